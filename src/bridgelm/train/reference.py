"""GRPO's reference model (beta > 0): a frozen copy of the policy at the start of RL, blocks included.

The copy is made from the policy after it is placed on the ranks (`prepare_model`), not before: a skeleton of the
policy is taken on the meta device first (no parameter allocated), sharded as the policy is, and then each rank copies
its own shards of the policy's parameters into it. So no rank ever holds two whole models (under FSDP a rank holds
the policy's shards and the reference's, P x b / W each); a deep copy before sharding held the fp32 policy twice
(62 GiB for an 8B model). Without FSDP every rank holds both whole models anyway.

The reference only runs no_grad forwards; FSDP2 leaves a root sharded with reshard_after_forward=False gathered
after its forward until a backward reshards it, which the reference never runs: `reshard` frees it after each pass.

Used by bridgelm.train.rl and bridgelm.train.update; tested by tests/test_train_distributed.py.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch

from bridgelm import lora
from bridgelm.dist import Dist, shard_model


def skeleton(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` whose parameters are on the meta device, in their own dtypes (tied ones stay tied); buffers
    and the rest copied. Taken before the policy is sharded or checkpointed (the copy keeps neither)."""
    memo = {id(p): torch.nn.Parameter(torch.empty_like(p, device="meta")) for p in model.parameters()}
    return copy.deepcopy(model, memo).requires_grad_(False)


def make_reference(skeleton: torch.nn.Module, model: torch.nn.Module, dist: Dist, bf16: bool) -> torch.nn.Module:
    """The reference: `skeleton` (of `model`, see `skeleton`) sharded as the prepared `model` is, given storage on the
    rank's device, and filled with this rank's part of `model`'s parameters and buffers (no collective). In eval
    mode, without gradients."""
    ref = skeleton
    if dist.fsdp:
        shard_model(ref, replace(dist), bf16)
    ref.to_empty(device=dist.device)
    if hasattr(ref, "tie_weights") and not dist.fsdp:
        ref.tie_weights()  # to_empty gives each module its own tensor
    with torch.no_grad():
        names = [n for n, _ in model.named_parameters()]
        assert [n for n, _ in ref.named_parameters()] == names, "the reference's parameters do not face the policy's"
        for dst, src in zip(ref.parameters(), model.parameters(), strict=True):
            dst.copy_(src)
        for dst, src in zip(ref.buffers(), model.buffers(), strict=True):
            dst.copy_(src)
    lora.disable(ref)  # with LoRA: the base without it (its update is 0 at the start anyway), the starting blocks
    return ref.requires_grad_(False).eval()


def reshard(model: torch.nn.Module | None) -> None:
    """Free the parameters FSDP2 keeps gathered after a forward (the root's) of a model that runs no backward."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.reshard()

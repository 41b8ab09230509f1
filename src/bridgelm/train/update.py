"""GRPO's update phase: K optimiser steps on the mini-batches of one rollout batch (paper Sec. 3.3, App. A).

1. Old log-probs (and reference log-probs when beta > 0) come from the training forward under no_grad, on the same
   micro-batches as the first pass of updates, so that the first ratio is exactly 1. The first mini-batch needs no
   such pass: before the first optimiser step the policy is the old one, so its own forward's detached log-probs
   are the old ones (kept for later epochs); the no_grad pass covers mini-batches 2..K only.
2. K optimiser steps on K mini-batches of whole Bridge groups (groups are the unit of shuffling and of
   micro-batching; micro-batches accumulate gradients; `micro_batch_tokens` sorts a mini-batch's groups by length
   and cuts micro-batches by padded tokens), with the loss of `bridgelm.grpo.policy_loss` normalised by the token
   count of the whole mini-batch over all ranks. Mini-batch shuffles derive from (seed, step, epoch).

Under FSDP every rank runs the same number of forwards and backwards (FSDP2's collectives are per forward and per
backward): micro-batches cut by `micro_batch_tokens` from each rank's lengths are split until the ranks agree
(`agreed_micro_batches`).

Work whose result is known is skipped (not under FSDP, whose ranks must run the same forwards). A group whose
advantages are all exactly 0 (with 0/1 rewards: a prompt whose G rewards are all equal) adds a policy term and a
gradient of 0 whatever its ratio, so it needs no old log-probs: the no_grad pass leaves out the micro-batches that
hold only such groups (the others keep the trained cut, so the ratio of an unchanged policy stays exactly 1), and
their trained forward makes their old log-probs as the first mini-batch's does. With beta = 0 such groups add
nothing to the loss or its gradient at all, so they get no forward or backward either (each mini-batch is cut into
micro-batches from its other groups; a mini-batch of such groups only gives the optimiser zero gradients, as the
full computation would).
Entropy is logged over the rows that had a forward, each once; a row first forwarded by a later mini-batch's training
(a micro-batch of zero-advantage groups, beta > 0) is measured after the earlier optimiser steps of its rollout
batch. The weights equal those of the full computation up to float rounding (tests/test_rl.py).

Log-probs are at the sampling temperature (logits / T), like the engine's.

Used by bridgelm.train.rl; tested by tests/test_rl.py and tests/test_train_distributed.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import torch

from bridgelm.dist import Dist, all_reduce_max, all_reduce_sum
from bridgelm.grpo import policy_loss
from bridgelm.logprobs import pack_rows, response_logprobs
from bridgelm.rng import generator
from bridgelm.train.batches import autocast, chunks, rows_tensor
from bridgelm.train.optim import optimizer_step
from bridgelm.train.reference import reshard
from bridgelm.train.rollouts import Rollouts

if TYPE_CHECKING:
    from bridgelm.train.rl_config import RLConfig


@dataclass
class Learner:
    """The policy being trained and what updates it."""

    model: torch.nn.Module
    ref_model: torch.nn.Module | None  # the frozen reference (beta > 0)
    params: list[torch.nn.Parameter]  # the trained parameters
    optimizer: torch.optim.Optimizer  # AdamW over `params`
    scheduler: torch.optim.lr_scheduler.LRScheduler  # stepped with the optimiser
    parts: dict  # the blocks' parameters by part, whose gradient norms are logged per step (optim.gradient_parts)


def micro_batches(rollouts: Rollouts, groups: list[int], cfg: RLConfig) -> list[list[int]]:
    """The micro-batches (lists of whole groups) of the mini-batch `groups`: `micro_batch_groups` groups each, in
    order; with `micro_batch_tokens`, groups sorted by their longest row and cut before the padded tokens of a
    micro-batch (rows x its longest row) would pass the budget, so that short rows are not padded to long ones."""
    if cfg.micro_batch_tokens is None:
        return chunks(groups, cfg.micro_batch_groups)
    out: list[list[int]] = [[]]
    for g in sorted(groups, key=lambda g: (group_length(rollouts, g), g)):  # ascending: g is the longest so far
        cur = out[-1]
        padded = (len(cur) + 1) * rollouts.width * group_length(rollouts, g)
        if cur and (len(cur) == cfg.micro_batch_groups or padded > cfg.micro_batch_tokens):
            out.append(cur := [])
        cur.append(g)
    return out


def group_length(rollouts: Rollouts, group: int) -> int:
    """The longest row (prompt + response tokens) of a group: what its rows are padded to."""
    return max(len(rollouts.rows[r].prompt) + len(rollouts.rows[r].response) for r in rollouts.group_rows([group]))


def agreed_micro_batches(rollouts: Rollouts, micro_of: list[list[list[int]]], dist: Dist) -> list[list[list[int]]]:
    """Under FSDP, each mini-batch's micro-batches (`micro_of`, this rank's cut) split until every rank runs as many.

    FSDP2 all-gathers a layer's parameters in each forward and reduce-scatters its gradients in each backward, so
    the ranks must run the same number of forwards and backwards; cut by `micro_batch_tokens` from each rank's own
    lengths, they would not (and would hang at the first unmatched collective). One all-reduce gives the largest
    count of each mini-batch; a rank with fewer splits its micro-batch of most padded tokens in two (in its sorted
    order) until it has as many. Every forward is real work, none padded with empty or zero-weight ones, and
    splitting only lowers a micro-batch's padded tokens, so the budget holds. A count is never more than a rank's
    groups in that mini-batch: every rank holds as many (the same share of the same plan, nothing skipped under
    FSDP). Without FSDP the cut is each rank's own: data parallel meets only once per mini-batch."""
    if not dist.fsdp:
        return micro_of
    counts = all_reduce_max([len(micro) for micro in micro_of], dist)
    return [_split_to(rollouts, micro, n) for micro, n in zip(micro_of, counts, strict=True)]


def _split_to(rollouts: Rollouts, micro: list[list[int]], n: int) -> list[list[int]]:
    """`micro` with its largest micro-batches (padded tokens) halved until there are `n`."""
    out = [list(m) for m in micro]

    def padded(i: int) -> int:
        return len(out[i]) * max(group_length(rollouts, g) for g in out[i]) if len(out[i]) > 1 else -1

    while len(out) < n:
        i = max(range(len(out)), key=padded)
        assert len(out[i]) >= 2, f"{sum(map(len, out))} groups cannot make the {n} micro-batches another rank runs"
        half = len(out[i]) // 2
        out[i : i + 1] = [out[i][:half], out[i][half:]]
    return out


def minibatch_plan(n_groups: int, cfg: RLConfig, step: int) -> list[list[int]]:
    """Group indices of each mini-batch: per epoch a shuffle of the groups cut into K near-equal parts."""
    K, plan = cfg.steps_per_rollout, []
    for epoch in range(cfg.epochs_per_rollout):
        perm = torch.randperm(n_groups, generator=generator(cfg.seed, "minibatches", step, epoch)).tolist()
        plan += [perm[i * n_groups // K : (i + 1) * n_groups // K] for i in range(K)]
    return plan


@dataclass
class MinibatchStats:
    """The sums of one mini-batch, or of an update's mini-batches (`add`)."""

    loss: float = 0.0  # the loss over all ranks
    tokens: float = 0.0  # response tokens over all ranks
    clipped: float = 0.0  # this rank's token sums (see grpo.PolicyStats)
    kl: float = 0.0
    entropy: float = 0.0
    entropy_tokens: float = 0.0  # this rank's response tokens whose entropy is in `entropy`

    def add(self, other: MinibatchStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass
class UpdateStats:
    """What one update (`update_policy`) gives the step's record."""

    sums: MinibatchStats  # over its mini-batches; entropy: each fresh micro-batch's, then the no_grad pass's
    grad_norm: float = 0.0  # summed over optimiser steps
    old_seconds: float = 0.0  # the no_grad passes: old log-probs ...
    ref_seconds: float = 0.0  # ... and the reference's
    parts: dict[str, float] = field(default_factory=dict)  # gradient norm by part (optim.gradient_parts), summed


@dataclass
class Minibatch:
    """This rank's share of one mini-batch, and the log-probs its loss compares against."""

    groups: list[int]  # its groups
    micro: list[list[int]] | None = None  # its cut into micro-batches, as the old log-probs were (None: micro_batches)
    old: dict[int, torch.Tensor] | None = None  # old log-probs by row (None: every micro-batch fresh)
    ref: dict[int, torch.Tensor] | None = None  # reference log-probs by row (beta > 0)


@torch.no_grad()
def rollout_logprobs(
    model,
    rollouts: Rollouts,
    micro: list[list[int]],
    cfg: RLConfig,
    pad_id: int,
    device: torch.device,
    with_entropy: bool = True,
):
    """Log-probs of `model` for each row ({row: [len]}) over the micro-batches `micro` (lists of groups), and the
    entropy summed over all response tokens (0.0 without `with_entropy`)."""
    logprobs: dict[int, torch.Tensor] = {}
    entropy = 0.0
    for groups in micro:
        rows = rollouts.group_rows(groups)
        batch = pack_rows([rollouts.rows[r] for r in rows], pad_id, device)
        with autocast(device, cfg.optim.bf16):
            lp, ent = response_logprobs(model, batch, cfg.rollout.temperature, with_entropy=with_entropy)
        if ent is not None:
            entropy += float(ent[batch.response_mask].sum())
        for b, r in enumerate(rows):
            logprobs[r] = lp[b, : len(rollouts.rows[r].response)]
    return logprobs, entropy


def minibatch_backward(
    model, rollouts: Rollouts, mb: Minibatch, cfg: RLConfig, pad_id: int, dist: Dist
) -> MinibatchStats:
    """Forward/backward of one mini-batch (this rank's `mb.groups`), micro-batch by micro-batch (`mb.micro`).

    A micro-batch whose rows are missing from `mb.old` (None: all rows) is fresh: it is trained before any optimiser
    step of this rollout batch, or its groups' advantages are all 0 (the no_grad pass left it out, see the module
    docstring). Its current log-probs, detached, serve as its old ones; they are added to `old` (when given) for
    later epochs, and its entropy is counted. The loss is normalised by the mini-batch's token count over all ranks;
    gradients accumulate in .grad.
    """
    old, ref = mb.old, mb.ref
    local = sum(len(rollouts.rows[r].response) for r in rollouts.group_rows(mb.groups))
    total = all_reduce_sum([local], dist)[0]
    out = MinibatchStats(loss=0.0, tokens=total)
    for part in mb.micro if mb.micro is not None else micro_batches(rollouts, mb.groups, cfg):
        rows = rollouts.group_rows(part)
        batch = pack_rows([rollouts.rows[r] for r in rows], pad_id, dist.device)
        mask = batch.response_mask  # [B, T]
        # The no_grad pass runs on whole trained micro-batches, and after the first pass every row is in `old`:
        # a micro-batch is fresh entirely or not at all.
        fresh = old is None or rows[0] not in old
        with autocast(dist.device, cfg.optim.bf16):
            lp, ent = response_logprobs(model, batch, cfg.rollout.temperature, with_entropy=fresh)
        if fresh:
            old_lp = lp.detach()  # [B, T]
            if old is not None:
                old.update({r: old_lp[b, : len(rollouts.rows[r].response)] for b, r in enumerate(rows)})
        else:
            old_lp = rows_tensor([old[r] for r in rows], mask)  # [B, T]
        ref_lp = None if ref is None else rows_tensor([ref[r] for r in rows], mask)  # [B, T]
        adv = rollouts.advantages[rows].to(lp.device)  # [B]
        loss, s = policy_loss(lp, old_lp, ref_lp, adv, mask, cfg.clip_eps, cfg.clip_eps_high, cfg.beta, total)
        loss.backward()
        out.loss += float(loss.detach())
        out.clipped += s.clipped
        out.kl += s.kl
        if ent is not None:  # a fresh micro-batch's (the others' is counted by the no_grad pass)
            out.entropy += float(ent[mask].sum())
            out.entropy_tokens += float(mask.sum())
    out.loss = all_reduce_sum([out.loss], dist)[0]
    return out


def update_policy(
    learner: Learner, rollouts: Rollouts, cfg: RLConfig, step: int, pad_id: int, dist: Dist
) -> UpdateStats:
    """K (x epochs) optimiser steps on this rollout batch; returns token-level sums and means for logging."""
    model, ref_model, params = learner.model, learner.ref_model, learner.params
    plan = minibatch_plan(rollouts.n_groups, cfg, step)
    flat = set() if dist.fsdp else rollouts.flat_groups()  # advantages all 0: no policy term (module docstring)
    skip = flat if cfg.beta == 0 else set()  # ... and, with beta = 0, no KL term either: nothing to compute
    # Each mini-batch's micro-batches, as trained (and as the no_grad pass runs them): cut from its groups but `skip`.
    micro_of = [[m for m in micro_batches(rollouts, [g for g in mb if g not in skip], cfg) if m] for mb in plan]
    micro_of = agreed_micro_batches(rollouts, micro_of, dist)  # under FSDP, as many on every rank
    model.train()
    old = ref = None
    entropy = entropy_tokens = 0.0
    t0 = time.perf_counter()
    if len(plan) > 1:  # later mini-batches need the old policy's log-probs; the first one makes its own
        later = [m for mbs in micro_of[1 : cfg.steps_per_rollout] for m in mbs if not flat.issuperset(m)]
        old, entropy = rollout_logprobs(model, rollouts, later, cfg, pad_id, dist.device)
        entropy_tokens = sum(v.numel() for v in old.values())  # the pass's entropy is over these
    t1 = time.perf_counter()
    if ref_model is not None:  # beta > 0: nothing skipped, every group once as the first pass trains it
        first_pass = [m for mbs in micro_of[: cfg.steps_per_rollout] for m in mbs]
        ref, _ = rollout_logprobs(ref_model, rollouts, first_pass, cfg, pad_id, dist.device, with_entropy=False)
        reshard(ref_model)  # its root, left gathered by its forwards (it runs no backward)
    t2 = time.perf_counter()
    out = UpdateStats(MinibatchStats(entropy_tokens=entropy_tokens), old_seconds=t1 - t0, ref_seconds=t2 - t1)
    for groups, micro in zip(plan, micro_of):
        out.sums.add(minibatch_backward(model, rollouts, Minibatch(groups, micro, old, ref), cfg, pad_id, dist))
        if not micro:
            # Every group skipped: the full computation's gradients are zeros, which AdamW's moments still act on.
            # (On several ranks reduce_gradients fills them in; so would it for a parameter no loss reaches.)
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        opt = learner.optimizer, learner.scheduler
        out.grad_norm += optimizer_step(params, *opt, cfg.optim.max_grad_norm, dist, learner.parts, out.parts)
    out.sums.entropy += entropy  # the no_grad pass's entropy, after the mini-batches' own
    return out

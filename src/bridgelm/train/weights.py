"""Model folders of a training run: weights written as `save_pretrained` writes them, and read back exactly.

A checkpoint (or RL's best/) is a model folder that `bridgelm.load_model` opens: safetensors weights, config and
tokenizer. Under FSDP the shards are gathered to rank 0 first (a collective), and rank 0 writes the folder under a
temporary name and renames it (`write_on_main`); the other ranks wait. A resumed run copies the weights back
into its model with `load_weights`, bit for bit.

Used by bridgelm.train.loop, bridgelm.train.rl and bridgelm.demo.base; tested by tests/test_train_common.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from bridgelm.dist import Dist, barrier, full_state_dict
from bridgelm.runs import write_dir_atomic


def write_on_main(
    final: str | os.PathLike, model: torch.nn.Module, dist: Dist, write: Callable[[Path, dict | None], None]
) -> None:
    """All ranks call: gather the weights (under FSDP), let rank 0 fill `final` atomically with `write(tmp,
    state_dict)` (state_dict None: the model's own), then wait for it."""
    state_dict = full_state_dict(model, dist)
    if dist.is_main:
        write_dir_atomic(final, lambda tmp: write(tmp, state_dict))
    barrier(dist)


def save_model(model: torch.nn.Module, tokenizer, folder: Path, state_dict: dict | None = None) -> None:
    """`save_pretrained` of the model (with `state_dict` when gathered) and of its tokenizer into `folder`."""
    with quiet_saves():
        model.save_pretrained(folder, state_dict=state_dict)
    tokenizer.save_pretrained(folder)


@contextmanager
def quiet_saves() -> Iterator[None]:
    """Silence transformers' per-save progress bars ("Writing model shards") inside the block."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def load_weights(model: torch.nn.Module, folder: str | os.PathLike) -> None:
    """Copy the safetensors weights of `folder` (a save_pretrained directory) into `model` (not sharded), exactly.

    Tensors absent from the files must be tied to loaded ones (e.g. a tied lm_head); anything else is an error.
    """
    from safetensors.torch import load_file

    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no .safetensors weights")
    loaded: dict[str, torch.Tensor] = {}
    for f in files:
        loaded.update(load_file(str(f)))
    own = model.state_dict()
    unexpected = sorted(set(loaded) - set(own))
    if unexpected:
        raise ValueError(f"{folder} holds weights the model lacks: {unexpected[:3]}")
    have = {own[k].data_ptr() for k in own if k in loaded}
    missing = [k for k in own if k not in loaded and own[k].data_ptr() not in have]
    if missing:
        raise ValueError(f"{folder} lacks weights of the model: {missing[:3]}")
    wrong = [k for k in loaded if loaded[k].shape != own[k].shape]
    if wrong:
        raise ValueError(
            f"{folder}: {wrong[0]} has shape {tuple(loaded[wrong[0]].shape)}, the model's is "
            f"{tuple(own[wrong[0]].shape)}"
        )
    with torch.no_grad():
        for name, t in own.items():
            if name in loaded:
                t.copy_(loaded[name])

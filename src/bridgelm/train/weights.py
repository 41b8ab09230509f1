"""Model folders of a training run: weights written as `save_pretrained` writes them, and read back exactly.

A checkpoint (or RL's best/) is a model folder that `bridgelm.load_model` opens: safetensors weights, config and
tokenizer; rank 0 writes it under a temporary name and renames it (`write_on_main`), the other ranks wait. Under
FSDP the weights are gathered to rank 0 for such a folder (a collective), which a run does once, for its last
checkpoint (and for RL's best/): every checkpoint holds instead each rank's own shards of model and optimiser
(`write_checkpoint`, torch.distributed.checkpoint), which each rank reads back alone (`load_checkpoint`). A resumed
run gets its weights back bit for bit either way.

Used by bridgelm.train.loop, bridgelm.train.rl and bridgelm.demo.base; tested by tests/test_train_common.py.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from bridgelm import lora
from bridgelm.attach import save_with_own_names
from bridgelm.blockfile import check_fits
from bridgelm.dist import Dist, barrier, full_state_dict, load_model_shards, save_shards
from bridgelm.errors import MissingFile, UserError
from bridgelm.train.checkpoints import SHARDS, check_layout, write_dir_atomic


def write_on_main(
    final: str | os.PathLike, model: torch.nn.Module, dist: Dist, write: Callable[[Path, dict | None], None]
) -> None:
    """All ranks call: gather the weights (under FSDP), let rank 0 fill `final` atomically with `write(tmp,
    state_dict)` (state_dict None: the model's own), then wait for it."""
    state_dict = full_state_dict(model, dist)
    if dist.is_main:
        write_dir_atomic(final, lambda tmp: write(tmp, state_dict))
    barrier(dist)


def write_checkpoint(
    final: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    dist: Dist,
    write: Callable[[Path, dict | None], None],
    gather: bool,
) -> None:
    """All ranks call. Without FSDP: `write_on_main`. Under FSDP each rank writes its shards of model and optimiser
    (into a folder beside `final`, moved to final/SHARDS by rank 0); `write(tmp, state_dict)` fills the rest on rank
    0, state_dict holding the weights gathered when `gather` (else None: write no weights)."""
    if not dist.fsdp:
        write_on_main(final, model, dist, write)
        return
    staging = final.with_name(f".{final.name}.{SHARDS}")  # the same name on every rank
    if dist.is_main and staging.exists():
        shutil.rmtree(staging)
    barrier(dist)
    save_shards(model, optimizer, staging)
    state_dict = full_state_dict(model, dist) if gather else None
    if dist.is_main:

        def fill(tmp: Path) -> None:
            os.replace(staging, tmp / SHARDS)
            write(tmp, state_dict)

        write_dir_atomic(final, fill)
    barrier(dist)


def load_checkpoint(model: torch.nn.Module, folder: Path, dist: Dist) -> None:
    """The weights of the checkpoint `folder` into `model`, prepared (placed, and sharded under FSDP): each rank
    reads its own shards under FSDP, else the whole weights; a checkpoint of the other layout is refused."""
    check_layout(folder, dist.fsdp)
    if lora.has_lora(model):  # the LoRA weights and the blocks; the frozen base is the run's --model
        lora.load_trained(model, folder)
    elif dist.fsdp:
        load_model_shards(model, folder / SHARDS)
    else:
        load_weights(model, folder)


def save_model(model: torch.nn.Module, tokenizer, folder: Path, state_dict: dict | None = None) -> None:
    """`save_pretrained` of the model (with `state_dict` when gathered) and of its tokenizer into `folder`; with LoRA,
    the LoRA merged into the base's weights and the adapter in folder/lora (bridgelm.lora.save_folder)."""
    with quiet_saves():
        if lora.has_lora(model):
            lora.save_folder(model, folder)
        else:
            save_with_own_names(model, folder, state_dict)
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
        raise MissingFile(f"{folder} holds no .safetensors weights")
    loaded: dict[str, torch.Tensor] = {}
    for f in files:
        loaded.update(load_file(str(f)))
    own = model.state_dict()
    have = {own[k].data_ptr() for k in own if k in loaded}  # a tensor absent from the files may be tied to one there
    needed = {k: tuple(t.shape) for k, t in own.items() if k in loaded or t.data_ptr() not in have}
    check_fits(str(folder), {k: tuple(t.shape) for k, t in loaded.items()}, needed)
    bad = next((k for k, t in loaded.items() if t.is_floating_point() and not torch.isfinite(t).all()), None)
    if bad is not None:
        raise UserError(f"{folder}: {bad} holds NaN or infinite values: expected the finite weights of a run that did "
                        "not diverge (no bridgelm run writes such a checkpoint: it was damaged or edited)")
    with torch.no_grad():
        for name, t in own.items():
            if name in loaded:
                t.copy_(loaded[name])

"""Plumbing shared by the SFT and RL trainers: seeds, distributed set-up, grouped batches, optimiser and schedule,
checkpoints, metrics, Ctrl-C.

Design notes:
- Randomness that a trainer needs per step comes from generators seeded with `derive_seed(seed, name, step, ...)`,
  so a resumed run draws exactly what an uninterrupted one would; the global RNG state is saved as well.
- Data parallel without wrappers: each rank runs its own groups, the loss is normalised by the GLOBAL token count
  (all-reduced), and gradients are summed with one all-reduce per optimiser step (`optimizer_step`). With
  `fsdp=True` each decoder layer (holding its Bridge block) and then the root are `fully_shard`-ed; FSDP sums the
  gradients itself (divide factor 1). Generation under FSDP runs on unsharded parameters (`unsharded`), because
  ranks decode different numbers of steps and must not meet in collectives there.
- A grouped batch (`TokenBatch`) holds prompt + response rows, right-padded; logits are computed only where the
  next token is a response token (`logits_to_keep` as a [B, S] mask), never on the prompt or the padding.
- Checkpoints are directories written under a temporary name and renamed; the last N are kept. Trainer state
  (optimiser, scheduler, RNG, step) is a torch file read back with `weights_only=True`; weights are safetensors.
  A resume first checks the files of the newest checkpoint (JSON, safetensors headers and sizes, the checksums
  of trainer_state.pt's zip); a damaged one is named and passed over for the previous whole one, which a resumed
  run continues from exactly.

Used by bridgelm.train.sft and bridgelm.train.rl; tested by tests/test_train_common.py.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from bridgelm.dist import (  # noqa: F401  (moved; re-exported until the callers import bridgelm.dist)
    Dist,
    all_reduce_sum,
    barrier,
    broadcast_parameters,
    full_state_dict,
    load_optimizer_state,
    optimizer_state,
    prepare_model,
    reduce_gradients,
    setup_distributed,
    shard_model,
    teardown_distributed,
    unsharded,
)
from bridgelm.jsonl import append_record, read_records, write_atomic, write_json
from bridgelm.rng import derive_seed, generator, rng_state, set_rng_state  # noqa: F401  (moved)
from bridgelm.runs import (  # noqa: F401  (moved; re-exported until the callers import bridgelm.runs)
    CHECKPOINTS,
    METRICS,
    TRAINER_INFO,
    TRAINER_STATE,
    check_settings,
    checkpoint_damage,
    checkpoint_name,
    jsonable,
    latest_checkpoint,
    list_checkpoints,
    load_trainer_state,
    prune_checkpoints,
    read_info,
    resume_point,
    save_trainer_state,
    write_dir_atomic,
)
from bridgelm.train.batches import (  # noqa: F401  (moved; re-exported until the callers import batches)
    LogProbs,
    Row,
    TokenBatch,
    autocast,
    chunks,
    forward_logits,
    pack_rows,
    response_logprobs,
    rows_tensor,
)

# ---------------------------------------------------------------------------------------------- rewards

# A response counts as correct when its reward reaches this value (rewards are correctness in [0, 1]).
CORRECT_REWARD = 1.0


def check_rewards(rewards: Sequence[float], where: str) -> list[float]:
    """Rewards as floats; a non-finite one is a ValueError naming `where` and the response."""
    out = []
    for i, r in enumerate(rewards):
        r = float(r)
        if not math.isfinite(r):
            raise ValueError(f"{where}: reward of response {i} is {r}; expected a finite number in [0, 1]")
        out.append(r)
    return out


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


# ---------------------------------------------------------------------------------------------- optimiser, schedule


@dataclass
class WarmupSchedule:
    """Learning-rate factor: linear warm-up to 1 over `warmup_steps`, then constant or linear decay to 0.

    factor(s) = (s + 1) / (warmup + 1) while s < warmup; then 1 ("constant") or (total - s) / (total - warmup)
    ("linear"). Step s is the s-th optimiser step (0-based). A plain object, so LambdaLR saves its fields.
    """

    total_steps: int  # optimiser steps of the whole run
    warmup_steps: int  # steps of linear warm-up
    decay: str = "constant"  # "constant" or "linear"

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.decay == "constant":
            return 1.0
        return max(0.0, (self.total_steps - step) / max(1, self.total_steps - self.warmup_steps))


def make_optimizer(
    params: Sequence[torch.nn.Parameter],
    lr: float,
    weight_decay: float = 0.0,
    betas=(0.9, 0.999),
    lr_of: dict[int, float] | None = None,
) -> torch.optim.AdamW:
    """AdamW over `params`; `lr_of` maps id(parameter) to its own learning rate (one param group per rate)."""
    params = list(params)
    if not params:
        raise ValueError("no trainable parameters: nothing to optimise")
    if not lr_of:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=tuple(betas))
    rates: dict[float, list] = {}
    for p in params:
        rates.setdefault(lr_of.get(id(p), lr), []).append(p)
    groups = [{"params": ps, "lr": rate} for rate, ps in rates.items()]
    return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, betas=tuple(betas))


def make_scheduler(optimizer, total_steps: int, warmup_fraction: float, decay: str):
    if decay not in ("constant", "linear"):
        raise ValueError(f"decay={decay!r}: expected 'constant' or 'linear'")
    if not 0.0 <= warmup_fraction < 1.0:
        raise ValueError(f"warmup_fraction={warmup_fraction} must be in [0, 1)")
    schedule = WarmupSchedule(total_steps, int(round(warmup_fraction * total_steps)), decay)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def gradient_parts(model: torch.nn.Module) -> dict[str, list[tuple[torch.nn.Parameter, slice | None]]]:
    """The parameters whose gradient norms the trainers log apart (a diagnostic of what the new blocks learn).

    Bridge's fused projection is split into its query, key and value rows; P-Match into up and down; the
    host model's trainable parameters form one part.
    """
    parts: dict[str, list] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if ".bridge.qkv_proj." in name:
            third = p.shape[0] // 3
            for i, part in enumerate(("bridge_q", "bridge_k", "bridge_v")):
                parts.setdefault(part, []).append((p, slice(i * third, (i + 1) * third)))
        elif ".bridge.o_proj." in name:
            parts.setdefault("bridge_o", []).append((p, None))
        elif ".pmatch.up_proj." in name:
            parts.setdefault("pmatch_up", []).append((p, None))
        elif ".pmatch.down_proj." in name:
            parts.setdefault("pmatch_down", []).append((p, None))
        elif ".bridge." in name or ".pmatch." in name:  # the blocks' input norms
            parts.setdefault("bridge_norm" if ".bridge." in name else "pmatch_norm", []).append((p, None))
        else:
            parts.setdefault("base", []).append((p, None))
    return parts


def part_grad_norms(parts: dict[str, list[tuple[torch.nn.Parameter, slice | None]]]) -> dict[str, float]:
    """L2 norm of the current gradients of each part (after the ranks' sum, before clipping)."""
    out = {}
    for name, entries in parts.items():
        squares = []  # one host sync per part, not per parameter
        for p, rows in entries:
            if p.grad is None:
                continue
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            g = g if rows is None else g[rows]
            squares.append(g.detach().float().pow(2).sum())
        out[name] = math.sqrt(float(torch.stack(squares).sum())) if squares else 0.0
    return out


def optimizer_step(
    params, optimizer, scheduler, max_grad_norm: float, dist: Dist, parts: dict | None = None, norms: dict | None = None
) -> float:
    """Sum gradients over ranks, clip, step, advance the schedule, zero the gradients; returns the gradient norm.

    A non-finite norm skips the update (the schedule still advances) and is returned as is. With `parts` (from
    `gradient_parts`), the norm of each part is added into the dict `norms` (summed over calls).
    """
    params = list(params)
    reduce_gradients(params, dist)
    if parts:
        for name, value in part_grad_norms(parts).items():
            norms[name] = norms.get(name, 0.0) + value
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else math.inf)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    norm = float(norm)
    if math.isfinite(norm):
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def check_same_config(where, saved: dict, current: dict) -> None:
    """Moved: bridgelm.runs.check_settings."""
    check_settings(where, saved, current)


check_fresh_or_resume = resume_point


# ---------------------------------------------------------------------------------------------- metrics, progress


class MetricsLog:
    """metrics.jsonl (one record per step, appended and fsynced) plus TensorBoard when asked and installed.

    Only the main process writes; every process keeps `records`, the history returned to callers.
    """

    def __init__(self, path: str | os.PathLike, enabled: bool = True, tensorboard: bool = False):
        self.path = Path(path)
        self.enabled = enabled
        self.records: list[dict] = read_records(self.path) if self.path.exists() else []
        self.writer = None
        if tensorboard and enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(self.path.parent / "tensorboard"))
            except ImportError:
                print("tensorboard is not installed: metrics go to metrics.jsonl only", file=sys.stderr)

    def keep_until(self, step: int) -> None:
        """Drop records after `step` (a resumed run recomputes them identically)."""
        kept = [r for r in self.records if r.get("step", 0) <= step]
        if len(kept) != len(self.records) and self.enabled:
            import json

            write_atomic(self.path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept))
        self.records = kept

    def log(self, record: dict) -> None:
        self.records.append(record)
        if not self.enabled:
            return
        append_record(self.path, record)
        if self.writer is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.writer.add_scalar(k, v, record.get("step", 0))
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class _NoBar:
    def update(self, n=1):
        pass

    def set_postfix(self, *a, **k):
        pass

    def close(self):
        pass


def progress_bar(total: int, initial: int = 0, desc: str = "", enabled: bool = True):
    """A tqdm bar (or a silent stand-in)."""
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)


# ---------------------------------------------------------------------------------------------- Ctrl-C


class DeferInterrupt:
    """Hold back Ctrl-C inside the block (a step's updates) and raise it as KeyboardInterrupt at the end.

    A second Ctrl-C raises at once. Only the main thread can install the handler; elsewhere this does nothing.
    """

    def __enter__(self):
        self.hit = False
        self.old = None
        if threading.current_thread() is threading.main_thread():
            self.old = signal.signal(signal.SIGINT, self._handler)
        return self

    def _handler(self, signum, frame):
        if self.hit:
            raise KeyboardInterrupt
        self.hit = True
        print("\ninterrupted: finishing this step, then saving a checkpoint (Ctrl-C again: stop now)", file=sys.stderr)

    def __exit__(self, exc_type, exc, tb):
        if self.old is not None:
            signal.signal(signal.SIGINT, self.old)
        if self.hit and exc_type is None:
            raise KeyboardInterrupt
        return False


__all__ = [
    "Dist",
    "LogProbs",
    "MetricsLog",
    "Row",
    "TokenBatch",
    "WarmupSchedule",
    "derive_seed",
    "generator",
    "rng_state",
    "set_rng_state",
    "setup_distributed",
    "prepare_model",
    "pack_rows",
    "forward_logits",
    "response_logprobs",
    "make_optimizer",
    "make_scheduler",
    "optimizer_step",
    "gradient_parts",
    "part_grad_norms",
    "write_dir_atomic",
    "list_checkpoints",
    "latest_checkpoint",
    "prune_checkpoints",
    "save_trainer_state",
    "load_trainer_state",
    "write_json",
]

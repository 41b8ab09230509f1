"""Optimiser, learning-rate schedules and the optimiser step every trainer takes.

- AdamW, with one param group per learning rate when the added blocks get their own (`make_optimizer`).
- Schedules are plain callables of the optimiser step (warm-up then constant or linear decay for SFT and RL; warm-up
  then cosine for the demo's pre-training) behind a LambdaLR, so that the scheduler's state is saved with a
  checkpoint and a resumed run takes exactly the same rates.
- `optimizer_step` sums gradients over ranks, logs the gradient norm of each part of the new blocks (a diagnostic of
  what they learn), clips, steps and zeroes. A non-finite gradient norm, or parameters that the step made non-finite
  (checked by one sum per step), raise `Diverged`: the run stops there and writes nothing of that step
  (bridgelm.train.loop.Run names the step and the last good checkpoint). `check_lr` refuses up front a rate whose
  step would overflow (above MAX_LR: AdamW moves each parameter by about lr a step).

Used by bridgelm.train.sft, bridgelm.train.rl and bridgelm.demo.base; tested by tests/test_train_common.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from bridgelm.dist import Dist, all_reduce_sum, reduce_gradients
from bridgelm.errors import UserError, check_number
from bridgelm.setting import setting

# The largest learning rate accepted: AdamW moves each parameter by about lr per step, so a larger rate only
# diverges, and one near the largest float makes its step overflow (inf x 0 = NaN weights).
MAX_LR = 1.0


def check_lr(name: str, value) -> None:
    """UserError naming `name` unless `value` is a finite learning rate in (0, MAX_LR]."""
    check_number(name, value, 0, open_low=True)
    if value > MAX_LR:
        raise UserError(
            f"{name}={value!r}: expected at most {MAX_LR} (AdamW moves each weight by about lr per step, so a larger "
            "rate only diverges)"
        )


class Diverged(UserError):
    """A non-finite loss, gradient norm or parameter: the run stops at `step` (None: the step in progress)."""

    def __init__(self, what: str, step: int | None = None):
        super().__init__(what)
        self.step = step

    def explain(self, kind: str, step: int, last) -> str:
        """The one line of a `kind` run stopped at `step` (unless known), `last` its last checkpoint (None: none)."""
        good = f"the last good checkpoint is {last}" if last else "no checkpoint was written"
        return (
            f"step {self.step or step} diverged ({self}); the {kind} run stopped, and nothing of that step was "
            f"written: {good}; expected finite weights: start again with a lower --lr"
        )


def parameters_finite(params: Sequence[torch.nn.Parameter], dist: Dist) -> bool:
    """Whether every parameter is finite: one sum over them (a NaN or an infinity makes it non-finite), summed over
    ranks under FSDP (each rank holds its own shards)."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    sums = [t.detach().sum(dtype=torch.float32) for t in local if t.numel()]
    total = float(torch.stack(sums).sum()) if sums else 0.0
    if dist.fsdp:
        total = all_reduce_sum([total], dist)[0]
    return math.isfinite(total)


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


@dataclass
class CosineSchedule:
    """Learning-rate factor of the demo's pre-training: linear warm-up to 1, then a cosine down to `floor`.

    factor(s) = (s + 1) / warmup while s < warmup; then floor + (1 - floor) / 2 * (1 + cos(pi t)), with t going from
    0 at the end of the warm-up to 1 at `total_steps`. A plain object, so LambdaLR saves its fields.
    """

    total_steps: int  # optimiser steps over which the cosine falls (the horizon)
    warmup_steps: int  # steps of linear warm-up (at least 1)
    floor: float = 0.1  # the factor at the end of the horizon

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        t = (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)
        return self.floor + (1 - self.floor) / 2 * (1 + math.cos(math.pi * t))


@dataclass
class OptimConfig:
    """The optimiser settings SFT and RL share (SFTConfig.optim, RLConfig.optim): AdamW, its warm-up, clipping, and
    the precision and memory of the forwards it learns from. Each trainer gives its own default rate."""

    lr: float = setting(1e-6, "peak learning rate of AdamW")
    warmup_fraction: float = setting(0.1, "share of the optimiser steps spent warming the lr up linearly")
    weight_decay: float = setting(0.0, "AdamW weight decay")
    max_grad_norm: float = setting(1.0, "gradient clipping (<= 0: off)")
    bf16: bool = setting(False, "bf16 autocast of forwards")
    gradient_checkpointing: bool = setting(False, "recompute layer activations in the backward")

    def validate(self) -> None:
        check_lr("lr", self.lr)
        check_number("warmup_fraction", self.warmup_fraction, 0, 1, open_high=True)
        check_number("weight_decay", self.weight_decay, 0)
        check_number("max_grad_norm", self.max_grad_norm, note=" (<= 0: no clipping)")


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
        raise UserError("no trainable parameters: nothing to optimise")
    if not lr_of:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=tuple(betas))
    rates: dict[float, list] = {}
    for p in params:
        rates.setdefault(lr_of.get(id(p), lr), []).append(p)
    groups = [{"params": ps, "lr": rate} for rate, ps in rates.items()]
    return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, betas=tuple(betas))


def make_scheduler(optimizer, total_steps: int, warmup_fraction: float, decay: str):
    """The SFT and RL schedule: `WarmupSchedule` over `total_steps`, warming up for `warmup_fraction` of them (checked
    by OptimConfig.validate)."""
    assert decay in ("constant", "linear"), f"decay={decay!r}: expected 'constant' or 'linear'"  # each trainer's own
    return scheduled(optimizer, WarmupSchedule(total_steps, int(round(warmup_fraction * total_steps)), decay))


def scheduled(optimizer, schedule) -> torch.optim.lr_scheduler.LambdaLR:
    """A scheduler that sets each param group's rate to its base rate x `schedule(optimizer step)`."""
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

    A non-finite norm, or parameters the step made non-finite, raise `Diverged` (the run stops). With `parts` (from
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
    if not math.isfinite(norm):
        raise Diverged(f"the gradient norm is {norm}")
    optimizer.step()
    if not parameters_finite(params, dist):
        lrs = sorted({group["lr"] for group in optimizer.param_groups})
        raise Diverged(f"the update at lr {', '.join(f'{lr:g}' for lr in lrs)} made the weights non-finite")
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return norm

"""Whether a plan fits one GPU: the plan's table with its verdict, the refusal with its numbers, and the batch bounds
that fill a rank's rollout waves (`bridgelm plan` recommends them). The rows themselves are `bridgelm.plan`'s."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from bridgelm.errors import UserError
from bridgelm.plan import GIB, PHASES, Setup, SFTSetup, per_gpu, phases, plan_rows


def table(setup: Setup | SFTSetup, rows: dict[str, float], budget_gib: float | None) -> str:
    """The plan as a markdown table in GiB: the rows, each phase, and the peak with the verdict against
    `budget_gib`."""
    lines = ["| per GPU | GiB |", "|---|---|"]
    lines += [f"| {name} | {value / GIB:.2f} |" for name, value in rows.items()]
    lines += [f"| *{name}* phase | {value / GIB:.2f} |" for name, value in phases(rows).items()]
    total = per_gpu(rows) / GIB
    verdict = "" if budget_gib is None else f" of {budget_gib:g} ({'fits' if total <= budget_gib else 'does not fit'})"
    lines.append(f"| **peak** (the largest phase) | **{total:.2f}**{verdict} |")
    return setup.head() + "\n" + "\n".join(lines)


@dataclass
class Waves:
    """Batch bounds under which each rank decodes its rollouts in `waves` waves of `rows` rows (whole prompts)."""

    waves: int  # waves a rank decodes a step (1: its whole rollout batch at once)
    rows: int  # rows of each (the last may hold fewer prompts)
    setup: Setup  # the run with these bounds (max_batch_sequences >= rows, max_batch_tokens = rows x L)

    @property
    def peak_gib(self) -> float:
        return per_gpu(self.setup.rows()) / GIB


def filled_waves(setup: Setup, budget_gib: float) -> Waves | None:
    """The batch bounds that fill a rank's waves: one wave of all its rollouts when that fits `budget_gib`, else the
    fewest waves of as many whole prompts each that fit (no tail wave of a few rows decoding alone). Rollouts are
    sampled from a bf16 copy unless the run names another (rollout_dtype). None: not even a wave of one prompt fits."""
    cfg = setup.cfg
    cfg = replace(cfg, rollout_dtype=cfg.rollout_dtype or ("bfloat16" if cfg.replica_dtype() is None else None))
    prompts = cfg.prompts_per_step // setup.world
    tried = set()
    for waves in range(1, prompts + 1):
        rows = -(-prompts // waves) * cfg.rollout.n  # ceil: whole prompts a wave
        if rows in tried:
            continue
        tried.add(rows)
        bounds = {"max_batch_sequences": max(rows, cfg.rollout.max_batch_sequences) if waves == 1 else rows,
                  "max_batch_tokens": rows * setup.row_tokens}  # fmt: skip
        candidate = replace(setup, cfg=replace(cfg, rollout=replace(cfg.rollout, **bounds)))
        found = Waves(-(-prompts // (rows // cfg.rollout.n)), rows, candidate)
        if found.peak_gib <= budget_gib:
            return found
    return None


def device_memory_gib(device: str | torch.device = "cuda:0") -> float | None:
    """A CUDA device's memory (None for another device, or without CUDA)."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.device(device)).total_memory / GIB


def check_fits(setup: Setup | SFTSetup, budget_gib: float) -> str:
    """The plan's table; UserError, with the numbers, when the run's peak passes `budget_gib` (one GPU's memory)."""
    rows = plan_rows(setup)
    need = per_gpu(rows) / GIB
    if need > budget_gib:
        phase = max(phases(rows).items(), key=lambda kv: kv[1])[0]
        held = ("weights", "optimiser", "reference", "rollout replica")
        names = ("start-up",) if phase == "startup" else [n for n in rows if n in held or n in PHASES[phase]]
        parts = ", ".join(f"{name} {rows[name] / GIB:.1f}" for name in names)
        raise UserError(
            f"this run needs about {need:.1f} GiB per GPU ({phase} phase: {parts}; overhead "
            f"{rows['overhead'] / GIB:.1f}), more than the {budget_gib:.1f} GiB a GPU has: {setup.advice} "
            "(see bridgelm plan)"
        )
    return table(setup, rows, budget_gib)

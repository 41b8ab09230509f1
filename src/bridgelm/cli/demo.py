"""bridgelm demo: the paper's pipeline in miniature, offline (pre-train, warm up, RL, evaluate, report)."""

from __future__ import annotations

import argparse
from dataclasses import fields, replace

from bridgelm.cli.fields import Flag, add_fields, build
from bridgelm.demo.arms import ARMS, PAPER_ARMS, check_arms
from bridgelm.demo.config import DemoConfig
from bridgelm.demo.misalign import check_preambles
from bridgelm.errors import UserError
from bridgelm.jsonl import check_out
from bridgelm.setting import help_of

# The sizes a user may set; every other one is the preset's (DemoConfig(), or DemoConfig.quick() with --quick).
SETTABLE = ("seeds", "sft_per_seed", "bf16", "arms", "primary", "recipe_control", "misalignment", "threads", "workers")
MAX_THREADS = 4096  # torch.set_num_threads overflows a C int far above any machine's core count


def comparisons(cfg: DemoConfig) -> list[str]:
    """The paired differences the report of `cfg`'s arms can name (demo/results.py: `controls`, `extra_arms`)."""
    names = ["bridge-rlvr", "bridge-pmatch", f"w{cfg.eval.sampling.width}-w1", "foreign-w1", "sets-all bridge-rlvr",
             "sets-any bridge-rlvr"]
    for arm in (a for a in cfg.arms if a not in PAPER_ARMS):
        names += [f"{arm}-{'bridge' if ARMS[arm].bridge else 'pmatch'}", f"{arm}-rlvr"]
    if {"bridge_tuned", "pmatch_tuned"} <= set(cfg.arms):
        names.append("bridge_tuned-pmatch_tuned")
    return names


def check_primary(cfg: DemoConfig) -> None:
    """--primary names one of the differences the run's arms make, before the run (the report reads it at the end)."""
    names = comparisons(cfg)
    if cfg.primary not in names:
        extra = next((a for a in ARMS if cfg.primary.startswith(f"{a}-") and a not in cfg.arms), None)
        hint = f" (--arms {extra} runs that arm)" if extra and extra not in PAPER_ARMS else ""
        raise UserError(f"--primary {cfg.primary!r}: expected one of the comparisons of these arms: "
                         f"{', '.join(names)}{hint}")


def _cmd_demo(args) -> None:
    from bridgelm.demo.pipeline import run_demo

    cfg = build(DemoConfig, args, base=DemoConfig.quick() if args.quick else DemoConfig())
    cfg = replace(cfg, arms=[a for entry in cfg.arms for a in entry.split(",") if a])  # --arms a,b or --arms a --arms b
    check_arms(cfg.arms)
    check_preambles(cfg.misalignment)
    repeated = sorted({p for p in cfg.misalignment if cfg.misalignment.count(p) > 1})
    if repeated:
        raise UserError(f"--misalignment names the preamble {repeated[0]} more than once: expected distinct preambles")
    check_primary(cfg)
    if cfg.seeds is not None and cfg.seeds < 1:
        raise UserError(f"--seeds {cfg.seeds} must be >= 1")
    if cfg.workers < 1:
        raise UserError(f"--workers {cfg.workers} must be >= 1")
    if not 0 <= cfg.threads <= MAX_THREADS:
        raise UserError(f"--threads {cfg.threads} must be in [0, {MAX_THREADS}] (0: torch's default)")
    out = args.out or ("runs/demo-quick" if args.quick else "runs/demo")
    check_out(out, "dir")
    print(f"bridgelm demo: every stage writes under {out} (a finished stage is skipped on a re-run)")
    report = run_demo(out, cfg, quick=args.quick)
    print(f"bridgelm demo: report at {report} (numbers in {report.parent / 'results.json'})")


def add_commands(sub) -> None:
    p = sub.add_parser("demo", help="the paper's pipeline in miniature on a CPU, offline; writes a report")
    p.add_argument("--out", help="output folder (default runs/demo, or runs/demo-quick with --quick)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="toy sizes (~20 s on 2 quiet CPU cores): proves the pipeline, numbers mean nothing",
    )
    full, quick, helps = DemoConfig(), DemoConfig.quick(), {f.name: help_of(f) for f in fields(DemoConfig)}
    preset = {
        name: Flag(
            default=argparse.SUPPRESS,  # not given: the preset's
            help=f"{helps[name]} (default {getattr(full, name)}; {getattr(quick, name)} with --quick)",
        )
        for name in SETTABLE
    }
    preset["bf16"] = Flag(
        default=argparse.SUPPRESS,
        help="bf16 forwards (autocast in training, bf16 weights in sampling), or fp32 with --no-bf16 (default: as the "
        "folder's earlier stages, else bf16 where this machine's bf16 matmul, measured at the start, is at least 1.2x "
        "as fast as fp32)",
    )
    preset["arms"] = Flag(
        default=argparse.SUPPRESS,
        help=f"RL arms beside RLVR only, P-Match and Bridge, comma-separated: {', '.join(list(ARMS)[3:])} "
        "(demo/arms.py; a re-run may add arms to a folder)",
    )
    add_fields(p, DemoConfig, only=SETTABLE, **preset)
    p.set_defaults(func=_cmd_demo)

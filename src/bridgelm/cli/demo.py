"""bridgelm demo: the paper's pipeline in miniature, offline (pre-train, warm up, RL, evaluate, report)."""

from __future__ import annotations

import argparse
from dataclasses import fields, replace

from bridgelm.cli.fields import Flag, add_fields, build
from bridgelm.demo.arms import ARMS
from bridgelm.demo.config import DemoConfig
from bridgelm.setting import help_of

# The sizes a user may set; every other one is the preset's (DemoConfig(), or DemoConfig.quick() with --quick).
SETTABLE = ("seeds", "sft_per_seed", "bf16", "arms", "primary", "recipe_control", "misalignment", "threads", "workers")


def _cmd_demo(args) -> None:
    from bridgelm.demo.pipeline import run_demo

    cfg = build(DemoConfig, args, base=DemoConfig.quick() if args.quick else DemoConfig())
    cfg = replace(cfg, arms=[a for entry in cfg.arms for a in entry.split(",") if a])  # --arms a,b or --arms a --arms b
    run_demo(args.out or ("runs/demo-quick" if args.quick else "runs/demo"), cfg, quick=args.quick)


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

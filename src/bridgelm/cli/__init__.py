"""Command line: argument parsing only; every command builds configs and calls the library.

Each module of this package adds the commands of one family with `add_commands(subparsers)`.

    bridgelm params --preset ds-qwen-7b
    bridgelm generate --model DIR --prompt "1+2=" --n 8 --width 4 --out samples.jsonl
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# Modules whose add_commands(sub) registers subcommands, in --help order.
FAMILIES = ["params", "generate", "evaluate", "train", "demo"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bridgelm", description="Bridge: interdependent parallel generations")
    sub = parser.add_subparsers(dest="command", required=True)
    for family in FAMILIES:
        importlib.import_module(f"bridgelm.cli.{family}").add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"bridgelm {args.command}: error: {err}", file=sys.stderr)
        sys.exit(2)

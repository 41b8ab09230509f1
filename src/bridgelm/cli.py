"""Command line: argument parsing only; every command builds configs and calls the library.

    bridgelm params --preset ds-qwen-7b
    bridgelm generate --model DIR --prompt "1+2=" --n 8 --width 4 --out samples.jsonl
"""

from __future__ import annotations

import argparse
import os
import sys


def _cmd_params(args) -> None:
    from bridgelm.params import PRESETS, count, meta_model, table

    names = args.preset or ([] if args.model else list(PRESETS))
    rows = [count(meta_model(preset=p), p, args.kind, args.heads) for p in names]
    rows += [count(meta_model(model_dir=m), m, args.kind, args.heads) for m in args.model or []]
    print(table(rows, args.kind))


def _add_params(sub) -> None:
    p = sub.add_parser("params", help="parameter counts by part (paper Appendix B), built on the meta device")
    p.add_argument("--preset", action="append", help="ds-qwen-1.5b | ds-qwen-7b | ds-llama-8b (repeatable)")
    p.add_argument("--model", action="append", help="a model directory or hub id (only its config is read)")
    p.add_argument("--kind", default="bridge", choices=["bridge", "pmatch"])
    p.add_argument("--heads", type=int, default=4)
    p.set_defaults(func=_cmd_params)


COMMANDS = [_add_params]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bridgelm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"bridgelm {args.command}: error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()

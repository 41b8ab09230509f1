"""Arguments shared by several commands (the model, counts, stop strings, threads) and the checks of their values."""

from __future__ import annotations

import argparse

from bridgelm.errors import UserError
from bridgelm.hardware import MAX_THREADS


def positive_int(text: str) -> int:
    """argparse type of counts that must be at least 1 (checked as the flags are read, before any model loads)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def stop_string(text: str) -> str:
    """argparse type of --stop: non-empty text, checked by the engine's own check (so the API refuses the same)."""
    from bridgelm.engine.text import check_stop_strings

    try:
        check_stop_strings([text])
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err
    return text




def thread_count(text: str) -> int:
    """argparse type of --threads: 0 (the default: `hardware.default_threads`) to MAX_THREADS."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_THREADS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a thread count in [0, {MAX_THREADS}] (0: the idle cores)")
    return value


def add_threads_arg(p) -> None:
    p.add_argument(
        "--threads",
        type=thread_count,
        default=0,
        help="torch threads (default 0: OMP_NUM_THREADS where set, else the cores other processes leave idle)",
    )


def add_num_samples(p, dest: str) -> None:
    """--num-samples, the same as the command's --n: under torchrun, whose own parser takes --n for an abbreviation
    of its options (--nnodes, --nproc-per-node), only this one reaches the command."""
    p.add_argument("--num-samples", dest=dest, metavar="N", type=int, default=argparse.SUPPRESS,
                   help="same as --n (torchrun takes --n for its own options)")


def add_model_args(p) -> None:
    p.add_argument("--model", required=True, help="model directory or hub id")
    p.add_argument("--blocks", help="a block file (save_blocks / bridgelm sft), an adapter folder or its hub id")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    add_threads_arg(p)


def model_source(args: argparse.Namespace):
    """The bridgelm.source.ModelSource of --model, --blocks, --dtype, --device and --threads."""
    from bridgelm.source import ModelSource

    return ModelSource(args.model, getattr(args, "blocks", None), args.dtype, args.device, getattr(args, "threads", 0))


def block_heads(args: argparse.Namespace) -> int:
    """--num-heads of the blocks --add adds (not given: BlockConfig's); given without --add, nothing would read it, so
    it is refused (rl, plan)."""
    from bridgelm.blocks import BlockConfig

    if args.num_heads is not None and not args.add:
        raise UserError(
            f"--num-heads {args.num_heads} is read only with --add (the heads of the blocks it adds): expected --add "
            "bridge or --add pmatch, or no --num-heads"
        )
    return BlockConfig.num_heads if args.num_heads is None else args.num_heads

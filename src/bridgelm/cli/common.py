"""Arguments shared by several commands (the model to load, prompts, outputs) and the checks of their values."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from bridgelm.errors import UserError


def read_prompts(path: str) -> list[str]:
    from bridgelm.jsonl import read_records

    if not Path(path).exists():
        raise UserError(
            f"--prompts {path} does not exist: expected a JSONL file, one object with a 'prompt' field per line"
        )
    rows = read_records(path, repair=False, allow_cut=False)  # written by hand: a cut last line is an error
    if not rows:
        raise UserError(f"{path} holds no prompts: expected one JSON object per line with a 'prompt' field")
    prompts = []
    for number, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise UserError(f"{path}, line {number}: a JSON {type(row).__name__}: expected an object with a 'prompt'")
        text = row.get("prompt")
        if not isinstance(text, str) or not text:
            why = "missing" if "prompt" not in row else f"{text!r}"
            raise UserError(f"{path}, line {number}: field 'prompt' is {why}: expected non-empty text")
        prompts.append(text)
    return prompts


def dtype_of(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_tokenizer(name: str):
    """The tokenizer of --model; one that cannot be loaded (missing, damaged files) is a UserError."""
    from bridgelm.tokenizer import load_tokenizer as load

    try:
        return load(name)
    except UserError:
        raise
    except Exception as err:  # transformers and tokenizers raise many types for missing or damaged files
        first = str(err).splitlines()[0] if str(err) else ""
        raise UserError(
            f"--model {name}: no tokenizer could be loaded from it ({type(err).__name__}: {first})"
        ) from err


def load_model_and_tokenizer(args):
    """Model (with --blocks) and tokenizer from --model, on --device in --dtype."""
    from bridgelm.tokenizer import check_vocab

    model, tokenizer = load_model_of(args, args.blocks), load_tokenizer(args.model)
    check_vocab(model, tokenizer, args.model)
    return model, tokenizer


def load_model_of(args, blocks: str | None):
    """The model of --model with the block file `blocks` (None: none), in --dtype, on this rank's device
    (`dist.rank_device`: under torchrun --device cuda is the rank's own GPU, cuda:LOCAL_RANK, from the first tensor);
    a --dtype bfloat16 that this CPU runs slowly is warned first."""
    from bridgelm.dist import rank_device
    from bridgelm.models import load_model

    if str(args.device).split(":")[0] == "meta":  # load_model takes it (shapes only); these commands compute
        raise UserError(
            f"--device {args.device}: the meta device holds no values to compute with; expected cpu or cuda"
        )
    warn_slow_bf16(args.dtype == "bfloat16", args.device)
    set_threads(getattr(args, "threads", 0))
    device = rank_device(args.device)
    return load_model(args.model, blocks=blocks, dtype=dtype_of(args.dtype), device=device)


def width_is_moot(model) -> str | None:
    """Why the generation width cannot change `model`'s samples (None: it has Bridge blocks, so it can)."""
    from bridgelm.attach import block_config

    kind = getattr(block_config(model), "kind", None)
    if kind == "bridge":
        return None
    return "its P-Match blocks read one sample each" if kind else "it has no Bridge blocks"


def warn_slow_bf16(asked: bool, device, flag: str = "--dtype bfloat16") -> None:
    """A DataWarning when `flag` asks for bf16 (`asked`) on a CPU whose oneDNN has no bf16 (AVX2 only, no AVX-512),
    where it runs some 100x slower than float32 (measured on an AMD EPYC: 0.9-2.9 against 53-176 GFLOP/s)."""
    import warnings

    import torch

    from bridgelm import packed
    from bridgelm.errors import DataWarning

    if asked and torch.device(device).type == "cpu" and not packed.half_instructions(torch.bfloat16):
        warnings.warn(
            f"{flag} on this CPU, which has no bf16 matmul instructions (AVX2 only): it runs far slower than float32 "
            "here (about 100x)",
            DataWarning,
            stacklevel=2,
        )


def check_out(path: str, kind: str, flag: str = "--out") -> None:
    """UserError, before any work, for an output path that cannot be written: a folder where a file is expected
    ("file") or a file where a folder is expected ("dir"), or a place without write permission. Creates nothing."""
    p = Path(path).expanduser()
    if kind == "file" and p.is_dir():
        raise UserError(f"{flag} {path} is a folder: expected a file name")
    if kind == "dir" and p.exists() and not p.is_dir():
        raise UserError(f"{flag} {path} is a file: expected a folder (created when missing)")
    if p.exists():
        if not os.access(p, os.W_OK | (os.X_OK if p.is_dir() else 0)):
            raise UserError(
                f"{flag} {path} is not writable: expected a {'folder' if kind == 'dir' else 'file'} you may write"
            )
        return
    parent = next(q for q in p.absolute().parents if q.exists())
    if not parent.is_dir():
        raise UserError(f"{flag} {path}: {parent} is a file, so nothing can be created under it")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path}: folder {parent} is not writable, so {path} cannot be created there")


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


MAX_THREADS = 4096  # torch.set_num_threads overflows a C int far above any machine's core count


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


def set_threads(threads: int) -> None:
    """torch's threads for a command: `threads`, or 0 for `hardware.default_threads` (no oversubscription of a
    loaded machine: there a step took 10x longer with 2 threads on 2 busy cores than with 1)."""
    import torch

    from bridgelm.hardware import default_threads

    threads = threads or default_threads()[0]
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)


def add_model_args(p) -> None:
    p.add_argument("--model", required=True, help="model directory or hub id")
    p.add_argument("--blocks", help="a block file (save_blocks / bridgelm sft), an adapter folder or its hub id")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    add_threads_arg(p)


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

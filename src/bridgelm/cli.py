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


def _read_prompts(path: str) -> list[str]:
    from bridgelm.jsonl import read_records

    rows = read_records(path, repair=False)
    if not rows:
        raise ValueError(f"{path} holds no prompts: expected one JSON object per line with a 'prompt' field")
    prompts = []
    for number, row in enumerate(rows, start=1):
        text = row.get("prompt") if isinstance(row, dict) else None
        if not isinstance(text, str) or not text:
            raise ValueError(f"{path}, line {number}: missing or empty field 'prompt'")
        prompts.append(text)
    return prompts


def _dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_model_and_tokenizer(args):
    """Model (with --blocks) and tokenizer from --model, on --device in --dtype."""
    from transformers import AutoTokenizer

    from bridgelm.attach import load_model

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = load_model(args.model, blocks=args.blocks, dtype=_dtype(args.dtype), device=args.device)
    return model, tokenizer


def _add_model_args(p) -> None:
    p.add_argument("--model", required=True, help="model directory or hub id")
    p.add_argument("--blocks", help="a block file written by save_blocks / bridgelm sft")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")


def _add_sampling_args(p, n=8, width=1, max_new_tokens=256) -> None:
    p.add_argument("--n", type=int, default=n, help="samples per prompt")
    p.add_argument("--width", type=int, default=width, help="Bridge group width (divides --n); 1 = independent")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    p.add_argument("--temperature", type=float, default=0.6, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-batch-sequences", type=int, default=256)
    p.add_argument("--max-batch-tokens", type=int, default=262_144)
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_config(args):
    from bridgelm.sampling import SamplingConfig

    cfg = SamplingConfig(
        n=args.n,
        width=args.width,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_batch_sequences=args.max_batch_sequences,
        max_batch_tokens=args.max_batch_tokens,
    )
    cfg.validate()
    return cfg


def _cmd_generate(args) -> None:
    from bridgelm.samples import run_settings, sample_to_file

    cfg = sampling_config(args)
    if (args.prompts is None) == (args.prompt is None):
        raise ValueError("give exactly one of --prompts FILE.jsonl or --prompt TEXT")
    prompts = _read_prompts(args.prompts) if args.prompts else [args.prompt]
    model, tokenizer = load_model_and_tokenizer(args)
    settings = run_settings(cfg, args.model, args.blocks, args.chat, stop=args.stop)
    print(f"bridgelm generate: {len(prompts)} prompts x {cfg.n} samples (width {cfg.width}) -> {args.out}")
    made = sample_to_file(model, tokenizer, prompts, args.out, cfg, settings, args.chat, args.stop)
    print(f"bridgelm generate: sampled {made} prompts now, {len(prompts) - made} were already in {args.out}")


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="sample n interdependent responses per prompt into a JSONL file")
    _add_model_args(p)
    p.add_argument("--prompts", help="JSONL file, one object with a 'prompt' field per line")
    p.add_argument("--prompt", help="a single prompt")
    _add_sampling_args(p)
    p.add_argument("--out", required=True, help="output JSONL (one line per prompt; re-runs resume)")
    p.set_defaults(func=_cmd_generate)


COMMANDS = [_add_params, _add_generate]


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

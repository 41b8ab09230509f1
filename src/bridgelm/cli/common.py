"""Arguments shared by several commands: the model to load and how to sample."""

from __future__ import annotations


def read_prompts(path: str) -> list[str]:
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


def dtype_of(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_model_and_tokenizer(args):
    """Model (with --blocks) and tokenizer from --model, on --device in --dtype."""
    from transformers import AutoTokenizer

    from bridgelm.attach import load_model

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = load_model(args.model, blocks=args.blocks, dtype=dtype_of(args.dtype), device=args.device)
    return model, tokenizer


def add_model_args(p) -> None:
    p.add_argument("--model", required=True, help="model directory or hub id")
    p.add_argument("--blocks", help="a block file written by save_blocks / bridgelm sft")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")


def add_sampling_args(p, n=8, width=1, max_new_tokens=256) -> None:
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

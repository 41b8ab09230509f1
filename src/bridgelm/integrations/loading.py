"""What the evaluator integrations (`lm_eval`, `lighteval`) share: loading a Bridge model from their model
arguments, scoring one continuation, and cutting a sample at its stop sequence. It imports neither library, so
each integration needs only its own."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

import bridgelm
from bridgelm.errors import DataWarning, UserError
from bridgelm.models import load_model
from bridgelm.tokenizer import load_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def positive_int(owner: str, name: str, value) -> int:
    """`value` as an integer >= 1, or a UserError that names it (`owner`: who asks, e.g. "bridgelm backend")."""
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1:
        raise UserError(f"{owner}: {name}={value!r}: expected a positive integer")
    return number


def load_bridge_model(owner: str, pretrained: str, blocks: str | None, width: int, dtype: str, device: str):
    """(model in eval mode, tokenizer, device) for sampling in Bridge groups of `width`: refused before loading
    when dtype is unknown, and after when width > 1 but the model has no Bridge blocks. A CUDA device without a
    GPU falls back to the CPU with a warning (as lm-eval's hf backend does)."""
    if dtype not in DTYPES:
        raise UserError(f"{owner}: dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        warnings.warn(f"{owner}: device {device} asked for, but there is no CUDA GPU: running on the CPU",
                      DataWarning, stacklevel=3)
        device = "cpu"
    model = load_model(pretrained, blocks=blocks or None, dtype=DTYPES[dtype], device=device).eval()
    if width > 1 and bridgelm.block_config(model) is None:
        raise UserError(
            f"{owner}: width={width} needs a model with Bridge blocks, and {pretrained} has none: "
            "give blocks=FILE, or width=1"
        )
    return model, load_tokenizer(pretrained), torch.device(device)


@torch.no_grad()
def continuation_logprob(model, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    """log p(continuation | context) under `model` alone (a group of one), and whether every continuation token is
    the greedy one. The pair is tokenized whole and cut where the context's tokens end, when they are a prefix."""
    ctx = tokenizer(context, add_special_tokens=False)["input_ids"] if context else []
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    cont = whole[len(ctx):] if whole[: len(ctx)] == ctx else tokenizer(continuation, add_special_tokens=False)[
        "input_ids"]
    ctx = whole[: len(whole) - len(cont)] or [tokenizer.eos_token_id]
    ids = torch.tensor([ctx + cont], device=model.device)  # [1, S]
    logprobs = torch.log_softmax(model(ids).logits[0, len(ctx) - 1 : -1].float(), dim=-1)  # [C, V]
    target = ids[0, len(ctx):]  # [C]
    picked = logprobs.gather(-1, target[:, None])[:, 0]  # [C]
    return float(picked.sum()), bool((logprobs.argmax(-1) == target).all())


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """`text` up to the first of `stops` (the evaluators' continuations end before their stop sequence)."""
    ends = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(ends)] if ends else text

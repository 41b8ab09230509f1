"""What the evaluator integrations (`lm_eval`, `lighteval`) share: loading a Bridge model from their model
arguments, scoring one continuation, and cutting a sample at its stop sequence. It imports neither library, so
each integration needs only its own."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence

import torch

import bridgelm
from bridgelm.dist import check_device
from bridgelm.errors import DataWarning, UserError, check_choice, check_int, check_number
from bridgelm.models import DTYPES, load_model
from bridgelm.tokenizer import load_tokenizer



def positive_int(owner: str, name: str, value) -> int:
    """`value` as an integer >= 1 (an int, or its digits as text), or a UserError that names it (`owner`: who asks,
    e.g. "bridgelm backend"); 1.5 is refused, not truncated."""
    number = integer(owner, name, value, "a positive integer")
    check_int(f"{owner}: {name}", number)
    return number


def integer(owner: str, name: str, value, expected: str = "an integer") -> int:
    """`value` as an int (an int, an integral float from a parsed argument string, or its digits as text)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"{owner}: {name}={value!r}: expected {expected}")
    return value


def seed_arg(owner: str, value) -> int:
    """A sampling seed: an integer >= 0, refused before any model loads (the engine refused it at the first batch)."""
    seed = integer(owner, "seed", value, "an integer >= 0")
    check_int(f"{owner}: seed", seed, low=0)
    return seed


def number(owner: str, name: str, value) -> float:
    """`value` as a finite float (a number, or its digits as text), or a UserError naming it."""
    try:
        out = value if isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        out = value  # not a number: check_number names it as given
    check_number(f"{owner}: {name}", out)
    return out


def load_bridge_model(owner: str, pretrained: str, blocks: str | None, width: int, dtype: str, device: str,
                      revision: str | None = None, tokenizer: str | None = None):
    """(model in eval mode, tokenizer, device) for sampling in Bridge groups of `width`: refused before loading
    when dtype is unknown, and after when width > 1 but the model has no Bridge blocks. A CUDA device without a
    GPU falls back to the CPU with a warning (as lm-eval's hf backend does)."""
    if not pretrained:
        raise UserError(f"{owner}: pretrained={pretrained!r}: expected a model folder or hub id (pretrained=DIR)")
    check_choice(f"{owner}: dtype", dtype, DTYPES)
    device = _sampling_device(owner, device)
    at = {"revision": revision} if revision else {}  # a hub id's branch, tag or commit (model and tokenizer)
    try:
        model = load_model(pretrained, blocks=blocks or None, dtype=DTYPES[dtype], device=device, **at).eval()
    except UserError as err:  # a folder, block file or hub id that does not load: said as this integration's
        raise UserError(f"{owner}: {err}") from None
    if width > 1 and bridgelm.block_config(model) is None:
        raise UserError(
            f"{owner}: width={width} needs a model with Bridge blocks, and {pretrained} has none: "
            "give blocks=FILE, or width=1"
        )
    return model, load_tokenizer(tokenizer or pretrained, **at), torch.device(device)


def model_in_memory(owner: str, model: torch.nn.Module, tokenizer, blocks: str | None, width: int):
    """(model in eval mode, tokenizer, device) of a model object (one trained in this process), used as it is: its
    dtype, its device, its blocks. `tokenizer`: a tokenizer object, or a folder or hub id to load one from."""
    if blocks:
        raise UserError(f"{owner}: blocks={blocks!r} beside a model object: load them onto it first "
                        "(bridgelm.load_blocks(model, FILE)), or give pretrained as a folder")
    if tokenizer is None:
        raise UserError(f"{owner}: pretrained is a model object ({type(model).__name__}): expected its tokenizer "
                        "too (tokenizer=a tokenizer object, folder or hub id)")
    if width > 1 and bridgelm.block_config(model) is None:
        raise UserError(f"{owner}: width={width} needs a model with Bridge blocks, and the {type(model).__name__} "
                        "given has none: attach them (bridgelm.add_bridge, load_blocks), or width=1")
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(str(tokenizer))
    return model.eval(), tokenizer, next(model.parameters()).device


def one_group_at_least(tokenizer, prompts: Sequence[str], width: int, new_tokens: int) -> int:
    """A wave bound (max_batch_tokens) that holds at least one Bridge group of the longest prompt: the engine's
    default, raised where a group of `width` rows of (prompt + `new_tokens`) tokens exceeds it (a reasoning task's
    32768 new tokens at width 8), since these front ends have no bound of their own to set."""
    from bridgelm.engine import SamplingConfig, encode_text

    longest = max(len(encode_text(tokenizer, p)) for p in prompts)
    return max(SamplingConfig.max_batch_tokens, width * (longest + new_tokens))


def in_own_words(err: UserError, owner: str, length: str) -> UserError:
    """The engine's refusal `err` as `owner` says it: its length setting (max_new_tokens, the command line's
    --max-new-tokens) named `length`, the tool's own."""
    said = str(err).replace("max_new_tokens (--max-new-tokens)", length).replace("max_new_tokens", length)
    return UserError(f"{owner}: {said}")


def _sampling_device(owner: str, device: str) -> str:
    """`device` checked as a device name of this machine, a CUDA one without a GPU turned into the CPU."""
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        raise UserError(f"{owner}: device={device!r} is not a device name: expected cpu, cuda or cuda:N") from None
    if kind == "meta":
        raise UserError(f"{owner}: device={device!r}: the meta device holds no weights to sample from; expected cpu "
                        "or cuda")
    if kind == "cuda" and not torch.cuda.is_available():
        warnings.warn(f"{owner}: device {device} asked for, but there is no CUDA GPU: running on the CPU",
                      DataWarning, stacklevel=4)
        return "cpu"
    try:
        check_device(device)
    except UserError as err:
        raise UserError(f"{owner}: {err}") from None
    return device


@torch.no_grad()
def score_ids(model, ctx: list[int], cont: list[int], max_length: int | None = None) -> tuple[float, bool]:
    """log p(cont | ctx) under `model` alone (a group of one), and whether every `cont` token is the greedy one.
    A pair longer than `max_length` tokens loses its context's first tokens (left truncation, as lm-eval's hf
    backend does); a continuation alone longer than that is refused."""
    if max_length is not None and len(ctx) + len(cont) > max_length:
        if len(cont) >= max_length:
            raise UserError(f"a continuation of {len(cont)} tokens does not fit max_length={max_length} positions")
        ctx = ctx[len(ctx) + len(cont) - max_length :]
    ids = torch.tensor([ctx + cont], device=model.device)  # [1, S]
    logprobs = torch.log_softmax(model(ids).logits[0, len(ctx) - 1 : -1].float(), dim=-1)  # [C, V]
    target = ids[0, len(ctx):]  # [C]
    picked = logprobs.gather(-1, target[:, None])[:, 0]  # [C]
    return float(picked.sum()), bool((logprobs.argmax(-1) == target).all())


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """`text` up to the first of `stops` (the evaluators' continuations end before their stop sequence)."""
    ends = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(ends)] if ends else text

"""The text edges of the engine: prompts in as text, samples out as text (the engine itself speaks token ids).

`stream_text` encodes the prompts (through the chat template when asked), runs `bridgelm.engine.loop.stream_ids`
and decodes each sample, yielding a prompt's samples as soon as they are done: what resumable writers append to
their files. `generate` is the same, from one SamplingConfig and keyword changes of it, collected in a list
(`bridgelm.generate`).
"""

from __future__ import annotations

import numbers
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from bridgelm.engine.config import SamplingConfig, with_settings
from bridgelm.engine.loop import stream_ids
from bridgelm.errors import DataWarning, UserError
from bridgelm.progress import bar as progress_bar
from bridgelm.tokenizer import unknown_characters


@dataclass
class Sample:
    """One generated sample of a prompt."""

    prompt_ids: list[int]  # the prompt as the model saw it (chat template applied when asked)
    token_ids: list[int]  # generated ids, ending with EOS when `finished`
    logprobs: list[float]  # one per generated id, under softmax(logits / temperature)
    text: str  # decoded generated ids, special tokens skipped
    finished: bool  # ended by EOS or a stop string


def eos_ids(model, tokenizer=None, override: int | Sequence[int] | None = None) -> list[int]:
    """EOS ids: the override (each an id of the model's vocabulary), else the generation config's (one or several),
    else the tokenizer's."""
    if override is not None:
        ids = [override] if isinstance(override, numbers.Integral) else list(override)
        vocab = model.get_output_embeddings().weight.shape[0]
        for i in ids:  # an id the model cannot draw would never end a sample
            if not isinstance(i, numbers.Integral) or isinstance(i, bool) or not 0 <= i < vocab:
                raise UserError(f"eos_token_id={i!r}: expected a token id from 0 to {vocab - 1} (the model's vocabulary)")
        return [int(i) for i in ids]
    gen = getattr(model, "generation_config", None)
    ids = getattr(gen, "eos_token_id", None) if gen is not None else None
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


def check_prompt_chars(model, tokenizer, texts: Sequence[str], max_new_tokens: int) -> None:
    """ValueError for a prompt with more characters than the model's context can hold as tokens, found before any
    prompt is tokenized (a 10 MB line took minutes to tokenize, only to be refused). No token stands for more
    characters than the vocabulary's longest entry, so a prompt of more than (context - max_new_tokens) x that many
    characters has more tokens than fit."""
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    room = None if context is None else int(context) - int(max_new_tokens)
    if room is None or room <= 0:  # no known context, or none left (check_prompts says so, by tokens)
        return
    widest = max((len(entry) for entry in tokenizer.get_vocab()), default=1)
    limit = room * max(widest, 1)
    for i, text in enumerate(texts):
        if isinstance(text, str) and len(text) > limit:
            raise UserError(
                f"prompt {i} has {len(text)} characters: more than the {limit} that fit in {room} tokens (the model's "
                f"context of {context} positions less max_new_tokens={max_new_tokens}; this tokenizer's longest "
                f"token is {widest} characters): expected a shorter prompt or a lower max_new_tokens"
            )


def pad_id(tokenizer, eos: Sequence[int]) -> int:
    """The id that fills finished rows and padding: the tokenizer's pad, else the first EOS, else 0."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return eos[0] if eos else 0


def encode_text(tokenizer, text: str) -> list[int]:
    """`text`'s token ids with the tokenizer's own special tokens (its BOS, where it adds one), but none when the
    text already starts with the BOS text (a chat template's output, as lm-eval hands it over): one BOS, not two."""
    bos = tokenizer.bos_token
    return list(tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)))["input_ids"])


def encode_prompts(tokenizer, prompts: Sequence[str], chat: bool = False, warn: bool = True) -> list[list[int]]:
    """Token ids of each prompt; with `chat`, through the tokenizer's chat template (generation prompt added). Prompts
    with characters the tokenizer can only encode as its unknown token (a character vocabulary's <pad>) are encoded
    so, with one DataWarning (unless not `warn`: a caller that only counts tokens) that counts them and names the
    first one's characters."""
    if isinstance(prompts, str):
        raise UserError("prompts must be a list of strings, got one string")
    out, unread = [], []  # unread: (prompt index, characters) of prompts with characters the tokenizer lacks
    for i, text in enumerate(prompts):
        if not isinstance(text, str) or not text:
            raise UserError(f"prompt {i} is empty or not a string: {text!r}")
        if chat:
            if not getattr(tokenizer, "chat_template", None):
                raise UserError("chat: the tokenizer has no chat template: leave out --chat (chat=False in Python)")
            ids = _chat_ids(tokenizer, text)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
        else:
            ids = encode_text(tokenizer, text)
        unknown = unknown_characters(tokenizer, text, ids) if warn else None
        if unknown:
            unread.append((i, unknown))
        out.append(list(ids))
    if unread:
        (first, chars), unk = unread[0], tokenizer.backend_tokenizer.model.unk_token
        warnings.warn(
            f"{len(unread)} of {len(prompts)} prompts hold characters the tokenizer has no token for (prompt {first}: "
            f"{', '.join(map(repr, chars[:10]))}); the model reads each as {unk!r}",
            DataWarning,
            stacklevel=2,
        )
    return out


def _chat_ids(tokenizer, text: str):
    """The tokenizer's chat template applied to one user turn; a template that fails (a syntax error, or one that
    raises: a role it refuses) is bad input in one line."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
    except TemplateError as err:
        raise UserError(
            f"chat: the tokenizer's chat template fails ({type(err).__name__}: {err}): fix its chat_template.jinja "
            "(or tokenizer_config.json), or leave out --chat"
        ) from err


def check_stop_strings(stop_strings: Sequence[str]) -> None:
    """ValueError unless every stop string is non-empty text (the one check of the API and the CLI's --stop)."""
    for s in stop_strings:
        if not isinstance(s, str) or not s:
            what = "empty stop string ''" if s == "" else f"stop string {s!r}"
            raise UserError(f"{what}: expected non-empty text (an empty one ends every sample after its first token)")


def stop_checker(tokenizer, stop_strings: Sequence[str]) -> Callable[[list[int]], bool] | None:
    """A `stop(token_ids)` that looks for any stop string in the decoded tail of a sample: the last (longest stop
    string's UTF-8 bytes + 4) tokens. A token holds at least a byte in every tokenizer (byte-level BPE splits a
    Chinese character into up to three), so the tail holds the whole string whenever the sample ends with it.

    A stop string is looked for in the text as the sample's text shows it (special tokens left out), so that "end"
    does not stop at "<|im_end|>"; one that holds a special token ("<|user|>": a turn's end) in the text with them."""
    if isinstance(stop_strings, str):
        stop_strings = [stop_strings]  # one stop string, not its characters
    check_stop_strings(stop_strings)
    if not stop_strings:
        return None
    longest = max(len(s.encode("utf-8")) for s in stop_strings)  # bytes, not characters
    specials = [t for t in getattr(tokenizer, "all_special_tokens", ()) if t]
    marked = [s for s in stop_strings if any(t in s for t in specials)]
    plain = [s for s in stop_strings if s not in marked]

    def found(strings: list[str], tail: list[int], skip: bool) -> bool:
        if not strings:
            return False
        text = tokenizer.decode(tail, skip_special_tokens=skip)  # once for every string (it ran once per string)
        return any(s in text for s in strings)

    def stop(token_ids: list[int]) -> bool:
        tail = token_ids[-(longest + 4) :]
        return found(plain, tail, skip=True) or found(marked, tail, skip=False)

    return stop


def stream_text(
    model,
    tokenizer,
    texts: Sequence[str],
    cfg: SamplingConfig,
    keys: Sequence | None = None,
    chat: bool = False,
    stop_strings: Sequence[str] = (),
    eos_token_id: int | Sequence[int] | None = None,
    progress: str | Callable[[int], None] | None = None,
) -> Iterator[tuple[int, list[Sample]]]:
    """The engine, text in and out: encode `texts`, sample, decode; yields (index, its n `Sample`) as prompts
    complete, in prompt order. `keys` name the prompts' random streams (see `stream_ids`); `progress` is a
    progress-bar title, or a callable fed the number of completed samples.
    """
    cfg.validate()  # the prompts are checked as token ids, by stream_ids' check_prompts
    texts = texts if isinstance(texts, str) else list(texts)  # a generator is read once, here
    check_prompt_chars(model, tokenizer, texts, cfg.max_new_tokens)  # before tokenizing a line of megabytes
    ids = encode_prompts(tokenizer, texts, chat)
    eos = eos_ids(model, tokenizer, eos_token_id)
    bar = None
    if isinstance(progress, str):
        bar = progress_bar(len(texts) * cfg.n, progress, "sample")
    update = bar.update if bar is not None else progress
    try:
        stop = stop_checker(tokenizer, stop_strings)
        decode = lambda g: tokenizer.decode(g.token_ids, skip_special_tokens=True)
        for i, samples in stream_ids(model, ids, cfg, eos, pad_id(tokenizer, eos), stop, update, keys):
            yield i, [Sample(ids[i], g.token_ids, g.logprobs, decode(g), g.finished) for g in samples]
    finally:
        if bar is not None:
            bar.close()


def generate(
    model,
    tokenizer,
    prompts: Sequence[str],
    cfg: SamplingConfig | None = None,
    *,
    chat: bool = False,
    stop_strings: Sequence[str] = (),
    eos_token_id: int | Sequence[int] | None = None,
    progress: bool | None = None,
    keys: Sequence | None = None,
    **overrides: Any,
) -> list[list[Sample]]:
    """Sample `cfg.n` responses per prompt; samples j*width .. (j+1)*width-1 of a prompt form one Bridge group.

    `cfg` (default: `SamplingConfig()`) with `overrides` of its fields: `generate(model, tok, prompts, n=8, width=4)`.
    Returns, per prompt, a list of n `Sample` (`stream_text`, collected). Works with and without Bridge blocks
    (width 1 = independent). `progress`: a progress bar on stderr; None (default): when stderr is a terminal.
    `keys`: one per prompt, what its samples' random streams are keyed by (default: its position in `prompts`); a
    prompt under the same key and seed draws the same samples whatever else the list holds, in any order.
    """
    cfg = with_settings(cfg, overrides)
    if progress is None:
        progress = sys.stderr.isatty()
    title = "sampling" if progress else None
    stream = stream_text(model, tokenizer, prompts, cfg, keys, chat, stop_strings, eos_token_id, title)
    return [samples for _, samples in stream]

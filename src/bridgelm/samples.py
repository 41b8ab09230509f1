"""Sampling into a resumable JSONL file: one line per prompt, appended as prompts complete.

Every line carries the settings that produced it, headed by the kind and format version of the file (a samples file
of `bridgelm generate`, or warm-up data); a re-run with the same file skips prompts already written and refuses to
mix in samples made by another model or other settings (a block file or model folder whose content changed at the same
path included), or to append to a file of an older format. A second process on the same file is refused at once.

    bridgelm generate --model DIR --prompts prompts.jsonl --n 8 --width 4 --out samples.jsonl
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bridgelm.engine import SamplingConfig, check_stop_strings, stream_text
from bridgelm.errors import UserError
from bridgelm.jsonl import append_record, check_regular_file, exclusive, read_records
from bridgelm.runs import SAMPLED_WITH, check_format, check_settings, format_of, source_digests
from bridgelm.stop import stop_on_sigterm


def run_settings(
    kind: str, cfg: SamplingConfig, model_id: str, blocks: str | None, chat: bool, dtype: str, **extra
) -> dict[str, Any]:
    """The settings recorded with (and checked against) every line of a samples file of `kind` ("generate",
    "warmup-data"): its format, the engine's settings that decide what is sampled (not the batch bounds), the model
    and blocks by path and by content (`source_digests`) and the dtype of its weights (`runs.dtype_name`)."""
    sampled = {k: v for k, v in asdict(cfg).items() if k in SAMPLED_WITH}
    sources = {"model": model_id, "blocks": blocks, **source_digests(model_id, blocks), "dtype": dtype}
    return {**format_of(kind), **sampled, **sources, "chat": chat, **extra}


def check_lines(path: Path, done: list[dict], settings: dict) -> None:
    """UserError when the lines of `path` are not bridgelm lines, or were written with other settings."""
    for number, rec in enumerate(done, start=1):
        if not isinstance(rec.get("index"), int) or not isinstance(rec.get("settings"), dict):
            raise UserError(
                f"{path}, line {number}: not a line written by bridgelm (expected 'index' and 'settings' fields); "
                "refusing to append to a file that is not ours: use another --out"
            )
    for rec in done[:1]:
        check_format(path, rec["settings"], settings["kind"], expected=f"a file of bridgelm {settings['kind']}")
        fix = "use another --out to compare runs"
        check_settings(path, rec["settings"], settings, keys=settings, saved_as="file", fix=fix)


def check_prompts(path: Path, done: list[dict], prompts: Sequence[str], source: str) -> None:
    """UserError when a line of `path` was sampled from another prompt than the one now at its index."""
    for rec in done:
        i = rec["index"]
        if i >= len(prompts):
            raise UserError(
                f"{path} holds samples of prompt {i + 1}, but {source} has {len(prompts)} prompts now (a shorter "
                "file): expected at least as many as it was sampled from; use another --out"
            )
        now = prompts[i] if i >= 0 else None
        if rec.get("prompt") != now:
            shown = "none" if now is None else f"{_short(now)!r}"
            raise UserError(
                f"{path} holds samples of other prompts than {source}: its line with index {i} (prompt {i + 1}) was "
                f"sampled from {_short(rec.get('prompt'))!r}, but prompt {i + 1} of {source} is {shown} (another "
                "file, or one edited since); use another --out"
            )


def _short(text, limit: int = 60) -> str:
    text = str(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def sample_to_file(
    model,
    tokenizer,
    prompts: Sequence[str],
    out: str | os.PathLike,
    cfg: SamplingConfig,
    settings: dict[str, Any],
    chat: bool = False,
    stop_strings: Sequence[str] = (),
    records: Sequence[dict[str, Any]] | None = None,
    progress: bool = True,
    source: str = "the prompts",
) -> int:
    """Sample n responses for every prompt not yet in `out`; returns the number of prompts sampled now.

    `records[i]` (optional) holds extra fields written on prompt i's line (an id, a gold answer...). Lines already
    in `out` must come from the same settings and the same prompts (`source` names them in errors). A second process
    on the same `out` is refused at once (`jsonl.exclusive`).
    """
    out = Path(out)
    check_stop_strings(stop_strings)
    with exclusive(out, folder=False):
        done = read_records(out)
        check_lines(out, done, settings)
        check_prompts(out, done, prompts, source)
        have = {rec["index"] for rec in done}
        todo = [i for i in range(len(prompts)) if i not in have]
        if todo:
            _sample_into(model, tokenizer, prompts, todo, out, cfg, settings, chat, stop_strings, records, progress)
        return len(todo)


def _sample_into(model, tokenizer, prompts, todo, out: Path, cfg, settings, chat, stop_strings, records, progress):
    """Sample prompts `todo` (indices) and append their lines to `out` (sample_to_file holds its lock)."""
    texts = [prompts[i] for i in todo]
    title = f"sampling -> {out}" if progress else None
    # keys = prompt indices: a resumed run draws exactly what an uninterrupted one would have
    for k, samples in stream_text(model, tokenizer, texts, cfg, todo, chat, stop_strings, progress=title):
        i = todo[k]
        line = {
            "index": i,
            **(dict(records[i]) if records is not None else {}),
            "prompt": prompts[i],
            "prompt_ids": samples[0].prompt_ids,
            "samples": [
                {
                    "text": g.text,
                    "token_ids": g.token_ids,
                    "logprobs": [round(x, 5) for x in g.logprobs],
                    "finished": g.finished,
                }
                for g in samples
            ],
            "settings": settings,
        }
        append_record(out, line)


def run_generate(
    cfg: SamplingConfig, source, out: str, prompts_file: str | None = None, prompt: str | None = None,
    chat: bool = False, stop: Sequence[str] = (),
) -> int:
    """`bridgelm generate`: `cfg.n` samples (in groups of `cfg.width`) of the model of `source` (a
    bridgelm.source.ModelSource) for each prompt of `prompts_file` (JSONL, a 'prompt' a line) or for `prompt`,
    into `out` (re-runs resume); returns the prompts sampled now."""
    from bridgelm.jsonl import check_free, check_out
    from bridgelm.runs import dtype_name, local_source
    from bridgelm.source import width_is_moot

    cfg.validate()
    if (prompts_file is None) == (prompt is None):
        raise UserError("give exactly one of --prompts FILE.jsonl or --prompt TEXT")
    if prompt is not None and not prompt:
        raise UserError("--prompt is empty: expected the text of a prompt")
    check_out(out, "file")
    check_free(out, folder=False)  # another process writing it: refused before the model loads
    prompts = read_prompts(prompts_file) if prompts_file else [prompt]
    model, tokenizer = source.load()
    settings = run_settings(
        "generate", cfg, local_source(source.model), local_source(source.blocks), chat, dtype_name(model), stop=stop
    )
    print(f"bridgelm generate: {_count(len(prompts), 'prompt')} x {_count(cfg.n, 'sample')} (width {cfg.width}) "
          f"-> {out}")
    if note := greedy_note(cfg):
        print(f"bridgelm generate: {note}")
    moot = width_is_moot(model)
    if moot and cfg.width > 1:
        print(f"bridgelm generate: note: {moot}, so width {cfg.width} samples like width 1: independently")
    elif not moot and cfg.width == 1 and cfg.n > 1:
        print(f"bridgelm generate: note: width 1: each of a prompt's {cfg.n} samples is its Bridge blocks' only "
              "one, so they are drawn independently; --width W (a divisor of --n) draws groups of W that read each "
              "other")
    where = f"--prompts {prompts_file}" if prompts_file else "--prompt"
    with kept_on_interrupt("bridgelm generate", "prompts", out):
        made = sample_to_file(model, tokenizer, prompts, out, cfg, settings, chat, stop, source=where)
    print(f"bridgelm generate: sampled {_count(made, 'prompt')} now, {len(prompts) - made} were already in {out}")
    texts = [s["text"] for rec in read_records(out) for s in rec["samples"]]
    if note := empty_note(len(texts), sum(not t.strip() for t in texts), chat):
        print(f"bridgelm generate: {note}")
    return made


def greedy_note(cfg: SamplingConfig) -> str | None:
    """A note when sampling is greedy with more than one sample a prompt (None otherwise): its samples are alike."""
    if cfg.temperature != 0 or cfg.n == 1:
        return None
    return (f"note: --temperature 0 is greedy decoding: a prompt's {cfg.n} samples are alike (a group's rows read "
            "alike siblings); a temperature above 0 draws different ones")


def empty_note(samples: int, empty: int, chat: bool) -> str | None:
    """A note when every sample is empty (None otherwise): what an Instruct model sampled without a chat template
    often does."""
    if not samples or empty < samples:
        return None
    hint = ": an Instruct model sampled without --chat often ends at once" if not chat else ""
    return f"note: every one of the {samples} samples is empty{hint}"


@contextlib.contextmanager
def kept_on_interrupt(name: str, what: str, out: str | os.PathLike):
    """Ctrl-C or SIGTERM in the body said as what was kept (the `what` sampled so far, in `out`; nothing, when `out`
    was not written yet) and how to go on (the command line adds no line of its own)."""
    try:
        with stop_on_sigterm():
            yield
    except KeyboardInterrupt as err:
        kept = (f"the {what} sampled so far are kept in {out}; the same command continues after them"
                if Path(out).exists() else f"nothing was written yet ({out} does not exist)")
        print(f"\n{name}: interrupted; {kept}", file=sys.stderr)
        err.said = True
        raise


def read_prompts(path: str) -> list[str]:
    """The prompts of a JSONL file written by hand: one object with a non-empty 'prompt' a line."""
    path = check_regular_file(path, "--prompts", "a JSONL file, one object with a 'prompt' field per line")
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


def _count(k: int, noun: str) -> str:
    return f"{k} {noun}{'' if k == 1 else 's'}"

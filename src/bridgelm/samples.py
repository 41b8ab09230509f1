"""Sampling into a resumable JSONL file: one line per prompt, appended as prompts complete.

Every line carries the settings that produced it; a re-run with the same file skips prompts already written
and refuses to mix in samples made by another model or other settings.

    bridgelm generate --model DIR --prompts prompts.jsonl --n 8 --width 4 --out samples.jsonl
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bridgelm.jsonl import append_record, read_records
from bridgelm.sampling import SamplingConfig, iter_generate

# Settings that change what is sampled; batch bounds do not.
_KEYED = ("n", "width", "max_new_tokens", "temperature", "top_p", "top_k", "seed")


def run_settings(cfg: SamplingConfig, model_id: str, blocks: str | None, chat: bool, **extra) -> dict[str, Any]:
    """The settings recorded with (and checked against) every line of a samples file."""
    s = {k: v for k, v in asdict(cfg).items() if k in _KEYED}
    return {**s, "model": model_id, "blocks": blocks, "chat": chat, **extra}


def check_settings(path: Path, done: list[dict], settings: dict) -> None:
    for rec in done[:1]:
        old = rec.get("settings", {})
        diff = {k: (old.get(k), v) for k, v in settings.items() if old.get(k) != v}
        if diff:
            detail = ", ".join(f"{k}: file {a!r} vs now {b!r}" for k, (a, b) in sorted(diff.items()))
            raise ValueError(f"{path} was written with other settings ({detail}); use another --out to compare runs")


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
) -> int:
    """Sample n responses for every prompt not yet in `out`; returns the number of prompts sampled now.

    `records[i]` (optional) holds extra fields written on prompt i's line (an id, a gold answer...).
    """
    out = Path(out)
    done = read_records(out)
    check_settings(out, done, settings)
    have = {rec["index"] for rec in done}
    todo = [i for i in range(len(prompts)) if i not in have]
    if not todo:
        return 0
    texts = [prompts[i] for i in todo]
    title = f"sampling -> {out}" if progress else None
    # keys = prompt indices: a resumed run draws exactly what an uninterrupted one would have
    for k, samples in iter_generate(model, tokenizer, texts, cfg, todo, chat, stop_strings, progress=title):
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
    return len(todo)

"""The warm-up data file read back: the kept problems of `bridgelm warmup-data`'s JSONL, each with its correct
responses as token ids (`read_warmup`; `load_warmup` reads it once, `WarmupData.checked` then checks it against
the model); errors name the file and line.

Written by bridgelm.train.warmup_data; read by bridgelm.train.sft (the SFT warm-up) and bridgelm.eval.analyze (the
response sets of Sec. 5); tested by tests/test_sft.py and tests/test_bad_input.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from bridgelm.errors import UserError
from bridgelm.jsonl import check_regular_file, read_records


@dataclass
class Problem:
    prompt_ids: list[int]  # the prompt as the model saw it
    responses: list[list[int]]  # token ids of its correct responses (>= 2)


@dataclass
class WarmupData:
    """A warm-up file read once (`load_warmup`): its problems, and its kept records to check against the model
    that will train on them (`checked`)."""

    path: Path
    problems: list[Problem]
    kept: list[tuple[int, dict, list[int], list[list[int]]]]  # (line, record, prompt ids, responses' ids)

    def checked(self, tokenizer=None, vocab_size: int | None = None) -> list[Problem]:
        """The problems, once the kept records are checked against the model: with `tokenizer` (the model's), the
        first kept responses' token ids must decode to the text sampled with them (ids from another tokenizer would
        be trained on as if they were this model's); with `vocab_size` (its embedding rows) every id must be below
        it."""
        counted = False
        for number, rec, prompt, ids in self.kept:
            if vocab_size is not None:
                bad = next((t for t in [*prompt, *(x for r in ids for x in r)] if t >= vocab_size), None)
                if bad is not None:
                    raise UserError(
                        f"{self.path}, line {number}: token id {bad} is outside the model's vocabulary of {vocab_size} "
                        "ids (expected warm-up data sampled by the model being trained)"
                    )
            if tokenizer is not None and not counted:
                _check_tokenizer(tokenizer, rec, self.path, number)
            counted = counted or len(ids) >= 2
        return self.problems


def read_warmup(path: str | os.PathLike, tokenizer=None, vocab_size: int | None = None) -> list[Problem]:
    """Kept problems of a warm-up file, each with >= 2 responses, checked against `tokenizer` and `vocab_size` when
    given (`WarmupData.checked`); errors name the file and line."""
    return load_warmup(path).checked(tokenizer, vocab_size)


def load_warmup(path: str | os.PathLike) -> WarmupData:
    """A warm-up file read and its structure checked (a kept problem has prompt ids and responses' token ids; one
    problem at least has >= 2 responses); errors name the file and line."""
    path = check_regular_file(path, "warm-up data", "a JSONL file written by bridgelm warmup-data")
    records = read_records(path, repair=False)
    if not records:
        raise UserError(f"{path} is empty: expected one JSON line per problem (bridgelm warmup-data writes it)")
    problems, kept = [], []
    for number, rec in enumerate(records, start=1):
        if not isinstance(rec, dict) or "kept" not in rec:
            raise UserError(f"{path}, line {number}: expected an object with a 'kept' field")
        if not isinstance(rec["kept"], bool):  # "false" would be read as kept
            raise UserError(f"{path}, line {number}: field 'kept' is {rec['kept']!r}: expected true or false")
        if not rec["kept"]:
            continue
        prompt, responses = rec.get("prompt_ids"), rec.get("responses")
        if not _ids(prompt) or not isinstance(responses, list):
            raise UserError(
                f"{path}, line {number}: a kept problem needs 'prompt_ids' (token ids >= 0) and 'responses'"
            )
        ids = [r.get("token_ids") if isinstance(r, dict) else None for r in responses]
        if not all(_ids(t) for t in ids):
            raise UserError(f"{path}, line {number}: every response needs non-empty 'token_ids' (ids >= 0)")
        kept.append((number, rec, prompt, ids))
        if len(ids) >= 2:
            problems.append(Problem(list(prompt), [list(t) for t in ids]))
    if not problems:
        raise UserError(
            f"{path} holds no problem with two or more correct responses ({len(records)} lines): "
            "sample more responses per problem (--n) or use more problems"
        )
    return WarmupData(path, problems, kept)


def _check_tokenizer(tokenizer, rec: dict, path: Path, number: int) -> None:
    """ValueError when the first response of record `rec` does not decode, with `tokenizer`, to its sampled text."""
    first = rec["responses"][0]
    text = first.get("text")
    if not isinstance(text, str):
        return  # written by hand without texts: nothing to compare
    got = tokenizer.decode(first["token_ids"], skip_special_tokens=True)  # as the engine decodes samples
    if got != text:
        settings = rec.get("settings") or {}
        source = f" by model {settings['model']!r}" if settings.get("model") else ""
        at = next((i for i, (a, b) in enumerate(zip(got, text)) if a != b), min(len(got), len(text)))
        raise UserError(
            f"{path}, line {number}: the first response's token ids decode with this model's tokenizer to text that "
            f"differs from the text sampled{source} at character {at} ({got[at : at + 20]!r} vs "
            f"{text[at : at + 20]!r}): expected warm-up data sampled by the model being trained (its tokenizer)"
        )


def _ids(x) -> bool:
    """A non-empty list of token ids (integers >= 0)."""
    return isinstance(x, list) and len(x) > 0 and all(isinstance(t, int) and t >= 0 for t in x)

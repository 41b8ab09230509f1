"""GPQA: four-option multiple choice (graduate-level science), graded by the extracted letter.

Design notes:
- Rows are in the public layout of Idavidrein/gpqa: `Question`, `Correct Answer`, `Incorrect Answer 1`,
  `Incorrect Answer 2`, `Incorrect Answer 3` (the diamond subset is the usual benchmark). Local
  .jsonl/.json/.parquet files or a folder; with no path, the hub (gated; config `gpqa_diamond`, whose only
  split is `train`).
- The four options are shuffled per problem by `numpy.random.default_rng([seed, row index])` when the task is
  loaded: the same file and seed always give the same order, whatever else is evaluated. Each example records
  its `options` (in the order shown) and the `gold` letter.
- Prompt (the simple-evals / Lighteval GPQA template), one user message:

      Answer the following multiple choice question. The last line of your response should be of the following
      format: 'Answer: $LETTER' (without quotes) where LETTER is one of ABCD. Think step by step before answering.

      {Question}

      A) {option A}
      B) ...

- Answer format: in the text after the last `</think>` (the whole completion when there is none), the last
  `Answer: X` (any case for "answer", markdown and `$`, `(`, `\\boxed{}` around X allowed), else the last
  `\\boxed{X}`; X is one capital letter A-D. Accuracy: the letter equals the gold letter.

    bridgelm eval --model M --task gpqa --data gpqa_diamond.jsonl --n 32 --width 8 --chat --out runs/gpqa
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from bridgelm.tasks.answers import after_thinking, last_boxed
from bridgelm.tasks.base import Task, load_rows, require_text

# Fields every GPQA row must have.
FIELDS = ("Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3")

# Hub fallback when no local path is given (gated: needs an accepted licence and a token).
HUB_ID, HUB_CONFIG, HUB_SPLIT = "Idavidrein/gpqa", "gpqa_diamond", "train"

LETTERS = "ABCD"

INSTRUCTION = (
    "Answer the following multiple choice question. The last line of your response should be of the following "
    "format: 'Answer: $LETTER' (without quotes) where LETTER is one of ABCD. Think step by step before answering."
)

# "Answer: B", "**Answer:** (B)", "answer: $B$", "Answer: \boxed{B}", "Final Answer: B".
_ANSWER_RE = re.compile(
    r"(?i:answer)\s*(?:\*\*)?\s*[:：]\s*(?:\*\*)?[\s$(\[{*]*(?:\\boxed\{)?\s*(?:\\text\{)?([A-D])\b"
)
_BOXED_LETTER_RE = re.compile(r"^\s*(?:\\text\{)?\s*\(?([A-D])\)?\s*\}?\s*$")


def check_row(row: dict) -> None:
    """ValueError naming the first of the question and its four answers that is not non-empty text (a number, as a
    table may hold an answer, is taken as its text)."""
    for name in FIELDS:
        value = row.get(name)
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)):
            require_text(row, name)


def shuffled_options(row: dict, seed: int, index: int) -> tuple[list[str], str]:
    """(options in the order shown, gold letter) of a row: a permutation seeded by (seed, index)."""
    choices = [str(row[f]).strip() for f in FIELDS[1:]]  # the correct answer first
    order = np.random.default_rng([seed, index]).permutation(len(choices))
    return [choices[j] for j in order], LETTERS[int(np.flatnonzero(order == 0)[0])]


def extract_letter(completion: str | None) -> str | None:
    """The chosen letter A-D (see the module notes), or None."""
    text = after_thinking(completion)
    found = _ANSWER_RE.findall(text)
    if found:
        return found[-1]
    boxed = last_boxed(text)
    if boxed is not None:
        match = _BOXED_LETTER_RE.match(boxed)
        if match:
            return match.group(1)
    return None


@dataclass
class GPQA(Task):
    """GPQA with shuffled options; accuracy of the extracted letter."""

    def prompt(self, example: dict) -> str:
        options = "\n".join(f"{letter}) {text}" for letter, text in zip(LETTERS, example["options"]))
        return f"{INSTRUCTION}\n\n{str(example['Question']).strip()}\n\n{options}"

    def answer(self, example: dict) -> str:
        return example["gold"]

    def extract(self, completion: str) -> str | None:
        return extract_letter(completion)

    def reward(self, completion: str, example: dict) -> float:
        return 1.0 if extract_letter(completion) == example["gold"] else 0.0


def load(path: str | None = None, split: str = "test", seed: int = 0) -> GPQA:
    """GPQA rows from a local file/folder (or the hub when path is None), options shuffled with `seed`."""
    if path is None:
        rows = load_rows(HUB_ID, HUB_SPLIT, FIELDS, hub_config=HUB_CONFIG, check=check_row)
    else:
        rows = load_rows(path, split, FIELDS, check=check_row)
    examples = []
    for i, row in enumerate(rows):
        options, gold = shuffled_options(row, seed, i)
        examples.append({**row, "options": options, "gold": gold})
    return GPQA(name="gpqa", examples=examples)

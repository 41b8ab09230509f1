"""Short-answer questions with a number for an answer, asked exactly as written.

Rows hold `question` (the whole user message, with any instruction of its own, e.g. "What is 7 + 5? Answer with
the number only.") and `answer` (the gold number as text). Unlike GSM8K, no instruction is added: a question that
asks for the number alone gets a completion of a few tokens, which is what a small model needs when its reasoning
in words runs out of tokens. A completion's answer is read as GSM8K's is: a box, "####" or "the answer is" when there
is one, else the last number of a finished completion; numbers match exactly, up to GSM8K's tolerance.

    task = bridgelm.tasks.load("numeric", "questions.jsonl", split="test")
"""

from __future__ import annotations

from dataclasses import dataclass

from bridgelm.errors import UserError
from bridgelm.tasks.answers import canonical_number
from bridgelm.tasks.base import load_rows, require_text
from bridgelm.tasks.gsm8k import GSM8K

# Fields every row must have.
FIELDS = ("question", "answer")


def check_row(row: dict) -> None:
    """ValueError unless the row has a question and a single number for its answer."""
    require_text(row, "question")
    answer = row.get("answer")
    if canonical_number(str(answer)) is None:
        raise ValueError(f"field 'answer' is {answer!r}: expected a single number")


@dataclass
class Numeric(GSM8K):
    """Questions asked as written, graded by the number the completion gives (GSM8K's extraction and matching)."""

    def prompt(self, example: dict) -> str:
        return example["question"]

    def answer(self, example: dict) -> str:
        return canonical_number(str(example["answer"]))


def load(path: str | None = None, split: str = "test") -> Numeric:
    """Rows from a local JSONL/JSON/Parquet file or folder (the split's file in a folder); no hub default."""
    if path is None:
        raise UserError("task 'numeric' has no default data: pass --data with question/answer rows")
    return Numeric(name="numeric", examples=load_rows(path, split, FIELDS, check=check_row))

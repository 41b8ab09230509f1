"""GSM8K: grade-school word problems with a numeric answer.

Rows hold `question` and `answer`, a worked solution ending in `#### N`; the gold is N. A
completion is correct when its extracted number equals N up to a relative tolerance of 1e-6, so
"18", "18.0" and "$18" agree, and so do "1,234" and "1234". A completion cut by the token limit (it never ended)
is graded only on an explicit answer (a box, "####" or "the answer is"), not on its last number.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import MAX_EMAX, MIN_EMIN, Decimal, InvalidOperation, localcontext

from bridgelm.tasks.answers import canonical_number, extract_number_answer
from bridgelm.tasks.base import Task, load_rows, require_text, with_instruction

# Fields every GSM8K row must have.
FIELDS = ("question", "answer")

# Hub fallback when no local path is given.
HUB_ID, HUB_CONFIG = "openai/gsm8k", "main"

# Relative and absolute tolerances of the numeric comparison, exact decimals (never floats).
REL_TOL = Decimal("1e-6")
ABS_TOL = Decimal("1e-12")


def gold_from_solution(solution: str) -> str:
    """The canonical number after the last `####` of a GSM8K worked solution."""
    if "####" not in solution:
        raise ValueError(f"GSM8K solution {solution[-60:]!r} has no '#### N' final line")
    gold = canonical_number(solution.rsplit("####", 1)[1].strip())
    if gold is None:
        raise ValueError(f"GSM8K solution ends with {solution.rsplit('####', 1)[1]!r}: expected a number")
    return gold


def numbers_match(pred: str | None, gold: str) -> bool:
    """Numeric equality in exact decimal arithmetic (any size, no overflow): integers exactly, other numbers up to a
    relative tolerance REL_TOL ("18" and "18.0000001")."""
    if pred is None:
        return False
    if pred == gold:
        return True
    try:
        a, b = Decimal(pred), Decimal(gold)  # exact: 10^400 and 2 x 10^400 stay apart (as floats both are inf)
    except InvalidOperation:
        return False
    if not (a.is_finite() and b.is_finite()):
        return False
    with localcontext() as ctx:  # room for any exponent a Decimal can hold: the difference never overflows
        ctx.prec, ctx.Emax, ctx.Emin = 34, MAX_EMAX, MIN_EMIN
        if a == a.to_integral_value() and b == b.to_integral_value():
            return False  # two different integers, however large: no tolerance
        return abs(a - b) <= max(REL_TOL * max(abs(a), abs(b)), ABS_TOL)


@dataclass
class GSM8K(Task):
    """GSM8K graded by the extracted final number."""

    def prompt(self, example: dict) -> str:
        return with_instruction(example["question"])

    def answer(self, example: dict) -> str:
        return gold_from_solution(example["answer"])

    def extract(self, completion: str) -> str | None:
        return extract_number_answer(completion)

    def answered(self, completion: str) -> bool:
        # a box, "####" or "the answer is"; a last number alone is often incidental ("Step 3: Calculate the total")
        return extract_number_answer(completion, fallback=False) is not None

    def reward(self, completion: str, example: dict) -> float:
        return 1.0 if numbers_match(self.extract(completion), self.answer(example)) else 0.0


def check_row(row: dict) -> None:
    """ValueError unless the row has a question and a solution ending in '#### N'."""
    require_text(row, "question")
    require_text(row, "answer")
    gold_from_solution(row["answer"])


def load(path: str | None = None, split: str = "test") -> GSM8K:
    """GSM8K rows from a local file/folder, or from the hub (`openai/gsm8k`) when path is None."""
    if path is None:
        rows = load_rows(HUB_ID, split, FIELDS, hub_config=HUB_CONFIG, check=check_row)
    else:
        rows = load_rows(path, split, FIELDS, check=check_row)
    return GSM8K(name="gsm8k", examples=rows)

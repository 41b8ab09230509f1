"""Sums whose steps may be taken in any order: the demo's task, where siblings have something to share.

A problem is 3-5 two-digit numbers to add, e.g. `37+12+58+64=`. A worked solution adds two numbers per line, in
an order of its choosing, and writes every partial sum on three digits, then boxes the total:

    37+58=095
    095+12=107
    107+64=171
    \\boxed{171}

Why this task. Correct solutions of one problem come in many forms (k! orders of k numbers), so a model that
learned from solutions in random orders samples several of them, and the kept warm-up traces of a problem differ.
Every number has a fixed width, so every solution of a problem has the same layout and length whatever its
order: at one generation step all samples of a prompt are on the same line and digit. Their partial sums differ
(different orders, different additions, different slips), but the last line of every correct solution holds the
same total. At that step a sample can read what its siblings computed: a consensus that independent samples only
reach afterwards, by majority vote. Independent sampling remains the natural baseline (every problem is solvable
alone); nothing is split across siblings.

Problems come from a seeded generator; the split of a problem is decided by a hash of its sorted numbers (test
10%, validation 10%, train 80%), so the splits never overlap, whatever the order the numbers are written in. The
reward is 1 when the last `\\boxed{}` of a completion holds the right total (compared as integers).

    task = bridgelm.tasks.load("anysum", split="test", size=400)
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from bridgelm.errors import UserError
from bridgelm.tasks import arith
from bridgelm.tasks.arith import Arith

_BOXED = re.compile(r"\\boxed\{(\d+)\}")
_PROBLEM = re.compile(r"^\d+(\+\d+)+$")


@dataclass(frozen=True)
class AnySumSpec:
    """Which problems the generator makes."""

    min_operands: int = 3  # numbers in a problem, at least
    max_operands: int = 5  # and at most
    min_value: int = 10  # operands are drawn from min_value..max_value (two digits: 10..99)
    max_value: int = 99


def numbers_of(problem: str) -> list[int]:
    """The operands of `37+12+58` -> [37, 12, 58]; ValueError when the text is not such a sum."""
    text = problem.strip().rstrip("=")
    if not _PROBLEM.match(text):
        raise ValueError(f"problem {problem!r} is not a sum of integers such as '37+12+58'")
    return [int(x) for x in text.split("+")]


def split_of(problem: str) -> str:
    """The split a problem belongs to, from a stable hash of its sorted numbers (any order: one problem)."""
    return arith.split_of(_text(sorted(numbers_of(problem))))


def _text(numbers: list[int]) -> str:
    return "+".join(map(str, numbers))


def solution_text(numbers: list[int], order: list[int]) -> str:
    """The worked solution adding `numbers` in the order of the indices `order` (a permutation)."""
    first, second = numbers[order[0]], numbers[order[1]]
    total = first + second
    lines = [f"{first}+{second}={total:03d}"]
    for i in order[2:]:
        new = total + numbers[i]
        lines.append(f"{total:03d}+{numbers[i]}={new:03d}")
        total = new
    return "\n".join(lines) + f"\n\\boxed{{{total:03d}}}"


def _draw(rng: random.Random, spec: AnySumSpec) -> list[int]:
    k = rng.randint(spec.min_operands, spec.max_operands)
    return [rng.randint(spec.min_value, spec.max_value) for _ in range(k)]


def make_problems(
    size: int, split: str = "train", seed: int = 0, spec: AnySumSpec = AnySumSpec(), distinct: bool = True
) -> list[dict]:
    """`size` problems of `split` (distinct unless `distinct=False`), drawn by a generator seeded with (seed, split).

    Each row holds one worked solution, in a random order drawn by the same generator.
    """
    if spec.max_operands * spec.max_value > 999 or spec.min_value < 10 or spec.max_value > 99:
        raise UserError(f"{spec} must keep operands on two digits and totals on three")
    rng = random.Random(f"anysum-{seed}-{split}")
    rows = []
    for numbers in arith.accepted_draws(rng, size, split, spec, _draw, _text, split_of, distinct):
        problem = _text(numbers)
        order = list(range(len(numbers)))
        rng.shuffle(order)
        rows.append({"problem": problem, "answer": str(sum(numbers)), "solution": solution_text(numbers, order)})
    return rows


@dataclass
class AnySum(Arith):
    """Sums taken in any order, with a boxed total: `arith`'s prompt, gold answer and reward; the boxed total is
    zero-padded, so it is read as an integer."""

    def extract(self, completion: str) -> str | None:
        found = _BOXED.findall(completion)
        return str(int(found[-1])) if found else None


def load(path: str | None = None, split: str = "test", size: int = 500, seed: int = 0, **spec) -> AnySum:
    """Generated problems of `split` (no file needed); `path`, when given, is a JSONL of such rows."""
    if path is not None:
        from bridgelm.tasks.base import read_rows

        rows = read_rows(path, ("problem", "answer"))
        for i, row in enumerate(rows, 1):
            try:
                numbers = numbers_of(str(row["problem"]))
            except ValueError as err:
                raise UserError(f"{path}: row {i}: {err}") from None
            if str(row["answer"]).strip() != str(sum(numbers)):
                raise UserError(f"{path}: row {i}: answer {row['answer']!r} is not the sum {sum(numbers)}")
        return AnySum(name="anysum", examples=rows)
    return AnySum(name="anysum", examples=make_problems(size, split, seed, AnySumSpec(**spec)))

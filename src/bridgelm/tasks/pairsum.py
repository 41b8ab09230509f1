"""A search whose samples drift apart in time: find the two numbers that add up to a target.

A problem is 5 distinct two-digit numbers and a three-digit target that exactly one pair of them adds up to, e.g.
`37,12,58,64,21>079`. A worked solution tries pairs in an order of its choosing, one per line, writing each sum on
three digits, and boxes the first pair whose sum is the target:

    ?37+12=049
    ?58+21=079
    \\boxed{58+21}

Why this task. Correct solutions of a problem come in many forms (the order in which pairs are tried), and they
differ in length: a sample that tries the right pair early finishes while its siblings are still searching. Every
try line has the same width, so at every step the samples of a prompt are at the same place of a line, and the
boxed line starts where a try line would: when one sample writes `\\boxed{58+21}`, every sibling still searching is
about to choose its next pair, one digit at a time, in the same steps. What a sibling found is then worth a whole
search to the others. Independent sampling remains the natural baseline: every problem is solvable alone (a full
search takes at most 10 tries), and nothing is split across siblings. A generation budget shorter than the full
search (the demo's `max_new_tokens`) makes finding it early matter.

Problems come from a seeded generator; the split of a problem is decided by a hash of its sorted numbers and target
(test 10%, validation 10%, train 80%). The reward is 1 when the last `\\boxed{a+b}` names two of the problem's
numbers whose sum is the target; the gold answer and extracted answers are written smaller number first.

    task = bridgelm.tasks.load("pairsum", split="test", size=400)
"""

from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass

from bridgelm.errors import UserError
from bridgelm.tasks import arith
from bridgelm.tasks.arith import Arith

_BOXED = re.compile(r"\\boxed\{(\d+)\+(\d+)\}")
_PROBLEM = re.compile(r"^(\d+(?:,\d+)+)>(\d+)$")
TRY = "?"  # the first character of a try line (the boxed line starts at the same step)


@dataclass(frozen=True)
class PairSumSpec:
    """Which problems the generator makes."""

    numbers: int = 5  # numbers in a problem (pairs: numbers * (numbers - 1) / 2)
    min_value: int = 10  # numbers are drawn from min_value..max_value (two digits)
    max_value: int = 89


def parse(problem: str) -> tuple[list[int], int]:
    """`37,12,58>070` -> ([37, 12, 58], 70); ValueError (naming the row's field) when the text is not such a
    problem."""
    found = _PROBLEM.match(problem.strip().rstrip("="))
    if not found:
        raise ValueError(f"field 'problem' is {problem!r}: expected numbers and a target, e.g. '37,12,58>070'")
    return [int(x) for x in found.group(1).split(",")], int(found.group(2))


def problem_text(numbers: list[int], target: int) -> str:
    return ",".join(map(str, numbers)) + f">{target:03d}"


def pairs_to(numbers: list[int], target: int) -> list[tuple[int, int]]:
    """The index pairs (i < j) of `numbers` that add up to `target`."""
    return [(i, j) for i, j in itertools.combinations(range(len(numbers)), 2) if numbers[i] + numbers[j] == target]


def answer_text(a: int, b: int) -> str:
    """A pair as the gold answer and extracted answers write it: smaller number first."""
    return f"{min(a, b)}+{max(a, b)}"


def split_of(problem: str) -> str:
    """The split of a problem, from a stable hash of its sorted numbers and its target (any order: one problem)."""
    numbers, target = parse(problem)
    return arith.split_of(problem_text(sorted(numbers), target))


def solution_text(numbers: list[int], order: list[tuple[int, int]]) -> str:
    """The worked search trying the index pairs `order` until the first whose sum is the target (the last one)."""
    lines = [f"{TRY}{numbers[i]}+{numbers[j]}={numbers[i] + numbers[j]:03d}" for i, j in order]
    i, j = order[-1]
    return "\n".join(lines) + f"\n\\boxed{{{numbers[i]}+{numbers[j]}}}"


def _draw(rng: random.Random, spec: PairSumSpec) -> tuple[list[int], int]:
    while True:
        numbers = rng.sample(range(spec.min_value, spec.max_value + 1), spec.numbers)
        i, j = rng.sample(range(spec.numbers), 2)
        target = numbers[i] + numbers[j]
        if len(pairs_to(numbers, target)) == 1:
            return numbers, target


def make_problems(
    size: int, split: str = "train", seed: int = 0, spec: PairSumSpec = PairSumSpec(), distinct: bool = True
) -> list[dict]:
    """`size` problems of `split` (distinct unless `distinct=False`), drawn by a generator seeded with (seed, split).

    Each row holds one worked solution: the pairs in a random order drawn by the same generator, up to the answer.
    """
    if spec.numbers < 2 or spec.min_value < 10 or spec.max_value > 99 or spec.max_value - spec.min_value < spec.numbers:
        raise UserError(f"{spec} must hold at least 2 distinct two-digit numbers")
    rng = random.Random(f"pairsum-{seed}-{split}")
    rows = []
    drawn = arith.accepted_draws(rng, size, split, spec, _draw, lambda d: problem_text(*d), split_of, distinct)
    for numbers, target in drawn:
        order = list(itertools.combinations(range(len(numbers)), 2))
        rng.shuffle(order)
        (answer,) = pairs_to(numbers, target)
        order = order[: order.index(answer) + 1]
        a, b = numbers[answer[0]], numbers[answer[1]]
        rows.append(
            {
                "problem": problem_text(numbers, target),
                "answer": answer_text(a, b),
                "solution": solution_text(numbers, order),
            }
        )
    return rows


@dataclass
class PairSum(Arith):
    """Find the pair that adds up to the target: `arith`'s prompt, gold answer and reward; the boxed pair is read
    smaller number first."""

    def extract(self, completion: str) -> str | None:
        found = _BOXED.findall(completion)
        return answer_text(int(found[-1][0]), int(found[-1][1])) if found else None


def check_row(row: dict) -> None:
    """ValueError unless `problem` parses, exactly one pair adds up to its target, and `answer` names that pair."""
    problem = row["problem"]
    numbers, target = parse(str(problem))
    found = pairs_to(numbers, target)
    if len(found) != 1:
        raise ValueError(f"field 'problem' is {problem!r}: {len(found)} pairs add up to {target}; expected exactly 1")
    pair = answer_text(numbers[found[0][0]], numbers[found[0][1]])
    if str(row["answer"]).strip() != pair:
        raise ValueError(f"field 'answer' is {row['answer']!r}, but the pair of {problem} is {pair}")


def load(path: str | None = None, split: str = "test", size: int = 500, seed: int = 0, **spec) -> PairSum:
    """Generated problems of `split` (no file needed); `path`, when given, is a JSONL of such rows."""
    if path is not None:
        from bridgelm.tasks.base import read_rows

        return PairSum(name="pairsum", examples=read_rows(path, ("problem", "answer"), check_row))
    return PairSum(name="pairsum", examples=make_problems(size, split, seed, PairSumSpec(**spec)))

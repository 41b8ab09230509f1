"""The demo's offline reasoning task: multi-step addition and subtraction, solved step by step.

A problem is 2-4 integers in [1, 99] joined by + and -, every partial result non-negative, e.g. `48-13+27=`.
The worked solution does one operation per line and ends with the answer boxed:

    48-13=35
    35+27=62
    \\boxed{62}

Problems come from a seeded generator; the split of a problem is decided by a hash of its text (test 10%,
validation 10%, train 80%), so the splits never overlap whatever the sizes asked for. The reward is 1 when
the last `\\boxed{}` of a completion holds the right integer.

    task = bridgelm.tasks.load("arith", split="train", size=2000)
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass

from bridgelm.errors import UserError, check_choice, check_int
from bridgelm.tasks.base import Task

SPLITS = ("train", "validation", "test")
_BOXED = re.compile(r"\\boxed\{(-?\d+)\}")
_PROBLEM = re.compile(r"\d+(?:[+-]\d+)*")  # integers joined by + and -, as the generator writes them


@dataclass(frozen=True)
class ArithSpec:
    """Which problems the generator makes."""

    min_operands: int = 2  # numbers in a problem, at least
    max_operands: int = 4  # and at most
    max_value: int = 99  # operands are drawn from 1..max_value


def split_of(problem: str) -> str:
    """The split a problem belongs to, from a stable hash of its text."""
    bucket = int(hashlib.sha256(problem.encode()).hexdigest()[:8], 16) % 10
    return "test" if bucket == 0 else "validation" if bucket == 1 else "train"


def solve(problem: str) -> tuple[list[str], int]:
    """The worked steps and the answer of a problem such as `48-13+27`."""
    tokens = re.findall(r"\d+|[+-]", problem)
    value = int(tokens[0])
    steps = []
    for op, num in zip(tokens[1::2], tokens[2::2]):
        new = value + int(num) if op == "+" else value - int(num)
        steps.append(f"{value}{op}{num}={new}")
        value = new
    return steps, value


def solution_text(problem: str) -> str:
    steps, answer = solve(problem)
    return "\n".join(steps) + f"\n\\boxed{{{answer}}}"


def _draw(rng: random.Random, spec: ArithSpec) -> str:
    while True:
        k = rng.randint(spec.min_operands, spec.max_operands)
        value = rng.randint(1, spec.max_value)
        text = str(value)
        ok = True
        for _ in range(k - 1):
            num = rng.randint(1, spec.max_value)
            op = rng.choice("+-")
            value = value + num if op == "+" else value - num
            if value < 0:
                ok = False
                break
            text += f"{op}{num}"
        if ok:
            return text


def make_problems(
    size: int, split: str = "train", seed: int = 0, spec: ArithSpec = ArithSpec(), distinct: bool = True
) -> list[dict]:
    """`size` problems of `split` (distinct ones unless `distinct=False`), drawn by a generator seeded with (seed,
    split)."""
    rng = random.Random(f"arith-{seed}-{split}")
    rows = []
    for problem in accepted_draws(rng, size, split, spec, _draw, str, split_of, distinct):
        _, answer = solve(problem)
        rows.append({"problem": problem, "answer": str(answer), "solution": solution_text(problem)})
    return rows


def accepted_draws(rng: random.Random, size: int, split: str, spec, draw, problem_of, split_of, distinct: bool):
    """Yield `size` draws `draw(rng, spec)` whose problem text `problem_of(draw)` is in `split` (by `split_of`) and,
    when `distinct`, not seen before. The caller may use `rng` between yields (its draws stay in one sequence)."""
    check_choice("split", split, SPLITS)
    check_int("size", size)
    seen: set[str] = set()
    accepted = attempts = 0
    while accepted < size:
        attempts += 1
        if attempts > 200 * size + 10_000:
            raise UserError(f"cannot draw {size} distinct {split} problems from {spec}")
        drawn = draw(rng, spec)
        problem = problem_of(drawn)
        if (distinct and problem in seen) or split_of(problem) != split:
            continue
        seen.add(problem)
        accepted += 1
        yield drawn


@dataclass
class Arith(Task):
    """Step-by-step arithmetic with a boxed integer answer."""

    def prompt(self, example: dict) -> str:
        return f"{example['problem']}="

    def answer(self, example: dict) -> str:
        return str(example["answer"]).strip()

    def extract(self, completion: str) -> str | None:
        found = _BOXED.findall(completion)
        return found[-1] if found else None

    def reward(self, completion: str, example: dict) -> float:
        return 1.0 if self.extract(completion) == self.answer(example) else 0.0


def check_row(row: dict) -> None:
    """ValueError unless `problem` is integers joined by + and - and `answer` is its value, as an integer."""
    problem, answer = row["problem"], row["answer"]
    if not isinstance(problem, str) or not _PROBLEM.fullmatch(problem):
        raise ValueError(f"field 'problem' is {problem!r}: expected integers joined by + and -, e.g. '48-13+27'")
    text = str(answer).strip() if isinstance(answer, (str, int)) and not isinstance(answer, bool) else ""
    if not re.fullmatch(r"-?(0|[1-9]\d*)", text):
        raise ValueError(f"field 'answer' is {answer!r}: expected an integer")
    value = solve(problem)[1]
    if int(text) != value:
        raise ValueError(f"field 'answer' is {answer!r}, but {problem} = {value}")


def load(path: str | None = None, split: str = "test", size: int = 500, seed: int = 0, **spec) -> Arith:
    """Generated problems of `split` (no file needed); `path`, when given, is a JSONL of such rows."""
    if path is not None:
        from bridgelm.tasks.base import read_rows, resolve_local

        return Arith(name="arith", examples=read_rows(resolve_local(path, split), ("problem", "answer"), check_row))
    return Arith(name="arith", examples=make_problems(size, split, seed, ArithSpec(**spec)))

"""Noisy clues: the demo's positive control, a task where siblings carry the answer and no sample reaches it alone.

A problem is 8 digits, e.g. `73779477`, in which one digit (the answer, here 7) fills 4 places and the other places
hold distinct other digits. A worked solution reads two places drawn at random, a line each (the place and its
digit), and boxes the digit of one of them, drawn at random:

    h3=7
    h6=9
    \\boxed{9}

The base model is pre-trained on such solutions, so it learns to read two random places exactly and to box one of
their digits at random: alone, a sample is right half the time (4 places in 8), and when its two reads differ it has
nothing that says which one to trust. Together, the 16 reads of a group of 8 hold the answer: the right digit is by
far the most frequent (half of the reads, against 1 in 8 for each other digit), so the majority of a group's reads is
right almost always. Every sample has the same layout and length, so at the step where a sample boxes its answer,
each sibling's state holds its own two reads: a Bridge block that averages its siblings can read the vote. A sample
alone could only do the same by counting the digits of the prompt, which the frozen base model never learned to do.
Nothing is split across samples: each draws its own evidence from its own randomness.

Bridge w=8 − Bridge w=1 with the same weights is the effect to detect; foreign siblings (groups made of samples of
different problems) must hurt, since their reads vote for other digits. If the demo cannot show both, it cannot
detect sibling use at all.

The split of a problem is decided by a hash of its digits (test 10%, validation 10%, train 80%). The reward is 1
when the last `\\boxed{}` holds the answer.

    task = bridgelm.tasks.load("hint", split="test", size=240)
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass

from bridgelm.errors import UserError
from bridgelm.tasks import arith
from bridgelm.tasks.arith import Arith

_BOXED = re.compile(r"\\boxed\{(\d)\}")
DIGITS = "0123456789"


@dataclass(frozen=True)
class HintSpec:
    """Which problems the generator makes."""

    digits: int = 8  # places in a problem (at most 9: a hint's index is one digit)
    copies: int = 4  # places holding the answer; the other places hold distinct other digits
    reads: int = 2  # places a worked solution reads (each drawn uniformly); it boxes the digit of one of them, drawn
    # uniformly: which read to trust is a coin flip for a sample alone
    preamble: int = 0  # a worked solution starts with 0..preamble filler dots (drawn uniformly), so that siblings
    # reach their reads at different positions: Bridge reads a sibling only at the same position (the misalignment
    # dose-response of the positive control)


def answer_of(problem: str) -> str:
    """The answer of `73179427` -> `7`, the digit that fills the most places; ValueError when the text is not a
    string of digits with one most frequent digit."""
    if not re.fullmatch(r"\d{2,9}", problem):
        raise ValueError(f"problem {problem!r} is not a string of 2 to 9 digits such as '73179427'")
    counts = Counter(problem).most_common(2)
    if len(counts) > 1 and counts[0][1] == counts[1][1]:
        raise ValueError(f"problem {problem!r} has no single most frequent digit")
    return counts[0][0]


def solution_text(problem: str, places: list[int], boxed: str, filler: int = 0) -> str:
    """The worked solution that reads `places` (1-based) of `problem`, a line each (its index and digit), then boxes
    `boxed`, after `filler` dots."""
    reads = "".join(f"h{p}={problem[p - 1]}\n" for p in places)
    return f"{'.' * filler}{reads}\\boxed{{{boxed}}}"


def _draw(rng: random.Random, spec: HintSpec) -> str:
    """A problem: the answer in `copies` places, the other places filled with distinct other digits."""
    answer = rng.choice(DIGITS)
    others = [d for d in DIGITS if d != answer]
    rng.shuffle(others)
    places = [answer] * spec.copies + others[: spec.digits - spec.copies]
    rng.shuffle(places)
    return "".join(places)


def make_problems(
    size: int, split: str = "train", seed: int = 0, spec: HintSpec = HintSpec(), distinct: bool = True
) -> list[dict]:
    """`size` problems of `split` (distinct unless `distinct=False`), drawn by a generator seeded with (seed, split),
    each with a worked solution that reads a place drawn uniformly by the same generator."""
    if not 2 <= spec.copies < spec.digits <= 9 or spec.reads < 1 or spec.preamble < 0:
        raise UserError(f"{spec}: expected 2 <= copies < digits <= 9, reads >= 1 and preamble >= 0")
    rng = random.Random(f"hint-{seed}-{split}")
    fillers = random.Random(f"hint-preamble-{seed}-{split}")  # its own stream: the same problems at every preamble
    rows = []
    for problem in arith.accepted_draws(rng, size, split, spec, _draw, str, arith.split_of, distinct):
        places = [rng.randint(1, spec.digits) for _ in range(spec.reads)]
        boxed = problem[rng.choice(places) - 1]
        filler = fillers.randint(0, spec.preamble)
        solution = solution_text(problem, places, boxed, filler)
        rows.append({"problem": problem, "answer": answer_of(problem), "solution": solution})
    return rows


@dataclass
class Hint(Arith):
    """Noisy clues: the prompt is the digits and `?`; the reward is 1 when the last boxed digit is the most frequent
    one."""

    def prompt(self, example: dict) -> str:
        return f"{example['problem']}?"

    def extract(self, completion: str) -> str | None:
        found = _BOXED.findall(completion)
        return found[-1] if found else None


def _check_row(row: dict) -> None:
    if str(row["answer"]).strip() != answer_of(str(row["problem"])):
        raise ValueError(f"answer {row['answer']!r} is not the most frequent digit of {row['problem']!r}")


def load(path: str | None = None, split: str = "test", size: int = 500, seed: int = 0, **spec) -> Hint:
    """Generated problems of `split` (no file needed); `path`, when given, is a JSONL of such rows."""
    if path is not None:
        from bridgelm.tasks.base import read_rows, resolve_local

        return Hint(name="hint", examples=read_rows(resolve_local(path, split), ("problem", "answer"), _check_row))
    return Hint(name="hint", examples=make_problems(size, split, seed, HintSpec(**spec)))

"""The positive control's task (tasks/hint.py): problems, worked solutions and grading."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from bridgelm.tasks import load
from bridgelm.tasks.hint import HintSpec, answer_of, make_problems


def test_the_answer_is_the_one_most_frequent_digit():
    assert answer_of("73179477") == "7"
    with pytest.raises(ValueError, match="no single most frequent"):
        answer_of("1122")
    with pytest.raises(ValueError, match="string of 2 to 9 digits"):
        answer_of("12a4")


def test_problems_hold_the_answer_in_copies_places_and_distinct_other_digits():
    spec = HintSpec()
    for row in make_problems(300, "train", 0, spec, distinct=False):
        counts = Counter(row["problem"])
        assert len(row["problem"]) == spec.digits and counts[row["answer"]] == spec.copies
        assert all(c == 1 for d, c in counts.items() if d != row["answer"])


def test_worked_solutions_read_uniform_places_and_box_one_of_their_digits():
    """Each solution reads `reads` places drawn uniformly (their digits copied exactly) and boxes the digit of one of
    them, drawn uniformly: a boxed digit is right copies/digits of the time, and which read to box is a coin flip."""
    spec = HintSpec()
    rows = make_problems(4000, "train", 0, spec, distinct=False)
    places, right = Counter(), []
    for row in rows:
        *reads, boxed = row["solution"].split("\n")
        assert len(reads) == spec.reads and len(boxed) == len("\\boxed{1}")  # one layout: siblings stay aligned
        digits = []
        for read in reads:
            place, digit = int(read[1]), read[3]
            assert read == f"h{place}={digit}" and row["problem"][place - 1] == digit
            places[place] += 1
            digits.append(digit)
        assert boxed[-2] in digits
        right.append(boxed[-2] == row["answer"])
    assert set(places) == set(range(1, spec.digits + 1))
    assert min(places.values()) > 0.8 * spec.reads * len(rows) / spec.digits
    assert abs(sum(right) / len(rows) - spec.copies / spec.digits) < 0.03


def test_reward_and_a_data_file():
    task = load("hint", split="test", size=20)
    ex = task.examples[0]
    assert task.prompt(ex) == ex["problem"] + "?"
    assert task.reward(f"h1=0\n\\boxed{{{ex['answer']}}}", ex) == 1.0
    wrong = next(d for d in "0123456789" if d != ex["answer"])
    assert task.reward(f"h1={ex['answer']}\n\\boxed{{{wrong}}}", ex) == 0.0
    splits = {split: {r["problem"] for r in load("hint", split=split, size=50).examples} for split in ("train", "test")}
    assert not splits["train"] & splits["test"]


def test_a_data_file_with_a_wrong_answer_is_refused(tmp_path):
    path = tmp_path / "test.jsonl"
    path.write_text(json.dumps({"problem": "73179477", "answer": "3"}) + "\n")
    with pytest.raises(Exception, match="not the most frequent digit"):
        load("hint", path=str(path))


def test_a_preamble_misaligns_solutions_and_keeps_the_problems():
    """Preamble p: each worked solution starts with 0..p filler dots, drawn from a stream of its own, so the problems
    and the reads are those of preamble 0 and only the positions move."""
    plain = make_problems(400, "train", 1, HintSpec(), distinct=False)
    padded = make_problems(400, "train", 1, HintSpec(preamble=4), distinct=False)
    assert [r["problem"] for r in plain] == [r["problem"] for r in padded]
    lengths = Counter()
    for a, b in zip(plain, padded):
        dots = len(b["solution"]) - len(b["solution"].lstrip("."))
        assert b["solution"][dots:] == a["solution"]
        lengths[dots] += 1
    assert set(lengths) == {0, 1, 2, 3, 4} and min(lengths.values()) > 40  # uniform over 0..4
    with pytest.raises(ValueError, match="preamble >= 0"):
        make_problems(4, "train", 1, HintSpec(preamble=-1))


def test_misalignment_settings_and_refusals():
    from bridgelm.demo.config import DemoConfig
    from bridgelm.demo.control import HINT_TOKENS, ControlDirs
    from bridgelm.demo.misalign import MAX_PREAMBLE, check_preambles, control_at, dirs_at

    base = DemoConfig().control
    at = control_at(base, 16)
    assert at.base.task.preamble == 16
    assert at.rl.rollout.max_new_tokens == at.eval.sampling.max_new_tokens == HINT_TOKENS + 16
    assert control_at(base, 0) == base
    root = ControlDirs(__import__("pathlib").Path("x"))
    assert dirs_at(root, 0) is root and dirs_at(root, 4).root.name == "misalign_p4"
    check_preambles([0, 4, MAX_PREAMBLE])
    for bad in (-1, MAX_PREAMBLE + 1):
        with pytest.raises(ValueError, match=rf"--misalignment {bad}: expected preambles of 0 to {MAX_PREAMBLE}"):
            check_preambles([bad])

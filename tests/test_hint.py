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


def test_worked_solutions_read_a_uniform_place_and_box_a_digit_right_as_often_either_way():
    """The hint copies the digit of its place; half the solutions box it, half box the digit of a place drawn again:
    a boxed digit is right copies/digits of the time either way, so following the hint alone gains nothing."""
    spec = HintSpec()
    rows = make_problems(4000, "train", 0, spec, distinct=False)
    places, follows, right = Counter(), [], []
    for row in rows:
        text = row["solution"]
        assert len(text) == len("h3=1\n\\boxed{1}")  # one layout: siblings stay aligned step by step
        place, hint, boxed = int(text[1]), text[3], text[-2]
        assert row["problem"][place - 1] == hint
        places[place] += 1
        follows.append(boxed == hint)
        right.append(boxed == row["answer"])
    assert set(places) == set(range(1, spec.digits + 1)) and min(places.values()) > 0.8 * len(rows) / spec.digits
    rate = spec.copies / spec.digits  # a uniform place holds the answer this often
    same = rate * rate + (1 - rate) / spec.digits  # a place drawn again holds the hint's digit this often
    assert abs(sum(follows) / len(rows) - (spec.follow + (1 - spec.follow) * same)) < 0.03
    assert abs(sum(right) / len(rows) - rate) < 0.03


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

"""Graders on real benchmark rows from ../shared/data, loaders and their error messages."""

from __future__ import annotations

import json
import random
import re
import sys
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bridgelm import tasks
from bridgelm.tasks import answers, base
from bridgelm.tasks import countdown as countdown_mod
from bridgelm.tasks import math as math_mod

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
INTEGER = re.compile(r"-?\d+")


def data_file(*parts: str) -> Path:
    path = DATA.joinpath(*parts)
    if not path.is_file():
        pytest.skip(f"benchmark data {path} is absent (expected the shared data folder next to the repo)")
    return path


@pytest.fixture(scope="module")
def math500():
    # 30 s a grading call, not the default 5: the 500 gold answers hold sympy's slowest comparisons (an interval
    # once took over 5 s on a loaded 2-core CI machine and was scored as refused). Timeouts have tests of their own.
    return tasks.load("math", data_file("math", "math500.jsonl"), timeout=30.0)


@pytest.fixture(scope="module")
def gsm8k_test():
    return tasks.load("gsm8k", data_file("gsm8k", "test.jsonl"))


@pytest.fixture(scope="module")
def countdown():
    return tasks.load("countdown", size=40, seed=0)


# ----------------------------------------------------------------------------- answer helpers


def test_last_boxed():
    assert answers.last_boxed(r"a \boxed{1} then \boxed{\frac{1}{2}} end") == r"\frac{1}{2}"
    assert answers.last_boxed(r"nested \boxed{\sqrt{\frac{a}{b}}}") == r"\sqrt{\frac{a}{b}}"
    assert answers.last_boxed(r"so $\boxed 5$") == "5"
    assert answers.last_boxed(r"\fbox{x+1}") == "x+1"
    assert answers.last_boxed(r"unclosed \boxed{3") is None
    assert answers.last_boxed("no box") is None


def test_parse_number():
    assert answers.parse_number("1,234") == 1234.0
    assert answers.parse_number("$18.00") == 18.0
    assert answers.parse_number("50\\%") == 50.0
    assert answers.parse_number("3.0") == 3.0
    assert answers.parse_number("1,2") is None
    assert answers.parse_number("x") is None


# ----------------------------------------------------------------------------- MATH


def test_math_prompt_keeps_single_instruction(math500):
    prompt = math500.prompt(math500.examples[0])
    assert prompt.count(base.BOXED_INSTRUCTION) == 1 and prompt.endswith(base.BOXED_INSTRUCTION)
    assert base.with_instruction("What is 1+1?").endswith("\n" + base.BOXED_INSTRUCTION)


def test_math500_every_gold_accepted(math500):
    pairs = [(f"Thus the final answer is $\\boxed{{{ex['answer']}}}$.", ex) for ex in math500.examples]
    assert len(pairs) == 500
    rewards = math500.reward_many(pairs)
    refused = [ex["answer"] for (_, ex), r in zip(pairs, rewards) if r != 1.0]
    assert refused == []


def test_math500_other_answers_refused(math500):
    # Distinct plain integers can never be equal, so these pairs are certainly wrong.
    rows = [ex for ex in math500.examples if INTEGER.fullmatch(ex["answer"].strip())]
    rng = random.Random(0)
    pairs = []
    for ex in rng.sample(rows, 80):
        other = rng.choice([o for o in rows if int(o["answer"]) != int(ex["answer"])])
        pairs.append((f"The answer is $\\boxed{{{other['answer']}}}$.", ex))
    assert math500.reward_many(pairs) == [0.0] * len(pairs)


@pytest.mark.parametrize(
    "gold, pred, expected",
    [
        ("\\frac{1}{2}", "0.5", 1.0),
        ("0.5", "\\frac{1}{2}", 1.0),
        ("2\\sqrt{2}", "\\sqrt{8}", 1.0),
        ("\\frac{14}{3}", "\\frac{28}{6}", 1.0),
        ("\\frac{14}{3}", "\\frac{3}{14}", 0.0),
        ("p - q", "p + q", 0.0),
        ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3, \\pi)", 0.0),
    ],
)
def test_math_equivalent_and_different_forms(gold, pred, expected):
    assert math_mod.grade(gold, f"We get $\\boxed{{{pred}}}$.") == expected


def test_math_grading_from_worker_threads(math500):
    examples = math500.examples[:16]
    jobs = [(f"\\boxed{{{ex['answer']}}}", ex, 1.0) for ex in examples]
    jobs += [("\\boxed{\\text{no idea}}", ex, 0.0) for ex in examples[:4]]

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda job: math500.reward(job[0], job[1]), jobs))
    assert results == [expected for _, _, expected in jobs]

    box: list[float] = []
    thread = threading.Thread(target=lambda: box.append(math_mod.grade("\\frac{14}{3}", "\\boxed{14/3}")))
    thread.start()
    thread.join(60)
    assert box == [1.0]


def test_math_hanging_answer_is_bounded_and_scored_zero():
    # sympy spends minutes on 9^(9^(9^9)) (checked by hand: > 15 s without a timeout).
    grader = math_mod.MathGrader(timeout=1.0)
    try:
        assert grader.grade("5", "\\boxed{5}") == 1.0  # starts the worker outside the timed call
        start = time.monotonic()
        assert grader.grade("5", "So the answer is \\boxed{9^{9^{9^{9}}}}") == 0.0
        elapsed = time.monotonic() - start
        assert 0.9 <= elapsed < 10, elapsed  # it really hung, and was cut at the timeout
        assert grader.restarts == 1
        assert grader.grade("5", "\\boxed{5}") == 1.0  # a fresh worker takes over
    finally:
        grader.close()


def test_math_timeout_hook_in_thread():
    grader = math_mod.MathGrader(timeout=0.5)
    try:
        # The worker starts (imports sympy) before the clock: on a loaded machine that alone can take many seconds.
        assert grader.grade("1", "\\boxed{1}", timeout=60) == 1.0
        box: list[float] = []
        thread = threading.Thread(target=lambda: box.append(grader.debug_sleep(30)))
        start = time.monotonic()
        thread.start()
        thread.join(30)
        assert box == [0.0] and time.monotonic() - start < 20
        assert grader.restarts == 1
        assert grader.grade("\\frac{1}{2}", "\\boxed{0.5}") == 1.0
    finally:
        grader.close()


def test_math_rejects_bad_timeout():
    with pytest.raises(ValueError, match="timeout=0"):
        math_mod.MathGrader(timeout=0)


# ----------------------------------------------------------------------------- GSM8K


def with_commas(gold: str) -> str:
    return f"{int(gold):,}" if INTEGER.fullmatch(gold) else gold


def test_gsm8k_every_gold_accepted_in_four_forms(gsm8k_test):
    assert len(gsm8k_test) == 1319
    refused = []
    for ex in gsm8k_test.examples:
        gold = gsm8k_test.answer(ex)
        forms = [
            f"Adding everything up gives 3 + 4 = 7 items.\n#### {gold}",
            f"So the total is $\\boxed{{{gold}}}$.",
            f"We computed 12 * 3 = 36 before. The answer is {gold}.",
            f"First 2 + 2 = 4, and in the end she pays {with_commas(gold)} dollars",
        ]
        refused += [(gold, f) for f in forms if gsm8k_test.reward(f, ex) != 1.0]
    assert refused == []


@pytest.mark.parametrize(
    "text, number",
    [
        ("So, the answer is 2 * 2 = 4 pens.", "4"),  # was 2: a small model's usual last line
        ("#### 3+2=5", "5"),
        ("The answer is: $3 + $2 = $5", "5"),
        ("the final answer is 160 - 160 = 0.", "0"),
        ("The answer is -4 + 1 = -3.", "-3"),
        ("The answer is 18. Before that, 3 + 2 = 5.", "18"),  # a later sentence's sum is not the answer
        ("The answer is 3.5 = 7/2", "3.5"),  # a fraction after "=" is not one number
        ("The answer is 7 = seven", "7"),
        ("The answer is 2 * 4 = **8**", "8"),
        ("The answer is 3 * 4 = 12 + 1 = 13.", "13"),  # a chain of sums: its last result
        # the answer first, then how it is made or what it equals: the answer stands
        ("The answer is $1,200 = 12 * $100.", "1200"),
        ("The answer is 6 = 2 x 3.", "6"),
        ("The answer is 64 = 8^2.", "64"),
        ("The answer is 15 because 20 - 5 = 15, and 15 + 3 = 18 is the total.", "15"),
        ("The answer is 120 minutes = 2 hours.", "120"),
        ("#### 1\nWait, that is wrong. So the answer is 2.", "2"),  # the later marker says it last (was 1)
        ("So the answer is 2.\n#### 3", "3"),
        ("#### 4\nThe answer is below.", "4"),  # a marker no number follows: the one before it
    ],
)
def test_a_sum_worked_out_after_the_marker_gives_its_result(text, number):
    from bridgelm.tasks.answers import extract_number_answer

    assert extract_number_answer(text) == number


def test_gsm8k_wrong_number_refused(gsm8k_test):
    for ex in gsm8k_test.examples[:200]:
        wrong = str(int(gsm8k_test.answer(ex)) + 1)
        assert gsm8k_test.reward(f"#### {wrong}", ex) == 0.0
        assert gsm8k_test.reward(f"\\boxed{{{wrong}}}", ex) == 0.0
        assert gsm8k_test.reward("I cannot solve this.", ex) == 0.0


def test_gsm8k_gold_and_extraction(gsm8k_test):
    ex = gsm8k_test.examples[0]
    assert gsm8k_test.answer(ex) == "18"
    assert gsm8k_test.prompt(ex).endswith(base.BOXED_INSTRUCTION)
    assert gsm8k_test.extract("The answer is $1,234.50.") == "1234.5"
    assert gsm8k_test.extract("x = \\boxed{18 \\text{ dollars}}") == "18"
    assert gsm8k_test.reward("\\boxed{18.0}", ex) == 1.0
    with ThreadPoolExecutor(max_workers=2) as pool:
        assert pool.submit(gsm8k_test.reward, "#### 18", ex).result() == 1.0


# ----------------------------------------------------------------------------- Countdown


def test_countdown_reference_solutions_score_one(countdown):
    assert len(countdown) == 40
    for ex in countdown.examples:
        assert countdown.reward(f"Done: \\boxed{{{ex['solution']}}}", ex) == 1.0
        assert countdown.reward(f"<answer>{ex['solution']}</answer>", ex) == 1.0


def test_countdown_wrong_expressions_score_zero(countdown):
    ex = countdown.examples[0]
    numbers, target, solution = ex["numbers"], ex["target"], ex["solution"]
    assert countdown.reward(f"\\boxed{{{solution} + 1}}", ex) == 0.0  # number not given
    assert countdown.reward(f"\\boxed{{{solution} + 1000 - 1000}}", ex) == 0.0  # same value, foreign numbers
    assert countdown.reward("\\boxed{" + " + ".join(map(str, numbers)) + "}", ex) == float(sum(numbers) == target)
    assert countdown.reward(f"\\boxed{{{solution} + {numbers[0]} - {numbers[0]}}}", ex) == 0.0  # reused
    assert countdown.reward(f"\\boxed{{{target}}}", ex) == 0.0
    assert countdown.reward("\\boxed{1/0}", ex) == 0.0
    assert countdown.reward("no answer", ex) == 0.0


def test_countdown_latex_forms():
    ex = {"numbers": [66, 34, 98, 54, 6], "target": 164}
    task = countdown_mod.Countdown(name="countdown", examples=[ex])
    assert task.reward("\\boxed{6 \\times (98 - 54) - 34 - 66 = 164}", ex) == 1.0
    assert task.reward("\\boxed{\\left(98 - 54\\right) \\cdot 6 - (34 + 66)}", ex) == 1.0
    assert task.reward("\\boxed{-34 + 6*(98 - 54) - 66}", ex) == 1.0
    assert task.reward("\\boxed{6*(98 - 54) - 34 - 66}", {"numbers": [66, 34, 98, 54, 6, 1], "target": 164}) == 0.0
    relaxed = countdown_mod.Countdown(name="countdown", examples=[ex], use_all=False)
    assert relaxed.reward("\\boxed{6*(98-54) - 34 - 66}", {"numbers": [66, 34, 98, 54, 6, 1], "target": 164}) == 1.0


def test_countdown_never_executes_code(tmp_path):
    ex = {"numbers": [1, 2], "target": 3}
    task = countdown_mod.Countdown(name="countdown", examples=[ex])
    marker = tmp_path / "executed"
    attacks = [
        "\\boxed{__import__('os')}",
        f"\\boxed{{__import__('pathlib').Path('{marker}').touch() or 3}}",
        "\\boxed{(lambda: 3)()}",
        "\\boxed{1 ** 2 + 2}",
        "\\boxed{[1, 2]}",
    ]
    for attack in attacks:
        assert task.reward(attack, ex) == 0.0, attack
    assert not marker.exists()


def test_countdown_splits_are_disjoint_and_deterministic():
    test_a = countdown_mod.make_problems(30, seed=0, split="test")
    test_b = countdown_mod.make_problems(30, seed=0, split="test")
    train = countdown_mod.make_problems(30, seed=0, split="train")
    key = lambda ex: (tuple(ex["numbers"]), ex["target"])  # noqa: E731
    assert [key(e) for e in test_a] == [key(e) for e in test_b]
    assert not {key(e) for e in test_a} & {key(e) for e in train}
    with pytest.raises(ValueError, match="split='dev'"):
        countdown_mod.make_problems(3, split="dev")


# ----------------------------------------------------------------------------- loading


def test_read_rows_missing_field_names_file_line_and_field(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"question": "q1", "answer": "#### 1"}\n{"question": "q2"}\n', encoding="utf-8")
    with pytest.raises(ValueError) as info:
        base.read_rows(path, ("question", "answer"))
    message = str(info.value)
    assert str(path) in message and ", line 2" in message and "'answer'" in message


def test_read_rows_malformed_line_names_file_and_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"problem": "p", "answer": "1"}\n\n{"problem": "p", "answer": \n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"rows\.jsonl, line 3: malformed JSON"):
        base.read_rows(path, ("problem", "answer"))


def test_read_rows_json_and_parquet(tmp_path):
    rows = [{"problem": "p", "answer": "1"}, {"problem": "q", "answer": "2"}]
    (tmp_path / "list.json").write_text(json.dumps(rows), encoding="utf-8")
    (tmp_path / "wrapped.json").write_text(json.dumps({"data": rows}), encoding="utf-8")
    assert base.read_rows(tmp_path / "list.json", ("problem",)) == rows
    assert base.read_rows(tmp_path / "wrapped.json", ("problem",)) == rows
    (tmp_path / "bad.json").write_text(json.dumps([rows[0], {"problem": "x"}]), encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.json: item 2: missing field 'answer'"):
        base.read_rows(tmp_path / "bad.json", ("problem", "answer"))
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    assert base.read_rows(tmp_path / "rows.parquet", ("problem", "answer")) == rows


def test_load_local_folder_with_split(tmp_path):
    (tmp_path / "test.jsonl").write_text('{"question": "q", "answer": "x\\n#### 1,500"}\n', encoding="utf-8")
    task = tasks.load("gsm8k", str(tmp_path), split="test")
    assert task.answer(task.examples[0]) == "1500"
    with pytest.raises(FileNotFoundError, match="train.jsonl"):
        tasks.load("gsm8k", str(tmp_path), split="train")


def test_hub_fallback_errors_are_clear(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # "not installed"
    with pytest.raises(RuntimeError, match="'datasets' package is not installed"):
        base.load_rows("someone/some-dataset", "test", ("question",))
    fake = types.ModuleType("datasets")

    def offline(*args, **kwargs):
        raise ConnectionError("offline")

    fake.load_dataset = offline
    monkeypatch.setitem(sys.modules, "datasets", fake)
    with pytest.raises(RuntimeError, match="could not load 'someone/some-dataset'.*offline"):
        base.load_rows("someone/some-dataset", "test", ("question",))


def test_unknown_task_lists_known_names():
    with pytest.raises(ValueError, match="unknown task 'gsm9k'.*countdown, gpqa, gsm8k, hint, math"):
        tasks.load("gsm9k")


def test_format_chat():
    class Plain:
        chat_template = None

    class Chat:
        chat_template = "{{ messages }}"

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            assert add_generation_prompt is True and tokenize is False
            return f"<user>{messages[0]['content']}</user><assistant>"

    assert base.format_chat(Plain(), "hi") == "hi"
    assert base.format_chat(Chat(), "hi") == "<user>hi</user><assistant>"


# ---------------------------------------------------------------------------------------------- anysum


def test_anysum_solutions_have_one_layout_whatever_the_order():
    from itertools import permutations

    from bridgelm.tasks import anysum

    numbers = [37, 12, 58, 64]
    texts = {anysum.solution_text(numbers, list(order)) for order in permutations(range(4))}
    assert len(texts) == 24  # every order is a distinct trace...
    assert len({len(t) for t in texts}) == 1  # ...of one length
    assert {t.splitlines()[-1] for t in texts} == {"\\boxed{171}"}
    assert anysum.solution_text(numbers, [1, 0, 2, 3]) == "12+37=049\n049+58=107\n107+64=171\n\\boxed{171}"


def test_anysum_rows_grading_and_splits():
    from bridgelm.tasks import anysum

    rows = anysum.make_problems(60, "train", seed=3)
    assert rows == anysum.make_problems(60, "train", seed=3)  # seeded
    task = anysum.AnySum("anysum", rows)
    for row in rows:
        numbers = anysum.numbers_of(row["problem"])
        assert 3 <= len(numbers) <= 5 and all(10 <= x <= 99 for x in numbers)
        assert int(row["answer"]) == sum(numbers)
        assert task.reward(row["solution"], row) == 1.0
        assert anysum.split_of(row["problem"]) == "train"
        # The split follows the numbers, not the order they are written in.
        assert anysum.split_of("+".join(map(str, reversed(numbers)))) == "train"
    ex = {"problem": "20+30+40", "answer": "90"}
    assert task.reward("20+30=050\n050+40=090\n\\boxed{090}", ex) == 1.0  # padded total, compared as an integer
    assert task.reward("\\boxed{91}", ex) == 0.0
    assert task.reward("no box", ex) == 0.0
    assert task.extract("\\boxed{12} then \\boxed{090}") == "90"  # the last box counts
    test = {r["problem"] for r in anysum.make_problems(50, "test", seed=3)}
    assert not test & {r["problem"] for r in rows}


def test_anysum_file_rows_are_checked(tmp_path):
    from bridgelm.tasks import anysum

    good = tmp_path / "good.jsonl"
    good.write_text('{"problem": "10+20+30", "answer": "60"}\n')
    assert anysum.load(str(good)).examples[0]["answer"] == "60"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "10+20+30", "answer": "61"}\n')
    with pytest.raises(ValueError, match="row 1: answer '61' is not the sum 60"):
        anysum.load(str(bad))
    with pytest.raises(ValueError, match="is not a sum"):
        anysum.numbers_of("10*20")


# ---------------------------------------------------------------------------------------------- pairsum


def test_pairsum_search_lines_have_one_width_and_stop_at_the_pair():
    from bridgelm.tasks import pairsum

    numbers, target = [37, 12, 58, 64, 21], 79
    assert pairsum.pairs_to(numbers, target) == [(2, 4)]
    text = pairsum.solution_text(numbers, [(0, 1), (2, 4)])
    assert text == "?37+12=049\n?58+21=079\n\\boxed{58+21}"
    rows = pairsum.make_problems(80, "train", seed=3)
    assert rows == pairsum.make_problems(80, "train", seed=3)  # seeded
    task = pairsum.PairSum("pairsum", rows)
    lengths = set()
    for row in rows:
        numbers, target = pairsum.parse(row["problem"])
        assert len(set(numbers)) == 5 and all(10 <= x <= 89 for x in numbers)
        assert len(pairsum.pairs_to(numbers, target)) == 1  # exactly one pair reaches the target
        *tries, box = row["solution"].split("\n")
        assert {len(line) for line in tries} == {10} and all(line.startswith(pairsum.TRY) for line in tries)
        assert [int(line[-3:]) == target for line in tries] == [False] * (len(tries) - 1) + [True]  # stops there
        assert len(set(tries)) == len(tries)  # no pair tried twice
        assert box.startswith("\\boxed{") and task.reward(row["solution"], row) == 1.0
        assert pairsum.split_of(row["problem"]) == "train"
        assert pairsum.split_of(pairsum.problem_text(numbers[::-1], target)) == "train"  # any order: one problem
        lengths.add(len(tries))
    assert len(lengths) >= 6  # the samples of a problem drift apart in time: searches of many lengths
    ex = {"problem": "37,12,58,64,21>079", "answer": "21+58"}
    assert task.reward("\\boxed{58+21}", ex) == task.reward("\\boxed{21+58}", ex) == 1.0  # either order
    assert task.reward("\\boxed{37+42}", ex) == 0.0  # the right sum from numbers not in the problem
    assert task.reward("?58+21=079", ex) == 0.0  # found but not boxed
    assert task.extract("\\boxed{37+12}\n\\boxed{58+21}") == "21+58"  # the last box counts
    test = {r["problem"] for r in pairsum.make_problems(50, "test", seed=3)}
    assert not test & {r["problem"] for r in rows}


def test_pairsum_file_rows_are_checked(tmp_path):
    from bridgelm.tasks import load

    good = tmp_path / "good.jsonl"
    good.write_text('{"problem": "37,12,58,64,21>079", "answer": "21+58"}\n')
    assert load("pairsum", str(good)).examples[0]["answer"] == "21+58"
    for row, message in [
        (
            '{"problem": "37,12,58,64,21>079", "answer": "12+37"}',
            "'answer' is '12+37', but the pair of 37,12,58,64,21>079 is 21+58",
        ),
        ('{"problem": "37,12,58,64,21>049", "answer": "12+37"}', None),
        (
            '{"problem": "10,20,30,40>050", "answer": "10+40"}',
            "'problem' is '10,20,30,40>050': 2 pairs add up to 50; expected exactly 1",
        ),
        ('{"problem": "10*20>200", "answer": "10+20"}', "'problem' is '10*20>200': expected numbers and a target"),
    ]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(row + "\n")
        if message is None:
            assert load("pairsum", str(bad)).examples[0]["answer"] == "12+37"
        else:
            with pytest.raises(ValueError, match=r"bad\.jsonl, line 1: field " + re.escape(message)):
                load("pairsum", str(bad))


def test_correct_means_the_full_reward():
    from bridgelm.tasks.base import check_rewards, is_correct

    assert is_correct(1.0) and not is_correct(0.0)
    assert not is_correct(0.75)  # a graded score (ROUGE-1) counts as correct only when perfect
    assert check_rewards([1, 0.5], "t") == [1.0, 0.5]
    with pytest.raises(ValueError, match=r"t: reward of response 1 is inf"):
        check_rewards([0.0, float("inf")], "t")


# ---------------------------------------------------------------------------------------------- numeric


def test_numeric_asks_as_written_and_grades_the_number(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text('{"question": "What is 7 + 5? Answer with the number only.", "answer": "12"}\n')
    task = tasks.load("numeric", str(path))
    ex = task.examples[0]
    assert task.prompt(ex) == "What is 7 + 5? Answer with the number only."  # no instruction added
    assert task.reward("12", ex) == 1.0
    assert task.reward("The answer is 12.", ex) == 1.0
    assert task.reward("7 + 5 = 12", ex) == 1.0  # the last number of a finished completion
    assert task.reward("13", ex) == 0.0
    assert task.reward("\\boxed{12} but 13", ex) == 1.0  # a box wins over a later number
    assert task.graded_text("7 + 5 = 12", finished=False) == ""  # cut before an explicit answer
    assert task.graded_text("the answer is 12", finished=False) == "the answer is 12"


def test_numeric_rows_are_checked(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "What is 7 + 5?", "answer": "twelve"}\n')
    with pytest.raises(ValueError, match="bad.jsonl, line 1: field 'answer' is 'twelve': expected a single number"):
        tasks.load("numeric", str(bad))
    with pytest.raises(ValueError, match="no default data"):
        tasks.load("numeric")

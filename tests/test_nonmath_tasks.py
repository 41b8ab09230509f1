"""The paper's non-math tasks (Table 2): XSum / CNN-DailyMail (ROUGE-1), GPQA (shuffled letters), ZebraLogic.

Every data file here is a small fixture written by the test in the data set's public column layout.
"""

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rouge_score import rouge_scorer

from bridgelm import tasks
from bridgelm.tasks import gpqa as gpqa_mod
from bridgelm.tasks import summarize
from bridgelm.tasks import zebra as zebra_mod


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


# ---------------------------------------------------------------------------------------------- summarisation


def test_summarisation_rows_prompt_and_summary_extraction(tmp_path):
    xsum = tasks.load("xsum", _jsonl(tmp_path / "x.jsonl", [{"document": " A long text. ", "summary": "Short."}]))
    cnn = tasks.load("cnn_dailymail", _parquet(tmp_path / "c.parquet", [{"article": "Body", "highlights": "H1\nH2"}]))
    assert xsum.continuous and cnn.continuous and xsum.long_field() == "document" and cnn.long_field() == "article"
    assert xsum.prompt(xsum.examples[0]) == "Article: A long text.\n\nSummarize the above article in 1 sentence."
    assert cnn.prompt(cnn.examples[0]).endswith("Summarize the above article in 3 sentences.")
    assert xsum.answer(xsum.examples[0]) == "Short." and cnn.answer(cnn.examples[0]) == "H1\nH2"
    assert summarize.summary_of("<think>plan</think>\n\n**Summary:** The cat sat.") == "The cat sat."
    assert summarize.summary_of("plan ... </think> A. </think> B.") == "B."
    assert summarize.summary_of("The cat sat.") == "The cat sat."  # no thinking at all
    assert summarize.summary_of("<think>still thinking") is None and summarize.summary_of("   ") is None
    with pytest.raises(ValueError, match=r"row 2: field 'summary' is '': expected non-empty text"):
        tasks.load(
            "xsum",
            _jsonl(
                tmp_path / "bad.jsonl", [{"document": "d", "summary": "s"}] * 1 + [{"document": "d", "summary": ""}]
            ),
        )
    with pytest.raises(ValueError, match=r"missing field 'highlights'"):
        tasks.load("cnn_dailymail", _jsonl(tmp_path / "xsum_layout.jsonl", [{"article": "d", "summary": "s"}]))


def test_rouge1_hand_worked_and_equal_to_rouge_score(tmp_path):
    task = tasks.load("xsum", _jsonl(tmp_path / "x.jsonl", [{"document": "d", "summary": "the cat sat on the mat"}]))
    ex = task.examples[0]
    # unigrams the,cat,sat,on,the,mat vs a,cat,sat,on,a,mat: 4 shared of 6 each, P = R = 2/3
    assert task.reward("</think>a cat sat on a mat", ex) == pytest.approx(2 / 3)
    # stemming: "cats" -> cat, "mats" -> mat, "sitting" -> sit (not sat): shared the x2, cat, on, mat -> 5 of 6
    assert task.reward("the cats sitting on the mats", ex) == pytest.approx(5 / 6)
    assert task.reward("the cat sat on the mat", ex) == 1.0 and task.reward("<think>unfinished", ex) == 0.0
    scorer = rouge_scorer.RougeScorer(["rouge1"], use_stemmer=True)
    pairs = [
        ("Police arrested two men after the robbery.", "Two men were arrested by police following a robbery"),
        ("Shares rose 5% on Monday.", "The company's shares rose on Monday, up 5 percent."),
        ("Rain is expected.", "Sunny skies all week."),
    ]
    for reference, summary in pairs:
        expected = scorer.score(reference, summary)["rouge1"].fmeasure
        assert summarize.rouge1(summary, reference) == expected
        assert task.reward(f"<think>x</think>{summary}", {"summary": reference}) == expected


# ---------------------------------------------------------------------------------------------- GPQA


def _gpqa_rows(count):
    return [
        {
            "Question": f"Question {i}?",
            "Correct Answer": f"right {i}",
            "Incorrect Answer 1": f"wrong {i}a",
            "Incorrect Answer 2": f"wrong {i}b",
            "Incorrect Answer 3": f"wrong {i}c",
            "Subdomain": "Physics",
        }
        for i in range(count)
    ]


def test_gpqa_shuffle_is_seeded_and_records_the_gold_letter(tmp_path):
    path = _jsonl(tmp_path / "gpqa_diamond.jsonl", _gpqa_rows(40))
    first, again, other = tasks.load("gpqa", path), tasks.load("gpqa", path), tasks.load("gpqa", path, seed=1)
    assert [e["options"] for e in first.examples] == [e["options"] for e in again.examples]
    assert [e["options"] for e in first.examples] != [e["options"] for e in other.examples]
    for i, ex in enumerate(first.examples):
        assert sorted(ex["options"]) == sorted([f"right {i}", f"wrong {i}a", f"wrong {i}b", f"wrong {i}c"])
        assert ex["options"]["ABCD".index(ex["gold"])] == f"right {i}" and first.answer(ex) == ex["gold"]
        assert (ex["options"], ex["gold"]) == gpqa_mod.shuffled_options(ex, 0, i)  # a function of (seed, index)
    assert {ex["gold"] for ex in first.examples} == set("ABCD")  # the gold is not always in one place
    ex = first.examples[0]
    prompt = first.prompt(ex)
    assert prompt.startswith(gpqa_mod.INSTRUCTION + "\n\nQuestion 0?\n\nA) ")
    assert [line[:3] for line in prompt.splitlines()[-4:]] == ["A) ", "B) ", "C) ", "D) "]
    assert prompt.splitlines()[-4 + "ABCD".index(ex["gold"])] == f"{ex['gold']}) right 0"
    wrong = next(c for c in "ABCD" if c != ex["gold"])
    assert first.reward(f"<think>Answer: {wrong}?</think>\nAnswer: {ex['gold']}", ex) == 1.0
    assert first.reward(f"Answer: {ex['gold']}\n... no, Answer: {wrong}", ex) == 0.0  # the last one counts


@pytest.mark.parametrize(
    "completion, letter",
    [
        ("Answer: B", "B"),
        ("**Answer:** (C)", "C"),
        ("Final answer: $D$", "D"),
        ("answer: $\\boxed{A}$", "A"),
        ("so the choice is \\boxed{\\text{(B)}}", "B"),
        ("The answer is B", None),  # no "Answer:" line and no box
        ("Answer: Apple", None),
        ("Answer: E", None),
        ("<think>Answer: A</think>I cannot decide.", None),  # only the text after the thinking counts
    ],
)
def test_gpqa_letter_extraction(completion, letter):
    assert gpqa_mod.extract_letter(completion) == letter


def test_gpqa_bad_rows_name_row_and_field(tmp_path):
    rows = _gpqa_rows(2)
    rows[1]["Incorrect Answer 2"] = None
    with pytest.raises(ValueError, match=r"g.jsonl, line 2: field 'Incorrect Answer 2' is None: expected non-empty text"):
        tasks.load("gpqa", _jsonl(tmp_path / "g.jsonl", rows))
    del rows[0]["Correct Answer"]
    with pytest.raises(ValueError, match=r"g2.jsonl, line 1: missing field 'Correct Answer'"):
        tasks.load("gpqa", _jsonl(tmp_path / "g2.jsonl", rows))


# ---------------------------------------------------------------------------------------------- ZebraLogic


def test_zebra_generated_rows_graded_by_reasoning_gym():
    task = tasks.load("zebra", size=4, seed=0)
    again = zebra_mod.make_problems(4, seed=0)
    assert [e["question"] for e in task.examples] == [e["question"] for e in again]
    assert {e["question"] for e in zebra_mod.make_problems(4, seed=0, split="train")}.isdisjoint(
        e["question"] for e in task.examples
    )
    for ex in task.examples:
        gold = ex["answer"]
        assert task.prompt(ex).endswith("put your final answer within \\boxed{}.")
        assert task.reward(f"<think>maybe bob</think>It is \\boxed{{{gold.title()}}}.", ex) == 1.0
        assert task.reward(f"\\boxed{{\\text{{{gold}}}}}", ex) == 1.0
        assert task.reward(f"<answer>{gold}</answer>", ex) == 1.0
        assert task.reward("\\boxed{nobody}", ex) == 0.0 and task.reward("no answer", ex) == 0.0
        assert task.extract(f"so \\boxed{{{gold}}}") == gold


SOLUTION = {"header": ["House", "Name", "Drink"], "rows": [["1", "Arnold", "tea"], ["2", "Peter", "water"]]}


def _grid_row():
    return {"id": "lgp-test-2x2-0", "size": "2*2", "puzzle": "Two houses. Clues: ...", "solution": SOLUTION}


def _grid_answer(name1="Arnold", drink2="water"):
    table = {"House 1": {"Name": name1, "Drink": ["Tea"]}, "house 2": {"name": "peter ", "Drink": drink2}}
    return "<think>{draft}</think>Done.\n```json\n" + json.dumps({"reasoning": "r {x}", "solution": table}) + "\n```"


def test_zebra_grid_mode_rows(tmp_path):
    task = tasks.load("zebra", _parquet(tmp_path / "grid.parquet", [_grid_row()]))
    ex = task.examples[0]
    prompt = task.prompt(ex)
    assert prompt.startswith("Two houses. Clues: ...\n\n" + zebra_mod.GRID_INSTRUCTION)
    template = json.loads(prompt[prompt.index("{") :])
    assert template == {
        "reasoning": "___",
        "solution": {"House 1": {"Name": "___", "Drink": "___"}, "House 2": {"Name": "___", "Drink": "___"}},
    }
    assert json.loads(task.answer(ex)) == {
        "House 1": {"Name": "Arnold", "Drink": "tea"},
        "House 2": {"Name": "Peter", "Drink": "water"},
    }
    assert task.reward(_grid_answer(), ex) == 1.0  # case, spaces, a list cell and "house 2" all accepted
    assert zebra_mod.grid_cells(_grid_answer(drink2="milk"), SOLUTION) == (3, 4)
    assert task.reward(_grid_answer(drink2="milk"), ex) == 0.0  # one wrong cell: not solved
    assert task.reward(_grid_answer(name1="Peter"), ex) == 0.0
    assert task.reward("no json here", ex) == 0.0 and task.reward('{"solution": {"House 1": {', ex) == 0.0
    # a reasoning string with raw newlines (invalid strict JSON) still parses, as in ZeroEval
    houses = '"House 1": {"Name": "arnold", "Drink": "tea"}, "House 2": {"Name": "peter", "Drink": "water"}'
    raw = '{"reasoning": "line\nline", "solution": {' + houses + "}}"
    assert task.reward(raw, ex) == 1.0
    # majority voting: equal grids give equal canonical answers
    assert task.extract(_grid_answer()) == task.extract(raw.replace("arnold", "ARNOLD"))
    jsonl = tasks.load("zebra", _jsonl(tmp_path / "grid.jsonl", [_grid_row()]))
    assert jsonl.prompt(jsonl.examples[0]) == prompt


def test_zebra_bad_rows(tmp_path):
    bad = {**_grid_row(), "solution": {"header": ["House", "Name"], "rows": [["1", "Arnold", "extra"]]}}
    with pytest.raises(ValueError, match=r"z.jsonl, line 1: solution has header of 2 columns and rows of lengths \[3\]"):
        tasks.load("zebra", _jsonl(tmp_path / "z.jsonl", [bad]))
    with pytest.raises(ValueError, match=r"z2.jsonl, line 2: has fields \['prompt'\]: expected puzzle, solution"):
        tasks.load("zebra", _jsonl(tmp_path / "z2.jsonl", [_grid_row(), {"prompt": "p"}]))
    # fields of the wrong type: once an AttributeError or a TypeError, or accepted
    for row, expected in (
        ({"question": 5, "answer": "x"}, "field 'question' is 5: expected non-empty text"),
        ({"question": "", "answer": None}, "field 'question' is '': expected non-empty text"),
        ({**_grid_row(), "puzzle": 7}, "field 'puzzle' is 7: expected non-empty text"),
        ({**_grid_row(), "solution": {"header": 5, "rows": [[1]]}}, "expected 'header' a list and 'rows' a list of"),
        ({**_grid_row(), "solution": {"header": ["H", "N"], "rows": [5]}}, "expected 'header' a list and 'rows' a"),
    ):
        with pytest.raises(ValueError, match=re.escape("z3.jsonl, line 1: ") + ".*" + re.escape(expected)):
            tasks.load("zebra", _jsonl(tmp_path / "z3.jsonl", [row]))
    gpqa = {f: "text" for f in ("Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2")}
    for row, expected in (
        ({**gpqa, "Incorrect Answer 3": "t", "Question": ["q"]}, "field 'Question' is ['q']: expected non-empty"),
        ({**gpqa, "Incorrect Answer 3": "t", "Correct Answer": True}, "field 'Correct Answer' is True: expected"),
    ):
        with pytest.raises(ValueError, match=re.escape(f"g.jsonl, line 1: {expected}")):
            tasks.load("gpqa", _jsonl(tmp_path / "g.jsonl", [row]))


def test_registry_knows_the_new_tasks():
    assert {"xsum", "cnn_dailymail", "gpqa", "zebra"} <= set(tasks.REGISTRY)
    with pytest.raises(ValueError, match="unknown task 'xsun'.*cnn_dailymail.*gpqa.*xsum, zebra"):
        tasks.load("xsun")


# ---------------------------------------------------------------------------------------------- Countdown (TinyZero)


def test_countdown_tinyzero_prompt_rows_and_answer_tags(tmp_path):
    path = _jsonl(tmp_path / "countdown.jsonl", [{"target": 98, "nums": [44, 19, 35]}])  # Countdown-Tasks-3to4
    task = tasks.load("countdown", path)
    ex = task.examples[0]
    assert ex["numbers"] == [44, 19, 35]
    assert task.prompt(ex) == (
        "Using the numbers [44, 19, 35], create an equation that equals 98. You can use basic arithmetic "
        "operations (+, -, *, /) and each number can only be used once. Show your work in <think> </think> tags. "
        "And return the final answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>."
    )
    boxed = tasks.load("countdown", path, prompt_style="boxed")
    assert boxed.prompt(ex).endswith("within \\boxed{}.") and boxed.reward("\\boxed{44 + 19 + 35}", ex) == 1.0
    # TinyZero's rule: every number exactly once, value equal to the target
    assert task.reward("<think>44 + 19 = 63</think>\n<answer>44 + 19 + 35</answer>", ex) == 1.0
    assert task.reward("<answer> (44 + 19 + 35) = 98 </answer>", ex) == 1.0  # "= target" tail dropped
    assert task.reward("<answer>44 + 19 - 35</answer>", ex) == 0.0  # 28
    assert task.reward("<answer>44 + 54</answer>", ex) == 0.0  # 98 with numbers not given
    # whichever comes last of \boxed{} and <answer> is the answer
    assert task.reward("draft \\boxed{44 - 19} then <answer>44 + 19 + 35</answer>", ex) == 1.0
    assert task.reward("<answer>44 + 19 + 35</answer> no wait \\boxed{44 - 19}", ex) == 0.0
    with pytest.raises(ValueError, match=r"row 1: missing field 'numbers' \(expected fields: numbers, target; or nums"):
        tasks.load("countdown", _jsonl(tmp_path / "bad.jsonl", [{"target": 3, "values": [1, 2]}]))
    with pytest.raises(ValueError, match=r"prompt_style='chat' is unknown: expected one of tinyzero, boxed"):
        tasks.load("countdown", path, prompt_style="chat")

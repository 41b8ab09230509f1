"""Eval runs: resumable, sharded under torchrun, refusing mixed settings; scores, majority vote and budgets."""

import copy
import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import randomize_blocks, save_tiny_model_dir, tiny_model

import bridgelm
from bridgelm.eval import datasets as B
from bridgelm.eval import folder as F
from bridgelm.eval import runner as E
from bridgelm.eval import score as S
from bridgelm.cli import main
from bridgelm.errors import UserError
from bridgelm.runs import check_format
from bridgelm.jsonl import read_records
from bridgelm.tokenizer import char_tokenizer

ALPHABET = "0123456789+-=() abc\n"


def _write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _toy(path, count):
    return _write_rows(path, [{"problem": f"{i}+{i}=", "answer": str(2 * i)} for i in range(count)])


@pytest.fixture(scope="module")
def model_tok():
    tok = char_tokenizer(ALPHABET)
    model = tiny_model(
        vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_position_embeddings=1024
    )
    randomize_blocks(bridgelm.add_bridge(model))
    return model, tok


def _snapshot(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_resumed_run_samples_exactly_the_missing_problems(tmp_path, model_tok, monkeypatch):
    model, tok = model_tok
    data = [str(_toy(tmp_path / "toy.jsonl", 4)), str(_toy(tmp_path / "toy2.jsonl", 3))]
    cfg = E.EvalConfig(sampling=E.eval_sampling(n=4, width=2, max_new_tokens=5), widths=[1, 2])
    run = tmp_path / "run"
    first = E.run_eval(model, tok, "math", data, cfg, run, "tiny", progress=False)
    assert first["sampled"] == 14 and first["skipped"] == 0
    out = run / "samples.jsonl"
    lines = out.read_text().splitlines(keepends=True)
    keys = [F._key(json.loads(line)) for line in lines]
    assert sorted(keys) == sorted((b, w, i) for b, k in (("toy", 4), ("toy2", 3)) for w in (1, 2) for i in range(k))
    settings = json.loads((run / "run.json").read_text())
    assert settings["n"] == 4 and settings["widths"] == [1, 2] and settings["task"] == "math"
    assert [b["name"] for b in settings["benchmarks"]] == ["toy", "toy2"]

    # a crash lost line 3 and cut the last line in half: the re-run samples exactly those two problems
    out.write_text("".join(lines[:2] + lines[3:-1]) + lines[-1][: len(lines[-1]) // 2])
    prompts_sampled = []
    real = E.stream_text

    def counting(model, tokenizer, texts, *args, **kwargs):
        prompts_sampled.append(len(texts))
        return real(model, tokenizer, texts, *args, **kwargs)

    monkeypatch.setattr(E, "stream_text", counting)
    again = E.run_eval(model, tok, "math", data, cfg, run, "tiny", progress=False)
    assert again["sampled"] == 2 and again["skipped"] == 12 and sum(prompts_sampled) == 2
    after = out.read_text().splitlines(keepends=True)
    assert sorted(F._key(json.loads(line)) for line in after) == sorted(keys)
    assert after[:2] == lines[:2] and after[2:12] == lines[3:-1]  # what was written is untouched
    # per-problem random streams: the redone problems drew exactly what the first run drew
    assert sorted(after[12:]) == sorted([lines[2], lines[-1]])
    prompts_sampled.clear()
    assert E.run_eval(model, tok, "math", data, cfg, run, "tiny", progress=False)["sampled"] == 0
    assert prompts_sampled == []


def test_other_settings_are_refused_and_nothing_is_touched(tmp_path, model_tok):
    model, tok = model_tok
    data = [str(_toy(tmp_path / "toy.jsonl", 2))]
    cfg = E.EvalConfig(sampling=E.eval_sampling(n=4, width=2, max_new_tokens=4))
    run = tmp_path / "run"
    E.run_eval(model, tok, "math", data, cfg, run, "tiny", progress=False)
    before = _snapshot(run)
    other_n = E.EvalConfig(sampling=E.eval_sampling(n=2, width=2, max_new_tokens=4))
    with pytest.raises(ValueError, match=r"n: run 4 vs now 2.*mixing them is refused"):
        E.run_eval(model, tok, "math", data, other_n, run, "tiny", progress=False)
    with pytest.raises(ValueError, match=r"model: run 'tiny' vs now 'other-model'"):
        E.run_eval(model, tok, "math", data, cfg, run, "other-model", progress=False)
    with pytest.raises(ValueError, match=r"dtype: run 'float32' vs now 'bfloat16'"):  # bf16 samples are others
        E.run_eval(copy.deepcopy(model).to(torch.bfloat16), tok, "math", data, cfg, run, "tiny", progress=False)
    _toy(tmp_path / "toy.jsonl", 3)  # the data file grew since it was sampled
    with pytest.raises(ValueError, match=r"benchmark 'toy' problems: run 2 vs now 3"):
        E.run_eval(model, tok, "math", data, cfg, run, "tiny", progress=False)
    assert _snapshot(run) == before


def test_a_check_failing_before_any_sample_leaves_no_run_behind(tmp_path, model_tok):
    """A prompt that does not fit the context with max_new_tokens fails before anything is sampled: no run.json is
    left to refuse the corrected command, which then runs."""
    model, tok = model_tok
    data = [str(_toy(tmp_path / "toy.jsonl", 2))]
    run = tmp_path / "run"
    too_long = E.EvalConfig(sampling=E.eval_sampling(n=2, width=2, max_new_tokens=1020), widths=(1, 2))
    # refused by its characters before it is tokenized (issue 48: cheap refusals first)
    with pytest.raises(ValueError, match=r"max_new_tokens=1020.*expected a shorter prompt or a lower max_new_tokens"):
        E.run_eval(model, tok, "math", data, too_long, run, "tiny", progress=False)
    assert not run.exists()  # the folder it made is taken away again
    run.mkdir()  # a folder of the user's stays, empty
    with pytest.raises(ValueError, match="max_new_tokens=1020"):
        E.run_eval(model, tok, "math", data, too_long, run, "tiny", progress=False)
    assert run.is_dir() and not any(run.iterdir())
    cfg = E.EvalConfig(sampling=E.eval_sampling(n=2, width=2, max_new_tokens=4), widths=(1, 2))
    assert E.run_eval(model, tok, "math", data, cfg, run, "tiny", progress=False)["sampled"] == 4


def test_widths_must_divide_n(tmp_path, capsys):
    with pytest.raises(ValueError, match="widths=1,3: width 3 does not divide n=4"):
        E.EvalConfig(sampling=E.eval_sampling(n=4), widths=[1, 3]).validate()
    data = str(_toy(tmp_path / "toy.jsonl", 2))
    base = ["eval", "--model", str(tmp_path / "no-model"), "--data", data, "--n", "4", "--out", str(tmp_path / "r")]
    with pytest.raises(SystemExit):
        main(base + ["--widths", "1,3"])
    assert "error: --widths 1,3: width 3 does not divide --n 4" in capsys.readouterr().err  # the flags as typed
    for widths, words in [("1,0", "--widths 1,0: expected positive integers, not 0"),
                          ("2,2", "--widths 2,2 lists 2 more than once")]:
        with pytest.raises(SystemExit):
            main(base + ["--widths", widths])
        assert words in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(base + ["--widths", "1,2", "--limit", "0"])
    assert "--limit 0: expected a positive integer (left unset: every problem)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(base)  # no --widths: the default width 8 alone
    assert "--width 8 (its default) does not divide --n 4: every width must divide n" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(base + ["--widths", "1,x"])
    assert "--widths entry 'x' is not an integer" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_bad_data_file_names_file_line_and_field(tmp_path, capsys):
    missing = tmp_path / "missing.jsonl"
    missing.write_text('{"problem": "1+1=", "answer": "2"}\n{"problem": "2+2="}\n')
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"problem": "1+1=", "answer": "2"}\n{"problem": \n{"problem": "3", "answer": "3"}\n')
    for path, expected in ((missing, f"{missing}, line 2: missing field 'answer'"), (broken, f"{broken}, line 2: malformed JSON")):
        with pytest.raises(SystemExit):
            main(["eval", "--model", str(tmp_path / "m"), "--data", str(path), "--out", str(tmp_path / "r")])
        assert expected in capsys.readouterr().err


def _fabricate(run: Path, texts_by_problem: dict, lengths=None, finished=None):
    """Rewrite samples.jsonl with chosen texts; keys {(benchmark, index): [texts]} for every width."""
    recs = read_records(run / "samples.jsonl")
    for rec in recs:
        texts = texts_by_problem[(rec["benchmark"], rec["index"])]
        lens = (lengths or {}).get((rec["benchmark"], rec["index"]), [2] * len(texts))
        fins = (finished or {}).get((rec["benchmark"], rec["index"]), [True] * len(texts))
        rec["samples"] = [
            {"text": t, "token_ids": [5] * n, "finished": f} for t, n, f in zip(texts, lens, fins, strict=True)
        ]
    (run / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_a_run_whose_every_sample_is_empty_says_so(tmp_path, model_tok):
    """What an Instruct model sampled without --chat often does: it ends at once, and every score is 0."""
    model, tok = model_tok
    run = tmp_path / "run"
    E.run_eval(model, tok, "math", [str(_toy(tmp_path / "toy.jsonl", 2))],
               E.EvalConfig(sampling=E.eval_sampling(n=2, width=2, max_new_tokens=4)), run, "tiny", progress=False)
    _fabricate(run, {("toy", 0): ["", " "], ("toy", 1): ["\n", ""]})
    result = S.score_run(run, progress=False)
    assert result["samples"] == result["empty_samples"] == 4 and result["run"]["chat"] is False
    note = "note: every one of the 4 samples is empty: an Instruct model sampled without --chat often ends at once"
    assert S.summary_lines(result)[-1] == note
    _fabricate(run, {("toy", 0): ["", " "], ("toy", 1): ["4", ""]})
    result = S.score_run(run, progress=False)
    assert result["empty_samples"] == 3 and not any("note" in line for line in S.summary_lines(result))


def test_a_cut_gsm8k_sample_counts_only_with_an_explicit_answer(tmp_path, model_tok):
    """GSM8K falls back on a completion's last number; a sample cut by the token limit has not answered yet, so its
    last number ("Step 3: ...") is not its answer. A box, '####' or 'the answer is' still counts, cut or not."""
    from bridgelm.engine import Sample
    from bridgelm.tasks.gsm8k import GSM8K

    model, tok = model_tok
    rows = [{"question": "What is 1+2?", "answer": "1+2=3\n#### 3"}, {"question": "What is 2+2?", "answer": "#### 4"}]
    data = [str(_write_rows(tmp_path / "gsm.jsonl", rows))]
    run = tmp_path / "run"
    cfg = E.EvalConfig(sampling=E.eval_sampling(n=4, width=2, max_new_tokens=4))
    E.run_eval(model, tok, "gsm8k", data, cfg, run, "tiny", progress=False)
    cut = "Step 3: Calculate the total number of"
    texts = {("gsm", 0): [cut, cut, "so #### 3 and then", "It is 3"], ("gsm", 1): ["\\boxed{4} and", cut, "4", "4"]}
    _fabricate(run, texts, finished={("gsm", 0): [False, True, False, True], ("gsm", 1): [False, False, True, True]})
    S.score_run(run, progress=False)
    scores = {r["index"]: r for r in read_records(run / "scores.jsonl")}
    assert scores[0]["correct"] == [False, True, True, True] and scores[0]["answers"] == [None, "3", "3", "3"]
    assert scores[1]["correct"] == [True, False, True, True] and scores[1]["answers"] == ["4", None, "4", "4"]

    task = GSM8K(name="gsm8k", examples=rows)
    samples = [[Sample([], [], [], cut, finished) for finished in (False, True)]]
    assert E.grade_samples(task, rows[:1], samples) == [[False, True]]
    assert task.graded_text(cut, finished=False) == "" and task.graded_text(cut, finished=True) == cut


def test_a_data_folder_is_read_at_the_split_asked_for(tmp_path, model_tok):
    """--split train reads FOLDER/train.jsonl (the benchmark named as that file is), run.json records it, scoring
    re-reads it, and a re-run at another split is refused by name."""
    model, tok = model_tok
    (tmp_path / "toys").mkdir()
    _toy(tmp_path / "toys" / "test.jsonl", 2)
    _write_rows(tmp_path / "toys" / "train.jsonl", [{"problem": "7+7=", "answer": "14"}])
    assert [b.name for b in B.load_benchmarks("math", [str(tmp_path / "toys")])] == ["toys"]
    cfg = E.EvalConfig(sampling=E.eval_sampling(n=2, width=2, max_new_tokens=3), split="train")
    run = tmp_path / "run"
    E.run_eval(model, tok, "math", [str(tmp_path / "toys")], cfg, run, "tiny", progress=False)
    settings = json.loads((run / "run.json").read_text())
    assert settings["split"] == "train" and [b["name"] for b in settings["benchmarks"]] == ["toys_train"]
    assert len(read_records(run / "samples.jsonl")) == 1  # the train split's one problem, at one width
    assert S.score_run(run, progress=False)["benchmarks"]["toys_train"]["2"]["problems"] == 1
    with pytest.raises(ValueError, match="split: run 'train' vs now 'test'"):
        E.run_eval(model, tok, "math", [str(tmp_path / "toys")], replace(cfg, split="test"), run, "tiny",
                   progress=False)


def test_a_split_named_file_is_named_after_its_folder(tmp_path, model_tok):
    """gsm8k/test.jsonl makes the benchmark "gsm8k" (titled GSM8K in reports), not "test"; its train.jsonl
    "gsm8k_train"; a test.jsonl given without a folder, the task's name. A run scores through a symlink to its moved
    data (same content)."""
    import shutil

    model, tok = model_tok
    rows = [{"question": "What is 1+2?", "answer": "#### 3"}, {"question": "What is 2+2?", "answer": "#### 4"}]
    (tmp_path / "gsm8k").mkdir()
    test, train = (str(_write_rows(tmp_path / "gsm8k" / f"{n}.jsonl", rows)) for n in ("test", "train"))
    assert [b.name for b in B.load_benchmarks("gsm8k", [test, train])] == ["gsm8k", "gsm8k_train"]
    assert B.benchmark_name("math", "aime24/test.jsonl") == "aime24"
    assert B.benchmark_name("math", "test.jsonl") == "math"
    assert B.benchmark_name("math", "aime24.jsonl") == "aime24"
    other = str(_write_rows(tmp_path / "gsm8k.jsonl", rows[:1]))  # named "gsm8k" too: refused, as ever
    with pytest.raises(ValueError, match="two data files make the benchmark 'gsm8k'"):
        B.load_benchmarks("gsm8k", [test, other])
    # a split names a folder's file; with a file it would be recorded and never read
    with pytest.raises(ValueError, match=rf"--split train is read from a data folder .* and --data {test} is a file"):
        B.load_benchmarks("gsm8k", [test], split="train")
    assert [b.name for b in B.load_benchmarks("gsm8k", [str(tmp_path / "gsm8k")], split="train")] == ["gsm8k_train"]
    cfg = E.EvalConfig(sampling=E.eval_sampling(n=2, width=1, max_new_tokens=3))
    run = tmp_path / "run"
    E.run_eval(model, tok, "gsm8k", [test], cfg, run, "tiny", progress=False)
    assert set(S.score_run(run, progress=False)["benchmarks"]) == {"gsm8k"}
    assert E.run_eval(model, tok, "gsm8k", [test], cfg, run, "tiny", progress=False)["sampled"] == 0
    shutil.move(tmp_path / "gsm8k", tmp_path / "moved")  # the data moved since: same content, scored as recorded
    (tmp_path / "gsm8k").symlink_to(tmp_path / "moved")
    assert set(S.score_run(run, progress=False)["benchmarks"]) == {"gsm8k"}


def test_a_run_continues_from_its_data_moved_elsewhere_and_records_where_it_is(tmp_path, model_tok):
    """A data file moved with its content unchanged continues its run, as rl's and sft's do (it was refused by path);
    run.json then names the new place, which score reads; other content is still refused."""
    model, tok = model_tok
    rows = [{"question": "What is 1+2?", "answer": "#### 3"}, {"question": "What is 2+2?", "answer": "#### 4"}]
    (tmp_path / "a").mkdir()
    data = _write_rows(tmp_path / "a" / "gsm8k.jsonl", rows)
    cfg = E.EvalConfig(sampling=E.eval_sampling(n=2, width=1, max_new_tokens=3))
    run = tmp_path / "run"
    E.run_eval(model, tok, "gsm8k", [str(data)], replace(cfg, limit=1), run, "tiny", progress=False)
    moved = tmp_path / "b" / "gsm8k.jsonl"
    moved.parent.mkdir()
    data.rename(moved)
    with pytest.raises(UserError, match="limit"):  # a longer run is another run: its fingerprint differs
        E.run_eval(model, tok, "gsm8k", [str(moved)], cfg, run, "tiny", progress=False)
    assert E.run_eval(model, tok, "gsm8k", [str(moved)], replace(cfg, limit=1), run, "tiny", progress=False)[
        "sampled"] == 0
    assert json.loads((run / "run.json").read_text())["benchmarks"][0]["path"] == str(moved)
    assert set(S.score_run(run, progress=False)["benchmarks"]) == {"gsm8k"}
    _write_rows(moved, [rows[1], rows[0]])
    with pytest.raises(UserError, match="the data changed since it was sampled"):
        E.run_eval(model, tok, "gsm8k", [str(moved)], replace(cfg, limit=1), run, "tiny", progress=False)


def test_a_folder_of_an_older_format_is_refused_in_one_line(tmp_path, model_tok, capsys):
    """An eval run, a training run and a samples file written by an older bridgelm (another format version, or none)
    are refused in one line naming the version found and the one expected, with exit code 2 from the CLI."""
    from bridgelm.runs import FORMATS

    model, tok = model_tok
    data = str(_toy(tmp_path / "toy.jsonl", 2))
    run = tmp_path / "run"
    cfg = E.EvalConfig(sampling=E.eval_sampling(n=2, width=1, max_new_tokens=2))
    E.run_eval(model, tok, "math", [data], cfg, run, "tiny", progress=False)
    settings = json.loads((run / "run.json").read_text())
    assert settings["kind"] == "eval" and settings["format"] == FORMATS["eval"] and settings["foreign_groups"] is False
    old = {k: v for k, v in settings.items() if k != "kind"}
    (run / "run.json").write_text(json.dumps({**old, "format": "bridgelm-eval-1"}))  # as bridgelm 0.1.0 wrote it
    expected = (
        f"bridgelm score: error: {run} has format version 'bridgelm-eval-1' (written by an older bridgelm), and "
        f"bridgelm eval reads version {FORMATS['eval']} only: start a new --out"
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["score", str(run)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [expected]
    with pytest.raises(UserError, match=r"has format version 'bridgelm-eval-1' .* start a new --out"):
        cfg = E.EvalConfig(sampling=E.eval_sampling(n=2, width=1, max_new_tokens=2))
        E.run_eval(model, tok, "math", [data], cfg, run, "tiny")
    sft = tmp_path / "sft"
    sft.mkdir()
    (sft / "run.json").write_text(json.dumps({"kind": "sft", "identity": {}}))  # no version: older than versions
    version = FORMATS["sft"]
    with pytest.raises(UserError, match=rf"{sft} has no format version .* bridgelm sft reads version {version} only"):
        check_format(sft, json.loads((sft / "run.json").read_text()), "sft", "a folder of bridgelm sft")
    samples = tmp_path / "s.jsonl"
    samples.write_text(json.dumps({"index": 0, "prompt": "1+1=", "samples": [], "settings": {"n": 2}}) + "\n")
    argv = ["generate", "--model", str(tmp_path / "m"), "--prompt", "1+1=", "--n", "2", "--width", "1"]
    save_tiny_model_dir(tmp_path / "m")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--max-new-tokens", "2", "--out", str(samples)])
    assert exit_info.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]  # after the model's loading bars
    assert line == (
        f"bridgelm generate: error: {samples} has no format version (written by an older bridgelm), and bridgelm "
        f"generate reads version {FORMATS['generate']} only: start a new --out"
    )


def test_a_cut_math_sample_counts_only_with_a_box():
    """math-verify falls back on a bare number: a MATH sample cut by the token limit answers only with a box."""
    from bridgelm.tasks.math import MathTask

    task = MathTask(name="math", examples=[])
    cut = "Step 1: there are 18 apples. Step 2: the total number of"
    assert task.reward(cut, {"answer": "2"}) == 1.0  # the "2" of "Step 2", had it finished there
    assert task.reward(task.graded_text(cut, finished=False), {"answer": "2"}) == 0.0
    assert task.graded_text(cut, finished=True) == cut
    boxed = "so \\boxed{2} and then"
    assert task.graded_text(boxed, finished=False) == boxed


def test_a_math_answer_graded_correct_without_a_box_votes_with_it():
    """math-verify grades "So the answer is 5." correct; its answer was None (the box only), so it never voted, and a
    problem whose samples were all correct, unboxed, had a wrong majority vote."""
    from bridgelm.eval.metrics import majority_vote
    from bridgelm.tasks.math import MathTask

    task = MathTask(name="math", examples=[])
    texts = ["So the answer is 5.", "The answer is $5$.", "We get \\boxed{4}.", ""]
    correct = [task.reward(t, {"answer": "5"}) == 1.0 for t in texts]
    answers = [task.extract(t) for t in texts]
    assert correct == [True, True, False, False] and answers == ["5", "5", "4", None]
    assert majority_vote(answers, correct)


def _math_rows(shared_data):
    math = [json.loads(x) for x in (shared_data / "math" / "math500.jsonl").read_text().splitlines()]
    math = sorted((r for r in math if r["answer"].strip().isdigit()), key=lambda r: len(r["problem"]))[:2]
    aime = [json.loads(x) for x in (shared_data / "math" / "aime24.jsonl").read_text().splitlines()]
    return math, sorted(aime, key=lambda r: len(r["problem"]))[:2]


def test_scoring_real_math_rows(tmp_path, model_tok, shared_data):
    model, tok = model_tok
    math, aime = _math_rows(shared_data)
    data = [str(_write_rows(tmp_path / "math500.jsonl", math)), str(_write_rows(tmp_path / "aime24.jsonl", aime))]
    cfg = E.EvalConfig(sampling=E.eval_sampling(n=4, width=2, max_new_tokens=8), widths=[1, 2])
    run = tmp_path / "run"
    E.run_eval(model, tok, "math", data, cfg, run, "tiny", progress=False)
    result = S.score_run(run, progress=False)
    assert set(result["benchmarks"]) == {"math500", "aime24"} and set(result["avg"]) == {"1", "2"}
    entry = result["benchmarks"]["aime24"]["2"]
    assert entry["problems"] == 2 and entry["missing"] == [] and set(entry["budgets"]) == {"1", "2", "4", "8"}
    assert 0.0 <= entry["metrics"]["accuracy"]["mean"] <= 1.0 and 1 <= entry["mean_length"] <= 8
    assert json.loads((run / "metrics.json").read_text()) == result
    assert result["gpass_k"] == 4  # the k the metrics used: 8 capped at n
    for w in ("1", "2"):  # the random model's samples mostly cut at 8 tokens: the summary says so, share and cap
        cut = round(100 * (1 - result["avg"][w]["finished"]))
        assert cut > 50 and f"warning: {cut}% of samples were cut at max_new_tokens 8 (raise --max-new-tokens)" in (
            S.summary_line(result, int(w)))

    # fake samples with boxed answers: what scoring counts, majority vote and budgets
    g0, g1 = math[0]["answer"], math[1]["answer"]
    texts = {
        ("math500", 0): [f"so \\boxed{{{g0}}}", f"\\boxed{{{g0}}}", f"\\boxed{{{g0}}}", "\\boxed{7777}"],
        ("math500", 1): ["\\boxed{5555}", "\\boxed{5555}", f"\\boxed{{{g1}}}", "no answer"],
        ("aime24", 0): ["\\boxed{1}"] * 4,
        ("aime24", 1): ["\\boxed{2}"] * 4,
    }
    lengths = {("math500", 0): [1, 6, 3, 3]}
    finished = {("math500", 0): [True, True, False, True]}
    _fabricate(run, texts, lengths, finished)
    result = S.score_run(run, progress=False)
    assert result["avg"]["1"]["finished"] > 0.5 and "warning" not in S.summary_line(result, 1)
    for w in ("1", "2"):
        m = result["benchmarks"]["math500"][w]
        assert m["metrics"]["accuracy"]["mean"] == pytest.approx(0.5)  # (3/4 + 1/4) / 2
        assert m["metrics"]["coverage@n"]["mean"] == pytest.approx(1.0)
        assert m["metrics"]["majority_vote"]["mean"] == pytest.approx(0.5)  # 5555 outvotes the right answer
        assert m["mean_length"] == pytest.approx(21 / 8) and m["finished"] == pytest.approx(7 / 8)
        # at budget L only samples that finished within L tokens count
        assert m["budgets"]["1"]["accuracy"] == pytest.approx(0.125) and m["budgets"]["1"]["coverage@n"] == 0.5
        assert m["budgets"]["2"]["accuracy"] == pytest.approx(0.25) and m["budgets"]["2"]["coverage@n"] == 1.0
        assert m["budgets"]["8"]["accuracy"] == pytest.approx(0.375)
        assert result["benchmarks"]["aime24"][w]["metrics"]["accuracy"]["mean"] == 0.0
        assert result["avg"][w]["metrics"]["accuracy"]["mean"] == pytest.approx(0.25)
    scores = {(s["benchmark"], s["width"], s["index"]): s for s in read_records(run / "scores.jsonl")}
    assert len(scores) == 8
    s = scores[("math500", 2, 0)]
    assert s["c"] == 3 and s["correct"] == [True, True, True, False] and s["majority_correct"]
    assert s["answers"] == [g0, g0, g0, "7777"] and s["lengths"] == [1, 6, 3, 3]
    assert scores[("math500", 2, 1)]["majority"] == "5555" and not scores[("math500", 2, 1)]["majority_correct"]


def test_overlapping_or_missing_problems_are_reported(tmp_path, model_tok):
    model, tok = model_tok
    data = [str(_toy(tmp_path / "toy.jsonl", 3))]
    run = tmp_path / "run"
    cfg = E.EvalConfig(sampling=E.eval_sampling(n=2, width=2, max_new_tokens=3))
    E.run_eval(model, tok, "math", data, cfg, run, "tiny", progress=False)
    lines = (run / "samples.jsonl").read_text().splitlines(keepends=True)
    (run / "samples.rank1.jsonl").write_text(lines[1])
    with pytest.raises(ValueError, match=r"1 problems were sampled more than once: toy w=2 #1"):
        S.score_run(run, progress=False)
    (run / "samples.rank1.jsonl").unlink()
    (run / "samples.jsonl").write_text(lines[0] + lines[2])
    with pytest.raises(ValueError, match=r"incomplete: toy w=2 misses 1 of 3 problems \(#1\)"):
        S.score_run(run, progress=False)
    result = S.score_run(run, allow_partial=True, progress=False)
    assert result["benchmarks"]["toy"]["2"]["problems"] == 2 and result["benchmarks"]["toy"]["2"]["missing"] == [1]
    # the report says that the row is partial (it once showed its figures like a whole run's)
    from bridgelm.eval.report import build_report, render_markdown

    report = build_report([str(run)])
    assert report["runs"]["run"]["missing"] == {"toy w=2": 1}
    assert "(**partial run**: toy w=2: 1 problem not sampled)" in render_markdown(report)
    # a damaged metrics.json is one line that says how to write it again (it was a JSONDecodeError or a TypeError)
    metrics = run / S.METRICS_FILE
    cases = (('{"format": ', ": malformed JSON (Expecting value at column 12)"), ("[]", "is not a metrics.json of bridgelm"))
    for damage, expected in cases:
        metrics.write_text(damage)
        with pytest.raises(UserError, match=re.escape(expected) + ".*`bridgelm score .*` writes it again"):
            build_report([str(run)])


def _torchrun() -> list[str]:
    script = Path(sys.executable).with_name("torchrun")
    return [str(script)] if script.exists() else [sys.executable, "-m", "torch.distributed.run"]


def test_torchrun_shards_every_problem_exactly_once(tmp_path):
    save_tiny_model_dir(tmp_path / "m", blocks="bridge")
    data = _toy(tmp_path / "toy.jsonl", 5)
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = _torchrun() + ["--standalone", "--nproc_per_node", "2", "-m", "bridgelm", "eval"]
    # --num-samples: torchrun's own parser would take "--n" for an abbreviation of its options
    args = ["--model", str(tmp_path / "m"), "--data", str(data), "--num-samples", "2", "--width", "2"]
    args += ["--max-new-tokens", "4", "--out", str(run)]
    proc = subprocess.run(cmd + args, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shards = {p.name: [r["index"] for r in read_records(p)] for p in F.shard_files(run)}
    assert shards == {"samples.rank0.jsonl": [0, 2, 4], "samples.rank1.jsonl": [1, 3]}
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["benchmarks"]["toy"]["2"]["problems"] == 5 and metrics["benchmarks"]["toy"]["2"]["missing"] == []
    assert sorted(s["index"] for s in read_records(run / "scores.jsonl")) == [0, 1, 2, 3, 4]
    assert "accuracy" in proc.stdout and "metrics.json" in proc.stdout


class _HasDigit(bridgelm.tasks.Task):
    """Correct when the completion contains the example's digit: a grade a random model meets about half the time."""

    def prompt(self, example):
        return example["problem"]

    def reward(self, completion, example):
        return float(example["digit"] in completion)


def test_grade_samples_grades_each_sample_and_accuracy_is_their_mean(model_tok):
    model, tok = model_tok
    task = _HasDigit("has-digit", [{"problem": f"{i}+{i}=", "digit": str(i % 10)} for i in range(6)])
    cfg = E.EvalConfig(sampling=E.eval_sampling(n=4, width=2, max_new_tokens=6, temperature=1.0, seed=3))
    samples = E.sample_examples(model, tok, task, task.examples, cfg.sampling_at(cfg.sampling.width))
    flags = E.grade_samples(task, task.examples, samples)
    assert [len(s) for s in samples] == [len(f) for f in flags] == [4] * 6
    for ex, outs, marks in zip(task.examples, samples, flags):
        assert marks == [ex["digit"] in tok.decode(s.token_ids, skip_special_tokens=True) for s in outs]
        assert [s.text for s in outs] == [tok.decode(s.token_ids, skip_special_tokens=True) for s in outs]
    mean = sum(map(sum, flags)) / 24
    assert 0.0 < mean < 1.0  # both grades occur: the check above tests both
    assert E.accuracy(model, tok, task, cfg) == pytest.approx(mean)


@pytest.mark.parametrize("blocks", [None, "pmatch", "bridge"])
def test_eval_at_several_widths_says_when_the_width_changes_nothing(tmp_path, capsys, blocks):
    """Without Bridge blocks the samples of every width are the same (checked): eval says so; with them it does not."""
    save_tiny_model_dir(tmp_path / "m", blocks=blocks)
    data = str(_toy(tmp_path / "toy.jsonl", 2))
    run = tmp_path / "run"
    main(
        ["eval", "--model", str(tmp_path / "m"), "--data", data, "--n", "4", "--widths", "1,2", "--width", "2"]
        + ["--max-new-tokens", "6", "--temperature", "1.0", "--out", str(run), "--no-score"]
    )
    noted = "so its samples do not depend on the width: widths [1, 2] sample the same sets" in capsys.readouterr().out
    assert noted == (blocks != "bridge")
    by_width = {}
    for rec in read_records(run / "samples.jsonl"):
        by_width.setdefault(rec["width"], {})[rec["index"]] = [s["token_ids"] for s in rec["samples"]]
    if blocks != "bridge":
        assert by_width[1] == by_width[2]
    # --foreign-groups, a control of Bridge's siblings, is said to change nothing where no sample reads another
    argv = ["eval", "--model", str(tmp_path / "m"), "--data", data, "--n", "2", "--max-new-tokens", "2", "--no-score"]
    for widths, moot in (("2", blocks != "bridge"), ("1", True)):
        out = tmp_path / f"fg{widths}"
        main([*argv, "--widths", widths, "--width", widths, "--foreign-groups", "--out", str(out)])
        said = capsys.readouterr().out
        assert ("bridgelm eval: note: --foreign-groups changes nothing here: " in said) is moot, said
        single = "so width 2 samples like width 1: independently" in said  # one width: a forgotten --blocks
        assert single == (widths == "2" and blocks != "bridge"), said
        if moot and widths == "1":
            assert "at width 1 a sample has no siblings" in said or "so no sample reads another" in said


def test_an_interrupted_eval_says_what_it_kept_once(tmp_path, capsys, monkeypatch):
    """Ctrl-C while eval samples: one line saying where the samples so far are and that the same command continues
    (the command line's own "interrupted" is not added), exit code 130."""
    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    save_tiny_model_dir(tmp_path / "m")
    monkeypatch.setattr(E, "sample_benchmarks", ctrl_c)
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as stop:
        data = str(_toy(tmp_path / "toy.jsonl", 2))
        main(["eval", "--model", str(tmp_path / "m"), "--data", data, "--n", "2", "--widths", "1,2", "--out", str(run)])
    said = capsys.readouterr()
    err = said.err
    assert stop.value.code == 130 and err.count(": interrupted") == 1, err
    # --width outside --widths: the width the tables report instead is said
    noted = "note: --width 8 (the width tables report) is not among --widths 1,2: they report w=2, the widest"
    assert noted in said.out
    # stopped before anything was written: not said to be kept where nothing is
    assert f"bridgelm eval: interrupted; nothing was written yet ({run} does not exist)" in err


def test_samples_added_after_a_score_remove_its_stale_metrics(tmp_path, capsys):
    """A run scored part-way (score --allow-partial), then completed with --no-score: its metrics.json no longer
    says what the samples hold (report read it as a partial run): removed, and said, when samples are added."""
    save_tiny_model_dir(tmp_path / "m")
    run = tmp_path / "run"
    argv = ["eval", "--model", str(tmp_path / "m"), "--data", str(_toy(tmp_path / "toy.jsonl", 3)), "--n", "2",
            "--width", "1", "--max-new-tokens", "2", "--no-score", "--out", str(run)]
    main(argv)
    lines = (run / "samples.jsonl").read_text().splitlines(keepends=True)
    (run / "samples.jsonl").write_text("".join(lines[:2]))  # as if stopped before the last problem
    S.score_run(run, allow_partial=True, progress=False)
    assert (run / "metrics.json").is_file() and (run / "scores.jsonl").is_file()
    capsys.readouterr()
    main(argv)  # the last problem sampled now: the partial scores are stale
    assert not (run / "metrics.json").exists() and not (run / "scores.jsonl").exists()
    assert "removed metrics.json, scores.jsonl of the run before these samples" in capsys.readouterr().out
    main(["score", str(run)])
    main(argv)  # nothing sampled now: the scores stay
    assert (run / "metrics.json").is_file()

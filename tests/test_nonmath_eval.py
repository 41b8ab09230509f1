"""Eval runs of the non-math tasks as a user runs them (CLI): sample, resume, score (continuous ROUGE-1 with its
per-prompt variance), cut long documents to the context, and report the paper's Table 2 and Table 5 layouts."""

import json

import pytest
from conftest import randomize_blocks, tiny_model

import bridgelm
from bridgelm.cli import main
from bridgelm.engine import encode_prompts
from bridgelm.eval import prompts as P
from bridgelm.jsonl import read_records
from bridgelm.tasks import gsm8k, summarize
from bridgelm.tokenizer import char_tokenizer

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 .,:?()+-*/=\n"
REFERENCE = "the cat sat on the mat"
CONTEXT = 640  # positions of the tiny model: a GPQA prompt fits, LONG_DOCUMENT does not
LONG_DOCUMENT = "the cat sat on the mat and looked at the dog. " * 24  # 1104 characters: too long


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    tok = char_tokenizer(ALPHABET)
    model = tiny_model(
        vocab_size=len(tok),
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_position_embeddings=CONTEXT,
    )
    randomize_blocks(bridgelm.add_bridge(model))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def _eval(model_dir, task, data, out, *extra):
    args = ["eval", "--model", model_dir, "--task", task, "--n", "4", "--width", "2", "--max-new-tokens", "6"]
    main(args + [arg for d in data for arg in ("--data", d)] + ["--out", str(out), *extra])


def _fabricate(run, texts_by_index):
    recs = read_records(run / "samples.jsonl")
    for rec in recs:
        texts = texts_by_index[rec["index"]]
        rec["samples"] = [{"text": t, "token_ids": [5] * 3, "finished": True} for t in texts]
    (run / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_fit_prompt_keeps_the_longest_prefix_that_fits():
    tok = char_tokenizer(ALPHABET)
    task = summarize.Summarization(name="xsum", examples=[])
    example = {"document": LONG_DOCUMENT, "summary": REFERENCE}
    count = lambda text: len(encode_prompts(tok, [text], False, warn=False)[0])  # noqa: E731
    assert P.fit_prompt(task, example, tok, False, 10_000) == (task.prompt(example), None)  # fits: unchanged
    text, cut = P.fit_prompt(task, example, tok, False, 120)
    assert count(text) <= 120 and cut["budget"] == 120 and cut["prompt_tokens"] == count(task.prompt(example))
    assert text == task.prompt({**example, "document": LONG_DOCUMENT[: cut["kept_chars"]]})
    longer = task.prompt({**example, "document": LONG_DOCUMENT[: cut["kept_chars"] + 1]})
    assert count(longer) > 120  # one more character (= token here) would not fit
    assert cut["field"] == "document" and cut["field_tokens"] == len(LONG_DOCUMENT) and 0 < cut["kept_tokens"] < 120
    with pytest.raises(ValueError, match=r"even with its 'document' empty: more than the 20 tokens"):
        P.fit_prompt(task, example, tok, False, 20)
    gsm = gsm8k.GSM8K(name="gsm8k", examples=[])  # tasks without a long field are never cut
    assert P.fit_prompt(gsm, {"question": "x" * 500, "answer": "#### 1"}, tok, False, 10)[1] is None


def test_xsum_run_resumes_scores_rouge_and_cuts_long_documents(tmp_path, model_dir, capsys):
    rows = [
        {"document": "the cat sat on the mat.", "summary": REFERENCE},
        {"document": LONG_DOCUMENT, "summary": "a dog"},
        {"document": "rain fell all day.", "summary": "rain fell"},
    ]
    data = _jsonl(tmp_path / "xsum_test.jsonl", rows)
    run = tmp_path / "run"
    _eval(model_dir, "xsum", [data], run)
    printed = capsys.readouterr().out
    assert (
        "sampled 3 problems now" in printed
        and "the long document of 1 of them was cut" in printed
        and "mean rouge1 (ROUGE-1 F1) " in printed
    )
    settings = json.loads((run / "run.json").read_text())
    assert settings["task"] == "xsum" and settings["prompt_budget"] == CONTEXT - 6
    recs = {r["index"]: r for r in read_records(run / "samples.jsonl")}
    assert set(recs) == {0, 1, 2} and "truncated" not in recs[0] and "truncated" not in recs[2]
    cut = recs[1]["truncated"]
    assert cut["budget"] == CONTEXT - 6 and len(recs[1]["prompt_ids"]) <= CONTEXT - 6 < cut["prompt_tokens"]
    assert recs[1]["prompt"].endswith("Summarize the above article in 1 sentence.")
    assert recs[1]["prompt"].startswith("Article: " + LONG_DOCUMENT[: cut["kept_chars"]].strip())

    _eval(model_dir, "xsum", [data], run)  # resumes: nothing left to sample
    assert "sampled 0 problems now, 3 were already" in capsys.readouterr().out

    # known summaries: ROUGE-1 F1 against the reference, its per-prompt mean and variance
    _fabricate(
        run,
        {
            0: [f"<think>x</think>{REFERENCE}", "a cat sat on a mat", "a cat sat on a mat", "dog"],  # 1, 2/3, 2/3, 0
            1: ["a dog"] * 4,
            2: ["rain fell", "rain fell", "<think>never closed", "rain"],  # 1, 1, 0, 2/3
        },
    )
    main(["score", str(run)])
    scores = {s["index"]: s for s in read_records(run / "scores.jsonl")}
    assert scores[0]["scores"] == pytest.approx([1, 2 / 3, 2 / 3, 0]) and scores[2]["scores"] == pytest.approx(
        [1, 1, 0, 2 / 3]
    )
    assert scores[0]["mean"] == pytest.approx(7 / 12) and scores[0]["variance"] == pytest.approx(19 / 144)
    assert scores[1]["truncated"] and not scores[0]["truncated"]
    entry = json.loads((run / "metrics.json").read_text())["benchmarks"]["xsum_test"]["2"]
    means = [7 / 12, 1.0, 2 / 3]
    variances = [19 / 144, 0.0, (1 + 1 + 0 + 4 / 9) / 4 - (2 / 3) ** 2]
    assert entry["metrics"]["rouge1"]["mean"] == pytest.approx(sum(means) / 3)
    assert entry["metrics"]["score_variance"]["mean"] == pytest.approx(sum(variances) / 3)
    assert entry["metrics"]["rouge1"]["low"] <= entry["metrics"]["rouge1"]["mean"] <= entry["metrics"]["rouge1"]["high"]
    assert not any(k.startswith(("pass@", "g_pass", "mg_pass", "accuracy", "majority")) for k in entry["metrics"])
    assert entry["truncated"] == 1 and entry["budgets"]["2"]["rouge1"] == 0.0  # every sample has 3 tokens
    assert entry["budgets"]["6"]["rouge1"] == pytest.approx(entry["metrics"]["rouge1"]["mean"])

    # a report of ROUGE-only runs: no accuracy Avg (no NaN in strict JSON), no accuracy line on the terminal
    capsys.readouterr()
    main(["report", str(run), "--out", str(tmp_path / "report")])
    said = capsys.readouterr().out
    text = (tmp_path / "report" / "report.json").read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"report.json holds {c}"))
    assert "mean accuracy" not in said and "nan" not in said.lower() and "non-math (ROUGE-1" in said


def _nonmath_runs(tmp_path, model_dir, name):
    """One small run per Table 2 task, as a user makes them; returns {task: run dir}."""
    folder = tmp_path / name
    folder.mkdir()
    gpqa_row = {
        "Question": "which?",
        "Correct Answer": "one",
        "Incorrect Answer 1": "two",
        "Incorrect Answer 2": "three",
        "Incorrect Answer 3": "four",
    }
    grid = {"header": ["House", "Name"], "rows": [["1", "arnold"], ["2", "bob"]]}
    data = {
        "xsum": _jsonl(folder / "xsum.jsonl", [{"document": "the cat sat.", "summary": REFERENCE}] * 2),
        "cnn_dailymail": _jsonl(folder / "cnn_dm.jsonl", [{"article": "rain fell.", "highlights": "rain fell"}] * 2),
        "gpqa": _jsonl(folder / "gpqa_diamond.jsonl", [gpqa_row] * 2),
        "zebra": _jsonl(folder / "zebra.jsonl", [{"id": "a", "size": "2*1", "puzzle": "who?", "solution": grid}] * 2),
        "countdown": _jsonl(folder / "countdown.jsonl", [{"nums": [1, 2, 3], "target": 6}] * 2),
    }
    runs = {}
    for task, path in data.items():
        runs[task] = folder / task
        _eval(model_dir, task, [path], runs[task], "--no-score")
    return runs


def test_table_2_and_table_5_layouts(tmp_path, model_dir, capsys):
    answers = {
        "xsum": [REFERENCE, REFERENCE, "a cat sat on a mat", "dog"],  # mean (1 + 1 + 2/3 + 0) / 4
        "cnn_dailymail": ["rain fell"] * 4,
        "gpqa": None,  # filled from each problem's gold letter
        "zebra": ['{"solution": {"House 1": {"Name": "Arnold"}, "House 2": {"Name": "bob"}}}'] * 3 + ["no"],
        "countdown": ["<answer>1 + 2 + 3</answer>", "\\boxed{1 * 2 * 3}", "<answer>1 + 2</answer>", "6"],
    }
    rows = {}
    for name in ("base", "bridge"):
        runs = _nonmath_runs(tmp_path, model_dir, name)
        for task, run in runs.items():
            if task == "gpqa":
                gold = read_records(run / "samples.jsonl")[0]["answer"]
                wrong = "A" if gold != "A" else "B"
                texts = [f"Answer: {gold}"] * (4 if name == "bridge" else 1) + [f"Answer: {wrong}"] * 3
                _fabricate(run, {0: texts[:4], 1: texts[:4]})
            else:
                _fabricate(run, {0: answers[task], 1: answers[task]})
            main(["score", str(run)])
        rows[name] = runs
    main(["analyze", "similarity", "--run", str(rows["bridge"]["xsum"]), "--embedding-model", ""])
    out = tmp_path / "report"
    dirs = [
        str(rows[n][t]) for n in ("base", "bridge") for t in ("countdown", "gpqa", "xsum", "zebra", "cnn_dailymail")
    ]
    names = ",".join(n for n in ("base", "bridge") for _ in range(5))
    capsys.readouterr()
    main(["report", *dirs, "--names", names, "--out", str(out)])
    printed = capsys.readouterr().out
    assert "bridge: non-math (ROUGE-1 / accuracy, %): XSum 66.67, CNN/DM 100.00, GPQA 100.00" in printed
    table = (out / "table.md").read_text()
    lines = table.splitlines()
    assert "## Non-math benchmarks (paper Table 2)" in table
    header2 = "| Model | XSum | CNN/DM | GPQA | ZebraLogic | Countdown |"  # the paper's column order
    base_row = next(line for line in lines[lines.index(header2) :] if line.startswith("| base | "))
    cells = [c.strip().split(" [")[0] for c in base_row.strip("|").split("|")[1:]]
    assert cells == ["66.67", "100.00", "25.00", "75.00", "50.00"]
    report = json.loads((out / "report.json").read_text())
    assert report["nonmath"]["metric"] == {
        "xsum": "rouge1",
        "cnn_dm": "rouge1",
        "gpqa_diamond": "accuracy",
        "zebra": "accuracy",
        "countdown": "accuracy",
    }
    # Table 5: variance of ROUGE-1 x 100 within a prompt's set; the similarity only where it was computed
    assert "## Output stability (paper Table 5)" in table
    head = next(line for line in lines if line.startswith("| Model | XSum variance"))
    assert head == "| Model | XSum variance | CNN/DM variance | XSum ROUGE-L sim. |"
    variance = 1e4 * ((1 + 1 + 4 / 9 + 0) / 4 - (2 / 3) ** 2)  # = 1e4 / 6
    stab = report["stability"]["rows"]
    assert stab["base"]["variance:xsum"]["mean"] == pytest.approx(variance)
    assert stab["base"]["variance:cnn_dm"]["mean"] == 0.0 and "rouge_l:xsum" not in stab["base"]
    similarity = json.loads((rows["bridge"]["xsum"] / "similarity.json").read_text())["xsum"]["2"]["rouge_l"]["mean"]
    assert stab["bridge"]["rouge_l:xsum"]["mean"] == pytest.approx(100 * similarity)
    table5 = lines[lines.index(head) :]
    base5 = next(line for line in table5 if line.startswith("| base |"))
    bridge5 = next(line for line in table5 if line.startswith("| bridge |"))
    assert base5.startswith(f"| base | {variance:.2f} [") and base5.endswith("| – |")
    assert bridge5.endswith(f"| {100 * similarity:.2f} [{100 * similarity:.1f}, {100 * similarity:.1f}] |")

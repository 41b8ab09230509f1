"""Reports: Table-1 markdown with Avg and the improvement column, coverage table, PNG figures, report.json."""

import copy
import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

import bridgelm
from bridgelm.eval import runner as E
from bridgelm.eval import report as R
from bridgelm.eval import score as S
from bridgelm.cli import main
from bridgelm.jsonl import read_records
from bridgelm.eval.report import collect_rows
from bridgelm.eval.tables import benchmark_table, gpass_table, markdown_table, pct, table_numbers
from bridgelm.tokenizer import char_tokenizer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def model_tok():
    tok = char_tokenizer("0123456789+-=() abc\n")
    model = tiny_model(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return bridgelm.add_bridge(model), tok


def _scored_run(folder: Path, model_tok, correct: dict, widths: list[int], **settings) -> Path:
    """A sampled and scored run whose samples are replaced: `correct[bench][i]` of 4 samples answer right."""
    model, tok = model_tok
    folder.mkdir()
    data = []
    for bench in correct:
        path = folder / f"{bench}.jsonl"
        path.write_text("".join(json.dumps({"problem": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(2)))
        data.append(str(path))
    sampling = E.eval_sampling(n=4, width=widths[-1], max_new_tokens=4, **settings)
    cfg = E.EvalConfig(sampling=sampling, widths=widths)
    run = folder / "run"
    E.run_eval(model, tok, "math", data, cfg, run, "tiny", progress=False)
    recs = read_records(run / "samples.jsonl")
    for rec in recs:
        c = correct[rec["benchmark"]][rec["index"]]
        texts = [f"\\boxed{{{2 * rec['index']}}}"] * c + ["\\boxed{99}"] * (4 - c)
        rec["samples"] = [{"text": t, "token_ids": [5, 5, 5], "finished": True} for t in texts]
    (run / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    S.score_run(run, progress=False)
    return run


def test_report_of_two_runs(tmp_path, model_tok, capsys):
    base = _scored_run(tmp_path / "a", model_tok, {"aime24": [1, 0], "amc23": [2, 2]}, [2])
    bridge = _scored_run(tmp_path / "b", model_tok, {"aime24": [3, 1], "amc23": [4, 2]}, [1, 2])
    out = tmp_path / "report"
    main(["report", str(base), str(bridge), "--names", "base,bridge", "--out", str(out)])
    assert "table.md" in capsys.readouterr().out
    table = (out / "table.md").read_text()
    acc = {}
    for name, run in (("base", base), ("bridge", bridge)):
        m = json.loads((run / "metrics.json").read_text())["benchmarks"]
        acc[name] = [m[b]["2"]["metrics"]["accuracy"]["mean"] for b in ("aime24", "amc23")]
    avg = {name: sum(v) / 2 for name, v in acc.items()}
    assert avg == {"base": pytest.approx(0.3125), "bridge": pytest.approx(0.625)}
    header = next(line for line in table.splitlines() if line.startswith("| Model | AIME24"))
    assert header == "| Model | AIME24 | AMC | Avg | ↑Δ |"
    base_row = next(line for line in table.splitlines() if line.startswith("| base |"))
    bridge_row = next(line for line in table.splitlines() if line.startswith("| bridge |"))
    assert base_row.endswith(f"| {100 * avg['base']:.2f} | +0.00 |")
    assert bridge_row.endswith(f"| {100 * avg['bridge']:.2f} | {100 * (avg['bridge'] - avg['base']):+.2f} |")
    assert bridge_row.startswith(f"| bridge | {100 * acc['bridge'][0]:.2f} [")
    assert "## Coverage" in table and "## Majority vote" in table and "| bridge (w=1) |" in table
    report = json.loads((out / "report.json").read_text())
    assert report["accuracy"]["rows"]["bridge"]["delta"] == pytest.approx(avg["bridge"] - avg["base"])
    assert report["coverage@n"]["rows"]["base"]["avg"] == pytest.approx(0.75)  # aime24 1 of 2, amc23 2 of 2
    assert report["gpass"]["bridge"]["k"] == 4 and set(report["width"]) == {"bridge"}
    for name in ("gpass.png", "width.png", "length.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    assert "In length.png a sample counts at budget L when it finished within L tokens" in table
    # another base row: the improvement column changes sign
    main(["report", str(base), str(bridge), "--names", "base,bridge", "--base", "bridge", "--out", str(out)])
    table = (out / "table.md").read_text()
    base_row = next(line for line in table.splitlines() if line.startswith("| base |"))
    assert base_row.endswith(f"| {100 * (avg['base'] - avg['bridge']):+.2f} |")
    with pytest.raises(ValueError, match="has benchmark 'aime24' twice"):
        collect_rows([str(base), str(bridge)], ["x", "x"])
    assert report["setting_differences"] == [] and "Not like for like" not in table


def test_a_row_without_a_mean_says_which_benchmark_it_lacks(tmp_path, model_tok, capsys):
    both = _scored_run(tmp_path / "a", model_tok, {"aime24": [1, 0], "amc23": [2, 2]}, [2])
    one = _scored_run(tmp_path / "b", model_tok, {"aime24": [3, 1]}, [2])
    main(["report", str(both), str(one), "--names", "both,one", "--out", str(tmp_path / "report")])
    said = capsys.readouterr().out
    assert "bridgelm report: both: mean accuracy 31.25%" in said  # aime24 (1/4 + 0) / 2, amc23 2/4: their mean
    assert "bridgelm report: one: mean accuracy – (not scored on amc23)" in said


def test_report_says_when_it_scores_a_run_or_reports_another_width(tmp_path, model_tok, capsys):
    """A run without metrics.json is scored first, and the terminal says so; a partial run with no scores at its
    own width is reported at the width it has, with a warning (in report.json and the terminal), not silently."""
    run = _scored_run(tmp_path / "a", model_tok, {"aime24": [1, 0]}, [1, 2])
    (run / "metrics.json").unlink()
    main(["report", str(run), "--out", str(tmp_path / "r1")])
    said = capsys.readouterr().out
    assert f"bridgelm report: {run} is not scored yet: scoring it first (-> {run / 'metrics.json'})" in said
    assert json.loads((tmp_path / "r1" / "report.json").read_text())["setting_differences"] == []
    recs = [r for r in read_records(run / "samples.jsonl") if r["width"] == 1]  # w=2, the run's width, not sampled
    (run / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    S.score_run(run, allow_partial=True, progress=False)
    main(["report", str(run), "--out", str(tmp_path / "r2")])
    said = capsys.readouterr().out
    line = "run: aime24 has no scores at its run's width 2 (a partial run): reported at w=1"
    assert json.loads((tmp_path / "r2" / "report.json").read_text())["setting_differences"] == [line]
    assert f"bridgelm report: warning: {line}" in said and "scoring it first" not in said


def test_report_says_when_rows_differ_in_settings(tmp_path, model_tok, capsys):
    """A row sampled hotter, on other data for one benchmark: the report names each difference, in table.md, in
    report.json and on the terminal."""
    base = _scored_run(tmp_path / "a", model_tok, {"aime24": [1, 0], "amc23": [2, 2]}, [2])
    hot = _scored_run(tmp_path / "b", model_tok, {"aime24": [3, 1]}, [2], temperature=0.7)
    model, tok = model_tok
    half = _scored_run(tmp_path / "h", (copy.deepcopy(model).to(torch.bfloat16), tok), {"aime24": [1, 0]}, [2])
    (tmp_path / "c").mkdir()
    other = tmp_path / "c" / "amc23.jsonl"
    other.write_text(json.dumps({"problem": "5+5=", "answer": "10"}) + "\n")
    model, tok = model_tok
    E.run_eval(
        model, tok, "math", [str(other)], E.EvalConfig(sampling=E.eval_sampling(n=4, width=2, max_new_tokens=4)),
        tmp_path / "c" / "run", "tiny",
    )
    out = tmp_path / "report"
    main(["report", str(base), str(hot), str(tmp_path / "c" / "run"), str(half), "--names", "base,hot,hot,half",
          "--out", str(out)])
    said = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert report["setting_differences"] == [
        "aime24: temperature differs between rows: base 0.6, hot 0.7, half 0.6",
        'aime24: dtype differs between rows: base "float32", hot "float32", half "bfloat16"',
        "amc23: problems differs between rows: base 2, hot 1",
        f"amc23: data (digest) differs between rows: {report['setting_differences'][3].split('rows: ')[1]}",
    ]
    assert all(f"bridgelm report: warning: {line}" in said for line in report["setting_differences"])
    assert "**Not like for like**" in (out / "table.md").read_text()


def test_report_marks_a_foreign_groups_control(tmp_path, model_tok, capsys):
    """A run of control (b) (`eval --foreign-groups`) is marked in the run list and warned about, not shown as an
    ordinary Bridge row."""
    own = _scored_run(tmp_path / "a", model_tok, {"aime24": [1, 0]}, [2])
    foreign = _scored_run(tmp_path / "b", model_tok, {"aime24": [1, 1]}, [2], foreign_groups=True)
    out = tmp_path / "report"
    main(["report", str(own), str(foreign), "--names", "own,foreign", "--out", str(out)])
    said = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert report["runs"]["foreign"]["foreign_groups"] and not report["runs"]["own"]["foreign_groups"]
    assert report["setting_differences"] == ["aime24: foreign_groups differs between rows: own false, foreign true"]
    assert "warning: aime24: foreign_groups differs" in said
    table = (out / "table.md").read_text()
    line = next(x for x in table.splitlines() if x.startswith("- **foreign**"))
    assert "**foreign groups**" in line and "**foreign groups**" not in table.split("- **own**")[1].split("\n")[0]


def test_gpass_header_names_k_only_when_the_rows_share_it():
    curves = {
        "a": {"k": 4, "values": {m: 0.5 for m in range(1, 5)}, "mg_pass": 0.25},
        "b": {"k": 2, "values": {1: 0.5, 2: 0.25}, "mg_pass": 0.1},
    }
    head = gpass_table(curves).splitlines()[0]
    assert "mG-Pass@k (the row's k)" in head and "mG-Pass@4" not in head
    assert "| mG-Pass@4 |" in gpass_table({"a": curves["a"]}).splitlines()[0]


def test_table_helpers_take_plain_dicts():
    rows = {
        "a": {"b1": {"mean": 0.10, "low": 0.05, "high": 0.2}, "b2": {"mean": 0.30, "low": 0.2, "high": 0.4}},
        "b": {"b1": {"mean": 0.20, "low": 0.1, "high": 0.3}},
    }
    numbers = table_numbers(rows)
    assert numbers["columns"] == ["b1", "b2"] and numbers["rows"]["a"]["avg"] == pytest.approx(0.2)
    assert numbers["rows"]["b"]["avg"] is None and numbers["rows"]["b"]["delta"] is None  # lacks b2
    empty = table_numbers({"a": {}, "b": {}})  # no accuracy column (ROUGE-only runs): no Avg, not NaN
    assert empty["rows"]["a"]["avg"] is None and empty["rows"]["b"]["delta"] is None
    text = benchmark_table(rows, intervals=False)
    assert "| a | 10.00 | 30.00 | 20.00 | +0.00 |" in text and "| b | 20.00 | – | – | – |" in text
    with pytest.raises(ValueError, match="base row 'c'"):
        benchmark_table(rows, base="c")


def test_one_markdown_table_for_every_report():
    """The reports' tables and the demo's come from `markdown_table`: names left-aligned, numbers right-aligned."""
    rows = [["base", "math", pct(0.5)], ["b", "aime", pct(None)]]
    got = markdown_table(["Run", "benchmark", "accuracy (%)"], rows, labels=2)
    assert got == "| Run | benchmark | accuracy (%) |\n|---|---|---:|\n| base | math | 50.00 |\n| b | aime | – |"
    assert markdown_table(["Method", "1"], []) == "| Method | 1 |\n|---|---:|"


def test_report_writes_into_its_own_folder_only(tmp_path, model_tok, capsys):
    """--out holding what no report wrote (notes, another tool's report.json) or a run's own folder is refused in one
    line and left as it was (report replaced table.md, report.json and figures there); a report's own folder is
    written again, a figure it no longer draws removed."""
    run = _scored_run(tmp_path / "a", model_tok, {"aime24": [1, 0]}, [1])  # one width: no width figure
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "table.md").write_text("keep me\n")
    older = tmp_path / "older"  # a report of another tool (or an older bridgelm): report.json of no kind
    older.mkdir()
    (older / "report.json").write_text('{"accuracy": {}}')
    cases = [(notes, "holds table.md, and no report.json of bridgelm report"), (run, "is a run's folder"),
             (older, "holds report.json, and its report.json is not one this bridgelm wrote")]
    for out, words in cases:
        before = sorted(p.name for p in out.iterdir())
        with pytest.raises(SystemExit) as err:
            main(["report", str(run), "--out", str(out)])
        assert err.value.code == 2 and words in capsys.readouterr().err
        assert sorted(p.name for p in out.iterdir()) == before
    assert (notes / "table.md").read_text() == "keep me\n"
    out = tmp_path / "report"
    main(["report", str(run), "--out", str(out)])
    assert json.loads((out / "report.json").read_text())["kind"] == "report"
    (out / "width.png").write_bytes(b"a figure of an earlier report, of runs at several widths")
    main(["report", str(run), "--out", str(out)])  # its own folder: written again, without a width figure
    files = {Path(f).name for f in json.loads((out / "report.json").read_text())["files"]}
    assert "width.png" not in files and not (out / "width.png").exists() and files <= set(R.FIGURES)

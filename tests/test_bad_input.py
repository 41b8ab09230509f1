"""Bad and hostile input: every case answers with one line naming the value (exit 2), loses nothing, and never
silently does the wrong thing; a bug keeps its traceback and says it is one."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_model_dir
from safetensors.torch import save_file

from bridgelm import tasks
from bridgelm.cli import main
from bridgelm.errors import DataWarning, UserError, user_message
from bridgelm.evaluate import EvalConfig
from bridgelm.jsonl import read_records
from bridgelm.train import common

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A plain tiny model folder, one with Bridge blocks, and damaged copies of the plain one."""
    root = tmp_path_factory.mktemp("models")
    save_tiny_model_dir(root / "m")
    save_tiny_model_dir(root / "mb", blocks="bridge")
    for name in ("cut", "trunc", "shape"):
        shutil.copytree(root / "m", root / name)
    config = (root / "m" / "config.json").read_bytes()
    (root / "cut" / "config.json").write_bytes(config[: len(config) // 2])
    weights = (root / "m" / "model.safetensors").read_bytes()
    (root / "trunc" / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    shape = json.loads(config)
    shape["intermediate_size"] = 96  # the weights were saved with 128
    (root / "shape" / "config.json").write_text(json.dumps(shape))
    return root


def _fails(capsys, argv) -> str:
    """Run the CLI in-process; it must exit with 2 and say `bridgelm <command>: error:` in one line (returned;
    the rest of stderr is in `_fails.stderr`)."""
    with pytest.raises(SystemExit) as err:
        main([str(a) for a in argv])
    assert err.value.code == 2
    msg = capsys.readouterr().err
    lines = [line for line in msg.splitlines() if ": error: " in line]
    assert len(lines) == 1 and "Traceback" not in msg, msg
    _fails.stderr = msg
    return lines[0]


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------------------------------------- silent wrong results


@pytest.mark.parametrize("command", ["generate", "eval"])
def test_empty_stop_string_is_refused(models, tmp_path, capsys, command):
    extra = ["--prompt", "1+1="] if command == "generate" else ["--task", "arith"]
    out = tmp_path / ("s.jsonl" if command == "generate" else "run")
    line = _fails(capsys, [command, "--model", models / "m", *extra, "--stop", "", "--out", out])
    assert "--stop" in line and "empty stop string" in line
    assert not out.exists()
    with pytest.raises(ValueError, match="stop string ''"):
        EvalConfig(n=2, width=1, stop=["</s>", ""]).validate()


def test_generate_refuses_to_resume_with_other_prompts(models, tmp_path, capsys):
    first = _jsonl(tmp_path / "first.jsonl", [{"prompt": "1+2="}, {"prompt": "3+4="}])
    other = _jsonl(tmp_path / "other.jsonl", [{"prompt": "1+2="}, {"prompt": "9+9="}, {"prompt": "5"}])
    out = tmp_path / "s.jsonl"
    args = ["generate", "--model", models / "m", "--n", "2", "--max-new-tokens", "2", "--out", out]
    main([str(a) for a in args + ["--prompts", first]])
    before = out.read_bytes()
    line = _fails(capsys, args + ["--prompts", other])
    assert f"--prompts {other}" in line and "'3+4='" in line and "'9+9='" in line
    assert out.read_bytes() == before
    # the same prompts with one more at the end resume (only the new prompt is sampled)
    main([str(a) for a in args + ["--prompts", _jsonl(tmp_path / "more.jsonl", [{"prompt": "1+2="}, {"prompt": "3+4="}, {"prompt": "5"}])]])
    assert [r["index"] for r in read_records(out)] == [0, 1, 2]


@pytest.mark.parametrize(
    "content, expected",
    [
        (b"hello world\n", "line 1: malformed JSON"),  # a text file with one line
        (b"hello world", "line 1: malformed JSON"),  # unterminated, but not the start of a record
        (b'{"index": 0}\n{"index": \n', "line 2: malformed JSON"),  # a malformed last line that ends properly
        (b'{"index": 0}\n[1, 2]\n', "line 2: a JSON list, expected a JSON object"),
        (b'{"index": 0}\n{"text": "caf\xe9"}\n', "line 2: not UTF-8 text (byte 0xe9"),
    ],
)
def test_read_records_refuses_what_is_not_a_record_and_leaves_it(tmp_path, content, expected):
    path = tmp_path / "f.jsonl"
    path.write_bytes(content)
    with pytest.raises(UserError, match=re.escape(expected)):
        read_records(path)
    assert path.read_bytes() == content


def test_only_an_unterminated_record_is_a_cut_line(tmp_path):
    path = tmp_path / "f.jsonl"
    path.write_bytes(b'{"index": 0}\n{"index": 1, "te')
    assert read_records(path) == [{"index": 0}]
    assert path.read_bytes() == b'{"index": 0}\n'


def test_generate_leaves_a_foreign_out_file_alone(models, tmp_path, capsys):
    for content in (b"hello world\n", b'{"note": "mine"}\n'):  # not JSON; JSON but not a line of ours
        out = tmp_path / "notes.txt"
        out.write_bytes(content)
        line = _fails(capsys, ["generate", "--model", models / "m", "--prompt", "1=", "--n", "1", "--out", out])
        assert f"{out}, line 1" in line
        assert out.read_bytes() == content


@pytest.mark.parametrize(
    "task, row, expected",
    [
        ("arith", {"problem": "", "answer": "2"}, "field 'problem' is ''"),
        ("arith", {"problem": "1+1", "answer": ""}, "field 'answer' is '': expected an integer"),
        ("arith", {"problem": "1+1", "answer": "impossible"}, "field 'answer' is 'impossible': expected an integer"),
        ("arith", {"problem": "3+5", "answer": "7"}, "field 'answer' is '7', but 3\\+5 = 8"),
        ("gsm8k", {"question": "", "answer": "x\n#### 3"}, "field 'question' is ''"),
        ("gsm8k", {"question": "  ", "answer": "x\n#### 3"}, "field 'question' is '  '"),
        ("gsm8k", {"question": "q", "answer": "no final line"}, "GSM8K solution 'no final line' has no '#### N' final line"),
        ("math", {"problem": "", "answer": "2"}, "field 'problem' is ''"),
        ("math", {"problem": "p", "answer": " "}, "field 'answer' is ' '"),
        ("math", {"problem": "p", "answer": "\\frac{1}{2"}, "field 'answer' is .*: expected a LaTeX answer with balanced braces"),
        ("countdown", {"numbers": [1, 2], "target": "x"}, "field 'target' is 'x'"),
        ("countdown", {"numbers": [], "target": 3}, "field 'numbers' is \\[\\]"),
    ],
)
def test_bad_rows_are_refused_on_load_by_line(tmp_path, task, row, expected):
    good = {
        "arith": {"problem": "1+2", "answer": "3"},
        "gsm8k": {"question": "1+2?", "answer": "x\n#### 3"},
        "math": {"problem": "1+2?", "answer": "3"},
        "countdown": {"numbers": [1, 2], "target": 3},
    }[task]
    path = _jsonl(tmp_path / "test.jsonl", [good, row])
    assert len(tasks.load(task, str(_jsonl(tmp_path / "ok.jsonl", [good])))) == 1
    with pytest.raises(UserError, match=f"test.jsonl:2: {expected}"):
        tasks.load(task, str(path))


@pytest.mark.parametrize("command", ["eval", "warmup-data", "rl"])
def test_commands_refuse_an_empty_problem_before_loading_the_model(tmp_path, capsys, command):
    data = _jsonl(tmp_path / "train.jsonl", [{"question": "1+1", "answer": "#### 2"}, {"question": "", "answer": "#### 0"}])
    out = tmp_path / ("w.jsonl" if command == "warmup-data" else "out")
    line = _fails(capsys, [command, "--model", tmp_path / "no-model", "--task", "gsm8k", "--data", data, "--out", out])
    assert f"{data}:2: field 'question' is ''" in line
    assert not out.exists()


def test_a_repeated_problem_is_warned_about(tmp_path, capsys):
    path = _jsonl(tmp_path / "d.jsonl", [{"problem": p, "answer": str(eval(p))} for p in ("1+1", "2+2", "1+1", "1+1")])
    with pytest.warns(DataWarning, match="d.jsonl repeats problems: row 3 repeats row 1, row 4 repeats row 1"):
        task = tasks.load("arith", str(path))
    assert len(task) == 4  # kept: a warning, not an error
    # the command line prints it as one warning line (here before failing on the missing model)
    line = _fails(capsys, ["eval", "--model", tmp_path / "m", "--task", "arith", "--data", path, "--out", tmp_path / "r"])
    assert "model folder" in line
    assert f"bridgelm eval: warning: {path} repeats problems: row 3 repeats row 1" in _fails.stderr


def test_analyze_features_refuses_a_run_of_another_model(models, tmp_path, capsys):
    data = _jsonl(tmp_path / "a.jsonl", [{"problem": "1+2", "answer": "3"}])
    run = tmp_path / "run"
    main(["eval", "--model", str(models / "mb"), "--task", "arith", "--data", str(data), "--n", "2", "--width", "2",
          "--max-new-tokens", "2", "--out", str(run), "--no-score"])  # fmt: skip
    out = tmp_path / "features"
    base = ["analyze", "features", "--run", run, "--out", out, "--sets", "1"]
    line = _fails(capsys, [*base, "--model", models / "m", "--blocks", tmp_path / "b.safetensors"])
    assert line.startswith("bridgelm analyze features: error:") and f"model: run '{models / 'mb'}' vs now" in line
    assert not out.exists()
    main([str(a) for a in [*base, "--model", models / "mb"]])  # the model that sampled it
    assert len(json.loads((out / "features.json").read_text())["ratios"]) == 2

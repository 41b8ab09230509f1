"""Bad and hostile input: every case answers with one line naming the value (exit 2), loses nothing, and never
silently does the wrong thing; a bug keeps its traceback and says it is one."""

import io
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

import bridgelm
from bridgelm import jsonl, tasks
from bridgelm.cli import main
from bridgelm.errors import DataWarning, UserError, user_message
from bridgelm.eval.runner import EvalConfig, eval_sampling
from bridgelm.jsonl import read_records
from bridgelm.train import checkpoints

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A plain tiny model folder, one with Bridge blocks, and damaged copies of the plain one."""
    root = tmp_path_factory.mktemp("models")
    save_tiny_model_dir(root / "m")
    save_tiny_model_dir(root / "mb", blocks="bridge")
    for name in ("cut", "trunc", "shape", "noweights", "badtype", "notok", "strtype"):
        shutil.copytree(root / "m", root / name)
    (root / "noweights" / "model.safetensors").unlink()
    for file in (root / "notok").glob("*token*"):
        file.unlink()
    config = (root / "m" / "config.json").read_bytes()
    (root / "cut" / "config.json").write_bytes(config[: len(config) // 2])
    weights = (root / "m" / "model.safetensors").read_bytes()
    (root / "trunc" / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    shape = json.loads(config)
    shape["intermediate_size"] = 96  # the weights were saved with 128
    (root / "shape" / "config.json").write_text(json.dumps(shape))
    (root / "badtype" / "config.json").write_text(json.dumps({**json.loads(config), "model_type": "nosuchmodel"}))
    (root / "strtype" / "config.json").write_text(json.dumps({**json.loads(config), "hidden_size": "64"}))
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
        EvalConfig(sampling=eval_sampling(n=2, width=1), stop=["</s>", ""]).validate()


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
    main(
        [
            str(a)
            for a in args
            + ["--prompts", _jsonl(tmp_path / "more.jsonl", [{"prompt": "1+2="}, {"prompt": "3+4="}, {"prompt": "5"}])]
        ]
    )
    assert [r["index"] for r in read_records(out)] == [0, 1, 2]
    before = out.read_bytes()  # fewer prompts than the file holds: said so, not "another file"
    line = _fails(capsys, args + ["--prompts", first])
    assert f"holds samples of prompt 3, but --prompts {first} has 2 prompts now (a shorter file)" in line
    assert out.read_bytes() == before


def test_generate_resumes_from_another_spelling_of_the_model_folder(models, tmp_path, monkeypatch):
    """The model is recorded as its absolute folder: `m`, `./m` and /abs/m are one model (they were refused)."""
    monkeypatch.chdir(models)
    out = tmp_path / "s.jsonl"
    args = ["generate", "--n", "2", "--max-new-tokens", "2", "--out", out]
    main([str(a) for a in [*args, "--model", "m", "--prompt", "1+2="]])
    main([str(a) for a in [*args, "--model", "./m", "--prompt", "1+2="]])  # nothing left to sample: no error
    assert [r["settings"]["model"] for r in read_records(out)] == [str(models / "m")]


@pytest.mark.parametrize(
    "content, expected",
    [
        (b"hello world\n", "line 1: malformed JSON"),  # a text file with one line
        (b"hello world", "line 1: malformed JSON"),  # unterminated, but not the start of a record
        (b'{"index": 0}\n{"index": \n', "line 2: malformed JSON"),  # a malformed last line that ends properly
        (b'{"index": 0}\n[1, 2]\n', "line 2: a JSON array: expected one JSON object per line"),
        (b'{"index": 0}\n{"text": "caf\xe9"}\n', "line 2: not UTF-8 text (byte 0xe9"),
    ],
)
def test_read_records_refuses_what_is_not_a_record_and_leaves_it(tmp_path, content, expected):
    path = tmp_path / "f.jsonl"
    path.write_bytes(content)
    with pytest.raises(UserError, match=re.escape(expected)):
        read_records(path)
    assert path.read_bytes() == content


def test_data_files_and_files_written_by_hand_have_one_reader(tmp_path):
    """A task's data file and a file of records written by hand (allow_cut=False: --prompts) are read by one reader
    (jsonl.json_lines): the same line gets the same refusal, naming the file and the line."""
    path = tmp_path / "f.jsonl"
    path.write_bytes(b'{"problem": "1+2", "answer": "3"}\n{"problem": "1", "problem": "2", "answer": "3"}\n')
    expected = f"{path}, line 2: field 'problem' is given twice in one object: expected each field once"
    with pytest.raises(UserError, match=re.escape(expected)):
        tasks.load("arith", str(path))
    with pytest.raises(UserError, match=re.escape(expected)):
        read_records(path, repair=False, allow_cut=False)
    assert read_records(path, repair=False)[1] == {"problem": "2", "answer": "3"}  # our own files: as json reads


def test_only_an_unterminated_record_is_a_cut_line(tmp_path):
    path = tmp_path / "f.jsonl"
    path.write_bytes(b'{"index": 0}\n{"index": 1, "te')
    with pytest.raises(UserError, match="line 2: malformed JSON"):  # a file written by hand: nothing is dropped
        read_records(path, repair=False, allow_cut=False)
    assert read_records(path) == [{"index": 0}]
    assert path.read_bytes() == b'{"index": 0}\n'


def test_a_cut_last_prompt_is_not_dropped(models, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+2="}\n{"prompt": "3+')
    line = _fails(capsys, ["generate", "--model", models / "m", "--prompts", prompts, "--out", tmp_path / "s.jsonl"])
    assert f"{prompts}, line 2: malformed JSON" in line


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
        (
            "gsm8k",
            {"question": "q", "answer": "no final line"},
            "GSM8K solution 'no final line' has no '#### N' final line",
        ),
        ("math", {"problem": "", "answer": "2"}, "field 'problem' is ''"),
        ("math", {"problem": "p", "answer": " "}, "field 'answer' is ' '"),
        (
            "math",
            {"problem": "p", "answer": "\\frac{1}{2"},
            "field 'answer' is .*: expected a LaTeX answer with balanced braces",
        ),
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
    with pytest.raises(UserError, match=f"test.jsonl, line 2: {expected}"):
        tasks.load(task, str(path))


@pytest.mark.parametrize("command", ["eval", "warmup-data", "rl"])
def test_commands_refuse_an_empty_problem_before_loading_the_model(tmp_path, capsys, command):
    data = _jsonl(
        tmp_path / "train.jsonl", [{"question": "1+1", "answer": "#### 2"}, {"question": "", "answer": "#### 0"}]
    )
    out = tmp_path / ("w.jsonl" if command == "warmup-data" else "out")
    line = _fails(capsys, [command, "--model", tmp_path / "no-model", "--task", "gsm8k", "--data", data, "--out", out])
    assert f"{data}, line 2: field 'question' is ''" in line
    assert not out.exists()


@pytest.mark.parametrize(
    "command, flags, expected",
    [
        ("rl", ["--lr", "nan"], "--lr nan: expected a finite number > 0"),
        ("rl", ["--lr", "-1"], "--lr -1.0: expected a finite number > 0"),
        ("rl", ["--block-lr", "inf"], "--block-lr inf: expected a finite number > 0"),
        ("rl", ["--block-lr", "-1"], "--block-lr -1.0: expected a finite number > 0"),
        ("rl", ["--beta", "nan"], "--beta nan: expected a finite number >= 0"),
        ("rl", ["--clip-eps", "nan"], "--clip-eps nan: expected a finite number > 0"),
        ("rl", ["--max-grad-norm", "nan"], "--max-grad-norm nan: expected a finite number (<= 0: no clipping)"),
        ("rl", ["--weight-decay", "-5"], "--weight-decay -5.0: expected a finite number >= 0"),
        ("rl", ["--temperature", "nan"], "--temperature nan: expected a finite number > 0 (GRPO's log-probs are at"),
        ("rl", ["--temperature", "0"], "--temperature 0.0: expected a finite number > 0 (GRPO's log-probs are at"),
        ("rl", ["--temperature", "1e-45"], "--temperature 1e-45: expected at least 1e-06"),
        ("rl", ["--top-p", "5"], "--top-p 5.0: expected a finite number in (0, 1]"),
        # the validation's settings, refused before training instead of after it, by their own names
        ("rl", ["--eval-temperature", "-1"], "--eval-temperature -1.0: expected a finite number >= 0 (0 = greedy)"),
        ("rl", ["--eval-top-p", "5"], "--eval-top-p 5.0: expected a finite number in (0, 1]"),
        ("rl", ["--eval-n", "0"], "--eval-n 0: expected a positive integer"),
        ("rl", ["--eval-width", "0"], "--eval-width 0: expected a positive integer"),
        ("rl", ["--eval-max-new-tokens", "0"], "--eval-max-new-tokens 0: expected a positive integer"),  # not None
        ("rl", ["--eval-limit", "0"], "--eval-limit 0: expected a positive integer"),
        ("rl", ["--eval-n", "4", "--eval-width", "3"], "--eval-width 3 does not divide --eval-n 4"),
        ("rl", ["--rollouts", "4", "--width", "3"], "--width 3 must divide --rollouts 4"),
        ("sft", ["--lr", "nan"], "--lr nan: expected a finite number > 0"),
        ("sft", ["--lr", "inf"], "--lr inf: expected a finite number > 0"),
        ("sft", ["--weight-decay", "-5"], "--weight-decay -5.0: expected a finite number >= 0"),
        ("sft", ["--max-grad-norm", "nan"], "--max-grad-norm nan: expected a finite number (<= 0: no clipping)"),
        ("sft", ["--val-count", "-1"], "--val-count -1: expected an integer >= 0"),
        ("sft", ["--warmup-fraction", "1.5"], "--warmup-fraction 1.5: expected a finite number in [0, 1)"),  # once
        ("rl", ["--warmup-fraction", "1"], "--warmup-fraction 1.0: expected a finite number in [0, 1)"),
        ("generate", ["--temperature", "1e-45"], "--temperature 1e-45: expected 0 (greedy) or at least 1e-06"),
        ("generate", ["--top-p", "nan"], "--top-p nan: expected a finite number in (0, 1]"),
        ("generate", ["--max-batch-tokens", "0"], "--max-batch-tokens 0: expected a positive integer"),
        ("generate", ["--max-batch-sequences", "-5"], "--max-batch-sequences -5: expected a positive integer"),
    ],
)
def test_training_and_sampling_numbers_that_cannot_work(tmp_path, capsys, command, flags, expected):
    """NaN, infinite, negative and too small values are refused before the model loads: they once trained to NaN
    (exit 0), or crashed inside torch's optimiser, or (the validation's settings) threw a finished run away."""
    out = tmp_path / ("s.jsonl" if command == "generate" else "out")
    args = {
        "rl": ["--task", "arith"],
        "sft": ["--data", tmp_path / "w.jsonl"],
        "generate": ["--prompt", "1+1="],
    }[command]
    line = _fails(capsys, [command, "--model", tmp_path / "no-model", *args, *flags, "--out", out])
    assert expected in line
    assert not out.exists()


def test_the_edges_of_the_number_checks():
    """What users legitimately pass still passes: greedy validation, top_p 1, no clipping, defaults of None, integers
    for floats, numpy scalars; an integer beyond any float is refused as a number, not by an OverflowError."""
    import numpy as np

    from bridgelm.engine import SamplingConfig
    from bridgelm.errors import check_number
    from bridgelm.train.optim import OptimConfig
    from bridgelm.train.rl_config import RLConfig, default_rollout, default_validation
    from bridgelm.train.sft import SFTConfig

    validation = default_validation()
    validation = replace(validation, sampling=replace(validation.sampling, temperature=0), limit=None)
    rollout = replace(default_rollout(), top_p=1)
    optim = OptimConfig(max_grad_norm=0, lr=1)
    RLConfig(rollout=rollout, validation=validation, optim=optim, block_lr=None, beta=0).validate()
    SFTConfig(val_count=0, optim=OptimConfig(max_grad_norm=-1, warmup_fraction=0, lr=1)).validate()
    SamplingConfig(temperature=0, top_p=1).validate()
    SamplingConfig(temperature=1e-6, top_p=1e-3).validate()
    check_number("x", np.float32(0.5), 0, 1)
    with pytest.raises(ValueError, match=r"x=10{400}: expected a finite number"):
        check_number("x", 10**400)
    with pytest.raises(ValueError, match="temperature=False"):
        SamplingConfig(temperature=False).validate()


def test_flags_checked_before_any_work(tmp_path, capsys):
    """Flags that were refused only after the model loaded, or with a message that named nothing."""
    missing = tmp_path / "no-model"
    line = _fails(capsys, ["generate", "--model", missing, "--prompt", "", "--out", tmp_path / "s.jsonl"])
    assert "--prompt is empty: expected the text of a prompt" in line
    line = _fails(capsys, ["warmup-data", "--model", missing, "--task", "arith", "--n", "1", "--out", tmp_path / "w"])
    assert "--n 1 must be >= 2: a kept problem needs 2 correct responses" in line
    (tmp_path / "empty.jsonl").write_text("")
    line = _fails(capsys, ["sft", "--model", missing, "--data", tmp_path / "empty.jsonl", "--out", tmp_path / "o"])
    assert f"{tmp_path / 'empty.jsonl'} is empty" in line  # the data, before the model (which does not exist)
    (tmp_path / "empty.jsonl").unlink()
    line = _fails(capsys, ["demo", "--quick", "--threads", "100000000000", "--out", tmp_path / "d"])
    assert "--threads 100000000000 must be in [0, 4096]" in line  # was "Overflow when unpacking long"
    assert not any(tmp_path.iterdir())
    line = _fails(capsys, ["report", tmp_path / "run", "--names", "", "--out", tmp_path / "r"])
    assert "empty name for run" in line  # an empty --names was taken for no --names


def test_a_repeated_problem_is_warned_about(tmp_path, capsys):
    path = _jsonl(tmp_path / "d.jsonl", [{"problem": p, "answer": str(eval(p))} for p in ("1+1", "2+2", "1+1", "1+1")])
    with pytest.warns(DataWarning, match="d.jsonl repeats problems: row 3 repeats row 1, row 4 repeats row 1"):
        task = tasks.load("arith", str(path))
    assert len(task) == 4  # kept: a warning, not an error
    # the command line prints it as one warning line (here before failing on the missing model)
    line = _fails(
        capsys, ["eval", "--model", tmp_path / "m", "--task", "arith", "--data", path, "--out", tmp_path / "r"]
    )
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


# ---------------------------------------------------------------------------------------------- one-line errors


def _model_cases(root: Path, tmp: Path):
    """(flag values, expected message part) for model folders and devices that cannot work."""
    return [
        (["--model", tmp / "no-such-model"], f"model folder {tmp / 'no-such-model'} does not exist"),
        (["--model", root / "m" / "config.json"], "is a file: expected a model folder"),
        (["--model", root / "cut"], f"{root / 'cut' / 'config.json'}: malformed JSON ("),
        (["--model", root / "trunc"], f"{root / 'trunc' / 'model.safetensors'} is unreadable"),
        (
            ["--model", root / "shape"],
            "model.layers.0.mlp.down_proj.weight is [64, 128], config.json makes it [64, 96]",
        ),
        (["--model", root / "m", "--device", "cuda:99"], "device 'cuda:99': this machine has"),
        (["--model", root / "m", "--device", "gpu0"], "device 'gpu0' is not a device name"),
        (["--model", root / "m", "--device", "meta"], "--device meta: the meta device holds no values"),
        (["--model", root / "noweights"], f"model folder {root / 'noweights'} has config.json but no weights file"),
        (["--model", root / "badtype"], "cannot read its config: The checkpoint you are trying to load has model type"),
        (  # once a traceback of transformers' strict config checks
            ["--model", root / "strtype"],
            "its config.json does not describe a valid model: TypeError: Field 'hidden_size' expected int, got str",
        ),
        (["--model", root / "mb", "--blocks", tmp / "b.safetensors"], "has bridge blocks of its own (recorded in its"),
        (
            ["--model", root / "notok"],
            f"{root / 'notok'} has no tokenizer files (tokenizer.json, tokenizer_config.json",
        ),
    ]


@pytest.mark.parametrize("case", range(13))
def test_models_and_devices_that_cannot_work(models, tmp_path, capsys, case):
    flags, expected = _model_cases(models, tmp_path)[case]
    out = tmp_path / "s.jsonl"
    line = _fails(capsys, ["generate", *flags, "--prompt", "1=", "--n", "1", "--out", out])
    assert expected in line
    assert not out.exists()


def test_weights_this_user_may_not_read_are_said_so(models, tmp_path, capsys, monkeypatch):
    """A weights file without read permission (root reads every file, so the refusal is simulated): safetensors
    says "No such file or directory", which was passed on with "a truncated or damaged weights file?"."""
    import pathlib

    weights, real_open = models / "m" / "model.safetensors", pathlib.Path.open

    def no_permission(self, *args, **kwargs):
        if self == weights:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", no_permission)
    line = _fails(capsys, ["generate", "--model", models / "m", "--prompt", "1=", "--out", tmp_path / "s.jsonl"])
    assert line.endswith(f"cannot read {weights}: Permission denied")


def test_load_model_takes_dtype_by_name_or_torch_dtype_only(models):
    """dtype="fp16" was an AttributeError; torch_dtype= (transformers' older name) was overridden by dtype's default
    and the model came back in float32, silently."""
    assert next(bridgelm.load_model(str(models / "m"), dtype="bfloat16").parameters()).dtype == torch.bfloat16
    for kwargs, words in [({"dtype": "fp16"}, "dtype='fp16': expected one of float32, bfloat16, float16"),
                          ({"dtype": torch.int8}, "dtype=torch.int8: expected one of"),
                          ({"torch_dtype": torch.bfloat16}, "torch_dtype=torch.bfloat16: give it as dtype=")]:
        with pytest.raises(UserError, match=re.escape(words)):
            bridgelm.load_model(str(models / "m"), **kwargs)


def test_misfit_weights_are_found_before_transformers_loads_them(models, monkeypatch):
    """Found from the safetensors headers: transformers never loads the weights (its report of every misfit tensor
    would come before the one-line error)."""
    from transformers import AutoModelForCausalLM

    from bridgelm.models import load_model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(UserError, match=r"down_proj.weight is \[64, 128\], config.json makes it \[64, 96\]"):
        load_model(str(models / "shape"))


@pytest.mark.parametrize(
    "command, out_kind",
    [
        ("generate", "dir"),
        ("eval", "file"),
        ("rl", "file"),
        ("warmup-data", "dir"),
        ("sft", "file"),
        ("report", "file"),
        ("demo", "file"),
    ],
)
def test_out_of_the_wrong_kind(models, tmp_path, capsys, command, out_kind):
    out = tmp_path / "taken"
    if out_kind == "dir":
        out.mkdir()
    else:
        out.write_text("keep me\n")
    data = _jsonl(tmp_path / "d.jsonl", [{"question": "1+1", "answer": "#### 2"}])
    argv = {
        "generate": ["generate", "--model", models / "m", "--prompt", "1="],
        "eval": ["eval", "--model", models / "m", "--task", "gsm8k", "--data", data],
        "rl": ["rl", "--model", models / "m", "--task", "gsm8k", "--data", data],
        "warmup-data": ["warmup-data", "--model", models / "m", "--task", "gsm8k", "--data", data],
        "sft": ["sft", "--model", models / "m", "--data", data],
        "report": ["report", tmp_path / "run"],
        "demo": ["demo", "--quick"],
    }[command]
    line = _fails(capsys, [*argv, "--out", out])
    assert f"--out {out} is a {'folder' if out_kind == 'dir' else 'file'}: expected a" in line
    assert out_kind == "dir" and not any(out.iterdir()) or out_kind == "file" and out.read_text() == "keep me\n"


@pytest.mark.parametrize("argv, expected", [
    (["score", "a", "b"], "bridgelm score: error: unrecognized arguments: b"),
    (["analyze", "siblings", "--model", "m", "--run", "r", "--out", "o", "--bogus", "1"],
     "bridgelm analyze siblings: error: unrecognized arguments: --bogus 1"),
])
def test_an_argument_no_command_takes_is_refused_by_its_command(capsys, argv, expected):
    assert _fails(capsys, argv).startswith(expected)


@pytest.mark.parametrize("argv, expected", [
    (["generate", "--model", "m", "--prompt", "3+4=", "--prompt", "1+2=", "--out", "o"], "--prompt given twice"),
    (["analyze", "siblings", "--model", "m", "--model", "n", "--run", "r", "--out", "o"], "--model given twice"),
    (["generate", "--model", "m", "--prompt", "a", "--out=o", "--ou", "p"], "--out given twice"),  # abbreviated
    (["eval", "--model", "m", "--task", "math", "--n", "4", "--num-samples", "2", "--out", "o"],
     "--n and --num-samples both given"),
    (["eval", "--model", "m", "--task", "math", "--widths", "1,2", "--widths=2", "--out", "o"], "--widths given twice"),
    (["rl", "--model", "m", "--task", "gsm8k", "--bf16", "--no-bf16", "--out", "o"], "--bf16 and --no-bf16 both"),
])
def test_a_flag_of_one_value_given_twice_is_refused(capsys, argv, expected):
    """argparse keeps the last of a repeated flag: `--prompt A --prompt B` sampled B alone, without a word."""
    assert expected in _fails(capsys, argv)


def test_flags_that_repeat_or_repeat_a_switch_still_run(models, tmp_path):
    """Repeatable flags (--stop, --data) and a switch given twice (the same thing said twice) are not refused."""
    from bridgelm.cli import main

    out = tmp_path / "s.jsonl"
    main(["generate", "--model", str(models / "m"), "--prompt", "1+2=", "--stop", "9", "--stop", "=", "--chat",
          "--chat", "--n", "2", "--max-new-tokens", "2", "--out", str(out)])
    assert out.is_file()


@pytest.mark.parametrize("command", ["eval", "sft", "rl"])
def test_a_folder_of_files_no_run_wrote_is_left_alone(models, tmp_path, capsys, command):
    """--out holding files but no run.json (blocks saved by hand, notes, another output) is refused before the model
    loads, every file as it was; an empty folder, or one holding only hidden files, is a new run's."""
    out = tmp_path / "mine"
    (out / "best").mkdir(parents=True)
    (out / "best" / "notes.txt").write_text("keep me\n")
    for name in ("blocks.safetensors", "metrics.json", "scores.jsonl"):
        (out / name).write_text("keep me\n")
    data = _jsonl(tmp_path / "d.jsonl", [{"question": "1+1", "answer": "#### 2"}])
    argv = {
        "eval": ["eval", "--model", models / "m", "--task", "gsm8k", "--data", data],
        "rl": ["rl", "--model", models / "m", "--task", "gsm8k", "--data", data],
        "sft": ["sft", "--model", models / "m", "--data", data],
    }[command]
    line = _fails(capsys, [*argv, "--out", out])
    assert f"--out {out} holds best, blocks.safetensors, metrics.json, scores.jsonl but no run.json" in line
    assert (out / "best" / "notes.txt").read_text() == "keep me\n" and len(list(out.iterdir())) == 4
    assert all((out / n).read_text() == "keep me\n" for n in ("blocks.safetensors", "metrics.json", "scores.jsonl"))
    from bridgelm.runs import check_run_folder

    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / ".lock").write_text("")
    check_run_folder(hidden, command)  # bridgelm's own lock (a run stopped before it wrote anything): a new run's


def test_a_folder_that_is_not_an_eval_run(models, tmp_path, capsys):
    """eval into an SFT run's folder, and the readers of samples on a folder that is no eval run: one line each,
    saying what the folder is."""
    sft = tmp_path / "sft"
    sft.mkdir()
    (sft / "run.json").write_text(json.dumps({"kind": "sft", "identity": {}}))
    data = _jsonl(tmp_path / "d.jsonl", [{"question": "1+1", "answer": "#### 2"}])
    line = _fails(capsys, ["eval", "--model", models / "m", "--task", "gsm8k", "--data", data, "--out", sft])
    assert f"{sft} is a bridgelm sft training run" in line
    assert json.loads((sft / "run.json").read_text()) == {"kind": "sft", "identity": {}}
    line = _fails(capsys, ["analyze", "similarity", "--run", tmp_path / "nope", "--embedding-model", ""])
    assert f"{tmp_path / 'nope'} is not an eval run" in line
    line = _fails(capsys, ["analyze", "similarity", "--run", sft, "--out", tmp_path / "simdir"])
    assert f"--out {tmp_path / 'simdir'}: expected a .json file" in line and not (tmp_path / "simdir").exists()


def test_score_reads_a_hand_edited_run_as_one_line(models, tmp_path, capsys):
    """samples.jsonl and run.json edited by hand: the field is named (these were TypeErrors and KeyErrors)."""
    data = _jsonl(tmp_path / "d.jsonl", [{"problem": "1+2", "answer": "3"}, {"problem": "2+2", "answer": "4"}])
    run = tmp_path / "run"
    main(
        [
            str(a)
            for a in ["eval", "--model", models / "m", "--task", "arith", "--data", data, "--n", "2"]
            + ["--width", "1", "--max-new-tokens", "2", "--out", run]
        ]
    )
    samples, settings = (run / "samples.jsonl").read_text(), json.loads((run / "run.json").read_text())
    first = json.loads(samples.splitlines()[0])
    damaged = [
        ({**first, "samples": [{**first["samples"][0], "text": 5}, first["samples"][1]]}, "line 1: sample 0 is not"),
        ({k: v for k, v in first.items() if k != "samples"}, "line 1: field 'samples' is None: expected a list"),
        ({**first, "samples": [7, 7]}, "line 1: sample 0 is not an object"),
    ]
    for record, expected in damaged:
        (run / "samples.jsonl").write_text(json.dumps(record) + "\n" + "".join(samples.splitlines(True)[1:]))
        assert expected in _fails(capsys, ["score", run])
    (run / "samples.jsonl").write_text(samples)
    edits = [({"widths": None}, "field 'widths' is None"), ({"n": "2"}, "field 'n' is '2'"),
             ({"gpass_k": 0}, "field 'gpass_k' is 0: expected a positive integer"),  # were tracebacks
             ({"gpass_k": None}, "field 'gpass_k' is None"), ({"format": 99}, "(written by a newer bridgelm)")]
    for edit, expected in edits:
        (run / "run.json").write_text(json.dumps({**settings, **edit}))
        assert expected in _fails(capsys, ["score", run])
    (run / "run.json").write_text(json.dumps(settings))
    main(["score", str(run)])  # put back, it scores
    assert (run / "metrics.json").is_file()


def test_out_in_a_folder_without_write_permission(models, tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != locked and real_access(p, mode))  # root ignores modes
    for argv in (
        ["generate", "--model", models / "m", "--prompt", "1=", "--out", locked / "s.jsonl"],
        ["eval", "--model", models / "m", "--task", "arith", "--out", locked / "run" / "deeper"],
    ):
        line = _fails(capsys, argv)
        assert f"folder {locked} is not writable" in line
    assert not any(locked.iterdir())


def test_report_and_score_refuse_a_training_run(tmp_path, capsys):
    run = tmp_path / "rl_run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"kind": "rl", "identity": {}}))
    for argv in (["score", run], ["report", run, "--out", tmp_path / "rep"]):
        line = _fails(capsys, argv)
        assert f"{run} is a bridgelm rl training run" in line and "expected a folder made by bridgelm eval" in line
    assert not (tmp_path / "rep").exists()


def test_data_that_is_a_folder_or_not_utf8(models, tmp_path, capsys):
    folder = tmp_path / "data"
    folder.mkdir()
    base = ["eval", "--model", tmp_path / "no-model", "--task", "arith", "--out", tmp_path / "r"]
    assert "folder " + str(folder) + " has no test.jsonl" in _fails(capsys, [*base, "--data", folder])
    _jsonl(folder / "test.jsonl", [{"problem": "1+2", "answer": "3"}])  # a folder with the split's file is fine
    assert "model folder" in _fails(capsys, [*base, "--data", folder])
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"problem": "1+2", "answer": "3"}\n{"problem": "1+2", "answer": "3", "note": "caf\xe9"}\n')
    assert f"{latin}, line 2: not UTF-8 text (byte 0xe9 at column 47)" in _fails(capsys, [*base, "--data", latin])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(b'{"prompt": "caf\xe9"}\n')
    line = _fails(capsys, ["generate", "--model", models / "m", "--prompts", prompts, "--out", tmp_path / "s.jsonl"])
    assert f"{prompts}, line 1: not UTF-8 text" in line
    assert f"--prompts {tmp_path / 'none.jsonl'} does not exist" in _fails(
        capsys,
        ["generate", "--model", models / "m", "--prompts", tmp_path / "none.jsonl", "--out", tmp_path / "s.jsonl"],
    )
    # a folder where a file is expected is called a folder (it was called missing)
    line = _fails(capsys, ["sft", "--model", models / "m", "--data", folder, "--out", tmp_path / "sft"])
    assert f"warm-up data {folder} is a folder: expected a JSONL file" in line
    line = _fails(
        capsys, ["generate", "--model", models / "m", "--blocks", folder, "--prompt", "1", "--out", tmp_path / "b"]
    )
    assert f"block file {folder} is a folder: expected a .safetensors file" in line and "--model" not in line
    line = _fails(  # a model folder with its blocks (an rl checkpoint) given as --blocks: said what it is
        capsys, ["generate", "--model", models / "m", "--blocks", models / "mb", "--prompt", "1", "--out", tmp_path / "c"]
    )
    assert line.endswith("It holds a model (config.json): give it as --model, blocks included.")


def test_gsm8k_without_data_offline(tmp_path, capsys, monkeypatch):
    fake = types.ModuleType("datasets")

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (OfflineModeIsEnabled)")

    fake.load_dataset = offline
    monkeypatch.setitem(sys.modules, "datasets", fake)
    line = _fails(capsys, ["eval", "--model", tmp_path / "m", "--task", "gsm8k", "--out", tmp_path / "r"])
    assert "could not load 'openai/gsm8k' (split 'test')" in line and "pass a local .jsonl" in line


def test_rl_blocks_and_no_blocks(models, tmp_path, capsys):
    blocks = tmp_path / "b.safetensors"
    data = _jsonl(tmp_path / "d.jsonl", [{"question": "1+1", "answer": "#### 2"}])
    base = [
        "rl",
        "--model",
        models / "m",
        "--task",
        "gsm8k",
        "--data",
        data,
        "--blocks",
        blocks,
        "--out",
        tmp_path / "r",
    ]
    assert f"--blocks {blocks} and --no-blocks contradict each other" in _fails(capsys, [*base, "--no-blocks"])
    assert f"--blocks {blocks} and --add bridge contradict each other" in _fails(capsys, [*base, "--add", "bridge"])
    # a model folder that holds blocks itself is blamed by name
    line = _fails(capsys, [*base[:2], models / "mb", *base[3:7], "--no-blocks", "--out", tmp_path / "r"])
    assert f"--no-blocks, but {models / 'mb'} holds bridge blocks" in line


def _fake_checkpoint(out: Path, step: int) -> Path:
    folder = out / checkpoints.CHECKPOINTS / checkpoints.checkpoint_name(step)
    folder.mkdir(parents=True)
    save_file({"w": torch.full((4,), float(step))}, str(folder / "model.safetensors"))
    state = {"step": step, "optimizer": {"m": torch.full((64,), 7.0)}, "extra": {}}
    torch.save(state, folder / checkpoints.TRAINER_STATE)
    jsonl.write_json(folder / checkpoints.TRAINER_INFO, {"step": step})
    return folder


def test_resume_passes_over_a_damaged_checkpoint(tmp_path):
    one, two = _fake_checkpoint(tmp_path, 1), _fake_checkpoint(tmp_path, 2)
    assert checkpoints.resume_point(tmp_path, resume=True) == two
    state = (two / checkpoints.TRAINER_STATE).read_bytes()
    flipped = bytearray(state)
    flipped[state.index(torch.full((4,), 7.0).numpy().tobytes()) + 5] ^= 0xFF  # a bit of a tensor: torch.load
    assert torch.load(io.BytesIO(bytes(flipped)), weights_only=True)["optimizer"]["m"][1] != 7.0  # reads it anyway
    for damage in (bytes(flipped), state[: len(state) // 2]):
        (two / checkpoints.TRAINER_STATE).write_bytes(damage)
        with pytest.warns(
            DataWarning, match=f"checkpoint {two} is damaged .*trainer_state.pt.*resuming from .*{one.name}"
        ):
            assert checkpoints.resume_point(tmp_path, resume=True) == one
    weights = (one / "model.safetensors").read_bytes()
    (one / "model.safetensors").write_bytes(weights[:-8])
    with pytest.raises(UserError, match=f"checkpoint {two} is damaged .* no earlier checkpoint .* is whole"):
        checkpoints.resume_point(tmp_path, resume=True)


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_an_unsafe_trainer_state_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    folder = _fake_checkpoint(tmp_path, 1)
    torch.save({"step": 1, "payload": _Payload(str(marker))}, folder / checkpoints.TRAINER_STATE)
    with pytest.raises(UserError) as err:
        checkpoints.load_trainer_state(folder)
    assert str(folder / checkpoints.TRAINER_STATE) in str(err.value) and "was not loaded" in str(err.value)
    assert "weights_only" not in str(err.value)  # no hint to turn the protection off
    assert not marker.exists()


def test_rl_resume_over_a_damaged_checkpoint_ends_like_an_uninterrupted_run(tmp_path):
    from test_rl import CFG, TASK, TOK, _params, policy

    from bridgelm.train.rl import train_rl

    cfg = replace(CFG, steps=3, run=replace(CFG.run, save_every=1, keep_last=0))
    straight = policy()
    train_rl(straight, TOK, TASK, cfg, tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / checkpoints.CHECKPOINTS / "step-00000003")  # killed after the checkpoint of step 2
    state = tmp_path / "b" / checkpoints.CHECKPOINTS / "step-00000002" / checkpoints.TRAINER_STATE
    state.write_bytes(state.read_bytes()[:100])  # ... which is then found cut
    resumed = policy()
    with pytest.warns(DataWarning, match="step-00000002 is damaged"):
        train_rl(resumed, TOK, TASK, replace(cfg, run=replace(cfg.run, resume=True)), tmp_path / "b")
    a, b = _params(straight), _params(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------------------------- errors versus bugs


def test_user_message_tells_input_errors_from_bugs():
    from bridgelm.engine import SamplingConfig

    with pytest.raises(ValueError) as ours:
        SamplingConfig(n=4, width=3).validate()
    assert user_message(ours.value) == str(ours.value)
    with pytest.raises(ValueError) as theirs:
        json.loads("{")  # raised inside the json module: a bug if it escapes
    assert user_message(theirs.value) is None
    assert user_message(UserError("x=1: expected 2")) == "x=1: expected 2"
    assert user_message(KeyError("benchmarks")) is None
    assert "Permission denied" in user_message(PermissionError(13, "Permission denied", "/x/out.jsonl"))


def test_bad_input_is_told_by_type_not_by_where_it_was_raised(tmp_path):
    """A plain ValueError from bridgelm's own code (its API misused: only a bridgelm bug passes such values from the
    command line) is a bug that keeps its traceback; UserError and MissingFile (a missing input file) are bad input."""
    from bridgelm.errors import MissingFile
    from bridgelm.grouped import grouped_logits
    from bridgelm.warmup_file import read_warmup

    with pytest.raises(ValueError) as misuse:
        grouped_logits(None, torch.zeros(3, dtype=torch.long), torch.ones(3), [0])  # [S], not [B, S]
    assert not isinstance(misuse.value, UserError) and user_message(misuse.value) is None
    with pytest.raises(MissingFile) as missing:
        read_warmup(tmp_path / "none.jsonl")
    assert isinstance(missing.value, FileNotFoundError)
    assert user_message(missing.value) == str(missing.value) and "none.jsonl does not exist" in str(missing.value)


def test_a_bug_says_so_and_keeps_its_traceback(tmp_path, capsys, monkeypatch):
    import bridgelm.cli.generate as gen

    monkeypatch.setattr(gen, "_cmd_generate", lambda args: {}["missing"])
    with pytest.raises(KeyError):
        main(["generate", "--prompt", "x", "--model", "m", "--out", str(tmp_path / "s.jsonl")])
    assert "bridgelm generate: unexpected KeyError: this is a bug in bridgelm" in capsys.readouterr().err


def _run_cli(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_exit_codes_in_a_real_process(tmp_path):
    """Bad input: exit 2, one line, no traceback. A bug: exit 1, the bug line and the traceback."""
    bad = _run_cli(
        "from bridgelm.cli import main; "
        f"main(['generate', '--model', {str(tmp_path / 'nope')!r}, '--prompt', 'x', '--out', {str(tmp_path / 'o')!r}])"
    )
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.strip() == (
        f"bridgelm generate: error: model folder {tmp_path / 'nope'} does not exist: expected a folder with "
        "config.json and weights"
    )
    bug = _run_cli(
        "import bridgelm.cli.generate as g; g._cmd_generate = lambda a: 1 / 0; from bridgelm.cli import main; "
        "main(['generate', '--model', 'm', '--prompt', 'x', '--out', 'o'])"
    )
    assert bug.returncode == 1
    assert "unexpected ZeroDivisionError: this is a bug in bridgelm" in bug.stderr and "Traceback" in bug.stderr


def test_math_grader_worker_runs_under_resource_limits():
    pytest.importorskip("math_verify")
    from bridgelm.tasks.math import MathGrader

    grader = MathGrader(timeout=60, cpu_limit=1, memory_limit=256 * 1024**2)
    try:
        limits = grader.debug_limits()
        assert 0 < limits["RLIMIT_AS"] < 64 * 1024**3 and 0 < limits["RLIMIT_CPU"] < 60
        start = time.monotonic()
        assert grader.debug_burn(30) == 0.0  # 30 s of CPU: the kernel ends the worker long before the timeout
        assert time.monotonic() - start < 20 and grader.restarts == 1
        assert grader.grade("\\frac{1}{2}", "so \\boxed{0.5}") == 1.0  # a fresh worker grades on
    finally:
        grader.close()


def test_the_real_data_files_pass_the_row_checks_without_warnings(shared_data):
    import warnings

    files = {
        "gsm8k": sorted((shared_data / "gsm8k").glob("*.jsonl")),
        "math": sorted((shared_data / "math").glob("*.jsonl")),
    }
    assert files["gsm8k"] and files["math"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", DataWarning)
        for task, paths in files.items():
            for path in paths:
                assert len(tasks.load(task, str(path))) > 0


def test_the_shape_check_reads_what_transformers_reads(tmp_path):
    """Sharded weights are checked shard by shard as the index names them, and a stray *.safetensors that
    from_pretrained would not read (an old export) is not held against the model."""
    from conftest import tiny_model
    from safetensors.torch import save_file

    from bridgelm.models import load_model

    model = tiny_model()
    model.save_pretrained(tmp_path / "m", max_shard_size="100KB")
    assert (tmp_path / "m" / "model.safetensors.index.json").is_file()
    save_file({"model.layers.0.mlp.down_proj.weight": torch.zeros(3, 3)}, str(tmp_path / "m" / "old.safetensors"))
    loaded = load_model(str(tmp_path / "m"))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(UserError, match=r"model-000\d\d-of-000\d\d.safetensors: model.layers.0.mlp"):
        load_model(str(tmp_path / "m"))


def test_a_cut_weights_index_is_one_line(tmp_path, capsys):
    from conftest import save_tiny_model_dir

    model, _ = save_tiny_model_dir(tmp_path / "m")
    model.save_pretrained(tmp_path / "m", max_shard_size="100KB")
    index = tmp_path / "m" / "model.safetensors.index.json"
    index.write_bytes(index.read_bytes()[:40])
    line = _fails(capsys, ["generate", "--model", tmp_path / "m", "--prompt", "1=", "--out", tmp_path / "s.jsonl"])
    assert f"{index} is unreadable" in line and "weight_map written by save_pretrained" in line


def test_training_in_bf16_on_a_cpu_without_bf16_instructions_is_warned(tmp_path, capsys, monkeypatch):
    """sft/rl --bf16 and rl --rollout-dtype bfloat16 on an AVX2-only CPU (bf16 matmuls ~100x slower) are warned
    before the model loads (here a missing one, so that nothing trains)."""

    from bridgelm import packed

    monkeypatch.setattr(packed, "half_instructions", lambda dtype: False)
    data = _jsonl(tmp_path / "d.jsonl", [{"question": "1+1", "answer": "#### 2"}])
    missing = tmp_path / "no-model"
    _fails(capsys, ["sft", "--model", missing, "--data", data, "--bf16", "--out", tmp_path / "s"])
    assert "bridgelm sft: warning: --bf16 on this CPU, which has no bf16 matmul instructions" in _fails.stderr
    rl = ["rl", "--model", missing, "--task", "gsm8k", "--data", data, "--out", tmp_path / "r"]
    _fails(capsys, [*rl, "--rollout-dtype", "bfloat16"])
    assert "bridgelm rl: warning: --rollout-dtype bfloat16 on this CPU" in _fails.stderr
    assert "--bf16 on" not in _fails.stderr
    _fails(capsys, rl)
    assert "warning" not in _fails.stderr
    _fails(capsys, [*rl, "--val-task", "gsm8k"])  # the best checkpoint chosen on the test split: said at the start
    assert "the best checkpoint (best/) is chosen on gsm8k's test split" in _fails.stderr
    _fails(capsys, [*rl, "--val-task", "gsm8k", "--val-data", data])  # a held-out file of the user's: no note
    assert "test split" not in _fails.stderr


@pytest.mark.parametrize("command", ["warmup-data", "rl"])
def test_a_split_beside_a_data_file_is_refused(models, tmp_path, capsys, command):
    """A data file is read whole: --split (and --val-split beside --val-data) was ignored, silently; eval refused
    it already."""
    data = _jsonl(tmp_path / "d.jsonl", [{"question": f"{a}+1", "answer": f"#### {a + 1}"} for a in range(4)])
    argv = [command, "--model", models / "m", "--task", "gsm8k", "--data", data, "--out", tmp_path / "o"]
    line = _fails(capsys, [*argv, "--split", "validation"])
    assert f"--split validation is read from a data folder (FOLDER/validation.jsonl) or the hub's copy, and --data " \
           f"{data} is a file" in line
    if command == "rl":
        line = _fails(capsys, [*argv, "--val-task", "gsm8k", "--val-data", data, "--val-split", "train"])
        assert "--val-split train is read from a data folder" in line and f"--val-data {data} is a file" in line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", ["rl", "sft"])
@pytest.mark.parametrize(
    "flags, words",
    [
        (["--lora-r", "0"], "--lora-r 0: expected a positive integer"),
        (["--lora-r", "-2"], "--lora-r -2: expected a positive integer"),
        (["--lora-r", "4", "--lora-alpha", "0"], "--lora-alpha 0.0: expected"),
        (["--lora-r", "4", "--lora-alpha", "nan"], "--lora-alpha nan: expected"),
        (["--lora-alpha", "8"], "--lora-alpha 8.0 is read only with a LoRA rank: expected --lora-r R"),
        (["--lora-targets", "q_proj"], "--lora-targets 'q_proj' is read only with a LoRA rank"),  # was ignored
        (["--lora-targets", ""], "--lora-targets '' is read only with a LoRA rank"),
        (["--lora-r", "4", "--lora-targets", "q_proj;v_proj"], "--lora-targets 'q_proj;v_proj': expected a comma list"),
        (["--lora-r", "4", "--lora-targets", ","], "--lora-targets ',': expected a comma list"),
        (["--lora-r", "4", "--lora-targets", "q_proj,nosuch"], "--lora-targets 'q_proj,nosuch': 'nosuch' names no module"),
        (["--lora-r", "4", "--freeze-base"], "--lora-r 4 with --freeze-base True: it trains the blocks alone"),
    ],
)
def test_lora_settings_that_cannot_work(models, tmp_path, capsys, command, flags, words):
    """--lora-r / --lora-alpha / --lora-targets: one line naming the flag, before any output is written (the target
    names after the model loads: they are checked against its modules)."""
    pytest.importorskip("peft")
    if command == "sft" and "--freeze-base" in flags:
        pytest.skip("sft has no --freeze-base: its base is always frozen")
    if command == "rl":
        data = _jsonl(tmp_path / "d.jsonl", [{"question": f"{a}+1", "answer": f"#### {a + 1}"} for a in range(4)])
        argv = ["rl", "--model", models / "m", "--task", "gsm8k", "--data", data, "--add", "bridge"]
    else:
        from test_sft import write_warmup

        write_warmup(tmp_path / "w.jsonl")
        argv = ["sft", "--model", models / "m", "--data", tmp_path / "w.jsonl"]
    line = _fails(capsys, [*argv, *flags, "--out", tmp_path / "out"])
    assert words in line, line
    assert not (tmp_path / "out").exists()


def test_lora_without_peft_says_how_to_install_it(models, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft fails
    data = _jsonl(tmp_path / "d.jsonl", [{"question": "1+1", "answer": "#### 2"}])
    line = _fails(capsys, ["rl", "--model", models / "m", "--task", "gsm8k", "--data", data, "--add", "bridge",
                           "--lora-r", "4", "--out", tmp_path / "out"])
    assert "LoRA needs the peft library" in line and "pip install 'bridgelm[lora]'" in line
    assert not (tmp_path / "out").exists()

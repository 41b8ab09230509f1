"""Nothing runs that the user did not ask for, and no model output breaks a grader: code planted beside a command or
in a model folder is never imported, and numbers of any size compare exactly."""

import json
import os
import subprocess
import sys

import pytest

from bridgelm.errors import UserError
from bridgelm.tasks import gsm8k
from bridgelm.tasks.answers import canonical_number, exact_text
from bridgelm.tasks.math import MathGrader


def test_math_worker_imports_nothing_from_the_current_folder(tmp_path, monkeypatch):
    # a math_verify.py (or json.py) where someone runs `bridgelm score` must not replace the real modules
    marker = tmp_path / "planted-code-ran"
    planted = f"open({str(marker)!r}, 'w').close()\nraise ImportError('planted')\n"
    for name in ("math_verify.py", "json.py"):
        (tmp_path / name).write_text(planted)
    monkeypatch.chdir(tmp_path)
    grader = MathGrader(timeout=30)
    try:
        assert grader.grade("\\frac{1}{2}", "so \\boxed{0.5}") == 1.0
        assert grader.grade("2", "so \\boxed{3}") == 0.0
    finally:
        grader.close()
    assert not marker.exists()


def _custom_code_folder(tmp_path):
    """A model folder whose config.json names code of its own; that code leaves a marker when it runs."""
    folder, marker = tmp_path / "model", tmp_path / "folder-code-ran"
    folder.mkdir()
    config = {
        "model_type": "planted_model",
        "auto_map": {"AutoConfig": "planted.PlantedConfig", "AutoModelForCausalLM": "planted.PlantedModel"},
    }
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "planted.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import PretrainedConfig\n"
        "class PlantedConfig(PretrainedConfig):\n    model_type = 'planted_model'\n"
    )
    return folder, marker


def test_model_folder_code_is_never_run_nor_asked_about(tmp_path):
    folder, marker = _custom_code_folder(tmp_path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    # `y` on stdin: transformers' "run the custom code? [y/N]" prompt would take it
    proc = subprocess.run(
        [sys.executable, "-m", "bridgelm", "params", "--model", str(folder)],
        input="y\n", capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "does not run code from a model folder" in proc.stderr
    assert "Traceback" not in proc.stderr and "[y/N]" not in proc.stdout + proc.stderr
    assert not marker.exists()


def test_load_model_refuses_folder_code(tmp_path):
    from bridgelm.models import load_model

    import torch
    from safetensors.torch import save_file

    folder, marker = _custom_code_folder(tmp_path)
    save_file({"x": torch.zeros(1)}, str(folder / "model.safetensors"))  # weights, so the config is what is read
    with pytest.raises(UserError, match="does not run code"):
        load_model(str(folder))
    assert not marker.exists()


@pytest.mark.parametrize(
    "text, canonical",
    [("2.50", "2.5"), ("1,000", "1000"), ("-0", "0"), ("0.05", "0.05"), ("1e3", "1000"), ("1e400", "1e400"),
     ("1e-400", "1e-400"), ("12345678901234567890123456789012345", "12345678901234567890123456789012345"),
     ("-12.340", "-12.34"), ("1e1000000", "1e1000000")],
)
def test_canonical_numbers_are_exact(text, canonical):
    assert canonical_number(text) == canonical


def test_exact_text_is_one_text_per_value():
    from decimal import Decimal

    for a, b in [("100", "1e2"), ("0.5", "5e-1"), ("1e400", "10e399"), ("1.5e-60", "15e-61")]:
        assert exact_text(Decimal(a)) == exact_text(Decimal(b))


def test_gsm8k_grades_huge_numbers_exactly():
    task = gsm8k.GSM8K(name="gsm8k", examples=[])
    row = {"question": "q", "answer": "work\n#### 1e400"}
    assert task.reward("so \\boxed{1e400}", row) == 1.0
    assert task.reward("so \\boxed{2e400}", row) == 0.0  # as floats both were inf, and equal
    assert task.reward("so \\boxed{1e1000000}", row) == 0.0  # decimal.Overflow before
    big = {"question": "q", "answer": "#### 1000000000000000000000000000000"}
    assert task.reward("\\boxed{1000000000000000000000000000001}", big) == 0.0  # integers: no tolerance
    assert task.reward("\\boxed{18.0000001}", {"question": "q", "answer": "#### 18"}) == 1.0  # fractions: 1e-6


def test_special_files_are_refused_before_reading(tmp_path):
    from bridgelm.jsonl import read_records
    from bridgelm.tasks.base import read_rows

    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)  # reading it would block forever
    with pytest.raises(UserError, match="FIFO"):
        read_rows(fifo, ("question",))
    with pytest.raises(UserError, match="FIFO"):
        read_records(fifo)
    with pytest.raises(UserError, match="special file"):
        read_records("/dev/zero")  # never ends: it was read until the out-of-memory killer came
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "bridgelm", "generate", "--model", str(tmp_path), "--prompts", "/dev/zero",
         "--out", str(tmp_path / "s.jsonl")], capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 2 and "special file" in proc.stderr, proc.stderr


@pytest.mark.parametrize("number", ["1e400", "-1e400", "1e-400", "NaN", "Infinity"])
def test_data_numbers_that_a_float_cannot_hold_are_refused(tmp_path, number):
    from bridgelm.tasks.base import read_rows

    path = tmp_path / "math.jsonl"
    path.write_text('{"problem": "p", "answer": 1}\n{"problem": "p", "answer": %s}\n' % number)
    with pytest.raises(UserError, match=r"math.jsonl, line 2: .*(beyond a float's range|not a number)"):
        read_rows(path, ("problem", "answer"))
    path.write_text('{"problem": "p", "answer": 0.0}\n{"problem": "p", "answer": 2.5e-3}\n')
    assert [r["answer"] for r in read_rows(path, ("problem", "answer"))] == [0.0, 0.0025]


def test_a_quoted_home_path_is_the_same_path_everywhere(tmp_path, monkeypatch):
    from bridgelm.cli import build_parser, expand_home

    monkeypatch.setenv("HOME", str(tmp_path))
    args = build_parser().parse_args(["generate", "--model", "~/m", "--prompt", "~/not a path", "--out", "~/s.jsonl"])
    expand_home(args)
    assert args.out == str(tmp_path / "s.jsonl") and args.model == str(tmp_path / "m")
    assert args.prompt == "~/not a path"  # text stays text


def test_add_bridge_refuses_a_head_dim_below_one():
    import bridgelm
    from conftest import tiny_model

    for bad in (0, -4):
        with pytest.raises(ValueError, match=f"head_dim={bad}"):
            bridgelm.add_bridge(tiny_model(), head_dim=bad)


def test_non_finite_blocks_and_weights_are_refused_by_name(tmp_path):
    from safetensors.torch import load_file, save_file

    import bridgelm
    from bridgelm.models import load_model
    from conftest import save_tiny_model_dir, tiny_model

    model = bridgelm.add_bridge(tiny_model())
    path = bridgelm.save_blocks(model, tmp_path / "blocks.safetensors")
    state = load_file(str(path))
    state["layers.1.o_proj.weight"][0, 0] = float("nan")
    save_file(state, str(path), metadata={**bridgelm.blockfile.read_block_settings(path)[1]})
    with pytest.raises(UserError, match=r"layers\.1\.o_proj\.weight holds NaN"):
        bridgelm.load_blocks(tiny_model(), path)

    folder = tmp_path / "model"
    save_tiny_model_dir(folder)
    weights = load_file(str(folder / "model.safetensors"))
    name = next(k for k in weights if "layers.0.mlp" in k)
    weights[name][0] = float("inf")
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match=f"weight {name} holds infinite"):
        load_model(str(folder))


def test_an_untied_head_that_is_missing_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from bridgelm.models import load_model
    from conftest import save_tiny_model_dir

    folder = tmp_path / "model"
    model, _ = save_tiny_model_dir(folder)
    assert not model.config.tie_word_embeddings
    weights = load_file(str(folder / "model.safetensors"))
    del weights["lm_head.weight"]  # transformers would put a random head in its place and sample from it
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match="lack 1 tensor.*lm_head.weight"):
        load_model(str(folder))


def test_an_output_has_one_writer_at_a_time(tmp_path):
    from bridgelm.jsonl import exclusive

    code = (
        "import sys, time; from bridgelm.jsonl import exclusive\n"
        "with exclusive(sys.argv[1]):\n    print('locked', flush=True); time.sleep(60)\n"
    )
    for out in (tmp_path / "run", tmp_path / "samples.jsonl"):
        holder = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "locked"
            with pytest.raises(UserError, match=f"being written by another process \\(pid {holder.pid}\\)"):
                with exclusive(out):
                    pass
        finally:
            holder.kill()
            holder.wait()
        with exclusive(out):  # the kernel let go of a killed holder's lock: no stale lock to remove
            with pytest.raises(UserError, match="another process"):
                with exclusive(out):  # the same process asking twice is refused too (a second writer)
                    pass


def test_the_api_refuses_what_the_cli_refuses():
    import bridgelm
    from conftest import save_tiny_model_dir

    model, tok = save_tiny_model_dir(__import__("tempfile").mkdtemp())
    with pytest.raises(ValueError, match="empty stop string"):
        bridgelm.generate(model, tok, ["1+2="], n=1, max_new_tokens=4, stop_strings=[""])


def test_non_finite_log_probs_end_sampling_with_one_line():
    import torch

    import bridgelm
    from bridgelm.engine import SamplingConfig, generate_ids
    from conftest import randomize_blocks, tiny_model

    model = randomize_blocks(bridgelm.add_bridge(tiny_model()))
    with torch.no_grad():
        for name, p in bridgelm.added_parameters(model).items():
            if "o_proj" in name:
                p.fill_(float("nan"))  # a model diverged in memory (files are checked at load): NaN logits
    cfg = SamplingConfig(n=2, width=2, max_new_tokens=4)
    with pytest.raises(UserError, match="log-probs were not finite"):
        generate_ids(model, [[1, 2, 3]], cfg, eos_token_ids=[0], pad_token_id=0)


# ---------------------------------------------------------------------------------------------- one writer per output


def _toy_data(path, count):
    path.write_text("".join(json.dumps({"problem": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(count)))
    return str(path)


def _held_after_first(module, release):
    """Wrap `module.stream_text` so that it yields its first item, then waits for `release` (a second writer tries
    the same output meanwhile)."""
    real = module.stream_text

    def held(*args, **kwargs):
        for k, item in enumerate(real(*args, **kwargs)):
            if k == 1:
                assert release.wait(120)
            yield item

    return held


def _second_writer(argv):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "bridgelm", *argv], capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.mark.parametrize("command", ["eval", "generate"])
def test_a_second_process_on_one_out_is_refused_at_once(tmp_path, monkeypatch, command):
    import threading

    from bridgelm import samples
    from bridgelm.cli import main
    from bridgelm.eval import runner
    from bridgelm.jsonl import read_records
    from conftest import save_tiny_model_dir

    save_tiny_model_dir(tmp_path / "m", blocks="bridge")
    if command == "eval":
        out = tmp_path / "run"
        argv = ["eval", "--model", str(tmp_path / "m"), "--data", _toy_data(tmp_path / "toy.jsonl", 3), "--n", "2",
                "--width", "2", "--max-new-tokens", "4", "--max-batch-sequences", "2", "--no-score", "--out", str(out)]
        module, written = runner, out / "samples.jsonl"
    else:
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": f"{i}+1="}) + "\n" for i in range(3)))
        out = written = tmp_path / "s.jsonl"
        argv = ["generate", "--model", str(tmp_path / "m"), "--prompts", str(prompts), "--n", "2", "--width", "2",
                "--max-new-tokens", "4", "--max-batch-sequences", "2", "--out", str(out)]
        module = samples
    release = threading.Event()
    monkeypatch.setattr(module, "stream_text", _held_after_first(module, release))
    first = threading.Thread(target=main, args=(argv,))
    first.start()
    try:
        for _ in range(600):  # until the first writer has written its first line
            if written.exists() and written.read_text().count("\n") >= 1:
                break
            __import__("time").sleep(0.1)
        second = _second_writer(argv)
    finally:
        release.set()
        first.join(300)
    assert second.returncode == 2, second.stderr
    lines = second.stderr.strip().splitlines()
    assert "Traceback" not in second.stderr and "Loading weights" not in second.stderr  # refused before the model
    assert len(lines) == 1, second.stderr
    assert f"--out {out} is being written by another process (pid {os.getpid()})" in lines[0]
    keys = [(r.get("benchmark"), r.get("width"), r["index"]) for r in read_records(written)]
    assert len(keys) == 3 and len(set(keys)) == 3  # the first finished; nothing written twice


def test_training_runs_and_scoring_have_one_writer(tmp_path):
    from bridgelm.dist import Dist
    from bridgelm.eval.score import score_run
    from bridgelm.train.loop import Run, RunControl

    code = (
        "import sys, time; from bridgelm.jsonl import exclusive\n"
        "with exclusive(sys.argv[1], folder=True):\n    print('locked', flush=True); time.sleep(60)\n"
    )
    out = tmp_path / "out"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"kind": "eval", "format": 2}))
    holder = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(UserError, match=f"being written by another process \\(pid {holder.pid}\\)"):
            Run(tmp_path / "sft", "sft", {}, RunControl(), Dist())  # a free folder: no error
            (out / "run.json").unlink()
            Run(out, "sft", {}, RunControl(), Dist())
        (out / "run.json").write_text(json.dumps({"kind": "eval", "format": 2}))
        with pytest.raises(UserError, match="run folder .* is being written by another process"):
            score_run(out, progress=False)
    finally:
        holder.kill()
        holder.wait()


# ---------------------------------------------------------------------------------------------- run identity by content


def _model_and_blocks(tmp_path, seed=1):
    import bridgelm
    from conftest import randomize_blocks, save_tiny_model_dir

    model, _ = save_tiny_model_dir(tmp_path / "m")
    blocks = bridgelm.save_blocks(randomize_blocks(bridgelm.add_bridge(model), seed=seed), tmp_path / "b.safetensors")
    return str(tmp_path / "m"), str(blocks)


def test_a_block_file_replaced_at_the_same_path_is_refused_by_name(tmp_path, capsys):
    import bridgelm
    from bridgelm.cli import main
    from conftest import randomize_blocks

    model_dir, blocks = _model_and_blocks(tmp_path)
    run = tmp_path / "run"
    argv = ["eval", "--model", model_dir, "--blocks", blocks, "--data", _toy_data(tmp_path / "toy.jsonl", 3),
            "--n", "2", "--width", "2", "--max-new-tokens", "4", "--no-score", "--out", str(run)]
    main(argv)
    before = (run / "samples.jsonl").read_bytes()
    recorded = json.loads((run / "run.json").read_text())
    assert recorded["blocks_digest"].startswith("sha256:") and recorded["model_digest"].startswith("sha256:")
    # as sft does when validation improves: other blocks at the same path
    other = randomize_blocks(bridgelm.add_bridge(bridgelm.load_model(model_dir)), seed=7)  # the same base
    bridgelm.save_blocks(other, blocks)
    (run / "samples.jsonl").write_bytes(before[: before.index(b"\n") + 1])  # as if cut short: the re-run resumes
    before = (run / "samples.jsonl").read_bytes()
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and "(blocks: the file changed since the run began (sha256:" in err[0], err
    assert (run / "samples.jsonl").read_bytes() == before


def test_a_samples_file_and_a_training_run_record_what_they_read(tmp_path):
    from bridgelm.engine import SamplingConfig
    from bridgelm.runs import check_settings
    from bridgelm.samples import run_settings

    model_dir, blocks = _model_and_blocks(tmp_path)
    cfg = SamplingConfig(n=2, width=2)
    saved = run_settings("generate", cfg, model_dir, blocks, False, "float32")
    assert saved["blocks_digest"] == __import__("bridgelm").runs.file_fingerprint(blocks)
    weights = tmp_path / "m" / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # saved over since
    now = run_settings("generate", cfg, model_dir, blocks, False, "float32")
    with pytest.raises(UserError, match=r"model: the folder \(its config.json, or a file's size or modification"):
        check_settings("s.jsonl", saved, now, keys=now)
    from bridgelm.models import load_model
    from bridgelm.train import sft

    identity = sft._identity(load_model(model_dir), tmp_path / "w.jsonl", [], sft.SFTConfig())
    assert identity["model_digest"] == now["model_digest"]  # a base saved over since is refused on resume


# ---------------------------------------------------------------------------------------------- a full disk


def test_a_full_disk_is_one_line_and_a_re_run_resumes(tmp_path, monkeypatch, capsys):
    import errno

    from bridgelm.cli import main
    from bridgelm.jsonl import read_records
    from conftest import save_tiny_model_dir

    save_tiny_model_dir(tmp_path / "m", blocks="bridge")
    run = tmp_path / "run"
    argv = ["eval", "--model", str(tmp_path / "m"), "--data", _toy_data(tmp_path / "toy.jsonl", 3), "--n", "2",
            "--width", "2", "--max-new-tokens", "4", "--max-batch-sequences", "2", "--no-score", "--out", str(run)]
    real_fsync, lines = os.fsync, []

    def full_after_one_line(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("samples.jsonl"):
            lines.append(fd)
            if len(lines) > 1:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full_after_one_line)
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert err == [
        f"bridgelm eval: error: cannot write {run / 'samples.jsonl'}: No space left on device; the lines written so "
        "far are kept, and the same command run again resumes after them"
    ]
    monkeypatch.setattr(os, "fsync", real_fsync)
    main(argv)
    assert "sampled 1 problems now, 2 were already in" in capsys.readouterr().out
    keys = sorted(r["index"] for r in read_records(run / "samples.jsonl"))
    assert keys == [0, 1, 2]


# ---------------------------------------------------------------------------------------------- names in reports


def test_names_in_report_tables_cannot_shift_columns():
    from bridgelm.eval.tables import benchmark_table, markdown_table

    table = markdown_table(["Model", "x"], [["runs/a|b\nc", "1.00"]])
    assert table.splitlines()[2] == "| runs/a\\|b c | 1.00 |"
    cell = {"mean": 0.5, "low": 0.4, "high": 0.6}
    rows = {"bridge|w=8": {"aime24": cell, "amc23": cell}, "base": {"aime24": cell, "amc23": cell}}
    for line in benchmark_table(rows, base="base").splitlines():
        assert line.replace("\\|", "").count("|") == 6  # Model, 2 benchmarks, Avg, Δ: every row as many columns


def test_a_lone_surrogate_is_refused_as_not_text(tmp_path):
    from bridgelm.jsonl import read_records

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "\\ud83d\\ude00 fine"}\n{"prompt": "1+\\ud800="}\n')  # a pair, then half of one
    with pytest.raises(UserError, match=r"p.jsonl, line 2: a string holds \\ud800, half of a surrogate pair"):
        read_records(path)
    path.write_text('{"prompt": "\\ud83d\\ude00 fine"}\n')
    assert read_records(path) == [{"prompt": "\U0001F600 fine"}]


def test_a_folder_in_place_of_an_output_file_is_named(tmp_path):
    from bridgelm.jsonl import write_json

    (tmp_path / "metrics.json").mkdir()
    with pytest.raises(UserError, match=r"cannot write .*metrics.json: a folder is in its place"):
        write_json(tmp_path / "metrics.json", {"a": 1})
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.json"]  # no temporary file left


def test_data_rows_and_block_files_that_are_not_what_they_claim(tmp_path):
    from bridgelm.blockfile import read_block_settings
    from bridgelm.tasks.base import read_rows

    path = tmp_path / "gsm8k.jsonl"
    path.write_text('{"question": "half a pair \\ud800", "answer": "#### 1"}\n')  # valid JSON, not text
    with pytest.raises(UserError, match=r"gsm8k.jsonl, line 1: a string holds \\ud800"):
        read_rows(path, ("question", "answer"))
    fifo = tmp_path / "blocks.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(UserError, match="block file .* is a FIFO"):  # "does not exist" before
        read_block_settings(fifo)


def test_a_folder_saved_with_non_finite_blocks_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from bridgelm.models import load_model
    from conftest import save_tiny_model_dir

    folder = tmp_path / "model"
    save_tiny_model_dir(folder, blocks="bridge")  # the blocks recorded in config.json, their tensors in the folder
    weights = load_file(str(folder / "model.safetensors"))
    name = next(k for k in weights if ".bridge." in k)
    weights[name].view(-1)[0] = float("nan")
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match=f"weight {name} holds NaN"):  # read after the base, as recorded blocks
        load_model(str(folder))

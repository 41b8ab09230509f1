"""A third hostile sweep (issue 48): nothing a run folder holds is unpickled freely, no non-finite model is written
or announced, and every file a command reads is checked where it enters (one line, exit 2)."""

import json
import os
import pickle
import warnings

import pytest
import torch
from conftest import tiny_model
from test_bad_input import _fails  # the CLI must exit 2 with one line, no traceback

from bridgelm import runs
from bridgelm.train import checkpoints
from bridgelm.errors import DataWarning, UserError, user_message

# ---------------------------------------------------------------------------------------------- DCP shards


class _Planted:
    """Unpickled, this runs `touch MARKER` (what a shared or downloaded run folder could hold)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _shards(folder, extra=None):
    """DCP shards of a tiny model and its AdamW state (one process, as each FSDP rank writes its own)."""
    import torch.distributed.checkpoint as dcp

    model = tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sum(p.sum() for p in model.parameters()).backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), **(extra or {})}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(folder))
    return model


def _sharded_checkpoint(run, step):
    """A whole FSDP checkpoint folder of `run` at `step` as bridgelm writes it (trainer.json last)."""
    folder = run / checkpoints.CHECKPOINTS / checkpoints.checkpoint_name(step)
    folder.mkdir(parents=True)
    _shards(folder / checkpoints.SHARDS)
    torch.save({"step": step}, folder / checkpoints.TRAINER_STATE)
    info = {"step": step, **runs.format_of("checkpoint"), "layout": "sharded", "identity": {}}
    (folder / checkpoints.TRAINER_INFO).write_text(json.dumps(info))
    return folder


def test_a_planted_shard_index_is_refused_unread(tmp_path):
    from bridgelm.shards import load_shards, read_metadata

    folder, marker = tmp_path / "shards", tmp_path / "planted-code-ran"
    model = _shards(folder)
    read_metadata(folder)  # DCP's own index reads back
    (folder / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    with pytest.raises(UserError) as err:
        read_metadata(folder)
    message = user_message(err.value)
    assert str(folder / ".metadata") in message and "posix.system" in message and "\n" not in message
    with pytest.raises(UserError, match="not loaded"):
        load_shards({"model": model.state_dict()}, folder)  # what a resume calls on every rank
    assert not marker.exists()


def test_an_index_that_python_3_13_wrote_reads_back(tmp_path, monkeypatch):
    """Python 3.13 pickles a path as pathlib._local.PosixPath (its path classes moved there): DCP's index of a
    checkpoint written there names it (StorageMeta.checkpoint_id), and a resume on any Python reads it back."""
    import sys
    import types
    from pathlib import Path

    from bridgelm.shards import read_metadata

    folder = tmp_path / "shards"
    _shards(folder)
    index = read_metadata(folder)
    local = sys.modules.get("pathlib._local")
    if local is None:  # Python 3.11 and 3.12: a stand-in module of that name, as 3.13 has it
        local = types.ModuleType("pathlib._local")
        local.PosixPath = type("PosixPath", (type(Path()),), {"__module__": "pathlib._local"})
        monkeypatch.setitem(sys.modules, "pathlib._local", local)
    index.storage_meta.checkpoint_id = local.PosixPath(folder)
    (folder / ".metadata").write_bytes(pickle.dumps(index))
    assert b"pathlib._local" in (folder / ".metadata").read_bytes()
    assert read_metadata(folder).storage_meta.checkpoint_id == folder


def test_a_planted_non_tensor_item_is_refused_unread(tmp_path):
    from bridgelm.shards import load_shards

    folder, marker = tmp_path / "shards", tmp_path / "planted-code-ran"
    model = _shards(folder, extra={"note": _Planted(marker)})  # saved as bytes: torch.save of the object
    assert not marker.exists()
    with pytest.raises(UserError) as err:
        load_shards({"model": model.state_dict(), "note": None}, folder)
    assert "note" in str(err.value) and "not loaded" in str(err.value) and "\n" not in str(err.value)
    assert not marker.exists()


def test_shards_load_back_through_the_safe_reader(tmp_path):
    from bridgelm.shards import load_shards

    folder = tmp_path / "shards"
    model = _shards(folder)
    fresh = tiny_model(seed=5)
    optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    sum(p.sum() for p in fresh.parameters()).backward()
    optimizer.step()  # a state of the same layout to fill
    state = {"model": fresh.state_dict(), "optimizer": optimizer.state_dict()}
    load_shards(state, folder)  # the optimiser's param_groups are plain values: read with weights_only=True
    for k, v in model.state_dict().items():
        assert torch.equal(state["model"][k], v), k
    assert state["optimizer"]["param_groups"][0]["lr"] == 1e-3


def test_a_resume_refuses_a_planted_index_and_passes_over_a_cut_shard(tmp_path):
    run, marker = tmp_path / "run", tmp_path / "planted-code-ran"
    first = _sharded_checkpoint(run, 1)
    second = _sharded_checkpoint(run, 2)
    assert checkpoints.resume_point(run, True) == second
    shard = next((second / checkpoints.SHARDS).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # cut: passed over like a damaged plain checkpoint
    with pytest.warns(DataWarning, match=f"{second}.*{shard.name} has 100 bytes"):
        assert checkpoints.resume_point(run, True) == first
    (first / checkpoints.SHARDS / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    (second / checkpoints.SHARDS / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    with pytest.raises(UserError, match=r"\.metadata names posix\.system.*not loaded"):
        checkpoints.resume_point(run, True)
    cut = second / checkpoints.SHARDS / ".metadata"
    cut.write_bytes(cut.read_bytes()[:10])  # a cut index is damage, the next one's planted pickle still refused
    with pytest.raises(UserError, match=str(first / checkpoints.SHARDS / ".metadata")):
        checkpoints.resume_point(run, True)
    assert not marker.exists()


def test_an_fsdp_resume_passes_over_a_cut_shard_and_refuses_a_planted_index(tmp_path):
    """Under torchrun (2 CPU ranks): the real `rl --fsdp --resume` path (tests/dist_scripts/fsdp_guard.py)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "dist_scripts" / "fsdp_guard.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(got["damaged"]) == 1 and "step-00000003 is damaged (shards/" in got["damaged"][0]
        assert "resuming from the previous one" in got["damaged"][0]
        assert got["steps"] == ["step-00000002", "step-00000003"]  # step 3 recomputed from step 2
        assert got["refused"] is not None and "\n" not in got["refused"]
        assert got["refused"].startswith(str(tmp_path / "run" / "checkpoints" / "step-00000003" / "shards" / ".metadata"))
    assert not (tmp_path / "planted-code-ran").exists()


# ---------------------------------------------------------------------------------------------- non-finite models




@pytest.mark.parametrize(
    "command, flag, value",
    [("rl", "--lr", "1e308"), ("rl", "--block-lr", "2"), ("sft", "--lr", "1e300")],
)
def test_a_learning_rate_whose_step_overflows_is_refused_up_front(tmp_path, capsys, command, flag, value):
    out = tmp_path / "out"
    extra = ["--task", "arith"] if command == "rl" else ["--data", tmp_path / "w.jsonl"]
    line = _fails(capsys, [command, "--model", tmp_path / "no-model", *extra, flag, value, "--out", out])
    assert f"{flag} {float(value)!r}: expected at most 1.0" in line  # named by its flag
    assert not out.exists()


def _poison_after(monkeypatch, calls: int):
    """From AdamW's `calls`-th step on, the step leaves a NaN in the first parameter it updates (a diverging run)."""
    original, seen = torch.optim.AdamW.step, {"n": 0}

    def step(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        seen["n"] += 1
        if seen["n"] >= calls:
            with torch.no_grad():
                self.param_groups[0]["params"][0].view(-1)[0] = float("nan")
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", step)


def _stopped_at_step_2(err, out, kind):
    message = str(err.value)
    last = out / checkpoints.CHECKPOINTS / checkpoints.checkpoint_name(1)
    assert message.startswith("step 2 diverged") and f"the {kind} run stopped" in message  # the CLI names the command
    assert f"last good checkpoint is {last}" in message
    assert "\n" not in message and "lower --lr" in message
    assert checkpoints.list_checkpoints(out) == [last]  # nothing of step 2 written
    assert [r["step"] for r in map(json.loads, (out / runs.METRICS).read_text().splitlines())] == [1]


def test_a_diverging_rl_run_stops_without_writing_the_nan_model(tmp_path, monkeypatch):
    from dataclasses import replace

    from test_rl import CFG, TASK, TOK, policy

    from bridgelm.train.rl import train_rl

    _poison_after(monkeypatch, calls=CFG.steps_per_rollout + 1)  # in rollout step 2
    out = tmp_path / "rl"
    with pytest.raises(UserError) as err:
        train_rl(policy(), TOK, TASK, replace(CFG, run=replace(CFG.run, save_every=1)), out)
    _stopped_at_step_2(err, out, "rl")
    assert not (out / "best").exists()


def test_a_diverging_sft_run_stops_without_writing_the_nan_blocks(tmp_path, monkeypatch):
    from dataclasses import replace

    from test_sft import CFG, TOK, base_model, write_warmup

    from bridgelm.train.sft import train_sft

    _poison_after(monkeypatch, calls=2)
    out = tmp_path / "sft"
    with pytest.raises(UserError) as err:
        cfg = replace(CFG, run=replace(CFG.run, save_every=1))
        train_sft(base_model(), TOK, write_warmup(tmp_path / "w.jsonl"), cfg, out)
    _stopped_at_step_2(err, out, "sft")


def test_a_non_finite_loss_is_never_logged(tmp_path):
    from bridgelm.dist import Dist
    from bridgelm.train.loop import Run, RunControl

    run = Run(tmp_path / "run", "sft", {}, RunControl(progress=False), Dist())
    model = tiny_model()
    run.track(model, torch.optim.AdamW(model.parameters()), None, lambda folder, sd: None)
    with pytest.raises(UserError, match="step 1 diverged \\(its loss is nan\\).*no checkpoint was written"):
        with run.running(3, "x"):
            run.log({"step": 1, "loss": float("nan"), "grad_norm": 0.5})
    metrics = tmp_path / "run" / runs.METRICS
    assert not metrics.exists() or metrics.read_text() == ""
    assert checkpoints.list_checkpoints(tmp_path / "run") == []


# ---------------------------------------------------------------------------------------------- one boundary for input


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from conftest import save_tiny_model_dir

    root = tmp_path_factory.mktemp("models")
    save_tiny_model_dir(root / "m")
    return root / "m"


def _variant(model_dir, tmp_path, name, config=None):
    import shutil

    folder = tmp_path / name
    shutil.copytree(model_dir, folder)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    "change, expected",
    [
        (None, "config.json holds a JSON null: expected a model config (a JSON object)"),
        ({"num_attention_heads": 0}, "config.json has num_attention_heads=0: expected a positive integer"),
        ({"vocab_size": 0}, "config.json has vocab_size=0: expected a positive integer"),
        ({"num_key_value_heads": 3}, "num_attention_heads=4 and num_key_value_heads=3: expected a number of key/value"),
        ({"hidden_size": 30}, "hidden_size=30 and num_attention_heads=4: expected a hidden size that the heads divide"),
    ],
)
def test_plan_and_params_share_the_model_config_checks(model_dir, tmp_path, capsys, change, expected):
    config = None if change is None else {**json.loads((model_dir / "config.json").read_text()), **change}
    folder = _variant(model_dir, tmp_path, "bad")
    (folder / "config.json").write_text(json.dumps(config))
    for argv in (["plan", "--model", folder, "--gpu-memory-gib", "80"], ["params", "--model", folder]):
        assert expected in _fails(capsys, argv)  # "a bug in bridgelm" (TypeError, ZeroDivisionError) or "fits"


def test_state_files_that_are_json_but_not_objects(tmp_path, capsys, monkeypatch):
    from bridgelm.demo import pipeline

    monkeypatch.setattr("bridgelm.hardware.matmul_peaks", lambda: {"fp32_tflops": 1.0, "bf16_tflops": 1.0})
    demo = tmp_path / "demo"
    demo.mkdir()
    (demo / "demo.json").write_text("[1, 2]")
    with pytest.raises(UserError, match=r"demo.json holds a JSON array: expected the settings of a demo folder"):
        pipeline.run_demo(demo, pipeline.DemoConfig(), quick=True, log=lambda *_: None)
    assert (demo / "demo.json").read_text() == "[1, 2]"
    run = tmp_path / "run"
    first, second = _sharded_checkpoint(run, 1), _sharded_checkpoint(run, 2)
    (second / checkpoints.TRAINER_INFO).write_text("null")  # damaged: passed over
    with pytest.warns(DataWarning, match="trainer.json: holds a JSON null, not an object"):
        assert checkpoints.resume_point(run, True) == first
    with pytest.raises(UserError, match="trainer.json holds a JSON array"):
        (first / checkpoints.TRAINER_INFO).write_text("[]")
        checkpoints.read_info(first)


def test_the_demo_refuses_the_folder_of_another_run(tmp_path, capsys):
    out = tmp_path / "evalrun"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"kind": "eval", "format": 2}))
    line = _fails(capsys, ["demo", "--quick", "--out", out])
    assert f"{out} already holds a bridgelm eval run" in line
    assert sorted(p.name for p in out.iterdir()) == ["run.json"]


def test_a_data_line_nested_too_deep_is_one_line(model_dir, tmp_path, capsys):
    data = tmp_path / "deep.jsonl"
    data.write_text("[" * 200_000 + "]" * 200_000 + "\n")
    line = _fails(capsys, ["eval", "--model", model_dir, "--task", "arith", "--data", data, "--out", tmp_path / "e"])
    assert f"{data}, line 1: nests deeper than JSON is read here" in line
    line = _fails(capsys, ["generate", "--model", model_dir, "--prompts", data, "--out", tmp_path / "s.jsonl"])
    assert f"{data}, line 1: nests deeper than JSON is read here" in line


def test_a_sharded_index_naming_a_missing_shard_is_one_line(model_dir, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    folder = _variant(model_dir, tmp_path, "sharded")
    weights = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(weights)
    shard = {k: f"model-0000{1 + (i >= len(names) // 2)}-of-00002.safetensors" for i, k in enumerate(names)}
    save_file({k: weights[k] for k in names[: len(names) // 2]}, str(folder / "model-00001-of-00002.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shard}))
    line = _fails(capsys, ["generate", "--model", folder, "--prompt", "1+1=", "--out", tmp_path / "s.jsonl"])
    assert "names the weights file 'model-00002-of-00002.safetensors', which is not in" in line


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_naming_both(model_dir, tmp_path, capsys):
    from bridgelm.tokenizer import char_tokenizer

    folder = _variant(model_dir, tmp_path, "bigtok")
    char_tokenizer("0123456789+-=() abcdefghijklmnopqrstuvwxyz\n").save_pretrained(folder)
    line = _fails(capsys, ["generate", "--model", folder, "--prompt", "1+1=", "--out", tmp_path / "s.jsonl"])
    assert "its tokenizer has 48 tokens but the model's vocabulary only 25" in line


def test_html_in_run_names_is_inert_in_table_md():
    from bridgelm.eval.report import _run_lines
    from bridgelm.eval.tables import markdown_table

    name = "runs/<img src=x onerror=alert(1)>"
    table = markdown_table(["Model", "x"], [[name, "1.00"]])
    assert "<img" not in table and "&lt;img src=x onerror=alert(1)&gt;" in table
    report = {"runs": {name: {"dirs": [name + "/eval"], "widths": {"arith": 1}}}}
    assert not any("<img" in line for line in _run_lines(report))


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--dist-timeout", "1e300"], "--dist-timeout 1e+300: expected a finite number in (0, 525600.0] (minutes)"),
        (["--data", ""], "--data '': expected a path, not an empty string"),
        (["--no-blocks", "--block-lr", "1e-3"], "--block-lr 0.001 with --no-blocks: there are no blocks to train"),
    ],
)
def test_rl_flags_that_cannot_work(model_dir, tmp_path, capsys, flags, expected):
    out = tmp_path / "out"
    assert expected in _fails(capsys, ["rl", "--model", model_dir, "--task", "arith", *flags, "--out", out])
    assert not out.exists()


def test_train_rl_refuses_a_block_lr_without_blocks(tmp_path):
    from dataclasses import replace

    from test_rl import CFG, TASK, TOK, policy

    from bridgelm.train.rl import train_rl

    with pytest.raises(ValueError, match="block_lr=0.001, but the model has no added blocks"):
        train_rl(policy(blocks=False), TOK, TASK, replace(CFG, block_lr=1e-3), tmp_path / "rl")
    assert not (tmp_path / "rl").exists()


def test_a_huge_prompt_is_refused_by_characters_before_tokenizing(model_dir, tmp_path, capsys, monkeypatch):
    import bridgelm.engine.text as text

    def never(*args, **kwargs):
        raise AssertionError("tokenized")

    monkeypatch.setattr(text, "encode_prompts", never)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+1=" * 2_500_000}) + "\n")  # 10 MB
    argv = ["generate", "--model", model_dir, "--prompts", prompts, "--max-new-tokens", "8", "--out", tmp_path / "s"]
    line = _fails(capsys, argv)
    assert "prompt 0 has 10000000 characters: more than the" in line and "248 tokens" in line


def _block_file(tmp_path, arch="qwen2", **meta_changes):
    import bridgelm
    from safetensors import safe_open
    from safetensors.torch import save_file

    from bridgelm.blockfile import save_blocks

    path = save_blocks(bridgelm.add_bridge(tiny_model(arch)), tmp_path / f"{arch}.safetensors")
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    meta = {k: v for k, v in {**meta, **meta_changes}.items() if v is not None}
    dtype = meta_changes.get("_dtype")
    if dtype is not None:
        tensors = {k: (v * 100).to(dtype) for k, v in tensors.items()}
    save_file(tensors, str(path), metadata={k: v for k, v in meta.items() if not k.startswith("_")})
    return path


@pytest.mark.parametrize(
    "arch, changes, expected",
    [
        ("qwen2", {"kind": None}, "has no kind in its metadata"),
        ("qwen2", {"num_heads": "four"}, "its metadata does not describe blocks"),
        ("llama", {}, "holds blocks trained in a llama model"),  # same shapes, another architecture
        ("qwen2", {"_dtype": torch.int64}, r"is I64 \(and 5 more\): expected floating-point weights"),
    ],
)
def test_block_files_that_do_not_belong_to_this_model(tmp_path, arch, changes, expected):
    import bridgelm

    path = _block_file(tmp_path, arch, **changes)
    model = tiny_model("qwen2")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UserError, match=expected):
        bridgelm.load_blocks(model, path)
    assert bridgelm.block_config(model) is None and model.state_dict().keys() == before.keys()

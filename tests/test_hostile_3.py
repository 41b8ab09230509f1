"""A third hostile sweep (issue 48): nothing a run folder holds is unpickled freely, no non-finite model is written
or announced, and every file a command reads is checked where it enters (one line, exit 2)."""

import json
import os
import pickle
import warnings

import pytest
import torch
from conftest import tiny_model

from bridgelm import runs
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
    folder = run / runs.CHECKPOINTS / runs.checkpoint_name(step)
    folder.mkdir(parents=True)
    _shards(folder / runs.SHARDS)
    torch.save({"step": step}, folder / runs.TRAINER_STATE)
    info = {"step": step, **runs.format_of("checkpoint"), "layout": "sharded", "identity": {}}
    (folder / runs.TRAINER_INFO).write_text(json.dumps(info))
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
    assert runs.resume_point(run, True) == second
    shard = next((second / runs.SHARDS).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # cut: passed over like a damaged plain checkpoint
    with pytest.warns(DataWarning, match=f"{second}.*{shard.name} has 100 bytes"):
        assert runs.resume_point(run, True) == first
    (first / runs.SHARDS / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    (second / runs.SHARDS / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    with pytest.raises(UserError, match=r"\.metadata names posix\.system.*not loaded"):
        runs.resume_point(run, True)
    cut = second / runs.SHARDS / ".metadata"
    cut.write_bytes(cut.read_bytes()[:10])  # a cut index is damage, the next one's planted pickle still refused
    with pytest.raises(UserError, match=str(first / runs.SHARDS / ".metadata")):
        runs.resume_point(run, True)
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


def _fails(capsys, argv) -> str:
    """Run the CLI in-process: exit 2 and one line `bridgelm <command>: error: ...` (returned), no traceback."""
    from bridgelm.cli import main

    with pytest.raises(SystemExit) as err:
        main([str(a) for a in argv])
    assert err.value.code == 2
    msg = capsys.readouterr().err
    lines = [line for line in msg.splitlines() if ": error: " in line]
    assert len(lines) == 1 and "Traceback" not in msg, msg
    return lines[0]


@pytest.mark.parametrize(
    "command, flag, value",
    [("rl", "--lr", "1e308"), ("rl", "--block-lr", "2"), ("sft", "--lr", "1e300")],
)
def test_a_learning_rate_whose_step_overflows_is_refused_up_front(tmp_path, capsys, command, flag, value):
    out = tmp_path / "out"
    extra = ["--task", "arith"] if command == "rl" else ["--data", tmp_path / "w.jsonl"]
    line = _fails(capsys, [command, "--model", tmp_path / "no-model", *extra, flag, value, "--out", out])
    assert f"{flag[2:].replace('-', '_')}={float(value)!r}: expected at most 1.0" in line
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
    last = out / runs.CHECKPOINTS / runs.checkpoint_name(1)
    assert message.startswith(f"bridgelm {kind}: step 2 diverged") and f"last good checkpoint is {last}" in message
    assert "\n" not in message and "lower --lr" in message
    assert runs.list_checkpoints(out) == [last]  # nothing of step 2 written
    assert [r["step"] for r in map(json.loads, (out / runs.METRICS).read_text().splitlines())] == [1]


def test_a_diverging_rl_run_stops_without_writing_the_nan_model(tmp_path, monkeypatch):
    from dataclasses import replace

    from test_rl import CFG, TASK, TOK, policy

    from bridgelm.train.rl import train_rl

    _poison_after(monkeypatch, calls=CFG.steps_per_rollout + 1)  # in rollout step 2
    out = tmp_path / "rl"
    with pytest.raises(UserError) as err:
        train_rl(policy(), TOK, TASK, replace(CFG, save_every=1), out)
    _stopped_at_step_2(err, out, "rl")
    assert not (out / "best").exists()


def test_a_diverging_sft_run_stops_without_writing_the_nan_blocks(tmp_path, monkeypatch):
    from dataclasses import replace

    from test_sft import CFG, TOK, base_model, write_warmup

    from bridgelm.train.sft import train_sft

    _poison_after(monkeypatch, calls=2)
    out = tmp_path / "sft"
    with pytest.raises(UserError) as err:
        train_sft(base_model(), TOK, write_warmup(tmp_path / "w.jsonl"), replace(CFG, save_every=1), out)
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
    assert runs.list_checkpoints(tmp_path / "run") == []

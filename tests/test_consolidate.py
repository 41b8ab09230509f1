"""`bridgelm consolidate`: an --fsdp checkpoint's shards as one model folder, equal to the one the run gathers.

The run: `bridgelm rl --fsdp` on 2 CPU ranks (torchrun, gloo) with a checkpoint per step; its last checkpoint holds
the model folder the run gathers itself, the one before only shards. Weight decay moves every decayed weight at
each step, so step 1 differs from the base and from step 2 even where the rewards teach nothing.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import save_tiny_model_dir
from safetensors.torch import load_file

import bridgelm
from bridgelm.cli import main
from bridgelm.errors import DataWarning, UserError
from bridgelm.train.consolidate import consolidate


def _torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def _fsdp_rl(root, *extra, model=None):
    """A 2-step `rl --fsdp` run of 2 CPU ranks into root/run, a checkpoint a step, from the base root/m (or
    `model`)."""
    save_tiny_model_dir(root / "m")
    rows = [{"question": f"{i}+{i}=", "answer": f"#### {2 * i}"} for i in range(8)]
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--model", str(model or root / "m"), "--add", "bridge", "--task", "gsm8k"]
    args += ["--data", str(root / "data.jsonl")]
    args += ["--out", str(root / "run"), "--fsdp", "--steps", "2", "--prompts-per-step", "2", "--rollouts", "2"]
    args += ["--width", "2", "--max-new-tokens", "4", "--save-every", "1", "--keep-last", "3", "--lr", "0.01"]
    args += ["--weight-decay", "0.1", "--steps-per-rollout", "1", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(_torchrun() + ["-m", "bridgelm", "rl"] + args, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    return _fsdp_rl(tmp_path_factory.mktemp("fsdp"))


def test_a_bf16_run_consolidates_to_its_own_bf16_weights(tmp_path):
    """--dtype bfloat16: the run keeps its weights in bf16, and so does the folder (not an fp32 copy of them)."""
    root = _fsdp_rl(tmp_path, "--dtype", "bfloat16")
    consolidate(_step(root, 2), tmp_path / "step2")
    gathered = load_file(str(_step(root, 2) / "model.safetensors"))
    mine = load_file(str(tmp_path / "step2" / "model.safetensors"))
    assert {t.dtype for t in mine.values()} == {torch.bfloat16}
    assert sorted(mine) == sorted(gathered) and all(torch.equal(mine[k], gathered[k]) for k in mine)


def _step(root, n):
    return root / "run" / "checkpoints" / f"step-{n:08d}"


def test_the_shards_of_each_step_become_its_model_folder(fsdp_run, tmp_path, capsys):
    assert not (_step(fsdp_run, 1) / "model.safetensors").exists()  # step 1: shards only
    main(["consolidate", str(_step(fsdp_run, 1)), "--out", str(tmp_path / "step1")])
    assert "(a folder for --model)" in capsys.readouterr().out
    consolidate(_step(fsdp_run, 2), tmp_path / "step2")
    gathered = load_file(str(_step(fsdp_run, 2) / "model.safetensors"))  # the run's own, gathered on rank 0
    mine = load_file(str(tmp_path / "step2" / "model.safetensors"))
    assert sorted(mine) == sorted(gathered) and all(torch.equal(mine[k], gathered[k]) for k in mine)
    step1 = load_file(str(tmp_path / "step1" / "model.safetensors"))
    base = load_file(str(fsdp_run / "m" / "model.safetensors"))
    assert all(not torch.equal(step1[k], mine[k]) for k in mine)  # step 1's weights, not the last step's
    assert sum(not torch.equal(step1[k], base[k]) for k in base) > len(base) // 2  # nor the base's
    model = bridgelm.load_model(str(tmp_path / "step1"))
    assert bridgelm.attach.block_config(model).kind == "bridge"  # the blocks come with the folder
    assert all(torch.equal(t, step1[k]) for k, t in model.state_dict().items() if k in step1)
    assert (tmp_path / "step1" / "tokenizer.json").is_file()


def test_what_is_not_a_whole_sharded_checkpoint_is_refused_in_one_line(fsdp_run, tmp_path):
    def refused(checkpoint, match, **kwargs):
        with pytest.raises(UserError, match=match) as err:
            consolidate(checkpoint, tmp_path / "out", **kwargs)
        assert "\n" not in str(err.value) and not (tmp_path / "out").exists()

    refused(tmp_path / "none", "is not a folder: expected RUN/checkpoints/step-N of an --fsdp run")
    run = fsdp_run / "run"
    refused(run, r"is a run folder \(its newest checkpoint: .*step-00000002\): expected a checkpoint")
    refused(run / "checkpoints", r"holds the run's checkpoints \(the newest: .*step-00000002\)")
    refused(fsdp_run / "m", r"is a model folder already \(give it as --model\)")
    with pytest.raises(UserError, match=r"has no config.json: .* \(it holds an --fsdp checkpoint's shards: `bridgelm "
                                        r"consolidate` makes it one\)"):
        bridgelm.load_model(str(_step(fsdp_run, 1)))  # where a user meets it first: --model
    whole = tmp_path / "whole"
    shutil.copytree(_step(fsdp_run, 2), whole)
    info = json.loads((whole / "trainer.json").read_text())
    (whole / "trainer.json").write_text(json.dumps({**info, "layout": "whole"}))
    refused(whole, r"is not sharded \(whole layout\): it is a model folder already; give it as --model")
    cut = tmp_path / "cut"
    shutil.copytree(_step(fsdp_run, 1), cut)
    shard = sorted((cut / "shards").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:64])
    refused(cut, r"is damaged \(shards/__\d_0.distcp has 64 bytes")
    save_tiny_model_dir(tmp_path / "other", alphabet="0123456789")  # another vocabulary: other shapes
    with pytest.warns(DataWarning, match="its files differ from those the run read"):
        refused(_step(fsdp_run, 1), r"its shards do not fit the model \(.*\): expected the run's --model",
                model=str(tmp_path / "other"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "empty")  # a link to an empty folder: the folder gets the model
    consolidate(_step(fsdp_run, 1), tmp_path / "link")
    assert (tmp_path / "link").is_symlink() and (tmp_path / "empty" / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="--out .* already holds files"):
        consolidate(_step(fsdp_run, 1), tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_a_base_model_changed_since_the_run_is_warned_and_a_gone_one_asked_for(fsdp_run, tmp_path):
    moved = tmp_path / "moved"
    shutil.copytree(fsdp_run / "m", moved, copy_function=shutil.copy)  # without its times: its files read as changed
    with pytest.warns(DataWarning, match="its files differ from those the run read"):
        consolidate(_step(fsdp_run, 1), tmp_path / "a", model=str(moved))  # a copy without its times: said
    assert (tmp_path / "a" / "model.safetensors").is_file()
    run_copy = tmp_path / "run"
    shutil.copytree(_step(fsdp_run, 1), run_copy)
    info = json.loads((run_copy / "trainer.json").read_text())
    info["identity"]["model"] = str(moved)
    (run_copy / "trainer.json").write_text(json.dumps(info))
    with pytest.warns(DataWarning, match="its files differ from those the run read"):
        consolidate(run_copy, tmp_path / "b")
    shutil.move(moved, tmp_path / "gone")
    with pytest.raises(UserError, match=f"base model {moved} is not there any more .*: expected --model where"):
        consolidate(run_copy, tmp_path / "c")


def test_a_composite_fsdp_run_resumes_and_consolidates(tmp_path):
    """Gemma 3 with its vision tower under --fsdp: the tower's parameters never get a gradient in a text run, so its
    optimiser shards hold no state for them; a resume keeps their zero state (AdamW passes them over) where it
    demanded it from the shards (a RuntimeError traceback)."""
    from conftest import tiny_composite

    from bridgelm.tokenizer import char_tokenizer

    tok = char_tokenizer("0123456789+-=() abc\n")
    model = tiny_composite(vocab_size=len(tok))
    model.save_pretrained(tmp_path / "g3")
    tok.save_pretrained(tmp_path / "g3")
    run = _fsdp_rl(tmp_path, model=tmp_path / "g3")
    shutil.rmtree(_step(run, 2))
    _fsdp_rl(tmp_path, "--resume", model=tmp_path / "g3")
    consolidate(_step(run, 1), tmp_path / "step1")
    assert bridgelm.block_config(bridgelm.load_model(str(tmp_path / "step1"))).kind == "bridge"

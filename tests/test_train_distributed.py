"""Two CPU processes (torchrun, gloo) against one: same GRPO loss and gradients, data parallel and FSDP2.

One torchrun launch of tests/dist_scripts/rl_dist.py writes everything; the tests compare it with the same
functions run here in a single process.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import bridgelm
from bridgelm.dist import Dist

SCRIPT = Path(__file__).parent / "dist_scripts" / "rl_dist.py"
sys.path.insert(0, str(SCRIPT.parent))


@pytest.fixture(scope="module")
def two_procs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(SCRIPT), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def one_proc():
    import rl_dist

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return rl_dist.minibatch_grads(Dist(), fsdp=False)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kind", ["plain", "fsdp"])
def test_same_loss_and_gradients_as_one_process(two_procs, one_proc, kind):
    got = torch.load(two_procs / f"grads_{kind}.pt", weights_only=True)
    assert got["tokens"] == one_proc["tokens"]  # global token count, not each rank's
    assert got["loss"] == pytest.approx(one_proc["loss"], rel=1e-6, abs=1e-7)
    assert got["grads"].keys() == one_proc["grads"].keys()
    for name, want in one_proc["grads"].items():
        assert torch.allclose(got["grads"][name], want, rtol=1e-5, atol=1e-6), name
    assert any(g.abs().max() > 1e-3 for g in one_proc["grads"].values())


def test_training_runs_data_parallel_and_fsdp_alike(two_procs):
    plain = json.loads((two_procs / "train_plain.json").read_text())
    fsdp = json.loads((two_procs / "train_fsdp.json").read_text())
    assert [r["step"] for r in plain["history"]] == [1, 2] and "val_accuracy" in plain["history"][-1]
    for a, b in zip(plain["history"], fsdp["history"]):
        assert a["reward"] == b["reward"] and a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    wa = load_file(str(Path(plain["final"]) / "model.safetensors"))
    wb = load_file(str(Path(fsdp["final"]) / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.allclose(wa[k], wb[k], atol=1e-5), k
    model = bridgelm.load_model(fsdp["final"])  # the gathered FSDP checkpoint is a plain model directory
    assert bridgelm.block_config(model).kind == "bridge"
    assert (Path(fsdp["best"]) / "best.json").is_file()


def test_fsdp_resume_is_exact(two_procs):
    straight = json.loads((two_procs / "train_fsdp.json").read_text())
    resumed = json.loads((two_procs / "train_fsdp_resumed.json").read_text())
    assert resumed["stopped_at"] == "step-00000001"
    wa = load_file(str(Path(straight["final"]) / "model.safetensors"))
    wb = load_file(str(Path(resumed["final"]) / "model.safetensors"))
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    # each rank wrote its own shards of model and optimiser (torch.distributed.checkpoint); only the last
    # checkpoint holds the gathered model folder as well
    first, last = resumed["files"]["step-00000001"], resumed["files"]["step-00000002"]
    for files in (first, last):
        assert {"shards/.metadata", "shards/__0_0.distcp", "shards/__1_0.distcp", "trainer.json"} <= set(files)
    assert "model.safetensors" not in first and "model.safetensors" in last and "config.json" in last


def test_fsdp_bf16_is_mixed_precision(two_procs):
    """--fsdp --bf16: the weights (and so the optimiser) stay fp32, the training forwards compute in bf16 (a decoder
    layer's linear gets bf16 inputs and bf16 weights), and the run trains."""
    got = json.loads((two_procs / "train_fsdp_bf16.json").read_text())
    assert got["param_dtypes"] == ["torch.float32"]
    assert got["seen"] == [["torch.bfloat16", "torch.bfloat16"]]
    assert len(got["history"]) == 1 and math.isfinite(got["history"][0]["loss"])
    # and the rollouts were sampled from a plain bf16 replica, not from the sharded policy
    assert [(s["dtype"], s["sharded"]) for s in got["sampled"]] == [("torch.bfloat16", False)]


def test_the_rollout_replica_holds_the_gathered_weights_in_bf16(two_procs):
    """Each rank's replica equals the policy gathered to rank 0 (full_state_dict) cast to bf16, at the first refresh
    and after the trained parameters moved (the frozen ones copied once); it holds no FSDP module."""
    ranks = [torch.load(two_procs / f"replica_rank{r}.pt", weights_only=True) for r in range(2)]
    gathered = [refresh["gathered"] for refresh in ranks[0]["refreshes"]]
    assert gathered[0].keys() and not torch.equal(gathered[0]["lm_head.weight"], gathered[1]["lm_head.weight"])
    frozen = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(gathered[0][frozen], gathered[1][frozen])
    for got in ranks:
        assert got["fsdp_modules"] == 0
        for refresh, full in zip(got["refreshes"], gathered, strict=True):
            replica = refresh["replica"]
            assert {k for k, v in replica.items() if v.is_floating_point()} >= full.keys()
            for k, want in full.items():
                assert replica[k].dtype == torch.bfloat16 and torch.equal(replica[k], want.to(torch.bfloat16)), k


def test_fsdp_rollouts_from_the_bf16_replica_are_those_of_the_unsharded_bf16_copy(two_procs):
    """Same seed, rollout_dtype bfloat16, with and without FSDP: every step samples the same token ids on each
    rank. Step 1 samples from the same bf16 weights by construction; later steps sample from weights that FSDP's and
    data parallel's updates agree on to ~1e-7 (test_training_runs_data_parallel_and_fsdp_alike), which round to the
    same bf16 values here (a weight on a bf16 rounding boundary could flip one: then only step 1 would hold)."""
    for r in range(2):
        plain = json.loads((two_procs / f"bf16_copy_plain_rank{r}.json").read_text())
        fsdp = json.loads((two_procs / f"bf16_copy_fsdp_rank{r}.json").read_text())
        assert len(plain["steps"]) == len(fsdp["steps"]) == 2
        for a, b in zip(plain["steps"], fsdp["steps"]):
            assert (a["dtype"], a["sharded"]) == (b["dtype"], b["sharded"]) == ("torch.bfloat16", False)
            assert a["ids"] == b["ids"] and len(a["ids"]) == 2 * 4  # 2 prompts x 4 rollouts on this rank
        assert [h["reward"] for h in plain["history"]] == [h["reward"] for h in fsdp["history"]]


def test_validation_samples_from_the_bf16_copy_and_the_reference_is_resharded(two_procs):
    """With a rollout copy, validation samples from it (under FSDP no gathered fp32 policy beside it), sharded or
    not, and accuracy is the same; under FSDP the reference's root, which FSDP2 leaves gathered after a forward
    (reshard_after_forward=False, and it runs no backward), is sharded again after every update."""
    for r in range(2):
        plain = json.loads((two_procs / f"bf16_copy_plain_rank{r}.json").read_text())
        fsdp = json.loads((two_procs / f"bf16_copy_fsdp_rank{r}.json").read_text())
        for run in (plain, fsdp):
            assert run["validated"] == [{"dtype": "torch.bfloat16", "policy": False}]
        assert plain["history"][-1]["val_accuracy"] == fsdp["history"][-1]["val_accuracy"]
        assert fsdp["ref_gathered"] == [0, 0]  # no parameter of the reference left unsharded


def test_teardown_waits_for_every_rank(two_procs):
    """A rank leaves the process group only once every rank is there (a gloo rank torn down while another still
    talks to it can abort), so rank 0 waits in teardown for rank 1, which came LATE_S late."""
    import rl_dist

    waited = json.loads((two_procs / "teardown_rank0.json").read_text())
    assert waited >= 0.8 * rl_dist.LATE_S


MICRO = Path(__file__).parent / "dist_scripts" / "fsdp_micro.py"


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_micro_batches_by_tokens_agree_across_ranks(tmp_path, world):
    """Ragged lengths cut into different micro-batch counts per rank (zero advantages on rank 0): under FSDP the run
    finishes (it hung), and its weights are those of the run without micro_batch_tokens."""
    import rl_dist

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), str(MICRO), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cuts = [json.loads((tmp_path / f"cuts_rank{r}.json").read_text()) for r in range(world)]
    assert cuts[0] != cuts[1]  # alone, the ranks would run different numbers of forwards
    initial = rl_dist.model_and_tokenizer()[0].state_dict()
    for beta in (0.05, 0.0):
        whole = torch.load(tmp_path / f"beta{beta}_tokensNone.pt", weights_only=True)
        cut = torch.load(tmp_path / f"beta{beta}_tokens40.pt", weights_only=True)
        assert whole.keys() == cut.keys() == initial.keys()
        for k in whole:
            assert torch.allclose(whole[k], cut[k], atol=1e-5), k  # AdamW magnifies rounding: as test_rl.py
        assert any((whole[k] - initial[k]).abs().max() > 1e-4 for k in whole)  # trained


AGREE = Path(__file__).parent / "dist_scripts" / "agree_dist.py"


@pytest.fixture(scope="module")
def agreed(tmp_path_factory):
    out = tmp_path_factory.mktemp("agree")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(AGREE), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stderr


@pytest.mark.parametrize("case,step", [("fsdp_sigint_rank1", 1), ("plain_sigterm_rank0", 2)])
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_saved_step(agreed, case, step):
    """One rank is signalled while still sampling (the other waits in the update's all-reduce): both finish the
    step, save it (under FSDP each its own shards), stop in order (exit 0 from the command), and resume from it."""
    out, stderr = agreed
    ranks = [json.loads((out / f"{case}_rank{r}.json").read_text()) for r in range(2)]
    name = f"step-{step:08d}"
    for got in ranks:
        assert got["stopped"] == "StoppedTogether" and got["saved"] is True
        assert got["checkpoints"] == [name]  # save_every=0: the only checkpoint is the agreed one
        assert got["resumed_steps"] == list(range(1, 4)) and got["final"] == 3
    if case.startswith("fsdp"):
        assert {f"checkpoints/{name}/shards/__0_0.distcp", f"checkpoints/{name}/shards/__1_0.distcp"} <= set(
            ranks[0]["files"])
    assert ("SIGINT" if "sigint" in case else "SIGTERM") + ": every rank stops after this step" in stderr


def test_every_rank_refuses_to_resume_from_a_checkpoint_one_rank_lacks(agreed):
    out, _ = agreed
    for r in range(2):
        error = json.loads((out / f"missing_rank{r}.json").read_text())["error"]
        assert error.startswith("rank 1 cannot resume from step-00000003 (rank 0's newest checkpoint") and "\n" not in error

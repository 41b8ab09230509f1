"""One device per rank, decided from torchrun's environment before anything loads (no GPU needed: CUDA is faked)."""

import json
from datetime import timedelta

import pytest
import torch

import bridgelm.train.rl  # noqa: F401  imported before a test patches dist.setup_distributed, which
import bridgelm.train.sft  # noqa: F401  these modules bind by name when first imported
from bridgelm import dist, models
from bridgelm.source import ModelSource


def _torchrun(monkeypatch, world: int | None, local: int = 0, cuda: bool = True, gpus: int = 8) -> None:
    """torchrun's variables of rank `local` of `world` processes (None: a plain process), and a machine with `gpus`
    CUDA GPUs (`cuda`) or none."""
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    if world is not None:
        monkeypatch.setenv("WORLD_SIZE", str(world))
        monkeypatch.setenv("RANK", str(local))
        monkeypatch.setenv("LOCAL_RANK", str(local))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus if cuda else 0)


@pytest.mark.parametrize(
    "world, local, cuda, requested, want",
    [
        (None, 0, True, "cuda", "cuda"),  # one process: the request as it is
        (None, 0, True, "cuda:1", "cuda:1"),
        (None, 0, True, "cpu", "cpu"),
        (None, 0, True, None, "cpu"),
        (4, 3, True, "cuda", "cuda:3"),  # torchrun: the rank's own GPU, not cuda:0
        (4, 3, True, "cuda:0", "cuda:3"),
        (4, 2, True, torch.device("cuda"), "cuda:2"),
        (4, 1, True, None, "cuda:1"),
        (4, 1, True, "cpu", "cpu"),
        (4, 1, False, None, "cpu"),  # eval's default without a GPU
        (2, 1, False, "cuda", "cuda:1"),  # left for check_device to refuse in one line
    ],
)
def test_rank_device_from_the_environment(monkeypatch, world, local, cuda, requested, want):
    _torchrun(monkeypatch, world, local, cuda)
    assert dist.rank_device(requested) == want


def test_dist_from_env_takes_the_rank_device(monkeypatch):
    _torchrun(monkeypatch, 4, local=2)
    place = dist.Dist.from_env("cuda")
    assert (place.rank, place.world, place.local_rank, place.device) == (2, 4, 2, torch.device("cuda:2"))
    _torchrun(monkeypatch, 4, local=2, cuda=False)
    assert dist.Dist.from_env("cpu").device == torch.device("cpu")
    with pytest.raises(ValueError, match="device 'cuda:2': this machine has no CUDA GPU"):
        dist.Dist.from_env("cuda")


def test_a_rank_beyond_the_gpus_is_refused_before_loading(monkeypatch):
    _torchrun(monkeypatch, 8, local=5, gpus=4)
    with pytest.raises(models.UserError, match=r"device 'cuda:5': this machine has 4 CUDA GPU\(s\)"):
        models.check_device(dist.rank_device("cuda"))
    with pytest.raises(models.UserError, match=r"device 'cuda:5': this machine has 4 CUDA GPU\(s\)"):
        dist.Dist.from_env("cuda")  # the one check of a device, where the rank's device is decided


@pytest.mark.parametrize("world, local, want", [(None, 0, "cuda"), (4, 3, "cuda:3")])
def test_load_model_of_loads_onto_the_rank_device(monkeypatch, world, local, want):
    _torchrun(monkeypatch, world, local)
    asked = {}
    monkeypatch.setattr(models, "load_model", lambda name, **kwargs: asked.update(kwargs, name=name) or "model")
    source = ModelSource(model="M", device="cuda", dtype="float32")
    assert source.load_model(None) == "model"
    assert asked["name"] == "M" and asked["device"] == want and asked["blocks"] is None


def test_the_process_group_waits_dist_timeout_minutes(monkeypatch):
    _torchrun(monkeypatch, 2, local=1, cuda=False)
    joined = []
    monkeypatch.setattr(dist.torch_dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist.torch_dist, "init_process_group", lambda **kwargs: joined.append(kwargs))
    monkeypatch.setattr(dist.torch_dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist.torch_dist, "get_world_size", lambda: 2)
    place = dist.setup_distributed("cpu", timeout_minutes=90)
    assert (place.rank, place.world, place.device) == (1, 2, torch.device("cpu"))
    dist.setup_distributed("cpu")
    assert joined == [
        {"backend": "gloo", "timeout": timedelta(minutes=90)},
        {"backend": "gloo", "timeout": timedelta(minutes=60)},  # not torch's 10
    ]


class Joined(Exception):
    pass


def _rl_args(tmp_path) -> list[str]:
    from conftest import save_tiny_model_dir

    save_tiny_model_dir(tmp_path / "m")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+{a}", "answer": f"#### {2 * a}"}) + "\n" for a in range(6)))
    return ["rl", "--model", str(tmp_path / "m"), "--task", "gsm8k", "--data", str(data), "--out", str(tmp_path / "o")]


def test_rl_joins_the_group_with_dist_timeout_before_training(tmp_path, monkeypatch):
    from bridgelm.cli import main

    asked = []

    def join(device, timeout_minutes):
        asked.append((str(device), timeout_minutes))
        raise Joined

    monkeypatch.setattr(dist, "setup_distributed", join)
    with pytest.raises(Joined):
        main([*_rl_args(tmp_path), "--dist-timeout", "2.5"])
    assert asked == [("cpu", 2.5)]


@pytest.mark.parametrize("command", ["rl", "sft"])
@pytest.mark.parametrize("value", ["0", "-3", "nan"])
def test_a_dist_timeout_that_cannot_work_is_refused_before_the_model_loads(tmp_path, capsys, command, value):
    from bridgelm.cli import main

    sft = ["sft", "--model", str(tmp_path / "no-such-model"), "--data", str(tmp_path / "d.jsonl"), "--out", "o"]
    args = _rl_args(tmp_path) if command == "rl" else sft  # (the model is never reached)
    with pytest.raises(SystemExit) as err:
        main([*args, "--dist-timeout", value])
    assert err.value.code == 2
    assert f"--dist-timeout {float(value)}: expected a finite number in (0, 525600.0] (minutes)" in capsys.readouterr().err


def test_rollouts_under_fsdp_sample_from_a_bf16_replica_and_a_fp32_one_is_refused():
    from bridgelm.train.optim import OptimConfig
    from bridgelm.train.rl_config import RLConfig

    bf16 = OptimConfig(bf16=True)
    assert RLConfig(fsdp=True, optim=bf16).replica_dtype() == "bfloat16"  # the default under --fsdp --bf16
    assert RLConfig(fsdp=True).replica_dtype() is None  # the gathered fp32 policy samples
    assert RLConfig(optim=bf16).replica_dtype() is None  # without FSDP: only as asked
    RLConfig(fsdp=True, rollout_dtype="bfloat16").validate(2)
    with pytest.raises(ValueError, match=r"rollout_dtype='float32' with fsdp .*\(4 bytes a parameter\)"):
        RLConfig(fsdp=True, rollout_dtype="float32").validate(2)


def test_a_rollout_replica_is_the_policy_in_bf16_with_its_buffers_in_fp32():
    """One process: the replica made before the first refresh holds no storage (meta); after it, every parameter is
    the policy's cast to bf16 (tied ones tied), the rotary buffers stay fp32 (as transformers loads a bf16 model);
    a later refresh copies the trained parameters alone."""
    from conftest import tiny_model

    from bridgelm.train.rollouts import RolloutPolicy

    model = tiny_model(tie_word_embeddings=True)
    sampler = RolloutPolicy(model, "bfloat16")
    assert {p.device.type for p in sampler.replica.parameters()} == {"meta"}
    model.model.norm.requires_grad_(False)
    replica = sampler.current()
    assert replica.lm_head.weight is replica.model.embed_tokens.weight
    for (name, got), want in zip(replica.named_parameters(), model.parameters(), strict=True):
        assert got.dtype == torch.bfloat16 and not got.requires_grad and torch.equal(got, want.to(torch.bfloat16)), name
    assert {b.dtype for b in replica.buffers()} == {torch.float32}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    sampler.current()
    assert torch.equal(replica.model.norm.weight, (model.model.norm.weight - 0.5).to(torch.bfloat16))  # frozen
    assert torch.equal(replica.lm_head.weight, model.lm_head.weight.to(torch.bfloat16))


@pytest.mark.slow
def test_the_compiled_step_samples_the_refreshed_replica_without_compiling_again():
    """The replica is a plain module: the engine compiles it (no reason to refuse), and a refresh between rollout
    phases (weights copied in place, same storage) adds no graph, while the samples follow the new weights."""
    import torch._dynamo.utils as dynamo_utils
    from conftest import randomize_blocks, tiny_model

    import bridgelm
    from bridgelm.engine import SamplingConfig, generate_ids
    from bridgelm.engine.step import uncompiled_reason
    from bridgelm.train.rollouts import RolloutPolicy

    model = randomize_blocks(bridgelm.add_bridge(tiny_model()), std=0.2)
    sampler = RolloutPolicy(model, "bfloat16")
    cfg = SamplingConfig(n=4, width=2, max_new_tokens=6, temperature=1.0, top_p=1.0, seed=1, compile=True)
    prompts = [[7, 8, 9, 10], [11, 12, 13]]

    def ids(samples):
        return [s.token_ids for r in samples for s in r]

    replica = sampler.current()
    assert uncompiled_reason(replica) is None
    first = generate_ids(replica, prompts, cfg, [], 0)
    graphs = dict(dynamo_utils.counters["stats"]).get("unique_graphs")
    with torch.no_grad():
        model.lm_head.weight.mul_(-3.0)  # a step of training, in effect
    assert sampler.current() is replica
    got = generate_ids(replica, prompts, cfg, [], 0)
    assert dict(dynamo_utils.counters["stats"]).get("unique_graphs") == graphs  # compiled once
    assert ids(got) != ids(first)
    from test_engine import teacher_forced_logprobs  # the new weights' log-probs (bf16: compiled and eager round
    want = torch.cat(teacher_forced_logprobs(replica, prompts, got, 2, 1.0))  # apart, so a token may flip)
    have = torch.cat([torch.tensor(s.logprobs) for r in got for s in r])
    assert (have - want).abs().mean() < 0.05


@pytest.mark.parametrize("command", ["eval", "warmup-data"])
def test_a_cpu_run_under_torchrun_stays_on_the_cpu_where_gpus_are(tmp_path, monkeypatch, command):
    """--device cpu (the default) under torchrun on a machine with GPUs: each rank loads on the CPU, as asked (the
    rank's own GPU is for a cuda source)."""
    from bridgelm.eval.launch import run_evaluate
    from bridgelm.eval.runner import EvalConfig
    from bridgelm.launch import run_warmup_data
    from bridgelm.source import TaskSource

    class Loaded(Exception):
        pass

    def load(source):
        raise Loaded(source.device)

    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(ModelSource, "load", load)
    data = tmp_path / "toy.jsonl"
    data.write_text(json.dumps({"question": "1+1", "answer": "#### 2"}) + "\n")
    source = ModelSource(str(tmp_path / "m"), device="cpu")
    with pytest.raises(Loaded) as loaded:
        if command == "eval":
            run_evaluate(EvalConfig(), source, "gsm8k", [str(data)], str(tmp_path / "run"))
        else:
            run_warmup_data(source, TaskSource("gsm8k", str(data)), str(tmp_path / "w.jsonl"), 4)
    assert str(loaded.value) == "cpu"

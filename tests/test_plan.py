"""bridgelm plan against hand calculations on the paper's three model shapes (meta device: nothing is allocated)."""

import json

import pytest
import torch

from bridgelm import plan
from bridgelm.cli import main

GIB = 2**30
# published shapes: vocabulary, hidden, intermediate, layers, key/value heads (head_dim 128 in all three)
SHAPES = {
    "ds-qwen-1.5b": (151936, 1536, 8960, 28, 2),
    "ds-qwen-7b": (152064, 3584, 18944, 28, 4),
    "ds-llama-8b": (128256, 4096, 14336, 32, 8),
}
PUBLISHED = {"ds-qwen-1.5b": 1_777_088_000, "ds-qwen-7b": 7_615_616_512, "ds-llama-8b": 8_030_261_248}
# the paper's scale: 8 GPUs, FSDP, 64 prompts x 8 rollouts in groups of 4, 4096 new tokens after 512 prompt tokens;
# one group per micro-batch, bf16 autocast, gradient checkpointing
ARGS = "--world-size 8 --fsdp --prompts-per-step 64 --rollouts 8 --width 4 --max-new-tokens 4096 --prompt-tokens 512"
ARGS += " --micro-batch-groups 1 --bf16 --gradient-checkpointing --steps-per-rollout 8"


def by_hand(name: str) -> dict[str, float]:
    """The rows in bytes, worked out from the published shapes (plan.py's docstring gives the formulas)."""
    V, h, i, n, kv = SHAPES[name]
    qwen = name.startswith("ds-qwen")  # Qwen2 has q/k/v biases
    kvd = kv * 128
    attn = h * h + 2 * h * kvd + h * h + (h + 2 * kvd if qwen else 0)
    P = 2 * V * h + n * (attn + 3 * h * i + 2 * h) + h  # embedding and head, layers, final norm
    assert P == PUBLISHED[name]
    W, L = 8, 512 + 4096
    rows = min(64 // W * 8, 256, 262_144 // L) // 4 * 4  # a rank's 64 rollouts; 262144 tokens hold 56 rows
    assert rows == 56
    m = 1 * 4  # one group of 4 (a mini-batch holds 8 x 2 / 8 = 2 groups)
    return {
        "weights": P * 4 / W,
        "gradients": P * 4 / W,
        "optimiser": 2 * P * 4 / W,
        "reference": P * 4 / W,
        "rollout model": P * 2,  # the whole model gathered to sample, in bf16 (mixed-precision FSDP)
        "KV cache": n * 2 * kv * 128 * rows * L * 2,  # sampled in bf16
        "activations": m * L * (n * h + 10 * h + 4 * i) * 2 + m * 4096 * V * 4 * 2,
    }


@pytest.mark.parametrize("name", list(SHAPES))
def test_plan_matches_the_hand_calculation(name, capsys):
    main(["plan", "--preset", name, *ARGS.split(), "--gpu-memory-gib", "80", "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    got = json.loads(out[-1])
    want = by_hand(name)
    assert got["rows_gib"] == pytest.approx({k: v / GIB for k, v in want.items()}, rel=1e-12)
    held = want["weights"] + want["optimiser"] + want["reference"]
    peak = held + max(want["rollout model"] + want["KV cache"], want["gradients"] + want["activations"])
    assert got["per_gpu_gib"] == pytest.approx(peak / GIB, rel=1e-12)
    assert got["fits"] == (peak / GIB <= 80)
    assert "| KV cache |" in "\n".join(out) and "waves of 56 rows x 4608 tokens" in out[0]


def test_the_paper_7b_fits_80_gib_only_with_care(capsys):
    main(["plan", "--preset", "ds-qwen-7b", *ARGS.split(), "--gpu-memory-gib", "80", "--json"])
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["fits"]
    plain = ARGS.replace(" --bf16 --gradient-checkpointing", "")
    main(["plan", "--preset", "ds-qwen-7b", *plain.split(), "--gpu-memory-gib", "80", "--json"])
    assert not json.loads(capsys.readouterr().out.splitlines()[-1])["fits"]


def test_without_fsdp_each_gpu_holds_the_whole_model_and_its_rollout_copy(capsys):
    main(["plan", "--preset", "ds-qwen-1.5b", "--world-size", "2", "--rollout-dtype", "bfloat16", "--beta", "0",
          "--gpu-memory-gib", "80", "--json"])  # fmt: skip
    rows = json.loads(capsys.readouterr().out.splitlines()[-1])["rows_gib"]
    P = PUBLISHED["ds-qwen-1.5b"]
    assert rows["weights"] == pytest.approx(P * 4 / GIB) and rows["optimiser"] == pytest.approx(2 * P * 4 / GIB)
    assert rows["reference"] == 0 and rows["rollout model"] == pytest.approx(P * 2 / GIB)


def test_blocks_are_counted_and_a_model_folder_is_read_for_its_config_only(tmp_path, capsys):
    from conftest import save_tiny_model_dir

    save_tiny_model_dir(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()  # only config.json is read
    main(["plan", "--model", str(tmp_path / "m"), "--gpu-memory-gib", "1", "--json"])
    plain = json.loads(capsys.readouterr().out.splitlines()[-1])
    main(["plan", "--model", str(tmp_path / "m"), "--add", "bridge", "--gpu-memory-gib", "1", "--json"])
    added = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert added["rows_gib"]["weights"] > plain["rows_gib"]["weights"] and plain["fits"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--preset", "ds-qwen-7b"], "no CUDA device here to read the GPU's memory from"),
        (["--preset", "ds-qwen-7b", "--world-size", "3", "--gpu-memory-gib", "80"], "divisible by the 3 processes"),
        (["--preset", "ds-qwen-7b", "--world-size", "0"], "'0' is not a positive integer"),
        (["--preset", "ds-qwen-7b", "--gpu-memory-gib", "-1"], "'-1' is not a positive number of GiB"),
        (["--preset", "nope", "--gpu-memory-gib", "80"], "--preset nope: expected one of ds-qwen-1.5b"),
        (["--gpu-memory-gib", "80"], "give one of --model and --preset"),
    ],
)
def test_bad_input_is_one_line(monkeypatch, capsys, args, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as err:
        main(["plan", *args])
    assert err.value.code == 2 and message in capsys.readouterr().err


def test_the_device_memory_is_the_default_budget(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"total_memory": 80 * GIB}))
    assert plan.device_memory_gib() == 80


def test_rl_on_cuda_prints_the_plan_and_refuses_a_run_that_cannot_fit(monkeypatch, capsys):
    from test_rl import CFG, TASK, TOK, policy

    from bridgelm.cli.train import _plan_or_refuse
    from bridgelm.errors import UserError

    model = policy()
    _plan_or_refuse(model, TOK, TASK, CFG, "float32", "cpu")  # not a GPU: nothing to plan
    assert capsys.readouterr().out == ""
    asked = []
    monkeypatch.setattr(plan, "device_memory_gib", lambda device: asked.append(device) or 80.0)
    _plan_or_refuse(model, TOK, TASK, CFG, "float32", "cuda:3")
    out = capsys.readouterr().out
    assert asked == ["cuda:3"] and "bridgelm rl: memory per GPU" in out and "of 80 (fits)" in out
    assert "x 10 tokens" in out  # the longest prompt ("5+3=": 4 tokens) + 6 new tokens
    monkeypatch.setattr(plan, "device_memory_gib", lambda device: 1e-6)
    with pytest.raises(UserError, match=r"this run needs about 0.0 GiB per GPU \(weights 0.0, .*a GPU has"):
        _plan_or_refuse(model, TOK, TASK, CFG, "float32", "cuda:0")

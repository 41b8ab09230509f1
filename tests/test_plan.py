"""bridgelm plan against hand calculations on the paper's three model shapes (meta device: nothing is allocated)."""

import json
import re

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
        "rollout replica": P * 2,  # the plain bf16 copy rollouts sample from (--fsdp --bf16), kept between steps
        "rollout model": 0,  # nothing gathered beside it
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
    held = want["weights"] + want["optimiser"] + want["reference"] + want["rollout replica"]
    peak = held + max(want["KV cache"], want["gradients"] + want["activations"])
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
    assert rows["reference"] == 0 and rows["rollout replica"] == pytest.approx(P * 2 / GIB)
    assert rows["rollout model"] == 0


def test_fsdp_without_a_replica_gathers_the_fp32_policy_to_sample(capsys):
    """--fsdp without --bf16 or --rollout-dtype: the gathered fp32 policy samples (the rest of the model, during the
    rollout phase only); with --rollout-dtype bfloat16 the bf16 replica does, held throughout."""
    base = ["plan", "--preset", "ds-qwen-1.5b", "--world-size", "2", "--fsdp", "--gpu-memory-gib", "80", "--json"]
    main(base)
    gathered = json.loads(capsys.readouterr().out.splitlines()[-1])
    main([*base, "--rollout-dtype", "bfloat16"])
    replica = json.loads(capsys.readouterr().out.splitlines()[-1])
    P = PUBLISHED["ds-qwen-1.5b"]
    assert gathered["rows_gib"]["rollout model"] == pytest.approx(P * 4 / 2 / GIB)
    assert gathered["rows_gib"]["rollout replica"] == 0
    assert replica["rows_gib"]["rollout model"] == 0
    assert replica["rows_gib"]["rollout replica"] == pytest.approx(P * 2 / GIB)
    assert replica["rows_gib"]["KV cache"] == pytest.approx(gathered["rows_gib"]["KV cache"] / 2)  # bf16, not fp32


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

    from bridgelm.cli.train import _plan_or_refuse, _rl_setup
    from bridgelm.errors import UserError

    model = policy()
    setup = lambda: _rl_setup(model, TOK, TASK, CFG, "float32")  # noqa: E731
    _plan_or_refuse("cpu", "rl", setup)  # not a GPU: nothing to plan
    assert capsys.readouterr().out == ""
    asked = []
    monkeypatch.setattr(plan, "device_memory_gib", lambda device: asked.append(device) or 80.0)
    _plan_or_refuse("cuda:3", "rl", setup)
    out = capsys.readouterr().out
    assert asked == ["cuda:3"] and "bridgelm rl: memory per GPU" in out and "of 80 (fits)" in out
    assert "x 10 tokens" in out  # the longest prompt ("5+3=": 4 tokens) + 6 new tokens
    monkeypatch.setattr(plan, "device_memory_gib", lambda device: 1e-6)
    with pytest.raises(UserError, match=r"this run needs about 0.0 GiB per GPU \(weights 0.0, .*a GPU has"):
        _plan_or_refuse("cuda:0", "rl", setup)


def test_sft_plan_matches_the_hand_calculation():
    """SFT of Bridge blocks on DS-Qwen-7B: the whole model on each GPU, gradients and AdamW over the blocks alone,
    no reference or rollouts; activations of one micro-batch of 4-wide groups of max_length tokens."""
    from bridgelm.attach import add_bridge
    from bridgelm.params import meta_model
    from bridgelm.train.sft import SFTConfig

    V, h, i, n, _ = SHAPES["ds-qwen-7b"]
    B = n * (h + 4 * h * 4 * 128)  # a Bridge block a layer: its RMSNorm, W_Q/W_K/W_V (h -> 4 heads x 128), W_O
    P = PUBLISHED["ds-qwen-7b"] + B
    model = add_bridge(meta_model(preset="ds-qwen-7b"), num_heads=4)
    cfg = SFTConfig(batch_groups=8, micro_batch_groups=2, max_width=4, max_length=2048, bf16=True)
    rows = plan.SFTSetup(plan.shape_of(model), cfg, world=8, dtype="float32").rows()
    m = 1 * 4  # a rank's share of 8 groups over 8 GPUs is one group (micro_batch_groups 2 bounded by it), 4 rows
    acts = m * 2048 * n * (10 * h + 4 * i) * 2 + m * 2048 * V * 4 * 2  # bf16 activations, fp32 logits + log-softmax
    want = {"weights": P * 4, "gradients": B * 4, "optimiser": 2 * B * 4, "activations": acts}
    assert rows == pytest.approx({name: want.get(name, 0) for name in plan.ROWS}, rel=1e-12)
    assert plan.per_gpu(rows) == pytest.approx(P * 4 + 2 * B * 4 + B * 4 + acts, rel=1e-12)
    text = plan.table(plan.SFTSetup(plan.shape_of(model), cfg, 8, "float32"), rows, 80)
    assert "micro-batches of 4 rows x 2048 tokens" in text and "(205.62M trained: the blocks)" in text


def test_sft_refuses_a_run_that_cannot_fit_before_training(tmp_path, monkeypatch, capsys):
    from conftest import save_tiny_model_dir
    from test_sft import write_warmup

    save_tiny_model_dir(tmp_path / "m")
    args = ["sft", "--model", str(tmp_path / "m"), "--data", str(write_warmup(tmp_path / "w.jsonl"))]
    capsys.readouterr()  # what saving the model printed
    monkeypatch.setattr(plan, "device_memory_gib", lambda device: 1e-6)  # a GPU of 1 KiB
    with pytest.raises(SystemExit) as err:
        main([*args, "--out", str(tmp_path / "sft")])
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("bridgelm sft")]
    assert err.value.code == 2 and len(said) == 1  # one line (besides transformers' loading bar)
    message = said[0]
    head = r"bridgelm sft: error: this run needs about \d+\.\d GiB per GPU \(weights \d+\.\d, gradients \d+\.\d, "
    assert re.match(head + r"optimiser .* activations \d+\.\d\)", message)
    assert "more than the 0.0 GiB a GPU has: lower --max-length or --micro-batch-groups" in message
    assert not (tmp_path / "sft" / "metrics.jsonl").exists()  # refused before any training
    monkeypatch.setattr(plan, "device_memory_gib", lambda device: 80.0)
    main([*args, "--out", str(tmp_path / "sft2"), "--epochs", "1"])
    out = capsys.readouterr().out
    assert "bridgelm sft: memory per GPU (bridgelm plan)" in out and "of 80 (fits)" in out
    assert (tmp_path / "sft2" / "blocks.safetensors").is_file()

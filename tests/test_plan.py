"""bridgelm plan against hand calculations on the paper's three model shapes (meta device: nothing is allocated)."""

import dataclasses
import json
import re

import pytest
import torch

from bridgelm import plan, plan_fit
from bridgelm.shape import shape_of
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


def norm(h: int) -> int:
    """An RMSNorm's bytes a token under bf16: its input in float32, the reciprocal root, the normalised values in bf16."""
    return 4 * h + 4 + 2 * h


def layer_bytes(h: int, i: int, kvd: int, block: int = 0) -> int:
    """A decoder layer's bytes a token under bf16: two norms and their outputs, q, k, v and the attention's output
    (sdpa's), o_proj's input, the SwiGLU's gate, up, activation and product; a Bridge block of `block` = H x Dh: its
    norm and output, its q, k, v and output, o_proj's input."""
    layer = 2 * (norm(h) + 2 * h) + 2 * (h + 2 * kvd + h) + 2 * h + 2 * 4 * i
    return layer + (norm(h) + 2 * h + 2 * 3 * block + 2 * block + 2 * block if block else 0)


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
    buffers = 2 * (2**26 // V) * V * 4  # token_logprobs' two float32 chunk buffers (2^26 // V rows each)
    rows_ = {
        "weights": P * 4 / W,
        "gradients": P * 4 / W,
        "optimiser": 2 * P * 4 / W,
        "reference": P * 4 / W,
        "rollout replica": P * 2,  # the plain bf16 copy rollouts sample from (--fsdp --bf16), kept between steps
        "rollout model": 0,  # nothing gathered beside it
        # sampled in bf16 by the compiled decode step, whose slab holds the bucket 6144 >= 4608 and a spare slot
        "KV cache": n * 2 * kv * 128 * rows * 6145 * 2,
        # bf16 activations kept with checkpointing (every layer's input, one layer's own, the final norm's), and at
        # the 4096 response positions a row the head's input, the bf16 logits, the target id and log-normaliser
        # under FSDP in bf16 the update holds whole: the root (embedding, head, final norm), two layers (one
        # prefetched), and the root's and a layer's gradients before their reduce-scatter
        "gathered weights": 2 * ((2 * V * h + h) * 2 + 3 * (attn + 3 * h * i + 2 * h)),
        "activations": m * L * (n * h * 2 + layer_bytes(h, i, kvd) + norm(h)) + m * 4096 * (2 * h + 2 * V + 12)
        + buffers,
        "validation model": 0,  # validation samples from the bf16 copy too
        "validation KV cache": n * 2 * kv * 128 * rows * 6145 * 2,  # no --eval-limit: a full wave of 56 rows
        "start-up": P * 4,  # the whole fp32 policy on each GPU before it is sharded
    }
    held = rows_["weights"] + rows_["optimiser"] + rows_["reference"] + rows_["rollout replica"]
    largest = held + max(rows_["KV cache"], rows_["gradients"] + rows_["gathered weights"] + rows_["activations"])
    return {**rows_, "overhead": 1.5 * GIB + 0.05 * largest}


@pytest.mark.parametrize("name", list(SHAPES))
def test_plan_matches_the_hand_calculation(name, capsys):
    main(["plan", "--preset", name, *ARGS.split(), "--gpu-memory-gib", "80", "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    got = json.loads(out[-1])
    want = by_hand(name)
    assert got["rows_gib"] == pytest.approx({k: v / GIB for k, v in want.items()}, rel=1e-12)
    held = want["weights"] + want["optimiser"] + want["reference"] + want["rollout replica"]
    phases = {
        "rollout": held + want["KV cache"],
        "update": held + want["gradients"] + want["gathered weights"] + want["activations"],
        "validation": held + want["validation KV cache"],
        "startup": want["start-up"],
    }
    phases = {k: (v + want["overhead"]) / GIB for k, v in phases.items()}
    assert got["phases_gib"] == pytest.approx(phases, rel=1e-12)
    peak = max(phases.values())
    assert got["per_gpu_gib"] == pytest.approx(peak, rel=1e-12)
    assert got["fits"] == (peak <= 80)
    assert "| KV cache |" in "\n".join(out) and "waves of 56 rows x 4608 tokens" in out[0]
    assert "| *validation* phase |" in "\n".join(out) and "| overhead |" in "\n".join(out)


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
    # bf16, not fp32, in the compiled step's slab (1024 positions: the bucket 1024 and a spare slot) where the
    # gathered policy decodes eagerly in the 512 + 512 positions of its rows
    assert replica["rows_gib"]["KV cache"] == pytest.approx(gathered["rows_gib"]["KV cache"] / 2 * 1025 / 1024)


def test_blocks_are_counted_and_a_model_folder_is_read_for_its_config_only(tmp_path, capsys):
    from conftest import save_tiny_model_dir

    save_tiny_model_dir(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()  # only config.json is read
    main(["plan", "--model", str(tmp_path / "m"), "--gpu-memory-gib", "2", "--json"])  # 1.5 GiB of it the overhead
    plain = json.loads(capsys.readouterr().out.splitlines()[-1])
    main(["plan", "--model", str(tmp_path / "m"), "--add", "bridge", "--gpu-memory-gib", "2", "--json"])
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
        ([], "give one of --model and --preset"),  # the model first, then the GPU's memory
        (["--preset", "ds-qwen-7b", "--world-size", "8", "--fsdp", "--gpu-memory-gib", "80"],
         "--steps-per-rollout 8 (its default) mini-batches need at least one Bridge group each, but a rank holds 1 "
         "prompts x 2 groups = 2: expected at least --prompts-per-step 32 (over 8 processes), or at most "
         "--steps-per-rollout 2"),  # fmt: skip
        (["--preset", "ds-qwen-7b", "--fsdp", "--gpu-memory-gib", "80"], "--fsdp with --world-size 1: FSDP shards "
         "the model over several processes: expected --world-size 2 or more, or no --fsdp"),  # fmt: skip
        (["--preset", "ds-qwen-7b", "--max-batch-tokens", "2000", "--gpu-memory-gib", "80"],
         "--max-batch-tokens 2000 cannot hold one Bridge group of --width 4 (its default) rows of --max-new-tokens "
         "512 (its default) tokens and a prompt: expected at least 2052 (4 x (512 + 1))"),  # fmt: skip
        (["--preset", "ds-qwen-7b", "--eval-width", "8", "--eval-n", "8", "--max-batch-tokens", "4000",
          "--gpu-memory-gib", "80"],
         "cannot hold one Bridge group of --eval-width 8 rows of --eval-max-new-tokens 512 tokens"),
        (["--preset", "ds-qwen-7b", "--max-batch-tokens", "9000", "--prompt-tokens", "3000",
          "--gpu-memory-gib", "80"],
         "rollouts: max_batch_tokens=9000 holds 2 rows of 3512 tokens, less than one Bridge group of 4: expected at "
         "least 14048"),  # fmt: skip
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
    assert plan_fit.device_memory_gib() == 80


def test_rl_on_cuda_prints_the_plan_and_refuses_a_run_that_cannot_fit(monkeypatch, capsys):
    from test_rl import CFG, TASK, TOK, policy

    from bridgelm.launch import plan_or_refuse, rl_setup
    from bridgelm.errors import UserError

    model = policy()
    setup = lambda: rl_setup(model, TOK, TASK, CFG, "float32")  # noqa: E731
    plan_or_refuse("cpu", "rl", setup)  # not a GPU: nothing to plan
    assert capsys.readouterr().out == ""
    asked = []
    monkeypatch.setattr(plan_fit, "device_memory_gib", lambda device: asked.append(device) or 80.0)
    plan_or_refuse("cuda:3", "rl", setup)
    out = capsys.readouterr().out
    assert asked == ["cuda:3"] and "bridgelm rl: memory per GPU" in out and "of 80 (fits)" in out
    assert "x 10 tokens" in out  # the longest prompt ("5+3=": 4 tokens) + 6 new tokens
    monkeypatch.setattr(plan_fit, "device_memory_gib", lambda device: 1e-6)
    refused = r"needs about 1.5 GiB per GPU \(\w+ phase: weights 0.0, .*; overhead 1.5\), .*a GPU has"
    with pytest.raises(UserError, match=refused):
        plan_or_refuse("cuda:0", "rl", setup)


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
    bf16 = dataclasses.replace(SFTConfig().optim, bf16=True)
    cfg = SFTConfig(optim=bf16, batch_groups=8, micro_batch_groups=2, max_width=4, max_length=2048)
    rows = plan.SFTSetup(shape_of(model), cfg, world=8, dtype="float32").rows()
    m = 1 * 4  # a rank's share of 8 groups over 8 GPUs is one group (micro_batch_groups 2 bounded by it), 4 rows
    buffers = 2 * (2**26 // V) * V * 4  # token_logprobs' two float32 chunk buffers
    kvd = SHAPES["ds-qwen-7b"][4] * 128
    # bf16 activations of every layer (Bridge blocks of 4 x 128) and the final norm; head input and bf16 logits
    acts = m * 2048 * (n * layer_bytes(h, i, kvd, 4 * 128) + norm(h)) + m * 2048 * (2 * h + 2 * V + 12) + buffers
    want = {"weights": P * 4, "gradients": B * 4, "optimiser": 2 * B * 4, "activations": acts, "start-up": P * 4}
    peak = P * 4 + 2 * B * 4 + B * 4 + acts
    want["overhead"] = 1.5 * GIB + 0.05 * peak
    assert rows == pytest.approx({name: want.get(name, 0) for name in [*plan.ROWS, "overhead"]}, rel=1e-12)
    assert plan.per_gpu(rows) == pytest.approx(peak + want["overhead"], rel=1e-12)
    text = plan_fit.table(plan.SFTSetup(shape_of(model), cfg, 8, "float32"), rows, 80)
    assert "micro-batches of 4 rows x 2048 tokens" in text and "(205.62M trained: the blocks)" in text


def test_sft_refuses_a_run_that_cannot_fit_before_training(tmp_path, monkeypatch, capsys):
    from conftest import save_tiny_model_dir
    from test_sft import write_warmup

    save_tiny_model_dir(tmp_path / "m")
    args = ["sft", "--model", str(tmp_path / "m"), "--data", str(write_warmup(tmp_path / "w.jsonl"))]
    capsys.readouterr()  # what saving the model printed
    monkeypatch.setattr(plan_fit, "device_memory_gib", lambda device: 1e-6)  # a GPU of 1 KiB
    with pytest.raises(SystemExit) as err:
        main([*args, "--out", str(tmp_path / "sft")])
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("bridgelm sft")]
    assert err.value.code == 2 and len(said) == 1  # one line (besides transformers' loading bar)
    message = said[0]
    head = r"bridgelm sft: error: this run needs about \d+\.\d GiB per GPU \(update phase: weights \d+\.\d, "
    assert re.match(head + r"gradients \d+\.\d, optimiser .* activations \d+\.\d; overhead \d+\.\d\)", message)
    assert "more than the 0.0 GiB a GPU has: lower --max-length or --micro-batch-groups" in message
    assert not (tmp_path / "sft" / "metrics.jsonl").exists()  # refused before any training
    monkeypatch.setattr(plan_fit, "device_memory_gib", lambda device: 80.0)
    main([*args, "--out", str(tmp_path / "sft2"), "--epochs", "1"])
    out = capsys.readouterr().out
    assert "bridgelm sft: memory per GPU (bridgelm plan)" in out and "of 80 (fits)" in out
    assert (tmp_path / "sft2" / "blocks.safetensors").is_file()


def test_plan_recommends_the_bound_that_fills_one_wave_a_rank(capsys):
    """The paper's 7B setting: a rank's 8 prompts x 8 rollouts are 64 rows, which the default bound (262144 tokens)
    cuts into a wave of 56 and a tail of 8; the plan recommends 64 x 4608 = 294912 tokens, one wave, and the rl
    command with it, whose own plan fits."""
    main(["plan", "--preset", "ds-qwen-7b", *ARGS.split(), "--gpu-memory-gib", "80", "--json"])
    out = capsys.readouterr().out.splitlines()
    got = json.loads(out[-1])["recommended"]
    assert got["waves"] == 1 and got["rows"] == 64 and got["max_batch_tokens"] == 64 * 4608
    assert "one wave a rank: 64 rows x 4608 tokens, --max-batch-tokens 294912" in "\n".join(out)
    command = got["command"].split()
    assert command[:6] == ["torchrun", "--nproc_per_node", "8", "-m", "bridgelm", "rl"]
    assert "--max-batch-tokens 294912" in got["command"] and f"recommended: {got['command']}" in out
    assert command[6:10] == ["--model", "MODEL", "--device", "cuda"]  # rl's default device is the CPU
    again = [w for w in command[10:] if w not in ("--task", "TASK", "--out", "OUT")]
    main(["plan", "--preset", "ds-qwen-7b", "--world-size", "8", "--prompt-tokens", "512", *again,
          "--gpu-memory-gib", "80", "--json"])  # fmt: skip
    planned = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert planned["fits"] and planned["per_gpu_gib"] == pytest.approx(got["per_gpu_gib"], rel=1e-12)
    assert "waves" not in planned["recommended"] or planned["recommended"]["rows"] == 64


def test_plan_recommends_bf16_rollouts_and_equal_waves_when_one_does_not_fit(capsys):
    """One GPU sampling from its fp32 policy: the command adds --rollout-dtype bfloat16; when a rank's whole batch
    does not fit, the fewest waves of whole prompts that fit."""
    args = ["plan", "--preset", "ds-qwen-1.5b", "--prompts-per-step", "8", "--rollouts", "8", "--max-new-tokens",
            "4096", "--beta", "0", "--bf16", "--gradient-checkpointing", "--micro-batch-groups", "1",
            "--json"]  # fmt: skip
    main([*args, "--gpu-memory-gib", "80"])
    one = json.loads(capsys.readouterr().out.splitlines()[-1])["recommended"]
    assert one["waves"] == 1 and one["rows"] == 64 and one["command"].startswith("bridgelm rl --model MODEL")
    assert "--rollout-dtype bfloat16" in one["command"] and "--max-batch-tokens 294912" in one["command"]
    from bridgelm.params import meta_model
    from bridgelm.train.optim import OptimConfig
    from bridgelm.train.rl_config import RLConfig

    optim = OptimConfig(bf16=True, gradient_checkpointing=True)
    cfg = RLConfig(prompts_per_step=8, beta=0, micro_batch_groups=1, optim=optim)
    cfg.rollout.max_new_tokens = 4096
    setup = plan.Setup(shape_of(meta_model(preset="ds-qwen-1.5b")), cfg, 1, "float32", 512)
    whole = plan_fit.filled_waves(setup, 1e9)
    assert whole.waves == 1 and whole.peak_gib == pytest.approx(one["per_gpu_gib"], rel=1e-12)
    # 16 prompts and only blocks trained (the rollout phase the largest), a GPU just short of one wave's peak: two
    # waves of 8 prompts x 8 rollouts
    cfg.freeze_base, cfg.prompts_per_step = True, 16
    whole = plan_fit.filled_waves(setup, 1e9)
    half = plan_fit.filled_waves(setup, whole.peak_gib - 1e-6)
    assert (whole.waves, whole.rows) == (1, 128)
    assert (half.waves, half.rows, half.setup.cfg.rollout.max_batch_tokens) == (2, 64, 64 * 4608)
    assert half.setup.cfg.rollout.max_batch_sequences == 64 and half.peak_gib < whole.peak_gib
    assert plan_fit.filled_waves(setup, 1.0) is None


def test_validation_rows_follow_eval_limit_and_the_rollouts_bounds(capsys):
    """Validation: a rank's share of --eval-limit problems x --eval-n rows, of prompt + --eval-max-new-tokens tokens,
    under the rollouts' batch bounds; sampled from the bf16 copy when there is one, else gathered as the rollouts."""
    V, h, i, n, kv = SHAPES["ds-qwen-1.5b"]
    base = ["plan", "--preset", "ds-qwen-1.5b", "--world-size", "2", "--fsdp", "--gpu-memory-gib", "80", "--json"]
    main([*base, "--eval-limit", "5", "--eval-n", "8", "--eval-width", "4", "--eval-max-new-tokens", "1024"])
    rows = json.loads(capsys.readouterr().out.splitlines()[-1])["rows_gib"]
    P = PUBLISHED["ds-qwen-1.5b"]
    assert rows["validation model"] == pytest.approx(P * 4 / 2 / GIB)  # fp32 policy gathered: no bf16 copy
    assert rows["validation KV cache"] == pytest.approx(n * 2 * kv * 128 * 24 * (512 + 1024) * 4 / GIB)  # 3 x 8 rows
    main([*base, "--eval-max-new-tokens", "1024", "--max-batch-tokens", "20000", "--rollout-dtype", "bfloat16"])
    rows = json.loads(capsys.readouterr().out.splitlines()[-1])["rows_gib"]
    assert rows["validation model"] == 0  # the bf16 copy samples
    # 20000 // 1536 = 13 rows, 12 in whole groups; the compiled step's slab: the bucket 1536 and a spare slot
    assert rows["validation KV cache"] == pytest.approx(n * 2 * kv * 128 * 12 * 1537 * 2 / GIB)


def test_rl_refuses_a_world_size_that_does_not_divide_before_the_model_loads(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SystemExit) as err:
        main(["rl", "--model", str(tmp_path / "no-such-model"), "--task", "gsm8k", "--out", str(tmp_path / "o")])
    said = capsys.readouterr().err.strip().splitlines()
    assert err.value.code == 2 and len(said) == 1
    assert "--prompts-per-step 8 must be divisible by the 3 processes" in said[0]  # not the missing model folder


def test_recommended_command_names_block_heads_only_when_given(capsys):
    """--add bridge without --num-heads: the recommended rl command adds the default heads too (no "--num-heads
    None", which rl would refuse); with --num-heads 8 it says so."""
    base = ["plan", "--preset", "ds-qwen-1.5b", "--add", "bridge", *ARGS.split(), "--gpu-memory-gib", "80", "--json"]
    main(base)
    command = json.loads(capsys.readouterr().out.splitlines()[-1])["recommended"]["command"]
    assert "--add bridge" in command and "--num-heads" not in command
    main([*base, "--num-heads", "8"])
    assert "--add bridge --num-heads 8" in json.loads(capsys.readouterr().out.splitlines()[-1])["recommended"]["command"]


_GEMMA4 = {"model_type": "gemma4_text", "head_dim": 16, "global_head_dim": 32, "sliding_window": 8,
           "vocab_size_per_layer_input": 97, "hidden_size_per_layer_input": 8}


@pytest.mark.parametrize("settings", [
    {"model_type": "llama"},
    {**_GEMMA4},
    {**_GEMMA4, "num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2,
     "num_kv_shared_layers": 2},
    {**_GEMMA4, "attention_k_eq_v": True, "num_global_key_value_heads": 1},  # per-layer key/value heads too
])
def test_the_cache_width_is_what_transformers_cache_keeps_a_token(settings):
    """Key and value elements a token keeps, summed over layers, against transformers' own cache after a prompt:
    Gemma 4's full-attention layers keep another head dim, and its last layers read earlier layers' caches (the plan
    counted every layer at the top-level head dim)."""
    import transformers

    settings = dict(settings)
    kind = settings.pop("model_type")
    if kind not in transformers.models.auto.configuration_auto.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {kind}")
    config = transformers.AutoConfig.for_model(kind, vocab_size=97, hidden_size=64, intermediate_size=128,
                                               num_attention_heads=4, num_key_value_heads=2,
                                               **{"num_hidden_layers": 2, **settings})
    if kind == "gemma4_text" and not getattr(config, "is_heterogeneous", False):
        pytest.skip(f"transformers {transformers.__version__} keeps Gemma 4's per-layer values outside "
                    "per_layer_config")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    cache = model(torch.tensor([[1, 5, 6]]), use_cache=True).past_key_values
    kept = [layer.keys for layer in cache.layers if getattr(layer, "keys", None) is not None and layer.keys.numel()]
    width = sum(2 * k.shape[1] * k.shape[3] for k in kept)
    assert shape_of(model).cache_width == width

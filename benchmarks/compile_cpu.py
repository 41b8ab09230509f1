"""The compiled decode step against the eager one on this CPU (inductor's C++ backend), Bridge blocks inside:

    python benchmarks/compile_cpu.py --threads 1 --json    # 16 and 128 rows, bf16 where the CPU has it

The benchmark's random 30M model (`bench_models.bench_model`) samples 2 and 16 prompts x 8 (plain, and Bridge at width
8) with `compile=False` (packed oneDNN linears, the CPU default) and `compile=True`, no EOS, so every call decodes
`--new-tokens` steps. One untimed call of each at the timed shape first: its excess over the median is the compile
time, printed apart. Then `--repeats` interleaved rounds; printed per (rows, model): tok/s of each and
`compiled_over_eager` as median [min, max] over the rounds. `bridgelm.engine.compile_wins` decides the default
from such a run (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_models import bench_model, timed, with_random_bridge  # noqa: E402
from gpu_rows import ragged_prompts  # noqa: E402
from vllm_compare import spread  # noqa: E402

from bridgelm.engine import SamplingConfig, generate_ids  # noqa: E402
from bridgelm.hardware import bf16_by_flags  # noqa: E402


def sample(model, prompts, width: int, new_tokens: int, compile: bool) -> int:
    cfg = SamplingConfig(n=8, width=width, max_new_tokens=new_tokens, temperature=0.6, top_p=0.95, seed=1,
                         compile=compile)
    out = generate_ids(model, prompts, cfg, eos_token_ids=[], pad_token_id=0)
    return sum(len(s.token_ids) for r in out for s in r)


def measure(models: dict, rows: int, args) -> dict:
    """Interleaved rounds of eager and compiled, plain and Bridge, at `rows` rows."""
    prompts = ragged_prompts(rows // 8, models["plain"].config.vocab_size)
    runs = {
        (name, mode): (lambda m=model, w=(8 if name == "bridge" else 1), c=(mode == "compiled"):
                       sample(m, prompts, w, args.new_tokens, c))
        for name, model in models.items() for mode in ("eager", "compiled")
    }
    first = {key: timed(fn) for key, fn in runs.items()}
    rounds = {key: [] for key in runs}
    keys = list(runs)
    for r in range(args.repeats):
        for key in keys[r % len(keys):] + keys[: r % len(keys)]:
            rounds[key].append(timed(runs[key]))
    out = {"rows": rows}
    for name in models:
        eager = [x["tok_per_s"] for x in rounds[name, "eager"]]
        compiled = [x["tok_per_s"] for x in rounds[name, "compiled"]]
        median_s = statistics.median(x["seconds"] for x in rounds[name, "compiled"])
        out[name] = {
            "eager_tok_per_s": spread(eager),
            "compiled_tok_per_s": spread(compiled),
            "compiled_over_eager": spread([c / e for c, e in zip(compiled, eager)]),
            "compile_seconds": round(max(first[name, "compiled"]["seconds"] - median_s, 0.0), 1),
        }
        q = out[name]["compiled_over_eager"]
        print(f"  {rows} rows, {name}: eager {out[name]['eager_tok_per_s']['median']} tok/s, compiled "
              f"{out[name]['compiled_tok_per_s']['median']} tok/s, compiled/eager {q['median']} [{q['min']}, "
              f"{q['max']}], compile {out[name]['compile_seconds']} s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="16,128", help="rows decoded together (multiples of 8), comma-separated")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None, help="default: bf16 where the CPU has it")
    ap.add_argument("--json", action="store_true", help="print the results as JSON at the end")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",") if r.strip()]
    if not rows or any(r < 8 or r % 8 for r in rows) or args.new_tokens < 1 or args.repeats < 1 or args.threads < 1:
        ap.error(f"--rows {args.rows!r} (multiples of 8), --new-tokens, --repeats, --threads: expected positive")
    torch.set_num_threads(args.threads)
    dtype_name = args.dtype or ("bfloat16" if bf16_by_flags() else "float32")
    dtype = getattr(torch, dtype_name)
    models = {"plain": bench_model(dtype), "bridge": with_random_bridge(bench_model(dtype))}
    print(f"compile_cpu: {dtype_name}, {args.threads} thread(s), {args.new_tokens} new tokens, rows {rows}", flush=True)
    results = {"dtype": dtype_name, "threads": args.threads, "new_tokens": args.new_tokens, "torch": torch.__version__,
               "runs": [measure(models, r, args) for r in rows]}
    if args.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

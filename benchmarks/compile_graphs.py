"""How many graphs the compiled decode step makes, and what the first call costs against the second:

    python benchmarks/compile_graphs.py --layers 28 --new-tokens 128    # the 1.5B shape's depth, hidden size 64

A model of the paper's 1.5B shape (its depth; hidden size 64 and a small vocabulary unless --full-width) with random
Bridge blocks samples 16 prompts x 4 (width 4) twice with `compile=True` and no EOS; printed: each call's seconds
and dynamo's graph and recompile counters. The first call holds the compiles; the second, none. Inductor's time per
graph grows with the depth, not the width, so the narrow model shows the compile cost of the real one (docs/
benchmarks.md, "The first GPU run").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_models import shape_model, with_random_bridge  # noqa: E402
from gpu_rows import TOY, ragged_prompts  # noqa: E402

from bridgelm.engine import SamplingConfig, generate_ids  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--full-width", action="store_true", help="the 1.5B shape's own widths (slow on a CPU)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    args = ap.parse_args()
    if args.layers < 1 or args.new_tokens < 1:
        ap.error(f"--layers {args.layers} and --new-tokens {args.new_tokens}: expected positive integers")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    overrides = {} if args.full_width else dict(TOY)
    model = with_random_bridge(shape_model("ds-qwen-1.5b", dtype, device=args.device,
                                           **{**overrides, "num_hidden_layers": args.layers}))
    prompts = ragged_prompts(16, model.config.vocab_size)
    cfg = SamplingConfig(n=4, width=4, max_new_tokens=args.new_tokens, temperature=0.6, top_p=0.95, seed=1,
                         compile=True)
    counters = torch._dynamo.utils.counters
    for call in ("first", "second"):
        start = time.perf_counter()
        generate_ids(model, prompts, cfg, eos_token_ids=[], pad_token_id=0)
        if args.device == "cuda":
            torch.cuda.synchronize()
        print(json.dumps({"call": call, "seconds": round(time.perf_counter() - start, 2),
                          "graphs": counters["stats"]["unique_graphs"],
                          "recompiles": sum(counters["recompiles"].values())}), flush=True)


if __name__ == "__main__":
    main()

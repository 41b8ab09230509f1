"""The engine with each prompt's keys and values held once (SamplingConfig.share_prompts, the default) against the
engine copying them to every sample, in one run: tok/s and peak memory, plain and Bridge, interleaved repeats.

SmolLM2-135M-Instruct in bf16 on GSM8K questions in its chat template, `--questions` of them joined into each
prompt (1: ~110-token prompts; 6: ~500, the length of a few-shot prompt). EOS is off: every sample makes
--new-tokens. The ratios are taken within a repeat (shared / copies); peak memory is the resident memory above
the level at the call's start (the allocator keeps freed memory: a later call may show less).

    python benchmarks/shared_prompt.py --threads 2 --questions 6 --new-tokens 32 --json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from bench_models import gsm8k_questions, ratio_range, timed, with_random_bridge  # noqa: E402

from bridgelm.engine import SamplingConfig, encode_prompts, generate_ids  # noqa: E402
from bridgelm.engine.batch import share_pays  # noqa: E402
from bridgelm.engine.waves import plan_waves  # noqa: E402
from bridgelm.pretrained import load_smollm2  # noqa: E402


def run(model, prompts, cfg) -> int:
    return sum(len(s.token_ids) for r in generate_ids(model, prompts, cfg, [], 0) for s in r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--questions", type=int, default=1, help="GSM8K questions joined into each prompt")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_smollm2(torch.bfloat16)
    engines = {"plain": model, "bridge": with_random_bridge(copy.deepcopy(model))}
    qs, k = gsm8k_questions(args.prompts * args.questions), args.questions
    prompts = encode_prompts(tok, ["\n\n".join(qs[i * k : (i + 1) * k]) for i in range(args.prompts)], chat=True)
    cfg = SamplingConfig(n=args.n, width=args.width, max_new_tokens=args.new_tokens, temperature=1.0, top_p=1.0)
    layouts = {"shared": replace(cfg, share_prompts=True), "copies": replace(cfg, share_prompts=False)}
    for m in engines.values():  # warm-up: first-call allocations and oneDNN's kernels
        run(m, prompts[:2], replace(cfg, max_new_tokens=4))
    runs: dict[str, list[dict]] = {}
    for rep in range(args.repeats):
        for name, m in engines.items():
            order = list(layouts.items())[:: 1 if rep % 2 == 0 else -1]  # alternate which layout goes first
            for layout, c in order:
                runs.setdefault(f"{name}_{layout}", []).append(timed(lambda: run(m, prompts, c)))
    out = {"threads": args.threads, "rows": args.prompts * args.n, "prompt_tokens": sorted(map(len, prompts)),
           "default": "shared" if share_pays(plan_waves([len(p) for p in prompts], cfg)[0]) else "copies"}
    for key, series in runs.items():
        out[key] = {"tok_per_s": round(statistics.median(r["tok_per_s"] for r in series), 1), "runs": series}
    for name in engines:
        out[f"{name}_shared_over_copies"] = ratio_range(runs[f"{name}_shared"], runs[f"{name}_copies"])
        peaks = {layout: max(r["peak_mb"] for r in runs[f"{name}_{layout}"]) for layout in layouts}
        out[f"{name}_peak_mb"] = peaks
        print(f"{name}: tok/s shared {out[f'{name}_shared']['tok_per_s']}, copies {out[f'{name}_copies']['tok_per_s']}"
              f"; shared / copies min, median, max {out[f'{name}_shared_over_copies']}; peak MB {peaks}", flush=True)
    print(f"{out['rows']} rows, prompts of {out['prompt_tokens'][0]}-{out['prompt_tokens'][-1]} tokens, "
          f"{args.new_tokens} new tokens, {args.threads} threads, {args.repeats} repeats; the default here: "
          f"{out['default']} (bridgelm.engine.batch.share_pays)")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()

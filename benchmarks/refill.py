"""The engine refilling finished groups' rows with waiting prompts (SamplingConfig.refill=True) against waves,
in one run: tok/s and the share of decoded rows that were live, plain and Bridge, interleaved repeats.

SmolLM2-135M-Instruct in bf16 on GSM8K questions in its chat template, sampled at the paper's settings (temperature
0.6, top-p 0.95) with EOS on, so that samples end at their own lengths; more rows than the batch holds
(--prompts x --n against --rows). `live_fraction` = generated tokens / rows decoded over all steps: what a wave
loses to rows that finished while their wave runs on. The ratios are taken within a repeat (refill / waves).

    python benchmarks/refill.py --threads 2 --prompts 16 --n 8 --rows 32 --new-tokens 256 --json
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

from bridgelm.engine import SamplingConfig, encode_prompts, eos_ids, generate_ids, step  # noqa: E402
from bridgelm.pretrained import load_smollm2  # noqa: E402


class RowCounter:
    """Counts the rows of every decode step (wraps `step.decode_step`, which each step calls once)."""

    def __init__(self):
        self.rows = 0
        self.real = step.decode_step

    def __enter__(self):
        def counted(model, cache, tokens, *args):
            self.rows += tokens.shape[0]
            return self.real(model, cache, tokens, *args)

        step.decode_step = counted
        return self

    def __exit__(self, *exc):
        step.decode_step = self.real


def run(model, prompts, cfg, eos, pad, live: list) -> int:
    with RowCounter() as counter:
        tokens = sum(len(s.token_ids) for r in generate_ids(model, prompts, cfg, eos, pad) for s in r)
    live.append(round(tokens / max(counter.rows, 1), 3))
    return tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--width", type=int, default=8, help="Bridge group width (the plain engine: 1)")
    ap.add_argument("--rows", type=int, default=32, help="max_batch_sequences: rows decoded together")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engines", default="plain,bridge")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_smollm2(torch.bfloat16)
    engines = {"plain": (model, 1), "bridge": (with_random_bridge(copy.deepcopy(model)), args.width)}
    engines = {k: engines[k] for k in args.engines.split(",")}
    prompts = encode_prompts(tok, gsm8k_questions(args.prompts), chat=True)
    eos = eos_ids(model, tok)
    cfg = SamplingConfig(n=args.n, max_new_tokens=args.new_tokens, max_batch_sequences=args.rows, seed=0)
    modes = {"refill": replace(cfg, refill=True), "waves": cfg}
    for m, w in engines.values():  # warm-up: first-call allocations and oneDNN's kernels
        generate_ids(m, prompts[:2], replace(cfg, width=w, max_new_tokens=4), eos, tok.pad_token_id or 0)
    runs: dict[str, list[dict]] = {}
    for rep in range(args.repeats):
        for name, (m, w) in engines.items():
            for mode, c in list(modes.items())[:: 1 if rep % 2 == 0 else -1]:  # alternate which goes first
                live: list[float] = []
                r = timed(lambda: run(m, prompts, replace(c, width=w), eos, tok.pad_token_id or 0, live))
                runs.setdefault(f"{name}_{mode}", []).append({**r, "live_fraction": live[0]})
    out = {"threads": args.threads, "rows": args.rows, "samples": args.prompts * args.n, "new_tokens": args.new_tokens}
    for key, series in runs.items():
        out[key] = {"tok_per_s": round(statistics.median(r["tok_per_s"] for r in series), 1), "runs": series}
    for name in engines:
        out[f"{name}_refill_over_waves"] = ratio_range(runs[f"{name}_refill"], runs[f"{name}_waves"])
        live = {mode: runs[f"{name}_{mode}"][0]["live_fraction"] for mode in modes}
        print(f"{name}: tok/s refill {out[f'{name}_refill']['tok_per_s']}, waves {out[f'{name}_waves']['tok_per_s']}; "
              f"refill / waves min, median, max {out[f'{name}_refill_over_waves']}; live fraction {live}", flush=True)
    print(f"{out['samples']} samples of {len(prompts)} GSM8K prompts, {args.rows} rows at a time, up to "
          f"{args.new_tokens} new tokens, {args.threads} threads, {args.repeats} repeats")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()

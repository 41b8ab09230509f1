"""Attention on this machine: transformers' sdpa (PyTorch's fused kernel) against bridgelm's two-matmul attention.

Shapes are those the engine and the trainers meet: decode (one query per row against a cache of L positions, the
query heads of a key/value head packed as transformers does) and training rows (S queries over S keys, causal with
right padding; forward and backward). Each pair is timed interleaved, 5 repeats, median time per call and the ratio
sdpa / matmul (> 1: the matmul path is faster). Use it to check `bridgelm.attention.MAX_KEYS` on a new machine.

    python benchmarks/attention.py            # quiet machine, ~1 min on 2 CPU cores
    python benchmarks/attention.py --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from bridgelm.attention import matmul_attention
from bridgelm.packed import half_instructions

DECODE = [  # (rows B, heads H, KV heads, head dim D, cache length L)
    (64, 16, 4, 32, 128),  # benchmarks/generate.py's random 30M model
    (32, 9, 3, 64, 300),  # SmolLM2-135M
    (128, 4, 2, 48, 70),  # the demo's model
    (256, 32, 8, 128, 1024),  # an 8B model's shape
]
TRAIN = [  # (rows B, heads H, KV heads, head dim D, sequence length S)
    (64, 4, 2, 48, 64),  # the demo's RL micro-batch
    (32, 9, 3, 64, 128),
    (16, 9, 3, 64, 192),
    (16, 9, 3, 64, 256),
    (8, 16, 4, 64, 512),
    (4, 16, 4, 64, 1024),
]


def _sdpa(q, k, v, mask, scale):
    rep = q.shape[1] // k.shape[1]
    if q.shape[2] == 1:  # transformers packs the query heads of a key/value head for one query
        B, H, _, D = q.shape
        out = F.scaled_dot_product_attention(q.reshape(B, H // rep, rep, D), k, v, attn_mask=mask, scale=scale)
        return out.reshape(B, H, 1, D)
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # transformers' repeat_kv when a mask is given
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _time(fn, calls: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def measure(shape, dtype, train: bool, repeats: int) -> dict:
    B, H, KVH, D, L = shape
    g = torch.Generator().manual_seed(0)
    S = L if train else 1
    q = torch.randn(B, H, S, D, generator=g, dtype=dtype, requires_grad=train)
    k = torch.randn(B, KVH, L, D, generator=g, dtype=dtype, requires_grad=train)
    v = torch.randn(B, KVH, L, D, generator=g, dtype=dtype, requires_grad=train)
    lengths = torch.randint(L // 2, L + 1, (B,), generator=g)
    keep = torch.arange(L)[None, :] < lengths[:, None]  # [B, L] right padding
    if train:
        keep[:, 0] = True
        mask = torch.ones(S, L, dtype=torch.bool).tril()[None, None] & keep[:, None, None, :]  # [B, 1, S, L]
    else:
        mask = keep[:, None, None, :]  # [B, 1, 1, L]
    scale = D**-0.5

    def run(fn):
        def call():
            out = fn(q, k, v, mask, scale)
            if train:
                out.float().square().mean().backward()
                q.grad = k.grad = v.grad = None

        return call

    sdpa = run(_sdpa)
    ours = run(lambda q, k, v, m, s: matmul_attention(q, k, v, m, s, causal=False))
    calls = 3 if train else 20
    pairs = []
    for i in range(repeats):
        order = (sdpa, ours) if i % 2 == 0 else (ours, sdpa)
        t = {fn: _time(fn, calls) for fn in order}
        pairs.append((t[sdpa], t[ours]))
    return {
        "shape": list(shape),
        "sdpa_ms": statistics.median(a for a, _ in pairs) * 1e3,
        "matmul_ms": statistics.median(b for _, b in pairs) * 1e3,
        "sdpa_over_matmul": statistics.median(a / b for a, b in pairs),
        "scores": B * H * S * L,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--dtypes",
        default=None,
        help="comma-separated (default: bfloat16,float32; float32 alone on a CPU without bf16)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args()
    if args.dtypes is None:
        args.dtypes = "bfloat16,float32" if half_instructions(torch.bfloat16) else "float32"
        if args.dtypes == "float32":
            print("this CPU has no bf16 instructions (bf16 matmuls ~100x slower than fp32): float32 only", flush=True)
    out = {}
    for dtype in [getattr(torch, d.strip()) for d in args.dtypes.split(",") if d.strip()]:
        name = str(dtype).removeprefix("torch.")
        for kind, shapes in (("decode", DECODE), ("train", TRAIN)):
            rows = out.setdefault(f"{kind}_{name}", [])
            for shape in shapes:
                r = measure(shape, dtype, kind == "train", args.repeats)
                rows.append(r)
                print(
                    f"{kind:6s} {name:8s} B,H,KVH,D,L={shape}: sdpa {r['sdpa_ms']:8.2f} ms, matmul "
                    f"{r['matmul_ms']:8.2f} ms, sdpa/matmul {r['sdpa_over_matmul']:.2f} (scores {r['scores']:,})",
                    flush=True,
                )
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()

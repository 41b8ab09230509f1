"""Attention on this machine: transformers' sdpa (PyTorch's fused kernel) against bridgelm's two-matmul attention.

Shapes are those the engine and the trainers meet: decode (one query per row against a cache of L positions, the
query heads of a key/value head packed as transformers does) and training rows (S queries over S keys, causal with
right padding; forward and backward). Each pair is timed interleaved, 5 repeats, median time per call and the ratio
sdpa / matmul (> 1: the matmul path is faster). Use it to check `bridgelm.attention.MAX_KEYS` on a new machine.

    python benchmarks/attention.py            # quiet machine, ~1 min on 2 CPU cores
    python benchmarks/attention.py --json
    python benchmarks/attention.py --decode-orders   # a decode step's scores as q k^T against k q^T (scores_of)

`--decode-orders` times the scores' matmul alone in both operand orders, over as many distinct caches as a model
has layers (keys read from memory, not from the CPU's caches, as a decode step meets them): `keys_first`'s check.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import torch
import torch.nn.functional as F

from bridgelm.attention import matmul_attention
from bridgelm.packed import half_instructions
from bridgelm.scores import scores_of

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


ORDERS = [  # (rows B, heads H, KV heads, head dim D, cache length L): SmolLM2 at 128 rows, and DECODE's last
    (128, 9, 3, 64, 16),
    (128, 9, 3, 64, 64),
    (128, 9, 3, 64, 256),
    (256, 32, 8, 128, 1024),
]
LAYERS = 30  # distinct caches per timing: more bytes than the CPU's caches hold


def measure_orders(shape, dtype, repeats: int) -> dict:
    """q k^T against k q^T (`scores_of` with keys first) for one decode step's scores, LAYERS caches in turn."""
    B, H, KVH, D, L = shape
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, KVH, H // KVH, D, generator=g, dtype=dtype)
    keys = [torch.randn(B, KVH, L, D, generator=g, dtype=dtype) for _ in range(LAYERS)]
    q_first = lambda k: torch.matmul(q, k.transpose(-1, -2)).float()  # noqa: E731
    same = torch.equal(q_first(keys[0]), scores_of(q, keys[0]))  # bit for bit (oneDNN's bf16 kernels: yes)
    layer = itertools.count()
    calls = {
        "q_first": lambda: q_first(keys[next(layer) % LAYERS]),
        "k_first": lambda: scores_of(q, keys[next(layer) % LAYERS]),
    }
    pairs = []
    for i in range(repeats):
        order = ("q_first", "k_first") if i % 2 == 0 else ("k_first", "q_first")
        t = {name: _time(calls[name], 3 * LAYERS) for name in order}
        pairs.append((t["q_first"], t["k_first"]))
    return {
        "shape": list(shape),
        "q_first_us": statistics.median(a for a, _ in pairs) * 1e6,
        "k_first_us": statistics.median(b for _, b in pairs) * 1e6,
        "q_first_over_k_first": statistics.median(a / b for a, b in pairs),
        "bit_equal": same,
    }


def orders(dtype, repeats: int) -> list[dict]:
    rows = []
    for shape in ORDERS:
        r = measure_orders(shape, dtype, repeats)
        rows.append(r)
        print(
            f"scores {str(dtype).removeprefix('torch.'):8s} B,H,KVH,D,L={shape}: q k^T {r['q_first_us']:8.0f} us, "
            f"k q^T {r['k_first_us']:8.0f} us, ratio {r['q_first_over_k_first']:.2f}, bit-equal {r['bit_equal']}",
            flush=True,
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--dtypes",
        default=None,
        help="comma-separated (default: bfloat16,float32; float32 alone on a CPU without bf16)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--decode-orders", action="store_true", help="only the decode scores' operand orders")
    args = ap.parse_args()
    if args.dtypes is None:
        args.dtypes = "bfloat16,float32" if half_instructions(torch.bfloat16) else "float32"
        if args.dtypes == "float32":
            print("this CPU has no bf16 instructions (bf16 matmuls ~100x slower than fp32): float32 only", flush=True)
    out = {}
    dtypes = [getattr(torch, d.strip()) for d in args.dtypes.split(",") if d.strip()]
    if args.decode_orders:
        out = {f"orders_{str(d).removeprefix('torch.')}": orders(d, args.repeats) for d in dtypes}
        if args.json:
            print(json.dumps(out))
        return
    for dtype in dtypes:
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

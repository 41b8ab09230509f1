"""Attention scores q k^T in the operand order that suits the device: the decoder's attention and the shared prompt's.

On CPU, oneDNN's batched bfloat16 matmul reorders its right operand into its own layout at every call. A decode
step multiplies a few queries per row (a key/value head's stacked query heads) with many keys, so q k^T reorders the
keys, the large operand, read from memory at every step; k q^T hands them over as they are and reorders the queries.
With oneDNN's kernels the values are the same bit for bit (`benchmarks/attention.py --decode-orders` says so on
each machine; the tests hold both orders to the float64 product); where it pays: `keys_first`.
"""

from __future__ import annotations

import torch

KEYS_FIRST_MIN = 48  # `keys_first`: keys per row from which k q^T pays, and 8 per query (measured, below)
HALF = (torch.bfloat16, torch.float16)  # the half-precision dtypes (bridgelm.attention reads them here too)


def keys_first(q: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether `scores_of` multiplies k q^T (keys as the left operand) instead of q k^T: on CPU in half precision,
    for at least KEYS_FIRST_MIN keys and 8 per query (a decode step's few stacked heads against its cache), where the
    keys' reorder costs more than the transposed copy of the scores. Measured (`benchmarks/attention.py
    --decode-orders`, 1 thread, keys not in the CPU's caches, bf16, 128 rows x 3 heads of 3 queries): q k^T / k q^T
    0.75 at 16 keys, 0.90 at 32, 1.14 at 48, 1.23-1.24 at 64 to 128; a prompt's 24 stacked queries: 0.90 at 150
    keys, 1.10 at 300. float32 (MKL) is slower keys first (0.59-0.80)."""
    L, M = key.shape[-2], q.shape[-2]
    return q.device.type == "cpu" and q.dtype in HALF and L >= max(KEYS_FIRST_MIN, 8 * M)


def scores_of(q: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """q [..., M, D] @ key[..., L, D]^T in float32 at least, contiguous: -> [..., M, L] (`keys_first` decides the
    order of the operands)."""
    if keys_first(q, key):
        scores = torch.matmul(key, q.transpose(-1, -2)).transpose(-1, -2)  # a view of [..., L, M]
    else:
        scores = torch.matmul(q, key.transpose(-1, -2))
    # a fresh contiguous tensor either way (the masking writes to it in place); `to` alone keeps a float32 view as is
    dtype = torch.promote_types(scores.dtype, torch.float32)
    return scores.to(dtype, memory_format=torch.contiguous_format).contiguous()

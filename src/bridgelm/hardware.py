"""This machine's measured matmul peak: the yardstick that reports and benchmarks state beside their times.

CPU speed varies from day to day (the same run can take 3x longer), so a time means little without the peak
measured in the same run: reports give both, and ratios against the peak are comparable across days.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from bridgelm import packed


def _best_seconds(fn, repeats: int, cuda: bool) -> float:
    """The shortest of `repeats` timed calls of `fn` (after one warm-up call), synchronising the GPU around each."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_kernels(a: torch.Tensor, b: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """The ways this machine multiplies a @ b, each a call that returns the product: ATen's matmul, and on CPU
    oneDNN's with b packed once (`bridgelm.packed`, for the dtypes it packs). On AMD CPUs ATen's float32 matmul goes
    to MKL, which runs at less than half of oneDNN's rate: the machine's peak is the faster of the two."""
    kernels = {"aten": lambda: a @ b}
    if a.device.type == "cpu" and a.dtype == b.dtype and a.dtype in packed.dtypes():
        w = packed.pack(b.t().contiguous(), a.shape[0])  # a linear computes a @ W^T: W = b^T
        kernels["onednn"] = lambda: packed.linear(a, w)
    return kernels


def _square(n: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)


def matmul_size(
    dtype: torch.dtype, n: int, repeats: int = 5, device="cpu", max_seconds: float | None = None, smallest: int = 128
) -> int:
    """The side of the square matmul that `matmul_flops` times: `n`, or, where `dtype` is so slow that its
    `repeats` + 1 calls of every kernel would take more than about `max_seconds`, the largest of `smallest`,
    2 x `smallest`, 4 x ... below n that fits (one call of each kernel at each size on the way, timed, predicts the
    next size's at 8x). bf16 on a CPU without bf16 instructions runs ~100x slower than fp32: its peak at n = 4096
    would take an hour there, at n = 1024 a dozen seconds."""
    if max_seconds is None or n <= smallest:
        return n
    m = smallest
    while m < n:
        a, b = _square(m, dtype, device)
        per_call = sum(_best_seconds(fn, 1, a.is_cuda) for fn in matmul_kernels(a, b).values())
        if per_call * min(n / m, 2) ** 3 * (repeats + 1) > max_seconds:
            return m
        m *= 2
    return n


def matmul_flops(
    dtype: torch.dtype = torch.float32, n: int = 1024, repeats: int = 5, device="cpu", max_seconds: float | None = None
) -> float:
    """FLOP/s of a square n x n matmul in `dtype`: the best of `repeats` timed runs (after one warm-up) of the
    fastest of `matmul_kernels`. With `max_seconds`, n shrinks where the dtype is slow (`matmul_size`)."""
    n = matmul_size(dtype, n, repeats, device, max_seconds)
    a, b = _square(n, dtype, device)
    seconds = min(_best_seconds(fn, repeats, a.is_cuda) for fn in matmul_kernels(a, b).values())
    return 2 * n**3 / seconds


def copy_bandwidth(device="cpu", mib: int = 1024, repeats: int = 5) -> float:
    """Bytes/s of a large tensor copy on `device`, counting bytes read plus bytes written (best of `repeats`)."""
    src = torch.randn(mib * 2**18, device=device)  # mib MiB of float32
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / _best_seconds(lambda: dst.copy_(src), repeats, src.is_cuda)


# bf16 matmuls slower than 1/SLOW_BF16 of fp32's: a CPU without bf16 instructions (an AVX2-only one reads ~0.006).
SLOW_BF16 = 4


def bf16_is_slow(bf16_flops: float, fp32_flops: float) -> bool:
    """Whether measured bf16 matmuls run so far below fp32's that bf16 work is a trap on this machine."""
    return bf16_flops < fp32_flops / SLOW_BF16


def matmul_peaks(n: int = 1024, max_seconds: float = 2.0) -> dict[str, float]:
    """{"fp32_tflops", "bf16_tflops"} of this machine, now: the fastest of `matmul_kernels` (a slow dtype's at a
    smaller n: `matmul_size`)."""
    return {
        "fp32_tflops": round(matmul_flops(torch.float32, n, max_seconds=max_seconds) / 1e12, 4),
        "bf16_tflops": round(matmul_flops(torch.bfloat16, n, max_seconds=max_seconds) / 1e12, 4),
    }

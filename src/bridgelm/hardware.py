"""This machine's measured matmul peak: the yardstick that reports and benchmarks state beside their times; and
the facts that choose a run's precision and threads (its CPU flags, its cores and their load).

CPU speed varies from day to day (the same run can take 3x longer), so a time means little without the peak
measured in the same run: reports give both, and ratios against the peak are comparable across days. For the same
reason a single timing does not choose bf16 where the CPU's flags say it has bf16 instructions (`bf16_choice`).
"""

from __future__ import annotations

import os
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


# The CPU flags of bf16 matmul instructions: AVX-512 BF16 and AMX-BF16 (x86), BF16 (Arm, /proc/cpuinfo "bf16").
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def cpu_flags() -> set[str] | None:
    """This CPU's feature flags: those cpuinfo reports to torch (`torch.cpu.get_capabilities`) and those of
    /proc/cpuinfo's flags/Features lines; None where neither says."""
    flags, known = set(), False
    try:
        flags |= {name for name, on in torch.cpu.get_capabilities().items() if on is True}
        known = True
    except (AttributeError, RuntimeError):  # an older torch, or cpuinfo could not read this CPU
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    flags |= set(value.split())
                    known = True
    except OSError:
        pass
    return flags if known else None


def bf16_by_flags() -> bool | None:
    """Whether this CPU has bf16 matmul instructions, by its flags (None: its flags are unknown)."""
    flags = cpu_flags()
    return None if flags is None else any(f in flags for f in BF16_FLAGS)


def bf16_choice(bf16_flops: float, fp32_flops: float, device="cpu") -> tuple[bool, str]:
    """Whether to run bf16 here, and why. A CPU's flags decide; the peaks measured in the run (FLOP/s) only confirm:
    one timing on a loaded machine can read bf16 at a tenth of its rate, and must not switch a CPU with bf16
    instructions to fp32 (it then warns). Where the flags are unknown, the measurement decides (`bf16_is_slow`); a
    CUDA device takes bf16 where torch says it supports it."""
    measured = f"bf16 matmul measured at {bf16_flops / 1e12:.4f} TFLOP/s against fp32's {fp32_flops / 1e12:.4f}"
    if torch.device(device).type == "cuda":
        ok = torch.cuda.is_bf16_supported()
        return ok, f"this GPU {'supports' if ok else 'does not support'} bf16 ({measured})"
    flags = bf16_by_flags()
    slow = bf16_is_slow(bf16_flops, fp32_flops)
    if flags is None:
        return not slow, f"this CPU's flags are unknown: by the measurement, {measured}"
    if not flags:
        return False, f"this CPU has no bf16 instructions (none of {', '.join(BF16_FLAGS)} in its flags; {measured})"
    if slow:
        return True, (
            f"this CPU has bf16 instructions (its flags), though {measured} (under 1/{SLOW_BF16}: a loaded machine?); "
            "bf16 kept"
        )
    return True, f"this CPU has bf16 instructions (its flags), confirmed: {measured}"


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup (v2) CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


MAX_THREADS = 4096  # torch.set_num_threads overflows a C int far above any machine's core count
_TORCH_DEFAULT_THREADS = torch.get_num_threads()  # torch's own default (physical cores), before anyone sets it


def default_threads() -> tuple[int, str]:
    """Torch threads that do not oversubscribe this machine, and why: OMP_NUM_THREADS where it is set (torchrun
    sets 1 per rank); else torch's default (physical cores), capped by the cores this process may use and by
    those the other processes leave idle (cores - the 1-minute load average, rounded; at least 1). On a loaded
    2-core machine a step took 10x longer with 2 threads than with 1 (issue 50): an OpenMP team waits at every op
    for a descheduled partner."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env), f"OMP_NUM_THREADS={env}"
    cores = min(_TORCH_DEFAULT_THREADS, usable_cores())
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    idle = max(1, min(cores, round(usable_cores() - load)))
    return idle, f"{cores} cores, 1-minute load {load:.1f}"

"""The machine's matmul peak (bridgelm.hardware): every kernel it times computes the product."""

import pytest
import torch

from bridgelm import hardware, packed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_timed_kernel_computes_the_product(dtype):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 96, generator=g).to(dtype), torch.randn(96, 80, generator=g).to(dtype)
    kernels = hardware.matmul_kernels(a, b)
    assert set(kernels) == ({"aten", "onednn"} if dtype in packed.dtypes() else {"aten"})
    exact = a.double() @ b.double()
    # rounding of the result: float32 2^-24, bfloat16 2^-9 of its size (half an ulp), with room for the sum's order
    tol = (2**-20 if dtype == torch.float32 else 2**-7) * float(exact.abs().max())
    for name, fn in kernels.items():
        got = fn()
        assert got.shape == (64, 80) and got.dtype == dtype, name
        assert float((got.double() - exact).abs().max()) < tol, name
        if name == "onednn":
            got_onednn = got
    if "onednn" in kernels:
        b.mul_(2)
        assert torch.equal(kernels["onednn"](), got_onednn)  # it multiplies with the copy packed at the start


def test_the_peak_is_the_fastest_kernel(monkeypatch):
    """matmul_flops times every kernel and keeps the fastest."""
    timed = []
    seconds = iter([2.0, 1.0])
    monkeypatch.setattr(hardware, "matmul_kernels", lambda a, b: {"slow": lambda: a @ b, "fast": lambda: a @ b})
    monkeypatch.setattr(hardware, "_best_seconds", lambda fn, repeats, cuda: timed.append(fn) or next(seconds))
    assert hardware.matmul_flops(torch.float32, n=8) == 2 * 8**3 / 1.0
    assert len(timed) == 2


def test_bf16_is_slow_only_far_below_fp32():
    from bridgelm.hardware import bf16_is_slow

    assert bf16_is_slow(0.9e9, 160e9)  # an AVX2-only CPU (2026-11-25)
    assert not bf16_is_slow(0.45e12, 0.22e12) and not bf16_is_slow(0.1e12, 0.2e12)  # fast bf16; merely slower


def test_a_slow_dtype_peak_is_timed_at_a_smaller_size(monkeypatch):
    """matmul_size shrinks the matmul where its calls would pass max_seconds (bf16 on an AVX2-only CPU), not
    elsewhere; matmul_flops times at that size."""
    sides = []
    rate = {"flops": 1e9}  # the fake kernel's speed
    monkeypatch.setattr(hardware, "matmul_kernels", lambda a, b: {"k": lambda: sides.append(a.shape[0])})
    monkeypatch.setattr(hardware, "_best_seconds", lambda fn, repeats, cuda: fn() or 2 * sides[-1] ** 3 / rate["flops"])
    # 1 GFLOP/s: 6 calls at n = 512 take 1.6 s, at n = 1024 12.9 s
    assert hardware.matmul_size(torch.float32, 1024, max_seconds=2.0) == 512
    assert hardware.matmul_size(torch.float32, 1024, max_seconds=20.0) == 1024
    assert hardware.matmul_size(torch.float32, 1024) == 1024  # no limit asked
    sides.clear()
    assert hardware.matmul_flops(torch.float32, 1024, max_seconds=2.0) == pytest.approx(1e9)
    assert sides[-1] == 512
    rate["flops"] = 1e11  # fast: the full size
    assert hardware.matmul_size(torch.float32, 1024, max_seconds=2.0) == 1024


def test_bf16_is_chosen_by_the_flags_and_a_slow_timing_does_not_switch_it(monkeypatch):
    """A CPU with bf16 instructions keeps bf16 when a timing on a loaded machine reads it at a tenth of fp32 (issue
    50: 0.026 against 0.2 TFLOP/s), saying so; one without them runs fp32 however the timing reads; unknown flags
    leave the choice to the measurement."""
    monkeypatch.setattr(hardware, "bf16_by_flags", lambda: True)
    use, why = hardware.bf16_choice(0.026e12, 0.2e12)
    assert use and "loaded" in why and "0.0260" in why
    assert hardware.bf16_choice(0.4e12, 0.2e12) == (True, hardware.bf16_choice(0.4e12, 0.2e12)[1])
    assert "confirmed" in hardware.bf16_choice(0.4e12, 0.2e12)[1]
    monkeypatch.setattr(hardware, "bf16_by_flags", lambda: False)
    use, why = hardware.bf16_choice(0.4e12, 0.2e12)
    assert not use and "no bf16 instructions" in why
    monkeypatch.setattr(hardware, "bf16_by_flags", lambda: None)
    assert not hardware.bf16_choice(0.026e12, 0.2e12)[0] and hardware.bf16_choice(0.4e12, 0.2e12)[0]


def test_the_bf16_flags_are_the_cpus():
    """bf16_by_flags reads what /proc/cpuinfo says (where there is one)."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    words = set(" ".join(line.split(":", 1)[1] for line in text.splitlines() if line.startswith("flags")).split())
    if words:
        assert hardware.bf16_by_flags() == bool(words & {"avx512_bf16", "amx_bf16"})


def test_default_threads_leave_busy_cores_alone(monkeypatch):
    """The default thread count: the cores the other processes leave idle (at least 1, at most torch's default),
    OMP_NUM_THREADS where set."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(hardware, "usable_cores", lambda: 2)
    monkeypatch.setattr(hardware, "_TORCH_DEFAULT_THREADS", 2)
    for load, want in ((6.7, 1), (1.2, 1), (0.4, 2), (0.0, 2)):
        monkeypatch.setattr(hardware.os, "getloadavg", lambda load=load: (load, load, load))
        assert hardware.default_threads()[0] == want, load
    monkeypatch.setattr(hardware, "_TORCH_DEFAULT_THREADS", 1)  # torch's default (physical cores) caps it
    assert hardware.default_threads()[0] == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert hardware.default_threads() == (3, "OMP_NUM_THREADS=3")

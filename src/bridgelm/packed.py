"""Linear layers whose weights are packed once for oneDNN while the engine samples (CPU, float32 and bfloat16).

On CPU a bfloat16 `F.linear` hands its weight to oneDNN, which reorders it into its own blocked layout on every
call: a pass over the whole weight matrix that a decode step (a few dozen rows against every weight of the model)
pays again at each token. A float32 `F.linear` goes to ATen's BLAS (MKL), which on AMD CPUs runs at less than half
of oneDNN's rate. `packed_linears(model)` reorders each `nn.Linear` weight once, with the op that inductor's weight
freezing uses (`torch.ops.mkldnn._reorder_linear_weight`), and routes the module's forward to
`torch.ops.mkldnn._linear_pointwise` on the packed copy until the context exits.
- bfloat16: the kernel `F.linear` would run, so the same results bit for bit (tested, torch 2.13). torch 2.8's
  `F.linear` sums long rows in another order: about 1 output in 10^4 then differs by one bfloat16 rounding.
- float32: oneDNN's kernel instead of MKL's, so results equal to float32 rounding, not bit for bit (tested against
  float64).
The measured gains: docs/engine.md.

The packed copies are taken at entry, so weights changed between two contexts (an RL step) are packed afresh; the
model must not change its weights inside one. They cost a second copy of the linear weights while the context
lasts, so models above MAX_BYTES of linear weights are left alone.
"""

from __future__ import annotations

import contextlib
import platform
from functools import partial

import torch
from torch import nn

MAX_BYTES = 2 * 2**30  # pack at most this many bytes of linear weights (the packed copy doubles them)


_HALF_INSTRUCTIONS: dict[torch.dtype, bool] = {}  # a plain dict, not functools.cache: torch.compile reads it as a
# constant inside the decode step (it warns on an lru_cache-wrapped call and traces through it)


def half_instructions(dtype: torch.dtype) -> bool:
    """Whether this CPU has instructions for `dtype` (bfloat16 / float16) matmuls: oneDNN's AVX-512 BF16/FP16 or AMX
    kernels. Without them (an AVX2-only CPU) a bf16 matmul runs 20-200x slower than a float32 one."""
    if dtype not in _HALF_INSTRUCTIONS:
        if dtype == torch.bfloat16:
            _HALF_INSTRUCTIONS[dtype] = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        else:
            _HALF_INSTRUCTIONS[dtype] = dtype == torch.float16 and bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return _HALF_INSTRUCTIONS[dtype]


def dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes this machine's oneDNN packs: bfloat16 where it has bf16 support, and float32 on x86. The
    float32 gain was measured on an AMD EPYC, where ATen's BLAS is slow; on Intel CPUs MKL is fast and oneDNN is
    assumed to be no slower (not measured). Other CPUs keep their BLAS for float32."""
    mkldnn = torch.backends.mkldnn
    if not (mkldnn.enabled and mkldnn.is_available()):
        return ()
    out = (torch.float32,) if platform.machine().lower() in ("x86_64", "amd64") else ()
    return out + ((torch.bfloat16,) if half_instructions(torch.bfloat16) else ())


def _packable(module: nn.Module, kinds: tuple[torch.dtype, ...]) -> bool:
    """A plain nn.Linear (no subclass, no forward of its own set on the instance) with a CPU weight of one of
    `kinds`, and a bias of the same dtype."""
    return (
        type(module) is nn.Linear
        and "forward" not in module.__dict__
        and module.weight.device.type == "cpu"
        and module.weight.dtype in kinds
        and (module.bias is None or module.bias.dtype == module.weight.dtype)
    )


def _linears(model: nn.Module) -> list[nn.Linear]:
    """The linears `packed_linears` packs: every packable one when they hold at most MAX_BYTES of weights, else
    none."""
    kinds = dtypes()
    linears = [m for m in model.modules() if _packable(m, kinds)] if kinds else []
    return linears if sum(m.weight.nbytes for m in linears) <= MAX_BYTES else []


def wins(model: nn.Module) -> bool:
    """Whether `packed_linears` packs `model`: CPU linear weights in one of `dtypes()`, at most MAX_BYTES of them."""
    return bool(_linears(model))


def pack(weight: torch.Tensor, rows: int = 64) -> torch.Tensor:
    """`weight` [out, in] reordered into oneDNN's layout for inputs of about `rows` rows (a hint: any count works)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ W^T (+ bias) with W packed by `pack`: -> [..., out]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _packed_forward(module: nn.Linear, packed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != module.weight.dtype or torch.is_grad_enabled() or torch.is_autocast_enabled("cpu"):
        return nn.Linear.forward(module, x)  # what the packed kernel does not cover: the module's own path
    return linear(x, packed, module.bias)


@contextlib.contextmanager
def packed_linears(model: nn.Module, rows: int = 64):
    """Within the context, every packable linear of `model` (when `wins(model)`) multiplies with a weight packed
    at entry; `rows` is oneDNN's hint of the batch rows (any count works). Restored on exit."""
    switched = []
    try:
        with torch.no_grad():
            for module in _linears(model):
                packed = pack(module.weight.detach(), rows)
                switched.append(module)  # first: an interrupt between the two lines still restores it
                module.forward = partial(_packed_forward, module, packed)
        yield model
    finally:
        for module in switched:
            module.__dict__.pop("forward", None)

"""Linear layers whose weights are packed once for oneDNN while the engine samples (CPU, bfloat16).

On CPU a bfloat16 `F.linear` hands its weight to oneDNN, which reorders it into its own blocked layout on every
call: a pass over the whole weight matrix that a decode step (a few dozen rows against every weight of the model)
pays again at each token. `packed_linears(model)` reorders each `nn.Linear` weight once, with the op that
inductor's weight freezing uses (`torch.ops.mkldnn._reorder_linear_weight`), and routes the module's forward to
`torch.ops.mkldnn._linear_pointwise` on the packed copy until the context exits. Same kernel, same results (the
tests compare them bit for bit); measured on the 30M benchmark model, 64 rows, every linear of a decode step: 9.0
-> 6.9-7.7 ms (`benchmarks/generate.py` reports the engine with it).

The packed copies are taken at entry, so weights changed between two contexts (an RL step) are packed afresh; the
model must not change its weights inside one. They cost a second copy of the linear weights while the context
lasts, so models above MAX_BYTES of linear weights are left alone.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
from torch import nn

MAX_BYTES = 2 * 2**30  # pack at most this many bytes of linear weights (the packed copy doubles them)


def _supported() -> bool:
    mkldnn = torch.backends.mkldnn
    return mkldnn.enabled and mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _packable(module: nn.Module) -> bool:
    """A plain nn.Linear (no subclass, no forward of its own set on the instance) with a bfloat16 CPU weight."""
    return (
        type(module) is nn.Linear
        and "forward" not in module.__dict__
        and module.weight.device.type == "cpu"
        and module.weight.dtype == torch.bfloat16
        and (module.bias is None or module.bias.dtype == torch.bfloat16)
    )


def _linears(model: nn.Module) -> list[nn.Linear]:
    """The linears `packed_linears` packs: every packable one when oneDNN has bfloat16 support and they hold at
    most MAX_BYTES of weights, else none."""
    if not _supported():
        return []
    linears = [m for m in model.modules() if _packable(m)]
    return linears if sum(m.weight.nbytes for m in linears) <= MAX_BYTES else []


def wins(model: nn.Module) -> bool:
    """Whether `packed_linears` packs `model`: oneDNN with bfloat16 support, bfloat16 CPU linear weights, at most
    MAX_BYTES of them."""
    return bool(_linears(model))


def _packed_forward(module: nn.Linear, packed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.bfloat16 or torch.is_grad_enabled():
        return nn.Linear.forward(module, x)  # what the packed kernel does not cover: the module's own path
    return torch.ops.mkldnn._linear_pointwise(x, packed, module.bias, "none", [], "")


@contextlib.contextmanager
def packed_linears(model: nn.Module, rows: int = 64):
    """Within the context, every packable linear of `model` (when `wins(model)`) multiplies with a weight packed
    at entry; `rows` is oneDNN's hint of the batch rows (any count works). Restored on exit."""
    switched = []
    try:
        with torch.no_grad():
            for module in _linears(model):
                packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), rows)
                switched.append(module)  # first: an interrupt between the two lines still restores it
                module.forward = partial(_packed_forward, module, packed)
        yield model
    finally:
        for module in switched:
            module.__dict__.pop("forward", None)

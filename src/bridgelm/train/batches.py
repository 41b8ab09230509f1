"""Training's batch helpers: micro-batches of groups (`chunks`), per-row values as [B, T] tensors, bf16 autocast, a
model's train/eval mode for a block (`mode`).

The grouped token batches themselves and their teacher-forced log-probs are `bridgelm.logprobs`'.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

import torch


def rows_tensor(values: Sequence[torch.Tensor], response_mask: torch.Tensor) -> torch.Tensor:
    """Per-row 1D tensors (one value per response token) padded into [B, T] with zeros."""
    out = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    return out.masked_scatter(response_mask, torch.cat(list(values)).to(out.device, torch.float32))


def chunks(items: Sequence, size: int) -> list[list]:
    """Consecutive pieces of at most `size` items."""
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


def autocast(device: torch.device, bf16: bool):
    """bf16 autocast on `device` when asked (a no-op context otherwise)."""
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=bf16)


@contextmanager
def mode(model, training: bool):
    """`model` in training (True) or eval mode inside the block, its own mode restored after it."""
    was = model.training
    model.train(training)
    try:
        yield model
    finally:
        model.train(was)

"""Explicit randomness: seeds derived from names, and the global RNG states a checkpoint carries.

Randomness that a run needs per step comes from generators seeded with `derive_seed(seed, name, step, ...)`, so a
resumed run draws exactly what an uninterrupted one would; the global RNG states are saved with a checkpoint as well
(`rng_state`, `set_rng_state`), for whatever draws from them.

Used by the trainers, the CLI and bridgelm.runs (trainer state); tested by tests/test_train_common.py.
"""

from __future__ import annotations

import hashlib
import numbers
import random
from typing import Any

import torch


def derive_seed(*keys: Any) -> int:
    """A 63-bit seed from (seed, name, step, ...): stable across processes and Python versions; an integer key is
    taken by value (numpy's int64 1 seeds as 1 does)."""
    digest = hashlib.blake2b(repr(by_value(keys)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def by_value(keys: tuple) -> tuple:
    """`keys` with every integer as a Python int, so that the repr a seed is hashed from is the value's."""
    return tuple(int(k) if isinstance(k, numbers.Integral) and not isinstance(k, bool) else k for k in keys)


def generator(*keys: Any) -> torch.Generator:
    """A CPU torch.Generator seeded with `derive_seed(*keys)`."""
    return torch.Generator().manual_seed(derive_seed(*keys))


def rng_state() -> dict[str, Any]:
    """The global RNG states (Python, torch CPU, CUDA when present)."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` captured."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

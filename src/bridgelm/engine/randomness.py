"""Per-sample random streams: every uniform the sampler uses is fixed by (seed, prompt key, sample, step, attempt).

A sample's draws then do not depend on which prompts share its batch, on the batch bounds, on resuming or on
sharding: the same prompt key gives the same samples. The sampler asks for uniforms through a `Uniform`
(uniform(rows, attempt) -> one uniform per batch row); `SampleRandomness` is the engine's, `generator_uniform` one
torch.Generator's (whose draws then depend on the batch's composition).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import torch

from bridgelm.engine.waves import Job
from bridgelm.rng import by_value

# uniform(rows, attempt) -> [len(rows)] uniforms in [0, 1): the draws of those batch rows, `attempt`-th try.
Uniform = Callable[[torch.Tensor, int], torch.Tensor]

DEFERRED_ROUNDS = 4  # draws per row per step made without a host sync (sampler.sample_tokens_deferred)


def generator_uniform(generator: torch.Generator | None) -> Uniform:
    """Uniforms from one generator (the draws then depend on the batch's composition)."""
    return lambda rows, attempt: torch.rand(len(rows), generator=generator, device=rows.device)


def _stream_seed(*keys) -> int:
    digest = hashlib.sha256(repr(by_value(keys)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class SampleRandomness:
    """The uniforms of the samples in a batch's slots, fixed by (seed, prompt key, sample index, step, attempt).

    The first ROUNDS attempts of a step come from a table drawn once per sample (so sample j's draws do not depend
    on n: more samples of a prompt keep the first ones); the rare later attempts from a generator seeded with the
    full coordinates. A slot holds one sample at a time (`assign`: a wave's rows at its start, a waiting prompt's
    group in the slots of a finished one). The engine sets `rows` (each batch row's slot) and `step` (each batch
    row's own step) before each step's draws.
    """

    ROUNDS = DEFERRED_ROUNDS  # table attempts per step; the GPU sampler makes them all at once

    def __init__(self, seed: int, keys: Sequence, steps: int, slots: int, device):
        self.seed, self.keys, self.steps = seed, keys, steps
        self.table = torch.zeros(slots, steps, self.ROUNDS, device=device)  # [slots, steps, ROUNDS]
        self.coords: list[tuple | None] = [None] * slots  # (prompt key, sample index) of each slot
        self.rows = None  # [B] slot of each batch row, set every step
        self.step = None  # [B] long: each batch row's step (`Batch.steps`), set every step

    def assign(self, slots: Sequence[int], jobs: Sequence[Job]) -> None:
        """The samples of `jobs`, in order, take the slots `slots` (one each)."""
        parts = []
        for job in jobs:
            key = self.keys[job.prompt]
            for j in range(job.first, job.first + job.count):
                self.coords[slots[len(parts)]] = (key, j)
                g = torch.Generator().manual_seed(_stream_seed(self.seed, key, j))
                # Step-major: the draws of step t do not depend on max_new_tokens (prefix-consistent).
                parts.append(torch.rand(self.steps, self.ROUNDS, generator=g))  # [steps, ROUNDS]
        assert len(parts) == len(slots), f"{len(parts)} samples for {len(slots)} slots"
        index = torch.as_tensor(list(slots), dtype=torch.long, device=self.table.device)
        self.table[index] = torch.stack(parts).to(self.table.device)

    def rounds(self, batch_rows: torch.Tensor) -> torch.Tensor:
        """The uniforms of attempts 0..ROUNDS-1 of the current step: [len(batch_rows), ROUNDS], one gather."""
        return self.table[self.rows[batch_rows], self.step[batch_rows]]

    def __call__(self, batch_rows: torch.Tensor, attempt: int) -> torch.Tensor:
        rows, steps = self.rows[batch_rows], self.step[batch_rows]
        if attempt < self.ROUNDS:
            return self.table[rows, steps, attempt]
        out = [
            torch.rand(1, generator=torch.Generator().manual_seed(_stream_seed(self.seed, *self.coords[r], t, attempt)))
            for r, t in zip(rows.tolist(), steps.tolist())
        ]
        return torch.cat(out).to(self.table.device)

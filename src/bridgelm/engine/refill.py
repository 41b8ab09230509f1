"""Refilling a batch: the rows of a finished group take a waiting prompt's group, so a stream needs no waves.

A wave decodes until its longest sample ends while its finished groups idle or are dropped (at 256 GSM8K rows x 256
tokens under a 64-row bound, the rows' live steps were 82-92% of rows x steps). Refilling (`SamplingConfig.refill`,
where a stream needs more than one wave): the prompts' groups queue in prompt order and, once finished groups are
`compact_fraction` of the batch (the rule by which waves drop them), waiting groups take their rows. Their prompts
are prefilled alone (each distinct prompt once) and written right-aligned to end just before the batch's next write
(`SlabCache.admit`: the slab becomes a ring, so rows of any age share one write column); their samples draw their
first tokens from the prefill's logits at the batch's next draw, with their own random streams
(`SampleRandomness.assign`), counting their own steps. The draws are a wave's: per-sample streams, only the
batch's shape (so its rounding) differs.

The cost, and why it is off by default: a ring is read whole at every step (longest prompt + max_new_tokens per
row), where a wave reads what it has written; on SmolLM2 on CPU that outweighed the rows it keeps live
(docs/engine.md). The batch holds as many rows as the bounds allow for the stream's longest prompt +
max_new_tokens (`refill_plan`). The compiled step keeps its shapes (the batch stays at its bucket while groups
wait; the ring is read whole, one read bucket). Foreign groups (whole blocks of prompts) keep waves, and so do
models that build their masks from the cache's length (`step.reads_whole` false: sliding-window layers), which a
ring does not have.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bridgelm.engine.batch import Batch, prefill, prompt_of_rows
from bridgelm.engine.config import SamplingConfig
from bridgelm.engine.waves import Job, Wave


def merged(groups: Sequence[Job]) -> list[Job]:
    """Consecutive groups of one prompt as one job (its prompt is prefilled once)."""
    jobs: list[Job] = []
    for g in groups:
        if jobs and jobs[-1].prompt == g.prompt and jobs[-1].first + jobs[-1].count == g.first:
            jobs[-1] = Job(g.prompt, jobs[-1].first, jobs[-1].count + g.count)
        else:
            jobs.append(g)
    return jobs


def refill_plan(
    lengths: Sequence[int], cfg: SamplingConfig, waves: Sequence[Wave], ring: bool = True
) -> tuple[Wave, list[Job]] | None:
    """The first batch of a refilled stream and the groups that wait for its rows (prompt order), or None where the
    `waves` serve: one wave, foreign groups, `refill` off, a model that cannot read a ring (not `ring`:
    `step.reads_whole` false), or bounds that hold no group of the longest prompt."""
    if len(waves) < 2 or cfg.foreign_groups or not cfg.refill or not ring:
        return None
    longest = max(lengths)  # every row may come to hold it
    rows = min(cfg.max_batch_sequences, cfg.max_batch_tokens // (longest + cfg.max_new_tokens))
    if rows < cfg.width:
        return None
    groups = [Job(p, first, cfg.width) for p in range(len(lengths)) for first in range(0, cfg.n, cfg.width)]
    k = rows // cfg.width
    return Wave(merged(groups[:k]), longest), groups[k:]


def freed_groups(group_alive: torch.Tensor, live: int, cfg: SamplingConfig, waiting: int) -> list[int]:
    """The finished groups whose rows waiting groups take now (at most `waiting`): none until they are
    `compact_fraction` of the batch."""
    groups = group_alive.numel()
    if not waiting or groups - live < max(1, cfg.compact_fraction * groups):
        return []
    return torch.nonzero(~group_alive)[:waiting, 0].tolist()


def admit(model, prompts, batch: Batch, logits: torch.Tensor, groups: Sequence[Job], rows: torch.Tensor, step: int,
          at: int, pad_id: int) -> tuple[torch.Tensor, list[Job]]:
    """The waiting `groups` take the batch rows `rows [R]` (finished groups', in order, a group's rows each),
    starting at the batch's `step`: their prompts prefilled and written into the cache to end before the write of
    the wave's position `at`, their rows' mask, positions and state reset, their first logits in place of the old
    rows' logits [B, V]. -> (logits, the groups as jobs: consecutive groups of a prompt merged, rows in order)."""
    device = logits.device
    wave = Wave(merged(groups), max(len(prompts[g.prompt]) for g in groups))
    fresh, mask, lengths, first_logits = prefill(model, prompts, wave, pad_id, wave.longest)
    src = prompt_of_rows(wave, device)  # [R]
    batch.cache.admit(rows, fresh, src, at)
    new_mask = torch.zeros(rows.numel(), batch.mask.shape[1], dtype=torch.bool, device=device)
    new_mask[:, batch.cache.prompt_columns(wave.longest, at).to(device)] = mask[src, : wave.longest]
    batch.mask = batch.mask.index_copy(0, rows, new_mask)
    batch.pos = batch.pos.index_copy(0, rows, lengths[src])
    batch.alive = batch.alive.index_fill(0, rows, True)
    batch.start = batch.start.index_fill(0, rows, step)
    return logits.index_copy(0, rows, first_logits[src].to(logits.dtype)), wave.jobs

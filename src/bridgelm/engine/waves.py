"""Waves: the split of (prompt, samples) work into batches that respect the memory bounds.

A wave holds at most `max_batch_sequences` rows and `max_batch_tokens` = rows x (longest prompt + max_new_tokens);
its rows are whole Bridge groups, in prompt order, so that a prompt completes as soon as its last wave does. A
prompt with more samples than a wave holds is split into chunks of whole groups. With foreign groups (sample j of
`width` consecutive prompts form one group) a wave holds whole blocks of `width` prompts with all their samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from bridgelm.engine.config import SamplingConfig
from bridgelm.errors import UserError


@dataclass
class Job:
    """Samples first .. first+count-1 of one prompt, decoded in one wave."""

    prompt: int  # index of the prompt
    first: int  # index of its first sample in this job
    count: int  # samples in this job (a multiple of the width)


@dataclass
class Wave:
    """The work decoded together: jobs in prompt order, and the longest prompt among them."""

    jobs: list[Job] = field(default_factory=list)  # in prompt order
    longest: int = 0  # tokens of its longest prompt


def plan_waves(lengths: Sequence[int], cfg: SamplingConfig) -> list[Wave]:
    """Split (prompt, samples) work into waves that respect the batch bounds, keeping prompt order; balanced: with
    as many waves as the bounds need, each holds about the same rows (64 rows under a bound of 56: 32 and 32, not
    56 and a lone tail wave of 8, which costs a whole wave's steps for an eighth of the work)."""
    if cfg.foreign_groups:
        return plan_foreign_waves(lengths, cfg)
    waves = _greedy_waves(lengths, cfg, cfg.max_batch_sequences)
    if len(waves) < 2:
        return waves
    rows = len(lengths) * cfg.n
    even = -(-rows // len(waves))  # rows per wave, balanced
    even = -(-even // cfg.width) * cfg.width  # whole groups
    if even >= cfg.max_batch_sequences:
        return waves
    balanced = _greedy_waves(lengths, cfg, even)
    return balanced if len(balanced) == len(waves) else waves  # the token bound or chunking may need more waves


def _greedy_waves(lengths: Sequence[int], cfg: SamplingConfig, max_rows: int) -> list[Wave]:
    """Waves filled in prompt order up to `max_rows` rows (at most cfg.max_batch_sequences) and the token bound."""
    per_row = lambda longest: longest + cfg.max_new_tokens  # noqa: E731
    waves: list[Wave] = []
    current = Wave()
    rows = 0
    for p, length in enumerate(lengths):
        # Largest chunk of whole groups that fits a wave alone.
        fit = min(max_rows, cfg.max_batch_tokens // per_row(length))
        chunk = (fit // cfg.width) * cfg.width
        if chunk < cfg.width:
            raise UserError(
                f"max_batch_tokens={cfg.max_batch_tokens} cannot hold one group of {cfg.width} rows of "
                f"{per_row(length)} tokens (prompt {p} has {length} tokens + max_new_tokens={cfg.max_new_tokens})"
            )
        first = 0
        while first < cfg.n:
            count = min(chunk, cfg.n - first)
            longest = max(current.longest, length)
            if current.jobs and (rows + count > max_rows or (rows + count) * per_row(longest) > cfg.max_batch_tokens):
                waves.append(current)
                current, rows = Wave(), 0
                longest = length
            current.jobs.append(Job(p, first, count))
            current.longest = longest
            rows += count
            first += count
    if current.jobs:
        waves.append(current)
    return waves


def plan_foreign_waves(lengths: Sequence[int], cfg: SamplingConfig) -> list[Wave]:
    """Waves of whole blocks of `width` prompts with all their samples (foreign groups)."""
    w = cfg.width
    assert len(lengths) % w == 0, f"foreign_groups: {len(lengths)} prompts is not a multiple of width={w}"
    waves: list[Wave] = []
    current = Wave()
    for start in range(0, len(lengths), w):
        longest = max(current.longest, *lengths[start : start + w])
        rows = (len(current.jobs) + w) * cfg.n
        if current.jobs and (
            rows > cfg.max_batch_sequences or rows * (longest + cfg.max_new_tokens) > cfg.max_batch_tokens
        ):
            waves.append(current)
            current = Wave()
            longest = max(lengths[start : start + w])
        current.jobs += [Job(p, 0, cfg.n) for p in range(start, start + w)]
        current.longest = longest
    waves.append(current)
    return waves

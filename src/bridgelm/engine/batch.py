"""A decode batch's state: the rows decoded together, what their samples generated, and how a wave starts.

`prefill` runs each distinct prompt of a wave once; `expand` points the prompt's samples at its cache row (held once,
`bridgelm.prompt_attention`) or copies the row to them. `Batch` holds the B rows decoded together, `Outputs` what
the samples in its slots generated, one slot per sample at a time: a wave's rows at its start, and a waiting
prompt's group in the slots of a finished group (`bridgelm.engine.refill`). Each row counts its own steps from its
`start`, the wave's step at which its sample began.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from bridgelm.engine.cache import SlabCache
from bridgelm.engine.config import SamplingConfig
from bridgelm.engine.step import cache_arg, layout_arg, reads_whole
from bridgelm.engine.waves import Wave
from bridgelm.errors import UserError


@dataclass
class GeneratedIds:
    """One sample, as token ids."""

    token_ids: list[int]  # generated ids, ending with the EOS id when `finished`
    logprobs: list[float]  # log-prob of each generated id, under softmax(logits / temperature)
    finished: bool  # ended by EOS or a stop string (False: ran out of max_new_tokens)


@dataclass
class Outputs:
    """What the samples in a batch's W slots generated (a wave's rows: prompt-major sample order)."""

    tokens: torch.Tensor  # [W, T] long: generated ids, pad after a sample's end
    logprobs: torch.Tensor  # [W, T] float: their log-probs, 0 after a sample's end
    lengths: torch.Tensor  # [W] long: generated tokens
    ended: torch.Tensor  # [W] bool: emitted EOS or a stop string
    pad_id: int

    @classmethod
    def empty(cls, rows: int, steps: int, pad_id: int, device) -> Outputs:
        tokens = torch.full((rows, steps), pad_id, dtype=torch.long, device=device)
        lengths = torch.zeros(rows, dtype=torch.long, device=device)
        ended = torch.zeros(rows, dtype=torch.bool, device=device)
        return cls(tokens, torch.zeros(rows, steps, device=device), lengths, ended, pad_id)

    def samples(self, slots: Sequence[int]) -> list[GeneratedIds]:
        """The samples in `slots`, which are then emptied for others."""
        index = torch.as_tensor(list(slots), dtype=torch.long, device=self.tokens.device)
        # One copy to the host each (not a sync per row and value), then the rows are cut there.
        held = (self.tokens, self.logprobs, self.lengths, self.ended)
        tokens, logprobs, lengths, ended = [t[index].cpu() for t in held]
        self.tokens[index], self.logprobs[index], self.lengths[index], self.ended[index] = self.pad_id, 0.0, 0, False
        if not bool(torch.isfinite(logprobs).all()):  # checked where the results reach the host
            raise UserError(
                "the model's log-probs were not finite while sampling (NaN or infinite logits): its weights or blocks "
                "overflow (values as large as 1e30?), or training diverged; expected a model with finite outputs"
            )
        out = []
        for r, n in enumerate(lengths.tolist()):
            out.append(GeneratedIds(tokens[r, :n].tolist(), logprobs[r, :n].tolist(), bool(ended[r])))
        return out


@dataclass
class Batch:
    """The B rows decoded together: the samples of the groups not dropped yet."""

    cache: SlabCache  # their keys and values
    mask: torch.Tensor  # [B, capacity] bool: the slots each row attends to (its prompt, then its inputs)
    pos: torch.Tensor  # [B] long: position of the next input token
    rows: torch.Tensor  # [B] long: the slot of each batch row (of `Outputs` and `SampleRandomness`)
    alive: torch.Tensor  # [B] bool: still generating
    valid: torch.Tensor  # [B] bool: rows whose last token is a real input (live ones and a just-emitted EOS)
    start: torch.Tensor  # [B] long: the wave's step at which each row's sample began (its step 0)

    def steps(self, step: int, limit: int) -> torch.Tensor:
        """Each row's own step at the batch's `step`, at most limit - 1 (max_new_tokens: the last a sample has; a
        finished group waiting for its rows to be refilled counts on past it, and nothing it draws is kept)."""
        return (step - self.start).clamp(max=limit - 1)

    def keep(self, keep: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """Keep the rows `keep [B']` (finished groups dropped) -> the kept rows of inputs [B]."""
        self.cache.select_rows(keep)
        self.mask, self.pos, self.rows, self.alive, self.valid, self.start, inputs = (
            t[keep] for t in (self.mask, self.pos, self.rows, self.alive, self.valid, self.start, inputs)
        )
        return inputs


# Prompt positions that copies per sample would add to a wave's cache, from which holding each prompt once pays:
# it saves their reads at every step, for a dozen more small ops per layer (docs/benchmarks.md: SmolLM2, 2 threads,
# 16 rows x ~110-token prompts, 1.6k positions: 0.90x; 128 rows x ~500, 68k: 1.25x; 128 x ~140, 18k: 0.98-1.14x).
SHARE_MIN_POSITIONS = 16_384


def share_pays(wave: Wave) -> bool:
    """Whether the wave's samples hold each prompt once by default: the copies would add SHARE_MIN_POSITIONS."""
    rows = sum(job.count for job in wave.jobs)
    return (rows - len(wave.jobs)) * wave.longest >= SHARE_MIN_POSITIONS


def prefill(model, prompts: Sequence[Sequence[int]], wave: Wave, pad_id: int, capacity: int):
    """Each distinct prompt of the wave once through the model, left-padded to the longest: -> (cache [P rows],
    mask [P, capacity] bool, lengths [P], logits [P, V] of each prompt's next token)."""
    device = next(model.parameters()).device
    P, L = len(wave.jobs), wave.longest
    ids = torch.full((P, L), pad_id, dtype=torch.long, device=device)  # [P, L]
    mask = torch.zeros(P, capacity, dtype=torch.bool, device=device)  # [P, capacity]
    for i, job in enumerate(wave.jobs):
        toks = torch.as_tensor(prompts[job.prompt], dtype=torch.long, device=device)
        ids[i, L - len(toks) :] = toks
        mask[i, L - len(toks) : L] = True
    positions = (mask[:, :L].long().cumsum(-1) - 1).clamp(min=0)  # [P, L]
    cache = SlabCache(model.config.get_text_config().num_hidden_layers, capacity, reads_whole(model))
    out = model(
        input_ids=ids,
        attention_mask=mask[:, :L].long(),
        position_ids=positions,
        **{cache_arg(model): cache},
        **layout_arg(model, None),
        use_cache=True,
        logits_to_keep=1,
    )
    lengths = torch.tensor([len(prompts[j.prompt]) for j in wave.jobs], device=device)
    return cache, mask, lengths, out.logits[:, -1]


def prompt_of_rows(wave: Wave, device) -> torch.Tensor:
    """The wave's prompt (index into wave.jobs) of each of its rows, prompt-major [rows]; sized on the host, so no
    device sync."""
    counts = [j.count for j in wave.jobs]
    index = torch.arange(len(counts), device=device)
    return torch.repeat_interleave(index, torch.tensor(counts, device=device), output_size=sum(counts))


def expand(cache: SlabCache, mask, lengths, logits, wave: Wave, cfg: SamplingConfig, shared: bool = False):
    """Copy each prompt's cache row (`shared`: only point its samples at it), mask and logits to its samples
    -> (the batch, logits [B, V])."""
    device = mask.device
    P = len(wave.jobs)
    src = prompt_of_rows(wave, device)  # [B]
    B = len(src)
    rows = torch.arange(B, device=device)  # wave row (prompt-major sample order) of each batch row
    if cfg.foreign_groups:  # batch order [block, sample j, prompt of the block]: groups of `width` prompts
        rows = rows.view(P // cfg.width, cfg.width, cfg.n).transpose(1, 2).reshape(-1)
        src = src[rows]
    if shared:
        cache.share_prompts(src, P)
    else:
        cache.select_rows(src)
    alive = torch.ones(B, dtype=torch.bool, device=device)
    start = torch.zeros(B, dtype=torch.long, device=device)
    return Batch(cache, mask[src], lengths[src].clone(), rows, alive, alive, start), logits[src]



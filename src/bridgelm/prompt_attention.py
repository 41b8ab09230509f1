"""Decode attention over a prompt that several rows share: its keys and values held once, not once per sample.

The engine samples n continuations of each prompt. Its rows all start with the same prompt, so the prompt's keys
and values are the same in each of them: copying them to every row costs n times their memory, and a decode step
reads the copies again at every token (at 128 rows of SmolLM2 with ~200-token prompts, reading the cache was a third
of the step, at the memory bandwidth: issue 50). Here the cache keeps the prompt part once per prompt
(`SharedPrompt`: keys and values [P, KVH, Lp, D]) and each row's own positions after it ([B, KVH, Lg, D]).
`shared_prompt_attention` computes the same `softmax(q k^T * scale + mask) v` over the two parts:

- scores against the prompt with the queries of a prompt's rows stacked ([P, KVH, slots x rep, D], one matmul per
  prompt instead of one per row, each prompt key read once), scattered back to rows;
- scores against the rows' own positions as before; one softmax over the two, concatenated, in float32;
- the two weighted sums of values added in float32.

Rows may come in any order and any number per prompt (finished groups dropped, foreign groups): `PromptRows`
places each row in a slot of its prompt, the empty slots reading a zero query.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bridgelm.scores import scores_of


@dataclass
class PromptRows:
    """Which prompt each of the B rows continues, and its slot among that prompt's rows."""

    src: torch.Tensor  # [B] long: the prompt of each row
    where: torch.Tensor  # [B] long: each row's slot, prompt * k + its rank among the prompt's rows
    slots: torch.Tensor  # [P * k] long: the row in each slot, B for an empty one
    k: int  # slots per prompt: the most rows a prompt has
    in_order: bool = False  # row b in slot b: every prompt has k rows, in prompt order (no gathers needed)

    @classmethod
    def of(cls, src: torch.Tensor, prompts: int) -> PromptRows:
        """src [B] long, each in [0, prompts) (host syncs: k, in_order)."""
        B = src.numel()
        counts = torch.bincount(src, minlength=prompts)
        k = max(int(counts.max()), 1)
        order = torch.argsort(src, stable=True)
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.arange(B, device=src.device) - starts[src[order]]
        where = torch.empty_like(src)
        where[order] = src[order] * k + rank
        slots = torch.full((prompts * k,), B, dtype=torch.long, device=src.device)
        slots[where] = torch.arange(B, device=src.device)
        in_order = B == prompts * k and bool((where == torch.arange(B, device=src.device)).all())
        return cls(src, where, slots, k, in_order)


@dataclass
class SharedPrompt:
    """One layer's prompt keys and values, once per prompt, and the rows that continue them."""

    keys: torch.Tensor  # [P, KVH, Lp, D]
    values: torch.Tensor  # [P, KVH, Lp, Dv]
    rows: PromptRows

    def select(self, kept: PromptRows, prompts: torch.Tensor | None) -> SharedPrompt:
        """The rows kept (`kept`: their prompts and places), and only the prompts `prompts` (None: all)."""
        if prompts is None:
            return SharedPrompt(self.keys, self.values, kept)
        return SharedPrompt(self.keys.index_select(0, prompts), self.values.index_select(0, prompts), kept)

    def expanded(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's whole keys and values, prompt then its own positions: [B, KVH, Lp + Lg, D] (a copy: what the
        cache held before; for attention calls `shared_prompt_attention` does not cover)."""
        src = self.rows.src
        return torch.cat([self.keys[src], key], dim=2), torch.cat([self.values[src], value], dim=2)


def _by_prompt(x: torch.Tensor, rows: PromptRows) -> torch.Tensor:
    """x [B, KVH, r, N] -> [P, KVH, k * r, N]: each prompt's rows stacked in their slots (zeros in empty ones)."""
    B, KVH, r, N = x.shape
    padded = x if rows.in_order else torch.cat([x, x.new_zeros(1, KVH, r, N)])[rows.slots]  # [P * k, KVH, r, N]
    return padded.view(-1, rows.k, KVH, r, N).transpose(1, 2).reshape(-1, KVH, rows.k * r, N)


def _by_row(x: torch.Tensor, rows: PromptRows, r: int) -> torch.Tensor:
    """x [P, KVH, k * r, N] -> [B, KVH, r, N]: the inverse of `_by_prompt` (empty slots left out)."""
    P, KVH, _, N = x.shape
    out = x.view(P, KVH, rows.k, r, N).transpose(1, 2).reshape(P * rows.k, KVH, r, N)  # a view where P is 1
    return out.contiguous() if rows.in_order else out[rows.where]


def shared_prompt_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, shared: SharedPrompt, mask, scale: float
) -> torch.Tensor:
    """One decode step's attention. query [B, H, 1, D]; key/value [B, KVH, Lg, D] the rows' own positions, after the
    prompt's Lp (H a multiple of KVH); mask [B, 1, 1, Lp + Lg], one row per batch row: bool (True = attend),
    additive float, or None. -> [B, H, 1, Dv]."""
    B, H, _, D = query.shape
    KVH = key.shape[1]
    rep, Lp = H // KVH, shared.keys.shape[2]
    q = (query * scale).reshape(B, KVH, rep, D)  # a row's query heads stacked on their key/value head
    prompt_scores = scores_of(_by_prompt(q, shared.rows), shared.keys)  # [P, KVH, k*rep, Lp]
    own_scores = scores_of(q, key)  # [B, KVH, rep, Lg]
    scores = torch.cat([_by_row(prompt_scores, shared.rows, rep), own_scores], dim=-1)  # [B, KVH, rep, L] float32
    if mask is not None and mask.dtype == torch.bool:  # the lowest finite value, as matmul_attention's
        scores = scores.masked_fill_(~mask.view(B, 1, 1, -1), torch.finfo(scores.dtype).min)
    elif mask is not None:  # additive
        scores = scores + mask.view(B, 1, 1, -1).to(scores.dtype)
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    prompt_probs, own_probs = probs[..., :Lp], probs[..., Lp:]
    prompt_out = torch.matmul(_by_prompt(prompt_probs, shared.rows), shared.values)  # [P, KVH, k*rep, Dv]
    out = _by_row(prompt_out, shared.rows, rep).float() + torch.matmul(own_probs, value).float()
    return out.to(value.dtype).view(B, H, 1, -1)

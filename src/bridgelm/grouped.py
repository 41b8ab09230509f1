"""How group membership and validity reach the Bridge blocks during a forward pass.

A forward pass over a batch of B sequences carries a `Groups` bundle as the keyword argument
`bridge_groups`; Hugging Face decoders pass unknown keyword arguments down to every decoder layer, and
gradient checkpointing keeps them for the recomputation, so no global state is involved.

`Groups` says which rows attend to each other (rows with equal group id) and which rows are valid at each
position (`valid [B, S]`, the attention mask). Its layout is computed once per forward, not per layer:
- "contiguous": groups are consecutive runs of equal width w, the common case of sampling; blocks then
  reshape [B, ...] into [B/w, w, ...] without gathering;
- "gathered": any other assignment; rows are gathered into [G, w_max] slots (padding slots masked).
Either way the cost per layer is O(B * w * S * D), never a dense B x B matrix over the whole batch.

Without `bridge_groups` every row is its own group (width 1), which is independent generation; a Bridge model that
decodes several rows without it (transformers' generate) says so once (`note_rows_alone`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

KWARG = "bridge_groups"


@dataclass
class Groups:
    """Group layout of a batch, built by `Groups.build`."""

    batch_size: int  # B, rows of the batch
    width: int  # w for the contiguous layout; w_max (widest group) for the gathered layout
    valid: torch.Tensor | None  # [B, S] bool: row b is a live token at position s; None means all valid
    index: torch.Tensor | None = None  # [G, w_max] long: row of each slot (gathered layout only; pads -> 0)
    slot_used: torch.Tensor | None = None  # [G, w_max] bool: slot holds a real row (gathered layout only)
    slot_of_row: torch.Tensor | None = None  # [B] long: flat slot index g*w_max+j of each row (gathered only)
    _last_keys: torch.Tensor | None = field(default=None, repr=False, compare=False)  # last_position_keys' cache

    @property
    def contiguous(self) -> bool:
        return self.index is None

    def last_position_keys(self, dtype: torch.dtype) -> torch.Tensor | None:
        """Contiguous layout: which keys each row reads at the last position, as an additive mask [G, 1, w(query),
        w(key)] of `dtype` (0 for the valid rows of its group, and always for itself; -inf for the others), or None
        when every row is valid. Made once per layout, for every layer of a decode step (sdpa would turn a bool mask
        into this one in every layer)."""
        if self.valid is None:
            return None
        if self._last_keys is None or self._last_keys.dtype != dtype:
            w = self.width
            eye = torch.eye(w, dtype=torch.bool, device=self.valid.device)
            keys = self.valid[:, -1].reshape(-1, 1, 1, w) | eye
            self._last_keys = torch.zeros(keys.shape, dtype=dtype, device=keys.device).masked_fill_(~keys, -torch.inf)
        return self._last_keys

    @staticmethod
    def build(group_ids: torch.Tensor | list[int], valid: torch.Tensor | None = None) -> Groups:
        """Layout for `group_ids [B]` (equal ids interact) and the validity mask `valid [B, S]`."""
        group_ids = torch.as_tensor(group_ids).reshape(-1)
        if group_ids.dtype.is_floating_point:
            raise ValueError(f"group_ids must be integers, got dtype {group_ids.dtype}")
        batch = group_ids.numel()
        if batch == 0:
            raise ValueError("group_ids is empty: expected one group id per row of the batch")
        if valid is not None:
            if valid.dim() != 2 or valid.shape[0] != batch:
                raise ValueError(
                    f"attention mask of shape {tuple(valid.shape)} does not fit group_ids of length {batch}: "
                    "expected [B, S] with the same B"
                )
            valid = valid.bool()
        ids = group_ids.cpu()
        # Contiguous runs of equal width, each id used by one run only?
        change = torch.ones(batch, dtype=torch.bool)
        change[1:] = ids[1:] != ids[:-1]
        starts = torch.nonzero(change).reshape(-1)
        runs = torch.diff(torch.cat([starts, torch.tensor([batch])]))
        n_distinct = torch.unique(ids).numel()
        if n_distinct == starts.numel() and bool((runs == runs[0]).all()):
            return Groups(batch_size=batch, width=int(runs[0]), valid=valid)
        # General layout: gather rows of each group into padded slots.
        uniq, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
        w_max = int(counts.max())
        order = torch.argsort(inverse, stable=True)  # rows sorted by group, original order within a group
        sorted_groups = inverse[order]
        first = torch.cumsum(counts, 0) - counts  # first sorted position of each group
        rank = torch.arange(batch) - first[sorted_groups]  # slot within the group
        index = torch.zeros(uniq.numel(), w_max, dtype=torch.long)
        slot_used = torch.zeros(uniq.numel(), w_max, dtype=torch.bool)
        index[sorted_groups, rank] = order
        slot_used[sorted_groups, rank] = True
        slot_of_row = torch.empty(batch, dtype=torch.long)
        slot_of_row[order] = sorted_groups * w_max + rank
        device = valid.device if valid is not None else group_ids.device
        return Groups(
            batch_size=batch,
            width=w_max,
            valid=valid,
            index=index.to(device),
            slot_used=slot_used.to(device),
            slot_of_row=slot_of_row.to(device),
        )

    @staticmethod
    def contiguous_width(batch_size: int, width: int, valid: torch.Tensor | None = None) -> Groups:
        """Layout of `batch_size` rows in consecutive groups of `width` (the sampler's layout)."""
        assert width >= 1 and batch_size % width == 0, (
            f"width={width} must be >= 1 and divide the batch size {batch_size}")
        return Groups(batch_size=batch_size, width=width, valid=None if valid is None else valid.bool())


def _check_aligned(group_ids: list, leading_pads: list[int]) -> None:
    """ValueError unless the rows of each group start at the same position (as many padding tokens before them)."""
    first: dict = {}
    for row, (g, pads) in enumerate(zip(group_ids, leading_pads)):
        other = first.setdefault(g, (row, pads))
        if other[1] != pads:
            raise ValueError(
                f"rows {other[0]} and {row} of group {g} start after {other[1]} and {pads} padding tokens: a Bridge "
                "block meets a group's rows at the same positions, so left padding shifts one against the other; "
                "expected right-padded rows (tokenizer(..., padding_side='right'))"
            )


def grouped_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, group_ids) -> torch.Tensor:
    """Teacher-forced forward of a grouped batch; returns logits [B, S, V].

    `input_ids [B, S]` are right-padded; `attention_mask [B, S]` is 1 on real tokens and 0 on the padding
    after each sequence's end (None: no padding); `group_ids [B]`: rows with equal ids interact through Bridge
    blocks and share an identical prompt at the start. At position s a Bridge block lets row b attend to every row
    of its group whose attention mask is 1 at s (b itself included). Logits at padded positions are unspecified but
    finite.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, S], got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} must equal input_ids shape {tuple(input_ids.shape)}"
        )
    group_ids = torch.as_tensor(group_ids)
    if group_ids.dim() != 1 or group_ids.numel() != input_ids.shape[0]:
        raise ValueError(
            f"group_ids has {group_ids.numel()} entries (shape {tuple(group_ids.shape)}); "
            f"expected one per row of input_ids, i.e. {input_ids.shape[0]}"
        )
    _check_aligned(group_ids.tolist(), (attention_mask.cumsum(1) == 0).sum(1).tolist())
    device = model.get_input_embeddings().weight.device  # inputs built on the CPU serve a model on a GPU
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    groups = Groups.build(group_ids, attention_mask)
    out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **{KWARG: groups})
    return out.logits


class RowsAloneWarning(UserWarning):
    """A Bridge model decodes several rows with no group layout (transformers' generate): each row alone."""


_ROWS_ALONE_SAID = False


def note_rows_alone(hidden_states: torch.Tensor) -> None:
    """Warn once a process when a Bridge model decodes a step of several rows without `bridge_groups`: what
    transformers' `generate` (and pipelines built on it) does, whose samples are then drawn at width 1, each alone.
    bridgelm's own callers always pass the layout (None at width 1); attach.py's layers call this."""
    global _ROWS_ALONE_SAID
    if _ROWS_ALONE_SAID or hidden_states.dim() != 3 or hidden_states.shape[0] < 2 or hidden_states.shape[1] != 1:
        return
    _ROWS_ALONE_SAID = True
    warnings.warn(RowsAloneWarning(
        "a Bridge model decodes rows with no Bridge groups (transformers' generate, or a forward without "
        "bridge_groups): each row is drawn alone, as at width 1; bridgelm.generate(model, tokenizer, prompts, n=N, "
        "width=W) samples groups of W that read each other"), stacklevel=3)

"""The engine's key/value cache: a slab per layer, written in place, its rows repeated or dropped.

A wave prefills each distinct prompt once into a `SlabCache` of capacity (longest prompt + max_new_tokens), then
`select_rows` copies each prompt's row to its samples and later drops the rows of finished groups. Decoding writes
one position per step into the slab, with no concatenation. Where the decode step's attention reads a shared prompt
(`share_prompts`, the eager step under bridgelm's attention) each prompt's keys and values stay once per prompt
(`bridgelm.prompt_attention.SharedPrompt`) and the slab holds only the rows' own positions after them; the layer
tags its key slab with the shared part (the attribute `bridgelm.attention.SHARED`), where the attention finds it.

Reads in place (`whole_reads`, set where the decode step hands the model a ready mask): the slab holds the live
positions rounded up to a multiple of a step that grows with them (`rounded`: 16 up to 64 positions, 32 up to 256,
...), grown by that step when they reach its end (a copy of the cache), and a decode step reads the whole slab under
the mask: a dense tensor, which the attention's matmuls take as it is, where a slice [:, :, :live] of a larger slab
is strided and was copied whole at every step and layer (7.8% of a SmolLM2 decode step, issue 50). `make_static`
fixes every shape for the compiled step: the slab then holds its whole capacity (a `bucket`), each layer writes at
one slot and returns the live positions rounded up to a `bucket` (`set_read`), which the attention mask covers
(`read_as`: the read length is the mask's, a symbolic size under torch.compile, so one compile serves every read
bucket).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from bridgelm.attention import SHARED
from bridgelm.prompt_attention import PromptRows, SharedPrompt

READ_STEP = 64  # the compiled step's buckets start here


def bucket(n: int) -> int:
    """The smallest of READ_STEP x 2^k and 1.5 x READ_STEP x 2^k (64, 96, 128, 192, 256, ...) at least n: the
    compiled step's capacities and reads, a few shapes (two per doubling), at most 1.5x what they hold."""
    b = READ_STEP
    while b < n:
        b = b * 3 // 2 if b & (b - 1) == 0 else b * 4 // 3
    return b


def slab_capacity(positions: int, compiled: bool) -> int:
    """The positions a wave's slab holds for rows of `positions` (longest prompt + max_new_tokens): as many in eager
    mode; in compiled mode a `bucket` (a few capacities, and graphs) and one spare slot, never read (every read is
    then a strict slice of the slab and the mask: the same strides, one compiled graph)."""
    return bucket(positions) + 1 if compiled else positions


def grow_step(n: int) -> int:
    """The positions by which an eager slab holding n grows: the smallest power of two s from 16 with s^2 >= 4n, at
    most 256 (16 up to 64 positions, 32 up to 256, 64 up to 1024, ...). Growing copies the slab, once every s steps;
    in between each step reads s / 2 unwritten positions on average: about 2 sqrt(n) balances the two."""
    s = 16
    while s * s < 4 * n and s < 256:
        s *= 2
    return s


def rounded(n: int) -> int:
    """n positions rounded up to a multiple of `grow_step(n)`: the size of an eager slab holding n. Constant from one
    size to the next (the steps change at 64, 256, 1024 and 4096, multiples of every smaller step)."""
    s = grow_step(n)
    return -(-n // s) * s


class SlabLayer(CacheLayerMixin):
    """One layer's keys and values, preallocated as [B, H, capacity, Dh]; updates write in place."""

    is_compileable = False
    is_sliding = False

    def __init__(self, capacity: int, whole_reads: bool = False):
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self.whole_reads = whole_reads  # decode steps read the whole slab (see the module's docstring)
        self.slot: torch.Tensor | None = None  # [1] long: static mode's write position (see SlabCache.make_static)
        self.read = capacity  # static mode: the positions a step reads (SlabCache.set_read)
        self.shared: SharedPrompt | None = None  # the prompt, once per prompt (share_prompts); the slab holds
        self.prompt = 0  # positions [prompt, length) then: the rows' own
        self.wraps = False  # a ring: position p is written at slab column (p - prompt) % own (SlabCache.admit)

    @property
    def own(self) -> int:
        """The slab columns a row can hold after the shared prompt (all of them without one; static mode: but the
        spare slot)."""
        return self.capacity - self.prompt - (self.slot is not None)

    def column(self, position: int) -> int:
        """The slab column of the wave's position `position` (a ring once rows were refilled)."""
        at = position - self.prompt
        return at % self.own if self.wraps else at

    def columns_before(self, position: int, n: int) -> torch.Tensor:
        """The slab columns of the n positions before `position` (where a refilled row's prompt goes)."""
        return torch.tensor([self.column(position - n + i) for i in range(n)])

    def lazy_initialization(self, key_states, value_states) -> None:
        B, H, q, Dk = key_states.shape
        size = min(self.capacity, rounded(q)) if self.whole_reads else self.capacity
        self.keys = key_states.new_zeros(B, H, size, Dk)
        self.values = value_states.new_zeros(B, H, size, value_states.shape[-1])
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def grow(self, size: int) -> None:
        """A slab of `size` positions holding the written ones (the rest zeros, never attended)."""
        if self.is_initialized and self.keys.shape[2] < size:
            written = self.length - self.prompt
            for name in ("keys", "values"):
                old = getattr(self, name)
                new = old.new_zeros(*old.shape[:2], size, old.shape[3])
                new[:, :, :written] = old[:, :, :written]
                setattr(self, name, new)
            self._tag()

    def share_prompt(self, rows: PromptRows) -> None:
        """Hold the prompt written so far once per prompt (the P rows of the prefill) and give the B `rows` an empty
        slab of their own positions after it."""
        if not self.is_initialized:
            return
        assert self.whole_reads and self.slot is None, "a shared prompt needs whole reads and the eager step"
        self.prompt = self.length
        keys, values = (t[:, :, : self.length].contiguous() for t in (self.keys, self.values))
        size = min(self.capacity - self.prompt, grow_step(0))
        B = rows.src.numel()
        self.keys = keys.new_zeros(B, keys.shape[1], size, keys.shape[3])
        self.values = values.new_zeros(B, values.shape[1], size, values.shape[3])
        self.shared = SharedPrompt(keys, values, rows)
        self._tag()

    def _tag(self) -> None:
        if self.shared is not None:  # the attention finds the prompt on the key tensor it is handed
            setattr(self.keys, SHARED, self.shared)

    def update(self, key_states, value_states, *args, **kwargs):
        if self.slot is not None:  # static: one position per row at `slot`; the mask hides unwritten positions
            self.keys.index_copy_(2, self.slot, key_states)
            self.values.index_copy_(2, self.slot, value_states)
            return self.keys[:, :, : self.read], self.values[:, :, : self.read]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        end = self.length + q
        assert self.wraps or end <= self.capacity, f"cache capacity {self.capacity} exceeded ({end} positions)"
        at = self.column(self.length)  # in the slab
        stop = at + q
        if stop > self.keys.shape[2]:
            self.grow(min(self.capacity - self.prompt, rounded(stop)))
        self.keys[:, :, at:stop] = key_states
        self.values[:, :, at:stop] = value_states
        decode = q == 1 and end > 1  # a step after the prefill (whose mask transformers builds to `end`)
        self.length = end
        if self.whole_reads and decode:  # the whole slab, dense, under the caller's mask
            return self.keys, self.values
        assert self.shared is None, "a shared prompt is read by decode steps only"
        return self.keys[:, :, :end], self.values[:, :, :end]

    def admit_rows(self, rows: torch.Tensor, fresh: SlabLayer, src: torch.Tensor, position: int) -> None:
        """Rows `rows [R]` start the prompts prefilled in `fresh` (row r the prompt src[r]), right-aligned to end
        just before the write of `position`; the slab, grown to its capacity, becomes a ring (copies per row)."""
        self.grow(self.own)
        self.wraps = True
        n = fresh.length
        cols = self.columns_before(position, n).to(rows.device)
        self.keys[rows[:, None], :, cols] = fresh.keys[src, :, :n].transpose(1, 2)  # [R, n, H, D] either side
        self.values[rows[:, None], :, cols] = fresh.values[src, :, :n].transpose(1, 2)

    def admit_prompts(self, fresh: SlabLayer, used: torch.Tensor, kept: PromptRows) -> None:
        """The prompts prefilled in `fresh` join the shared prompt (left-padded to its length); only the prompts
        `used` stay (of the old ones, then the new ones), read by the rows `kept`."""
        self.wraps = True
        shared, n = self.shared, fresh.length
        parts = []
        for old, new in ((shared.keys, fresh.keys), (shared.values, fresh.values)):
            padded = new.new_zeros(new.shape[0], new.shape[1], self.prompt, new.shape[3])
            padded[:, :, self.prompt - n :] = new[:, :, :n]
            parts.append(torch.cat([old, padded]).index_select(0, used))
        self.shared = SharedPrompt(*parts, kept)
        self._tag()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.slot is not None:
            return self.read, 0
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def select_rows(self, rows: torch.Tensor, kept: PromptRows | None = None, prompts=None) -> None:
        """Keep (and repeat) the rows `rows [B']` of the batch, in that order (shared prompt: `kept` places them,
        and only the prompts `prompts` stay, None: all)."""
        if self.is_initialized:
            self.keys = self.keys.index_select(0, rows)
            self.values = self.values.index_select(0, rows)
            if self.shared is not None:
                self.shared = self.shared.select(kept, prompts)
            self._tag()


class SlabCache(Cache):
    """A slab cache whose rows can be repeated (prompt -> samples) or dropped (finished groups)."""

    def __init__(self, num_layers: int, capacity: int, whole_reads: bool = False):
        super().__init__(layers=[SlabLayer(capacity, whole_reads) for _ in range(num_layers)])

    def read_length(self, live: int) -> int:
        """The positions a decode step reads when `live` are written (its mask's length): `live` where reads are
        slices, the slab's size after the write where they are whole, the static read otherwise."""
        layer = self.layers[0]
        if layer.slot is not None:
            return layer.read
        if not layer.whole_reads:
            return live
        size = min(layer.own, rounded(live - layer.prompt))
        return layer.prompt + max(size, layer.keys.shape[2] if layer.is_initialized else 0)

    def column(self, position: int) -> int:
        """The mask column (and static mode's write slot) of the wave's position `position` (`SlabLayer.column`,
        after the shared prompt)."""
        layer = self.layers[0]
        return layer.prompt + layer.column(position)

    def prompt_columns(self, n: int, position: int) -> torch.Tensor:
        """The mask columns of the n positions before `position`, where `admit` puts a new prompt."""
        layer = self.layers[0]
        if layer.shared is not None:
            return torch.arange(layer.prompt - n, layer.prompt)
        return layer.columns_before(position, n)  # copies: no prompt before the slab's columns

    def admit(self, rows: torch.Tensor, fresh: SlabCache, src: torch.Tensor, position: int) -> None:
        """The batch rows `rows [R]` (a finished group's) start anew on the prompts prefilled in `fresh`, row r on
        its prompt src[r]: the prompt ends just before the write of the wave's `position` (at `prompt_columns`),
        and from there the slab is a ring (a row holds at most its prompt and max_new_tokens, at most the
        capacity). Static mode: written in place, the same addresses."""
        shared = self.layers[0].shared
        if shared is None:
            for layer, new in zip(self.layers, fresh.layers):
                layer.admit_rows(rows, new, src, position)
            return
        src_all = shared.rows.src.index_copy(0, rows, src + shared.keys.shape[0])
        used = torch.unique(src_all)  # sorted: the prompts some row still reads
        kept = PromptRows.of(torch.searchsorted(used, src_all), used.numel())
        for layer, new in zip(self.layers, fresh.layers):
            layer.admit_prompts(new, used, kept)

    def set_read(self, live: int) -> int:
        """Static mode: the next steps read `live` positions rounded up to a `bucket` (at most the capacity);
        -> that read length."""
        read = min(self.layers[0].own, bucket(live))  # a ring (refilled rows) is read whole
        for layer in self.layers:
            layer.read = read
        return read

    def read_as(self, keep: torch.Tensor) -> None:
        """Static mode, inside the decode step: every layer reads as many positions as the mask `keep [B, L]` covers
        (the bucket `set_read` chose). Under torch.compile L is a symbolic size, so the graph serves every read
        bucket instead of being compiled once per bucket. Eager decoding (no slot) reads as `read_length` says."""
        if self.layers and self.layers[0].slot is not None:
            for layer in self.layers:
                layer.read = keep.shape[-1]

    def select_rows(self, rows: torch.Tensor) -> None:
        kept = prompts = None
        shared = self.layers[0].shared if self.layers else None
        if shared is not None:  # the rows' prompts, renumbered when some have no row left
            src = shared.rows.src[rows]
            used = torch.unique(src)  # sorted
            if used.numel() < shared.keys.shape[0]:
                src, prompts = torch.searchsorted(used, src), used
            kept = PromptRows.of(src, used.numel())
        for layer in self.layers:
            layer.select_rows(rows, kept, prompts)
        if self.layers and self.layers[0].slot is not None:
            self._mark_static()

    def share_prompts(self, src: torch.Tensor, prompts: int) -> None:
        """After the prefill of `prompts` prompts: rows continuing prompt src [B] each, the prompts' keys and values
        held once (`bridgelm.prompt_attention`) instead of copied to each row (`select_rows(src)`)."""
        rows = PromptRows.of(src, prompts)
        for layer in self.layers:
            layer.share_prompt(rows)

    def make_static(self, slot: torch.Tensor) -> None:
        """Static mode for a compiled decode step: every layer writes one position per row at `slot` ([1] long,
        updated in place by the caller) and returns its first `read` positions (`set_read`, its whole capacity until
        then); shapes change only with the batch's and the read's buckets."""
        for layer in self.layers:
            layer.grow(layer.capacity)
            layer.slot = slot
            layer.read = layer.capacity
        self._mark_static()

    def _mark_static(self) -> None:
        # Fixed addresses for CUDA graphs: the cache is mutated in place, never copied into the graph. guard=False
        # (torch 2.13's default; 2.8's is True): no guard on the tensors' identity, so a new generate call's
        # cache reuses the compiled step instead of compiling it again.
        if not torch.compiler.is_compiling():
            for layer in self.layers:
                if layer.is_initialized:
                    torch._dynamo.mark_static_address(layer.keys, guard=False)
                    torch._dynamo.mark_static_address(layer.values, guard=False)

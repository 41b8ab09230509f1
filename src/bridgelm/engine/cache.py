"""The engine's key/value cache: preallocated once per wave, written in place, its rows repeated or dropped.

A wave prefills each distinct prompt once into a `SlabCache` of capacity (longest prompt + max_new_tokens), then
`select_rows` copies each prompt's row to its samples and later drops the rows of finished groups. Decoding writes
one position per step into the slab, with no concatenation. `make_static` fixes every shape for the compiled step:
each layer then writes at one slot and returns its whole capacity, which the attention mask covers.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class SlabLayer(CacheLayerMixin):
    """One layer's keys and values, preallocated as [B, H, capacity, Dh]; updates write in place."""

    is_compileable = False
    is_sliding = False

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self.slot: torch.Tensor | None = None  # [1] long: static mode's write position (see SlabCache.make_static)

    def lazy_initialization(self, key_states, value_states) -> None:
        B, H, _, Dk = key_states.shape
        self.keys = key_states.new_zeros(B, H, self.capacity, Dk)
        self.values = value_states.new_zeros(B, H, self.capacity, value_states.shape[-1])
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if self.slot is not None:  # static: one position per row at `slot`; the mask hides unwritten positions
            self.keys.index_copy_(2, self.slot, key_states)
            self.values.index_copy_(2, self.slot, value_states)
            return self.keys, self.values
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        end = self.length + q
        if end > self.capacity:
            raise RuntimeError(f"cache capacity {self.capacity} exceeded ({end} positions)")
        self.keys[:, :, self.length : end] = key_states
        self.values[:, :, self.length : end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.slot is not None:
            return self.capacity, 0
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep (and repeat) the rows `rows [B']` of the batch, in that order."""
        if self.is_initialized:
            self.keys = self.keys.index_select(0, rows)
            self.values = self.values.index_select(0, rows)


class SlabCache(Cache):
    """A preallocated cache whose rows can be repeated (prompt -> samples) or dropped (finished groups)."""

    def __init__(self, num_layers: int, capacity: int):
        super().__init__(layers=[SlabLayer(capacity) for _ in range(num_layers)])

    def select_rows(self, rows: torch.Tensor) -> None:
        for layer in self.layers:
            layer.select_rows(rows)
        if self.layers and self.layers[0].slot is not None:
            self._mark_static()

    def make_static(self, slot: torch.Tensor) -> None:
        """Static mode for a compiled decode step: every layer writes one position per row at `slot` ([1] long,
        updated in place by the caller) and returns its whole capacity; shapes no longer change from step to step."""
        for layer in self.layers:
            layer.slot = slot
        self._mark_static()

    def _mark_static(self) -> None:
        # Fixed addresses for CUDA graphs: the cache is mutated in place, never copied into the graph.
        if not torch.compiler.is_compiling():
            for layer in self.layers:
                if layer.is_initialized:
                    torch._dynamo.mark_static_address(layer.keys)
                    torch._dynamo.mark_static_address(layer.values)

"""The decode step: one token per row through the model, eager or under torch.compile, from the same functions.

`decode_logits` (the attention mask, the Bridge groups, one forward) is the step; `decode_and_draw` is the step
followed by the sampler's sync-free draws (`sampler.deferred_draws`). Eager decoding calls them as they are, the
attention reading the cache's dense slab in place (`cache.SlabCache.read_length`); `compile=True` hands the same
functions to `torch.compile` (inductor; on CUDA `mode="reduce-overhead"`, i.e. CUDA graphs, the forward and the
draws in one graph). Compiled shapes are bucketed: the cache writes each step at one slot of a fixed capacity (a
`cache.bucket`) and attention reads the live positions rounded up to a bucket under the mask, and dropping
finished groups moves the batch to the next smaller bucket (`bucket_keep`: half the groups, padded with finished
ones), so a wave meets a few shapes. The read length is a symbolic size of the compiled graph, taken from the
mask: one compile serves every read bucket (CUDA graphs still record one replay per bucket, which is quick),
where a graph per bucket cost a 1.5B model over a minute of inductor each (gpu_check on an H200, issue 47). Refilled
rows (`bridgelm.engine.refill`) keep the batch's bucket, and the write slot goes around the slab's ring
(`cache.SlabCache.column`). The default (`compile=None`) compiles where it wins, CUDA (see docs/engine.md for the
CPU's measurements). `Stepper` runs a batch's steps either way.
"""

from __future__ import annotations

from collections.abc import Callable
import inspect
import warnings
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from bridgelm.attention import NAME as ATTENTION
from bridgelm.engine import sampler
from bridgelm.engine.cache import SlabCache
from bridgelm.engine.config import SamplingConfig
from bridgelm.errors import UserError
from bridgelm.grouped import KWARG, Groups
from bridgelm.layout import decoder_layers

_COMPILED: dict[tuple[str, str], Callable] = {}
_CACHE_ARG: dict[type, str] = {}  # a plain dict: torch.compile reads it as a constant inside the decode step


def cache_arg(model) -> str:
    """The name `model`'s forward takes its KV cache by: `cache` from transformers 5.24 (where `past_key_values`
    warns, and goes in 5.40), `past_key_values` before."""
    kind = type(model)
    if kind not in _CACHE_ARG:
        _CACHE_ARG[kind] = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return _CACHE_ARG[kind]


def layout_arg(model, groups) -> dict:
    """The forward's Bridge layout argument: `groups`; a model with blocks is given it even where it is None (rows
    alone, width 1), since without it a Bridge model warns of a decode step without groups (attach.py)."""
    return {KWARG: groups} if groups is not None or hasattr(model.config, "bridgelm") else {}


def decode_step(model, cache: Cache, tokens: torch.Tensor, positions: torch.Tensor, mask, groups) -> torch.Tensor:
    """One token per row through the model. tokens, positions [B] -> next-token logits [B, V]."""
    extra = {**layout_arg(model, groups), cache_arg(model): cache}
    out = model(input_ids=tokens[:, None], position_ids=positions[:, None], attention_mask=mask, use_cache=True,
                **extra)
    return out.logits[:, -1]


def decode_logits(model, cache: Cache, tokens, positions, keep, valid, width: int) -> torch.Tensor:
    """The decode step: the attention mask from `keep [B, L]`, the Bridge layout (contiguous groups of `width`,
    validity `valid [B]`, None: every row valid), one forward. -> next-token logits [B, V]. No host sync: what
    `torch.compile` compiles (always with a `valid` tensor, so that one graph serves every step)."""
    if isinstance(cache, SlabCache):
        cache.read_as(keep)
    groups = None
    if width > 1:
        groups = Groups.contiguous_width(tokens.shape[0], width, None if valid is None else valid[:, None])
    mask = attention_mask(model, keep, next(model.parameters()).dtype)
    return decode_step(model, cache, tokens, positions, mask, groups)


def decode_and_draw(model, cache: Cache, tokens, positions, keep, valid, width: int, u, temperature, top_p):
    """`decode_logits`, then the sampler's sync-free draws from the logits with uniforms u [B, DEFERRED_ROUNDS]:
    the compiled step on a GPU, one CUDA graph for the forward and the sampler (whose ~40 small kernels, launched
    one by one from the host, cost more than the model's forward on small models). temperature, top_p: 0-d
    tensors, so that other values reuse the graphs (top_p None: no nucleus).
    -> (logits [B, V], tokens [B], logprobs [B], unsure [B])."""
    logits = decode_logits(model, cache, tokens, positions, keep, valid, width)
    return (logits, *sampler.deferred_draws(logits, u, temperature, top_p))


def compile_wins(device) -> bool:
    """Whether the compiled decode step is on by default on `device` (SamplingConfig.compile=None): on CUDA only."""
    return torch.device(device).type == "cuda"


def compiled_step(device, draws: bool) -> Callable:
    """The decode step under torch.compile: `decode_and_draw` when the engine `draws` inside it (deferred draws),
    else `decode_logits`. CUDA graphs ("reduce-overhead") on CUDA, inductor elsewhere."""
    mode = "reduce-overhead" if torch.device(device).type == "cuda" else "default"
    fn = decode_and_draw if draws else decode_logits
    if (mode, fn.__name__) not in _COMPILED:
        # The read length is a symbolic size (Stepper marks the mask's last dimension dynamic): one compile serves
        # every read bucket of a capacity; batch buckets and capacities may make graphs of their own: allow more
        # than dynamo's default 8.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        _COMPILED[mode, fn.__name__] = torch.compile(fn, mode=mode)
    return _COMPILED[mode, fn.__name__]


def group_rows(groups: torch.Tensor, width: int) -> torch.Tensor:
    """The batch rows of contiguous groups `groups [G']` of `width` rows, in order: [G' * width]."""
    return (groups[:, None] * width + torch.arange(width, device=groups.device)).reshape(-1)


def bucket_keep(group_alive: torch.Tensor, width: int, live: int) -> torch.Tensor | None:
    """Compiled mode's compaction: rows of the next smaller bucket (half the groups: the `live` live ones, padded
    with finished ones, order kept), or None when the live groups do not fit in half or the groups are odd in
    number."""
    groups = group_alive.numel()
    if groups % 2 or live > groups // 2:
        return None
    order = torch.argsort((~group_alive).long(), stable=True)[: groups // 2]  # live groups first
    kept = order.sort().values  # [G/2] groups, in batch order
    return group_rows(kept, width)


def decodes_compiled(model, cfg: SamplingConfig, device) -> bool:
    """Whether `model` decodes with the compiled step: as `cfg.compile` asks (None: where it wins), unless
    `uncompiled_reason` gives a reason not to, which is then said once (never a silent fall-back to eager)."""
    if not (compile_wins(device) if cfg.compile is None else cfg.compile):
        return False
    reason = uncompiled_reason(model)
    if reason is not None and reason not in _TOLD:
        _TOLD.add(reason)
        warnings.warn(f"the engine's decode step runs uncompiled: {reason}", RuntimeWarning, stacklevel=2)
    return reason is None


_TOLD: set[str] = set()  # the reasons already said in this process


def uncompiled_reason(model) -> str | None:
    """Why the compiled step cannot serve `model` (None: it can): FSDP's hooks around every layer break its graph
    (a model sharded by FSDP2 samples eagerly, gathered once); a model whose layers cannot share one ready mask
    builds its masks from positions the static cache does not track."""
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return (
            "the model is sharded by FSDP, whose hooks around every layer break the compiled graph (rl samples from a "
            "plain, compiled bf16 replica under --fsdp --bf16 or --rollout-dtype bfloat16)"
        )
    if not _static_mask_ok(model):
        return "its layers need masks of their own (sliding-window layers, or an attention backend other than sdpa)"
    return None


def _full_attention_only(config) -> bool:
    """No sliding-window layers: one ready-made mask then serves every layer."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return all(t == "full_attention" for t in types)
    return getattr(config, "sliding_window", None) is None


def reads_whole(model) -> bool:
    """Whether the decode step may read the cache's whole slab (`cache.SlabLayer.whole_reads`): where it hands
    every layer one ready mask, which then covers the slab (other models build their masks from the cache's
    length)."""
    return _static_mask_ok(model)


# The attention classes known to hand the cache's keys and values to the attention function as the cache returns
# them, which a shared prompt needs (tests/test_engine_cache.py samples each alike with prompts shared and copied),
# among those that attend through sdpa (the only ones bridgelm's attention serves). Others change them after the
# cache (DiffLlama splits its values, Doge masks by them) or were not tried: their prompts are copied.
PASSES_CACHE_THROUGH = frozenset({
    "LlamaAttention", "MistralAttention", "MixtralAttention", "Qwen2Attention", "Qwen2MoeAttention", "Qwen3Attention",
    "Qwen3MoeAttention", "GemmaAttention", "Gemma3Attention", "Phi3Attention", "GraniteAttention",
    "Glm4Attention", "SmolLM3Attention",
})  # fmt: skip


def shares_prompts(model, compiled: bool) -> bool:
    """Whether a wave's cache holds each prompt's keys and values once, not once per sample
    (`bridgelm.prompt_attention`): eager steps that read the whole slab, under bridgelm's attention (the model
    switched to it by `fast_attention`), which reads the shared prompt, in layers that pass the cache's tensors to
    it (`PASSES_CACHE_THROUGH`)."""
    impl = getattr(model.config.get_text_config(), "_attn_implementation", None)
    if compiled or not reads_whole(model) or impl != ATTENTION:
        return False
    try:  # the decoder's own layers (a composite model's vision tower attends otherwise, and has no cache)
        kinds = {type(layer.self_attn).__name__ for layer in decoder_layers(model)}
    except UserError:
        return False
    return kinds <= PASSES_CACHE_THROUGH


def _static_mask_ok(model) -> bool:
    """Whether every layer can take one ready 4D mask: full attention with the sdpa (or bridgelm's) or eager
    backend. The compiled step needs it; other models get the 2D padding mask."""
    impl = getattr(model.config, "_attn_implementation", "sdpa")
    return _full_attention_only(model.config.get_text_config()) and impl in ("sdpa", ATTENTION, "eager")


def attention_mask(model, keep: torch.Tensor, dtype: torch.dtype):
    """The mask to hand to the model for one decode step: keep [B, L] bool -> 4D when the backend takes it.

    Models with sliding-window layers, and backends other than sdpa/eager, get the 2D padding mask and build
    their own masks (slower, always right).
    """
    if not _static_mask_ok(model):
        return keep.long()  # the model builds its own masks from the 2D padding mask
    if model.config._attn_implementation == "eager":
        return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)[
            :, None, None, :
        ]
    return keep[:, None, None, :]  # sdpa and bridgelm's attention take the boolean mask


@dataclass
class Stepper:
    """A wave's decode steps, eager or compiled: the same `decode_logits` (and draws) either way."""

    model: torch.nn.Module  # the model being sampled
    width: int  # Bridge group width
    fn: Callable | None = None  # the compiled step; None: eager
    slot: torch.Tensor | None = None  # [1] long: the compiled cache's write position, updated in place
    knobs: tuple = ()  # (temperature, top_p or None) as 0-d tensors when the compiled step draws; () otherwise

    @classmethod
    def build(cls, model, cache: SlabCache, cfg: SamplingConfig, compiled: bool, deferred: bool) -> Stepper:
        """The stepper of a wave whose cache is filled and expanded (compiled: made static here)."""
        if not compiled:
            return cls(model, cfg.width)
        device = next(model.parameters()).device
        knobs = ()
        if deferred:  # the sampler's settings as tensors: graph inputs, not constants baked into the graph
            top_p = torch.tensor(cfg.top_p, device=device) if cfg.top_p < 1.0 else None
            knobs = (torch.tensor(cfg.temperature, device=device), top_p)
        slot = torch.zeros(1, dtype=torch.long, device=device)
        cache.make_static(slot)
        return cls(model, cfg.width, compiled_step(device, draws=deferred), slot, knobs)

    @property
    def compiled(self) -> bool:
        """Whether the steps run compiled (static shapes: compaction moves to the next smaller bucket)."""
        return self.fn is not None

    @property
    def draws(self) -> bool:
        """Whether the step draws the next tokens itself (and takes their uniforms)."""
        return bool(self.knobs)

    def __call__(self, cache, inputs, pos, mask, valid, all_valid: bool, at: int, u=None):
        """Logits [B, V] of the inputs [B] at positions pos [B], written at cache slot `at`; mask [B, capacity] holds
        the slots each row attends to (up to `at` included), valid [B] the rows whose input is real. -> (logits,
        (tokens, logprobs, unsure) drawn with uniforms u [B, DEFERRED_ROUNDS] when the step draws, else None)."""
        if self.fn is None:  # the mask up to what the cache reads; no validity while every row is valid
            valid = None if all_valid else valid
            keep = mask[:, : cache.read_length(at + 1)]
            return decode_logits(self.model, cache, inputs, pos, keep, valid, self.width), None
        self.slot.fill_(cache.column(at))  # every layer writes there; the mask covers the positions read, a bucket
        mask = mask[:, : cache.set_read(at + 1)]
        torch._dynamo.maybe_mark_dynamic(mask, 1)  # the read bucket: a symbolic size, not a graph per bucket
        if not self.draws:
            return self.fn(self.model, cache, inputs, pos, mask, valid, self.width), None
        logits, *drawn = self.fn(self.model, cache, inputs, pos, mask, valid, self.width, u, *self.knobs)
        return logits, tuple(drawn)

"""The sampling engine: N interdependent samples per prompt, in Bridge groups of width w.

Design (token ids in, token ids out; tokenizing happens in `bridgelm.generate` at the edges):
- Prompts stream through the batch in waves bounded by `max_batch_sequences` rows and `max_batch_tokens`
  (rows x (longest prompt + max_new_tokens)). A wave prefills each distinct prompt ONCE (left-padded, ragged
  lengths, per-row position ids) into a preallocated cache, then copies the cache rows to the prompt's samples.
  Prefill needs no grouping: the samples of a group are identical there, so Bridge acts on identical rows.
- Samples j*w .. (j+1)*w-1 of a prompt form one Bridge group; rows of a wave are contiguous groups, so the
  blocks use the reshape layout (no gather).
- Decoding writes into the preallocated cache (no concatenation), passes a ready 4D mask, and samples with an
  exact top-p that never sorts the vocabulary. A row that emitted EOS at step t is still fed at
  t+1 (its EOS is valid at that position, its siblings attend to it) and masked from then on, exactly as
  `grouped_logits` defines validity. A group whose rows all finished is dropped from the batch.
- Log-probs are those of the sampled token under softmax(logits / temperature), before top-p/top-k
  truncation (temperature 1 for greedy decoding): the distribution a GRPO trainer recomputes with a
  teacher-forced forward at the same temperature.
- Foreign groups (`foreign_groups=True`, a control, not a way to sample): sample j of `width` consecutive
  prompts form one group, so that a Bridge block sees the samples of other prompts, aligned by generation step,
  instead of its siblings. Prefill is unchanged (each prompt alone, as ever); grouping starts with the first
  generated token. The number of prompts must be a multiple of the width.
- The decode step (`decode_logits`: mask, groups, one forward) is a small function that `compile=True` hands to
  `torch.compile` (inductor; on CUDA `mode="reduce-overhead"`, i.e. CUDA graphs). Compiled shapes are static: the
  cache writes each step at one slot of a fixed capacity (rounded up to a multiple of 64) and attention reads the
  whole capacity under the mask, and dropping finished groups moves the batch to the next smaller bucket (half the
  groups, padded with finished ones) instead of an arbitrary size, so a wave meets a few shapes, each compiled
  once. On a GPU the compiled step of random sampling without top-k also draws the next tokens
  (`decode_and_draw`): one CUDA graph per step.
  Default (`compile=None`): on where it wins, CUDA; off on CPU, where compiling costs tens of seconds per shape
  and the compiled step is slower: its linears are ATen's (MKL), not the eager step's packed oneDNN ones (fp32 30M
  benchmark model on an AVX2 AMD EPYC, `benchmarks/generate.py --compile`: 410 tok/s against about 1,075 eager,
  with inductor's weight freezing no better). Routing its linears to the packed oneDNN kernel (an opaque custom op)
  does not save it: inductor then fuses each layer's rotary, cache write and expansion of the grouped keys and
  values over the whole capacity into two kernels of 15-20 ms each (a step of 64 rows at capacity 256: 250 ms,
  against 70 ms eager; 2026-11-25).
- Each wave decodes under `bridgelm.attention.fast_attention`: the attention over the cache is two matmuls, on
  CPU in half precision (1.3-2x faster than the fused kernel per call; float32 keeps the kernel) and on CUDA in
  every dtype (no copy of the keys and values per query head).
- Randomness is explicit: every sample draws from generators seeded with (seed, prompt key, sample index), so
  a prompt gets the same samples whatever shares its batch, and resumed or sharded runs redraw them exactly.
"""

from __future__ import annotations

import contextlib
import hashlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from bridgelm.attention import NAME as ATTENTION
from bridgelm.attention import fast_attention
from bridgelm.errors import DataWarning, check_int, check_number
from bridgelm.grouped import KWARG, Groups
from bridgelm.packed import packed_linears
from bridgelm.tokenizer import unknown_characters

# The smallest temperature above 0. Sampling is greedy in all but name long before it; far below it logits /
# temperature overflow float32 (1e-45 gave inf logits, NaN log-probs and one repeated token).
MIN_TEMPERATURE = 1e-6


def check_sampling(temperature: float, top_p: float, prefix: str = "", greedy: bool = True, why: str = "") -> None:
    """ValueError naming `prefix + "temperature"` / `prefix + "top_p"` unless temperature is 0 (when `greedy`) or at
    least MIN_TEMPERATURE, and top_p is in (0, 1]; NaN and infinities are refused. `why` ends the message of a
    temperature refused where sampling cannot be greedy."""
    check_number(f"{prefix}top_p", top_p, 0, 1, open_low=True)
    name = f"{prefix}temperature"
    if greedy and temperature == 0 and not isinstance(temperature, bool):
        return
    check_number(name, temperature, 0, open_low=not greedy, note=" (0 = greedy)" if greedy else why)
    if temperature < MIN_TEMPERATURE:
        raise ValueError(
            f"{name}={temperature!r}: expected {'0 (greedy) or ' if greedy else ''}at least {MIN_TEMPERATURE} "
            f"(sampling is greedy in all but name before that, and far below it logits / temperature overflow){why}"
        )


@dataclass
class SamplingConfig:
    """How to sample; every field has the paper's evaluation default where it has one."""

    n: int = 8  # samples per prompt
    width: int = 1  # Bridge group width w (w divides n); 1 = independent samples
    max_new_tokens: int = 256  # generated tokens per sample, at most
    temperature: float = 0.6  # 0 = greedy
    top_p: float = 0.95  # nucleus mass in (0, 1]
    top_k: int = 0  # 0 = off
    seed: int = 0  # seeds the torch.Generator of the whole run
    max_batch_sequences: int = 256  # rows decoded together, at most
    max_batch_tokens: int = 262_144  # rows x (longest prompt + max_new_tokens) of a wave, at most
    compact_fraction: float = 0.125  # drop finished groups once they are this fraction of the batch (0: each one)
    foreign_groups: bool = False  # control: group sample j of `width` different prompts (see "Foreign groups")
    compile: bool | None = None  # torch.compile the decode step; None: where it wins (CUDA), see compile_wins
    pack_weights: bool = True  # eager CPU decoding packs linear weights for oneDNN once per wave (bridgelm.packed)

    def validate(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n={self.n!r} must be a positive integer")
        if not isinstance(self.width, int) or self.width < 1:
            raise ValueError(f"width={self.width!r} must be a positive integer")
        if self.n % self.width and not self.foreign_groups:
            raise ValueError(f"width={self.width} must divide n={self.n}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be >= 1")
        check_sampling(self.temperature, self.top_p)
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be >= 0 (0 = off)")
        check_number("compact_fraction", self.compact_fraction, 0, 1, note=" (0: at every finished group)")
        for name in ("max_batch_sequences", "max_batch_tokens"):
            check_int(name, getattr(self, name))
        if self.max_batch_sequences < self.width:
            raise ValueError(
                f"max_batch_sequences={self.max_batch_sequences} must hold at least one group of width {self.width}"
            )
        if self.foreign_groups and self.max_batch_sequences < self.width * self.n:
            raise ValueError(
                f"foreign_groups: max_batch_sequences={self.max_batch_sequences} must hold width x n = "
                f"{self.width * self.n} rows (the samples of `width` prompts decoded together)"
            )


@dataclass
class GeneratedIds:
    """One sample, as token ids."""

    token_ids: list[int]  # generated ids, ending with the EOS id when `finished`
    logprobs: list[float]  # log-prob of each generated id (see the module docstring for the temperature)
    finished: bool  # ended by EOS or a stop string (False: ran out of max_new_tokens)


# ---------------------------------------------------------------------------------------------- the cache


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


# ---------------------------------------------------------------------------------------------- the sampler


# The shortcut of `in_nucleus` holds while a row's probabilities sum to 1 within this (float32 sums of 10^5-10^6
# terms stay within 1e-5 of 1); rows nearer the bound take the exact sum.
NUCLEUS_MARGIN = 1e-4


def in_nucleus(
    probs: torch.Tensor,
    tokens: torch.Tensor,
    top_p: float,
    scratch: torch.Tensor | None = None,
    all_rows: bool = False,
) -> torch.Tensor:
    """Whether each token is in its row's top-p nucleus. probs [B, V] (rows sum to 1), tokens [B] -> [B] bool.

    The nucleus is the smallest set of most probable tokens whose mass reaches top_p: a token belongs to it
    exactly when the tokens strictly more probable than it hold less than top_p. No sort, and most rows need no
    pass over the vocabulary at all: the mass above a token is at most 1 - p(token), so a token more probable than
    1 - top_p (with a margin for rounding) is in the nucleus. Only the other rows sum the mass above their token,
    as sum(relu(p - p_tok)) + p_tok x #{p > p_tok} (elementwise passes that vectorise; a boolean mask and `where`
    cost 5-7x more on CPU). `scratch` ([B, V] float, optional) receives the differences. `all_rows`: sum every
    row, with no host sync (on a GPU a pass over all rows costs less than a sync); the same answers.
    """
    p_tok = probs.gather(-1, tokens[:, None])  # [B, 1]
    sure = p_tok[:, 0] > (1.0 - top_p) + NUCLEUS_MARGIN  # [B]
    rest = None  # [R] rows that need the sum; None: all of them
    sub, p_sub = probs, p_tok
    if not all_rows:
        rest = torch.nonzero(~sure)[:, 0]  # the one host sync
        if rest.numel() == 0:
            return sure
        if rest.numel() == len(sure):
            rest = None
        else:
            sub, p_sub = probs[rest], p_tok[rest]
            scratch = None if scratch is None else scratch[: rest.numel()]  # [R, V]: its first rows
    diff = torch.sub(sub, p_sub, out=scratch).relu_()  # [R, V]
    excess = diff.sum(-1)  # [R]: sum over the tokens above p_tok of (p - p_tok); p > p_tok exactly when p - p_tok > 0
    count = diff.sign_().sum(-1)  # [R]: how many tokens are above
    accepted = ~(excess + p_sub[:, 0] * count >= top_p)  # a NaN row (diverged logits) is accepted, as ever
    if rest is None:
        return sure | accepted
    out = sure.clone()
    out[rest] = accepted
    return out


# uniform(rows, attempt) -> [len(rows)] uniforms in [0, 1): the draws of those batch rows, `attempt`-th try.
Uniform = Callable[[torch.Tensor, int], torch.Tensor]


def generator_uniform(generator: torch.Generator | None) -> Uniform:
    """Uniforms from one generator (the draws then depend on the batch's composition)."""
    return lambda rows, attempt: torch.rand(len(rows), generator=generator, device=rows.device)


def _draw(probs: torch.Tensor, u: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """One draw per row by inverse CDF. probs [B, V] (unnormalised is fine), u [B] uniforms -> [B] ids.
    `scratch` ([B, V] float, optional) receives the CDF."""
    return _search(torch.cumsum(probs, -1, out=scratch), u)


def _search(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The draw of each row from its CDF: cdf [B, V] (unnormalised), u [B] uniforms -> [B] ids."""
    target = u.to(cdf.dtype)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=cdf.shape[-1] - 1)


def _redraw_rejected(probs, tokens, ok, top_p: float, uniform: Uniform, attempt: int) -> torch.Tensor:
    """Redraw the rows whose token is outside the nucleus (`ok` False) with attempts attempt+1, attempt+2, ...
    until every row is accepted (one host sync per round); updates `tokens` and `ok` in place -> tokens."""
    while (redo := torch.nonzero(~ok)[:, 0]).numel():
        attempt += 1
        tokens[redo] = _draw(probs[redo], uniform(redo, attempt))
        ok[redo] = in_nucleus(probs[redo], tokens[redo], top_p)
    return tokens


class SamplerBuffers:
    """Two float32 [rows, V] buffers that every step of a wave reuses (the softmax and a scratch), sliced to the
    step's rows. On CPU a fresh tensor of several MB per elementwise pass comes from fresh pages, whose faults cost
    more than the pass itself (the 30M benchmark's sampler, 64 rows x 24k: 8-10 ms a step before these buffers and
    `in_nucleus`'s sum without a mask, 2.4 ms after; the same draws in the runs compared)."""

    def __init__(self):
        self.probs: torch.Tensor | None = None  # [rows, V] float32
        self.scratch: torch.Tensor | None = None  # [rows, V] float32

    def take(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(probs, scratch) views of [B, V] for logits [B, V]; reallocated when B grows or V or the device change."""
        B, V = logits.shape
        if (
            self.probs is None
            or self.probs.shape[0] < B
            or self.probs.shape[1] != V
            or self.probs.device != logits.device
        ):
            self.probs = logits.new_empty(B, V, dtype=torch.float32)
            self.scratch = torch.empty_like(self.probs)
        return self.probs[:B], self.scratch[:B]


@torch.no_grad()
def sample_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    top_k: int,
    rand: torch.Generator | Uniform | None,
    buffers: SamplerBuffers | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row. logits [B, V] -> (tokens [B], logprobs [B] under softmax(logits / T)).

    Top-p without sorting: draw from the (top-k) distribution and redraw the rows whose token fell outside the
    nucleus. Accepted draws follow the renormalised nucleus exactly; each round accepts with probability equal
    to the nucleus mass (>= top_p), so a round or two suffices. `rand` is a generator or a `Uniform`; `buffers`
    (the engine passes one per wave) keeps the [B, V] passes in the same memory from step to step.
    """
    uniform = rand if callable(rand) else generator_uniform(rand)
    if temperature == 0:
        logits = logits.float()
        tokens = logits.argmax(-1)
        return tokens, logits.gather(-1, tokens[:, None])[:, 0] - torch.logsumexp(logits, -1)
    full, scratch = (buffers or SamplerBuffers()).take(logits)  # [B, V] float32 each
    scratch.copy_(logits).div_(temperature)  # the same float32 values as logits.float() / temperature
    torch.softmax(scratch, -1, out=full)  # one fused pass; log-probs only of drawn tokens
    ids = None
    probs = full
    if top_k and top_k < full.shape[-1]:
        vals, ids = full.topk(top_k, -1)  # [B, k]
        probs = vals / vals.sum(-1, keepdim=True)  # renormalised over the top k
        scratch = None
    every = torch.arange(probs.shape[0], device=probs.device)
    tokens = _draw(probs, uniform(every, 0), scratch)
    if top_p < 1.0:
        _redraw_rejected(probs, tokens, in_nucleus(probs, tokens, top_p, scratch), top_p, uniform, 0)
    if ids is not None:
        tokens = ids.gather(-1, tokens[:, None])[:, 0]
    return tokens, full.gather(-1, tokens[:, None])[:, 0].log()


DEFERRED_ROUNDS = 4  # draws per row per step made without a host sync by `sample_tokens_deferred`


@torch.library.custom_op("bridgelm::cumsum_rows", mutates_args=())
def cumsum_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.cumsum over the last dimension, opaque to torch.compile: inductor (torch 2.11) fails to generate the
    split scan of a wide row block ([64, 24000]), so the compiled step calls ATen's kernel instead."""
    return torch.cumsum(x, -1)


@cumsum_rows.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _deferred_draws(
    logits: torch.Tensor, u: torch.Tensor, temperature, top_p, nucleus: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [B, V], u [B, DEFERRED_ROUNDS] uniforms -> (tokens [B], logprobs [B], unsure [B]); no host sync.
    `temperature` and `top_p`: floats, or 0-d tensors (the compiled step: one graph for every value); `nucleus`:
    whether top_p < 1."""
    probs = torch.softmax(logits.float() / temperature, -1)  # [B, V], the values `sample_tokens` computes
    cdf = cumsum_rows(probs) if torch.compiler.is_compiling() else torch.cumsum(probs, -1)  # [B, V], every attempt
    tokens = _search(cdf, u[:, 0])
    ok = torch.ones_like(tokens, dtype=torch.bool)
    if nucleus:
        ok = in_nucleus(probs, tokens, top_p, all_rows=True)
        for attempt in range(1, DEFERRED_ROUNDS):
            tokens = torch.where(ok, tokens, _search(cdf, u[:, attempt]))
            ok = ok | in_nucleus(probs, tokens, top_p, all_rows=True)
    return tokens, probs.gather(-1, tokens[:, None])[:, 0].log(), ~ok


@torch.no_grad()
def sample_tokens_deferred(
    logits: torch.Tensor, temperature: float, top_p: float, uniform: Uniform
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`sample_tokens` (temperature > 0, no top-k) without a host sync, for GPUs: the same draws.

    Attempts 0..DEFERRED_ROUNDS-1 of every row are made on all rows at once (one CDF, then one search and one
    nucleus test per attempt); a row keeps its first accepted draw, as in `sample_tokens`. -> (tokens [B],
    logprobs [B], unsure [B] bool): rows with no accepted draw yet (about (1 - top_p)^DEFERRED_ROUNDS of them at
    most), which `finish_deferred` completes once the caller has synced. The compiled engine draws the same
    way inside its decode step (`decode_and_draw`).
    """
    every = torch.arange(logits.shape[0], device=logits.device)
    rounds = getattr(uniform, "rounds", None)
    u = rounds(every) if rounds else torch.stack([uniform(every, a) for a in range(DEFERRED_ROUNDS)], -1)
    return _deferred_draws(logits, u, temperature, top_p, top_p < 1.0)


def defers_draws(device, cfg: SamplingConfig) -> bool:
    """Whether the engine draws with `sample_tokens_deferred`: on a GPU, where a host sync in the middle of a step
    leaves the GPU idle while the host queues the rest of the step's kernels one by one. On the CPU, syncs are
    free and the extra nucleus passes are not."""
    return torch.device(device).type == "cuda" and cfg.temperature > 0 and not cfg.top_k


def finish_deferred(
    logits: torch.Tensor, tokens: torch.Tensor, unsure: torch.Tensor, temperature: float, top_p: float, uniform: Uniform
) -> tuple[torch.Tensor, torch.Tensor]:
    """Complete `sample_tokens_deferred`'s unsure rows with attempts DEFERRED_ROUNDS, ... (host syncs; rare).
    -> (tokens [B], logprobs [B])."""
    probs = torch.softmax(logits.float() / temperature, -1)
    tokens = _redraw_rejected(probs, tokens.clone(), ~unsure, top_p, uniform, DEFERRED_ROUNDS - 1)
    return tokens, probs.gather(-1, tokens[:, None])[:, 0].log()


def _stream_seed(*keys) -> int:
    digest = hashlib.sha256(repr(keys).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class SampleRandomness:
    """The uniforms of every sample, fixed by (seed, prompt key, sample index, step, attempt).

    A sample's draws then do not depend on which prompts share its batch, on the batch bounds, on resuming or on
    sharding: the same prompt key gives the same samples. The first ROUNDS attempts of a step come from a table
    drawn once per prompt; the rare later attempts from a generator seeded with the full coordinates.
    """

    ROUNDS = DEFERRED_ROUNDS  # table attempts per step; the GPU sampler makes them all at once

    def __init__(self, seed: int, jobs: Sequence[_Job], keys: Sequence, n: int, steps: int, device):
        parts, self.coords = [], []
        for job in jobs:
            key = keys[job.prompt]
            g = torch.Generator().manual_seed(_stream_seed(seed, key))
            # Drawn step-major, so that the draws of step t do not depend on max_new_tokens (prefix-consistent).
            table = torch.rand(steps, n, self.ROUNDS, generator=g).transpose(0, 1)  # [n, steps, ROUNDS]
            parts.append(table[job.first : job.first + job.count])
            self.coords += [(key, job.first + j) for j in range(job.count)]
        self.table = torch.cat(parts).to(device)  # [B, steps, ROUNDS]
        self.seed = seed
        self.rows = None  # [B'] wave row of each batch row, set every step
        self.step = 0

    def rounds(self, batch_rows: torch.Tensor) -> torch.Tensor:
        """The uniforms of attempts 0..ROUNDS-1 of the current step: [len(batch_rows), ROUNDS], one gather."""
        return self.table[self.rows[batch_rows], self.step]

    def __call__(self, batch_rows: torch.Tensor, attempt: int) -> torch.Tensor:
        rows = self.rows[batch_rows]
        if attempt < self.ROUNDS:
            return self.table[rows, self.step, attempt]
        out = [
            torch.rand(
                1, generator=torch.Generator().manual_seed(_stream_seed(self.seed, *self.coords[r], self.step, attempt))
            )
            for r in rows.tolist()
        ]
        return torch.cat(out).to(self.table.device)


def decode_step(model, cache: Cache, tokens: torch.Tensor, positions: torch.Tensor, mask, groups) -> torch.Tensor:
    """One token per row through the model. tokens, positions [B] -> next-token logits [B, V]."""
    extra = {KWARG: groups} if groups is not None else {}
    out = model(
        input_ids=tokens[:, None],
        position_ids=positions[:, None],
        attention_mask=mask,
        past_key_values=cache,
        use_cache=True,
        **extra,
    )
    return out.logits[:, -1]


def decode_logits(model, cache: Cache, tokens, positions, keep, valid, width: int) -> torch.Tensor:
    """The decode step: the attention mask from `keep [B, L]`, the Bridge layout (contiguous groups of `width`,
    validity `valid [B]`, None: every row valid), one forward. -> next-token logits [B, V]. No host sync: what
    `torch.compile` compiles (always with a `valid` tensor, so that one graph serves every step)."""
    groups = None
    if width > 1:
        groups = Groups.contiguous_width(tokens.shape[0], width, None if valid is None else valid[:, None])
    mask = _attention_mask(model, keep, next(model.parameters()).dtype)
    return decode_step(model, cache, tokens, positions, mask, groups)


def decode_and_draw(model, cache: Cache, tokens, positions, keep, valid, width: int, u, temperature, top_p, nucleus):
    """`decode_logits`, then `sample_tokens_deferred`'s draws from the logits with uniforms u [B, DEFERRED_ROUNDS]:
    the compiled step on a GPU, one CUDA graph for the forward and the sampler (whose ~40 small kernels, launched
    one by one from the host, cost more than the model's forward on small models). temperature, top_p: 0-d
    tensors, so that other values reuse the graphs; nucleus: top_p < 1.
    -> (logits [B, V], tokens [B], logprobs [B], unsure [B])."""
    logits = decode_logits(model, cache, tokens, positions, keep, valid, width)
    return (logits, *_deferred_draws(logits, u, temperature, top_p, nucleus))


def compile_wins(device) -> bool:
    """Whether the compiled decode step is on by default on `device` (SamplingConfig.compile=None): on CUDA only."""
    return torch.device(device).type == "cuda"


_COMPILED: dict[tuple[str, str], Callable] = {}
CAPACITY_STEP = 64  # compiled mode rounds the cache capacity up to a multiple of this (fewer distinct shapes)


def compiled_step(device, draws: bool) -> Callable:
    """The decode step under torch.compile: `decode_and_draw` when the engine `draws` inside it (deferred draws),
    else `decode_logits`. CUDA graphs ("reduce-overhead") on CUDA, inductor elsewhere."""
    mode = "reduce-overhead" if torch.device(device).type == "cuda" else "default"
    fn = decode_and_draw if draws else decode_logits
    if (mode, fn.__name__) not in _COMPILED:
        # Each (model, batch bucket, capacity) is one graph: allow more of them than dynamo's default 8.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        _COMPILED[mode, fn.__name__] = torch.compile(fn, mode=mode, dynamic=False)
    return _COMPILED[mode, fn.__name__]


def _bucket_keep(group_alive: torch.Tensor, width: int, live: int) -> torch.Tensor | None:
    """Compiled mode's compaction: rows of the next smaller bucket (half the groups: the `live` live ones, padded
    with finished ones, order kept), or None when the live groups do not fit in half or the groups are odd in
    number."""
    groups = group_alive.numel()
    if groups % 2 or live > groups // 2:
        return None
    order = torch.argsort((~group_alive).long(), stable=True)[: groups // 2]  # live groups first
    kept = order.sort().values  # [G/2] groups, in batch order
    return (kept[:, None] * width + torch.arange(width, device=kept.device)).reshape(-1)


def decodes_compiled(model, cfg: SamplingConfig, device) -> bool:
    """Whether `model` decodes with the compiled step: as `cfg.compile` asks (None: where it wins), and only when one
    ready mask serves every layer (otherwise the model builds its masks from positions the static cache does not
    track, and the eager step runs)."""
    compiled = compile_wins(device) if cfg.compile is None else cfg.compile
    return compiled and _static_mask_ok(model)


def _full_attention_only(config) -> bool:
    """No sliding-window layers: one ready-made mask then serves every layer."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return all(t == "full_attention" for t in types)
    return getattr(config, "sliding_window", None) is None


def _static_mask_ok(model) -> bool:
    """Whether every layer can take one ready 4D mask: full attention with the sdpa (or bridgelm's) or eager
    backend. The compiled step needs it; other models get the 2D padding mask."""
    impl = getattr(model.config, "_attn_implementation", "sdpa")
    return _full_attention_only(model.config.get_text_config()) and impl in ("sdpa", ATTENTION, "eager")


def _attention_mask(model, keep: torch.Tensor, dtype: torch.dtype):
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
class _Job:
    prompt: int  # index of the prompt
    first: int  # index of its first sample in this job
    count: int  # samples in this job (a multiple of the width)


@dataclass
class _Wave:
    jobs: list[_Job] = field(default_factory=list)
    longest: int = 0


def plan_waves(lengths: Sequence[int], cfg: SamplingConfig) -> list[_Wave]:
    """Split (prompt, samples) work into waves that respect the batch bounds, keeping prompt order."""
    per_row = lambda longest: longest + cfg.max_new_tokens  # noqa: E731
    if cfg.foreign_groups:
        return _plan_foreign_waves(lengths, cfg)
    waves: list[_Wave] = []
    current = _Wave()
    rows = 0
    for p, length in enumerate(lengths):
        # Largest chunk of whole groups that fits a wave alone.
        fit = min(cfg.max_batch_sequences, cfg.max_batch_tokens // per_row(length))
        chunk = (fit // cfg.width) * cfg.width
        if chunk < cfg.width:
            raise ValueError(
                f"max_batch_tokens={cfg.max_batch_tokens} cannot hold one group of {cfg.width} rows of "
                f"{per_row(length)} tokens (prompt {p} has {length} tokens + max_new_tokens={cfg.max_new_tokens})"
            )
        first = 0
        while first < cfg.n:
            count = min(chunk, cfg.n - first)
            longest = max(current.longest, length)
            if current.jobs and (
                rows + count > cfg.max_batch_sequences or (rows + count) * per_row(longest) > cfg.max_batch_tokens
            ):
                waves.append(current)
                current, rows = _Wave(), 0
                longest = length
            current.jobs.append(_Job(p, first, count))
            current.longest = longest
            rows += count
            first += count
    if current.jobs:
        waves.append(current)
    return waves


def _plan_foreign_waves(lengths: Sequence[int], cfg: SamplingConfig) -> list[_Wave]:
    """Waves of whole blocks of `width` prompts with all their samples (foreign groups)."""
    w = cfg.width
    if len(lengths) % w:
        raise ValueError(f"foreign_groups: {len(lengths)} prompts is not a multiple of width={w}")
    waves: list[_Wave] = []
    current = _Wave()
    for start in range(0, len(lengths), w):
        longest = max(current.longest, *lengths[start : start + w])
        rows = (len(current.jobs) + w) * cfg.n
        if current.jobs and (
            rows > cfg.max_batch_sequences or rows * (longest + cfg.max_new_tokens) > cfg.max_batch_tokens
        ):
            waves.append(current)
            current = _Wave()
            longest = max(lengths[start : start + w])
        current.jobs += [_Job(p, 0, cfg.n) for p in range(start, start + w)]
        current.longest = longest
    waves.append(current)
    return waves


@torch.no_grad()
def _run_wave(
    model,
    prompts: Sequence[Sequence[int]],
    wave: _Wave,
    cfg: SamplingConfig,
    eos: torch.Tensor,
    pad_id: int,
    keys: Sequence,
    stop: Callable[[list[int]], bool] | None,
    on_step: Callable[[int], None] | None,
) -> list[GeneratedIds]:
    device = next(model.parameters()).device
    P = len(wave.jobs)
    Lmax = wave.longest
    capacity = Lmax + cfg.max_new_tokens
    compiled = decodes_compiled(model, cfg, device)
    if compiled:
        capacity = -(-capacity // CAPACITY_STEP) * CAPACITY_STEP
    lengths = torch.tensor([len(prompts[j.prompt]) for j in wave.jobs], device=device)
    # Prefill each distinct prompt once, left-padded: [P, Lmax].
    ids = torch.full((P, Lmax), pad_id, dtype=torch.long, device=device)
    pad_mask = torch.zeros(P, capacity, dtype=torch.bool, device=device)
    for i, job in enumerate(wave.jobs):
        toks = torch.as_tensor(prompts[job.prompt], dtype=torch.long, device=device)
        ids[i, Lmax - len(toks) :] = toks
        pad_mask[i, Lmax - len(toks) : Lmax] = True
    positions = (pad_mask[:, :Lmax].long().cumsum(-1) - 1).clamp(min=0)
    num_layers = model.config.get_text_config().num_hidden_layers
    cache = SlabCache(num_layers, capacity)
    out = model(
        input_ids=ids,
        attention_mask=pad_mask[:, :Lmax].long(),
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    # Copy each prompt's cache row to its samples: rows [B] in sample order.
    counts = torch.tensor([j.count for j in wave.jobs], device=device)
    src = torch.repeat_interleave(torch.arange(P, device=device), counts)
    B = int(counts.sum())
    rows = torch.arange(B, device=device)  # wave row (prompt-major sample order) of each batch row
    if cfg.foreign_groups:  # batch order [block, sample j, prompt of the block]: groups of `width` prompts
        rows = rows.view(P // cfg.width, cfg.width, cfg.n).transpose(1, 2).reshape(-1)
        src = src[rows]
    cache.select_rows(src)
    pad_mask = pad_mask[src]
    pos = lengths[src].clone()  # position of the next input token
    logits = out.logits[:, -1][src]
    width = cfg.width
    deferred = defers_draws(device, cfg)
    step_fn, slot, knobs = None, None, None
    if compiled:
        step_fn = compiled_step(device, draws=deferred)
        if deferred:  # the sampler's settings as tensors: graph inputs, not constants baked into the graph
            knobs = (torch.tensor(cfg.temperature, device=device), torch.tensor(cfg.top_p, device=device))
        slot = torch.zeros(1, dtype=torch.long, device=device)
        cache.make_static(slot)
    out_tokens = torch.full((B, cfg.max_new_tokens), pad_id, dtype=torch.long, device=device)
    out_logps = torch.zeros(B, cfg.max_new_tokens, device=device)
    gen_len = torch.zeros(B, dtype=torch.long, device=device)
    ended = torch.zeros(B, dtype=torch.bool, device=device)  # emitted EOS / stop string
    alive = torch.ones(B, dtype=torch.bool, device=device)
    rand, buffers = None, SamplerBuffers()
    if cfg.temperature > 0:
        rand = SampleRandomness(cfg.seed, wave.jobs, keys, cfg.n, cfg.max_new_tokens, device)
    drawn = None  # (tokens, logprobs, unsure) of the step, drawn inside the compiled step

    def record(tok, lp, alive, rows):
        """The step's writes that depend on its tokens -> done [B] (emitted EOS or a stop string now)."""
        # Rows that finished earlier keep pad / 0 at `step`; index writes, no boolean masks (no device sync).
        out_tokens[rows, step] = torch.where(alive, tok, pad_id)
        out_logps[rows, step] = torch.where(alive, lp, 0.0)
        done = alive & torch.isin(tok, eos)
        if stop is not None:
            for b in torch.nonzero(alive & ~done)[:, 0].tolist():
                if stop(out_tokens[int(rows[b]), : step + 1].tolist()):
                    done[b] = True
        return done

    step = 0
    while True:
        if rand is not None:
            rand.rows, rand.step = rows, step
        unsure = None
        if drawn is not None:
            tok, lp, unsure = drawn
        elif deferred:
            tok, lp, unsure = sample_tokens_deferred(logits, cfg.temperature, cfg.top_p, rand)
        else:
            tok, lp = sample_tokens(logits, cfg.temperature, cfg.top_p, cfg.top_k, rand, buffers)  # token of `step`
        gen_len[rows] += alive.long()
        done = record(tok, lp, alive, rows)
        ended[rows] |= done
        valid = alive  # inputs of the next step: live tokens, a just-emitted EOS included
        alive = alive & ~done
        group_alive = alive.view(-1, width).any(-1)  # [G]
        # The loop's one host sync of a step (the CPU's nucleus sampling and stop strings add their own): what it
        # decides on. `all_valid` is taken before compaction: a step after dropping the last finished rows still
        # gets a mask.
        stats = [done.sum(), group_alive.sum(), valid.all().long()]
        n_done, live, all_valid, *n_unsure = torch.stack(stats + ([unsure.sum()] if deferred else [])).tolist()
        if n_unsure and n_unsure[0]:  # rare: rows with no accepted draw in the sync-free rounds
            tok, lp = finish_deferred(logits, tok, unsure, cfg.temperature, cfg.top_p, rand)
            first_done, done = done, record(tok, lp, valid, rows)
            ended[rows] = (ended[rows] & ~first_done) | done  # rows done now were live, so not ended before
            alive = valid & ~done
            group_alive = alive.view(-1, width).any(-1)
            n_done, live = torch.stack([done.sum(), group_alive.sum()]).tolist()
        step += 1
        if on_step is not None:
            on_step(n_done)
        if step == cfg.max_new_tokens or live == 0:
            break
        inputs = torch.where(valid, tok, pad_id)
        # Drop groups in which no row is alive, once they are a large enough part of the batch.
        keep = None
        if compiled:
            keep = _bucket_keep(group_alive, width, live)
        elif group_alive.numel() - live >= max(1, cfg.compact_fraction * group_alive.numel()):
            keep = torch.nonzero(group_alive.repeat_interleave(width))[:, 0]
        if keep is not None:
            cache.select_rows(keep)
            pad_mask, pos, rows, alive, valid, inputs = (t[keep] for t in (pad_mask, pos, rows, alive, valid, inputs))
        pad_mask[:, Lmax + step - 1] = True  # the input token's own slot
        if compiled:
            slot.fill_(Lmax + step - 1)  # every layer writes there; the mask covers the whole static capacity
            if deferred:  # the next step's draws too, with its uniforms
                rand.rows, rand.step = rows, step
                u = rand.rounds(torch.arange(len(rows), device=device))  # [B, DEFERRED_ROUNDS]
                logits, *drawn = step_fn(model, cache, inputs, pos, pad_mask, valid, width, u, *knobs, cfg.top_p < 1)
            else:
                logits = step_fn(model, cache, inputs, pos, pad_mask, valid, width)
        else:  # the mask up to this step; no validity while every row is valid (the blocks skip masking)
            logits = decode_logits(
                model, cache, inputs, pos, pad_mask[:, : Lmax + step], None if all_valid else valid, width
            )
        pos = pos + 1
    if on_step is not None:
        on_step(int((~ended).sum()))  # samples that ran out of tokens
    results = []
    for r in range(B):
        n = int(gen_len[r])
        results.append(GeneratedIds(out_tokens[r, :n].tolist(), out_logps[r, :n].tolist(), bool(ended[r])))
    return results


def iter_generate_ids(
    model,
    prompts: Sequence[Sequence[int]],
    cfg: SamplingConfig,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    stop: Callable[[list[int]], bool] | None = None,
    progress: Callable[[int], None] | None = None,
    keys: Sequence | None = None,
) -> Iterator[tuple[int, list[GeneratedIds]]]:
    """Yield (prompt index, its n samples) as prompts complete, in prompt order.

    `stop(token_ids) -> bool` ends a sample early (stop strings); `progress(k)` is called with the number of
    samples that completed since its last call (n * len(prompts) in all). `keys[i]` (default i) names prompt i's
    random stream: with the same seed and key a prompt gets the same samples whatever else is in the batch (up to
    the rounding differences of other batch shapes).
    """
    cfg.validate()
    if len(prompts) == 0:
        raise ValueError("prompts is empty: expected at least one prompt")
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty: expected at least one token")
        if context is not None and len(p) + cfg.max_new_tokens > context:
            room = context - max(map(len, prompts))  # what the longest prompt leaves
            fix = f"lower max_new_tokens (--max-new-tokens) to at most {room}, or shorten the prompts"
            raise ValueError(
                f"prompt {i} has {len(p)} tokens; with max_new_tokens={cfg.max_new_tokens} it exceeds the "
                f"model's context of {context} positions: " + (fix if room > 0 else "shorten the prompts")
            )
    if not eos_token_ids:
        eos_token_ids = [-1]  # nothing stops a sample but max_new_tokens
    device = next(model.parameters()).device
    eos = torch.tensor(list(eos_token_ids), dtype=torch.long, device=device)
    if keys is None:
        keys = list(range(len(prompts)))
    elif len(keys) != len(prompts):
        raise ValueError(f"keys has {len(keys)} entries: expected one per prompt ({len(prompts)})")
    # Packed weights serve the eager step only: the compiled one would see new tensors every wave and recompile.
    pack = cfg.pack_weights and not decodes_compiled(model, cfg, device)
    was_training = model.training
    model.eval()
    pending: dict[int, list[GeneratedIds | None]] = {}
    try:
        for wave in plan_waves([len(p) for p in prompts], cfg):
            # Switched per wave: the model is the caller's between yields (it may change its weights there).
            packed = packed_linears(model) if pack else contextlib.nullcontext()
            with fast_attention(model), packed:
                samples = _run_wave(model, prompts, wave, cfg, eos, pad_token_id, keys, stop, progress)
            at = 0
            for job in wave.jobs:
                slot = pending.setdefault(job.prompt, [None] * cfg.n)
                slot[job.first : job.first + job.count] = samples[at : at + job.count]
                at += job.count
                if all(s is not None for s in slot):
                    yield job.prompt, pending.pop(job.prompt)
    finally:
        model.train(was_training)


def generate_ids(model, prompts, cfg: SamplingConfig, eos_token_ids, pad_token_id, stop=None, progress=None, keys=None):
    """All samples: a list (per prompt) of n `GeneratedIds`."""
    out: list[list[GeneratedIds]] = [[] for _ in prompts]
    for i, samples in iter_generate_ids(model, prompts, cfg, eos_token_ids, pad_token_id, stop, progress, keys):
        out[i] = samples
    return out


# ---------------------------------------------------------------------------------------------- text edges


@dataclass
class Sample:
    """One generated sample of a prompt."""

    prompt_ids: list[int]  # the prompt as the model saw it (chat template applied when asked)
    token_ids: list[int]  # generated ids, ending with EOS when `finished`
    logprobs: list[float]  # one per generated id, under softmax(logits / temperature)
    text: str  # decoded generated ids, special tokens skipped
    finished: bool  # ended by EOS or a stop string


def eos_ids(model, tokenizer=None, override: int | Sequence[int] | None = None) -> list[int]:
    """EOS ids: the override, else the generation config's (one or several), else the tokenizer's."""
    if override is not None:
        return [override] if isinstance(override, int) else list(override)
    gen = getattr(model, "generation_config", None)
    ids = getattr(gen, "eos_token_id", None) if gen is not None else None
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


def pad_id(tokenizer, eos: Sequence[int]) -> int:
    """The id that fills finished rows and padding: the tokenizer's pad, else the first EOS, else 0."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return eos[0] if eos else 0


def encode_prompts(tokenizer, prompts: Sequence[str], chat: bool = False, warn: bool = True) -> list[list[int]]:
    """Token ids of each prompt; with `chat`, through the tokenizer's chat template (generation prompt added). Prompts
    with characters the tokenizer can only encode as its unknown token (a character vocabulary's <pad>) are encoded
    so, with one DataWarning (unless not `warn`: a caller that only counts tokens) that counts them and names the
    first one's characters."""
    if isinstance(prompts, str):
        raise ValueError("prompts must be a list of strings, got one string")
    out, unread = [], []  # unread: (prompt index, characters) of prompts with characters the tokenizer lacks
    for i, text in enumerate(prompts):
        if not isinstance(text, str) or not text:
            raise ValueError(f"prompt {i} is empty or not a string: {text!r}")
        if chat:
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError("chat=True but the tokenizer has no chat template")
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
        else:
            ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        unknown = unknown_characters(tokenizer, text, ids) if warn else None
        if unknown:
            unread.append((i, unknown))
        out.append(list(ids))
    if unread:
        (first, chars), unk = unread[0], tokenizer.backend_tokenizer.model.unk_token
        warnings.warn(
            f"{len(unread)} of {len(prompts)} prompts hold characters the tokenizer has no token for (prompt {first}: "
            f"{', '.join(map(repr, chars[:10]))}); the model reads each as {unk!r}",
            DataWarning,
            stacklevel=2,
        )
    return out


def stop_checker(tokenizer, stop_strings: Sequence[str]) -> Callable[[list[int]], bool] | None:
    """A `stop(token_ids)` that looks for any stop string in the decoded tail of a sample."""
    if not stop_strings:
        return None
    longest = max(len(s) for s in stop_strings)

    def stop(token_ids: list[int]) -> bool:
        tail = tokenizer.decode(token_ids[-(longest + 4) :], skip_special_tokens=True)
        return any(s in tail for s in stop_strings)

    return stop


def iter_generate(
    model,
    tokenizer,
    texts: Sequence[str],
    cfg: SamplingConfig,
    keys: Sequence | None = None,
    chat: bool = False,
    stop_strings: Sequence[str] = (),
    eos_token_id: int | Sequence[int] | None = None,
    progress: str | Callable[[int], None] | None = None,
) -> Iterator[tuple[int, list[Sample]]]:
    """The text edge of the engine: encode `texts`, sample, decode; yields (index, its n `Sample`) as prompts
    complete. `keys` name the prompts' random streams (see `iter_generate_ids`); `progress` is a progress-bar
    title, or a callable fed the number of completed samples.
    """
    cfg.validate()
    if len(texts) == 0:
        raise ValueError("prompts is empty: expected at least one prompt")
    ids = encode_prompts(tokenizer, texts, chat)
    eos = eos_ids(model, tokenizer, eos_token_id)
    bar = None
    if isinstance(progress, str):
        from tqdm.auto import tqdm

        bar = tqdm(total=len(texts) * cfg.n, desc=progress, unit="sample")
    update = bar.update if bar is not None else progress
    try:
        stop = stop_checker(tokenizer, stop_strings)
        decode = lambda g: tokenizer.decode(g.token_ids, skip_special_tokens=True)
        for i, samples in iter_generate_ids(model, ids, cfg, eos, pad_id(tokenizer, eos), stop, update, keys):
            yield i, [Sample(ids[i], g.token_ids, g.logprobs, decode(g), g.finished) for g in samples]
    finally:
        if bar is not None:
            bar.close()


def generate(
    model,
    tokenizer,
    prompts: Sequence[str],
    n: int = 8,
    width: int = 1,
    max_new_tokens: int = 256,
    temperature: float = 0.6,
    top_p: float = 0.95,
    seed: int = 0,
    top_k: int = 0,
    chat: bool = False,
    stop_strings: Sequence[str] = (),
    eos_token_id: int | Sequence[int] | None = None,
    max_batch_sequences: int = 256,
    max_batch_tokens: int = 262_144,
    progress: bool = False,
) -> list[list[Sample]]:
    """Sample `n` responses per prompt; samples j*width .. (j+1)*width-1 of a prompt form one Bridge group.

    Returns, per prompt, a list of n `Sample`. Works with and without Bridge blocks (width 1 = independent).
    """
    cfg = SamplingConfig(
        n=n,
        width=width,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        max_batch_sequences=max_batch_sequences,
        max_batch_tokens=max_batch_tokens,
    )
    title = "sampling" if progress else None
    return sample_all(model, tokenizer, prompts, cfg, chat, stop_strings, eos_token_id, title)


def sample_all(
    model,
    tokenizer,
    texts: Sequence[str],
    cfg: SamplingConfig,
    chat: bool = False,
    stop_strings: Sequence[str] = (),
    eos_token_id: int | Sequence[int] | None = None,
    progress: str | Callable[[int], None] | None = None,
) -> list[list[Sample]]:
    """`iter_generate` collected in memory: per text, its `cfg.n` samples (nothing written)."""
    out: list[list[Sample]] = [[] for _ in texts]
    for i, samples in iter_generate(model, tokenizer, texts, cfg, None, chat, stop_strings, eos_token_id, progress):
        out[i] = samples
    return out

"""The sampler: one token per row from next-token logits, with temperature, top-k and an exact top-p.

Every draw is an inverse-CDF draw with one uniform of the sample's own stream, in two levels and with no scan of
the vocabulary (`search`): the block of BLOCK tokens from the block sums' CDF (`block_cdf`, once a step), then the
token within that block. Top-p is rejection sampling, with no sort of the vocabulary: keep the draw from the
(top-k) distribution when it lies in the nucleus (`in_nucleus`), else draw again with the row's next uniform. Accepted
draws follow the renormalised nucleus exactly; a round accepts with probability equal to the nucleus mass
(>= top_p), so a round or two suffices. `draw_round` is one such round, and the only caller of `in_nucleus`; the
three ways to sample are rounds of it:
- `sample_tokens` (CPU): a round on every row, then rounds on the rejected rows alone (`redraw_rejected`, one
  host sync each);
- `sample_tokens_deferred` (GPU): DEFERRED_ROUNDS rounds on every row with no host sync (`deferred_draws`);
  `finish_deferred` completes the rare rows still rejected, after the step's one sync, with `redraw_rejected`;
- the compiled step on a GPU runs `deferred_draws` inside its graph (`bridgelm.engine.step.decode_and_draw`).
All three draw the same tokens from the same uniforms. Log-probs are those of the drawn token under
softmax(logits / temperature), before top-p/top-k truncation (temperature 1 for greedy decoding).
"""

from __future__ import annotations

import torch

from bridgelm.engine.config import SamplingConfig
from bridgelm.engine.randomness import DEFERRED_ROUNDS, SampleRandomness, Uniform, generator_uniform

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
    as sum(relu(p - p_tok)) + p_tok x #{p > p_tok} (elementwise passes that vectorise). `scratch` ([B, V] float,
    optional) receives the differences. `all_rows`: sum every row, with no host sync (on a GPU a pass over all rows
    costs less than a sync); the same answers.
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


@torch.library.custom_op("bridgelm::cumsum_rows", mutates_args=())
def cumsum_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.cumsum over the last dimension, opaque to torch.compile: inductor (torch 2.11) fails to generate the
    split scan of a wide row block ([64, 24000]), so the compiled step calls ATen's kernel instead."""
    return torch.cumsum(x, -1)


@cumsum_rows.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def cdf_of(probs: torch.Tensor) -> torch.Tensor:
    """The CDF of each row: probs [B, n] (unnormalised is fine) -> [B, n]. The sampler calls it on narrow rows
    only (block sums, one block), never on the vocabulary."""
    if torch.compiler.is_compiling():
        return cumsum_rows(probs)
    return torch.cumsum(probs, -1)


# The inverse-CDF draw reads the vocabulary in blocks of this many tokens (about sqrt(V) for V = 50k-150k).
BLOCK = 256


def block_cdf(probs: torch.Tensor) -> torch.Tensor:
    """The CDF over blocks of BLOCK tokens (the last one shorter): probs [B, V] -> [B, ceil(V / BLOCK)].

    One vectorised sum over the vocabulary and a scan of V / BLOCK terms, instead of a scan of V terms (a
    cumsum is one serial chain of additions per row)."""
    B, V = probs.shape
    full = V - V % BLOCK
    parts = [probs[:, :full].reshape(B, full // BLOCK, BLOCK).sum(-1)] if full else []
    if full < V:
        parts.append(probs[:, full:].sum(-1, keepdim=True))
    return cdf_of(parts[0] if len(parts) == 1 else torch.cat(parts, -1))


def _last_reaching(cdf: torch.Tensor) -> torch.Tensor:
    """[B, n] nondecreasing rows -> [B, 1]: the first index where a row reaches its total, i.e. its last entry of
    positive mass (a draw never lands beyond it, whatever the rounding)."""
    return torch.searchsorted(cdf, cdf[:, -1:].contiguous(), right=False)


def search(probs: torch.Tensor, blocks: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The inverse-CDF draw of each row, in two levels: probs [B, V] (unnormalised is fine), blocks [B, nb] its
    `block_cdf`, u [B] uniforms -> [B] ids. The block whose cumulative mass first exceeds u x total, then within
    it (one gather of BLOCK tokens and their scan) the token whose cumulative mass first exceeds what remains:
    token t with probability p_t / total, as a CDF over the whole row would give, up to rounding."""
    V = probs.shape[-1]
    target = u.to(blocks.dtype)[:, None] * blocks[:, -1:]  # [B, 1]
    b = torch.searchsorted(blocks, target, right=True).minimum(_last_reaching(blocks))  # [B, 1] block
    before = torch.where(b > 0, blocks.gather(-1, (b - 1).clamp(min=0)), 0.0)  # [B, 1] mass of earlier blocks
    idx = b * BLOCK + torch.arange(BLOCK, device=probs.device)  # [B, BLOCK] the block's tokens
    inner = probs.gather(-1, idx.clamp(max=V - 1))
    if V % BLOCK:  # the short last block: positions past V weigh nothing
        inner = inner.masked_fill(idx >= V, 0.0)
    inner = cdf_of(inner)  # [B, BLOCK]
    j = torch.searchsorted(inner, target - before, right=True).minimum(_last_reaching(inner))
    return (b * BLOCK + j)[:, 0].clamp_(max=V - 1)


def draw_round(probs, tokens, accepted, u, top_p, blocks=None, scratch=None, all_rows: bool = False):
    """One round of top-p by rejection. The rows not yet accepted (`accepted` [B] False; None: no row yet) take the
    draw of their uniform u [B] from probs [B, V] (by `blocks`, its `block_cdf`, or one summed here), and are
    accepted when it lies in the nucleus; `top_p` None: no nucleus, every draw is accepted. `scratch` ([B, V]
    float, optional) serves the nucleus test. `all_rows`: no host sync (see `in_nucleus`).
    -> (tokens [B], accepted [B] bool)."""
    drawn = search(probs, block_cdf(probs) if blocks is None else blocks, u)  # [B]
    if accepted is not None:
        drawn = torch.where(accepted, tokens, drawn)
    if top_p is None:
        return drawn, torch.ones_like(drawn, dtype=torch.bool)
    ok = in_nucleus(probs, drawn, top_p, scratch, all_rows)  # the one place where top_p decides
    return drawn, ok if accepted is None else accepted | ok


def redraw_rejected(probs, tokens, accepted, top_p: float, uniform: Uniform, attempt: int, blocks=None):
    """Rounds attempt+1, attempt+2, ... on the rows not yet accepted alone, until every row is (one host sync per
    round); updates `tokens` and `accepted` in place -> tokens. `blocks`: probs' `block_cdf`, when known."""
    blocks = block_cdf(probs) if blocks is None else blocks
    while (redo := torch.nonzero(~accepted)[:, 0]).numel():
        attempt += 1
        tokens[redo], accepted[redo] = draw_round(probs[redo], None, None, uniform(redo, attempt), top_p, blocks[redo])
    return tokens


def probabilities(logits: torch.Tensor, temperature, out=None, scratch=None) -> torch.Tensor:
    """softmax(logits / temperature) in float32: logits [B, V] -> [B, V]. With `out` and `scratch` ([B, V] float32
    each) the same values, computed in that memory. `temperature`: a float or a 0-d tensor (the compiled step)."""
    if out is None:
        return torch.softmax(logits.float() / temperature, -1)
    scratch.copy_(logits).div_(temperature)  # the same float32 values as logits.float() / temperature
    return torch.softmax(scratch, -1, out=out)  # one fused pass


def logprob_of(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token) of each row: probs [B, V], tokens [B] -> [B]."""
    return probs.gather(-1, tokens[:, None])[:, 0].log()


def nucleus_of(top_p):
    """top_p as the sampler takes it: None when there is no nucleus to test (top_p = 1)."""
    return top_p if top_p < 1.0 else None


class SamplerBuffers:
    """Two float32 [rows, V] buffers that every step of a wave reuses (the softmax and a scratch), sliced to the
    step's rows. On CPU a fresh tensor of several MB per elementwise pass comes from fresh pages, whose faults cost
    more than the pass itself (see docs/engine.md)."""

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


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The most probable token of each row: logits [B, V] -> (tokens [B], logprobs [B] at temperature 1)."""
    logits = logits.float()
    tokens = logits.argmax(-1)
    return tokens, logits.gather(-1, tokens[:, None])[:, 0] - torch.logsumexp(logits, -1)


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

    `rand` is a generator or a `Uniform`; `buffers` (the engine passes one per wave) keeps the [B, V] passes in the
    same memory from step to step.
    """
    uniform = rand if callable(rand) else generator_uniform(rand)
    if temperature == 0:
        return greedy(logits)
    full, scratch = (buffers or SamplerBuffers()).take(logits)  # [B, V] float32 each
    full = probabilities(logits, temperature, full, scratch)
    probs, ids = full, None
    if top_k and top_k < full.shape[-1]:
        vals, ids = full.topk(top_k, -1)  # [B, k]
        probs = vals / vals.sum(-1, keepdim=True)  # renormalised over the top k
        scratch = None
    every = torch.arange(probs.shape[0], device=probs.device)
    nucleus = nucleus_of(top_p)
    blocks = block_cdf(probs)  # [B, V / BLOCK], for every round
    tokens, accepted = draw_round(probs, None, None, uniform(every, 0), nucleus, blocks, scratch)
    if nucleus is not None:
        redraw_rejected(probs, tokens, accepted, nucleus, uniform, 0, blocks)
    if ids is not None:
        tokens = ids.gather(-1, tokens[:, None])[:, 0]
    return tokens, logprob_of(full, tokens)


def deferred_draws(logits: torch.Tensor, u: torch.Tensor, temperature, top_p) -> tuple[torch.Tensor, ...]:
    """logits [B, V], u [B, DEFERRED_ROUNDS] uniforms -> (tokens [B], logprobs [B], unsure [B]); no host sync.
    `temperature` and `top_p`: floats, or 0-d tensors (the compiled step: one graph for every value); `top_p` None:
    no nucleus."""
    probs = probabilities(logits, temperature)  # [B, V], the values `sample_tokens` computes
    blocks = block_cdf(probs)  # [B, V / BLOCK], for every round
    tokens, accepted = None, None
    for attempt in range(DEFERRED_ROUNDS if top_p is not None else 1):
        tokens, accepted = draw_round(probs, tokens, accepted, u[:, attempt], top_p, blocks, all_rows=True)
    return tokens, logprob_of(probs, tokens), ~accepted


@torch.no_grad()
def sample_tokens_deferred(
    logits: torch.Tensor, temperature: float, top_p: float, uniform: Uniform
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`sample_tokens` (temperature > 0, no top-k) without a host sync, for GPUs: the same draws.

    Attempts 0..DEFERRED_ROUNDS-1 of every row are made on all rows at once; a row keeps its first accepted draw,
    as in `sample_tokens`. -> (tokens [B], logprobs [B], unsure [B] bool): rows with no accepted draw yet (about
    (1 - top_p)^DEFERRED_ROUNDS of them at most), which `finish_deferred` completes once the caller has synced.
    """
    every = torch.arange(logits.shape[0], device=logits.device)
    rounds = getattr(uniform, "rounds", None)
    u = rounds(every) if rounds else torch.stack([uniform(every, a) for a in range(DEFERRED_ROUNDS)], -1)
    return deferred_draws(logits, u, temperature, nucleus_of(top_p))


def finish_deferred(
    logits: torch.Tensor, tokens: torch.Tensor, unsure: torch.Tensor, temperature: float, top_p: float, uniform: Uniform
) -> tuple[torch.Tensor, torch.Tensor]:
    """Complete `sample_tokens_deferred`'s unsure rows with attempts DEFERRED_ROUNDS, ... (host syncs; rare).
    -> (tokens [B], logprobs [B])."""
    probs = probabilities(logits, temperature)
    tokens = redraw_rejected(probs, tokens.clone(), ~unsure, top_p, uniform, DEFERRED_ROUNDS - 1)
    return tokens, logprob_of(probs, tokens)


def defers_draws(device, cfg: SamplingConfig) -> bool:
    """Whether the engine draws with `sample_tokens_deferred`: on a GPU, where a host sync in the middle of a step
    leaves the GPU idle while the host queues the rest of the step's kernels one by one. On the CPU, syncs are
    free and the extra nucleus passes are not."""
    return torch.device(device).type == "cuda" and cfg.temperature > 0 and not cfg.top_k


def draw(logits, cfg: SamplingConfig, rand: SampleRandomness | None, buffers: SamplerBuffers, deferred: bool):
    """A decode step's tokens from its logits [B, V], the deferred way or not -> (tokens [B], logprobs [B],
    unsure [B] bool, or None when not deferred)."""
    if deferred:
        return sample_tokens_deferred(logits, cfg.temperature, cfg.top_p, rand)
    return (*sample_tokens(logits, cfg.temperature, cfg.top_p, cfg.top_k, rand, buffers), None)

"""The decoder's own attention, computed with two matmuls where that beats PyTorch's fused kernels.

On CPU, `scaled_dot_product_attention` with a mask runs a flash kernel whose per-call setup dominates at the sizes
Bridge meets there: one query per row against a cache of a few hundred positions in the engine's decode step, and
short rows (up to ~128 tokens) in the trainers' forward and backward (measured: `benchmarks/attention.py`).
On a CUDA GPU, transformers' sdpa with a mask first copies the keys and values of a grouped-query head once per
query head that reads it, then runs a kernel made for long queries (half of the compiled decode step's GPU time in
a measurement of docs/engine.md).
`matmul_attention` computes the same `softmax(q k^T * scale + mask) v` as two batched matmuls with the query heads
of a key/value head stacked on that head (grouped-query attention without repeating keys), the softmax in float32.

`fast_attention(model)` is a context that points a model using "sdpa" at it (transformers' attention registry,
name "bridgelm_sdpa"; its masks are sdpa's), and puts the model back on exit. Inside, the calls it does not win or
cover go to transformers' sdpa unchanged: on CPU float32, half precision without the CPU's instructions for it
(`packed.half_instructions`; on an AVX2-only CPU the fused kernel, float32 inside, beats the two bf16 matmuls 3-8x)
and rows of more than MAX_KEYS keys, on CUDA every call with more than one query per row (training and prefill,
where the fused kernels win), anywhere dropout, soft-capping and attention sinks. The engine (`bridgelm.engine`)
and the trainers' grouped forwards (`bridgelm.logprobs`) use it.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from bridgelm import packed
from bridgelm.prompt_attention import shared_prompt_attention
from bridgelm.scores import HALF, scores_of

NAME = "bridgelm_sdpa"  # the name under which transformers finds `attention`
# Where the matmul path wins on CPU (benchmarks/attention.py, 2 cores): half-precision queries, either one query
# per row (decode: 1.0-2.0x at every shape measured, up to 256 rows x 32 heads x 1024 positions) or at most this many
# keys (training rows: 1.8-4.7x at 64-128 keys, even at 192, 0.3-0.7x from 256 on). In float32 the fused kernel is
# as fast (0.85-1.1x), so float32 stays with it.
MAX_KEYS = 128
SHARED = "bridgelm_shared_prompt"  # the attribute of a cache's key tensor that carries its shared prompt


def matmul_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float, causal: bool
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v with grouped-query heads packed.

    query [B, H, S, D], key/value [B, KVH, L, D] (H a multiple of KVH: query head h reads key/value head h // (H/KVH)),
    mask broadcastable to [B, 1 or H, S, L] (bool: True = attend; or float: added to the scores), or None with
    `causal` (the last S positions of L attend to themselves and before). Scores come out of the matmul in the
    inputs' dtype (half-precision inputs: half-precision scores), then mask and softmax in float32 at least.
    -> [B, H, S, D], value's dtype.
    """
    B, H, S, D = query.shape
    KVH, L = key.shape[1], key.shape[2]
    rep = H // KVH
    if query.device.type == "cpu":
        # Dense keys and values first: a cache slice [:, :, :L] (decode) or a transposed projection (training) handed
        # to matmul as k^T makes it gather element by element on CPU; copying rows first is 2x faster per call, same
        # result. (cuBLAS takes the strided slice as it is.)
        key, value = key.contiguous(), value.contiguous()
    q = (query * scale).reshape(B, KVH, rep * S, D)  # heads of a key/value head stacked: [B, KVH, rep*S, D]
    scores = scores_of(q, key).view(B, KVH, rep, S, L)  # [B, KVH, rep, S, L]
    if mask is None and causal and S > 1:
        mask = torch.ones(S, L, dtype=torch.bool, device=query.device).tril(L - S)  # [S, L]
    if mask is not None:
        if mask.dim() == 4:  # [B or 1, 1 or H, S or 1, L] -> [B or 1, KVH or 1, rep or 1, S or 1, L]
            heads = mask.shape[1]
            mask = mask.reshape(mask.shape[0], KVH if heads > 1 else 1, rep if heads > 1 else 1, *mask.shape[2:])
        if mask.dtype == torch.bool:
            # The lowest finite value, not -inf: a query whose keys are all masked (a left pad of a prompt) gets a
            # finite average instead of NaN, which the next layer's masked keys would otherwise spread (0 * NaN).
            scores = scores.masked_fill_(~mask, torch.finfo(scores.dtype).min)  # in place: the matmul's own output
        else:
            scores = scores + mask.to(scores.dtype)
    probs = torch.softmax(scores, dim=-1).to(value.dtype).view(B, KVH, rep * S, L)
    return torch.matmul(probs, value).view(B, H, S, D)  # [B, H, S, D]


def _covered(query, key, value, attention_mask, dropout, kwargs) -> bool:
    """Whether `attention` computes this call itself (else transformers' sdpa does)."""
    if dropout > 0 or kwargs.get("softcap") is not None:
        return False
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None or kwargs.get("position_bias") is not None:
        return False
    if key.shape[-1] != query.shape[-1] or value.shape[-1] != query.shape[-1] or query.shape[1] % key.shape[1]:
        return False
    if attention_mask is not None and attention_mask.dim() != 4:
        return False
    decode = query.shape[2] == 1
    if query.device.type == "cuda":
        return decode  # any dtype: sdpa would copy the keys and values once per query head of a group
    if query.device.type != "cpu":
        return False
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype  # autocast: its
    # dtype (the rotary embedding hands float32 queries to an attention that autocast runs in bf16)
    return dtype in HALF and packed.half_instructions(dtype) and (decode or key.shape[2] <= MAX_KEYS)


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kw):
    """transformers' attention signature: query [B, H, S, D], key/value [B, KVH, L, D] -> ([B, S, H, D], None).

    A key tagged with a shared prompt (SHARED, set by the engine's cache) holds only the rows' own positions after
    it (`bridgelm.prompt_attention`)."""
    shared = getattr(key, SHARED, None)
    covered = _covered(query, key, value, attention_mask, dropout, kw)
    if shared is not None and not (covered and query.shape[2] == 1):
        key, value = shared.expanded(key, value)  # whole rows again, for the backend that takes this call
        shared, covered = None, _covered(query, key, value, attention_mask, dropout, kw)
    if not covered:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kw)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if shared is not None:
        out = shared_prompt_attention(query, key, value, shared, attention_mask, scale)
        return out.transpose(1, 2).contiguous(), None
    causal = kw.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    out = matmul_attention(query, key, value, attention_mask, scale, bool(causal))
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def wins(model) -> bool:
    """Whether `fast_attention` switches `model`: it uses transformers' sdpa, its forwards here are not recomputed
    in a backward, and its weights are on a CUDA GPU or on the CPU in half precision or under CPU bf16/fp16
    autocast, on a CPU with instructions for it (float32, and half precision on an AVX2-only CPU, keep the fused
    kernel there).

    With gradient checkpointing a layer's forward is recomputed in the backward, after the context, with sdpa: the
    recomputation must compute what the forward did, so such forwards keep sdpa. transformers recomputes only a
    layer in training mode with gradients on, so the engine's decoding (eval mode, no gradients) and a trainer's
    no_grad passes keep the two-matmul attention."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    # the layers' own flag, which transformers 5.17 (is_gradient_checkpointing) and 5.23 (is_activation_checkpointing)
    # both read
    checkpointing = any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    if checkpointing and model.training and torch.is_grad_enabled():
        return False
    param = next(model.parameters(), None)
    if param is not None and param.device.type == "cuda":
        return True  # only decode calls are covered there
    if param is None or param.device.type != "cpu":
        return False
    autocast = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") in HALF
    dtype = torch.get_autocast_dtype("cpu") if autocast else param.dtype
    return dtype in HALF and packed.half_instructions(dtype)


def _configs(config) -> list:
    """`config` and its sub-configs (text, vision, ...), depth first."""
    out = [config]
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "_attn_implementation"):
            out += _configs(sub)
    return out


@contextlib.contextmanager
def fast_attention(model):
    """Within the context, `model` (when `wins(model)`) computes its attention with `attention`; restored on exit.

    Every (sub-)config that says "sdpa" says NAME inside; each gets its own value back on exit."""
    if not wins(model):
        yield model
        return
    saved = [(c, c._attn_implementation) for c in _configs(model.config)]
    for c, impl in saved:
        if impl == "sdpa":
            c._attn_implementation_internal = NAME  # this config only (the setter would recurse)
    try:
        yield model
    finally:
        for c, impl in saved:
            c._attn_implementation_internal = impl

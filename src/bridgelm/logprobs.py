"""Grouped token batches and their teacher-forced log-probs, shared by the trainers and the analyses.

A grouped batch (`TokenBatch`) holds prompt + response rows, right-padded; logits are computed only where the next
token is a response token (the head reads the positions of a [B, S] mask), never on the prompt or the padding. The
rows of a Bridge group sit next to each other and share their prompt, so one forward lets them see each other.
Log-probs and entropies are taken from those logits a chunk of rows at a time (`token_logprobs`), forward and
backward, so that no float32 copy of the [tokens, vocabulary] logits is made.

Used by bridgelm.train (SFT and GRPO) and bridgelm.eval.analyze; tested by tests/test_train_common.py.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import torch

from bridgelm.attention import fast_attention
from bridgelm.grouped import KWARG, Groups


class Row(NamedTuple):
    """One sequence of a grouped batch."""

    prompt: Sequence[int]  # prompt ids, identical for every row of a group
    response: Sequence[int]  # response ids (ending with EOS when the response finished)
    group: int  # Bridge group id; the rows of a group sit next to each other


@dataclass
class TokenBatch:
    """Rows prompt + response, right-padded, ready for one grouped forward."""

    input_ids: torch.Tensor  # [B, S] long
    attention_mask: torch.Tensor  # [B, S] long: 1 on prompt and response tokens
    group_ids: torch.Tensor  # [B] long: rows with equal ids attend to each other in Bridge blocks
    predict: torch.Tensor  # [B, S] bool: position s predicts a response token (s + 1); logits are kept there
    response_mask: torch.Tensor  # [B, T] bool: t < response length of the row (T = longest response)

    @property
    def tokens(self) -> int:
        return int(self.response_mask.sum())


def pack_rows(rows: Sequence[Row], pad_id: int, device: torch.device | str = "cpu") -> TokenBatch:
    """A TokenBatch of `rows` (order kept). The rows of a group must be adjacent and share their prompt."""
    assert rows, "no rows to pack: a batch needs at least one group"
    first_of: dict[int, int] = {}
    for i, row in enumerate(rows):
        assert len(row.response) > 0, f"row {i} has an empty response: expected at least one token"
        j = first_of.setdefault(row.group, i)
        assert j == i or (rows[i - 1].group == row.group and list(rows[j].prompt) == list(row.prompt)), (
            f"row {i} of group {row.group} is not next to its group or has another prompt")
    B = len(rows)
    S = max(len(r.prompt) + len(r.response) for r in rows)
    T = max(len(r.response) for r in rows)
    ids = torch.full((B, S), pad_id, dtype=torch.long)
    mask = torch.zeros(B, S, dtype=torch.long)
    predict = torch.zeros(B, S, dtype=torch.bool)
    resp = torch.zeros(B, T, dtype=torch.bool)
    for b, r in enumerate(rows):
        p, n = len(r.prompt), len(r.response)
        ids[b, :p] = torch.as_tensor(list(r.prompt), dtype=torch.long)
        ids[b, p : p + n] = torch.as_tensor(list(r.response), dtype=torch.long)
        mask[b, : p + n] = 1
        predict[b, p - 1 : p + n - 1] = True
        resp[b, :n] = True
    groups = torch.as_tensor([r.group for r in rows], dtype=torch.long)
    return TokenBatch(ids.to(device), mask.to(device), groups.to(device), predict.to(device), resp.to(device))


def forward_logits(model, batch: TokenBatch) -> torch.Tensor:
    """The grouped teacher-forced forward, logits only where `batch.predict`: -> [N, V], N = response tokens.

    Same forward as `bridgelm.grouped_logits` (same groups, mask and positions), the head restricted to `batch.predict`.
    """
    groups = Groups.build(batch.group_ids, batch.attention_mask)
    # short half-precision rows on CPU: two matmuls beat the fused kernel
    with fast_attention(model), _head_sees_only(model, batch.predict):
        out = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            use_cache=False,
            logits_to_keep=0,  # every position reaches the head, which keeps `batch.predict`'s
            **{KWARG: groups},
        )
    return out.logits


@contextmanager
def _head_sees_only(model, predict: torch.Tensor) -> Iterator[None]:
    """The output head (lm_head) reads the hidden states at `predict` only ([B, S, H] -> [N, H]), so logits are made
    there only: what a 2D boolean `logits_to_keep` does in transformers 5.23 (`hidden[mask]`, then the head), in a form
    every transformers 5 release runs (5.17's models index `hidden[:, logits_to_keep]`, which refuses a 2D mask)."""
    head = model.get_output_embeddings()
    handle = head.register_forward_pre_hook(lambda module, args: (args[0][predict], *args[1:]))
    try:
        yield
    finally:
        handle.remove()


class LogProbs(NamedTuple):
    logprobs: torch.Tensor  # [B, T] log-prob of each response token under softmax(logits / temperature); 0 on pads
    entropy: torch.Tensor | None  # [B, T] entropy of that distribution (no grad), when asked


def chunk_rows(vocab: int, device: torch.device) -> int:
    """Rows of [rows, V] float32 that `token_logprobs` handles at a time: ~16 MB per buffer on CPU (cache-sized, and
    below the size at which every fresh tensor comes from fresh pages), ~256 MB on an accelerator (few launches); one
    such buffer, two with the entropy."""
    budget = 2**22 if device.type == "cpu" else 2**26
    return max(1, budget // vocab)


def _scaled_chunks(logits: torch.Tensor, temperature: float) -> Iterator[tuple[int, torch.Tensor]]:
    """(start, z) over row chunks of `logits`, z = logits[chunk] / temperature in float32 [c, V]: one buffer for every
    chunk (a fresh one per chunk costs page faults worth more than the copy on CPU); z is overwritten by the next."""
    N, V = logits.shape
    step = chunk_rows(V, logits.device)
    buf = logits.new_empty(min(step, N), V, dtype=torch.float32)
    for i in range(0, N, step):
        z = buf[: min(step, N - i)]
        z.copy_(logits[i : i + step])
        if temperature != 1.0:
            z.div_(temperature)
        yield i, z


class _TokenLogProbs(torch.autograd.Function):
    """log softmax(logits / T) at the target of each row, and the entropy of that distribution, row chunk by row
    chunk: no [N, V] float32 tensor is ever made, forward or backward (at N = 4096 response tokens x 24k ids, a
    dozen such passes were half of a GRPO update on CPU). The backward recomputes each chunk's softmax from the saved
    logits and log-normalisers. With `overwrite`, it writes the logits' gradient into the logits themselves, chunk
    by chunk after reading each (see `token_logprobs`)."""

    @staticmethod
    def forward(ctx, logits, targets, temperature: float, with_entropy: bool, overwrite: bool):
        N = logits.shape[0]
        lse = logits.new_empty(N, dtype=torch.float32)  # [N] log-normaliser of logits / T
        picked = torch.empty_like(lse)  # [N] (logits / T) at the target
        entropy = torch.empty_like(lse) if with_entropy else None
        buf = None  # [c, V] float32 for the entropy, allocated once
        for i, z in _scaled_chunks(logits, temperature):
            rows = slice(i, i + z.shape[0])
            picked[rows] = z.gather(-1, targets[rows, None])[:, 0]
            # logsumexp as torch.logsumexp computes it, in place (its own z - max would be a fresh [c, V] each time)
            top = z.amax(-1)  # [c]
            top = torch.where(top.isinf(), 0.0, top)
            shifted = z.sub_(top[:, None])  # [c, V] z - max
            if with_entropy:  # e = exp(z - max), s = sum e: entropy = log s - sum(e (z - max)) / s
                buf = torch.empty_like(z) if buf is None else buf
                e = torch.exp(shifted, out=buf[: z.shape[0]])
                s = e.sum(-1)
                shifted.clamp_(min=torch.finfo(torch.float32).min)  # a -inf logit: e = 0 times a finite value
                log_s = s.log()
                entropy[rows] = log_s - e.mul_(shifted).sum(-1) / s
            else:
                log_s = shifted.exp_().sum(-1).log_()
            lse[rows] = log_s.add_(top)
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature = temperature
        # Only a tensor of its own (no leaf, which would lose its values; no view, whose base someone may read)
        ctx.overwrite = overwrite and logits.grad_fn is not None and logits._base is None
        if entropy is None:
            return picked - lse, None
        ctx.mark_non_differentiable(entropy)
        return picked - lse, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable  # in-place buffers, lse taken as given: no double backward
    def backward(ctx, grad_logprobs, _grad_entropy):
        logits, targets, lse = ctx.saved_tensors
        # [N, V]: d/dz (z_target - lse(z)) = onehot - softmax(z), z = logits / T. Chunk i of the logits is copied
        # into the chunk buffer before chunk i of the gradient is written, so the gradient may take their memory.
        grad = logits if ctx.overwrite else torch.empty_like(logits)
        g = grad_logprobs.float() / ctx.temperature  # [N]
        for i, z in _scaled_chunks(logits, ctx.temperature):
            rows = slice(i, i + z.shape[0])
            p = z.sub_(lse[rows, None]).exp_()  # [c, V] softmax(z), in place
            p.mul_(-g[rows, None]).scatter_add_(-1, targets[rows, None], g[rows, None])
            grad[rows] = p
        return grad, None, None, None, None


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    overwrite: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [N, V], targets [N] -> (log-prob of each target under softmax(logits / temperature) [N] float32, with
    gradients; its entropy [N] float32 without, or None). Chunked over rows (see `_TokenLogProbs`).

    `overwrite`: the backward writes the logits' gradient into `logits` (an autograd output, not a view), for a
    caller that reads them no more: no second [N, V] tensor (on CPU, its fresh pages cost ~5% of an SFT step of the
    30M benchmark model). Another backward through them then fails on their version counter instead of reading the
    gradient."""
    assert temperature > 0, f"temperature={temperature} must be > 0 to define log-probs"  # the configs refuse it
    return _TokenLogProbs.apply(logits, targets, float(temperature), with_entropy, overwrite)


def response_logprobs(model, batch: TokenBatch, temperature: float = 1.0, with_entropy: bool = False) -> LogProbs:
    """Log-probs of the response tokens of `batch`, from one grouped forward."""
    logits = forward_logits(model, batch)  # [N, V]
    targets = batch.input_ids[:, 1:][batch.predict[:, :-1]]  # [N], row-major like the kept logits
    flat, h = token_logprobs(logits, targets, temperature, with_entropy, overwrite=True)  # [N] each (logits: ours)
    logprobs = torch.zeros(batch.response_mask.shape, dtype=flat.dtype, device=flat.device)
    logprobs = logprobs.masked_scatter(batch.response_mask, flat)  # [B, T]
    entropy = None if h is None else torch.zeros_like(logprobs).masked_scatter(batch.response_mask, h)
    return LogProbs(logprobs, entropy)

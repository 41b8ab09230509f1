"""Looking inside eval runs (paper Sec. 5): what the added blocks write, and what a response's siblings are worth.
How alike a prompt's responses are is bridgelm.eval.similarity's.

Design notes:
- Feature contribution (Figure 7): forward hooks on every layer's `bridge` / `pmatch` submodule see the residual
  stream x entering the block and the update the block returns. Per token the ratio ||update|| / ||x||, averaged
  over the valid tokens of grouped teacher-forced forwards (the group layout of `grouped_logits`) of sampled
  response sets. A freshly added block has a zero output projection, so its ratio is exactly 0.
- Sibling information: whether a model's blocks read anything useful from a response's siblings. For each
  response set (an eval run's sampled set, or a warm-up problem's correct traces), the teacher-forced NLL of its
  response tokens with the set as one group, and with every response in a group of its own (w=1), same weights.
  The difference per token, averaged over sets with a bootstrap interval, is what the siblings are worth to the
  model's predictions: exactly 0 for P-Match, for a model without blocks and for fresh Bridge blocks. On
  teacher-forced correct traces (the warm-up's SFT loss) a problem's traces can only tell each other what the
  prompt already says, so a gain near 0 there says the warm-up gives cross-sample attention nothing to learn.

    bridgelm analyze features --model DIR [--blocks FILE] --run runs/x --out reports/features
    bridgelm analyze siblings --model DIR [--blocks FILE] (--run runs/x | --data warmup.jsonl) --out reports/siblings
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bridgelm.attach import block_config
from bridgelm.layout import decoder_layers
from bridgelm.errors import UserError, check_int
from bridgelm.eval.folder import read_samples
from bridgelm.grouped import KWARG, Groups
from bridgelm.intervals import bootstrap_ci
from bridgelm.jsonl import write_atomic
from bridgelm.logprobs import Row, pack_rows, response_logprobs
from bridgelm.progress import bar as progress_bar

# ---------------------------------------------------------------------------------------------- features


def _blocks(model) -> list[torch.nn.Module]:
    cfg = block_config(model)
    if cfg is None:
        raise UserError(
            f"{type(model).__name__} has no Bridge or P-Match blocks: nothing to measure (add_bridge, or --blocks)"
        )
    return [getattr(layer, cfg.kind) for layer in decoder_layers(model)]


@torch.no_grad()
def feature_ratio_sums(model, input_ids, attention_mask, group_ids) -> tuple[list[float], int]:
    """Sum over valid tokens of ||block output|| / ||block input|| per layer, and the number of valid tokens.

    input_ids, attention_mask [B, S] (right-padded, 1 on real tokens); group_ids [B].
    """
    assert input_ids.dim() == 2 and attention_mask.shape == input_ids.shape, (
        f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} must be equal [B, S]")
    blocks = _blocks(model)
    valid = attention_mask.bool()  # [B, S]
    sums = [0.0] * len(blocks)

    def hook_for(i: int):
        def hook(module, args, output):
            x = args[0]  # [B, S, D] residual stream entering the block
            ratio = output.float().norm(dim=-1) / x.float().norm(dim=-1).clamp_min(1e-12)  # [B, S]
            sums[i] += float(ratio[valid.to(ratio.device)].double().sum())

        return hook

    handles = [b.register_forward_hook(hook_for(i)) for i, b in enumerate(blocks)]
    was_training = model.training
    model.eval()
    try:
        groups = Groups.build(torch.as_tensor(group_ids), attention_mask)
        # logits_to_keep=1: the hooks need the hidden states only, not [B, S, V] logits.
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=1, **{KWARG: groups})
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return sums, int(valid.sum())


def block_feature_ratios(model, input_ids, attention_mask, group_ids) -> list[float]:
    """Per layer, the mean over valid tokens of ||block output|| / ||residual stream at the block|| (Figure 7)."""
    sums, count = feature_ratio_sums(model, input_ids, attention_mask, group_ids)
    assert count > 0, "attention_mask has no valid token: expected at least one 1"
    return [s / count for s in sums]


def _pick(items: list, count: int) -> list:
    """`count` items spread evenly over `items` (all of them when there are fewer)."""
    check_int("sets", count, note=" (response sets)")
    if len(items) <= count:
        return items
    return [items[int(i)] for i in np.linspace(0, len(items) - 1, count).round()]


def _run_sets(
    run_dir, sets: int, benchmark: str | None, width: int | None, max_tokens: int | None, min_width: int = 1
) -> tuple[dict, list]:
    """A run's sampled records and `sets` of their keys (benchmark, width, index) of width `width` (None: any of at
    least `min_width`), spread evenly; `max_tokens` (the cut of each sequence, None: none) is checked here for the
    callers."""
    if max_tokens is not None:
        check_int("max_tokens", max_tokens, note=" (tokens per sequence, or None)")
    records = read_samples(run_dir)
    keys = sorted(
        k
        for k in records
        if (benchmark is None or k[0] == benchmark) and (k[1] == width if width is not None else k[1] >= min_width)
    )
    if not keys:
        raise UserError(f"{run_dir} has no sampled problems {_where(benchmark, width, min_width)}: it has "
                        f"{_has(records)}")
    return records, _pick(keys, sets)


def _where(benchmark: str | None, width: int | None, min_width: int) -> str:
    at = f"at width {width}" if width is not None else f"at a width of {min_width} or more"
    return at if benchmark is None else f"of benchmark {benchmark!r} {at}"


def _has(records: dict) -> str:
    """The benchmarks and widths a run's samples hold, for a message."""
    found: dict[str, set] = {}
    for bench, w, *_ in records:
        found.setdefault(bench, set()).add(w)
    return "; ".join(f"{b} at widths {', '.join(map(str, sorted(ws)))}" for b, ws in sorted(found.items())) or "none"


def run_feature_ratios(
    model,
    run_dir: str | os.PathLike,
    sets: int = 8,
    benchmark: str | None = None,
    width: int | None = None,
    max_tokens: int | None = 4096,
    progress: bool = True,
) -> dict[str, Any]:
    """Feature ratios over `sets` sampled response sets of a run: each problem's first group of its width.

    Every sequence is its prompt ids + generated ids, cut at `max_tokens`. Returns {"ratios": [per layer],
    "kind", "sets", "tokens", "problems": [[benchmark, width, index], ...]}.
    """
    records, chosen = _run_sets(run_dir, sets, benchmark, width, max_tokens)
    device = next(model.parameters()).device
    totals, count = None, 0
    bar = progress_bar(len(chosen), "feature ratios", "set", enabled=progress)
    try:
        for key in chosen:
            rec = records[key]
            w = int(rec["width"])
            seqs = [(rec["prompt_ids"] + s["token_ids"])[:max_tokens] for s in rec["samples"][:w]]
            S = max(len(s) for s in seqs)
            ids = torch.zeros(len(seqs), S, dtype=torch.long)  # [w, S], right-padded
            mask = torch.zeros(len(seqs), S, dtype=torch.long)
            for r, s in enumerate(seqs):
                ids[r, : len(s)] = torch.tensor(s)
                mask[r, : len(s)] = 1
            sums, n = feature_ratio_sums(
                model, ids.to(device), mask.to(device), torch.zeros(len(seqs), dtype=torch.long)
            )
            totals = sums if totals is None else [a + b for a, b in zip(totals, sums)]
            count += n
            bar.update(1)
    finally:
        bar.close()
    return {
        "ratios": [t / count for t in totals],
        "kind": block_config(model).kind,
        "sets": len(chosen),
        "tokens": count,
        "problems": [list(k) for k in chosen],
    }


def plot_feature_ratios(ratios: dict[str, Sequence[float]] | Sequence[float], path: str | os.PathLike) -> Path:
    """Bars of the per-layer ratio, one panel per model (`{name: ratios}`, or one list) (Figure 7)."""
    from matplotlib.figure import Figure

    panels = ratios if isinstance(ratios, dict) else {"blocks": list(ratios)}
    fig = Figure(figsize=(4.2 * len(panels), 3.2), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (name, values) in zip(axes, panels.items()):
        ax.bar(range(len(values)), list(values))
        ax.set_title(name)
        ax.set_xlabel("layer")
        ax.set_ylabel("||block output|| / ||residual||")
        ax.grid(axis="y", alpha=0.3)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    return write_atomic(path, buf.getvalue())


# ---------------------------------------------------------------------------------------------- siblings


@torch.no_grad()
def set_nll(model, prompt_ids: Sequence[int], responses: Sequence[Sequence[int]]) -> tuple[float, float, int]:
    """NLL (nats, summed over the response tokens) of one response set, teacher-forced: with the set as one
    group, and with each response alone. -> (with siblings, alone, response tokens)."""
    pad = getattr(model.config, "pad_token_id", None) or 0
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        sums = []
        for rows in (
            [Row(prompt_ids, r, 0) for r in responses],  # one group: the set's responses are siblings
            [Row(prompt_ids, r, i) for i, r in enumerate(responses)],  # a group each: w=1
        ):
            batch = pack_rows(rows, pad, device)
            sums.append(-float((response_logprobs(model, batch).logprobs.double() * batch.response_mask).sum()))
    finally:
        model.train(was_training)
    return sums[0], sums[1], batch.tokens


def sibling_gain(model, sets: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]], progress: bool = True) -> dict:
    """What siblings are worth to `model` over `sets` of (prompt ids, responses): NLL per response token with the
    set as one group and alone, and `diff` (with - alone; negative: the siblings help), the mean over sets of
    each set's per-token difference with its 95% bootstrap interval over sets."""
    if not sets:
        raise UserError("no response sets to measure: expected at least one")
    if block_config(model) is None:  # P-Match blocks are let through: the control, 0 by construction
        raise UserError(
            f"{type(model).__name__} has no Bridge or P-Match blocks: its samples cannot read each other, so siblings "
            "are worth 0 by construction (add_bridge, or --blocks)"
        )
    vocab = model.get_input_embeddings().num_embeddings
    top = max(max(p, default=0) for p, _ in sets), max(max(t, default=0) for _, rs in sets for t in rs)
    if max(top) >= vocab:
        raise UserError(
            f"token id {max(top)} of the response sets is outside the model's vocabulary of {vocab}: "
            "expected sets tokenized for this model"
        )
    together = alone = 0.0
    tokens, per_set = 0, []
    bar = progress_bar(len(sets), "sibling NLL", "set", enabled=progress)
    try:
        for prompt_ids, responses in sets:
            a, b, n = set_nll(model, prompt_ids, responses)
            together, alone, tokens = together + a, alone + b, tokens + n
            per_set.append((a - b) / n)
            bar.update(1)
    finally:
        bar.close()
    low, high = bootstrap_ci(per_set)
    cfg = block_config(model)
    return {
        "kind": None if cfg is None else cfg.kind,
        "sets": len(sets),
        "responses": sum(len(r) for _, r in sets),
        "tokens": tokens,
        "nll_with_siblings": together / tokens,
        "nll_alone": alone / tokens,
        "diff": {"mean": float(np.mean(per_set)), "low": low, "high": high},
    }


def run_response_sets(
    run_dir, sets: int, benchmark: str | None = None, width: int | None = None, max_tokens: int | None = 4096
) -> list[tuple[list[int], list[list[int]]]]:
    """`sets` sampled response sets of an eval run, each the first group of its width (as sampled together); widths of
    2 or more only (a set of one response has no siblings)."""
    if width is not None and width < 2:
        raise UserError(f"width={width}: a set of one response has no siblings; expected a width of 2 or more")
    records, chosen = _run_sets(run_dir, sets, benchmark, width, max_tokens, min_width=2)
    out = []
    for key in chosen:
        rec = records[key]
        room = None if max_tokens is None else max(1, max_tokens - len(rec["prompt_ids"]))
        responses = [s["token_ids"][:room] for s in rec["samples"][: int(rec["width"])]]
        out.append((list(rec["prompt_ids"]), [r for r in responses if r]))
    return [(p, r) for p, r in out if len(r) >= 2]  # a set left with one response by the cut has no siblings


def warmup_response_sets(path, sets: int) -> list[tuple[list[int], list[list[int]]]]:
    """`sets` kept problems of a warm-up file (spread evenly), each with its correct traces."""
    from bridgelm.warmup_file import read_warmup

    return [(p.prompt_ids, p.responses) for p in _pick(read_warmup(path), sets)]

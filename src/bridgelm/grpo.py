"""GRPO's objective as pure tensor math (paper Sec. 3.3, eq. 3, with DAPO's token-level normalisation).

- `group_advantages`: A_i = (r_i - mean) / (std + eps) over the G rollouts of a prompt (std with Bessel's
  correction, as TRL and verl compute it); exactly 0 in a group whose rewards are all equal. A prompt sampled as
  several Bridge groups (G = k x w) is normalised over all its G rollouts, across its groups: this project's reading
  of App. A (G = 8 at width 4), where eq. 3 has one group of all G.
- `between_group_advantages`: one reading of App. C (which gives no formula), advantages *between* a prompt's Bridge
  groups. A rollout's baseline is the mean reward of the prompt's *other* groups (leave-own-group-out), scaled by the
  std of all G rewards: the baseline is independent of the rollout's own group, so no sibling's reward enters it.
  Needs >= 2 groups a prompt.
- `policy_loss`: -J. Per token, min(R A, clip(R, 1 - eps, 1 + eps_high) A) - beta * KL_k3(pi || pi_ref), summed
  over unmasked tokens and divided by the token count of the whole mini-batch (DAPO's token-level mean; eq. 3 as
  written divides by one prompt's tokens, sum_i |o_i|). A mini-batch split into micro-batches (or over ranks)
  passes that global count as `num_tokens`, so the pieces add up to the loss of the whole mini-batch.
  It returns the loss with its token sums for logging (`PolicyStats`: clipped tokens, KL, ratios), computed from the
  same ratio and KL; sums add over micro-batches and ranks.

With Bridge the G rollouts of a prompt are generated interdependently, so the log-probs of a group come from one
grouped forward and the ratios, KL terms and gradients of its rollouts are coupled; the formula itself does not
change. Everything here is elementwise math on [B, T] tensors; the trainer (train/rl.py) supplies them.

    python -m pytest tests/test_grpo.py
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def _check_rewards(rewards: torch.Tensor) -> None:
    """Invariants: the rewards reach here [P, G] and finite (tasks.check_rewards refused a non-finite one)."""
    assert rewards.dim() == 2, f"rewards must be [P, G] (prompts x rollouts), got shape {tuple(rewards.shape)}"
    assert bool(torch.isfinite(rewards).all()), f"rewards hold a non-finite value: {rewards[~torch.isfinite(rewards)]}"


def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """Advantages of rewards [P, G] (P prompts, G rollouts each) -> [P, G]."""
    _check_rewards(rewards)
    rewards = rewards.float()
    mean = rewards.mean(-1, keepdim=True)  # [P, 1]
    if rewards.shape[1] < 2:
        return torch.zeros_like(rewards)
    std = rewards.std(-1, keepdim=True)  # [P, 1], unbiased
    adv = (rewards - mean) / (std + eps)  # [P, G]
    all_equal = (rewards == rewards[:, :1]).all(-1, keepdim=True)  # [P, 1]
    return torch.where(all_equal, torch.zeros_like(adv), adv)


def between_group_advantages(rewards: torch.Tensor, width: int, eps: float = 1e-4) -> torch.Tensor:
    """Advantages of rewards [P, G] in Bridge groups of `width` consecutive rollouts, each against the mean of the
    prompt's other groups -> [P, G]. Exactly 0 in a prompt whose rewards are all equal."""
    _check_rewards(rewards)
    P, G = rewards.shape
    # RLConfig.validate refuses rollouts < 2 x width for this advantage
    assert width >= 1 and G % width == 0 and G // width >= 2, (
        f"between-group advantages need >= 2 Bridge groups of width {width} per prompt; got {G} rollouts")
    rewards = rewards.float()
    k = G // width
    sums = rewards.view(P, k, width).sum(-1, keepdim=True)  # [P, k, 1]
    others = (sums.sum(1, keepdim=True) - sums) / (width * (k - 1))  # [P, k, 1]: mean of the other groups' rewards
    std = rewards.std(-1, keepdim=True)  # [P, 1]
    adv = (rewards.view(P, k, width) - others).view(P, G) / (std + eps)
    all_equal = (rewards == rewards[:, :1]).all(-1, keepdim=True)
    return torch.where(all_equal, torch.zeros_like(adv), adv)


ADVANTAGES = ("prompt", "between-groups")


def advantages_of(kind: str, rewards: torch.Tensor, width: int) -> torch.Tensor:
    """The advantages [P, G] of `kind`: "prompt" (over all G rollouts of a prompt, the paper's) or "between-groups"
    (App. C: each rollout against the prompt's other Bridge groups)."""
    assert kind in ADVANTAGES, f"advantage={kind!r}: expected one of {', '.join(ADVANTAGES)}"  # RLConfig checked it
    return group_advantages(rewards) if kind == "prompt" else between_group_advantages(rewards, width)


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref): exp(ref - logp) - (ref - logp) - 1 (>= 0). [B, T] -> [B, T]."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1


def _check(logprobs, old_logprobs, advantages, mask) -> None:
    """Invariants of the update's tensors (broadcasting would otherwise hide a mismatch)."""
    assert logprobs.dim() == 2 and old_logprobs.shape == logprobs.shape == mask.shape, (
        f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and mask {tuple(mask.shape)} "
        "must all be [B, T]")
    assert advantages.shape == logprobs.shape[:1], (
        f"advantages has shape {tuple(advantages.shape)}; expected [B] = [{logprobs.shape[0]}]")


def _clipped_surrogate(ratio, adv, clip_eps, clip_eps_high):
    high = clip_eps if clip_eps_high is None else clip_eps_high
    return torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + high) * adv)


class PolicyStats(NamedTuple):
    """Token sums of one `policy_loss` call (add them over micro-batches and ranks, then divide by `tokens`)."""

    tokens: float  # unmasked tokens
    clipped: float  # tokens whose clipped term is the active one (ratio outside the range, in the advantage's sign)
    kl: float  # sum of the k3 KL to the reference (0 without one)
    ratio: float  # sum of the ratios


class PolicyLoss(NamedTuple):
    """What `policy_loss` returns: the loss to backpropagate and its token sums for logging."""

    loss: torch.Tensor  # scalar, -J
    stats: PolicyStats


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    beta: float = 1e-3,
    num_tokens: float | torch.Tensor | None = None,
) -> PolicyLoss:
    """-J of eq. 3 and its token sums: logprobs, old_logprobs, ref_logprobs [B, T]; advantages [B]; mask [B, T] ->
    (scalar loss, PolicyStats). The ratio and the KL are computed once, for both.

    `num_tokens` is the normaliser (default: the unmasked tokens of this call). Masked positions may hold
    anything, even non-finite values: they never reach the loss, its gradient or the stats. The KL is summed in the
    stats whenever `ref_logprobs` is given, and enters the loss only when beta != 0.
    """
    _check(logprobs, old_logprobs, advantages, mask)
    assert beta == 0 or ref_logprobs is not None, f"beta={beta} needs ref_logprobs (log-probs of the reference policy)"
    keep = mask.bool()  # [B, T]
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    logprobs = torch.where(keep, logprobs, zero)  # padding -> 0, so nothing non-finite enters the graph
    ratio = torch.exp(logprobs - torch.where(keep, old_logprobs, zero))  # [B, T]
    adv = advantages[:, None].to(ratio.dtype)  # [B, 1]
    per_token = _clipped_surrogate(ratio, adv, clip_eps, clip_eps_high)  # [B, T]
    kl = None if ref_logprobs is None else k3_kl(logprobs, torch.where(keep, ref_logprobs, zero))  # [B, T]
    if beta != 0:
        per_token = per_token - beta * kl
    count = keep.sum() if num_tokens is None else num_tokens
    count = torch.as_tensor(count, dtype=per_token.dtype, device=per_token.device).clamp(min=1)
    loss = -torch.where(keep, per_token, zero).sum() / count
    with torch.no_grad():
        stats = _stats(ratio, kl, adv, keep, clip_eps, clip_eps_high)
    return PolicyLoss(loss, stats)


def _stats(ratio, kl, adv, keep, clip_eps, clip_eps_high) -> PolicyStats:
    """The token sums of ratio and kl [B, T] over `keep` [B, T], fetched from the device at once."""
    high = clip_eps if clip_eps_high is None else clip_eps_high
    clipped = ((ratio < 1 - clip_eps) & (adv < 0)) | ((ratio > 1 + high) & (adv > 0))  # [B, T]
    kl_sum = torch.zeros((), device=ratio.device) if kl is None else kl[keep].sum()
    sums = [keep.sum(), (clipped & keep).sum(), kl_sum, ratio[keep].sum()]
    return PolicyStats(*torch.stack([s.double() for s in sums]).tolist())

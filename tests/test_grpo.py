"""GRPO math against slow per-token loops (paper eq. 3, DAPO token normalisation, k3 KL)."""

import math

import pytest
import torch

from bridgelm.grpo import group_advantages, k3_kl, policy_loss


def reference_advantages(rewards, eps=1e-4):
    out = []
    for row in rewards.tolist():
        mean = sum(row) / len(row)
        std = math.sqrt(sum((r - mean) ** 2 for r in row) / (len(row) - 1))
        out.append([0.0 if max(row) == min(row) else (r - mean) / (std + eps) for r in row])
    return torch.tensor(out)


def reference_loss(lp, old, ref, adv, mask, eps_low, eps_high, beta):
    """-J of eq. 3, token by token."""
    total, count = 0.0, 0
    B, T = len(lp), len(lp[0])
    for b in range(B):
        for t in range(T):
            if not mask[b][t]:
                continue
            ratio = math.exp(lp[b][t] - old[b][t])
            clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
            term = min(ratio * adv[b], clipped * adv[b])
            if beta:
                d = ref[b][t] - lp[b][t]
                term -= beta * (math.exp(d) - d - 1)
            total += term
            count += 1
    return -total / count


def test_group_advantages_match_loop_and_zero_for_equal_groups():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [0.3, 0.7, 0.1, 0.9]])
    got = group_advantages(rewards)
    assert torch.allclose(got, reference_advantages(rewards), atol=1e-6)
    assert torch.equal(got[1], torch.zeros(4)) and torch.equal(got[2], torch.zeros(4))
    # advantages are centred within each group
    assert torch.allclose(got.sum(-1), torch.zeros(4), atol=1e-5)


def test_group_advantages_errors():
    with pytest.raises(AssertionError, match=r"\[P, G\]"):
        group_advantages(torch.zeros(8))
    with pytest.raises(AssertionError, match="nan"):
        group_advantages(torch.tensor([[1.0, float("nan")]]))


def _inputs(seed=0, B=4, T=7, spread=0.8):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g) * 3
    old = lp + spread * torch.randn(B, T, generator=g)  # ratios well outside [0.8, 1.2] for some tokens
    ref = lp + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.tensor([1.5, -0.7, 0.0, -1.2])[:B]
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 5:] = False
    mask[2, 2:] = False
    mask[3, 6:] = False
    return lp, old, ref, adv, mask


@pytest.mark.parametrize("eps_high", [None, 0.28])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_policy_loss_matches_token_loop(eps_high, beta):
    lp, old, ref, adv, mask = _inputs()
    got = policy_loss(lp, old, ref if beta else None, adv, mask, clip_eps=0.2, clip_eps_high=eps_high, beta=beta).loss
    want = reference_loss(
        lp.tolist(), old.tolist(), ref.tolist(), adv.tolist(), mask.tolist(), 0.2, eps_high or 0.2, beta
    )
    assert got.item() == pytest.approx(want, rel=1e-5, abs=1e-7)
    # both clip sides are exercised: positive advantage above 1 + eps, negative advantage below 1 - eps
    ratio = (lp - old).exp()
    assert bool(((ratio > 1.3) & (adv[:, None] > 0) & mask).any())
    assert bool(((ratio < 0.7) & (adv[:, None] < 0) & mask).any())


def test_masked_positions_never_matter():
    lp, old, ref, adv, mask = _inputs(seed=1)
    lp = lp.clone().requires_grad_(True)
    base, base_stats = policy_loss(lp, old, ref, adv, mask, beta=0.1)
    junk = [t.clone() for t in (lp.detach(), old, ref)]
    for t in junk:
        t[~mask] = float("nan")
    lp2 = junk[0].requires_grad_(True)
    got, stats = policy_loss(lp2, junk[1], junk[2], adv, mask, beta=0.1)
    assert got.item() == base.item()
    assert stats == base_stats and all(map(math.isfinite, stats))  # the stats ignore them too
    got.backward()
    base.backward()
    assert torch.isfinite(lp2.grad).all()
    assert torch.equal(lp2.grad[~mask], torch.zeros(int((~mask).sum())))
    assert torch.allclose(lp2.grad, lp.grad)


def test_token_normalisation_over_microbatches():
    """Two halves with the global count add up to the whole batch's loss (DAPO over a mini-batch)."""
    lp, old, ref, adv, mask = _inputs(seed=2)
    whole = policy_loss(lp, old, ref, adv, mask, beta=0.01).loss
    n = mask.sum()
    halves = sum(
        policy_loss(lp[s], old[s], ref[s], adv[s], mask[s], beta=0.01, num_tokens=n).loss
        for s in (slice(0, 2), slice(2, 4))
    )
    assert halves.item() == pytest.approx(whole.item(), rel=1e-6)


def test_first_step_ratio_is_one():
    """With old = current log-probs, the loss is -mean(A) over tokens and the gradient is the plain policy gradient."""
    lp, _, _, adv, mask = _inputs(seed=3)
    lp = lp.clone().requires_grad_(True)
    loss, stats = policy_loss(lp, lp.detach(), None, adv, mask, beta=0.0)
    n = mask.sum()
    assert loss.item() == pytest.approx(-(adv[:, None] * mask).sum().item() / n.item(), rel=1e-6)
    loss.backward()
    assert torch.allclose(lp.grad, -(adv[:, None] * mask) / n)
    assert stats.clipped == 0 and stats.ratio == stats.tokens == n.item()


def test_k3_kl_and_stats():
    lp, old, ref, adv, mask = _inputs(seed=4)
    kl = k3_kl(lp, ref)
    assert bool((kl >= 0).all())
    assert torch.equal(k3_kl(lp, lp), torch.zeros_like(lp))
    s = policy_loss(lp, old, ref, adv, mask, clip_eps=0.2, beta=0.0).stats  # the KL is summed whatever beta
    ratio = (lp - old).exp()
    want_clipped = sum(
        1
        for b in range(4)
        for t in range(7)
        if mask[b, t] and ((ratio[b, t] < 0.8 and adv[b] < 0) or (ratio[b, t] > 1.2 and adv[b] > 0))
    )
    assert s.clipped == want_clipped > 0
    assert s.kl == pytest.approx(float(kl[mask].sum()), rel=1e-6)
    assert s.tokens == float(mask.sum())


def test_policy_loss_errors():
    lp, old, ref, adv, mask = _inputs()
    with pytest.raises(AssertionError, match="ref_logprobs"):
        policy_loss(lp, old, None, adv, mask, beta=0.1)
    with pytest.raises(AssertionError, match=r"advantages"):
        policy_loss(lp, old, ref, adv[:2], mask)
    with pytest.raises(AssertionError, match=r"\[B, T\]"):
        policy_loss(lp, old[:, :3], ref, adv, mask)

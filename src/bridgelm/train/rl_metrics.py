"""One RL step's record in metrics.jsonl: its sums on each rank, summed over ranks in one collective, then divided.

`StepSums` gathers what a rank contributes (its rollouts' rewards, lengths and timings, its update's token sums);
`dist.all_reduce_fields` sums every field over the ranks at once; `step_record` turns the sums, the update's
own (already global) loss and gradient norms, and the step's clock into the record's named means.

Used by bridgelm.train.rl; the records are read by tests/test_rl.py and tests/test_train_distributed.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bridgelm.dist import Dist, all_reduce_fields
from bridgelm.train.rollouts import Rollouts
from bridgelm.train.update import UpdateStats

if TYPE_CHECKING:
    from bridgelm.train.rl_config import RLConfig


@dataclass
class StepSums:
    """A step's sums on one rank (`of`), or over all ranks (after `all_reduce_fields`)."""

    reward: float  # of the rewards
    correct: float  # rollouts graded correct
    rollouts: float
    flat_prompts: float  # prompts whose rewards are all equal (advantages all 0)
    prompts: float
    response_tokens: float
    truncated: float  # rollouts cut at max_new_tokens
    empty: float  # rollouts that ended at once (no token before their EOS)
    clipped: float  # trained tokens whose clipped term is active (grpo.PolicyStats), over the update's passes
    kl: float  # k3 KL to the reference over the trained tokens
    entropy: float  # over the response tokens that had a forward
    entropy_tokens: float
    sample_seconds: float  # sampling time

    @classmethod
    def of(cls, rollouts: Rollouts, update: UpdateStats, n: int) -> StepSums:
        """This rank's sums, of its `rollouts` (`n` a prompt) and of the `update` trained on them."""
        r, sums = rollouts.rewards, update.sums
        per_prompt = r.view(-1, n)  # [P, n]
        return cls(
            reward=float(r.sum()),
            correct=float(rollouts.correct.sum()),
            rollouts=float(r.numel()),
            flat_prompts=float((per_prompt == per_prompt[:, :1]).all(-1).sum()),
            prompts=float(per_prompt.shape[0]),
            response_tokens=float(sum(len(row.response) for row in rollouts.rows)),
            truncated=float(sum(not f for f in rollouts.finished)),
            empty=float(sum(len(row.response) <= f for row, f in zip(rollouts.rows, rollouts.finished, strict=True))),
            clipped=sums.clipped,
            kl=sums.kl,
            entropy=sums.entropy,
            entropy_tokens=sums.entropy_tokens,
            sample_seconds=rollouts.sample_seconds,
        )


def step_record(
    step: int, rollouts: Rollouts, update: UpdateStats, cfg: RLConfig, lr: float, t0: float, t1: float, dist: Dist
) -> dict:
    """The record of `step` (0-based) whose sampling began at `t0` and update at `t1`, summed over ranks."""
    s = all_reduce_fields(StepSums.of(rollouts, update, cfg.rollout.n), dist)
    n, length = s.rollouts, s.response_tokens
    passes = cfg.epochs_per_rollout
    trained = max(update.sums.tokens, 1.0)  # tokens over all ranks and mini-batches (each pass)
    now = time.perf_counter()
    n_opt = cfg.steps_per_rollout * passes
    return {
        "step": step + 1,
        "optimizer_steps": (step + 1) * n_opt,
        "lr": lr,
        "reward": s.reward / n,
        "accuracy": s.correct / n,
        "zero_advantage_prompts": s.flat_prompts / s.prompts,
        "loss": update.sums.loss / n_opt,
        "kl": s.kl / trained if cfg.beta > 0 else None,
        "clip_fraction": s.clipped / trained,
        # over the response tokens that had a forward (None: none had, every prompt's rewards equal and beta = 0)
        "entropy": s.entropy / s.entropy_tokens if s.entropy_tokens else None,
        "response_length": length / n,
        "truncated": s.truncated / n,
        "empty": s.empty / n,
        "grad_norm": update.grad_norm / n_opt,
        **{f"grad_norm_{k}": v / n_opt for k, v in update.parts.items()},
        "tokens_per_s": length / max(now - t0, 1e-9),
        "sample_tokens_per_s": length / max(s.sample_seconds / dist.world, 1e-9),
        "sample_seconds": t1 - t0,
        "update_seconds": now - t1,
        "old_logprob_seconds": update.old_seconds,  # the update's no_grad passes
        "reference_seconds": update.ref_seconds,
        "seconds": now - t0,
        "passes": passes,
    }

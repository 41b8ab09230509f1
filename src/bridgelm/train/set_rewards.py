"""Set-level rewards of GRPO rollouts: the samples of a Bridge group judged as a set (`bridgelm rl --reward`).

The paper rewards each rollout by its own correctness and suggests (App. C) several Bridge groups per prompt with
advantages computed between the groups. Rollouts G = k x width give a prompt k groups, and the advantages are
normalised over all G rewards of the prompt (bridgelm.grpo.group_advantages on the [P, G] rewards), so a group is
compared with the other groups of its prompt. A set-level reward then scores what a group achieves together; the
paper defines none, so these are this project's:

- "sample": r_i = the task's reward of rollout i (the paper's).
- "majority": every rollout of a group gets 1 when the group's majority answer is correct, else 0: the evaluation's
  self-consistency vote (bridgelm.eval.metrics.majority_vote: the most common canonical answer wins, the first seen
  among equals, an answer that does not parse never wins). It needs >= 2 groups per prompt: with one, every rollout of a
  prompt gets the same reward and every advantage is 0 (RLConfig refuses it).
- "sibling": sibling credit, r_i + L x the mean of the other rewards of i's group (L: `sibling_weight`), so that a
  rollout is paid for what its siblings achieve. Under Bridge a rollout's tokens shape its siblings' samples, and the
  exact policy gradient of a group's summed reward credits each rollout with the whole group's reward (L = w - 1),
  where per-sample GRPO keeps only its own. With one group per prompt the siblings' term is shared by the rollouts it
  compares and cancels in the advantage, so it needs >= 2 groups per prompt and advantages between the groups
  (RLConfig refuses it otherwise).
- "distinct": coverage, where duplicate samples waste the budget, for tasks whose problems have several correct
  answers that the task's `extract` tells apart (`Task.several_answers`: Countdown's expressions). A correct rollout
  gets 1/k, k the number of correct rollouts of its group with the same canonical answer; a wrong one 0. A group's
  rewards add up to its number of distinct correct answers, and no rollout's reward depends on the siblings' order.
  Correct rollouts whose answer does not parse count as one answer.

Rewards stay per-rollout tensors [R] (P prompts x G rollouts, groups of `width` in order); tested by
tests/test_set_rewards.py.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from bridgelm.errors import UserError
from bridgelm.eval.metrics import canonical_answer, majority_vote
from bridgelm.tasks.base import is_correct

REWARDS = ("sample", "majority", "distinct", "sibling")


def check_reward_task(reward: str, task) -> None:
    """A ValueError when `task` cannot grade `reward`: a set-level reward of a graded score (ROUGE), or "distinct" on
    a task whose problems have one correct answer."""
    if reward in ("sample", "sibling"):
        return
    if task.continuous:
        raise UserError(f"reward={reward!r} needs a task graded correct or not; task {task.name!r} gives a score")
    if reward == "distinct" and not task.several_answers:
        raise UserError(
            f"reward='distinct' needs a task whose problems have several correct answers (countdown); task "
            f"{task.name!r} has one per problem"
        )


def set_rewards(
    reward: str, scores: torch.Tensor, answers: Sequence[str | None], width: int, sibling_weight: float = 1.0
) -> torch.Tensor:
    """The rewards [R] of `reward` from the task's rewards `scores` [R] and extracted `answers` (R of them; not read by
    "sample" and "sibling"), in groups of `width` consecutive rollouts."""
    if reward == "sample":
        return scores
    if reward == "sibling":
        return sibling_rewards(scores, width, sibling_weight)
    assert len(answers) == scores.numel() and scores.numel() % width == 0, (
        f"{len(answers)} answers and {scores.numel()} rewards must be as many, in groups of {width}")
    of_group = {"majority": majority_rewards, "distinct": distinct_rewards}[reward]
    out = []
    for start in range(0, len(answers), width):
        correct = [is_correct(s) for s in scores[start : start + width].tolist()]
        out += of_group(answers[start : start + width], correct)
    return torch.tensor(out, dtype=torch.float32)  # [R]


def majority_rewards(answers: Sequence[str | None], correct: Sequence[bool]) -> list[float]:
    """One group: 1 for every rollout when its majority answer is correct, else 0."""
    return [float(majority_vote(answers, correct))] * len(answers)


def distinct_rewards(answers: Sequence[str | None], correct: Sequence[bool]) -> list[float]:
    """One group: 1/k for a correct rollout whose canonical answer k correct rollouts hold, 0 for a wrong one."""
    canon = [canonical_answer(a) for a in answers]
    holders = Counter(a for a, ok in zip(canon, correct) if ok)
    return [1 / holders[a] if ok else 0.0 for a, ok in zip(canon, correct)]


def sibling_rewards(scores: torch.Tensor, width: int, weight: float) -> torch.Tensor:
    """r_i + weight x (mean of the other rewards of i's group), in groups of `width` consecutive rollouts -> [R]."""
    assert width >= 2 and scores.numel() % width == 0, (  # RLConfig refuses reward='sibling' at width 1
        f"sibling rewards need groups of width >= 2 that divide {scores.numel()} rewards; got {width}")
    groups = scores.float().view(-1, width)  # [groups, w]
    others = (groups.sum(-1, keepdim=True) - groups) / (width - 1)
    return (groups + weight * others).view(-1)

"""GRPO's rollout phase: a step's prompts, the model that samples them, and the graded rollout batch.

A step takes P prompts of an epoch-wise shuffled stream (sharded over ranks; a prompt's G rollouts never leave its
rank) and samples G rollouts per prompt with the engine, in Bridge groups of width w (w divides G), from the policy
or, with `rollout_dtype`, from a copy of it in that dtype refreshed before the step. The rollouts are graded
(reward = correctness, or with `reward` a set-level reward of each Bridge group: train/set_rewards.py) and their
advantages computed over the G rollouts of a prompt: with G = k x w, across its k groups (paper App. C). The
sampling seed derives from (seed, step, rank), the data order from (seed, epoch): a resumed run draws what an
uninterrupted one would.

Used by bridgelm.train.rl; tested by tests/test_rl.py and tests/test_set_rewards.py.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from bridgelm.dist import Dist, unsharded
from bridgelm.grpo import group_advantages
from bridgelm.rng import derive_seed, generator
from bridgelm.engine import encode_prompts, eos_ids, generate_ids, pad_id
from bridgelm.tasks.base import check_rewards, is_correct
from bridgelm.train.batches import Row
from bridgelm.train.set_rewards import set_rewards

if TYPE_CHECKING:
    from bridgelm.train.rl_config import RLConfig


@dataclass
class Rollouts:
    """One rank's rollout batch: P_local prompts x G rollouts, in prompt order."""

    rows: list[Row]  # group g holds rows g*w .. g*w + w - 1
    width: int  # w
    rewards: torch.Tensor  # [R]
    advantages: torch.Tensor  # [R]
    finished: list[bool]  # [R]: ended with EOS
    sample_seconds: float  # time spent sampling
    correct: torch.Tensor | None = None  # [R] bool: each rollout's own correctness, what accuracy counts (set by
    # collect_rollouts; with a set-level reward it differs from `rewards`)

    @property
    def n_groups(self) -> int:
        return len(self.rows) // self.width

    def group_rows(self, groups) -> list[int]:
        return [g * self.width + j for g in groups for j in range(self.width)]

    def flat_groups(self) -> set[int]:
        """Groups whose rows' advantages are all exactly 0 (with 0/1 rewards: a prompt whose rewards are all equal)."""
        flat = (self.advantages.view(self.n_groups, self.width) == 0).all(-1)  # [n_groups]
        return set(torch.nonzero(flat).flatten().tolist())


def step_examples(task, cfg: RLConfig, step: int, dist: Dist) -> list[dict]:
    """This rank's prompts of `step`: the step's P prompts of an epoch-wise shuffled stream, sharded by rank."""
    n = len(task.examples)
    per_rank = cfg.prompts_per_step // dist.world
    first = step * cfg.prompts_per_step + dist.rank * per_rank
    out, cache = [], {}
    for i in range(first, first + per_rank):
        epoch = i // n
        if epoch not in cache:
            cache[epoch] = torch.randperm(n, generator=generator(cfg.seed, "data", epoch)).tolist()
        out.append(task.examples[cache[epoch][i % n]])
    return out


class RolloutPolicy:
    """What samples the rollouts: the policy, or (rollout_dtype) a copy of it in that dtype whose weights are copied
    from the policy before each step, as an inference engine beside a trainer would be. Only which tokens are drawn
    depends on it: the update's forwards recompute every log-prob from the policy."""

    def __init__(self, model, dtype: str | None):
        self.model = model
        self.replica = None
        self.pairs = []  # (replica parameter, policy parameter) of every trained parameter: all that changes
        if dtype is not None:
            self.replica = copy.deepcopy(model).to(getattr(torch, dtype)).requires_grad_(False)
            trained = zip(self.replica.parameters(), model.parameters(), strict=True)
            self.pairs = [(dst, src) for dst, src in trained if src.requires_grad]

    def current(self):
        """The model to sample this step with (the copy refreshed from the policy's weights)."""
        if self.replica is None:
            return self.model
        with torch.no_grad():
            for dst, src in self.pairs:
                dst.copy_(src)
        return self.replica


def collect_rollouts(model, tokenizer, task, examples: list[dict], cfg: RLConfig, step: int, dist: Dist) -> Rollouts:
    """Sample G rollouts per example in Bridge groups of width w, grade them, and compute advantages."""
    G, w = cfg.rollout.n, cfg.rollout.width
    prompt_ids = encode_prompts(tokenizer, [task.prompt(ex) for ex in examples], cfg.chat)
    sampling = replace(cfg.rollout, seed=derive_seed(cfg.seed, "rollouts", step, dist.rank))
    eos = eos_ids(model, tokenizer)
    t0 = time.perf_counter()
    with unsharded(model, dist):
        samples = generate_ids(model, prompt_ids, sampling, eos, pad_id(tokenizer, eos))
    seconds = time.perf_counter() - t0
    rows, pairs, finished = [], [], []
    for p, outs in enumerate(samples):
        for i, s in enumerate(outs):
            rows.append(Row(prompt_ids[p], s.token_ids, p * (G // w) + i // w))
            text = tokenizer.decode(s.token_ids, skip_special_tokens=True)
            pairs.append((task.graded_text(text, s.finished), examples[p]))
            finished.append(s.finished)
    scores = torch.tensor(check_rewards(task.reward_many(pairs), f"task {task.name!r}, step {step + 1}"))  # [R]
    answers = [task.extract(text) for text, _ in pairs] if cfg.reward != "sample" else []
    rewards = set_rewards(cfg.reward, scores, answers, w)  # [R]
    advantages = group_advantages(rewards.view(len(examples), G)).view(-1)  # over a prompt's G rollouts, all groups
    correct = torch.tensor([is_correct(x) for x in scores.tolist()], dtype=torch.bool)
    return Rollouts(rows, w, rewards, advantages, finished, seconds, correct)

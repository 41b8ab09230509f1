"""GRPO's rollout phase: a step's prompts, the model that samples them, and the graded rollout batch.

A step takes P prompts of an epoch-wise shuffled stream (sharded over ranks; a prompt's G rollouts never leave its
rank) and samples G rollouts per prompt with the engine, in Bridge groups of width w (w divides G), from the policy
or, with `rollout_dtype`, from a copy of it in that dtype refreshed before the step. The rollouts are graded
(reward = correctness, or with `reward` a set-level reward of each Bridge group: train/set_rewards.py) and their
advantages computed over the G rollouts of a prompt: with G = k x w, across its k groups. That is this project's
reading of App. A (G = 8 rollouts at width 4), not the paper's eq. 3 (one group of all G) nor App. C (advantages
between groups, which the paper did not use; `advantage="between-groups"` is one reading of it). The sampling seed
derives from (seed, step, rank), the data order from (seed, epoch): a resumed run draws what an uninterrupted one
would.

Used by bridgelm.train.rl; tested by tests/test_rl.py and tests/test_set_rewards.py.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from bridgelm.dist import Dist, gather_into, unsharded
from bridgelm.engine import check_prompt_chars, encode_prompts, eos_ids, generate_ids, pad_id
from bridgelm.grpo import advantages_of
from bridgelm.logprobs import Row
from bridgelm.rng import derive_seed, generator
from bridgelm.tasks.base import check_rewards, is_correct
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
    """What samples the rollouts: the policy itself, or (dtype) a replica of it in that dtype, a plain module never
    sharded, whose weights are copied from the policy before each step, as an inference engine beside a trainer
    would be. Only which tokens are drawn depends on it: the update's forwards recompute every log-prob from the
    policy.

    Made before the policy is sharded (`prepare_model`): the replica's parameters start on the meta device (its
    buffers are copied) and are allocated on the rank's device at the first `current()`, once FSDP has freed the
    whole model. Under FSDP `current()` gathers the parameters one at a time (`dist.gather_into`: each rank's shard
    cast to the replica's dtype, then all-gathered), so a rank holds the replica and one gathered parameter, never
    a full fp32 copy. The engine decodes the replica as any plain model, compiled on CUDA (no FSDP hooks in its
    graph). The first refresh copies every parameter, later ones only the trained ones (all that changes). The
    replica is kept between steps: its parameters keep their addresses, so the compiled step (and its CUDA graphs)
    is made once.

    Memory per GPU, DS-Qwen-7B (P = 7.62e9 parameters, blocks aside) on W = 8 GPUs under --fsdp --bf16:
      replica            2 bytes x P                                  = 15.2 GB, held throughout
      training state     (4 weights + 4 gradients + 8 AdamW) x P / W  = 15.2 GB; reference 4 x P / W = 3.8 GB
      KV cache           28 layers x 2 x 4 kv heads x 128 x 2 bytes = 57 KB a token; 56 rows x 4608 = 14.8 GB
      while gathering    one parameter in bf16 (the largest, the embedding: 152064 x 3584 x 2 bytes = 1.1 GB)
    against 30.5 GB (4 bytes x P) for a full fp32 copy, which the gathered policy (FSDP without bf16) is. Freeing
    the replica during the update would give its 15.2 GB back there, at the price of new addresses each step
    (re-recorded CUDA graphs); `bridgelm plan` counts it as held (its "rollout replica" row).
    """

    def __init__(self, model, dtype: str | None):
        self.model = model
        self.replica = None if dtype is None else _meta_replica(model, getattr(torch, dtype))
        self.pairs = None  # (replica parameter, policy parameter) refreshed each step; None: not allocated yet

    def current(self):
        """The model to sample this step with (the replica refreshed from the policy's weights: a collective under
        FSDP, every rank calls it)."""
        if self.replica is None:
            return self.model
        with torch.no_grad():
            if self.pairs is None:
                _allocate(self.replica, self.model)
                everything = _pairs(self.replica, self.model)
                for dst, src in everything:
                    gather_into(dst, src)
                self.pairs = [(dst, src) for dst, src in everything if src.requires_grad]
            else:
                for dst, src in self.pairs:
                    gather_into(dst, src)
        return self.replica


def _meta_replica(model, dtype: torch.dtype):
    """A copy of `model` whose parameters are in `dtype` on the meta device (none allocated; tied ones stay tied).
    Its buffers are copied in their own dtype, as transformers keeps them when it loads a model in bf16 and as FSDP's
    mixed precision leaves them: a bf16 rotary inv_freq would turn the angles at position 4096 by up to 5 radians."""
    from torch.distributed.fsdp import FSDPModule

    assert not any(isinstance(m, FSDPModule) for m in model.modules()), "a rollout replica is made before FSDP"
    memo = {id(p): torch.nn.Parameter(torch.empty_like(p, device="meta", dtype=dtype)) for p in model.parameters()}
    return copy.deepcopy(model, memo).requires_grad_(False)


def _allocate(replica, model) -> None:
    """Give the replica's meta parameters storage on the device of `model`'s parameters (tied ones stay tied)."""
    device = next(model.parameters()).device
    made: dict[int, torch.nn.Parameter] = {}
    for module in replica.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in made:
                made[id(p)] = torch.nn.Parameter(torch.empty_like(p, device=device), requires_grad=False)
            setattr(module, name, made[id(p)])
    replica.to(device)  # the buffers


def _pairs(replica, model) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
    """(replica parameter, policy parameter) of every parameter, in the same order on every rank."""
    out = []
    for (a, dst), (b, src) in zip(replica.named_parameters(), model.named_parameters(), strict=True):
        assert a == b, f"the rollout replica's parameter {a!r} faces the policy's {b!r}: expected one layout"
        out.append((dst, src))
    return out


def collect_rollouts(model, tokenizer, task, examples: list[dict], cfg: RLConfig, step: int, dist: Dist) -> Rollouts:
    """Sample G rollouts per example in Bridge groups of width w, grade them, and compute advantages."""
    G, w = cfg.rollout.n, cfg.rollout.width
    texts = [task.prompt(ex) for ex in examples]
    check_prompt_chars(model, tokenizer, texts, cfg.rollout.max_new_tokens)  # before tokenizing a line of megabytes
    prompt_ids = encode_prompts(tokenizer, texts, cfg.chat)
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
    weight = 1.0 if cfg.sibling_weight is None else cfg.sibling_weight
    rewards = set_rewards(cfg.reward, scores, answers, w, weight)  # [R]
    advantages = advantages_of(cfg.advantage, rewards.view(len(examples), G), w).view(-1)  # [R]
    correct = torch.tensor([is_correct(x) for x in scores.tolist()], dtype=torch.bool)
    return Rollouts(rows, w, rewards, advantages, finished, seconds, correct)

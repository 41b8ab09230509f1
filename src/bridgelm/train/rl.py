"""RLVR with GRPO where the rollouts of a prompt are generated interdependently (paper Sec. 3.3, 4.1, App. A, C).

A step:
1. takes P prompts (sharded over ranks; a prompt's G rollouts never leave its rank) and samples G rollouts per
   prompt with the engine, in Bridge groups of width w (w divides G), from the policy or, with `rollout_dtype`, from
   a copy of it in that dtype refreshed before the step;
2. grades them (reward = correctness) and computes group advantages over the G rollouts of a prompt;
3. computes old log-probs (and reference log-probs when beta > 0) with the training forward under no_grad, on the
   same micro-batches as the first pass of updates, so that the first ratio is exactly 1. The first mini-batch
   needs no such pass: before the first optimiser step the policy is the old one, so its own forward's detached
   log-probs are the old ones (kept for later epochs); the no_grad pass covers mini-batches 2..K only;
4. takes K optimiser steps on K mini-batches of whole Bridge groups (groups are the unit of shuffling and of
   micro-batching; micro-batches accumulate gradients; `micro_batch_tokens` sorts a mini-batch's groups by length
   and cuts micro-batches by padded tokens), with the loss of `bridgelm.grpo.policy_loss` normalised by
   the token count of the whole mini-batch over all ranks.

Work whose result is known is skipped (not under FSDP, whose ranks must run the same forwards). A group whose
advantages are all exactly 0 (with 0/1 rewards: a prompt whose G rewards are all equal) adds a policy term and a
gradient of 0 whatever its ratio, so it needs no old log-probs: the no_grad pass leaves out the micro-batches that
hold only such groups (the others keep the trained cut, so the ratio of an unchanged policy stays exactly 1), and
their trained forward makes their old log-probs as the first mini-batch's does. With beta = 0 such groups add
nothing to the loss or its gradient at all, so they get no forward or backward either (each mini-batch is cut into
micro-batches from its other groups; a mini-batch of such groups only gives the optimiser zero gradients, as the
full computation would).
Entropy is logged over the rows that had a forward, each once; a row first forwarded by a later mini-batch's training
(a micro-batch of zero-advantage groups, beta > 0) is measured after the earlier optimiser steps of its rollout
batch. The weights equal those of the full computation up to float rounding (tests/test_rl.py).

Log-probs are at the sampling temperature (logits / T), like the engine's. The reference is the policy at the start
of RL (blocks included), kept only when beta > 0. Per-step randomness (sampling seed, mini-batch shuffles, data
order) derives from (seed, step), so a resumed run ends with the same weights as an uninterrupted one.

Outputs in OUT: metrics.jsonl (one record per step), checkpoints/step-N/ (each a model directory that
`bridgelm.load_model` reads, plus trainer_state.pt and trainer.json; the last `keep_last` are kept), best/ (best
validation accuracy), run.json.

    bridgelm rl --model M --add bridge --task gsm8k --data train.jsonl --out rl_run
    torchrun --nproc_per_node 2 -m bridgelm rl --model M --blocks sft_run/blocks.safetensors --task gsm8k ...
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from bridgelm.attach import added_parameters, block_config
from bridgelm.dist import Dist, all_reduce_sum, prepare_model, setup_distributed, unsharded
from bridgelm.errors import check_int, check_number
from bridgelm.evaluate import EvalConfig, accuracy
from bridgelm.grpo import group_advantages, policy_loss, policy_stats
from bridgelm.jsonl import write_json
from bridgelm.rng import derive_seed, generator
from bridgelm.runs import latest_checkpoint, local_source
from bridgelm.engine import SamplingConfig, check_sampling, encode_prompts, eos_ids, generate_ids, pad_id
from bridgelm.tasks.base import check_rewards, is_correct
from bridgelm.train.batches import Row, autocast, chunks, pack_rows, response_logprobs, rows_tensor
from bridgelm.train.optim import gradient_parts, make_optimizer, make_scheduler, optimizer_step
from bridgelm.train.run import Run, control_of, settings_of
from bridgelm.train.weights import load_weights, save_model, write_on_main

BEST = "best"  # OUT/best: the checkpoint with the best validation accuracy


@dataclass
class RLConfig:
    """GRPO settings; defaults follow the paper's Appendix A where it gives one (per-device sizes are smaller)."""

    steps: int = 100  # rollout steps; each samples P x G rollouts, then takes K optimiser steps
    prompts_per_step: int = 8  # P, over all ranks (divisible by the number of processes)
    rollouts: int = 8  # G, rollouts per prompt: the GRPO group (paper: 8)
    width: int = 4  # w, Bridge group width while sampling; divides G (paper: 4 or 8)
    max_new_tokens: int = 512  # tokens per rollout, at most
    temperature: float = 0.6  # sampling temperature; log-probs use logits / temperature as well
    top_p: float = 1.0  # nucleus of the rollouts (1: exactly the policy the ratios assume)
    rollout_dtype: str | None = None  # sample from a copy of the policy in this dtype ("bfloat16"), refreshed before
    # each step (1.3-1.5x faster sampling on CPU); the update recomputes every log-prob. None: the policy itself
    steps_per_rollout: int = 8  # K: optimiser steps per rollout batch, on K mini-batches of whole groups
    epochs_per_rollout: int = 1  # passes over the rollout batch (K steps each)
    micro_batch_groups: int = 4  # Bridge groups per forward/backward (gradient accumulation in a mini-batch)
    micro_batch_tokens: int | None = None  # also cut micro-batches, groups sorted by length, at this many padded
    # tokens (rows x longest row); None: micro_batch_groups groups each, in mini-batch order
    lr: float = 1e-6  # AdamW learning rate after warm-up (constant)
    block_lr: float | None = None  # learning rate of the added blocks (None: lr, as in the paper)
    warmup_fraction: float = 0.1  # share of the optimiser steps spent warming the lr up linearly
    weight_decay: float = 0.0  # AdamW weight decay
    max_grad_norm: float = 1.0  # gradient clipping (<= 0: off)
    clip_eps: float = 0.2  # ratio clip range below 1 (and above, unless clip_eps_high is set)
    clip_eps_high: float | None = None  # ratio clip range above 1 (DAPO's clip-higher), None = clip_eps
    beta: float = 1e-3  # weight of the k3 KL to the reference (0: no reference model)
    freeze_base: bool = False  # train only the added blocks
    bf16: bool = False  # bf16 autocast of the training forwards
    gradient_checkpointing: bool = False  # recompute layer activations in the backward
    fsdp: bool = False  # shard parameters, gradients and optimiser state with FSDP2 (torchrun only)
    chat: bool = False  # wrap prompts in the tokenizer's chat template
    seed: int = 0  # seeds data order, sampling and mini-batch shuffles (with the step)
    max_batch_sequences: int = 256  # engine: rows decoded together, at most
    max_batch_tokens: int = 262_144  # engine: rows x (prompt + max_new_tokens) of a wave, at most
    eval_every: int = 0  # steps between validations (0: only after the last step); needs a val_task
    eval_n: int = 4  # samples per validation problem (paper: 4 on MATH-500)
    eval_width: int = 4  # Bridge width of validation sampling (divides eval_n)
    eval_limit: int | None = None  # first problems of the val_task to use (None: all)
    eval_max_new_tokens: int | None = None  # None: max_new_tokens
    eval_temperature: float = 0.6  # validation sampling temperature (paper: 0.6)
    eval_top_p: float = 0.95  # validation nucleus (paper: 0.95)
    save_every: int = 50  # steps between checkpoints (0: only at the end and on Ctrl-C)
    keep_last: int = 2  # checkpoints kept (best/ is kept apart)
    resume: bool = False  # continue the run found in the output directory
    progress: bool = True  # show a progress bar
    tensorboard: bool = False  # also log to OUT/tensorboard (when tensorboard is installed)

    def validate(self, world: int = 1) -> None:
        for name in ("steps", "prompts_per_step", "rollouts", "width", "max_new_tokens", "steps_per_rollout"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.epochs_per_rollout < 1 or self.micro_batch_groups < 1:
            raise ValueError("epochs_per_rollout and micro_batch_groups must be >= 1")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens={self.micro_batch_tokens} must be >= 1 (or None)")
        if self.rollouts < 2:
            raise ValueError(
                f"rollouts={self.rollouts} must be >= 2: GRPO's advantages compare the rollouts of a prompt, and one "
                "rollout has nothing to be compared with"
            )
        if self.rollouts % self.width:
            raise ValueError(f"width={self.width} must divide rollouts={self.rollouts} (G % w == 0)")
        if self.prompts_per_step % world:
            raise ValueError(f"prompts_per_step={self.prompts_per_step} must be divisible by the {world} processes")
        groups = self.prompts_per_step // world * (self.rollouts // self.width)
        if groups < self.steps_per_rollout:
            raise ValueError(
                f"steps_per_rollout={self.steps_per_rollout} mini-batches need at least one Bridge group each, but a "
                f"rank holds {self.prompts_per_step // world} prompts x {self.rollouts // self.width} groups = {groups}"
            )
        # GRPO's log-probs are at logits / T: no greedy rollouts. The validation's settings are checked here too, so
        # that a bad one is refused before training instead of after it.
        check_sampling(self.temperature, self.top_p, greedy=False, why=" (GRPO's log-probs are at logits / T)")
        check_sampling(self.eval_temperature, self.eval_top_p, prefix="eval_")
        check_number("lr", self.lr, 0, open_low=True)
        if self.block_lr is not None:
            check_number("block_lr", self.block_lr, 0, open_low=True)
        check_number("warmup_fraction", self.warmup_fraction, 0, 1, open_high=True)
        check_number("weight_decay", self.weight_decay, 0)
        check_number("max_grad_norm", self.max_grad_norm, note=" (<= 0: no clipping)")
        check_number("beta", self.beta, 0)
        for name in ("clip_eps", "clip_eps_high"):
            value = getattr(self, name)
            if value is not None:
                check_number(name, value, 0, open_low=True)
        if self.rollout_dtype is not None:
            if self.rollout_dtype not in ROLLOUT_DTYPES:
                raise ValueError(f"rollout_dtype={self.rollout_dtype!r}: expected one of {', '.join(ROLLOUT_DTYPES)}")
            if self.fsdp:
                raise ValueError("rollout_dtype needs fsdp=False: the copy would hold the whole model on every rank")
        for name in ("eval_n", "eval_width", "eval_max_new_tokens", "eval_limit"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name))
        if self.eval_every < 0:
            raise ValueError(f"eval_every={self.eval_every} must be >= 0 (0: only after the last step)")
        if self.eval_n % self.eval_width:
            raise ValueError(f"eval_width={self.eval_width} must divide eval_n={self.eval_n}")


ROLLOUT_DTYPES = ("bfloat16", "float16", "float32")

# Fields that do not change the trained weights besides the run-control ones (train.run.RUN_FIELDS).
FREE_FIELDS = ("eval_every", "eval_limit")


@dataclass
class Rollouts:
    """One rank's rollout batch: P_local prompts x G rollouts, in prompt order."""

    rows: list[Row]  # group g holds rows g*w .. g*w + w - 1
    width: int  # w
    rewards: torch.Tensor  # [R]
    advantages: torch.Tensor  # [R]
    finished: list[bool]  # [R]: ended with EOS
    sample_seconds: float  # time spent sampling

    @property
    def n_groups(self) -> int:
        return len(self.rows) // self.width

    def group_rows(self, groups) -> list[int]:
        return [g * self.width + j for g in groups for j in range(self.width)]

    def flat_groups(self) -> set[int]:
        """Groups whose rows' advantages are all exactly 0 (with 0/1 rewards: a prompt whose rewards are all equal)."""
        flat = (self.advantages.view(self.n_groups, self.width) == 0).all(-1)  # [n_groups]
        return set(torch.nonzero(flat).flatten().tolist())


@dataclass
class RLResult:
    history: list[dict]  # metrics.jsonl records, one per step
    final_dir: Path | None  # the last checkpoint: a model directory for bridgelm.load_model
    best_dir: Path | None  # OUT/best (best validation accuracy), None without validation
    best_accuracy: float | None  # its validation accuracy
    best_step: int | None  # its step
    steps: int  # steps completed
    out_dir: Path


# ---------------------------------------------------------------------------------------------- data and rollouts


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
    prompt_ids = encode_prompts(tokenizer, [task.prompt(ex) for ex in examples], cfg.chat)
    scfg = SamplingConfig(
        n=cfg.rollouts,
        width=cfg.width,
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        seed=derive_seed(cfg.seed, "rollouts", step, dist.rank),
        max_batch_sequences=cfg.max_batch_sequences,
        max_batch_tokens=cfg.max_batch_tokens,
    )
    eos = eos_ids(model, tokenizer)
    pad = pad_id(tokenizer, eos)
    t0 = time.perf_counter()
    with unsharded(model, dist):
        samples = generate_ids(model, prompt_ids, scfg, eos, pad)
    seconds = time.perf_counter() - t0
    rows, pairs, finished = [], [], []
    per_prompt = cfg.rollouts // cfg.width
    for p, outs in enumerate(samples):
        for i, s in enumerate(outs):
            rows.append(Row(prompt_ids[p], s.token_ids, p * per_prompt + i // cfg.width))
            text = tokenizer.decode(s.token_ids, skip_special_tokens=True)
            pairs.append((task.graded_text(text, s.finished), examples[p]))
            finished.append(s.finished)
    rewards = torch.tensor(check_rewards(task.reward_many(pairs), f"task {task.name!r}, step {step + 1}"))
    advantages = group_advantages(rewards.view(len(examples), cfg.rollouts)).view(-1)
    return Rollouts(rows, cfg.width, rewards, advantages, finished, seconds)


def micro_batches(rollouts: Rollouts, groups: list[int], cfg: RLConfig) -> list[list[int]]:
    """The micro-batches (lists of whole groups) of the mini-batch `groups`: `micro_batch_groups` groups each, in
    order; with `micro_batch_tokens`, groups sorted by their longest row and cut before the padded tokens of a
    micro-batch (rows x its longest row) would pass the budget, so that short rows are not padded to long ones."""
    if cfg.micro_batch_tokens is None:
        return chunks(groups, cfg.micro_batch_groups)
    length = {
        g: max(len(rollouts.rows[r].prompt) + len(rollouts.rows[r].response) for r in rollouts.group_rows([g]))
        for g in groups
    }
    out: list[list[int]] = [[]]
    for g in sorted(groups, key=lambda g: (length[g], g)):  # ascending: g is the longest of its micro-batch so far
        cur = out[-1]
        if cur and (
            len(cur) == cfg.micro_batch_groups or (len(cur) + 1) * rollouts.width * length[g] > cfg.micro_batch_tokens
        ):
            out.append(cur := [])
        cur.append(g)
    return out


def minibatch_plan(n_groups: int, cfg: RLConfig, step: int) -> list[list[int]]:
    """Group indices of each mini-batch: per epoch a shuffle of the groups cut into K near-equal parts."""
    K, plan = cfg.steps_per_rollout, []
    for epoch in range(cfg.epochs_per_rollout):
        perm = torch.randperm(n_groups, generator=generator(cfg.seed, "minibatches", step, epoch)).tolist()
        plan += [perm[i * n_groups // K : (i + 1) * n_groups // K] for i in range(K)]
    return plan


# ---------------------------------------------------------------------------------------------- the update


@dataclass
class MinibatchStats:
    loss: float  # the mini-batch's loss over all ranks
    tokens: float  # response tokens of the mini-batch over all ranks
    clipped: float = 0.0  # this rank's token sums (see grpo.PolicyStats)
    kl: float = 0.0
    entropy: float = 0.0
    entropy_tokens: float = 0.0  # this rank's response tokens whose entropy is in `entropy`


@torch.no_grad()
def rollout_logprobs(
    model, rollouts: Rollouts, micro: list[list[int]], cfg: RLConfig, pad_id: int, dist, with_entropy: bool = True
):
    """Log-probs of `model` for each row ({row: [len]}) over the micro-batches `micro` (lists of groups), and the
    entropy summed over all response tokens (0.0 without `with_entropy`)."""
    logprobs: dict[int, torch.Tensor] = {}
    entropy = 0.0
    for groups in micro:
        rows = rollouts.group_rows(groups)
        batch = pack_rows([rollouts.rows[r] for r in rows], pad_id, dist.device)
        with autocast(dist, cfg.bf16):
            lp, ent = response_logprobs(model, batch, cfg.temperature, with_entropy=with_entropy)
        if ent is not None:
            entropy += float(ent[batch.response_mask].sum())
        for b, r in enumerate(rows):
            logprobs[r] = lp[b, : len(rollouts.rows[r].response)]
    return logprobs, entropy


def minibatch_backward(
    model,
    rollouts: Rollouts,
    groups: list[int],
    old: dict[int, torch.Tensor] | None,
    ref: dict[int, torch.Tensor] | None,
    cfg: RLConfig,
    pad_id: int,
    dist: Dist,
    micro: list[list[int]] | None = None,
) -> MinibatchStats:
    """Forward/backward of one mini-batch (this rank's `groups`), micro-batch by micro-batch (`micro`: its cut into
    micro-batches, the one the old log-probs were computed on; default `micro_batches`).

    A micro-batch whose rows are missing from `old` (None: all rows) is fresh: it is trained before any optimiser
    step of this rollout batch, or its groups' advantages are all 0 (the no_grad pass left it out, see the module
    docstring). Its current log-probs, detached, serve as its old ones; they are added to `old` (when given) for
    later epochs, and its entropy is counted. The loss is normalised by the mini-batch's token count over all ranks;
    gradients accumulate in .grad.
    """
    local = sum(len(rollouts.rows[r].response) for r in rollouts.group_rows(groups))
    total = all_reduce_sum([local], dist)[0]
    out = MinibatchStats(loss=0.0, tokens=total)
    for part in micro if micro is not None else micro_batches(rollouts, groups, cfg):
        rows = rollouts.group_rows(part)
        batch = pack_rows([rollouts.rows[r] for r in rows], pad_id, dist.device)
        mask = batch.response_mask  # [B, T]
        # The no_grad pass runs on whole trained micro-batches, and after the first pass every row is in `old`:
        # a micro-batch is fresh entirely or not at all.
        fresh = old is None or rows[0] not in old
        with autocast(dist, cfg.bf16):
            lp, ent = response_logprobs(model, batch, cfg.temperature, with_entropy=fresh)
        if fresh:
            old_lp = lp.detach()  # [B, T]
            if old is not None:
                old.update({r: old_lp[b, : len(rollouts.rows[r].response)] for b, r in enumerate(rows)})
        else:
            old_lp = rows_tensor([old[r] for r in rows], mask)  # [B, T]
        ref_lp = None if ref is None else rows_tensor([ref[r] for r in rows], mask)  # [B, T]
        adv = rollouts.advantages[rows].to(lp.device)  # [B]
        loss = policy_loss(lp, old_lp, ref_lp, adv, mask, cfg.clip_eps, cfg.clip_eps_high, cfg.beta, num_tokens=total)
        loss.backward()
        s = policy_stats(lp.detach(), old_lp, ref_lp, adv, mask, cfg.clip_eps, cfg.clip_eps_high)
        out.loss += float(loss.detach())
        out.clipped += s.clipped
        out.kl += s.kl
        if ent is not None:  # a fresh micro-batch's (the others' is counted by the no_grad pass)
            out.entropy += float(ent[mask].sum())
            out.entropy_tokens += float(mask.sum())
    out.loss = all_reduce_sum([out.loss], dist)[0]
    return out


def update_policy(
    model, ref_model, rollouts: Rollouts, params, optimizer, scheduler, cfg, step, pad_id, dist, parts=None
) -> dict:
    """K (x epochs) optimiser steps on this rollout batch; returns token-level sums and means for logging."""
    plan = minibatch_plan(rollouts.n_groups, cfg, step)
    flat = set() if dist.fsdp else rollouts.flat_groups()  # advantages all 0: no policy term (module docstring)
    skip = flat if cfg.beta == 0 else set()  # ... and, with beta = 0, no KL term either: nothing to compute
    # Each mini-batch's micro-batches, as trained (and as the no_grad pass runs them): cut from its groups but `skip`.
    micro_of = [[m for m in micro_batches(rollouts, [g for g in mb if g not in skip], cfg) if m] for mb in plan]
    model.train()
    old = ref = None
    entropy = entropy_tokens = 0.0
    t0 = time.perf_counter()
    if len(plan) > 1:  # later mini-batches need the old policy's log-probs; the first one makes its own
        later = [m for mbs in micro_of[1 : cfg.steps_per_rollout] for m in mbs if not flat.issuperset(m)]
        old, entropy = rollout_logprobs(model, rollouts, later, cfg, pad_id, dist)
        entropy_tokens = sum(v.numel() for v in old.values())  # the pass's entropy is over these
    t1 = time.perf_counter()
    if ref_model is not None:  # beta > 0: nothing skipped, every group once as the first pass trains it
        first_pass = [m for mbs in micro_of[: cfg.steps_per_rollout] for m in mbs]
        ref, _ = rollout_logprobs(ref_model, rollouts, first_pass, cfg, pad_id, dist, with_entropy=False)
    t2 = time.perf_counter()
    sums = {
        "loss": 0.0,
        "clipped": 0.0,
        "kl": 0.0,
        "tokens": 0.0,
        "entropy": 0.0,  # each fresh micro-batch's, then the no_grad pass's: every row with a forward once
        "entropy_tokens": entropy_tokens,
        "grad_norm": 0.0,
        "old_seconds": t1 - t0,  # the no_grad passes (old log-probs, reference)
        "ref_seconds": t2 - t1,
        "parts": {},  # gradient norm of each part (see optim.gradient_parts), summed over optimiser steps
    }
    for mb, micro in zip(plan, micro_of):
        s = minibatch_backward(model, rollouts, mb, old, ref, cfg, pad_id, dist, micro)
        if not micro:
            # Every group skipped: the full computation's gradients are zeros, which AdamW's moments still act on.
            # (On several ranks reduce_gradients fills them in; so would it for a parameter no loss reaches.)
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        norm = optimizer_step(params, optimizer, scheduler, cfg.max_grad_norm, dist, parts, sums["parts"])
        sums["loss"] += s.loss
        sums["clipped"] += s.clipped
        sums["kl"] += s.kl
        sums["entropy"] += s.entropy
        sums["entropy_tokens"] += s.entropy_tokens
        sums["tokens"] += s.tokens
        sums["grad_norm"] += norm
    sums["entropy"] += entropy
    return sums


# ---------------------------------------------------------------------------------------------- the run


def _checksum(model) -> float:
    with torch.no_grad():
        total = sum(float(p.detach().sum(dtype=torch.float64)) for p in model.parameters())
    return float(f"{total:.9g}")


def _identity(model, task, cfg: RLConfig, val_task, processes: int) -> dict:
    blocks = block_config(model)
    validation = None if val_task is None else val_task.digest(val_task.examples[: cfg.eval_limit])
    return {
        **settings_of(cfg, FREE_FIELDS),
        "model": local_source(str(getattr(model.config, "_name_or_path", ""))),
        "blocks": None if blocks is None else asdict(blocks),
        "task": task.name,
        "examples": len(task.examples),
        "digest": task.digest(),  # the training problems: a resume on other data is refused
        "validation": validation,  # the validation problems (--val-data, --eval-limit): best/ compares on one set
        "processes": processes,  # rollouts are drawn per rank: another process count would draw others
        "initial_checksum": _checksum(model),
    }


def _set_trainable(model, cfg: RLConfig) -> None:
    if cfg.freeze_base:
        blocks = added_parameters(model)
        if not blocks:
            raise ValueError("freeze_base=True trains only the added blocks, but the model has none")
        for name, p in model.named_parameters():
            p.requires_grad_(name in blocks)
    else:
        model.requires_grad_(True)


def _make_reference(model, cfg: RLConfig, dist: Dist):
    """A frozen copy of the policy at the start of RL (blocks included), only when beta > 0."""
    if cfg.beta == 0:
        return None
    ref = copy.deepcopy(model)
    ref.requires_grad_(False)
    return ref


def train_rl(model, tokenizer, task, cfg: RLConfig, out_dir: str | os.PathLike, val_task=None) -> RLResult:
    """GRPO on `task` starting from `model` (with or without blocks); see the module docstring for the outputs."""
    out_dir = Path(out_dir)
    dist = setup_distributed(next(model.parameters()).device)
    cfg.validate(dist.world)
    if cfg.eval_every and val_task is None:
        raise ValueError(f"eval_every={cfg.eval_every} needs a val_task (--val-task): the problems to validate on")
    if not task.examples:
        raise ValueError(f"task {task.name!r} has no examples to train on")
    identity = _identity(model, task, cfg, val_task, dist.world)
    run = Run(out_dir, "rl", identity, control_of(cfg), dist, best_accuracy=None, best_step=None)
    _set_trainable(model, cfg)
    ref_model = _make_reference(model, cfg, dist)
    if run.resume_from is not None:
        load_weights(model, run.resume_from)
    if cfg.gradient_checkpointing:
        model.activation_checkpointing_enable()
    prepare_model(model, dist, cfg.fsdp)
    if ref_model is not None:
        prepare_model(ref_model, replace(dist), cfg.fsdp)
    params = [p for p in model.parameters() if p.requires_grad]
    lr_of = None
    if cfg.block_lr is not None:
        lr_of = {id(p): cfg.block_lr for p in added_parameters(model).values() if p.requires_grad}
    optimizer = make_optimizer(params, cfg.lr, cfg.weight_decay, lr_of=lr_of)
    parts = {k: v for k, v in gradient_parts(model).items() if k != "base"}  # the blocks' parts (logged per step)
    total = cfg.steps * cfg.steps_per_rollout * cfg.epochs_per_rollout
    scheduler = make_scheduler(optimizer, total, cfg.warmup_fraction, "constant")
    run.track(model, optimizer, scheduler, lambda folder, state_dict: save_model(model, tokenizer, folder, state_dict))
    blocks = block_config(model)
    trained = f"{blocks.kind} blocks" if blocks else "no blocks: plain GRPO (RLVR only)"
    trained += ", base frozen" if cfg.freeze_base else ""
    run.say(
        f"bridgelm rl: {cfg.steps} steps of {cfg.prompts_per_step} prompts x {cfg.rollouts} rollouts "
        f"(width {cfg.width}; {trained}), {dist.world} process(es) -> {out_dir}"
    )
    pad = pad_id(tokenizer, eos_ids(model, tokenizer))
    sampler = RolloutPolicy(model, cfg.rollout_dtype)
    was_training = model.training
    try:
        with run.running(cfg.steps, "GRPO"):
            for step in range(run.step, cfg.steps):
                t0 = time.perf_counter()
                examples = step_examples(task, cfg, step, dist)
                rollouts = collect_rollouts(sampler.current(), tokenizer, task, examples, cfg, step, dist)
                with run.update():
                    lr = scheduler.get_last_lr()[0]
                    t1 = time.perf_counter()
                    sums = update_policy(
                        model, ref_model, rollouts, params, optimizer, scheduler, cfg, step, pad, dist, parts
                    )
                    run.state["step"] = step + 1
                    record = _record(step, rollouts, sums, cfg, lr, t0, t1, dist)
                    if val_task is not None and (
                        step + 1 == cfg.steps or (cfg.eval_every and (step + 1) % cfg.eval_every == 0)
                    ):
                        record.update(_validate(model, tokenizer, val_task, cfg, run.state, out_dir, dist))
                    run.log(
                        record, reward=f"{record['reward']:.3f}", kl=record["kl"], val=record.get("val_accuracy", "")
                    )
                run.save_if_due()
    finally:
        model.train(was_training)
    state = run.state
    return RLResult(
        history=run.history,
        final_dir=latest_checkpoint(out_dir),
        best_dir=out_dir / BEST if state["best_step"] is not None else None,
        best_accuracy=state["best_accuracy"],
        best_step=state["best_step"],
        steps=run.step,
        out_dir=out_dir,
    )


def _record(step, rollouts: Rollouts, sums: dict, cfg: RLConfig, lr, t0, t1, dist: Dist) -> dict:
    """The step's metrics, summed over ranks."""
    r = rollouts.rewards
    per_prompt = r.view(-1, cfg.rollouts)
    lengths = [len(row.response) for row in rollouts.rows]
    local = [
        float(r.sum()),
        float(sum(is_correct(x) for x in r.tolist())),
        float(r.numel()),
        float((per_prompt == per_prompt[:, :1]).all(-1).sum()),
        float(per_prompt.shape[0]),
        float(sum(lengths)),
        float(sum(not f for f in rollouts.finished)),
        sums["clipped"],
        sums["kl"],
        sums["entropy"],
        sums["entropy_tokens"],
        rollouts.sample_seconds,
    ]
    (reward, correct, n, flat, prompts, length, truncated, clipped, kl, entropy, entropy_tokens, sample_s) = (
        all_reduce_sum(local, dist)
    )
    passes = cfg.epochs_per_rollout
    trained = max(sums["tokens"], 1.0)  # tokens over all ranks and mini-batches (each pass)
    now = time.perf_counter()
    n_opt = cfg.steps_per_rollout * passes
    return {
        "step": step + 1,
        "optimizer_steps": (step + 1) * n_opt,
        "lr": lr,
        "reward": reward / n,
        "accuracy": correct / n,
        "zero_advantage_prompts": flat / prompts,
        "loss": sums["loss"] / n_opt,
        "kl": kl / trained if cfg.beta > 0 else None,
        "clip_fraction": clipped / trained,
        # over the response tokens that had a forward (None: none had, every prompt's rewards equal and beta = 0)
        "entropy": entropy / entropy_tokens if entropy_tokens else None,
        "response_length": length / n,
        "truncated": truncated / n,
        "grad_norm": sums["grad_norm"] / n_opt,
        **{f"grad_norm_{k}": v / n_opt for k, v in sums["parts"].items()},
        "tokens_per_s": length / max(now - t0, 1e-9),
        "sample_tokens_per_s": length / max(sample_s / dist.world, 1e-9),
        "sample_seconds": t1 - t0,
        "update_seconds": now - t1,
        "old_logprob_seconds": sums["old_seconds"],  # the update's no_grad passes
        "reference_seconds": sums["ref_seconds"],
        "seconds": now - t0,
        "passes": passes,
    }


def _validation_config(cfg: RLConfig) -> EvalConfig:
    """How the validation task is sampled (the paper: 4 samples per MATH-500 problem at temperature 0.6)."""
    return EvalConfig(
        n=cfg.eval_n,
        width=cfg.eval_width,
        max_new_tokens=cfg.eval_max_new_tokens or cfg.max_new_tokens,
        temperature=cfg.eval_temperature,
        top_p=cfg.eval_top_p,
        seed=derive_seed(cfg.seed, "eval"),
        limit=cfg.eval_limit,
        chat=cfg.chat,
    )


def _validate(model, tokenizer, val_task, cfg: RLConfig, state: dict, out_dir: Path, dist: Dist) -> dict:
    """Validation accuracy; OUT/best holds the model of the best one so far."""
    t0 = time.perf_counter()
    acc = accuracy(model, tokenizer, val_task, _validation_config(cfg), dist)
    is_best = state["best_accuracy"] is None or acc > state["best_accuracy"]
    if is_best:
        state["best_accuracy"], state["best_step"] = acc, state["step"]
        info = {"step": state["step"], "val_accuracy": acc}

        def write(folder: Path, state_dict: dict | None) -> None:
            save_model(model, tokenizer, folder, state_dict)
            write_json(folder / "best.json", info)

        write_on_main(out_dir / BEST, model, dist, write)
    return {"val_accuracy": acc, "val_best": is_best, "val_seconds": time.perf_counter() - t0}

"""The settings of a GRPO run (`bridgelm rl`): RLConfig, whose rollouts are a SamplingConfig and whose validation an
EvalConfig; read by the loop (rl.py), the rollout phase (rollouts.py), the update (update.py) and `bridgelm plan`."""

from __future__ import annotations

from dataclasses import dataclass, replace

from bridgelm.engine import SamplingConfig
from bridgelm.errors import UserError, check_choice, check_int, check_number
from bridgelm.eval.runner import EvalConfig
from bridgelm.grpo import ADVANTAGES
from bridgelm.lora import LoraSettings
from bridgelm.rng import derive_seed
from bridgelm.setting import setting
from bridgelm.train.loop import RunControl
from bridgelm.train.optim import OptimConfig, check_lr
from bridgelm.train.set_rewards import REWARDS

ROLLOUT_DTYPES = ("bfloat16", "float16", "float32")


def default_rollout() -> SamplingConfig:
    """G = 8 rollouts per prompt in Bridge groups of 4 (paper: G = 8, w = 4 or 8), at the policy's own nucleus."""
    return SamplingConfig(n=8, width=4, max_new_tokens=512, temperature=0.6, top_p=1.0)


def default_validation() -> EvalConfig:
    """4 samples per problem in one Bridge group at 0.6 / 0.95 (paper: MATH-500); max_new_tokens None: the rollouts'."""
    return EvalConfig(sampling=SamplingConfig(n=4, width=4, max_new_tokens=None, temperature=0.6, top_p=0.95))


MAX_SIBLING_WEIGHT = 1e6  # L of reward "sibling", at most: (1 + L)^2 stays far inside float32

@dataclass
class RLConfig:
    """GRPO settings. The paper's Appendix A where it gives a rate or a ratio (lr, warm-up, beta, clip, K, G,
    temperature); its sizes are smaller here and bf16 is off, for a first run on any machine (paper: steps 125 of 56
    prompts, 4096 tokens a rollout, bf16): docs/scale.md runs the paper's."""

    steps: int = setting(100, "rollout steps; each samples P x G rollouts, then takes K optimiser steps "
                                 "(paper: 125 of K = 8, its 1000 optimiser steps)")
    prompts_per_step: int = setting(8, "P, over all ranks (divisible by the number of processes) (paper: 56)")
    chat: bool = setting(False, "wrap prompts in the tokenizer's chat template (the paper's "
                                                "R1-Distill models need it)")
    seed: int = setting(0, "seeds data order, sampling and mini-batch shuffles (with the step)")

    rollout: SamplingConfig = setting(
        default_factory=default_rollout,
        help="G = n rollouts per prompt in groups of width w (w divides G); log-probs "
             "are at logits / temperature; its seed is drawn from `seed` each step",
    )
    rollout_dtype: str | None = setting(None, 'sample from a copy of the policy in this dtype ("bfloat16"), '
                                              'refreshed before each step (1.3-1.5x faster sampling on CPU); '
                                              'the update recomputes every log-prob. None: the policy itself')
    reward: str = setting("sample", "\"sample\": each rollout's correctness (paper); \"majority\": a Bridge "
                                    "group's majority vote correct, for all its rollouts (needs rollouts >= "
                                    "2 x width); \"distinct\": its distinct correct answers, shared by "
                                    "their holders (countdown); \"sibling\": r_i + sibling_weight x the "
                                    "mean of its group's other rewards (needs rollouts >= 2 x width)")
    sibling_weight: float | None = setting(None, "L of reward \"sibling\" (None: 1.0; L = width - 1 "
                                                 "credits each rollout with its whole group's reward, "
                                                 "the exact policy gradient of a group's summed reward)")
    advantage: str = setting("prompt", "\"prompt\": over all G rollouts of a prompt, across its groups (the "
                                       "paper's GRPO, G = 8 at w = 4 as App. A reads); \"between-groups\": each "
                                       "rollout against the mean of its prompt's other Bridge groups (one reading "
                                       "of App. C; rollouts >= 2 x width)")

    steps_per_rollout: int = setting(8, "K: optimiser steps per rollout batch, on K mini-batches of whole groups")
    epochs_per_rollout: int = setting(1, "passes over the rollout batch (K steps each)")
    micro_batch_groups: int = setting(4, "Bridge groups per forward/backward (gradient accumulation in a mini-batch)")
    micro_batch_tokens: int | None = setting(None, "also cut micro-batches, groups sorted by length, at "
                                                   "this many padded tokens (rows x longest row); None: "
                                                   "micro_batch_groups groups each, in mini-batch order")
    optim: OptimConfig = setting(default_factory=OptimConfig, help="AdamW at a constant rate after the warm-up, "
                                 "clipping; bf16: with fsdp, mixed precision and rollouts from a bf16 copy")
    block_lr: float | None = setting(None, "learning rate of the added blocks (None: lr, as in the paper)")
    clip_eps: float = setting(0.2, "ratio clip range below 1 (and above, unless clip_eps_high is set)")
    clip_eps_high: float | None = setting(None, "ratio clip range above 1 (DAPO's clip-higher), None = clip_eps")
    beta: float = setting(1e-3, "weight of the k3 KL to the reference (0: no reference model)")
    freeze_base: bool = setting(False, "train only the added blocks")
    fsdp: bool = setting(False, "shard parameters, gradients and optimiser state with FSDP2 (torchrun only)")
    lora: LoraSettings = setting(default_factory=LoraSettings, help="LoRA of the base (bridgelm.lora); off by default")

    eval_every: int = setting(0, "rollout steps between validations (0: only after the last step); needs a "
                                   "val_task (paper: every 100 optimiser steps, 12 of K = 8)")
    validation: EvalConfig = setting(
        default_factory=default_validation,
        help="how the val_task is sampled: n, width, limit (None: all problems), max_new_tokens "
             "(None: the rollouts'); its seed is drawn from `seed`, chat is `chat`",
    )

    run: RunControl = setting(default_factory=lambda: RunControl(save_every=50),
                              help="checkpoints (best/ is kept apart), resume, progress, tensorboard")

    def validate(self, world: int = 1) -> None:
        self._check_rollouts(world)
        self._check_update()
        self._check_validation()
        self._check_lora()
        if self.fsdp and world == 1:
            raise UserError(
                "fsdp=True shards the model over several processes, but this run has 1: launch with torchrun "
                "--nproc_per_node N (N >= 2), or leave --fsdp out"
            )

    def _check_rollouts(self, world: int) -> None:
        check_int("steps", self.steps)
        check_int("prompts_per_step", self.prompts_per_step)
        why = " (GRPO's log-probs are at logits / T)"  # no greedy rollouts
        self.rollout.validate({"n": "rollouts"}, greedy=False, why=why)
        G, w = self.rollout.n, self.rollout.width
        if G < 2:
            raise UserError(
                f"rollouts={G} must be >= 2: GRPO's advantages compare the rollouts of a prompt, and one rollout has "
                "nothing to be compared with"
            )
        if G % w:  # what SamplingConfig lets foreign_groups leave (rollouts are Bridge groups of one prompt)
            raise UserError(f"width={w} must divide rollouts={G} (G % w == 0)")
        if self.prompts_per_step % world:
            raise UserError(f"prompts_per_step={self.prompts_per_step} must be divisible by the {world} processes")
        groups = self.prompts_per_step // world * (G // w)
        if groups < self.steps_per_rollout:
            enough = world * -(-self.steps_per_rollout // (G // w))  # the fewest prompts a step that hold them
            raise UserError(
                f"steps_per_rollout={self.steps_per_rollout} mini-batches need at least one Bridge group each, but a "
                f"rank holds {self.prompts_per_step // world} prompts x {G // w} groups = {groups}: expected at least "
                f"prompts_per_step={enough} (over {world} processes), or at most steps_per_rollout={groups}"
            )
        check_one_group("", self.rollout)
        check_choice("reward", self.reward, REWARDS)
        if self.reward == "majority" and G == w:
            raise UserError(
                f"reward='majority' gives a Bridge group's rollouts one reward, so with one group per prompt "
                f"(rollouts={G}, width={w}) every advantage is 0: expected rollouts >= 2 x width"
            )
        self._check_credit()
        if self.rollout_dtype is not None:
            check_choice("rollout_dtype", self.rollout_dtype, ROLLOUT_DTYPES)
            if self.fsdp and self.rollout_dtype == "float32":
                raise UserError(
                    "rollout_dtype='float32' with fsdp would keep a whole fp32 copy (4 bytes a parameter) on every "
                    "rank beside its shard: expected bfloat16 or float16 (2 bytes a parameter)"
                )

    def _check_credit(self) -> None:
        """The advantage and sibling credit: each needs several Bridge groups per prompt, as it compares groups."""
        G, w = self.rollout.n, self.rollout.width
        check_choice("advantage", self.advantage, ADVANTAGES)
        if self.advantage == "between-groups" and G < 2 * w:
            raise UserError(
                f"advantage='between-groups' compares a prompt's Bridge groups, but rollouts={G} at width={w} make one "
                "group: expected rollouts >= 2 x width"
            )
        if self.reward != "sibling":
            if self.sibling_weight is not None:
                raise UserError(f"sibling_weight={self.sibling_weight} is read only by reward='sibling', not {self.reward!r}")
            return
        if w < 2:
            raise UserError("reward='sibling' credits a rollout with its Bridge group's other rewards: width=1 has none")
        if G == w:
            raise UserError(
                f"reward='sibling' with one Bridge group per prompt (rollouts={G}, width={w}): the siblings' term is "
                "shared by every rollout the advantage compares and cancels; expected rollouts >= 2 x width"
            )
        if self.sibling_weight is not None:
            check_number("sibling_weight", self.sibling_weight, 0, MAX_SIBLING_WEIGHT,
                         note=" (larger weights overflow the rewards' float32 mean and variance)")

    def replica_dtype(self) -> str | None:
        """The dtype of the copy the rollouts sample from (rollouts.RolloutPolicy): rollout_dtype, or bfloat16 under
        fsdp with bf16; None: the policy itself samples."""
        return self.rollout_dtype or ("bfloat16" if self.fsdp and self.optim.bf16 else None)

    def validation_sampling(self) -> EvalConfig:
        """How the val_task is sampled (`validation_sampling`)."""
        return validation_sampling(self)

    def _check_update(self) -> None:
        for name in ("steps_per_rollout", "epochs_per_rollout", "micro_batch_groups"):
            check_int(name, getattr(self, name))
        if self.micro_batch_tokens is not None:
            check_int("micro_batch_tokens", self.micro_batch_tokens, note=" (or None)")
        self.optim.validate()
        self.run.validate()
        if self.block_lr is not None:
            check_lr("block_lr", self.block_lr)
        check_number("beta", self.beta, 0)
        for name in ("clip_eps", "clip_eps_high"):
            value = getattr(self, name)
            if value is not None:
                check_number(name, value, 0, open_low=True)

    def _check_lora(self) -> None:
        self.lora.validate()
        if not self.lora.enabled:
            return
        for name in ("freeze_base", "fsdp"):
            if getattr(self, name):
                why = {"freeze_base": "trains the blocks alone, while LoRA trains LoRA weights beside them: expected "
                       "one of them", "fsdp": "is not supported with LoRA: run LoRA in one process or data-parallel "
                       "under torchrun (no fsdp)"}[name]
                raise UserError(f"lora_r={self.lora.r} with {name}=True: it {why}")

    def _check_validation(self) -> None:
        """The validation's settings, checked before training rather than after it (named as their flags are)."""
        check_int("eval_every", self.eval_every, low=0, note=" (0: only after the last step)")
        validation = validation_sampling(self)
        validation.validate(EVAL_NAMES)
        check_one_group("eval_", validation.sampling)


# How the validation's settings are named in messages: as their flags (--eval-n, ...).
EVAL_NAMES = {name: f"eval_{name}" for name in ("n", "width", "max_new_tokens", "temperature", "top_p", "limit")}


def check_one_group(prefix: str, s: SamplingConfig) -> None:
    """A wave of at most max_batch_tokens (rows x (prompt + max_new_tokens)) holds a Bridge group of `width` rows of
    at least a one-token prompt: else no wave can be made, whatever the prompts."""
    need = s.width * (1 + s.max_new_tokens)
    if s.max_batch_tokens < need:
        raise UserError(
            f"max_batch_tokens={s.max_batch_tokens} cannot hold one Bridge group of {prefix}width={s.width} rows of "
            f"{prefix}max_new_tokens={s.max_new_tokens} tokens and a prompt: expected at least {need} "
            f"({s.width} x ({s.max_new_tokens} + 1))"
        )


def validation_sampling(cfg: RLConfig) -> EvalConfig:
    """How the val_task is sampled: `cfg.validation` seeded from the run's seed, with the rollouts' chat template and
    batch bounds (max_batch_sequences, max_batch_tokens: what the plan fits in memory; the samples do not depend on
    them), and when its max_new_tokens is None, their max_new_tokens."""
    v, r = cfg.validation, cfg.rollout
    bounds = {"max_batch_sequences": r.max_batch_sequences, "max_batch_tokens": r.max_batch_tokens}
    max_new_tokens = r.max_new_tokens if v.sampling.max_new_tokens is None else v.sampling.max_new_tokens
    sampling = replace(v.sampling, max_new_tokens=max_new_tokens, seed=derive_seed(cfg.seed, "eval"), **bounds)
    return replace(v, sampling=sampling, chat=cfg.chat)


# Settings that do not change the trained weights besides the run-control ones (RLConfig.run).
FREE_FIELDS = ("eval_every", "validation.limit")

"""The demo's settings: `DemoConfig` (the sizes of every stage, and the `quick()` preset), its arms and seeds, and
the configs of the runs it makes from them, each built in one function here (`sampling_config`, `sft_config`,
`rl_config`, `eval_config`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from bridgelm.demo.base import BaseConfig
from bridgelm.tasks import anysum

RL_ARMS = ("rlvr", "pmatch", "bridge")  # the paper's arms; optional: "bridge_cold", "bridge_attn"
TRACE_SEED = 0  # the Bridge run whose checkpoints the trace stage follows


@dataclass
class DemoConfig:
    """Sizes of every stage; `quick()` shrinks them to toy sizes."""

    base: BaseConfig = field(default_factory=BaseConfig)  # the base model and its pre-training
    block_heads: int = 4  # heads of the added blocks
    block_head_dim: int = 16  # their head dim (4 x 16 = 64 wide: 12% of this tiny model, like-for-like for P-Match)
    warmup_problems: int = 400  # training problems the base model answers for the warm-up data
    warmup_n: int = 8  # answers per problem (paper: 8)
    sft_epochs: int = 5  # paper: 5
    sft_lr: float = 1e-3  # the paper's 2e-5 is for 7B models; a 2M model needs larger steps
    rl_steps: int = 80  # GRPO steps per arm
    rl_prompts: int = 16  # P, prompts per step
    rl_rollouts: int = 8  # G (paper: 8)
    rl_width: int = 8  # w of Bridge while training (paper: 4 or 8): every rollout of a prompt sees the others
    rl_steps_per_rollout: int = 2  # K
    rl_lr: float = 1e-4  # constant after 10% warm-up (the paper: 1e-6 for 1.5B-8B models)
    rl_beta: float = 1e-3  # KL weight (paper: 1e-3)
    rl_block_lr: float | None = None  # lr of the added blocks in RL (None: rl_lr, as in the paper)
    bf16: bool | None = None  # bf16 autocast of pre-training, SFT and RL forwards (fp32 weights and optimiser; 1.6x
    # faster on a CPU with AVX-512 BF16), and sampling (warm-up data, RL rollouts, evaluation) with bf16 weights
    # (1.3-1.5x faster); None: as the folder's earlier stages, else bf16 where its matmul is at least BF16_MARGIN
    # times as fast as fp32's (measured at the start: on CPUs without AVX-512 it is about 100x slower), else fp32
    max_new_tokens: int = 56  # the longest worked solution (5 numbers) is 49 tokens with its EOS
    temperature: float = 0.6  # paper: 0.6 for training and evaluation
    top_p: float = 0.95  # evaluation nucleus (paper: 0.95)
    eval_problems: int = 240  # held-out test problems (a multiple of eval_width, for the foreign-siblings control)
    eval_n: int = 16  # samples per problem (divisible by every width)
    eval_width: int = 8  # Bridge's width in the main table (paper: 8)
    widths: tuple[int, ...] = (1, 2, 4, 8, 16)  # Bridge widths of the width table (paper Table 3)
    trace_problems: int = 120  # test problems of the trace (interaction over the course of RL, Bridge seed 0)
    trace_n: int = 8  # samples per problem in the trace (a multiple of eval_width)
    gpass_k: int = 8  # G-Pass@k of the set figures (paper: 8)
    seeds: int = 3  # RL seeds per arm (the arms share each seed)
    sft_per_seed: bool = True  # RL seed s of P-Match and Bridge starts from SFT seed s (off: all from SFT seed 0)
    foreign_control: bool = True  # control (b): Bridge at eval_width with groups of samples of different problems
    cold_start: bool = False  # optional arm: Bridge RL from fresh blocks, no SFT (paper Table 4)
    attn_placement: bool = False  # optional arm: Bridge blocks after attention, SFT + RL (paper App. D)
    threads: int = 0  # torch threads (0 = torch's default); each of the workers gets threads // workers, at least 1
    workers: int = 2  # stages that do not wait on each other run in this many processes at once (1: one by one)

    @staticmethod
    def quick() -> DemoConfig:
        return DemoConfig(
            base=BaseConfig(
                task=anysum.AnySumSpec(min_operands=2, max_operands=3, max_value=20),  # learnable in seconds
                hidden_size=64,
                num_layers=2,
                num_heads=4,
                num_kv_heads=2,
                intermediate_size=128,
                steps=300,
                schedule_steps=300,
                batch_size=32,
                distinct=False,
                check_from=200,
                check_every=50,
                check_problems=20,
            ),
            warmup_problems=48,
            warmup_n=4,
            sft_epochs=1,
            rl_steps=3,
            rl_prompts=4,
            rl_rollouts=4,
            rl_width=2,
            eval_problems=12,
            eval_n=8,
            eval_width=4,
            widths=(1, 2, 4, 8),
            max_new_tokens=32,
            seeds=1,
        )


def rl_arms(cfg: DemoConfig) -> tuple[str, ...]:
    """The RL arms of this run: the paper's three, then the optional ones asked for."""
    return RL_ARMS + (("bridge_cold",) if cfg.cold_start else ()) + (("bridge_attn",) if cfg.attn_placement else ())


def eval_arms(cfg: DemoConfig, seed: int) -> tuple[str, ...]:
    """The arms evaluated at RL seed `seed`: every RL arm, and the base model once (at seed 0)."""
    return ("base",) + rl_arms(cfg) if seed == 0 else rl_arms(cfg)


def sft_kinds(cfg: DemoConfig) -> tuple[str, ...]:
    """Block sets warmed up by SFT: Bridge and P-Match, and Bridge after attention when that arm is asked for."""
    return ("bridge", "pmatch") + (("bridge_attn",) if cfg.attn_placement else ())


def sft_seeds(cfg: DemoConfig) -> tuple[int, ...]:
    """Seeds of the SFT runs: one per RL seed, or seed 0 alone (shared by every RL seed)."""
    return tuple(range(cfg.seeds)) if cfg.sft_per_seed else (0,)


def sft_seed_of(cfg: DemoConfig, seed: int) -> int:
    """The SFT run that RL seed `seed` starts from."""
    return seed if cfg.sft_per_seed else 0


def sampling_config(cfg: DemoConfig, n: int, width: int, seed: int = 0):
    """How the warm-up data and the trace sample: n samples per problem in groups of `width`."""
    from bridgelm.engine import SamplingConfig

    return SamplingConfig(
        n=n, width=width, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, seed=seed
    )


def sft_config(cfg: DemoConfig, kind: str, seed: int):
    """The SFT warm-up of block set `kind` ("bridge", "pmatch" or "bridge_attn") from `seed`."""
    from bridgelm.train.sft import SFTConfig

    return SFTConfig(
        blocks="pmatch" if kind == "pmatch" else "bridge",
        num_heads=cfg.block_heads,
        placement="attn" if kind == "bridge_attn" else "ffn",
        epochs=cfg.sft_epochs,
        lr=cfg.sft_lr,
        max_length=256,
        bf16=cfg.bf16,
        progress=True,
        resume=True,  # continue a run found in the stage's folder; start afresh when there is none
        seed=seed,  # the split, the groups and the batch order
    )


def rl_config(cfg: DemoConfig, arm: str, seed: int):
    """GRPO of one arm and seed: every arm shares the prompts, budget, settings and seed."""
    from bridgelm.train.rl import RLConfig, default_rollout

    return RLConfig(
        steps=cfg.rl_steps,
        prompts_per_step=cfg.rl_prompts,
        rollout=replace(
            default_rollout(), n=cfg.rl_rollouts, width=cfg.rl_width, max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature, top_p=1.0,
        ),
        steps_per_rollout=cfg.rl_steps_per_rollout,
        micro_batch_groups=64,
        micro_batch_tokens=2048,  # groups by length, <= 2048 padded tokens: a 16% faster update than 64 rows in one
        rollout_dtype="bfloat16" if cfg.bf16 else None,
        lr=cfg.rl_lr,
        block_lr=cfg.rl_block_lr,
        beta=cfg.rl_beta,
        bf16=cfg.bf16,
        seed=seed,
        save_every=20,  # an interrupted demo resumes its RL stage from here (bit-exact)
        # every checkpoint of the traced run kept (the interaction over the course of RL); elsewhere the last one
        keep_last=0 if (arm, seed) == ("bridge", TRACE_SEED) else 1,
        eval_every=0,
        resume=True,  # continue a run found in the stage's folder; start afresh when there is none
    )


def eval_config(cfg: DemoConfig, arm: str, seed: int, foreign: bool = False):
    """Held-out evaluation of one arm: n samples per problem, every width for Bridge arms; `foreign`: control (b),
    Bridge at the main width with groups made of samples of different problems."""
    from bridgelm.evaluate import EvalConfig

    bridge_like = arm.startswith("bridge")
    return EvalConfig(
        n=cfg.eval_n,
        width=cfg.eval_width if bridge_like else 1,
        widths=[cfg.eval_width] if foreign else list(cfg.widths) if bridge_like else [1],
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        seed=seed,
        gpass_k=cfg.gpass_k,
        foreign_groups=foreign,
    )

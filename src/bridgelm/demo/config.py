"""The demo's settings: `DemoConfig`, made of the configs of the runs it makes (blocks, warm-up sampling, SFT, RL,
evaluation) and a few sizes of its own, with the `quick()` preset; its arms and seeds; and each run's config, made
from the nested one in one function here (`sft_config`, `rl_config`, `eval_config`, `trace_sampling`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from bridgelm.blocks import BlockConfig
from bridgelm.demo import arms as registry
from bridgelm.demo.base import BaseConfig
from bridgelm.demo.control import ControlConfig
from bridgelm.demo.misalign import check_preambles
from bridgelm.engine import SamplingConfig
from bridgelm.errors import UserError
from bridgelm.eval.runner import EvalConfig, eval_sampling
from bridgelm.hardware import MAX_THREADS
from bridgelm.setting import setting
from bridgelm.tasks import anysum
from bridgelm.train.loop import RunControl
from bridgelm.train.optim import OptimConfig
from bridgelm.train.rl_config import RLConfig, default_rollout
from bridgelm.train.sft import SFTConfig

TRACE_SEED = 0  # the Bridge run whose checkpoints the trace stage follows
MAX_NEW_TOKENS = 56  # the longest worked solution (5 numbers) is 49 tokens with its EOS


def demo_blocks() -> BlockConfig:
    """4 heads of dim 16 (4 x 16 = 64 wide: 12% of this tiny model, like-for-like for P-Match; paper: 4 heads of the
    host's head dim). The kind and placement are each run's."""
    return BlockConfig(kind="bridge", num_heads=4, head_dim=16)


def demo_warmup() -> SamplingConfig:
    """8 independent answers per training problem (paper: 8), at the evaluation's temperature and nucleus."""
    return SamplingConfig(n=8, width=1, max_new_tokens=MAX_NEW_TOKENS, temperature=0.6, top_p=0.95)


def demo_sft() -> SFTConfig:
    """5 epochs (paper: 5) at lr 1e-3: the paper's 2e-5 is for 7B models, a 2M model needs larger steps. The block
    kind and placement, precision and seed are each run's."""
    return SFTConfig(epochs=5, optim=OptimConfig(lr=1e-3), max_length=256, run=RunControl(progress=True, resume=True))


def demo_rl() -> RLConfig:
    """80 steps of P = 16 prompts x G = 8 rollouts in Bridge groups of w = 8 (every rollout of a prompt sees the
    others), K = 2, lr 1e-4 constant after 10% warm-up (the paper: 1e-6 for 1.5B-8B models), KL weight 1e-3 (paper).
    Micro-batches of <= 2048 padded tokens, groups by length: a 16% faster update than 64 rows in one. A checkpoint
    every 20 steps, from which an interrupted demo resumes (bit-exact). Seed, precision and checkpoints kept are each
    run's."""
    return RLConfig(
        steps=80,
        prompts_per_step=16,
        rollout=replace(default_rollout(), n=8, width=8, max_new_tokens=MAX_NEW_TOKENS, temperature=0.6, top_p=1.0),
        steps_per_rollout=2,
        micro_batch_groups=64,
        micro_batch_tokens=2048,
        optim=OptimConfig(lr=1e-4),
        beta=1e-3,
        eval_every=0,
        # continue a run found in the stage's folder; start afresh when there is none
        run=RunControl(save_every=20, resume=True),
    )


def demo_eval() -> EvalConfig:
    """16 samples per problem (divisible by every width) at 0.6 / 0.95 (paper), Bridge at w = 8 in the main table and
    at every width of the paper's Table 3; G-Pass@8 (paper). Width and seed are each arm's."""
    sampling = eval_sampling(n=16, width=8, max_new_tokens=MAX_NEW_TOKENS, temperature=0.6, top_p=0.95)
    return EvalConfig(sampling=sampling, widths=[1, 2, 4, 8, 16], gpass_k=8)


@dataclass
class DemoConfig:
    """The demo: the configs of the runs it makes (each run sets its own seed, blocks and precision from them), and
    the sizes of its own; `quick()` shrinks them to toy sizes."""

    base: BaseConfig = setting(default_factory=BaseConfig, help="the base model and its pre-training")
    blocks: BlockConfig = setting(default_factory=demo_blocks, help="the added blocks' size (kind, "
                                                                    "placement: each run's)")
    warmup: SamplingConfig = setting(default_factory=demo_warmup, help="how the base model answers "
                                                                       "for the warm-up data")
    warmup_problems: int = setting(400, "training problems the base model answers for the warm-up data")
    sft: SFTConfig = setting(default_factory=demo_sft, help="the SFT warm-up of each block set")
    rl: RLConfig = setting(default_factory=demo_rl, help="GRPO of each arm: the same prompts, budget and settings")
    eval: EvalConfig = setting(default_factory=demo_eval, help="held-out evaluation of each arm")
    eval_problems: int = setting(240, "held-out test problems (a multiple of "
                                      "eval.sampling.width, for the foreign-siblings control)")
    trace_problems: int = setting(120, "test problems of the trace (interaction over the course of RL, Bridge seed 0)")
    trace_n: int = setting(8, "samples per problem in the trace (a multiple of eval.sampling.width), sampled as "
                              "the evaluation")
    bf16: bool | None = setting(None, "bf16 autocast of pre-training, SFT and RL forwards (fp32 weights and "
                                      "optimiser; 1.6x faster on a CPU with AVX-512 BF16), and sampling "
                                      "(warm-up data, RL rollouts, evaluation) with bf16 weights (1.3-1.5x "
                                      "faster); None: as the folder's earlier stages, else bf16 where its "
                                      "matmul is at least BF16_MARGIN times as fast as fp32's (measured at "
                                      "the start: on CPUs without AVX-512 it is about 100x slower), else fp32")
    seeds: int | None = setting(None, "RL seeds per arm (the arms share each seed); None: 3 where the "
                                      "forwards run in bf16, 1 in fp32 (a CPU without bf16 instructions runs "
                                      "the stages ~2.5x slower: 1 seed keeps make demo near 20 minutes)")
    sft_per_seed: bool = setting(True, "RL seed s of P-Match and Bridge starts "
                                       "from SFT seed s (off: all from SFT seed 0)")
    foreign_control: bool = setting(True, "control (b): Bridge at eval.sampling.width with "
                                          "groups of samples of different problems")
    positive_control: bool = setting(True, "the positive control (demo/control.py): a task where "
                                           "siblings carry the answer, blocks-only GRPO, w=8 "
                                           "against w=1 and foreign siblings, over `seeds` seeds")
    control: ControlConfig = setting(
        default_factory=ControlConfig,
        help="the positive control's model, GRPO and evaluation",
    )
    arms: list[str] = setting(default_factory=list, help="RL arms beside RLVR only, P-Match and Bridge "
                                                         f"(demo/arms.py): {', '.join(registry.OPTIONAL_ARMS)}")
    blocks_lrs: list[float] = setting(default_factory=lambda: [1e-3, 3e-3], help="candidate block lrs of bridge_blocks")
    lr_grid: list[float] = setting(
        default_factory=lambda: [1e-4, 1e-3, 3e-3],
        help="candidate block lrs of the tuned arms, each at base lr rl.optim.lr "
             "and at rl.optim.lr x 3 (6 candidates), chosen on validation problems",
    )
    misalignment: list[int] = setting(
        default_factory=list,
        help="preambles p of the positive control's misalignment dose-response (demo/misalign.py): solutions start "
        "with 0..p filler dots, so siblings' reads are misaligned; e.g. 0,4,16 ([]: not run)",
    )
    primary: str = setting("bridge-rlvr", "the one primary comparison of the report, named before the run "
                                          "(the others are secondary): a key of results.json \"diffs\" or "
                                          "of an extra arm's differences (\"bridge_tuned-rlvr\")")
    recipe_control: bool = setting(True, "every Bridge arm's recipe run on the positive "
                                         "control's task (demo/recipe_control.py)")
    threads: int = setting(0, "torch threads (0 = torch's default); each of "
                              "the workers gets threads // workers, at least 1")
    workers: int = setting(2, "stages that do not wait on each other run in "
                              "this many processes at once (1: one by one)")

    def validate(self) -> None:
        """The demo's own settings, each bad one refused in one line naming its flag, before any stage runs."""
        registry.check_arms(self.arms)
        check_preambles(self.misalignment)
        repeated = sorted({p for p in self.misalignment if self.misalignment.count(p) > 1})
        if repeated:
            raise UserError(f"--misalignment names the preamble {repeated[0]} more than once: expected distinct "
                            "preambles")
        check_primary(self)
        if self.seeds is not None and self.seeds < 1:
            raise UserError(f"--seeds {self.seeds} must be >= 1")
        if self.workers < 1:
            raise UserError(f"--workers {self.workers} must be >= 1")
        if not 0 <= self.threads <= MAX_THREADS:
            raise UserError(f"--threads {self.threads} must be in [0, {MAX_THREADS}] (0: torch's default)")

    @staticmethod
    def quick() -> DemoConfig:
        tokens = 32
        full = DemoConfig()
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
            warmup=replace(full.warmup, n=4, max_new_tokens=tokens),
            warmup_problems=48,
            sft=replace(full.sft, epochs=1),
            rl=replace(
                full.rl, steps=3, prompts_per_step=4, rollout=replace(full.rl.rollout, n=4, width=2, max_new_tokens=tokens)
            ),
            eval=replace(
                full.eval,
                sampling=replace(full.eval.sampling, n=8, width=4, max_new_tokens=tokens),
                widths=[1, 2, 4, 8],
            ),
            eval_problems=12,
            control=quick_control(),
            seeds=1,
        )


def comparisons(cfg: DemoConfig) -> list[str]:
    """The paired differences the report of `cfg`'s arms can name (demo/results.py: `controls`, `extra_arms`)."""
    names = ["bridge-rlvr", "bridge-pmatch", f"w{cfg.eval.sampling.width}-w1", "foreign-w1", "sets-all bridge-rlvr",
             "sets-any bridge-rlvr"]
    for arm in (a for a in cfg.arms if a not in registry.PAPER_ARMS):
        names += [f"{arm}-{'bridge' if registry.ARMS[arm].bridge else 'pmatch'}", f"{arm}-rlvr"]
    if {"bridge_tuned", "pmatch_tuned"} <= set(cfg.arms):
        names.append("bridge_tuned-pmatch_tuned")
    return names


def check_primary(cfg: DemoConfig) -> None:
    """--primary names one of the differences the run's arms make, before the run (the report reads it at the end)."""
    names = comparisons(cfg)
    if cfg.primary not in names:
        extra = next((a for a in registry.ARMS if cfg.primary.startswith(f"{a}-") and a not in cfg.arms), None)
        hint = f" (--arms {extra} runs that arm)" if extra and extra not in registry.PAPER_ARMS else ""
        raise UserError(f"--primary {cfg.primary!r}: expected one of the comparisons of these arms: "
                        f"{', '.join(names)}{hint}")


def quick_control() -> ControlConfig:
    """The positive control at toy sizes (too short to learn anything: it runs the stages)."""
    full = ControlConfig()
    return replace(
        full,
        base=replace(full.base, steps=60, schedule_steps=60, check_from=60),
        rl=replace(full.rl, steps=3, prompts_per_step=4),
        problems=16,
    )


def rl_arms(cfg: DemoConfig) -> tuple[str, ...]:
    """The RL arms of this run: the paper's three, then the others asked for."""
    return registry.rl_arms(cfg.arms)


def sft_of(arm: str) -> str | None:
    """The SFT block set an RL arm starts from; None: none (RLVR has no blocks, the cold start fresh ones)."""
    return registry.ARMS[arm].sft


def eval_arms(cfg: DemoConfig, seed: int) -> tuple[str, ...]:
    """The arms evaluated at RL seed `seed`: every RL arm, and the base model once (at seed 0)."""
    return (registry.BASE,) + rl_arms(cfg) if seed == 0 else rl_arms(cfg)


def sft_kinds(cfg: DemoConfig) -> tuple[str, ...]:
    """Block sets warmed up by SFT: those the arms start from."""
    return registry.sft_kinds(rl_arms(cfg))


def sft_seeds(cfg: DemoConfig) -> tuple[int, ...]:
    """Seeds of the SFT runs: one per RL seed, or seed 0 alone (shared by every RL seed)."""
    return tuple(range(cfg.seeds)) if cfg.sft_per_seed else (0,)


def sft_seed_of(cfg: DemoConfig, seed: int) -> int:
    """The SFT run that RL seed `seed` starts from (a seed past the evaluated ones, the rate search's: SFT seed 0)."""
    return seed if cfg.sft_per_seed and seed < cfg.seeds else 0


def lr_candidates(cfg: DemoConfig, arm: str) -> list[tuple[float, float | None]]:
    """The (lr, block_lr) pairs an arm's search compares (block_lr None: lr for every weight); [] without one."""
    search = registry.ARMS[arm].search
    if search == "block_lr":  # base frozen: the rate is the blocks'
        return [(lr, None) for lr in cfg.blocks_lrs]
    if search == "lrs":
        return [(base, blocks) for base in (cfg.rl.optim.lr, 3 * cfg.rl.optim.lr) for blocks in cfg.lr_grid]
    return []


def trace_sampling(cfg: DemoConfig, width: int, seed: int) -> SamplingConfig:
    """How the trace samples: trace_n samples per problem in groups of `width`, as the evaluation samples."""
    return replace(cfg.eval.sampling_at(width), n=cfg.trace_n, seed=seed)


def sft_config(cfg: DemoConfig, kind: str, seed: int) -> SFTConfig:
    """The SFT warm-up of block set `kind` ("bridge", "pmatch" or "bridge_attn") from `seed`."""
    return replace(
        cfg.sft,
        blocks="pmatch" if kind == "pmatch" else "bridge",
        num_heads=cfg.blocks.num_heads,
        placement="attn" if kind == "bridge_attn" else "ffn",
        optim=replace(cfg.sft.optim, bf16=cfg.bf16),
        seed=seed,  # the split, the groups and the batch order
    )


def rl_config(cfg: DemoConfig, arm: str, seed: int, lrs: tuple[float, float | None] | None = None) -> RLConfig:
    """GRPO of one arm and seed: every arm shares the prompts, budget, settings and seed, but for what its registry
    entry changes. An arm of k groups per prompt samples k x width rollouts per prompt, for as many prompts as keep
    the Bridge arm's rollouts per step (whole prompts, at least 1) or, with equal="prompts", its prompts. `lrs`: the
    (lr, block_lr) of a searched arm (demo/lr_search.py)."""
    spec, rl = registry.ARMS[arm], cfg.rl
    if spec.groups > 1:
        G = spec.groups * rl.rollout.width
        prompts = rl.prompts_per_step if spec.equal == "prompts" else max(1, rl.prompts_per_step * rl.rollout.n // G)
        rl = replace(rl, prompts_per_step=prompts, rollout=replace(rl.rollout, n=G))
    rl = replace(rl, **spec.rl)
    if rl.reward == "sibling":  # L = w - 1: each rollout is paid its group's total reward
        rl = replace(rl, sibling_weight=float(rl.rollout.width - 1))
    if lrs is not None:
        rl = replace(rl, optim=replace(rl.optim, lr=lrs[0]), block_lr=lrs[1])
    return replace(
        rl,
        rollout_dtype="bfloat16" if cfg.bf16 else None,
        optim=replace(rl.optim, bf16=cfg.bf16),
        seed=seed,
        # every checkpoint of the traced run kept (the interaction over the course of RL); elsewhere the last one
        run=replace(rl.run, keep_last=0 if (arm, seed) == ("bridge", TRACE_SEED) else 1),
    )


def eval_config(cfg: DemoConfig, arm: str, seed: int, foreign: bool = False) -> EvalConfig:
    """Held-out evaluation of one arm: n samples per problem, every width for Bridge arms; `foreign`: control (b),
    Bridge at the main width with groups made of samples of different problems."""
    bridge_like = arm != registry.BASE and registry.ARMS[arm].bridge
    w = cfg.eval.sampling.width
    return replace(
        cfg.eval,
        sampling=replace(cfg.eval.sampling, width=w if bridge_like else 1, seed=seed, foreign_groups=foreign),
        widths=[w] if foreign else list(cfg.eval.widths) if bridge_like else [1],
    )

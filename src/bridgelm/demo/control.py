"""The demo's positive control: can this pipeline produce, and detect, a sibling gain where one exists?

On the `hint` task (tasks/hint.py) each sample reads two random places of the problem and boxes one of their digits:
alone a sample is right half the time and cannot tell which read to trust, while the majority of its group's reads is
right almost always. A small base model is pre-trained on it, then fresh Bridge blocks (zero output: at first they
change nothing) are trained by GRPO with the base frozen, at a block learning rate of 3e-3 (an outside pilot learned
to pool siblings' hints at 1e-3 to 3e-3 and nothing at 1e-4; this module's pilots fixed 3e-3, 100 steps, K = 2).
Each seed's blocks are then evaluated on held-out problems at w = 1 and w = 8 with the same random draws, and with
foreign siblings (groups made of samples of 8 different problems).

What the control must show (`control_results`, `results.json` "positive_control"): w=8 − w=1 > 0 and foreign − w=1 <
0, each with a paired interval over seeds and problems that excludes 0. If it cannot, the pipeline cannot detect
sibling use, and a null result on the main task says nothing about Bridge.

Outputs, under DIR/control/: base/ (the model), rl_s<seed>/ (its GRPO run), eval_s<seed>/ and foreign_s<seed>/
(evaluation runs).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from bridgelm.demo.base import BaseConfig, make_problems, make_task, pretrain
from bridgelm.demo.numbers import per_problem_accuracy
from bridgelm.eval.runner import EvalConfig, eval_sampling
from bridgelm.setting import setting
from bridgelm.tasks.hint import HintSpec
from bridgelm.train.loop import RunControl
from bridgelm.train.optim import OptimConfig
from bridgelm.train.rl_config import RLConfig, default_rollout

TEST_SEED = 1  # the draw of held-out problems (seed 0's scored the pilot that chose the GRPO settings)
HINT_TOKENS = 16  # two reads `h3=1\nh6=4\n` and `\boxed{1}` and EOS: 14 tokens


def control_base() -> BaseConfig:
    """A 0.1M-parameter Qwen2 pre-trained on noisy clues for a fixed 2000 steps (no accuracy target: its accuracy is
    the hint rate by design)."""
    return BaseConfig(
        task=HintSpec(),
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        steps=2000,
        schedule_steps=2000,
        batch_size=64,
        distinct=False,  # 8000 training problems, each seen with several hints
        check_from=2000,  # no validation checks
    )


def control_rl() -> RLConfig:
    """GRPO of fresh Bridge blocks, base frozen: 100 steps of 16 prompts x 8 rollouts in one group of 8, K = 2, at
    temperature 1 (the hints' own randomness), block lr 3e-3, no KL term (the base is frozen). Set by a one-seed pilot
    (docs/demo.md): 60 steps at 2e-3 with K = 1 did not show the effect in 2 of 3 seeds."""
    return RLConfig(
        steps=100,
        prompts_per_step=16,
        rollout=replace(default_rollout(), n=8, width=8, max_new_tokens=HINT_TOKENS, temperature=1.0, top_p=1.0),
        steps_per_rollout=2,
        micro_batch_groups=16,
        optim=OptimConfig(lr=3e-3),
        beta=0.0,
        freeze_base=True,
        run=RunControl(save_every=20, keep_last=1, resume=True),
    )


def control_eval() -> EvalConfig:
    """8 samples per problem at temperature 1, at w = 1 and w = 8 (the same draws at both)."""
    sampling = eval_sampling(n=8, width=8, max_new_tokens=HINT_TOKENS, temperature=1.0, top_p=1.0)
    return EvalConfig(sampling=sampling, widths=[1, 8])


@dataclass
class ControlConfig:
    """The positive control's base model, its blocks' GRPO and its evaluation."""

    base: BaseConfig = setting(default_factory=control_base, help="the hint model")
    rl: RLConfig = setting(default_factory=control_rl, help="blocks-only GRPO of fresh Bridge blocks")
    eval: EvalConfig = setting(
        default_factory=control_eval, help="held-out evaluation at w = 1 and w = eval.sampling.width"
    )
    problems: int = setting(240, "held-out test problems (a multiple of eval.sampling.width, for the foreign groups)")


@dataclass
class ControlDirs:
    """Where the control's runs go, under DIR/control."""

    root: Path

    @property
    def base(self) -> Path:
        return self.root / "base"

    def rl(self, seed: int) -> Path:
        return self.root / f"rl_s{seed}"

    def eval(self, seed: int, foreign: bool = False) -> Path:
        return self.root / (f"foreign_s{seed}" if foreign else f"eval_s{seed}")


def train_task(cfg: ControlConfig):
    """The control's training prompts, one per prompt slot of its GRPO run (seeded: every process draws the same)."""
    spec = cfg.base.task
    return make_task(spec, make_problems(spec, cfg.rl.steps * cfg.rl.prompts_per_step, "train", 1, distinct=False))


def test_task(cfg: ControlConfig):
    """The control's held-out test problems, drawn with TEST_SEED."""
    return make_task(cfg.base.task, make_problems(cfg.base.task, cfg.problems, "test", TEST_SEED))


def stage_base(cfg: ControlConfig, dirs: ControlDirs, bf16: bool) -> dict:
    """Pre-train (or reuse) the hint model."""
    import json

    from bridgelm.demo.base import PRETRAIN_FILE

    pretrain(replace(cfg.base, bf16=bf16), dirs.base, progress=False)
    return json.loads((dirs.base / PRETRAIN_FILE).read_text())


def stage_rl(demo, dirs: ControlDirs, seed: int) -> dict:
    """Blocks-only GRPO of fresh Bridge blocks of the demo's size (drawn from `seed`) on the hint model; `demo`: the
    DemoConfig."""
    from bridgelm.demo.training import rl_numbers, with_blocks
    from bridgelm.models import load_model
    from bridgelm.tokenizer import load_tokenizer
    from bridgelm.train.rl import train_rl

    cfg = demo.control
    model = with_blocks(load_model(str(dirs.base)), "bridge", demo, seed=seed)
    rl_cfg = replace(cfg.rl, seed=seed, optim=replace(cfg.rl.optim, bf16=demo.bf16))
    result = train_rl(model, load_tokenizer(dirs.base), train_task(cfg), rl_cfg, dirs.rl(seed))
    return rl_numbers(result)


def stage_eval(cfg: ControlConfig, dirs: ControlDirs, seed: int, foreign: bool, bf16: bool) -> dict:
    """The trained blocks on held-out problems: at w = 1 and w = 8, or (foreign) at w = 8 with foreign siblings."""
    return evaluate(cfg, dirs.base, dirs.rl(seed), dirs.eval(seed, foreign), seed, foreign, bf16)


def evaluate(cfg: ControlConfig, base: Path, rl_dir: Path, out: Path, seed: int, foreign: bool, bf16: bool) -> dict:
    """The final model of the RL run in `rl_dir` on the control's test problems, into `out`: at w = 1 and w = 8, or
    (foreign) at w = 8 with foreign siblings."""
    import json

    import torch

    from bridgelm.eval.runner import run_eval
    from bridgelm.eval.score import score_run
    from bridgelm.models import load_model
    from bridgelm.tokenizer import load_tokenizer

    final = json.loads((rl_dir / "done.json").read_text())["final_dir"]
    model = load_model(final, dtype=torch.bfloat16 if bf16 else torch.float32)
    sampling = replace(cfg.eval.sampling, seed=seed, foreign_groups=foreign)
    ecfg = replace(cfg.eval, sampling=sampling, widths=[sampling.width] if foreign else cfg.eval.widths)
    test = test_task(cfg)
    run_eval(model, load_tokenizer(base), test, None, ecfg, out, model_id=final)
    return score_run(out, task=test)


def sibling_results(cfg: ControlConfig, runs: list[tuple[Path, Path]]) -> dict | None:
    """What runs on the control's task show, from their (evaluation, foreign-sibling evaluation) folders, one pair a
    seed: accuracy at w = 1, w = 8 and with foreign siblings (means over seeds), the majority vote of w = 1's samples
    (the independent ceiling) and the headroom it leaves (majority − w = 1: what pooling siblings could gain), and the
    paired differences "w8-w1" and "foreign-w1" ({"mean", "low", "high"}) over seeds and problems with their power.
    None until a seed's two evaluations are both there."""
    from bridgelm.demo.numbers import entry, mean_of, sibling_test

    done = [(e, f) for e, f in runs if (e / "scores.jsonl").exists()]
    if not done or any(not (f / "scores.jsonl").exists() for _, f in done):
        return None
    w = cfg.eval.sampling.width
    one = [per_problem_accuracy(e, 1) for e, _ in done]
    wide = [per_problem_accuracy(e, w) for e, _ in done]
    foreign = [per_problem_accuracy(f, w) for _, f in done]
    majority = [entry(e, 1)["metrics"].get("majority_vote", {}).get("mean") for e, _ in done]
    vote = None if None in majority else sum(majority) / len(majority)
    return {
        **sibling_test(one, wide, foreign, w),
        "seeds": len(done),
        "accuracy": {"w1": mean_of(one), f"w{w}": mean_of(wide), "foreign": mean_of(foreign)},
        "majority_vote_w1": vote,
        "headroom": None if vote is None else vote - mean_of(one),
    }


def control_results(cfg: ControlConfig, dirs: ControlDirs, seeds: int) -> dict | None:
    """`positive_control` of results.json: `sibling_results` of the control's own runs, with whether each
    difference shows what it must ("shown": w8 − w1 above 0 and foreign − w1 below 0, each interval excluding 0)."""
    out = sibling_results(cfg, [(dirs.eval(s), dirs.eval(s, True)) for s in range(seeds)])
    if out is None:
        return None
    w = cfg.eval.sampling.width
    out["shown"] = {f"w{w}-w1": out[f"w{w}-w1"]["low"] > 0, "foreign-w1": out["foreign-w1"]["high"] < 0}
    return out

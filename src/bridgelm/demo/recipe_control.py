"""The positive control through each Bridge arm's own recipe: can *that* recipe learn a sibling channel at all?

The positive control (demo/control.py) trains fresh blocks alone at a block lr of 3e-3 for 100 steps at temperature 1,
a recipe of its own. A Bridge arm that shows no sibling use on the main task says something about Bridge only if its
own recipe can learn one where one is worth having: an outside audit found the Bridge arm's recipe (full model at
1e-4, KL 1e-3, temperature 0.6, 80 steps) learns under 2 of the ~47 points a group's majority offers on the control's
task. So each Bridge arm's recipe runs here on the control's task and model, trained as on the main task: the same
SFT warm-up where the arm has one (on warm-up data the control's base model makes, as the demo's does), its
learning rates (a searched arm's chosen ones), KL weight, rollout temperature, steps, K, groups and rewards; only
the rollouts' length is the control's. Each seed's model is then evaluated as the control's is (w = 1, w = 8, and
foreign siblings).

`results.json` "recipe_control": per Bridge arm, "w8-w1" and "foreign-w1" ({"mean", "low", "high"}), the majority
vote's "headroom" over w = 1, and "learns": w8 − w1 reaches at least a quarter of the headroom and foreign siblings
fall below w = 1, each interval excluding 0.

Outputs, under DIR/control/recipe/: warmup.jsonl, sft_<kind>_s<seed>/, rl_<arm>_s<seed>/, eval_<arm>_s<seed>/,
foreign_<arm>_s<seed>/.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from bridgelm.demo.arms import ARMS
from bridgelm.demo.control import HINT_TOKENS, ControlDirs, evaluate, sibling_results
from bridgelm.demo.base import make_problems, make_task
from bridgelm.demo.lr_search import TUNE_SEED

LEARNS_SHARE = 0.25  # a recipe learns a sibling channel when w8 − w1 reaches this share of the majority's headroom


@dataclass
class RecipeDirs:
    """Where the recipe-matched runs go, under DIR/control/recipe."""

    control: ControlDirs

    @property
    def root(self) -> Path:
        return self.control.root / "recipe"

    @property
    def warmup(self) -> Path:
        return self.root / "warmup.jsonl"

    def sft(self, kind: str, seed: int) -> Path:
        return self.root / f"sft_{kind}_s{seed}"

    def rl(self, arm: str, seed: int) -> Path:
        return self.root / f"rl_{arm}_s{seed}"

    def eval(self, arm: str, seed: int, foreign: bool = False) -> Path:
        return self.root / (f"foreign_{arm}_s{seed}" if foreign else f"eval_{arm}_s{seed}")


def recipe_arms(arms: tuple[str, ...]) -> tuple[str, ...]:
    """The arms whose recipe the control checks: those that sample in Bridge groups."""
    return tuple(a for a in arms if ARMS[a].bridge)


def recipe_rl(demo, arm: str, seed: int, lrs=None):
    """The arm's RLConfig (demo/config.py rl_config) with the control's rollout length, its last checkpoint kept."""
    from bridgelm.demo.config import rl_config

    rl = rl_config(demo, arm, seed, lrs)
    return replace(rl, rollout=replace(rl.rollout, max_new_tokens=HINT_TOKENS), run=replace(rl.run, keep_last=1))


def _train_task(demo, n: int):
    spec = demo.control.base.task  # the control's training split, as its own GRPO draws it
    return make_task(spec, make_problems(spec, n, "train", 1, distinct=False))


def stage_warmup(demo, dirs: RecipeDirs) -> dict:
    """The control's base model answers demo.warmup.n times per training problem; correct answers kept."""
    import torch

    from bridgelm.models import load_model
    from bridgelm.tokenizer import load_tokenizer
    from bridgelm.train.warmup_data import make_warmup_data

    model = load_model(str(dirs.control.base), dtype=torch.bfloat16 if demo.bf16 else torch.float32)
    sampling = replace(demo.warmup, max_new_tokens=HINT_TOKENS)
    task = _train_task(demo, demo.warmup_problems)
    tok = load_tokenizer(dirs.control.base)
    return make_warmup_data(model, tok, task, dirs.warmup, n=sampling.n, sampling=sampling)


def stage_sft(demo, dirs: RecipeDirs, kind: str, seed: int) -> dict:
    """The SFT warm-up of block set `kind` from `seed` on the control's warm-up data, as the demo's (sft_config)."""
    from bridgelm.demo.config import sft_config
    from bridgelm.demo.training import with_blocks
    from bridgelm.models import load_model
    from bridgelm.tokenizer import load_tokenizer
    from bridgelm.train.sft import train_sft

    cfg = sft_config(demo, kind, seed)
    cfg = replace(cfg, run=replace(cfg.run, progress=False))
    model = with_blocks(load_model(str(dirs.control.base)), cfg.blocks, demo, cfg.placement, seed=seed)
    result = train_sft(model, load_tokenizer(dirs.control.base), dirs.warmup, cfg, dirs.sft(kind, seed))
    return {"best_val_ppl": result.best_val_ppl, "best_epoch": result.best_epoch, "steps": result.steps}


def stage_rl(demo, dirs: RecipeDirs, arm: str, seed: int, lrs=None, label: str | None = None) -> dict:
    """The arm's GRPO recipe on the control's task and model, from its SFT blocks (or fresh ones), into the run
    named `label` (default: the arm's own; a search candidate's is "<arm>_<candidate>")."""
    from bridgelm.blockfile import load_blocks
    from bridgelm.demo.config import sft_seed_of
    from bridgelm.demo.training import rl_numbers, with_blocks
    from bridgelm.models import load_model
    from bridgelm.tokenizer import load_tokenizer
    from bridgelm.train.rl import train_rl

    spec, model = ARMS[arm], load_model(str(dirs.control.base))
    if spec.sft is not None:
        load_blocks(model, dirs.sft(spec.sft, sft_seed_of(demo, seed)) / "blocks.safetensors")
    else:
        with_blocks(model, spec.blocks, demo, spec.placement, seed=seed)
    cfg = recipe_rl(demo, arm, seed, lrs)
    cfg = replace(cfg, run=replace(cfg.run, progress=False))
    task = _train_task(demo, cfg.steps * cfg.prompts_per_step)
    return rl_numbers(train_rl(model, load_tokenizer(dirs.control.base), task, cfg, dirs.rl(label or arm, seed)))


def stage_eval(demo, dirs: RecipeDirs, label: str, seed: int, foreign: bool) -> dict:
    """The model of recipe run `label` (an arm's, or a search candidate's) on the control's test problems, as the
    control's own are evaluated."""
    return evaluate(demo.control, dirs.control.base, dirs.rl(label, seed), dirs.eval(label, seed, foreign), seed,
                    foreign, demo.bf16)


def arm_result(demo, dirs: RecipeDirs, label: str, seeds=None) -> dict | None:
    """`sibling_results` of one recipe run (`label`: an arm, or a search candidate "<arm>_<candidate>") over `seeds`
    (default: every seed), with "learns"; None until a seed's evaluations are there."""
    seeds = range(demo.seeds) if seeds is None else seeds
    runs = [(dirs.eval(label, s), dirs.eval(label, s, True)) for s in seeds]
    out = sibling_results(demo.control, runs)
    if out is None:
        return None
    w = demo.control.eval.sampling.width
    gain, foreign, room = out[f"w{w}-w1"], out["foreign-w1"], out["headroom"]
    out["learns"] = bool(
        room is not None and gain["mean"] >= LEARNS_SHARE * room and gain["low"] > 0 and foreign["high"] < 0
    )
    return out


def results(demo, dirs: RecipeDirs, arms: tuple[str, ...], candidates: dict) -> dict:
    """`recipe_control` of results.json: {arm: arm_result} for every Bridge arm whose recipe ran; a searched arm's
    also has "candidates": {candidate: arm_result of the search's seed}, every rate its search compared, so that the report
    can say whether any of them learns a channel where the chosen one does not. `candidates`: {arm: {candidate
    name: label}}."""
    out = {arm: r for arm in recipe_arms(arms) if (r := arm_result(demo, dirs, arm)) is not None}
    for arm, named in candidates.items():
        found = {name: r for name, label in named.items() if (r := arm_result(demo, dirs, label, [TUNE_SEED])) is not None}
        if found:
            out.setdefault(arm, {})["candidates"] = found
    return out

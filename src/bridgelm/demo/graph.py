"""The demo's stages as a list (`demo_stages`), each after the stages it reads, for demo/runner.py; and what the
report reads of them (`run_dirs`, `arm_results`)."""

from __future__ import annotations

import json
from dataclasses import replace
from functools import partial

from bridgelm.demo import lr_search, misalign
from bridgelm.demo import recipe_control as rc
from bridgelm.demo import stages as st
from bridgelm.demo.arms import ARMS
from bridgelm.demo.base import PRETRAIN_FILE
from bridgelm.demo.config import (
    TRACE_SEED,
    eval_arms,
    lr_candidates,
    rl_arms,
    sft_kinds,
    sft_of,
    sft_seed_of,
    sft_seeds,
)
from bridgelm.demo.control import ControlDirs
from bridgelm.demo.results import RunDirs
from bridgelm.demo.runner import Stage


def demo_stages(ctx: st.Context) -> list[Stage]:
    """Warm-up data, SFT, the lr searches, RL, evaluation (then control (b), foreign siblings), the trace, and the
    positive control on its own and through each Bridge arm's recipe."""
    cfg, out = ctx.cfg, ctx.out
    stages = control_stages(cfg, control_dirs(out)) if cfg.positive_control else []  # first: beside the others
    warmup = partial(st.recorded, out / "warmup.done", st.stage_warmup, ctx)
    stages.append(Stage("warmup", out / "warmup.done", warmup, st.warmup_summary))
    for seed in sft_seeds(cfg):
        for kind in sft_kinds(cfg):
            done = ctx.sft_dir(kind, seed) / "done.json"  # blocks.safetensors appears at the first epoch's end
            fn = partial(st.recorded, done, st.stage_sft, ctx, kind, seed)
            stages.append(Stage(f"sft {kind} seed {seed}", done, fn, st.sft_summary, ("warmup",)))
    for arm in rl_arms(cfg):
        stages += search_stages(ctx, arm)
    stages += rl_stages(ctx) + eval_stages(ctx)
    trace = partial(st.recorded, out / "trace.json", st.stage_trace, ctx, TRACE_SEED)
    stages.append(Stage("trace", out / "trace.json", trace, st.trace_summary, (f"rl bridge seed {TRACE_SEED}",)))
    if cfg.positive_control and cfg.recipe_control:
        stages += recipe_stages(ctx)
    for p in cfg.misalignment if cfg.positive_control else ():
        if p:  # preamble 0 is the control itself
            variant = replace(cfg, control=misalign.control_at(cfg.control, p))
            stages += control_stages(variant, misalign.dirs_at(control_dirs(out), p), f"misaligned {p} ")
    return sorted(stages, key=_seed_of)  # seed by seed: a long run interrupted early has whole seeds to report


def _seed_of(stage: Stage) -> int:
    """The seed a stage belongs to ("... seed 3"); the stages of no seed (base models, warm-up data, searches) go
    with seed 0's. The runner starts ready stages in list order, so seed s is done before seed s + 1 starts."""
    last = stage.name.rsplit(" ", 2)
    return int(last[2]) if len(last) == 3 and last[1] == "seed" and last[2].isdigit() else 0


def _after_sft(cfg, arm: str, seed: int) -> tuple[str, ...]:
    return () if sft_of(arm) is None else (f"sft {sft_of(arm)} seed {sft_seed_of(cfg, seed)}",)


def rl_stages(ctx: st.Context) -> list[Stage]:
    """Every arm's RL run of every seed; a searched arm's after its choice of rates."""
    stages, cfg = [], ctx.cfg
    for seed in range(cfg.seeds):
        for arm in rl_arms(cfg):
            done = ctx.rl_dir(arm, seed) / "done.json"
            fn, after = partial(st.recorded, done, st.stage_rl, ctx, arm, seed), _after_sft(cfg, arm, seed)
            if ARMS[arm].search:
                fn = partial(st.recorded, done, lr_search.stage_rl, ctx, arm, seed)
                after += (f"choose lr {arm}",)
            stages.append(Stage(f"rl {arm} seed {seed}", done, fn, st.rl_summary, after))
    return stages


def eval_stages(ctx: st.Context) -> list[Stage]:
    """Every arm's evaluation of every seed (the base model once), and control (b) of the Bridge arm."""
    stages, cfg = [], ctx.cfg
    for seed in range(cfg.seeds):
        for arm in eval_arms(cfg, seed):
            fn = partial(st.stage_eval, ctx, arm, seed)
            after = () if arm == "base" else (f"rl {arm} seed {seed}",)
            summary = partial(st.eval_summary, arm=arm)
            stages.append(Stage(f"eval {arm} seed {seed}", ctx.eval_dir(arm, seed) / "metrics.json", fn, summary, after))
        if cfg.foreign_control:
            fn = partial(st.stage_eval, ctx, "bridge", seed, foreign=True)
            summary, after = partial(st.eval_summary, arm="Bridge with foreign siblings"), (f"rl bridge seed {seed}",)
            name = f"eval foreign siblings seed {seed}"
            stages.append(Stage(name, ctx.foreign_dir(seed) / "metrics.json", fn, summary, after))
    return stages


def search_stages(ctx: st.Context, arm: str) -> list[Stage]:
    """An arm's rates chosen on validation problems: the TUNE_SEED run at every candidate, each evaluated on validation
    problems, then the choice (DIR/lr_<arm>.json). None for an arm without a search."""
    stages, out, cfg = [], ctx.out, ctx.cfg
    candidates = lr_candidates(cfg, arm)
    for lrs in candidates:
        name = f"{arm} {lr_search.name(lrs)}"
        done = lr_search.candidate_dir(out, arm, lrs) / "done.json"
        fn = partial(st.recorded, done, lr_search.stage_candidate, ctx, arm, lrs)
        stages.append(Stage(f"rl {name}", done, fn, st.rl_summary, _after_sft(cfg, arm, lr_search.TUNE_SEED)))
        val = partial(lr_search.stage_validate, ctx, arm, lrs)
        output = lr_search.validation_dir(out, arm, lrs) / "metrics.json"
        summary = partial(st.eval_summary, arm=f"validation, {name}")
        stages.append(Stage(f"validate {name}", output, val, summary, (f"rl {name}",)))
    if candidates:
        choice = lr_search.choice_file(out, arm)
        choose = partial(st.recorded, choice, lr_search.stage_choose, ctx, arm)
        after = tuple(f"validate {arm} {lr_search.name(lrs)}" for lrs in candidates)
        stages.append(Stage(f"choose lr {arm}", choice, choose, json.dumps, after))
    return stages


def control_dirs(out) -> ControlDirs:
    return ControlDirs(out / "control")


def control_stages(cfg, dirs: ControlDirs, prefix: str = "") -> list[Stage]:
    """The positive control (`cfg.control`): its base model, then per seed blocks-only GRPO, evaluation at w = 1 and
    w = 8, and with foreign siblings; `prefix` names a variant's stages ("misaligned 4 ")."""
    from bridgelm.demo import control

    base = partial(control.stage_base, cfg.control, dirs, cfg.bf16)
    stages = [Stage(f"{prefix}control base", dirs.base / PRETRAIN_FILE, base)]
    for seed in range(cfg.seeds):
        done = dirs.rl(seed) / "done.json"
        rl = partial(st.recorded, done, control.stage_rl, cfg, dirs, seed)
        stages.append(Stage(f"{prefix}control rl seed {seed}", done, rl, st.rl_summary, (f"{prefix}control base",)))
        for foreign in (False, True):
            fn = partial(control.stage_eval, cfg.control, dirs, seed, foreign, cfg.bf16)
            name = f"{prefix}control {'foreign siblings' if foreign else 'eval'} seed {seed}"
            summary = partial(st.eval_summary, arm=f"{prefix}positive control")
            output = dirs.eval(seed, foreign) / "metrics.json"
            stages.append(Stage(name, output, fn, summary, (f"{prefix}control rl seed {seed}",)))
    return stages


def recipe_stages(ctx: st.Context) -> list[Stage]:
    """Each Bridge arm's recipe on the control's task: warm-up data from the control's model, SFT where the arm has
    one, the arm's GRPO (a searched arm's at its chosen rates), and the control's evaluations."""
    cfg, dirs = ctx.cfg, rc.RecipeDirs(control_dirs(ctx.out))
    arms = rc.recipe_arms(rl_arms(cfg))
    warm = dirs.root / "warmup.done"
    stages = [Stage("recipe warmup", warm, partial(st.recorded, warm, rc.stage_warmup, cfg, dirs), st.warmup_summary,
                    ("control base",))]
    for seed in sft_seeds(cfg):
        for kind in dict.fromkeys(ARMS[a].sft for a in arms if ARMS[a].sft):
            done = dirs.sft(kind, seed) / "done.json"
            fn = partial(st.recorded, done, rc.stage_sft, cfg, dirs, kind, seed)
            stages.append(Stage(f"recipe sft {kind} seed {seed}", done, fn, st.sft_summary, ("recipe warmup",)))
    for seed in range(cfg.seeds):
        for arm in arms:
            stages += _recipe_arm_stages(ctx, dirs, arm, seed)
    for arm, named in recipe_candidates(cfg).items():  # every rate a search compares, at the search's seed
        for name, label in named.items():
            stages += _recipe_arm_stages(ctx, dirs, arm, lr_search.TUNE_SEED, (label, name))
    return stages


def recipe_candidates(cfg) -> dict[str, dict[str, str]]:
    """{searched Bridge arm: {candidate name: its recipe run's label}}."""
    return {
        arm: {lr_search.name(c): f"{arm}_{lr_search.name(c)}" for c in lr_candidates(cfg, arm)}
        for arm in rc.recipe_arms(rl_arms(cfg))
        if ARMS[arm].search
    }


def _recipe_arm_stages(ctx: st.Context, dirs, arm: str, seed: int, candidate: tuple | None = None) -> list[Stage]:
    """An arm's recipe run of `seed` and its two evaluations; `candidate` (label, name): a search candidate's run at
    its own rates, named without a seed (it belongs to the search, at its seed)."""
    cfg, spec = ctx.cfg, ARMS[arm]
    after = ("control base",) if spec.sft is None else (f"recipe sft {spec.sft} seed {sft_seed_of(cfg, seed)}",)
    label, tag, lrs = arm, f"{arm} seed {seed}", None
    if candidate is not None:
        label, tag = candidate[0], f"{arm} {candidate[1]}"
        lrs = next(c for c in lr_candidates(cfg, arm) if lr_search.name(c) == candidate[1])
    elif spec.search:
        after += (f"choose lr {arm}",)
        lrs = partial(lr_search.chosen, ctx.out, arm)  # read when the stage runs, after the choice
    done = dirs.rl(label, seed) / "done.json"
    fn = partial(st.recorded, done, _recipe_rl, cfg, dirs, arm, seed, lrs, label)
    stages = [Stage(f"recipe rl {tag}", done, fn, st.rl_summary, after)]
    for foreign in (False, True):
        fn = partial(rc.stage_eval, cfg, dirs, label, seed, foreign)
        name = f"recipe {'foreign siblings' if foreign else 'eval'} {tag}"
        output = dirs.eval(label, seed, foreign) / "metrics.json"
        summary = partial(st.eval_summary, arm=f"recipe control, {label}")
        stages.append(Stage(name, output, fn, summary, (f"recipe rl {tag}",)))
    return stages


def _recipe_rl(cfg, dirs, arm: str, seed: int, lrs, label: str) -> dict:
    return rc.stage_rl(cfg, dirs, arm, seed, lrs() if callable(lrs) else lrs, label)


def run_dirs(ctx: st.Context) -> RunDirs:
    """The run folders the report reads."""
    cfg, seeds = ctx.cfg, range(ctx.cfg.seeds)
    return RunDirs(
        eval={(arm, seed): ctx.eval_dir(arm, seed) for seed in seeds for arm in eval_arms(cfg, seed)},
        rl={(arm, seed): ctx.rl_dir(arm, seed) for seed in seeds for arm in rl_arms(cfg)},
        foreign={seed: ctx.foreign_dir(seed) for seed in seeds} if cfg.foreign_control else {},
    )


def arm_results(ctx: st.Context) -> dict:
    """What the controls and searches found, for results.json: "positive_control", "recipe_control", "lr_search"
    ({arm: chosen rates and every candidate's validation accuracy}) and "misalignment" ({preamble: the control's
    numbers})."""
    from bridgelm.demo.control import control_results

    cfg, dirs = ctx.cfg, control_dirs(ctx.out)
    on = cfg.positive_control
    return {
        "positive_control": control_results(cfg.control, dirs, cfg.seeds) if on else None,
        "recipe_control": (
            rc.results(cfg, rc.RecipeDirs(dirs), rl_arms(cfg), recipe_candidates(cfg)) if on and cfg.recipe_control else None
        ),
        "lr_search": {a: lr_search.results(ctx.out, a) for a in rl_arms(cfg) if ARMS[a].search},
        "misalignment": misalign.results(cfg, dirs) if on and cfg.misalignment else None,
    }

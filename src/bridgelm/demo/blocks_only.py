"""The demo's blocks-only arm (`DemoConfig.blocks_only`): Bridge RL with the base frozen, only the added blocks
trained, from the Bridge SFT blocks, at a block learning rate chosen on validation problems, never on the test split.

A full-model arm at the demo's RL rate (1e-4) leaves zero-initialised or SFT-warmed blocks little room to learn to
read their siblings (issue 39's pilot: blocks learned to pool at 1e-3 to 3e-3, not at 1e-4). This arm asks whether
the blocks alone, at a rate of their own, make w = 8 beat w = 1 on the demo's task.

How the rate is chosen: seed 0's RL run is made at every candidate rate (`DemoConfig.blocks_lrs`); each is evaluated
on held-out *validation* problems at the main width; the rate with the best accuracy (the smaller one on a tie) is
recorded in DIR/blocks_lr.json, and seeds 1.. run at it (seed 0's run at that rate is the arm's seed 0). Only then is
the arm evaluated on the test problems, like every other arm.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path


ARM = "bridge_blocks"  # the arm's name in stages, folders and results.json
CHOICE = "blocks_lr.json"  # DIR/blocks_lr.json: the chosen rate and every candidate's validation accuracy
TUNE_SEED = 0  # the seed whose runs compare the candidate rates


def candidate_dir(out: Path, lr: float) -> Path:
    return out / f"rl_{ARM}_lr{lr:g}_s{TUNE_SEED}"


def validation_dir(out: Path, lr: float) -> Path:
    return out / f"val_{ARM}_lr{lr:g}"


def train(ctx, seed: int, lr: float, out_dir: Path) -> dict:
    """Blocks-only GRPO of one seed at block learning rate `lr`, from that seed's Bridge SFT blocks."""
    from bridgelm.blockfile import load_blocks
    from bridgelm.demo.config import rl_config, sft_seed_of
    from bridgelm.demo.stages import rl_numbers
    from bridgelm.models import load_model
    from bridgelm.train.rl import train_rl

    model = load_model(str(ctx.base_dir))
    load_blocks(model, ctx.sft_dir("bridge", sft_seed_of(ctx.cfg, seed)) / "blocks.safetensors")
    cfg = replace(rl_config(ctx.cfg, ARM, seed), lr=lr)
    return rl_numbers(train_rl(model, ctx.tokenizer, ctx.train, cfg, out_dir))


def stage_candidate(ctx, lr: float) -> dict:
    """Seed 0's run at candidate rate `lr`."""
    return train(ctx, TUNE_SEED, lr, candidate_dir(ctx.out, lr))


def stage_validate(ctx, lr: float) -> dict:
    """Candidate `lr`'s blocks at the main width on validation problems (drawn from the validation split)."""
    from bridgelm.demo.base import make_problems, make_task
    from bridgelm.evaluate import run_eval
    from bridgelm.score import score_run

    spec, cfg = ctx.cfg.base.task, ctx.cfg
    val = make_task(spec, make_problems(spec, cfg.eval_problems, "validation", 0))
    final = json.loads((candidate_dir(ctx.out, lr) / "done.json").read_text())["final_dir"]
    ecfg = replace(cfg.eval, widths=[cfg.eval.width], seed=TUNE_SEED)
    run_eval(ctx.sampler(final), ctx.tokenizer, val, None, ecfg, validation_dir(ctx.out, lr), model_id=final)
    return score_run(validation_dir(ctx.out, lr), task=val)


def validation_accuracy(out: Path, lr: float, width: int) -> float:
    metrics = json.loads((validation_dir(out, lr) / "metrics.json").read_text())
    return next(iter(metrics["benchmarks"].values()))[str(width)]["metrics"]["accuracy"]["mean"]


def stage_choose(ctx) -> dict:
    """The candidate rate with the best validation accuracy (the smaller on a tie), written to DIR/blocks_lr.json."""
    lrs = sorted(ctx.cfg.blocks_lrs)
    accuracy = {f"{lr:g}": validation_accuracy(ctx.out, lr, ctx.cfg.eval.width) for lr in lrs}
    best = max(lrs, key=lambda lr: (accuracy[f"{lr:g}"], -lr))
    return {"lr": best, "validation_accuracy": accuracy, "seed": TUNE_SEED}


def chosen_lr(out: Path) -> float:
    return float(json.loads((out / CHOICE).read_text())["lr"])


def stage_rl(ctx, seed: int) -> dict:
    """The arm's RL run of `seed` at the chosen rate; seed 0's is the candidate run at that rate, copied."""
    lr, out_dir = chosen_lr(ctx.out), ctx.rl_dir(ARM, seed)
    if seed != TUNE_SEED:
        return train(ctx, seed, lr, out_dir)
    source = candidate_dir(ctx.out, lr)
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source / "metrics.jsonl", out_dir / "metrics.jsonl")  # its reward curve, for the report
    return json.loads((source / "done.json").read_text())


def results(out: Path, eval_dirs: dict, cfg) -> dict | None:
    """`blocks_only` of results.json: the chosen rate and the candidates' validation accuracy, and the paired
    differences over seeds and problems "w8-w1" (same weights) and "blocks-bridge" (against the full-model Bridge arm
    at the main width). None when the arm did not run."""
    from bridgelm.demo.results import per_problem_accuracy, power
    from bridgelm.metrics import paired_difference

    seeds = sorted(s for (arm, s) in eval_dirs if arm == ARM and (eval_dirs[(arm, s)] / "scores.jsonl").exists())
    if not seeds or not (out / CHOICE).exists():
        return None
    w = cfg.eval.width
    wide = [per_problem_accuracy(eval_dirs[(ARM, s)], w) for s in seeds]
    diffs = {f"w{w}-w1": paired_difference(wide, [per_problem_accuracy(eval_dirs[(ARM, s)], 1) for s in seeds])}
    if all(("bridge", s) in eval_dirs for s in seeds):
        full = [per_problem_accuracy(eval_dirs[("bridge", s)], w) for s in seeds]
        diffs["blocks-bridge"] = paired_difference(wide, full)
    choice = json.loads((out / CHOICE).read_text())
    chosen = {"lr": choice["lr"], "validation_accuracy": choice["validation_accuracy"]}
    return {**diffs, **chosen, "seeds": len(seeds), "power": power(diffs)}

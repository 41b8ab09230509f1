"""Learning rates chosen on validation problems, never on the test split, for the arms whose registry entry says so
(demo/arms.py `search`): the blocks-only arm's block lr (`DemoConfig.blocks_lrs`, base frozen), and the tuned
Bridge and P-Match arms' base and block lrs (`DemoConfig.lr_grid`), the same search for both so that the comparison
stays fair.

A full-model arm at the demo's RL rate (1e-4) leaves its blocks little room to learn to read their siblings (an
outside pilot on the positive control: +1.7 points of w=8 − w=1 at the Bridge arm's recipe, +13.8 with the blocks at
3e-3), so the blocks get a rate of their own here.

How: an RL run of TUNE_SEED (a seed no evaluated run has, from SFT seed 0) is made at every candidate (lr, block_lr);
each is evaluated on held-out *validation* problems at the arm's main width; the candidate with the best accuracy
(the smaller rates on a tie) is recorded in DIR/lr_<arm>.json with every candidate's accuracy, and every evaluated
seed 0.. is trained afresh at it. Only then is the arm evaluated on the test problems, like every other arm.
"""

from __future__ import annotations

import json
from pathlib import Path

from bridgelm.errors import UserError

# The RL seed of the candidates' runs: one that no evaluated run has (seeds 0..S-1), so that the winner's luck on
# validation is not carried into the comparison on test problems (the winner's run reused as seed 0 biased the tuned
# arm upward: +0.6 points with no true effect, in simulation). Its runs start from SFT seed 0.
TUNE_SEED = 1000


def name(lrs: tuple[float, float | None]) -> str:
    """A candidate's name in folders and results: "lr0.001" or "lr0.0001_blr0.003"."""
    lr, block_lr = lrs
    return f"lr{lr:g}" + ("" if block_lr is None else f"_blr{block_lr:g}")


def choice_file(out: Path, arm: str) -> Path:
    return out / f"lr_{arm}.json"


def candidate_dir(out: Path, arm: str, lrs) -> Path:
    return out / f"rl_{arm}_{name(lrs)}_s{TUNE_SEED}"


def validation_dir(out: Path, arm: str, lrs) -> Path:
    return out / f"val_{arm}_{name(lrs)}"


def stage_candidate(ctx, arm: str, lrs) -> dict:
    """The TUNE_SEED run of `arm` at candidate `lrs`."""
    from bridgelm.demo.stages import train_arm

    return train_arm(ctx, arm, TUNE_SEED, candidate_dir(ctx.out, arm, lrs), tuple(lrs))


def stage_validate(ctx, arm: str, lrs) -> dict:
    """A candidate's model at the arm's main width on validation problems (drawn from the validation split)."""
    from dataclasses import replace

    from bridgelm.demo.base import make_problems, make_task
    from bridgelm.demo.config import eval_config
    from bridgelm.eval.runner import run_eval
    from bridgelm.eval.score import score_run

    spec, cfg = ctx.cfg.base.task, ctx.cfg
    val = make_task(spec, make_problems(spec, cfg.eval_problems, "validation", 0))
    final = json.loads((candidate_dir(ctx.out, arm, lrs) / "done.json").read_text())["final_dir"]
    main = eval_config(cfg, arm, TUNE_SEED)
    ecfg = replace(main, widths=[main.sampling.width])
    out = validation_dir(ctx.out, arm, lrs)
    run_eval(ctx.sampler(final), ctx.tokenizer, val, None, ecfg, out, model_id=final)
    return score_run(out, task=val)


def _accuracy(out: Path, arm: str, lrs) -> float:
    metrics = json.loads((validation_dir(out, arm, lrs) / "metrics.json").read_text())
    entry = next(iter(metrics["benchmarks"].values()))
    return next(iter(entry.values()))["metrics"]["accuracy"]["mean"]


def stage_choose(ctx, arm: str) -> dict:
    """The candidate with the best validation accuracy (the smaller rates on a tie), for DIR/lr_<arm>.json."""
    from bridgelm.demo.config import lr_candidates

    candidates = lr_candidates(ctx.cfg, arm)
    accuracy = {name(c): _accuracy(ctx.out, arm, c) for c in candidates}
    best = max(candidates, key=lambda c: (accuracy[name(c)], -c[0], -(c[1] or c[0])))
    return {"lr": best[0], "block_lr": best[1], "validation_accuracy": accuracy, "seed": TUNE_SEED}


def _choice(path: Path) -> dict:
    """DIR/lr_<arm>.json, refused when an older search made it (its winner's run was reused as seed 0)."""
    choice = json.loads(path.read_text())
    if choice.get("seed") != TUNE_SEED:
        raise UserError(f"{path} was made by an older search (candidates at seed {choice.get('seed', 0)}, not "
                        f"{TUNE_SEED}): use another --out")
    return choice


def check_choices(out: Path) -> None:
    """Refuse a folder whose choices an older search made, before any stage runs."""
    for path in sorted(out.glob("lr_*.json")):
        _choice(path)


def chosen(out: Path, arm: str) -> tuple[float, float | None]:
    """The (lr, block_lr) chosen for `arm`."""
    choice = _choice(choice_file(out, arm))
    return float(choice["lr"]), None if choice["block_lr"] is None else float(choice["block_lr"])


def stage_rl(ctx, arm: str, seed: int) -> dict:
    """The arm's RL run of `seed` at the chosen rates (trained afresh: no candidate run is evaluated)."""
    from bridgelm.demo.stages import train_arm

    return train_arm(ctx, arm, seed, ctx.rl_dir(arm, seed), chosen(ctx.out, arm))


def results(out: Path, arm: str) -> dict | None:
    """The chosen rates and every candidate's validation accuracy; None before the choice."""
    path = choice_file(out, arm)
    if not path.exists():
        return None
    choice = _choice(path)
    return {k: choice[k] for k in ("lr", "block_lr", "validation_accuracy")}

"""The demo's numbers, from the evaluation and RL runs: DIR/results.json (`demo_results`).

Per arm and seed: accuracy with its interval, coverage, G-Pass@k at every tau*k, majority vote; Bridge at every
width. The controls say whether Bridge uses its siblings: (a) interaction, the share of samples that change when the
same draws are made at width w instead of 1; (b) foreign siblings, accuracy when a group holds samples of different
problems; (c) P-Match, the parameter control. Differences between arms are paired (same problems, same seeds) with
95% intervals over seeds and problems (`intervals.paired_difference`), and set against the paper's effect
scaled to this run (`paper_effects`). demo/report.py writes them as DIR/report.md.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from bridgelm.demo.arms import ARMS, ORDER, PAPER_ARMS, TITLES
from bridgelm.demo.numbers import entry, per_problem_accuracy, per_problem_sets, power
from bridgelm.eval.folder import read_samples
from bridgelm.intervals import paired_difference
from bridgelm.jsonl import read_records, write_json

__all__ = ["ORDER", "TITLES", "RunDirs", "demo_results", "paper_contrasts", "paper_effects", "power"]


@dataclass
class RunDirs:
    """The run folders the report reads, as the stages named them (demo.stages.Context)."""

    eval: dict[tuple[str, int], Path]  # (arm, seed) -> evaluation run: metrics.json, scores.jsonl, samples
    rl: dict[tuple[str, int], Path]  # (arm, seed) -> RL run: metrics.jsonl
    foreign: dict[int, Path]  # seed -> control (b)'s evaluation run (empty without the control)


# The paper's average accuracy (points) over its math benchmarks. Table 1: original model, RLVR only, P-Match and
# Bridge for its three models. Table 3: DS-Qwen-7B (trained at w=4) by Bridge width; its average leaves out MATH-500,
# hence other base and RLVR figures than Table 1's.
PAPER_TABLE_1 = {
    "DS-Qwen-1.5B": {"base": 25.93, "rlvr": 29.29, "pmatch": 30.16, "bridge": 31.25},
    "DS-Qwen-7B": {"base": 33.55, "rlvr": 37.75, "pmatch": 36.68, "bridge": 39.40},
    "DS-Llama-8B": {"base": 26.64, "rlvr": 29.74, "pmatch": 30.98, "bridge": 32.47},
}
PAPER_TABLE_3 = {"base": 25.45, "rlvr": 29.35, "widths": {1: 29.39, 4: 31.01, 8: 31.28, 16: 30.85}}


@dataclass(frozen=True)
class PaperEffect:
    """A difference the paper reports, beside RLVR's own gain over the original model in the same table."""

    points: float  # the paper's difference, accuracy points
    rlvr_gain: float  # RLVR only - original model in the same table, points
    source: str  # model and table
    of_models: int = 1  # the smallest of this many models' effects (as a share of RLVR's gain)

    @property
    def share(self) -> float:
        return self.points / self.rlvr_gain


def paper_contrasts() -> dict[str, PaperEffect]:
    """The paper's effect for each paired difference of the report ("bridge-rlvr", "bridge-pmatch", "wW-w1"): for the
    two arms, the smallest share of RLVR's gain over the three models of Table 1; for the widths, Table 3's one model
    (trained at w=4, so w=8 and w=16 are away from its training width)."""
    out = {}
    for other in ("rlvr", "pmatch"):
        effects = [
            PaperEffect(row["bridge"] - row[other], row["rlvr"] - row["base"], f"{model}, Table 1")
            for model, row in PAPER_TABLE_1.items()
        ]
        out[f"bridge-{other}"] = replace(min(effects, key=lambda e: e.share), of_models=len(effects))
    t3 = PAPER_TABLE_3
    for w, acc in t3["widths"].items():
        if w > 1:
            gain = t3["rlvr"] - t3["base"]
            out[f"w{w}-w1"] = PaperEffect(acc - t3["widths"][1], gain, "DS-Qwen-7B trained at w=4, Table 3")
    return out


def paper_effects(diffs: dict, rlvr_gain: dict | None) -> dict:
    """Each paired difference in `diffs` that the paper measured, against the paper's effect scaled to this run.

    The scaling is this project's assumption, not the paper's: Bridge's advantage is taken to grow with what RLVR
    gains on the task, so the paper's difference is scaled by (RLVR's gain here) / (RLVR's gain in the same table of
    the paper). `rlvr_gain` ({"mean", "low", "high"}, accuracy) is this run's paired RLVR - base with its interval,
    and the scaled effect carries that interval: "above" when even its low end lies above the difference's interval
    (an effect of the paper's relative size is excluded by it), "below" when even its high end lies under it, else
    "inside". Returns {key: {"paper_points", "paper_rlvr_gain", "share", "source", "of_models", "scaled": {"mean",
    "low", "high"}, "position", "position_unscaled"}} ("position_unscaled": where the paper's difference in its own
    points lies); empty unless RLVR's gain is shown (its interval above 0)."""
    if not rlvr_gain or not rlvr_gain["low"] > 0:
        return {}
    out = {}
    for key, effect in paper_contrasts().items():
        d = diffs.get(key)
        if d is None:
            continue
        scaled = {k: effect.share * rlvr_gain[k] for k in ("mean", "low", "high")}
        out[key] = {
            "paper_points": round(effect.points, 2),
            "paper_rlvr_gain": round(effect.rlvr_gain, 2),
            "share": round(effect.share, 4),
            "source": effect.source,
            "of_models": effect.of_models,
            "scaled": scaled,
            "position": _position(scaled["low"], scaled["high"], d),
            "position_unscaled": _position(effect.points / 100, effect.points / 100, d),
        }
    return out


def _position(low: float, high: float, d: dict) -> str:
    """Where [low, high] lies against the interval of `d`: "above", "below" or "inside" (overlapping)."""
    return "above" if low > d["high"] else "below" if high < d["low"] else "inside"


def _numbers(entry: dict, k: int) -> dict:
    """The numbers of one (arm, width) cell: accuracy with interval, coverage, G-Pass@k at every tau*k, majority."""
    m = entry["metrics"]
    out = {
        "accuracy": m["accuracy"],
        "coverage@n": m["coverage@n"],
        "sets": set_numbers(entry, k),
        "mg_pass": m.get(f"mg_pass@{k}", {}).get("mean"),
        "gpass": {j: m[f"g_pass@{k}_atleast{j}"]["mean"] for j in range(1, k + 1) if f"g_pass@{k}_atleast{j}" in m},
        "mean_length": entry.get("mean_length"),
        "problems": entry.get("problems"),
        "samples": entry.get("samples"),
    }
    if "majority_vote" in m:
        out["majority_vote"] = m["majority_vote"]
    return out


def set_numbers(entry: dict, k: int) -> dict:
    """A cell's sets of k samples: its Bridge groups' own Pass@w, all-correct and majority (group metrics) where it
    was sampled in groups of k; else, for independent samples, Pass@k and G-Pass@k at tau = 1 over random k-subsets
    (the same quantities: a set of k independent samples is any k of them)."""
    m, size = entry["metrics"], entry.get("group_size", 1)
    if size == k:
        return {"size": k, "pass": m["pass@w"]["mean"], "all_correct": m["group_all_correct"]["mean"],
                "majority": m["group_majority"]["mean"], "of": "Bridge groups"}
    if size == 1 and f"pass@{k}" in m:
        return {"size": k, "pass": m[f"pass@{k}"]["mean"], "all_correct": m[f"g_pass@{k}_tau1"]["mean"],
                "majority": None, "of": "independent samples"}
    return {}


def collect(eval_dirs: dict[tuple[str, int], Path], cfg) -> dict:
    """Per arm (and seed): the main-width numbers; for Bridge also every width."""
    k = cfg.eval.gpass_k
    arms: dict[str, dict] = {}
    for (arm, seed), run_dir in sorted(eval_dirs.items()):
        bridge = arm in ARMS and ARMS[arm].bridge
        width = cfg.eval.sampling.width if bridge else 1
        cell = _numbers(entry(run_dir, width), k)
        cell["width"] = width
        arms.setdefault(arm, {"seeds": {}})["seeds"][seed] = cell
        if bridge:
            arms[arm].setdefault("widths", {})[seed] = {w: _numbers(entry(run_dir, w), k) for w in cfg.eval.widths}
            arms[arm].setdefault("diverged_by_seed", {})[seed] = diverged_from_width_1(run_dir)
    for data in arms.values():
        accs = [c["accuracy"]["mean"] for c in data["seeds"].values()]
        data["accuracy_mean"] = statistics.fmean(accs)
        data["accuracy_sd"] = statistics.stdev(accs) if len(accs) > 1 else 0.0
    return arms


def controls(arms: dict, eval_dirs: dict[tuple[str, int], Path], foreign: dict[int, Path], cfg) -> dict:
    """The causal controls and the paired differences, over every seed of the Bridge arm.

    Returns {"seeds", "interaction" {w: share of samples that differ from w = 1}, "foreign_siblings" (accuracy,
    or None), "diffs" {"bridge-rlvr", "bridge-pmatch", "wW-w1", "foreign-w1": {"mean", "low", "high"}},
    "rlvr_gain" {"mean", "low", "high"} (RLVR only - base, or None), "paper_effects" (see `paper_effects`)}.
    """
    w = cfg.eval.sampling.width
    per_problem = functools.cache(per_problem_accuracy)  # each run and width read once (RLVR's serve two differences)
    seeds = sorted(s for (arm, s) in eval_dirs if arm == "bridge")
    bridge_w = [per_problem(eval_dirs[("bridge", s)], w) for s in seeds]
    bridge_1 = [per_problem(eval_dirs[("bridge", s)], 1) for s in seeds] if 1 in cfg.eval.widths else None
    by_seed = arms["bridge"].get("diverged_by_seed", {})
    interaction = {"1": 0.0} if 1 in cfg.eval.widths else {}
    for width in sorted({x for d in by_seed.values() for x in d}):
        interaction[str(width)] = statistics.fmean(by_seed[s][width] for s in by_seed if width in by_seed[s])
    diffs: dict[str, dict] = {}
    for other in ("rlvr", "pmatch"):
        if all((other, s) in eval_dirs for s in seeds):
            theirs = [per_problem(eval_dirs[(other, s)], 1) for s in seeds]
            diffs[f"bridge-{other}"] = paired_difference(bridge_w, theirs)
    if bridge_1 is not None:
        diffs[f"w{w}-w1"] = paired_difference(bridge_w, bridge_1)
    k = cfg.eval.gpass_k
    if k == w and all(("rlvr", s) in eval_dirs for s in seeds):  # sets of k: Bridge's groups against k of RLVR's samples
        for name, tau in (("all", 1.0), ("any", 0.0)):
            mine = [per_problem_sets(eval_dirs[("bridge", s)], w, k, tau) for s in seeds]
            theirs = [per_problem_sets(eval_dirs[("rlvr", s)], 1, k, tau) for s in seeds]
            diffs[f"sets-{name} bridge-rlvr"] = paired_difference(mine, theirs)
    foreign_acc = None
    if bridge_1 is not None and all(s in foreign and (foreign[s] / "scores.jsonl").exists() for s in seeds):
        strangers = [per_problem(foreign[s], w) for s in seeds]
        foreign_acc = statistics.fmean(statistics.fmean(x) for x in strangers)
        diffs["foreign-w1"] = paired_difference(strangers, bridge_1)
    gain = None  # RLVR - base, paired over RLVR's seeds and problems (one base model for every seed)
    rlvr_seeds = sorted(s for (arm, s) in eval_dirs if arm == "rlvr")
    if ("base", 0) in eval_dirs and rlvr_seeds:
        base = per_problem(eval_dirs[("base", 0)], 1)
        gain = paired_difference([per_problem(eval_dirs[("rlvr", s)], 1) for s in rlvr_seeds], [base] * len(rlvr_seeds))
    return {
        "seeds": len(seeds),
        "interaction": interaction,
        "foreign_siblings": foreign_acc,
        "diffs": diffs,
        "rlvr_gain": gain,
        "paper_effects": paper_effects(diffs, gain),
        "power": power(diffs),
    }


def diverged_from_width_1(run_dir: Path) -> dict[int, float]:
    """Per width w > 1, the share of samples whose tokens differ from the same sample drawn at w = 1.

    Evaluation draws are keyed by problem and sample index, so at w = 1 and w > 1 a sample uses the same random
    numbers: any difference is the effect of its group.
    """
    by: dict[int, dict[tuple, list]] = {}
    for (benchmark, width, index), rec in read_samples(run_dir).items():
        by.setdefault(width, {})[(benchmark, index)] = [s["token_ids"] for s in rec["samples"]]
    if 1 not in by:
        return {}
    out = {}
    for w, problems in by.items():
        if w == 1:
            continue
        pairs = [(a, b) for key, samples in problems.items() for a, b in zip(samples, by[1].get(key, []))]
        out[w] = sum(a != b for a, b in pairs) / max(1, len(pairs))
    return out


def departures(cfg) -> list[str]:
    """Where the miniature departs from the paper's settings (Appendix A), one line each."""
    lines = [
        f"SFT lr {cfg.sft.optim.lr:g} (paper 2e-5) and RL lr {cfg.rl.optim.lr:g} (paper 1e-6): the paper's rates are "
        "for 1.5B-8B models; a model of a few million parameters needs larger steps",
        f"RL: {cfg.rl.steps} rollout steps of {cfg.rl.prompts_per_step} prompts x {cfg.rl.rollout.n} rollouts, "
        f"{cfg.rl.steps_per_rollout} optimiser steps each (paper: 125 of 56 x 8, 8 each: 1000 optimiser steps), "
        f"Bridge width {cfg.rl.rollout.width} while training",
        f"Block heads {cfg.blocks.num_heads} of dim {cfg.blocks.head_dim} (paper: 4 heads of the host's head dim)",
    ]
    if cfg.rl.block_lr is not None:
        lines.append(f"The added blocks learn at lr {cfg.rl.block_lr:g} in RL (paper: one lr for all)")
    return lines


def training_rewards(rl_dirs: dict[tuple[str, int], Path]) -> dict[str, list[float]]:
    """Reward per step of every RL run (its metrics.jsonl), by "<arm title> s<seed>"."""
    curves: dict[str, list[float]] = {}
    for (arm, seed), run_dir in sorted(rl_dirs.items(), key=lambda kv: (kv[0][1], ORDER.index(kv[0][0]))):
        path = run_dir / "metrics.jsonl"
        if path.exists():
            recs = [r for r in read_records(path, repair=False) if r.get("reward") is not None]
            curves[f"{TITLES[arm]} s{seed}"] = [r["reward"] for r in recs]
    return curves


def machine() -> str:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return f"{platform.machine()}, {cpus} CPU cores, Python {platform.python_version()}"


def extra_arms(eval_dirs: dict[tuple[str, int], Path], cfg) -> dict:
    """Each arm beyond the paper's three, paired over the seeds it shares with its reference: "<arm>-bridge" (or
    "<arm>-pmatch" for a P-Match arm) and "<arm>-rlvr" at the main widths, "w{w}-w1" for a Bridge arm (same
    weights), and their power; plus "bridge_tuned-pmatch_tuned" when both tuned arms ran."""
    w, out = cfg.eval.sampling.width, {}
    for arm in {a for a, _ in eval_dirs} - set(PAPER_ARMS) - {"base"}:
        spec = ARMS[arm]
        ref = "bridge" if spec.bridge else "pmatch"
        seeds = sorted(s for (a, s) in eval_dirs if a == arm and (ref, s) in eval_dirs)
        mine = [per_problem_accuracy(eval_dirs[(arm, s)], w if spec.bridge else 1) for s in seeds]
        theirs = [per_problem_accuracy(eval_dirs[(ref, s)], w if ARMS[ref].bridge else 1) for s in seeds]
        diffs = {f"{arm}-{ref}": paired_difference(mine, theirs)}
        if all(("rlvr", s) in eval_dirs for s in seeds):
            rlvr = [per_problem_accuracy(eval_dirs[("rlvr", s)], 1) for s in seeds]
            diffs[f"{arm}-rlvr"] = paired_difference(mine, rlvr)
        if spec.bridge:
            diffs[f"w{w}-w1"] = paired_difference(mine, [per_problem_accuracy(eval_dirs[(arm, s)], 1) for s in seeds])
        out[arm] = {**diffs, "seeds": len(seeds), "power": power(diffs)}
    pair = [s for (a, s) in eval_dirs if a == "bridge_tuned" and ("pmatch_tuned", s) in eval_dirs]
    if pair:
        mine = [per_problem_accuracy(eval_dirs[("bridge_tuned", s)], w) for s in sorted(pair)]
        theirs = [per_problem_accuracy(eval_dirs[("pmatch_tuned", s)], 1) for s in sorted(pair)]
        d = {"bridge_tuned-pmatch_tuned": paired_difference(mine, theirs)}
        out["bridge_tuned"].update(d, power={**out["bridge_tuned"]["power"], **power(d)})
    return out


def demo_results(out: Path, cfg, dirs: RunDirs, found: dict, timings: dict, quick: bool, peaks: list[dict]) -> dict:
    """Every number of the report, written to OUT/results.json and returned (with int keys where JSON has strings).

    `found`: what the controls and searches found (demo/graph.py arm_results: "positive_control", "recipe_control",
    "lr_search"); `peaks`: the matmul peaks measured by each invocation that ran stages, with the stages it ran."""
    arms = collect(dirs.eval, cfg)
    settings = json.loads((out / "demo.json").read_text()) if (out / "demo.json").exists() else {}
    base = out / "base" / "pretrain.json"
    results = {
        "base_params": json.loads(base.read_text())["params"] if base.exists() else None,
        **controls(arms, dirs.eval, dirs.foreign, cfg),  # seeds, interaction, foreign_siblings, diffs, rlvr_gain, ...
        **found,
        "extra_arms": extra_arms(dirs.eval, cfg),
        # the one primary comparison, named before the run; every other is secondary (about 8 to 20 of them,
        # uncorrected for multiplicity: one interval in 20 excludes 0 by chance)
        "primary": cfg.primary,
        "departures": departures(cfg),
        "matmul_peak": peaks[0] if peaks else {},  # measured by the invocation that ran the first stages
        "matmul_peaks": peaks,  # one per invocation that ran stages (more than one: an interrupted, resumed run)
        "arms": {a: arms[a] for a in ORDER if a in arms},
        "bridge_widths": {str(w): c for w, c in arms["bridge"]["widths"][0].items()},
        "gpass": {a: arms[a]["seeds"][0]["gpass"] for a in arms},
        "training_rewards": training_rewards(dirs.rl),
        "trace": json.loads((out / "trace.json").read_text()) if (out / "trace.json").exists() else None,
        "timings_s": timings,
        "quick": quick,
        "machine": machine(),
        "settings": settings,
        "precision": {"bf16": cfg.bf16, "why": settings.get("precision")},  # why the stages ran in this precision
    }
    write_json(out / "results.json", json.loads(json.dumps(results, default=str)))
    return results

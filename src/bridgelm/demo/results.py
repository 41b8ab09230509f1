"""The demo's report: DIR/report.md, DIR/results.json and the figures, from the evaluation runs' metrics.json.

Rows follow the paper's Table 1 (Base, RLVR only, P-Match, Bridge); the set figures follow Figure 4 (G-Pass@8
against tau*k) and Table 3 (Bridge at every width); training curves come from each RL run's metrics.jsonl.
The controls say whether Bridge uses its siblings: (a) interaction, the share of samples that change when the
same draws are made at width w instead of 1; (b) foreign siblings, accuracy when a group holds samples of
different problems; (c) P-Match, the parameter control. Differences between arms are paired (same problems,
same seeds) with 95% bootstrap intervals over seeds and problems (`metrics.paired_difference`). The claim list
is written from those intervals: it says which of the paper's claims the miniature reproduces and which not, and
whether each interval excludes the paper's effect scaled to this run (`paper_effects`).
"""

from __future__ import annotations

import functools
import json
import platform
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from bridgelm.demo.base import task_name
from bridgelm.eval_folder import read_samples
from bridgelm.figures import new_figure, plot_gpass, plot_width, save_png
from bridgelm.jsonl import read_records, write_atomic, write_json
from bridgelm.metrics import paired_difference
from bridgelm.tables import markdown_table, pct

ARMS = ("base", "rlvr", "pmatch", "bridge", "bridge_cold", "bridge_attn")
TITLES = {
    "base": "Base",
    "rlvr": "RLVR only",
    "pmatch": "P-Match",
    "bridge": "Bridge",
    "bridge_cold": "Bridge, cold start",
    "bridge_attn": "Bridge after attention",
}


@dataclass
class RunDirs:
    """The run folders the report reads, as the pipeline named them (demo.pipeline.Context)."""

    eval: dict[tuple[str, int], Path]  # (arm, seed) -> evaluation run: metrics.json, scores.jsonl, samples
    rl: dict[tuple[str, int], Path]  # (arm, seed) -> RL run: metrics.jsonl
    foreign: dict[int, Path]  # seed -> control (b)'s evaluation run (empty without the control)


INTERACTION_TARGET = 0.2  # design target: share of samples at w = 8 that differ from w = 1
MIN_GAIN = 0.005  # accuracy gain (half a point) below which a width is not said to beat w = 1


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


def _entry(run_dir: Path, width: int) -> dict:
    metrics = json.loads((run_dir / "metrics.json").read_text())
    bench = next(iter(metrics["benchmarks"].values()))
    return bench[str(width)]


def _numbers(entry: dict, k: int) -> dict:
    """The numbers of one (arm, width) cell: accuracy with interval, coverage, G-Pass@k at every tau*k, majority."""
    m = entry["metrics"]
    out = {
        "accuracy": m["accuracy"],
        "coverage": m["coverage"],
        "mg_pass": m.get(f"mg_pass@{k}", {}).get("mean"),
        "gpass": {j: m[f"g_pass@{k}_atleast{j}"]["mean"] for j in range(1, k + 1) if f"g_pass@{k}_atleast{j}" in m},
        "mean_length": entry.get("mean_length"),
        "problems": entry.get("problems"),
        "samples": entry.get("samples"),
    }
    if "majority_vote" in m:
        out["majority_vote"] = m["majority_vote"]
    return out


def collect(eval_dirs: dict[tuple[str, int], Path], cfg) -> dict:
    """Per arm (and seed): the main-width numbers; for Bridge also every width."""
    k = cfg.gpass_k
    arms: dict[str, dict] = {}
    for (arm, seed), run_dir in sorted(eval_dirs.items()):
        width = cfg.eval_width if arm.startswith("bridge") else 1
        cell = _numbers(_entry(run_dir, width), k)
        cell["width"] = width
        arms.setdefault(arm, {"seeds": {}})["seeds"][seed] = cell
        if arm.startswith("bridge"):
            arms[arm].setdefault("widths", {})[seed] = {w: _numbers(_entry(run_dir, w), k) for w in cfg.widths}
            arms[arm].setdefault("diverged_by_seed", {})[seed] = diverged_from_width_1(run_dir)
    for data in arms.values():
        accs = [c["accuracy"]["mean"] for c in data["seeds"].values()]
        data["accuracy_mean"] = statistics.fmean(accs)
        data["accuracy_sd"] = statistics.stdev(accs) if len(accs) > 1 else 0.0
    return arms


def _pct(x) -> str:
    """The demo's percentages: one decimal."""
    return pct(x, 1)


def table_1(arms: dict, cfg) -> str:
    """The Table 1 layout: a row per arm, accuracy with its 95% interval, set metrics, improvement over Base."""
    k = cfg.gpass_k
    seeds = max(len(a["seeds"]) for a in arms.values())
    head = [
        "Method",
        f"Accuracy (%){' mean ± sd over seeds' if seeds > 1 else ''}",
        f"95% interval{' (seed 0)' if seeds > 1 else ''}",
        f"Coverage@{cfg.eval_n}",
        f"G-Pass@{k} τ=0.5",
        f"G-Pass@{k} τ=1",
        "Majority vote",
        "Avg",
        "↑Δ",
    ]
    rows = []
    base = arms["base"]["accuracy_mean"] if "base" in arms else None
    for arm in ARMS:
        if arm not in arms:
            continue
        data = arms[arm]
        first = data["seeds"][min(data["seeds"])]
        title = TITLES[arm] + (f" (w={first['width']})" if arm.startswith("bridge") else "")
        acc = _pct(data["accuracy_mean"])
        if seeds > 1 and len(data["seeds"]) > 1:
            acc += f" ± {100 * data['accuracy_sd']:.1f}"
        interval = f"[{_pct(first['accuracy']['low'])}, {_pct(first['accuracy']['high'])}]"
        half = first["gpass"].get(k // 2)
        full = first["gpass"].get(k)
        maj = first.get("majority_vote", {}).get("mean")
        delta = "–" if base is None else f"{100 * (data['accuracy_mean'] - base):+.1f}"
        cells = [_pct(first["coverage"]["mean"]), _pct(half), _pct(full), _pct(maj), acc.split(" ")[0], delta]
        rows.append([title, acc, interval, *cells])
    return markdown_table(head, rows)


def width_table(arms: dict, cfg) -> str:
    """Bridge at every width: accuracy averaged over seeds, the rest of seed 0, and the interaction."""
    k = cfg.gpass_k
    by_seed = arms["bridge"]["widths"]
    first = by_seed[min(by_seed)]  # seed 0: {width: cell}
    diverged = arms["bridge"].get("diverged_by_seed", {})
    head = [
        "Bridge width w",
        f"Accuracy (%), mean over {len(by_seed)} seed(s)",
        "95% interval (seed 0)",
        f"Coverage@{cfg.eval_n}",
        f"G-Pass@{k} τ=1",
        "Samples that differ from w=1 (%)",
    ]
    rows = []
    for w in sorted(first):
        c = first[w]
        mean = statistics.fmean(by_seed[s][w]["accuracy"]["mean"] for s in by_seed)
        changed = [d[w] for d in diverged.values() if w in d]
        rows.append(
            [
                f"{w}{' (independent)' if w == 1 else ''}",
                _pct(mean),
                f"[{_pct(c['accuracy']['low'])}, {_pct(c['accuracy']['high'])}]",
                _pct(c["coverage"]["mean"]),
                _pct(c["gpass"].get(k)),
                _pct(statistics.fmean(changed)) if changed else "0.0",
            ]
        )
    return markdown_table(head, rows)


def training_curves(out: Path, rl_dirs: dict[tuple[str, int], Path]) -> tuple[dict, Path | None]:
    """Reward per step of every RL run (metrics.jsonl), and a PNG of them (OUT/training.png)."""
    curves: dict[str, list[float]] = {}
    for (arm, seed), run_dir in sorted(rl_dirs.items(), key=lambda kv: (kv[0][1], ARMS.index(kv[0][0]))):
        path = run_dir / "metrics.jsonl"
        if path.exists():
            recs = [r for r in read_records(path, repair=False) if r.get("reward") is not None]
            curves[f"{TITLES[arm]} s{seed}"] = [r["reward"] for r in recs]
    if not curves:
        return curves, None
    fig, (ax,) = new_figure(1, width=6.5, height=3.6)
    for name, ys in curves.items():
        window = max(1, len(ys) // 10)
        smooth = [statistics.fmean(ys[max(0, i - window + 1) : i + 1]) for i in range(len(ys))]
        ax.plot(range(1, len(ys) + 1), [100 * y for y in smooth], label=name)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean reward of rollouts (%), smoothed")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return curves, save_png(fig, out / "training.png")


def per_problem_accuracy(run_dir: Path, width: int) -> list[float]:
    """Accuracy (c / n) of every problem sampled at `width`, in problem order, from RUN_DIR/scores.jsonl."""
    scores = [r for r in read_records(run_dir / "scores.jsonl", repair=False) if int(r["width"]) == width]
    scores.sort(key=lambda r: (r["benchmark"], int(r["index"])))
    return [r["c"] / r["n"] for r in scores]


def controls(arms: dict, eval_dirs: dict[tuple[str, int], Path], foreign: dict[int, Path], cfg) -> dict:
    """The causal controls and the paired differences, over every seed of the Bridge arm.

    Returns {"seeds", "interaction" {w: share of samples that differ from w = 1}, "foreign_siblings" (accuracy,
    or None), "diffs" {"bridge-rlvr", "bridge-pmatch", "wW-w1", "foreign-w1": {"mean", "low", "high"}},
    "rlvr_gain" {"mean", "low", "high"} (RLVR only - base, or None), "paper_effects" (see `paper_effects`)}.
    """
    w = cfg.eval_width
    accuracy = functools.cache(per_problem_accuracy)  # each run and width read once (RLVR's serve two differences)
    seeds = sorted(s for (arm, s) in eval_dirs if arm == "bridge")
    bridge_w = [accuracy(eval_dirs[("bridge", s)], w) for s in seeds]
    bridge_1 = [accuracy(eval_dirs[("bridge", s)], 1) for s in seeds] if 1 in cfg.widths else None
    by_seed = arms["bridge"].get("diverged_by_seed", {})
    interaction = {"1": 0.0} if 1 in cfg.widths else {}
    for width in sorted({x for d in by_seed.values() for x in d}):
        interaction[str(width)] = statistics.fmean(by_seed[s][width] for s in by_seed if width in by_seed[s])
    diffs: dict[str, dict] = {}
    for other in ("rlvr", "pmatch"):
        if all((other, s) in eval_dirs for s in seeds):
            theirs = [accuracy(eval_dirs[(other, s)], 1) for s in seeds]
            diffs[f"bridge-{other}"] = paired_difference(bridge_w, theirs)
    if bridge_1 is not None:
        diffs[f"w{w}-w1"] = paired_difference(bridge_w, bridge_1)
    foreign_acc = None
    if bridge_1 is not None and all(s in foreign and (foreign[s] / "scores.jsonl").exists() for s in seeds):
        strangers = [accuracy(foreign[s], w) for s in seeds]
        foreign_acc = statistics.fmean(statistics.fmean(x) for x in strangers)
        diffs["foreign-w1"] = paired_difference(strangers, bridge_1)
    gain = None  # RLVR - base, paired over RLVR's seeds and problems (one base model for every seed)
    rlvr_seeds = sorted(s for (arm, s) in eval_dirs if arm == "rlvr")
    if ("base", 0) in eval_dirs and rlvr_seeds:
        base = accuracy(eval_dirs[("base", 0)], 1)
        gain = paired_difference([accuracy(eval_dirs[("rlvr", s)], 1) for s in rlvr_seeds], [base] * len(rlvr_seeds))
    return {
        "seeds": len(seeds),
        "interaction": interaction,
        "foreign_siblings": foreign_acc,
        "diffs": diffs,
        "rlvr_gain": gain,
        "paper_effects": paper_effects(diffs, gain),
    }


def _diff_text(d: dict) -> str:
    return f"{100 * d['mean']:+.1f} points [{100 * d['low']:+.1f}, {100 * d['high']:+.1f}]"


def controls_table(ctl: dict, cfg) -> str:
    """Paired differences (same problems, same seeds), and the controls."""
    w = cfg.eval_width
    names = {
        "bridge-rlvr": f"Bridge (w={w}) − RLVR only",
        "bridge-pmatch": f"Bridge (w={w}) − P-Match (control c: same parameters, no cross-sample attention)",
        f"w{w}-w1": f"Bridge w={w} − Bridge w=1 (same weights)",
        "foreign-w1": f"Bridge w={w} with foreign siblings (control b) − Bridge w=1",
    }
    runs = "its own SFT and RL runs" if cfg.sft_per_seed else "its own RL run, one shared SFT run"
    head = [f"Paired difference of accuracy, over {ctl['seeds']} seed(s) (each: {runs})", "Mean and 95% interval"]
    lines = [markdown_table(head, [[names[k], _diff_text(d)] for k, d in ctl["diffs"].items() if k in names])]
    if ctl["interaction"]:
        shares = [f"{100 * v:.1f}" for v in ctl["interaction"].values()]
        lines += [
            "",
            markdown_table(
                ["Width w", *ctl["interaction"]], [["Samples that differ from w=1 (control a), %", *shares]]
            ),
        ]
    return "\n".join(lines)


def verdict(arms: dict, ctl: dict, cfg) -> str:
    """Which of the paper's claims the miniature reproduces, read off the paired intervals."""
    k = cfg.gpass_k
    w = cfg.eval_width
    first = {arm: d["seeds"][min(d["seeds"])] for arm, d in arms.items()}
    acc = {arm: d["accuracy_mean"] for arm, d in arms.items()}
    diffs = ctl["diffs"]
    lines = []

    def claim(text: str, holds: bool, detail: str):
        lines.append(f"- {text}: **{'reproduced' if holds else 'not reproduced'}** ({detail}).")

    def by_interval(text: str, key: str, sign: int = 1):
        d = diffs.get(key)
        if d is None:
            return
        low, high = (d["low"], d["high"]) if sign > 0 else (-d["high"], -d["low"])
        word = "reproduced" if low > 0 else "reversed" if high < 0 else "not shown: the interval holds 0"
        line = f"- {text}: **{word}** ({_diff_text(d)}, paired over {ctl['seeds']} seed(s) and problems)"
        effect = ctl["paper_effects"].get(key)
        if effect is not None:
            where = {
                "above": "above the interval, which excludes an effect of the paper's relative size",
                "inside": "inside the interval: neither shown nor excluded",
                "below": "below the interval: the effect here is larger",
            }[effect["position"]]
            sc = effect["scaled"]
            n = effect["of_models"]
            which = f"smallest effect over its {n} models" if n > 1 else "effect"
            line += (
                f". The paper's {which}, {effect['paper_points']:+.2f} points on an RLVR gain of "
                f"{effect['paper_rlvr_gain']:+.2f} points ({effect['source']}), scaled to this run's RLVR gain: "
                f"{100 * sc['mean']:+.1f} points [{100 * sc['low']:+.1f}, {100 * sc['high']:+.1f}], {where}"
            )
            if effect["position_unscaled"] != effect["position"]:
                line += f" (unscaled, it is {effect['position_unscaled']} the interval)"
        lines.append(line + ".")

    by_interval("Bridge improves accuracy after RLVR more than RLVR alone", "bridge-rlvr")
    by_interval("Bridge beats P-Match, the parameter-matched control", "bridge-pmatch")
    by_interval(f"Bridge at w={w} beats independent generation (w=1) with the same weights", f"w{w}-w1")
    by_interval("Bridge uses what its siblings know: with foreign siblings it falls below w=1", "foreign-w1", -1)
    share = ctl["interaction"].get(str(w))
    if share is not None:
        claim(
            f"The samples interact: at least {100 * INTERACTION_TARGET:.0f}% of them change at w={w} (design target)",
            share >= INTERACTION_TARGET,
            f"{100 * share:.1f}% differ from their w=1 counterpart with the same random draws",
        )
    claim("RLVR improves on the base model", acc["rlvr"] > acc["base"], f"{_pct(acc['base'])}% -> {_pct(acc['rlvr'])}%")
    paper = [a for a in ("base", "rlvr", "pmatch", "bridge") if a in first]
    full = {a: first[a]["gpass"].get(k) or 0.0 for a in paper}
    claim(
        f"Bridge answers more consistently (G-Pass@{k} at τ=1, all {k} correct; seed 0)",
        full["bridge"] > max(full["rlvr"], full["pmatch"]),  # a tie is not "more"
        ", ".join(f"{TITLES[a]} {_pct(full[a])}%" for a in paper),
    )
    cov = {a: first[a]["coverage"]["mean"] for a in paper}
    claim(
        "Bridge keeps or raises coverage (seed 0)",
        cov["bridge"] >= max(cov["rlvr"], cov["pmatch"]) - 0.01,
        ", ".join(f"{TITLES[a]} {_pct(cov[a])}%" for a in paper),
    )
    return "\n".join(lines)


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


def trace_section(trace: dict | None) -> list[str]:
    """The interaction over the course of RL (the demo's trace stage), as report lines; none without a trace."""
    if not trace:
        return []
    w = trace["width"]
    rows = [
        [str(p["step"]), _pct(p["w1"]), _pct(p[f"w{w}"]), _pct(p[f"w{w}"] - p["w1"]), _pct(p["interaction"])]
        for p in trace["points"]
    ]
    return [
        f"## The interaction over the course of RL (Bridge, seed {trace['seed']}; step 0: the SFT blocks)",
        "",
        markdown_table(["RL step", "w=1", f"w={w}", f"w={w} - w=1", f"samples that differ at w={w}"], rows),
        "",
    ]


def departures(cfg) -> list[str]:
    """Where the miniature departs from the paper's settings (Appendix A), one line each."""
    lines = [
        f"SFT lr {cfg.sft_lr:g} (paper 2e-5) and RL lr {cfg.rl_lr:g} (paper 1e-6): the paper's rates are for "
        "1.5B-8B models; a 2M model needs larger steps",
        f"RL: {cfg.rl_steps} steps of {cfg.rl_prompts} prompts x {cfg.rl_rollouts} rollouts (paper: 1000 steps of "
        f"56 x 8), Bridge width {cfg.rl_width} while training",
        f"Block heads {cfg.block_heads} of dim {cfg.block_head_dim} (paper: 4 heads of the host's head dim)",
    ]
    if cfg.rl_block_lr is not None:
        lines.append(f"The added blocks learn at lr {cfg.rl_block_lr:g} in RL (paper: one lr for all)")
    return lines


def write_demo_report(out: Path, cfg, dirs: RunDirs, timings: dict, quick: bool, peaks: list[dict]) -> Path:
    """OUT/report.md, OUT/results.json and the figures from the runs in `dirs`; returns the report's path.

    `peaks`: the matmul peaks measured by each invocation that ran stages, with the stages it ran."""
    arms = collect(dirs.eval, cfg)
    ctl = controls(arms, dirs.eval, dirs.foreign, cfg)
    k = cfg.gpass_k
    gpass_curves = {
        TITLES[a] + (f" (w={arms[a]['seeds'][0]['width']})" if a == "bridge" else ""): arms[a]["seeds"][0]["gpass"]
        for a in ARMS
        if a in arms
    }
    plot_gpass(gpass_curves, out / "gpass.png", k)
    widths = arms["bridge"]["widths"][0]
    width_curve = {
        "Bridge": {
            w: {
                "accuracy": c["accuracy"]["mean"],
                "coverage": c["coverage"]["mean"],
                "g_pass_tau0.5": c["gpass"].get(k // 2, 0.0),
                "g_pass_tau1": c["gpass"].get(k, 0.0),
            }
            for w, c in widths.items()
        }
    }
    plot_width(width_curve, out / "widths.png")
    curves, training_png = training_curves(out, dirs.rl)
    machine = f"{platform.machine()}, {_cpus()} CPU cores, Python {platform.python_version()}"
    trace = json.loads((out / "trace.json").read_text()) if (out / "trace.json").exists() else None
    settings = json.loads((out / "demo.json").read_text()) if (out / "demo.json").exists() else {}
    precision = settings.get("precision")  # why the stages ran in cfg.bf16's precision (run_demo's choice)
    results = {
        "seeds": ctl["seeds"],
        "interaction": ctl["interaction"],
        "foreign_siblings": ctl["foreign_siblings"],
        "diffs": ctl["diffs"],
        "rlvr_gain": ctl["rlvr_gain"],
        "paper_effects": ctl["paper_effects"],
        "departures": departures(cfg),
        "matmul_peak": peaks[0] if peaks else {},  # measured by the invocation that ran the first stages
        "matmul_peaks": peaks,  # one per invocation that ran stages (more than one: an interrupted, resumed run)
        "arms": {a: arms[a] for a in ARMS if a in arms},
        "bridge_widths": {str(w): c for w, c in widths.items()},
        "gpass": {a: arms[a]["seeds"][0]["gpass"] for a in arms},
        "training_rewards": curves,
        "trace": trace,
        "timings_s": timings,
        "quick": quick,
        "machine": machine,
        "settings": settings,
        "precision": {"bf16": cfg.bf16, "why": precision},
    }
    write_json(out / "results.json", json.loads(json.dumps(results, default=str)))
    figures = ["gpass.png"] + (["widths.png"] if (out / "widths.png").exists() else [])
    figures += ["training.png"] if training_png else []
    text = [
        "# Bridge in miniature" + (" (--quick: toy sizes, the numbers mean nothing)" if quick else ""),
        "",
        f"Task: {task_text(cfg)}, {cfg.eval_problems} held-out test problems, {cfg.eval_n} samples each at "
        f"temperature {cfg.temperature}, top-p {cfg.top_p}; RL over {ctl['seeds']} seed(s). Machine: {machine}; "
        f"matmul peak measured when the stages ran: {_peaks_text(peaks)}. {_precision_text(cfg, precision)} "
        f"Stage times (s): {json.dumps(timings)}.",
        "",
        "## Accuracy and set metrics (layout of the paper's Table 1)",
        "",
        table_1(arms, cfg),
        "",
        f"## G-Pass@{k}_τ against τ·k (paper Figure 4)",
        "",
        markdown_table(
            ["Method", *(str(j) for j in range(1, k + 1))],
            [[name, *(_pct(c.get(j)) for j in range(1, k + 1))] for name, c in gpass_curves.items()],
        ),
        "",
        "## Bridge at every width, same weights (paper Table 3)",
        "",
        width_table(arms, cfg),
        "",
        "## Does Bridge use its siblings? Controls and paired differences",
        "",
        controls_table(ctl, cfg),
        "",
        *trace_section(trace),
        "## What the miniature reproduces",
        "",
        verdict(arms, ctl, cfg),
        "",
        "The miniature is a 1-2M parameter model on a synthetic task, trained for minutes: it tests the mechanics",
        "of the method and its direction, not the paper's numbers. Differences are paired (same test problems,",
        "same seeds, same random draws) with 95% bootstrap intervals that resample seeds and problems. An interval",
        "that holds 0 does not show an effect. To say what size of effect it does exclude, each difference the paper",
        "measured is set against the paper's smallest effect scaled by RLVR's gain here over its gain in the paper",
        "(this project's assumption: Bridge's advantage grows with what RLVR gains on the task; on DS-Qwen-7B it is",
        "the paper's headline 39%). Unscaled, the paper's differences are 1-2 points.",
        "",
        "## Departures from the paper's settings",
        "",
        *[f"- {line}" for line in departures(cfg)],
        "",
        "## Figures",
        "",
        *[f"![{f}]({f})" for f in figures],
        "",
    ]
    return write_atomic(out / "report.md", "\n".join(text))


def task_text(cfg) -> str:
    spec = cfg.base.task
    if task_name(spec) == "anysum":
        return (
            f"sums of {spec.min_operands}-{spec.max_operands} numbers in {spec.min_value}..{spec.max_value}, "
            "added in any order (anysum)"
        )
    return (
        f"step-by-step addition and subtraction ({spec.min_operands}-{spec.max_operands} numbers in "
        f"1..{spec.max_value}; arith)"
    )


def _peaks_text(peaks: list[dict]) -> str:
    if not peaks:
        return "not recorded"
    parts = []
    for p in peaks:
        text = f"fp32 {p['fp32_tflops']} TFLOP/s, bf16 {p['bf16_tflops']} TFLOP/s"
        if "kernels" not in p:  # measured before the peak took the fastest kernel
            text += " (ATen's matmul alone)"
        if len(peaks) > 1:  # name the stages each invocation ran
            text += f" (stages {', '.join(p.get('stages', []))})"
        parts.append(text + _wall_text(p))
    return "; ".join(parts)


def _precision_text(cfg, why: str | None) -> str:
    why = f" ({why})" if why else ""
    if cfg.bf16:
        return f"Forwards in bf16{why}: autocast in training (fp32 weights and optimiser), bf16 weights in sampling."
    return (
        f"Forwards in fp32{why}. A bf16 run gives other numbers: its rounding differs from the first step on, so it "
        "trains another base model and other runs."
    )


def _wall_text(peak: dict) -> str:
    """The wall time of the invocation that measured `peak`, and its worker processes (stages ran side by side, so
    the stage times add up to more than the wall time)."""
    if "wall_s" not in peak:
        return ""
    return f", {peak.get('workers', 1)} worker process(es), {peak['wall_s']:.0f} s wall time from start to last stage"


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

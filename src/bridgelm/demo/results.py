"""The demo's report: DIR/report.md, DIR/results.json and the figures, from the evaluation runs' metrics.json.

Rows follow the paper's Table 1 (Base, RLVR only, P-Match, Bridge); the set figures follow Figure 4 (G-Pass@8
against tau*k) and Table 3 (Bridge at every width); training curves come from each RL run's metrics.jsonl.
The closing paragraph is written from the numbers: it says which of the paper's claims the miniature
reproduces, within the 95% intervals, and which it does not.
"""

from __future__ import annotations

import io
import json
import platform
import statistics
from pathlib import Path

from bridgelm.jsonl import read_records, write_atomic, write_json
from bridgelm.report import plot_gpass, plot_width

ARMS = ("base", "rlvr", "pmatch", "bridge")
TITLES = {"base": "Base", "rlvr": "RLVR only", "pmatch": "P-Match", "bridge": "Bridge"}
MIN_GAIN = 0.005  # accuracy gain (half a point) below which a width is not said to beat w = 1


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
        width = cfg.eval_width if arm == "bridge" else 1
        cell = _numbers(_entry(run_dir, width), k)
        cell["width"] = width
        arms.setdefault(arm, {"seeds": {}})["seeds"][seed] = cell
        if arm == "bridge":
            arms[arm].setdefault("widths", {})[seed] = {w: _numbers(_entry(run_dir, w), k) for w in cfg.widths}
            if seed == 0:
                arms[arm]["diverged"] = diverged_from_width_1(run_dir)
    for data in arms.values():
        accs = [c["accuracy"]["mean"] for c in data["seeds"].values()]
        data["accuracy_mean"] = statistics.fmean(accs)
        data["accuracy_sd"] = statistics.stdev(accs) if len(accs) > 1 else 0.0
    return arms


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


def table_1(arms: dict, cfg) -> str:
    """The Table 1 layout: a row per arm, accuracy with its 95% interval, set metrics, improvement over Base."""
    k = cfg.gpass_k
    seeds = max(len(a["seeds"]) for a in arms.values())
    head = (
        f"| Method | Accuracy (%){' mean ± sd over seeds' if seeds > 1 else ''} | 95% interval"
        f"{' (seed 0)' if seeds > 1 else ''} | Coverage@{cfg.eval_n} | G-Pass@{k} τ=0.5 | G-Pass@{k} τ=1 "
        f"| Majority vote | Avg | ↑Δ |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    base = arms["base"]["accuracy_mean"] if "base" in arms else None
    for arm in ARMS:
        if arm not in arms:
            continue
        data = arms[arm]
        first = data["seeds"][min(data["seeds"])]
        title = TITLES[arm] + (f" (w={first['width']})" if arm == "bridge" else "")
        acc = _pct(data["accuracy_mean"])
        if seeds > 1 and len(data["seeds"]) > 1:
            acc += f" ± {100 * data['accuracy_sd']:.1f}"
        interval = f"[{_pct(first['accuracy']['low'])}, {_pct(first['accuracy']['high'])}]"
        half = first["gpass"].get(k // 2)
        full = first["gpass"].get(k)
        maj = first.get("majority_vote", {}).get("mean")
        delta = "–" if base is None else f"{100 * (data['accuracy_mean'] - base):+.1f}"
        lines.append(
            f"| {title} | {acc} | {interval} | {_pct(first['coverage']['mean'])} | {_pct(half)} | {_pct(full)} "
            f"| {_pct(maj)} | {acc.split(' ')[0]} | {delta} |"
        )
    return "\n".join(lines)


def width_table(arms: dict, cfg) -> str:
    k = cfg.gpass_k
    rows = arms["bridge"]["widths"][min(arms["bridge"]["widths"])]
    lines = [
        f"| Bridge width w | Accuracy (%) | 95% interval | Coverage@{cfg.eval_n} | G-Pass@{k} τ=1 |",
        "|---|---|---|---|---|",
    ]
    for w in sorted(rows):
        c = rows[w]
        lines.append(
            f"| {w}{' (independent)' if w == 1 else ''} | {_pct(c['accuracy']['mean'])} | "
            f"[{_pct(c['accuracy']['low'])}, {_pct(c['accuracy']['high'])}] | {_pct(c['coverage']['mean'])} "
            f"| {_pct(c['gpass'].get(k))} |"
        )
    return "\n".join(lines)


def training_curves(out: Path, cfg) -> tuple[dict, Path | None]:
    """Reward per step of every RL run (metrics.jsonl), and a PNG of them."""
    curves: dict[str, list[float]] = {}
    for seed in range(cfg.seeds):
        for arm in ("rlvr", "pmatch", "bridge"):
            path = out / f"rl_{arm}_s{seed}" / "metrics.jsonl"
            if path.exists():
                recs = [r for r in read_records(path, repair=False) if r.get("reward") is not None]
                curves[f"{TITLES[arm]} s{seed}"] = [r["reward"] for r in recs]
    if not curves:
        return curves, None
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5, 3.6), layout="constrained")
    ax = fig.subplots()
    for name, ys in curves.items():
        window = max(1, len(ys) // 10)
        smooth = [statistics.fmean(ys[max(0, i - window + 1) : i + 1]) for i in range(len(ys))]
        ax.plot(range(1, len(ys) + 1), [100 * y for y in smooth], label=name)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean reward of rollouts (%), smoothed")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    return curves, write_atomic(out / "training.png", buf.getvalue())


def _overlap(a: dict, b: dict) -> bool:
    return not (a["low"] > b["high"] or b["low"] > a["high"])


def verdict(arms: dict, cfg) -> str:
    """Which of the paper's claims the miniature reproduces, read off the numbers."""
    k = cfg.gpass_k
    first = {arm: d["seeds"][min(d["seeds"])] for arm, d in arms.items()}
    acc = {arm: d["accuracy_mean"] for arm, d in arms.items()}
    lines = []

    def claim(text: str, holds: bool, detail: str):
        lines.append(f"- {text}: **{'reproduced' if holds else 'not reproduced'}** ({detail}).")

    best_other = max(("rlvr", "pmatch"), key=lambda a: acc[a])
    gap = acc["bridge"] - acc[best_other]
    sig = not _overlap(first["bridge"]["accuracy"], first[best_other]["accuracy"])
    claim(
        "Bridge improves accuracy after RLVR more than RLVR alone and P-Match",
        gap > 0,
        f"Bridge {_pct(acc['bridge'])}% vs {TITLES[best_other]} {_pct(acc[best_other])}%, "
        f"{'outside' if sig else 'within'} the 95% intervals",
    )
    claim(
        "RLVR improves on the base model",
        acc["rlvr"] > acc["base"],
        f"{_pct(acc['base'])}% -> {_pct(acc['rlvr'])}%",
    )
    full = {a: first[a]["gpass"].get(k) or 0.0 for a in first}
    claim(
        f"Bridge answers more consistently (G-Pass@{k} at τ=1, all {k} correct)",
        full["bridge"] >= max(full["rlvr"], full["pmatch"]),
        ", ".join(f"{TITLES[a]} {_pct(full[a])}%" for a in ARMS if a in full),
    )
    cov = {a: first[a]["coverage"]["mean"] for a in first}
    claim(
        "Bridge keeps or raises coverage",
        cov["bridge"] >= max(cov["rlvr"], cov["pmatch"]) - 0.01,
        ", ".join(f"{TITLES[a]} {_pct(cov[a])}%" for a in ARMS if a in cov),
    )
    widths = arms["bridge"]["widths"][min(arms["bridge"]["widths"])]
    w1 = widths[1]["accuracy"]["mean"] if 1 in widths else None
    wider = [w for w in widths if w > 1]
    better = [w for w in wider if w1 is not None and widths[w]["accuracy"]["mean"] >= w1 + MIN_GAIN]
    claim(
        f"every width w > 1 beats independent generation (w = 1) with the same Bridge model, by {100 * MIN_GAIN:.1f}"
        " point or more",
        w1 is not None and len(better) == len(wider),
        f"w=1 {_pct(w1)}%; " + ", ".join(f"w={w} {_pct(widths[w]['accuracy']['mean'])}%" for w in wider),
    )
    diverged = arms["bridge"].get("diverged", {})
    if diverged:
        lines.append(
            "- How much the samples interact: with the same random draws, "
            + ", ".join(f"{100 * f:.1f}% of samples at w={w}" for w, f in sorted(diverged.items()))
            + " differ from their w=1 counterpart in at least one token."
        )
    return "\n".join(lines)


def diverged_from_width_1(run_dir: Path) -> dict[int, float]:
    """Per width w > 1, the share of samples whose tokens differ from the same sample drawn at w = 1.

    Evaluation draws are keyed by problem and sample index, so at w = 1 and w > 1 a sample uses the same random
    numbers: any difference is the effect of its group.
    """
    by: dict[int, dict[tuple, list]] = {}
    for path in sorted(run_dir.glob("samples*.jsonl")):
        for rec in read_records(path, repair=False):
            by.setdefault(rec["width"], {})[(rec["benchmark"], rec["index"])] = [s["token_ids"] for s in rec["samples"]]
    if 1 not in by:
        return {}
    out = {}
    for w, problems in by.items():
        if w == 1:
            continue
        pairs = [(a, b) for key, samples in problems.items() for a, b in zip(samples, by[1].get(key, []))]
        out[w] = sum(a != b for a, b in pairs) / max(1, len(pairs))
    return out


def write_demo_report(out: Path, cfg, eval_dirs: dict, timings: dict, quick: bool) -> Path:
    arms = collect(eval_dirs, cfg)
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
    curves, training_png = training_curves(out, cfg)
    machine = f"{platform.machine()}, {_cpus()} CPU cores, Python {platform.python_version()}"
    results = {
        "arms": {a: arms[a] for a in ARMS if a in arms},
        "bridge_widths": {str(w): c for w, c in widths.items()},
        "gpass": {a: arms[a]["seeds"][0]["gpass"] for a in arms},
        "training_rewards": curves,
        "timings_s": timings,
        "quick": quick,
        "machine": machine,
        "settings": json.loads((out / "demo.json").read_text()) if (out / "demo.json").exists() else {},
    }
    write_json(out / "results.json", json.loads(json.dumps(results, default=str)))
    figures = ["gpass.png"] + (["widths.png"] if (out / "widths.png").exists() else [])
    figures += ["training.png"] if training_png else []
    text = [
        "# Bridge in miniature" + (" (--quick: toy sizes, the numbers mean nothing)" if quick else ""),
        "",
        f"Task: step-by-step addition and subtraction ({cfg.base.task.min_operands}-{cfg.base.task.max_operands} "
        f"numbers in 1..{cfg.base.task.max_value}), {cfg.eval_problems} held-out test "
        f"problems, {cfg.eval_n} samples each at temperature {cfg.temperature}, top-p {cfg.top_p}. "
        f"Machine: {machine}. Stage times (s): {json.dumps(timings)}.",
        "",
        "## Accuracy and set metrics (layout of the paper's Table 1)",
        "",
        table_1(arms, cfg),
        "",
        f"## G-Pass@{k}_τ against τ·k (paper Figure 4)",
        "",
        "| Method | " + " | ".join(str(j) for j in range(1, k + 1)) + " |",
        "|---|" + "---|" * k,
        *[
            f"| {name} | " + " | ".join(_pct(c.get(j)) for j in range(1, k + 1)) + " |"
            for name, c in gpass_curves.items()
        ],
        "",
        "## Bridge at every width, same weights (paper Table 3)",
        "",
        width_table(arms, cfg),
        "",
        "## What the miniature reproduces",
        "",
        verdict(arms, cfg),
        "",
        "The miniature is a 1-2M parameter model on a synthetic task, trained for minutes: it tests the mechanics",
        "of the method and its direction, not the paper's numbers. Intervals are 95% bootstrap intervals over",
        "problems; with one RL seed per arm, differences within them are not evidence either way.",
        "",
        "## Figures",
        "",
        *[f"![{f}]({f})" for f in figures],
        "",
    ]
    return write_atomic(out / "report.md", "\n".join(text))


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

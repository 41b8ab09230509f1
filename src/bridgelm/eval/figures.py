"""Figures of eval numbers as PNG, from plain dicts, and the curves they plot: G-Pass@k_tau against tau*k (paper
Figure 4), and accuracy, coverage and G-Pass against the generation width (Table 3 / Figure 5) and the budget in
tokens (Figure 6).

Curves averaged over benchmarks use the benchmarks that share the row's largest G-Pass k (MATH-500 at n=4 drops out
of a k=8 average, as in the paper's Figure 4). Benchmarks with a continuous score (summarisation) have no G-Pass and
stay out of these curves. Rows are as `bridgelm.eval.report.collect_rows` makes them.

Used by bridgelm.eval.report and bridgelm.demo.results.
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from bridgelm.jsonl import write_atomic

# Panels of the width and length plots: metric key in the curves -> axis title.
CURVE_PANELS = {
    "accuracy": "accuracy",
    "coverage@n": "coverage@n",
    "g_pass_tau0.5": "G-Pass@k_0.5",
    "g_pass_tau1": "G-Pass@k_1",
}


# ---------------------------------------------------------------------------------------------- curves


def _k_of(entry: dict) -> int:
    """The G-Pass k of a metrics entry (from its mg_pass@k name); 0 for a continuous score (no G-Pass)."""
    if "rouge1" in entry["metrics"] and "accuracy" not in entry["metrics"]:
        return 0
    for name in entry["metrics"]:
        found = re.fullmatch(r"mg_pass@(\d+)", name)
        if found:
            return int(found.group(1))
    raise ValueError("metrics entry has no mg_pass@k metric")


def _curve_benchmarks(row: dict, width: str | None = None) -> tuple[int, list[str]]:
    """(k, benchmarks) that a row's averaged curves use: those with the row's largest G-Pass k."""
    ks = {}
    for bench, b in row["benchmarks"].items():
        w = width or b["width"]
        if w in b["widths"] and _k_of(b["widths"][w]) > 0:
            ks[bench] = _k_of(b["widths"][w])
    if not ks:
        return 0, []
    k = max(ks.values())
    return k, [b for b, kb in ks.items() if kb == k]


def gpass_curves(rows: dict[str, dict]) -> dict[str, dict[str, Any]]:
    """{row: {"k", "benchmarks", "values": {tau*k: mean G-Pass@k}, "mg_pass"}} at each benchmark's main width."""
    out = {}
    for name, row in rows.items():
        k, benches = _curve_benchmarks(row)
        if not benches:
            continue  # only continuous scores: no G-Pass
        entries = [row["benchmarks"][b]["widths"][row["benchmarks"][b]["width"]]["metrics"] for b in benches]
        out[name] = {
            "k": k,
            "benchmarks": benches,
            "values": {
                m: float(np.mean([e[f"g_pass@{k}_atleast{m}"]["mean"] for e in entries])) for m in range(1, k + 1)
            },
            "mg_pass": float(np.mean([e[f"mg_pass@{k}"]["mean"] for e in entries])),
        }
    return out


def _panel_values(metrics: dict[str, float], k: int) -> dict[str, float]:
    """The CURVE_PANELS numbers out of a flat {metric: value} dict."""
    return {
        "accuracy": metrics["accuracy"],
        "coverage@n": metrics["coverage@n"],
        "g_pass_tau0.5": metrics[f"g_pass@{k}_tau0.5"],
        "g_pass_tau1": metrics[f"g_pass@{k}_tau1"],
    }


def width_curves(rows: dict[str, dict]) -> dict[str, dict[int, dict[str, float]]]:
    """{row: {width: {panel metric: mean over benchmarks}}} for rows sampled at several widths."""
    out = {}
    for name, row in rows.items():
        widths = sorted({w for b in row["benchmarks"].values() for w in b["widths"]}, key=int)
        if len(widths) < 2:
            continue
        curve = {}
        for w in widths:
            k, benches = _curve_benchmarks(row, w)
            if not benches or any(w not in row["benchmarks"][b]["widths"] for b in row["benchmarks"]):
                continue  # a width not sampled on every benchmark of the row
            flat = [{m: v["mean"] for m, v in row["benchmarks"][b]["widths"][w]["metrics"].items()} for b in benches]
            vals = [_panel_values(f, k) for f in flat]
            curve[int(w)] = {m: float(np.mean([v[m] for v in vals])) for m in CURVE_PANELS}
        if len(curve) > 1:
            out[name] = curve
    return out


def length_curves(rows: dict[str, dict]) -> dict[str, dict[int, dict[str, float]]]:
    """{row: {budget: {panel metric: mean over benchmarks}}} at each benchmark's main width."""
    out = {}
    for name, row in rows.items():
        k, benches = _curve_benchmarks(row)
        per = [row["benchmarks"][b]["widths"][row["benchmarks"][b]["width"]]["budgets"] for b in benches]
        common = [L for L in per[0] if all(L in p for p in per)] if per else []
        out[name] = {
            int(L): {m: float(np.mean([_panel_values(p[L], k)[m] for p in per])) for m in CURVE_PANELS} for L in common
        }
    return out


# ---------------------------------------------------------------------------------------------- plots


def new_figure(panels: int, width: float = 4.2, height: float = 3.2):
    from matplotlib.figure import Figure  # no pyplot: no global backend state, works headless

    fig = Figure(figsize=(width * panels, height), layout="constrained")
    axes = fig.subplots(1, panels, squeeze=False)[0]
    return fig, axes


def save_png(fig, path: str | os.PathLike) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    return write_atomic(path, buf.getvalue())


def plot_gpass(curves: dict[str, dict[int, float]], path: str | os.PathLike, k: int | None = None) -> Path:
    """Grouped bars of G-Pass@k_tau (percent) against tau*k, one colour per run (paper Figure 4).

    `curves` maps a run name to {tau*k: value in [0, 1]}.
    """
    fig, (ax,) = new_figure(1, width=7.0, height=3.6)
    names = list(curves)
    ms = sorted({int(m) for c in curves.values() for m in c})
    step = 0.8 / max(1, len(names))
    for j, name in enumerate(names):
        xs = [m - 0.4 + step * (j + 0.5) for m in ms if m in curves[name]]
        ys = [100 * curves[name][m] for m in ms if m in curves[name]]
        ax.bar(xs, ys, width=step, label=name)
    ax.set_xticks(ms)
    ax.set_xlabel("τ·k (correct responses required)")
    ax.set_ylabel(f"G-Pass@{k or (max(ms) if ms else 'k')}_τ (%)")
    ax.legend(fontsize="small")
    ax.grid(axis="y", alpha=0.3)
    return save_png(fig, path)


def _plot_panels(curves: dict[str, dict[int, dict[str, float]]], path, xlabel: str, log2: bool) -> Path:
    fig, axes = new_figure(len(CURVE_PANELS))
    for ax, (metric, title) in zip(axes, CURVE_PANELS.items()):
        for name, curve in curves.items():
            xs = sorted(curve)
            ax.plot(xs, [100 * curve[x][metric] for x in xs], marker="o", label=name)
        if log2:  # ticks at the widths or budgets measured, written as the integers they are
            ticks = sorted({x for curve in curves.values() for x in curve})
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [str(int(x)) for x in ticks])
            ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("%")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    return save_png(fig, path)


def plot_width(curves: dict[str, dict[int, dict[str, float]]], path: str | os.PathLike) -> Path:
    """Accuracy, coverage and G-Pass against the generation width w (paper Table 3 / Figure 5).

    `curves` maps a run name to {width: {"accuracy", "coverage", "g_pass_tau0.5", "g_pass_tau1"}}.
    """
    return _plot_panels(curves, path, "generation width w", log2=True)


def plot_length(curves: dict[str, dict[int, dict[str, float]]], path: str | os.PathLike) -> Path:
    """Accuracy, coverage and G-Pass against the generation budget in tokens (paper Figure 6).

    `curves` maps a run name to {budget: {"accuracy", "coverage", "g_pass_tau0.5", "g_pass_tau1"}}.
    """
    return _plot_panels(curves, path, "generation budget (tokens)", log2=True)

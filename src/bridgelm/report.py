"""Reports over scored eval runs: the paper's tables as markdown, its figures as PNG, every number as JSON.

Design notes:
- The inputs are the runs' metrics.json files (`bridgelm score` writes them; a run without one is scored first).
  Every table and plot helper takes plain dicts, so the demo can call them on numbers it already has.
- One row per run name. Runs given the same name are merged into one row (their benchmarks must differ), so
  that a row can mix, as the paper does, MATH-500 at n=4, w=4 with the competitions at n=32, w=8.
- A row reports each benchmark at its run's main width (run.json "width"); the width table and plot use every
  width sampled. Avg is the unweighted mean over benchmarks, shown only for rows that have every benchmark
  column; Delta = Avg(row) - Avg(base) in percentage points (paper Table 1).
- Curves averaged over benchmarks (G-Pass against tau*k, width, budget) use the benchmarks that share the row's
  largest G-Pass k (MATH-500 at n=4 drops out of a k=8 average, as in the paper's Figure 4). Benchmarks with a
  continuous score (summarisation) have no G-Pass and stay out of these curves.
- Non-math benchmarks (paper Table 2): runs of the tasks xsum, cnn_dailymail, gpqa, zebra and countdown, one
  column each in that order; ROUGE-1 F1 for summarisation, accuracy for the others; no Avg (the columns measure
  different things). Output stability (paper Table 5): the mean per-prompt variance of the summarisation score
  (in points², i.e. of ROUGE-1 x 100), and the mean pairwise similarity of a run's responses where
  `bridgelm analyze similarity RUN` has written RUN/similarity.json (ROUGE-L; embedding cosine when computed).

    bridgelm report runs/base runs/bridge --names base,bridge --out reports/x
"""

from __future__ import annotations

import io
import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bridgelm.errors import UserError
from bridgelm.evaluate import read_run
from bridgelm.jsonl import write_atomic, write_json
from bridgelm.score import METRICS_FILE, score_run

# Column titles of the paper's Table 1 for the usual file stems; other benchmarks keep their name.
ABBREVIATIONS = {
    "math500": "MATH",
    "math": "MATH",
    "aime24": "AIME24",
    "aime25": "AIME25",
    "amc23": "AMC",
    "brumo25": "BRU",
    "cmimc25": "CMI",
    "hmmt25_feb": "HMMT",
    "hmmt_feb25": "HMMT",
    "gsm8k": "GSM8K",
}

# Tasks of the paper's Table 2, in its column order, with their column titles.
NONMATH_TASKS = {
    "xsum": "XSum",
    "cnn_dailymail": "CNN/DM",
    "gpqa": "GPQA",
    "zebra": "ZebraLogic",
    "countdown": "Countdown",
}

# File that `bridgelm analyze similarity` writes into a run.
SIMILARITY_FILE = "similarity.json"

# Panels of the width and length plots: metric key in the curves -> axis title.
CURVE_PANELS = {
    "accuracy": "accuracy",
    "coverage": "coverage",
    "g_pass_tau0.5": "G-Pass@k_0.5",
    "g_pass_tau1": "G-Pass@k_1",
}


def column_title(benchmark: str) -> str:
    return ABBREVIATIONS.get(benchmark, benchmark)


# ---------------------------------------------------------------------------------------------- rows


def _metrics_shape(result: Any) -> bool:
    """Whether `result` has the parts of a metrics.json that the report reads: the run's main width, and an entry
    (an object) per benchmark and width."""
    if not isinstance(result, dict) or not isinstance(result.get("run"), dict) or "width" not in result["run"]:
        return False
    benchmarks = result.get("benchmarks")
    return isinstance(benchmarks, dict) and all(
        isinstance(per, dict) and per and all(isinstance(e, dict) for e in per.values()) for per in benchmarks.values()
    )


def load_metrics(run_dir: str | os.PathLike) -> dict[str, Any]:
    """metrics.json of a run; a run without one is scored first."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        read_run(run_dir)  # a clear error when this is not a run at all
        result = score_run(run_dir)
    else:
        again = f"`bridgelm score {run_dir}` writes it again"
        try:
            result = json.loads(path.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise UserError(f"{path} is not valid JSON ({err}): {again}") from err
        if not _metrics_shape(result):
            raise UserError(
                f"{path} is not a metrics.json of bridgelm (expected a 'run' object and 'benchmarks' with an entry per "
                f"width): {again}"
            )
    if not result["benchmarks"]:  # scored with allow_partial before any problem was sampled
        raise UserError(f"{run_dir} has no scored problem yet (metrics.json lists none): sample it first")
    return result


def collect_rows(run_dirs: Sequence[str], names: Sequence[str] | None = None) -> dict[str, dict]:
    """Rows {name: {"runs": [dir...], "benchmarks": {bench: {"width": w, "widths": {w: entry}, "run": dir}}}}.

    Widths are strings as in metrics.json; `entry` is a metrics.json entry of one (benchmark, width).
    """
    if not run_dirs:
        raise ValueError("no run directories given: expected at least one")
    if names is None:
        names = [Path(d).resolve().name for d in run_dirs]
        dup = sorted({x for x in names if names.count(x) > 1})
        if dup:
            raise ValueError(f"two runs are both named {dup[0]!r} after their folder: give --names")
    names = list(names)
    if len(names) != len(run_dirs):
        raise ValueError(f"{len(names)} names for {len(run_dirs)} runs: expected one name per run ({names})")
    rows: dict[str, dict] = {}
    for name, run_dir in zip(names, run_dirs):
        if not name:
            raise ValueError(f"empty name for run {run_dir}")
        result = load_metrics(run_dir)
        settings = read_run(run_dir)
        main = str(result["run"]["width"])
        row = rows.setdefault(name, {"runs": [], "benchmarks": {}, "partial": {}})
        row["runs"].append(str(run_dir))
        row["partial"].update(result.get("partial") or {})
        for bench, per_width in result["benchmarks"].items():
            if bench in row["benchmarks"]:
                raise ValueError(
                    f"row {name!r} has benchmark {bench!r} twice ({row['benchmarks'][bench]['run']} and {run_dir}): "
                    "runs merged into one row must cover different benchmarks"
                )
            width = main if main in per_width else sorted(per_width, key=int)[-1]
            task = result["run"].get("task")
            row["benchmarks"][bench] = {
                "width": width,
                "widths": per_width,
                "run": str(run_dir),
                "task": task,
                "settings": settings,  # the run's run.json
            }
    return rows


# Settings of run.json that change what a benchmark's numbers mean; rows compared on a benchmark should share them.
# (A --limit is not one of them: it shows in the benchmark's problem count and digest, compared besides.)
# foreign_groups marks control (b) of `bridgelm eval --foreign-groups`: groups of samples of different problems.
COMPARABLE = ("n", "max_new_tokens", "temperature", "top_p", "top_k", "chat", "stop", "foreign_groups")


def setting_differences(rows: dict[str, dict]) -> list[str]:
    """One line per (benchmark, setting) whose value differs between the rows that report the benchmark: the
    sampling settings of COMPARABLE, and the benchmark's data (its problem count and digest)."""

    def value(entry: dict, bench: str, key: str):
        settings = entry.get("settings") or {}
        if key in ("problems", "digest"):
            return next((b.get(key) for b in settings.get("benchmarks", []) if b.get("name") == bench), None)
        return settings.get(key)

    lines = []
    benches = dict.fromkeys(b for row in rows.values() for b in row["benchmarks"])
    for bench in benches:
        having = {name: row["benchmarks"][bench] for name, row in rows.items() if bench in row["benchmarks"]}
        if len(having) < 2:
            continue
        for key in (*COMPARABLE, "problems", "digest"):
            values = {name: value(entry, bench, key) for name, entry in having.items()}
            if len({json.dumps(v) for v in values.values()}) > 1:
                what = "data (digest)" if key == "digest" else key
                shown = ", ".join(f"{name} {json.dumps(v)}" for name, v in values.items())
                lines.append(f"{bench}: {what} differs between rows: {shown}")
    return lines


def metric_cells(rows: dict[str, dict], metric: str) -> dict[str, dict[str, dict]]:
    """{row: {benchmark: {"mean", "low", "high"}}} of one metric at each benchmark's main width."""
    out = {}
    for name, row in rows.items():
        out[name] = {}
        for bench, b in row["benchmarks"].items():
            value = b["widths"][b["width"]]["metrics"].get(metric)
            if value is not None:
                out[name][bench] = value
    return out


def width_cells(rows: dict[str, dict], metric: str = "accuracy") -> tuple[dict[str, dict], dict[str, str]]:
    """Cells of the width table (paper Table 3): one row per (run, width) for runs with several widths.

    Returns (cells like `metric_cells`, {row name: its run's name}).
    """
    cells, origin = {}, {}
    for name, row in rows.items():
        widths = sorted({w for b in row["benchmarks"].values() for w in b["widths"]}, key=int)
        if len(widths) == 1:
            cells[name], origin[name] = metric_cells({name: row}, metric)[name], name
            continue
        for w in widths:
            label = f"{name} (w={w})"
            cells[label] = {
                bench: b["widths"][w]["metrics"][metric]
                for bench, b in row["benchmarks"].items()
                if w in b["widths"] and metric in b["widths"][w]["metrics"]
            }
            origin[label] = name
    return cells, origin


# ---------------------------------------------------------------------------------------------- tables


def table_numbers(rows: dict[str, dict[str, dict]], base: str | None = None) -> dict[str, Any]:
    """Columns, per-row cells, Avg and Delta of a Table-1 style table; rows: {name: {bench: {"mean",...}}}."""
    if not rows:
        raise ValueError("no rows: expected at least one run")
    base = base if base is not None else next(iter(rows))
    if base not in rows:
        raise ValueError(f"base row {base!r} is not one of the rows {list(rows)}")
    columns: list[str] = []
    for cells in rows.values():
        columns.extend(b for b in cells if b not in columns)
    out_rows = {}
    for name, cells in rows.items():
        full = bool(columns) and all(b in cells for b in columns)  # no columns (ROUGE-only runs): no Avg
        avg = float(np.mean([cells[b]["mean"] for b in columns])) if full else None
        out_rows[name] = {"cells": {b: cells.get(b) for b in columns}, "avg": avg}
    base_avg = out_rows[base]["avg"]
    for r in out_rows.values():
        r["delta"] = None if r["avg"] is None or base_avg is None else r["avg"] - base_avg
    return {"columns": columns, "base": base, "rows": out_rows}


def markdown_table(head: Sequence[str], rows: Iterable[Sequence[str]], labels: int = 1) -> str:
    """A markdown table (no final newline): the first `labels` columns name things and are left-aligned, the
    others hold numbers and are right-aligned. Every table of the reports, the demo's included, is made here."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * labels + "---:|" * (len(head) - labels)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def pct(x: float | None, digits: int = 2) -> str:
    """A share in [0, 1] as percent with `digits` decimals; "–" for a missing value."""
    return "–" if x is None else f"{100 * x:.{digits}f}"


def _cell(value: dict | None, intervals: bool) -> str:
    if value is None:
        return "–"
    text = pct(value["mean"])
    if intervals and "low" in value and "high" in value:
        text += f" [{pct(value['low'], 1)}, {pct(value['high'], 1)}]"
    return text


def table_1(rows: dict[str, dict[str, dict]], base: str | None = None, intervals: bool = True, label="Model") -> str:
    """Markdown table in the layout of the paper's Table 1: benchmarks, Avg and the improvement over `base`.

    `rows` maps a row name to {benchmark: {"mean", "low", "high"}} with values in [0, 1]; shown in percent.
    """
    t = table_numbers(rows, base)
    head = [label, *(column_title(b) for b in t["columns"]), "Avg", "↑Δ"]
    rows = [
        [name, *(_cell(r["cells"][b], intervals) for b in t["columns"]), pct(r["avg"]), _delta(r["delta"])]
        for name, r in t["rows"].items()
    ]
    return markdown_table(head, rows) + "\n"


def _delta(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:+.2f}"


def gpass_table(curves: dict[str, dict[str, Any]]) -> str:
    """Markdown table of G-Pass@k_tau against tau*k (the numbers of Figure 4); curves as from `gpass_curves`."""
    k = max(c["k"] for c in curves.values())
    # Rows of another k have their own τ = m/k and their own mG-Pass@k: the header names k only when all share it.
    same = all(c["k"] == k for c in curves.values())
    head = ["Model", *(f"τ·k={m}" for m in range(1, k + 1)), f"mG-Pass@{k}" if same else "mG-Pass@k (the row's k)"]
    rows = [
        [f"{name} (k={c['k']})", *(pct(c["values"].get(m)) for m in range(1, k + 1)), pct(c.get("mg_pass"))]
        for name, c in curves.items()
    ]
    return markdown_table(head, rows) + "\n"


def _main_entry(b: dict) -> dict:
    """The metrics.json entry of a row's benchmark at its main width."""
    return b["widths"][b["width"]]


def _nonmath_columns(rows: dict[str, dict]) -> list[tuple[str, str]]:
    """(benchmark, title) of the Table 2 columns: benchmarks of NONMATH_TASKS runs, in the paper's task order."""
    found: dict[str, list[str]] = {task: [] for task in NONMATH_TASKS}
    for row in rows.values():
        for bench, b in row["benchmarks"].items():
            if b.get("task") in NONMATH_TASKS and bench not in found[b["task"]]:
                found[b["task"]].append(bench)
    return [
        (bench, NONMATH_TASKS[task] if len(benches) == 1 else f"{NONMATH_TASKS[task]} ({bench})")
        for task, benches in found.items()
        for bench in benches
    ]


def nonmath_table(rows: dict[str, dict]) -> dict[str, Any] | None:
    """Numbers of the paper's Table 2: {"columns": [bench], "titles": {bench: title}, "metric": {bench: name},
    "rows": {row: {bench: {"mean", "low", "high"} or None}}}; ROUGE-1 ("score") for summarisation, else accuracy.
    None when no row has such a benchmark."""
    columns = _nonmath_columns(rows)
    if not columns:
        return None
    metric, out_rows = {}, {}
    for name, row in rows.items():
        out_rows[name] = {}
        for bench, _ in columns:
            b = row["benchmarks"].get(bench)
            m = _main_entry(b)["metrics"] if b else {}
            key = "score" if "score" in m else "accuracy"
            if b:
                metric[bench] = key
            out_rows[name][bench] = m.get(key)
    return {"columns": [c for c, _ in columns], "titles": dict(columns), "metric": metric, "rows": out_rows}


def _similarity(run_dir: str, bench: str, width: str) -> dict | None:
    """RUN/similarity.json's entry of (bench, width), or None."""
    path = Path(run_dir) / SIMILARITY_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get(bench, {}).get(width)


def stability_table(rows: dict[str, dict]) -> dict[str, Any] | None:
    """Numbers of the paper's Table 5: {"columns": [key], "titles": {key: title}, "rows": {row: {key: cell}}}.

    Keys: "variance:<bench>" for continuous benchmarks (mean per-prompt score variance, points²) and
    "rouge_l:<bench>" / "embedding:<bench>" where a run's similarity.json has the benchmark at its main width.
    None when there is nothing to show.
    """
    titles: dict[str, str] = {}
    out_rows: dict[str, dict] = {}
    nonmath_titles = dict(_nonmath_columns(rows))
    for name, row in rows.items():
        cells = out_rows.setdefault(name, {})
        for bench, b in row["benchmarks"].items():
            title = nonmath_titles.get(bench) or column_title(bench)
            variance = _main_entry(b)["metrics"].get("score_variance")
            if variance is not None:
                key = f"variance:{bench}"
                titles.setdefault(key, f"{title} variance")
                cells[key] = {k: 1e4 * v for k, v in variance.items()}
            sim = _similarity(b["run"], bench, b["width"])
            if sim and "rouge_l" in sim:
                titles.setdefault(f"rouge_l:{bench}", f"{title} ROUGE-L sim.")
                cells[f"rouge_l:{bench}"] = {k: 100 * v for k, v in sim["rouge_l"].items()}
            if sim and "cosine" in sim.get("embedding", {}):
                titles.setdefault(f"embedding:{bench}", f"{title} emb. cos.")
                cells[f"embedding:{bench}"] = {k: 100 * v for k, v in sim["embedding"]["cosine"].items()}
    if not titles:
        return None
    order = sorted(titles, key=lambda key: (0 if key.startswith("variance:") else 1, list(titles).index(key)))
    return {"columns": order, "titles": {k: titles[k] for k in order}, "rows": out_rows}


def _plain_cell(value: dict | None, digits: int = 2) -> str:
    """mean [low, high] of a cell already in display units."""
    if value is None:
        return "–"
    text = f"{value['mean']:.{digits}f}"
    if "low" in value and "high" in value:
        text += f" [{value['low']:.{digits - 1}f}, {value['high']:.{digits - 1}f}]"
    return text


def table_2(table: dict[str, Any], intervals: bool = True) -> str:
    """Markdown of `nonmath_table` in the paper's Table 2 layout (percent)."""
    head = ["Model", *(table["titles"][b] for b in table["columns"])]
    rows = [
        [name, *(_cell(cells.get(b), intervals) for b in table["columns"])] for name, cells in table["rows"].items()
    ]
    return markdown_table(head, rows) + "\n"


def table_5(table: dict[str, Any]) -> str:
    """Markdown of `stability_table` in the paper's Table 5 layout."""
    head = ["Model", *(table["titles"][k] for k in table["columns"])]
    rows = [[name, *(_plain_cell(cells.get(k)) for k in table["columns"])] for name, cells in table["rows"].items()]
    return markdown_table(head, rows) + "\n"


# ---------------------------------------------------------------------------------------------- curves


def _k_of(entry: dict) -> int:
    """The G-Pass k of a metrics entry (from its mg_pass@k name); 0 for a continuous score (no G-Pass)."""
    if "score" in entry["metrics"] and "accuracy" not in entry["metrics"]:
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
        "coverage": metrics["coverage"],
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
        if log2:
            from matplotlib.ticker import ScalarFormatter

            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(ScalarFormatter())
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


# ---------------------------------------------------------------------------------------------- the report


def build_report(
    run_dirs: Sequence[str], names: Sequence[str] | None = None, base: str | None = None
) -> dict[str, Any]:
    """Every number of the report (the content of report.json), without writing anything."""
    rows = collect_rows(run_dirs, names)
    base = base if base is not None else next(iter(rows))
    if base not in rows:
        raise ValueError(f"--base {base!r} is not one of the run names {list(rows)}")
    widths, origin = width_cells(rows)
    width_base = base if base in widths else _main_label(rows, base)
    if width_base not in widths:
        width_base = next(label for label, n in origin.items() if n == base)
    return {
        "runs": {
            name: {
                "dirs": row["runs"],
                "widths": {b: v["width"] for b, v in row["benchmarks"].items()},
                "mean_length": {b: v["widths"][v["width"]]["mean_length"] for b, v in row["benchmarks"].items()},
                "finished": {b: v["widths"][v["width"]]["finished"] for b, v in row["benchmarks"].items()},
                # problems a partial run (`bridgelm score --allow-partial`) has not sampled, by "benchmark w=width"
                "missing": row.get("partial", {}),
                # control (b): groups made of samples of different problems (`bridgelm eval --foreign-groups`)
                "foreign_groups": any(v["settings"].get("foreign_groups") for v in row["benchmarks"].values()),
            }
            for name, row in rows.items()
        },
        "base": base,
        "setting_differences": setting_differences(rows),
        "accuracy": table_numbers(metric_cells(rows, "accuracy"), base),
        "coverage": table_numbers(metric_cells(rows, "coverage"), base),
        "majority_vote": table_numbers(metric_cells(rows, "majority_vote"), base),
        "accuracy_by_width": table_numbers(widths, width_base) if len(widths) > len(rows) else None,
        "nonmath": nonmath_table(rows),
        "stability": stability_table(rows),
        "gpass": gpass_curves(rows),
        "width": width_curves(rows),
        "length": length_curves(rows),
    }


def _main_label(rows: dict[str, dict], name: str) -> str:
    """The width-table label of a run's row at its main width."""
    w = next(iter(rows[name]["benchmarks"].values()))["width"]
    return f"{name} (w={w})"


def _rows_of(table: dict[str, Any]) -> dict[str, dict[str, dict]]:
    return {name: {b: v for b, v in r["cells"].items() if v is not None} for name, r in table["rows"].items()}


def render_markdown(report: dict[str, Any], figures: Sequence[str] = ()) -> str:
    """table.md from a `build_report` dict."""
    base = report["base"]
    out = ["# Evaluation report", ""]
    for name, run in report["runs"].items():
        widths = ", ".join(f"{b} w={w}" for b, w in run["widths"].items())
        missing = run.get("missing") or {}
        partial = "; ".join(f"{b}: {n} problem{'s' if n != 1 else ''} not sampled" for b, n in missing.items())
        foreign = " (**foreign groups**: each group holds samples of different problems, a control)"
        out.append(
            f"- **{name}**: {', '.join(run['dirs'])} ({widths})"
            + (foreign if run.get("foreign_groups") else "")
            + (f" (**partial run**: {partial})" if partial else "")
        )
    differences = report.get("setting_differences") or []
    if differences:
        out += ["", "**Not like for like**: settings that change what the numbers mean differ between rows:", ""]
        out += [f"- {line}" for line in differences]
    note = (
        "Percent; 95% bootstrap intervals over problems in brackets. Avg: unweighted mean over the benchmark "
        f"columns. ↑Δ: Avg minus the Avg of **{base}**, in points."
    )
    sections = [
        ("Accuracy (Pass@1, paper Table 1)", report["accuracy"], base),
        ("Coverage (at least one correct response of n)", report["coverage"], base),
        ("Majority vote (self-consistency, paper Appendix E)", report["majority_vote"], base),
    ]
    if report["accuracy_by_width"] is not None:
        sections.append(("Accuracy by generation width (paper Table 3)", report["accuracy_by_width"], None))
    for title, table, table_base in sections:
        if not any(r["cells"] and any(v is not None for v in r["cells"].values()) for r in table["rows"].values()):
            continue
        out += ["", f"## {title}", "", table_1(_rows_of(table), table_base or table["base"]), note]
    if report.get("nonmath"):
        out += ["", "## Non-math benchmarks (paper Table 2)", "", table_2(report["nonmath"])]
        out.append(
            "Percent, 95% bootstrap intervals over problems in brackets: ROUGE-1 F1 (rouge-score, stemmed) for "
            "summarisation, accuracy (Pass@1) for the others; each at its run's main width."
        )
    if report.get("stability"):
        out += ["", "## Output stability (paper Table 5)", "", table_5(report["stability"])]
        out.append(
            "Variance: the variance of ROUGE-1 F1 x 100 across one prompt's responses, mean over prompts (points², "
            "lower = more consistent). Similarity: mean pairwise ROUGE-L F1 x 100 (and embedding cosine x 100) "
            "within a prompt's responses, from `bridgelm analyze similarity RUN` (higher = more alike)."
        )
    if report["gpass"]:
        out += ["", "## G-Pass@k_τ against τ·k, mean over benchmarks (paper Figure 4)", ""]
        out.append(gpass_table(report["gpass"]))
        used = {name: ", ".join(c["benchmarks"]) for name, c in report["gpass"].items()}
        out.append("Benchmarks averaged: " + "; ".join(f"{n}: {b}" for n, b in used.items()))
    responses = [
        [name, b, f"{length:.1f}", f"{100 * run['finished'][b]:.1f}"]
        for name, run in report["runs"].items()
        for b, length in run["mean_length"].items()
    ]
    out += [
        "",
        "## Responses",
        "",
        markdown_table(["Run", "benchmark", "mean length (tokens)", "finished (%)"], responses, labels=2),
    ]
    if figures:
        out += ["", "## Figures", ""] + [f"![{Path(f).stem}]({Path(f).name})" for f in figures]
    if any(Path(f).stem == "length" for f in figures):
        out += [
            "",
            "In length.png a sample counts at budget L when it finished within L tokens and is correct, so at the "
            "largest budget (max_new_tokens) it leaves out the samples cut there, which the accuracy table grades as "
            "they are (the 'finished' column above says how many ended).",
        ]
    return "\n".join(out) + "\n"


def write_report(
    run_dirs: Sequence[str], out_dir: str | os.PathLike, names: Sequence[str] | None = None, base: str | None = None
) -> Path:
    """Write OUT/table.md, OUT/report.json and the PNG figures for scored runs; returns the table.md path."""
    out = Path(out_dir)
    report = build_report(run_dirs, names, base)
    figures = []
    gpass = {n: c["values"] for n, c in report["gpass"].items() if c["values"]}
    if gpass:
        k = max(report["gpass"][n]["k"] for n in gpass)
        figures.append(plot_gpass(gpass, out / "gpass.png", k))
    if report["width"]:
        figures.append(plot_width(report["width"], out / "width.png"))
    if any(report["length"].values()):
        figures.append(plot_length(report["length"], out / "length.png"))
    report["files"] = [str(f) for f in figures]
    write_json(out / "report.json", report)
    return write_atomic(out / "table.md", render_markdown(report, [str(f) for f in figures]))

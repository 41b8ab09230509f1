"""Markdown tables of eval numbers, from plain dicts: the one table builder (`markdown_table`, which the demo's
report uses too) and the paper's layouts: `benchmark_table` (Table 1: a column per benchmark, Avg and the
improvement over a base row), `gpass_table` (the numbers of Figure 4), `table_2` (non-math benchmarks) and
`table_5` (output stability).

Percentages are shown with two decimals and 95% bootstrap intervals in brackets; a missing value is "–". Avg is the
unweighted mean over the benchmark columns, shown only for rows that have every column; Delta = Avg(row) -
Avg(base) in percentage points. Non-math benchmarks (paper Table 2): runs of the tasks xsum, cnn_dailymail, gpqa,
zebra and countdown, one column each in that order; ROUGE-1 F1 for summarisation, accuracy for the others; no Avg
(the columns measure different things). Output stability (paper Table 5): the mean per-prompt variance of the
summarisation score (in points², i.e. of ROUGE-1 x 100), and the mean pairwise similarity of a run's responses where
`bridgelm analyze similarity --run RUN` has written RUN/similarity.json (ROUGE-L; embedding cosine when computed).

Used by bridgelm.eval.report and bridgelm.demo.results.
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from bridgelm.errors import UserError

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


def column_title(benchmark: str) -> str:
    return ABBREVIATIONS.get(benchmark, benchmark)


def table_numbers(rows: dict[str, dict[str, dict]], base: str | None = None) -> dict[str, Any]:
    """Columns, per-row cells, Avg and Delta of a Table-1 style table; rows: {name: {bench: {"mean",...}}}."""
    assert rows, "no rows: expected at least one run"  # report.collect_rows refuses no run directories
    base = base if base is not None else next(iter(rows))
    if base not in rows:
        raise UserError(f"base row {base!r} is not one of the rows {list(rows)}")
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
    others hold numbers and are right-aligned. Every table of the reports, the demo's included, is made here. A
    cell's `|` is escaped and its line breaks become spaces, so that a name (a run folder's) cannot shift columns;
    its HTML is escaped, so that it cannot add markup."""
    lines = [_row(head), "|" + "---|" * labels + "---:|" * (len(head) - labels)]
    lines += [_row(row) for row in rows]
    return "\n".join(lines)


def _row(cells: Sequence[str]) -> str:
    """One line of a markdown table, each cell escaped (`\\|`, line breaks as spaces, `<`, `>` and `&` as HTML
    entities: markdown renders raw HTML, so a run folder named `<img onerror=...>` would run in a viewer)."""
    return "| " + " | ".join(" ".join(_escape(c).replace("|", "\\|").splitlines()) for c in cells) + " |"


def _escape(cell) -> str:
    return html.escape(str(cell), quote=False)


def md_text(text) -> str:
    """Text of a report outside its tables (a run's name or folder) made inert: HTML escaped, one line."""
    return " ".join(_escape(text).splitlines())


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


def benchmark_table(
    rows: dict[str, dict[str, dict]], base: str | None = None, intervals: bool = True, label: str = "Model"
) -> str:
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
    "rows": {row: {bench: {"mean", "low", "high"} or None}}}; ROUGE-1 F1 ("rouge1") for summarisation, else accuracy.
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
            key = "rouge1" if "rouge1" in m else "accuracy"
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

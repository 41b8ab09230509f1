"""Reports over scored eval runs: the paper's tables as markdown, its figures as PNG, every number as JSON.

Design notes:
- The inputs are the runs' metrics.json files (`bridgelm score` writes them; a run without one is scored first).
  The tables (bridgelm.eval.tables) and figures (bridgelm.eval.figures) take plain dicts, so the demo can call them on numbers
  it already has; this module loads the runs into rows and lays out table.md.
- One row per run name. Runs given the same name are merged into one row (their benchmarks must differ), so
  that a row can mix, as the paper does, MATH-500 at n=4, w=4 with the competitions at n=32, w=8.
- A row reports each benchmark at its run's main width (run.json "width"); the width table and plot use every
  width sampled. Rows that differ in a setting that changes what the numbers mean (LIKE_FOR_LIKE) are named.

    bridgelm report runs/base runs/bridge --names base,bridge --out reports/x
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bridgelm.errors import UserError
from bridgelm.eval.figures import gpass_curves, length_curves, plot_gpass, plot_length, plot_width, width_curves
from bridgelm.eval.folder import read_eval_run
from bridgelm.eval.score import METRICS_FILE, score_run
from bridgelm.eval.tables import (
    benchmark_table,
    gpass_table,
    markdown_table,
    md_text,
    nonmath_table,
    stability_table,
    table_2,
    table_5,
    table_numbers,
)
from bridgelm.jsonl import parse_json, write_atomic, write_json
from bridgelm.runs import RUN_FILE, SAMPLED_WITH, format_of, run_kind

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
        read_eval_run(run_dir)  # a clear error when this is not a run at all
        print(f"bridgelm report: {run_dir} is not scored yet: scoring it first (-> {path})", flush=True)
        result = score_run(run_dir)
    else:
        again = f"`bridgelm score {run_dir}` writes it again"
        result = parse_json(path.read_bytes(), str(path), f"a metrics.json of bridgelm; {again}", strict=False)
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
        raise UserError("no run directories given: expected at least one")
    if names is None:
        names = [Path(d).resolve().name for d in run_dirs]
        dup = sorted({x for x in names if names.count(x) > 1})
        if dup:
            raise UserError(f"two runs are both named {dup[0]!r} after their folder: give --names")
    names = list(names)
    if len(names) != len(run_dirs):
        raise UserError(f"{len(names)} names for {len(run_dirs)} runs: expected one name per run ({names})")
    rows: dict[str, dict] = {}
    for name, run_dir in zip(names, run_dirs):
        if not name:
            raise UserError(f"empty name for run {run_dir}")
        result = load_metrics(run_dir)
        settings = read_eval_run(run_dir)
        main = str(result["run"]["width"])
        row = rows.setdefault(name, {"runs": [], "benchmarks": {}, "partial": {}})
        row["runs"].append(str(run_dir))
        row["partial"].update(result.get("partial") or {})
        for bench, per_width in result["benchmarks"].items():
            if bench in row["benchmarks"]:
                raise UserError(
                    f"row {name!r} has benchmark {bench!r} twice ({row['benchmarks'][bench]['run']} and {run_dir}): "
                    "runs merged into one row must cover different benchmarks"
                )
            width = main if main in per_width else sorted(per_width, key=int)[-1]
            task = result["run"].get("task")
            row["benchmarks"][bench] = {
                "width": width,
                "main_width": main,  # the run's own: `width` differs when a partial run has no scores there
                "widths": per_width,
                "run": str(run_dir),
                "task": task,
                "settings": settings,  # the run's run.json
            }
    return rows


# Settings of run.json that change what a benchmark's numbers mean; rows compared on a benchmark should share them:
# those that decide what is sampled, but the width and the seed, which rows compare by design. (A --limit is not one
# of them: it shows in the benchmark's problem count and digest, compared besides.) foreign_groups marks control (b)
# of `bridgelm eval --foreign-groups`: groups of samples of different problems.
LIKE_FOR_LIKE = (*(k for k in SAMPLED_WITH if k not in ("width", "seed")), "dtype")  # bf16 samples: other ones


def setting_differences(rows: dict[str, dict]) -> list[str]:
    """One line per (benchmark, setting) whose value differs between the rows that report the benchmark: the
    sampling settings of LIKE_FOR_LIKE, and the benchmark's data (its problem count and digest); first, one per
    benchmark reported at another width than its run's (a partial run without scores at it)."""

    def value(entry: dict, bench: str, key: str):
        settings = entry.get("settings") or {}
        if key in ("problems", "digest"):
            return next((b.get(key) for b in settings.get("benchmarks", []) if b.get("name") == bench), None)
        return settings.get(key)

    lines = [
        f"{name}: {bench} has no scores at its run's width {b['main_width']} (a partial run): "
        f"reported at w={b['width']}"
        for name, row in rows.items() for bench, b in row["benchmarks"].items() if b["width"] != b["main_width"]
    ]
    benches = dict.fromkeys(b for row in rows.values() for b in row["benchmarks"])
    for bench in benches:
        having = {name: row["benchmarks"][bench] for name, row in rows.items() if bench in row["benchmarks"]}
        if len(having) < 2:
            continue
        for key in (*LIKE_FOR_LIKE, "problems", "digest"):
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


# ---------------------------------------------------------------------------------------------- the report


def build_report(
    run_dirs: Sequence[str], names: Sequence[str] | None = None, base: str | None = None
) -> dict[str, Any]:
    """Every number of the report (the content of report.json), without writing anything."""
    rows = collect_rows(run_dirs, names)
    base = base if base is not None else next(iter(rows))
    if base not in rows:
        raise UserError(f"--base {base!r} is not one of the run names {list(rows)}")
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
        "coverage@n": table_numbers(metric_cells(rows, "coverage@n"), base),
        "majority_vote": table_numbers(metric_cells(rows, "majority_vote"), base),
        "pass@w": table_numbers(metric_cells(rows, "pass@w"), base),
        "group_all_correct": table_numbers(metric_cells(rows, "group_all_correct"), base),
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
    out = ["# Evaluation report", "", *_run_lines(report)]
    out += _metric_sections(report)
    if report["gpass"]:
        out += ["", "## G-Pass@k_τ against τ·k, mean over benchmarks (paper Figure 4)", ""]
        out.append(gpass_table(report["gpass"]))
        used = {name: ", ".join(c["benchmarks"]) for name, c in report["gpass"].items()}
        out.append("Benchmarks averaged: " + md_text("; ".join(f"{n}: {b}" for n, b in used.items())))
    responses = [
        [name, b, f"{length:.1f}", f"{100 * run['finished'][b]:.1f}"]
        for name, run in report["runs"].items()
        for b, length in run["mean_length"].items()
    ]
    head = ["Run", "benchmark", "mean length (tokens)", "finished (%)"]
    out += ["", "## Responses", "", markdown_table(head, responses, labels=2)]
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


def _run_lines(report: dict[str, Any]) -> list[str]:
    """A line per row naming its runs and widths (and whether it is a control or partial), then the settings that
    differ between rows."""
    out = []
    for name, run in report["runs"].items():
        widths = ", ".join(f"{b} w={w}" for b, w in run["widths"].items())
        missing = run.get("missing") or {}
        partial = "; ".join(f"{b}: {n} problem{'s' if n != 1 else ''} not sampled" for b, n in missing.items())
        foreign = " (**foreign groups**: each group holds samples of different problems, a control)"
        out.append(
            f"- **{md_text(name)}**: {md_text(', '.join(run['dirs']))} ({md_text(widths)})"
            + (foreign if run.get("foreign_groups") else "")
            + (f" (**partial run**: {partial})" if partial else "")
        )
    differences = report.get("setting_differences") or []
    if differences:
        out += ["", "**Not like for like**: settings that change what the numbers mean differ between rows:", ""]
        out += [f"- {md_text(line)}" for line in differences]
    return out


def _metric_sections(report: dict[str, Any]) -> list[str]:
    """The sections of the Table-1 style tables (accuracy, coverage@n, pass@w, group all-correct, majority vote, by width), Table 2 and Table 5."""
    base = report["base"]
    note = (
        "Percent; 95% bootstrap intervals over problems in brackets. Avg: unweighted mean over the benchmark "
        f"columns. ↑Δ: Avg minus the Avg of **{md_text(base)}**, in points."
    )
    sections = [
        ("Accuracy (Pass@1, paper Table 1)", report["accuracy"], base),
        ("Coverage@n (at least one correct response of all n, pooled over groups)", report["coverage@n"], base),
        ("Pass@w (at least one correct response in a Bridge group: the paper's coverage)", report["pass@w"], base),
        ("All of a Bridge group correct (G-Pass@w at τ = 1, per group)", report["group_all_correct"], base),
        ("Majority vote (self-consistency, paper Appendix E)", report["majority_vote"], base),
    ]
    if report["accuracy_by_width"] is not None:
        sections.append(("Accuracy by generation width (paper Table 3)", report["accuracy_by_width"], None))
    out = []
    for title, table, table_base in sections:
        if not any(r["cells"] and any(v is not None for v in r["cells"].values()) for r in table["rows"].values()):
            continue
        out += ["", f"## {title}", "", benchmark_table(_rows_of(table), table_base or table["base"]), note]
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
            "within a prompt's responses, from `bridgelm analyze similarity --run RUN` (higher = more alike)."
        )
    return out


REPORT_FILE = "report.json"
FIGURES = ("gpass.png", "width.png", "length.png")  # what a report may draw


def check_report_out(out_dir: str | os.PathLike, run_dirs: Sequence[str]) -> None:
    """UserError unless `out_dir` is a new or empty folder or a report's own (its report.json says so): a run's
    folder, or one holding other files (which table.md, report.json or a figure would replace), is refused."""
    out = Path(out_dir)
    if any(out.resolve() == Path(d).resolve() for d in run_dirs) or (out / RUN_FILE).exists():
        raise UserError(f"--out {out_dir} is a run's folder: expected a folder of the report's own")
    if not out.is_dir() or run_kind(_read_report(out)) == "report":
        return
    found = sorted(e.name for e in out.iterdir() if not e.name.startswith("."))
    if found:
        held = ", ".join(found[:4]) + (" and more" if len(found) > 4 else "")
        why = ("its report.json is not one this bridgelm wrote (an older one's, or another tool's)"
               if REPORT_FILE in found else f"no {REPORT_FILE} of bridgelm report")
        raise UserError(f"--out {out_dir} holds {held}, and {why}: expected a new or empty folder, or a report's own")


def _read_report(out: Path) -> Any:
    try:
        return json.loads((out / REPORT_FILE).read_bytes())
    except (OSError, ValueError, RecursionError):
        return None


def write_report(
    run_dirs: Sequence[str], out_dir: str | os.PathLike, names: Sequence[str] | None = None, base: str | None = None
) -> Path:
    """Write OUT/table.md, OUT/report.json and the PNG figures for scored runs (a figure of an earlier report that
    this one does not draw is removed); returns the table.md path."""
    out = Path(out_dir)
    report = {**format_of("report"), **build_report(run_dirs, names, base)}
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
    for stale in set(FIGURES) - {Path(f).name for f in figures}:
        (out / stale).unlink(missing_ok=True)
    write_json(out / REPORT_FILE, report)
    return write_atomic(out / "table.md", render_markdown(report, [str(f) for f in figures]))

"""The demo's numbers read off its run folders: per-problem accuracy and set metrics, paired differences and what
each detects. Every module that reports a comparison (results, the controls, the learning-rate search) reads them
here, so none of them imports another."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from bridgelm.eval.metrics import g_pass_at_k, tau_threshold
from bridgelm.intervals import paired_difference
from bridgelm.jsonl import read_records

# z-scores of a two-sided 5% test and of 80% power: a difference of (Z_TEST + Z_POWER) standard errors is detected
# 80% of the time
Z_TEST, Z_POWER = 1.96, 0.84


def entry(run_dir: Path, width: int) -> dict:
    """The metrics entry of a run's (only) benchmark at `width`."""
    metrics = json.loads((run_dir / "metrics.json").read_text())
    bench = next(iter(metrics["benchmarks"].values()))
    return bench[str(width)]


def _scores(run_dir: Path, width: int) -> list[dict]:
    scores = [r for r in read_records(run_dir / "scores.jsonl", repair=False) if int(r["width"]) == width]
    return sorted(scores, key=lambda r: (r["benchmark"], int(r["index"])))


def per_problem_accuracy(run_dir: Path, width: int) -> list[float]:
    """Accuracy (c / n) of every problem sampled at `width`, in problem order, from RUN_DIR/scores.jsonl."""
    return [r["c"] / r["n"] for r in _scores(run_dir, width)]


def per_problem_sets(run_dir: Path, width: int, k: int, tau: float) -> list[float]:
    """Per problem (in problem order) of a run's samples at `width`: the share of its sets of k samples with at least
    ceil(tau x k) correct (tau 1: all; tau 0: at least one). With width k the sets are its Bridge groups; with width 1,
    any k of its n independent samples (G-Pass@k_tau, Pass@k at tau 0)."""
    scores = _scores(run_dir, width)
    if width == 1:
        return [g_pass_at_k(r["n"], r["c"], k, tau) for r in scores]
    assert width == k, f"sets of {k} are Bridge groups only at width {k}, not {width}"
    need = tau_threshold(tau, k)
    return [statistics.fmean(sum(r["correct"][i : i + k]) >= need for i in range(0, r["n"], k)) for r in scores]


def power(diffs: dict) -> dict[str, float | None]:
    """The difference each paired comparison finds 80% of the time (two-sided 5%), in points: its standard error read
    off its 95% interval (width / (2 x 1.96)), times 2.8. Smaller differences are found less often, so a null here
    does not exclude them; an interval that excludes 0 is a finding whatever this says. None for an interval of no
    width (every problem's difference the same, as at toy sizes): nothing to read a standard error from."""
    return {
        key: round(100 * (Z_TEST + Z_POWER) * (d["high"] - d["low"]) / (2 * Z_TEST), 2)
        if d["high"] > d["low"] else None
        for key, d in diffs.items()
    }


def power_text(points: float | None) -> str:
    return "not estimable (no variation)" if points is None else f"{points:.1f}"


def sibling_test(one: list, wide: list, foreign: list, w: int) -> dict:
    """The sibling-use comparisons of runs evaluated at w = 1, w and with foreign siblings (per seed, per-problem
    accuracies): "w{w}-w1" and "foreign-w1" paired over seeds and problems, and their power."""
    diffs = {f"w{w}-w1": paired_difference(wide, one), "foreign-w1": paired_difference(foreign, one)}
    return {**diffs, "power": power(diffs)}


def mean_of(rows: list[list[float]]) -> float:
    """The mean over every (seed, problem) value."""
    return sum(map(sum, rows)) / sum(map(len, rows))

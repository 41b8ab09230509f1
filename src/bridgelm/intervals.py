"""Confidence intervals: the percentile bootstrap of a mean over problems (`bootstrap_ci`), and the paired difference
of two methods over seeds and problems (`paired_difference`), which falls back on a t-interval over seed means when
seeds are few. Pure numpy; tested by tests/test_metrics.py against loops."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from bridgelm.errors import check_int, check_number


def bootstrap_ci(
    values: Iterable[float], n_boot: int = 1000, alpha: float = 0.05, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval (1 - alpha) for the mean of per-problem values.

    Resamples problems with replacement n_boot times with np.random.default_rng(seed). A single
    value gives the degenerate interval (v, v).
    """
    data = np.asarray(list(values), dtype=np.float64)
    if data.size == 0:
        raise ValueError("values is empty: expected at least one per-problem value")
    check_int("n_boot", n_boot)
    check_number("alpha", alpha, 0, 1, open_low=True, open_high=True)
    if data.size == 1:
        return float(data[0]), float(data[0])
    rng = np.random.default_rng(seed)
    means = np.empty(n_boot, dtype=np.float64)
    # Chunks keep the index matrix small for large benchmarks.
    chunk = max(1, 2_000_000 // data.size)
    for start in range(0, n_boot, chunk):
        stop = min(n_boot, start + chunk)
        idx = rng.integers(0, data.size, size=(stop - start, data.size))
        means[start:stop] = data[idx].mean(axis=1)
    low, high = np.quantile(means, [alpha / 2.0, 1.0 - alpha / 2.0])
    return float(low), float(high)


def paired_difference(
    a: Sequence[Sequence[float]], b: Sequence[Sequence[float]], n_boot: int = 2000, alpha: float = 0.05, seed: int = 0
) -> dict[str, float]:
    """Mean of a - b with a paired percentile bootstrap interval, over seeds and problems.

    `a[s][p]` and `b[s][p]` are per-problem scores (e.g. accuracy over the samples of problem p) of two methods
    trained or sampled with the same seed s on the same problems. Each replicate resamples seeds with
    replacement, then problems with replacement, and keeps every pair (s, p) together, so the interval holds
    the variation between training seeds as well as between problems. With 2 to 9 seeds the interval is the wider of
    that and a t-interval over the seeds' means (`T_SEEDS`). Returns {"mean", "low", "high", "interval"} ("interval":
    "bootstrap" or "t over S seeds", whichever was used).
    """
    x = np.asarray(a, dtype=np.float64)
    y = np.asarray(b, dtype=np.float64)
    if x.ndim != 2 or x.shape != y.shape or x.size == 0:
        raise ValueError(
            f"a and b must be non-empty [seeds, problems] arrays of one shape, got {x.shape} and {y.shape}"
        )
    check_int("n_boot", n_boot)
    check_number("alpha", alpha, 0, 1, open_low=True, open_high=True)
    d = x - y  # [S, P]
    S, P = d.shape
    rng = np.random.default_rng(seed)
    means = np.empty(n_boot, dtype=np.float64)
    for i in range(n_boot):
        seeds = rng.integers(0, S, size=S)
        problems = rng.integers(0, P, size=P)
        means[i] = d[np.ix_(seeds, problems)].mean()
    low, high = np.quantile(means, [alpha / 2.0, 1.0 - alpha / 2.0])
    out = {"mean": float(d.mean()), "low": float(low), "high": float(high), "interval": "bootstrap"}
    if 2 <= S < T_SEEDS and alpha == 0.05:
        t_low, t_high = seed_t_interval(d.mean(axis=1))
        if t_high - t_low > high - low:
            out.update(low=t_low, high=t_high, interval=f"t over {S} seeds")
    return out


# Below this many seeds the two-way bootstrap's interval is too narrow when seeds vary more than problems (it covers
# ~75% at 3 seeds in simulation): `paired_difference` then takes the wider of it and a t-interval over seed means.
T_SEEDS = 10
# Two-sided 95% quantiles of Student's t with 1..9 degrees of freedom (tests/test_metrics.py checks them with scipy).
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262)


def seed_t_interval(seed_means: np.ndarray) -> tuple[float, float]:
    """The 95% t-interval of the mean of 2..10 per-seed means: mean +- t(S - 1) x sd / sqrt(S)."""
    S = len(seed_means)
    half = T_975[S - 2] * float(np.std(seed_means, ddof=1)) / np.sqrt(S)
    return float(np.mean(seed_means) - half), float(np.mean(seed_means) + half)

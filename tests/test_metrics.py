"""Set metrics against brute-force enumeration of k-subsets of a concrete 0/1 sample list."""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics

import numpy as np
import pytest

from bridgelm import intervals
from bridgelm.intervals import bootstrap_ci
from bridgelm.eval.metrics import (
    canonical_answer,
    coverage,
    g_pass_at_k,
    majority_answer,
    majority_vote,
    mean_accuracy,
    mg_pass_at_k,
    pass_at_k,
    prob_at_least,
    summarize,
    tau_threshold,
)


def brute_at_least(n: int, c: int, k: int, m: int) -> float:
    """Fraction of k-subsets of [1]*c + [0]*(n-c) with at least m ones."""
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(samples, k))
    return sum(sum(s) >= m for s in subsets) / len(subsets)


def brute_threshold(tau: float, k: int) -> int:
    """At least one, and at least tau*k (by exact fraction arithmetic on the decimal tau)."""
    from fractions import Fraction

    return max(1, math.ceil(Fraction(str(tau)) * k))


def random_cases(count: int, seed: int):
    rng = random.Random(seed)
    taus = [0.0, 0.1, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.9, 1.0]
    for _ in range(count):
        n = rng.randint(1, 10)
        c = rng.randint(0, n)
        k = rng.randint(1, n)
        tau = rng.choice(taus) if rng.random() < 0.7 else rng.random()
        yield n, c, k, tau


def test_pass_at_k_matches_enumeration():
    for n, c, k, _ in random_cases(200, seed=1):
        assert pass_at_k(n, c, k) == pytest.approx(brute_at_least(n, c, k, 1), abs=1e-12)


def test_g_pass_matches_enumeration():
    for n, c, k, tau in random_cases(200, seed=2):
        expected = brute_at_least(n, c, k, brute_threshold(tau, k))
        assert g_pass_at_k(n, c, k, tau) == pytest.approx(expected, abs=1e-12), (n, c, k, tau)


def test_g_pass_tau_zero_is_pass_at_k():
    for n, c, k, _ in random_cases(200, seed=3):
        assert g_pass_at_k(n, c, k, 0.0) == pytest.approx(pass_at_k(n, c, k), abs=1e-12)
        # Any tau <= 1/k asks for a single correct draw as well.
        assert g_pass_at_k(n, c, k, 1.0 / k) == pytest.approx(pass_at_k(n, c, k), abs=1e-12)


def test_g_pass_tau_one_is_all_correct():
    for n, c, k, _ in random_cases(100, seed=4):
        expected = math.comb(c, k) / math.comb(n, k)
        assert g_pass_at_k(n, c, k, 1.0) == pytest.approx(expected, abs=1e-12)


def test_mg_pass_matches_definition_by_enumeration():
    for n, c, k, _ in random_cases(200, seed=5):
        start = math.ceil(k / 2) + 1
        expected = 2.0 / k * sum(brute_at_least(n, c, k, i) for i in range(start, k + 1))
        assert mg_pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12), (n, c, k)


def test_mg_pass_known_values():
    assert mg_pass_at_k(8, 8, 8) == pytest.approx(1.0)  # every tau in (0.5, 1] is met
    assert mg_pass_at_k(8, 0, 8) == 0.0
    assert mg_pass_at_k(5, 5, 1) == 0.0  # the (0.5, 1] grid is empty for k = 1


def test_tau_threshold_is_robust_to_float_products():
    assert tau_threshold(0.7, 10) == 7
    assert tau_threshold(0.3, 10) == 3  # 0.3 * 10 == 3.0000000000000004 in floats
    assert tau_threshold(0.0, 8) == 1
    assert tau_threshold(1.0, 8) == 8
    assert tau_threshold(3 / 8, 8) == 3
    assert g_pass_at_k(10, 7, 10, 0.7) == 1.0  # 7 correct out of 10, all drawn: exactly 7


def test_large_n_is_stable():
    assert pass_at_k(1000, 1, 500) == pytest.approx(0.5)
    assert pass_at_k(2000, 0, 1000) == 0.0
    value = g_pass_at_k(3000, 1500, 1000, 0.5)  # binomials far beyond float range
    assert 0.5 < value < 1.0
    assert prob_at_least(3000, 1500, 1000, 0) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: pass_at_k(4, 2, 5), "k=5 must be <= n=4"),
        (lambda: pass_at_k(4, 2, 0), "k=0 must be >= 1"),
        (lambda: pass_at_k(4, 5, 2), "c=5"),
        (lambda: pass_at_k(0, 0, 1), "n=0"),
        (lambda: g_pass_at_k(4, 2, 5, 0.5), "k=5 must be <= n=4"),
        (lambda: g_pass_at_k(4, 2, 2, -0.1), "tau=-0.1"),
        (lambda: g_pass_at_k(4, 2, 2, 1.5), "tau=1.5"),
        (lambda: g_pass_at_k(4, 2, 2, float("nan")), "tau=nan"),
        (lambda: mg_pass_at_k(3, 1, 4), "k=4 must be <= n=3"),
    ],
)
def test_errors_name_the_bad_value(call, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        call()


def test_coverage_and_mean_accuracy():
    flags = [[True, False, False, False], [False] * 4, [True] * 4]
    assert coverage(flags) == pytest.approx(2 / 3)
    assert mean_accuracy(flags) == pytest.approx((0.25 + 0 + 1) / 3)
    with pytest.raises(ValueError):
        coverage([])
    with pytest.raises(ValueError, match="problem 1"):
        mean_accuracy([[True], []])


def test_canonical_answer():
    assert canonical_answer("1,000") == "1000"
    assert canonical_answer("2.50") == "2.5"
    assert canonical_answer(" 3.0. ") == "3"
    assert canonical_answer("$18$") == "18"
    assert canonical_answer("\\left( 3, \\frac{\\pi}{2} \\right)") == "( 3, \\frac{\\pi}{2} )"
    assert canonical_answer("10\\!000") == "10000"
    assert canonical_answer("x  +\\, 1") == "x + 1"
    assert canonical_answer("1,2") == "1,2"  # a pair, not a thousands separator
    assert canonical_answer("  ") is None
    assert canonical_answer(None) is None


def test_majority_vote():
    # "1,000" and "1000.0" are one answer; the vote wins 3 to 2; any correct sample in it counts.
    answers = ["1,000", "7", "1000.0", "7", "1000"]
    assert majority_answer(answers) == "1000"
    assert majority_vote(answers, [False, True, False, True, True]) is True
    assert majority_vote(answers, [False, True, False, True, False]) is False
    # Ties go to the answer seen first; None never wins.
    assert majority_answer(["b", "a", "a", "b"]) == "b"
    assert majority_answer([None, None, "5"]) == "5"
    assert majority_vote([None, None, None], [True, True, True]) is False
    with pytest.raises(ValueError, match="len"):
        majority_vote(["1"], [True, False])


def test_bootstrap_contains_mean_and_narrows():
    rng = np.random.default_rng(123)
    small = rng.integers(0, 2, size=20).astype(float)
    large = rng.integers(0, 2, size=2000).astype(float)
    lo_s, hi_s = bootstrap_ci(small)
    lo_l, hi_l = bootstrap_ci(large)
    assert lo_s <= small.mean() <= hi_s
    assert lo_l <= large.mean() <= hi_l
    assert hi_l - lo_l < (hi_s - lo_s) / 3
    assert bootstrap_ci(small, seed=7) == bootstrap_ci(small, seed=7)


def test_bootstrap_edge_cases():
    assert bootstrap_ci([0.25]) == (0.25, 0.25)
    assert bootstrap_ci([1.0, 1.0, 1.0]) == (1.0, 1.0)
    with pytest.raises(ValueError, match="empty"):
        bootstrap_ci([])
    with pytest.raises(ValueError, match="alpha=1.5"):
        bootstrap_ci([1.0, 0.0], alpha=1.5)


def test_summarize():
    records = [
        {"n": 8, "c": 8, "majority_correct": True},
        {"n": 8, "c": 4, "majority_correct": True},
        {"n": 8, "c": 1, "majority_correct": False},
        {"n": 8, "c": 0, "majority_correct": False},
    ]
    out = summarize(records, n_boot=200)
    json.dumps(out)  # JSON-friendly
    assert out["problems"] == 4 and out["samples"] == 8
    m = out["metrics"]
    assert m["accuracy"]["mean"] == pytest.approx((1 + 0.5 + 0.125 + 0) / 4)
    assert m["coverage@n"]["mean"] == pytest.approx(0.75)
    assert m["pass@8"]["mean"] == pytest.approx(0.75)
    assert m["pass@1"]["mean"] == pytest.approx(m["accuracy"]["mean"])
    assert {"pass@1", "pass@2", "pass@4", "pass@8"} <= set(m)
    assert m["g_pass@8_cov"]["mean"] == pytest.approx(0.75)
    assert m["g_pass@8_tau0.5"]["mean"] == pytest.approx(0.5)  # c=8 and c=4 meet 4 of 8
    assert m["g_pass@8_tau1"]["mean"] == pytest.approx(0.25)
    assert m["g_pass@8_atleast4"]["mean"] == pytest.approx(m["g_pass@8_tau0.5"]["mean"])
    assert [f"g_pass@8_atleast{i}" for i in range(1, 9)] == [k for k in m if "atleast" in k]
    assert m["mg_pass@8"]["mean"] == pytest.approx(np.mean([mg_pass_at_k(8, r["c"], 8) for r in records]))
    assert m["majority_vote"]["mean"] == pytest.approx(0.5)
    for stats in m.values():
        assert stats["low"] <= stats["mean"] + 1e-12 and stats["mean"] <= stats["high"] + 1e-12


def test_summarize_small_n_and_errors():
    out = summarize([{"n": 3, "c": 1}, {"n": 3, "c": 2}], n_boot=50)
    assert "g_pass@3_tau0.5" in out["metrics"] and "pass@2" in out["metrics"]
    assert "pass@4" not in out["metrics"] and "majority_vote" not in out["metrics"]
    with pytest.raises(ValueError, match="empty"):
        summarize([])
    with pytest.raises(ValueError, match="record 1 has no 'c'"):
        summarize([{"n": 2, "c": 1}, {"n": 2}])
    with pytest.raises(ValueError, match="record 1 has no 'majority_correct'"):
        summarize([{"n": 2, "c": 1, "majority_correct": True}, {"n": 2, "c": 1}])


def test_paired_difference_against_a_loop_reference():
    rng = np.random.default_rng(1)
    a = rng.random((3, 40))
    b = a - 0.1 + 0.05 * rng.standard_normal((3, 40))
    # One seed: the percentile bootstrap over problems, written as loops.
    got = intervals.paired_difference(a[:1], b[:1], n_boot=300, seed=7)
    ref_rng = np.random.default_rng(7)
    means = []
    for _ in range(300):
        ref_rng.integers(0, 1, size=1)  # the seed drawn (always seed 0)
        problems = ref_rng.integers(0, 40, size=40)
        means.append(sum(a[0, p] - b[0, p] for p in problems) / 40)
    assert got["mean"] == pytest.approx(float((a[0] - b[0]).mean()))
    assert (got["low"], got["high"]) == pytest.approx((np.quantile(means, 0.025), np.quantile(means, 0.975)))
    assert got["interval"] == "bootstrap over problems (1 seed)"
    # 3 seeds: the seeds' part with t(2), the problems' with the normal, written out here.
    got = intervals.paired_difference(a, b)
    d = a - b
    seed_means = [sum(d[s]) / 40 for s in range(3)]
    problem_means = [sum(d[:, p]) / 3 for p in range(40)]
    seed_half = 4.303 * statistics.stdev(seed_means) / 3**0.5
    problem_half = 1.959964 * statistics.stdev(problem_means) / 40**0.5
    half = (seed_half**2 + problem_half**2) ** 0.5
    assert (got["low"], got["high"]) == pytest.approx((d.mean() - half, d.mean() + half))
    assert got["interval"] == "t over 3 seeds, with problems"
    assert 0 < got["low"] < 0.1 < got["high"] < 0.2  # the true shift 0.1 is inside, 0 is outside
    # Pairing matters: a shared per-problem difficulty cancels, so the interval is narrow.
    hard = rng.random(40)[None, :] * np.ones((3, 1))
    paired = intervals.paired_difference(hard + 0.01, hard, n_boot=200)
    assert paired["high"] - paired["low"] < 1e-9


def test_paired_intervals_cover_the_truth_at_many_seeds():
    """1,000 simulated studies d[s, p] = mu + seed effect + problem effect + noise, 10 seeds x 240 problems: the 95%
    interval holds mu in at least 94.5% of them (95.5% here; the two-way bootstrap it replaced held it in 92.9%)."""
    rng = np.random.default_rng(0)
    held = 0
    for _ in range(1000):
        d = 0.03 + rng.normal(0, 0.04, (10, 1)) + rng.normal(0, 0.1, (1, 240)) + rng.normal(0, 0.1, (10, 240))
        got = intervals.paired_difference(d, np.zeros_like(d))
        held += got["low"] <= 0.03 <= got["high"]
    assert held / 1000 >= 0.945, held / 1000


def test_paired_difference_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="one shape"):
        intervals.paired_difference([[1.0, 0.0]], [[1.0]])


def test_group_metrics_measure_each_bridge_group_not_random_subsets():
    """The issue's case: one group of 8 all right, one with 2 right. Half the groups are all right, while the pooled
    G-Pass@8 at tau = 1 (8 drawn from all 16) is C(10, 8) / C(16, 8) = 0.0035."""
    from bridgelm.eval.metrics import benchmark_metrics, group_columns

    correct = [True] * 8 + [True, True] + [False] * 6
    answers = ["5"] * 8 + ["5", "5", "3", "3", "3", "1", "1", "1"]
    score = {"n": 16, "c": 10, "correct": correct, "answers": answers, "majority_correct": True, "lengths": [4] * 16,
             "finished": [True] * 16}
    cols = group_columns([score], 8)
    assert cols["group_all_correct"] == [0.5] and cols["pass@w"] == [1.0]
    assert cols["group_majority"] == [0.5]  # group 2's vote is "3" (3 against 2 and 3: "3" seen first), wrong
    assert cols["group_g_pass@w_tau0.25"] == [1.0] and cols["group_g_pass@w_tau0.5"] == [0.5]
    m = benchmark_metrics([score], gpass_k=8, max_new_tokens=4, group_width=8)
    assert m["group_size"] == 8 and m["metrics"]["group_all_correct"]["mean"] == 0.5
    assert m["metrics"]["g_pass@8_tau1"]["mean"] == pytest.approx(45 / 12870)  # the pooled one: groups mixed
    assert m["metrics"]["coverage@n"]["mean"] == 1.0 and "coverage" not in m["metrics"]
    # at n = 16 with one correct sample: coverage@16 is 1, the paper's coverage at w = 8 is 0.5
    one = dict(score, c=1, correct=[True] + [False] * 15, answers=["5"] + ["3"] * 15, majority_correct=False)
    m = benchmark_metrics([one], gpass_k=8, max_new_tokens=4, group_width=8)
    assert m["metrics"]["coverage@n"]["mean"] == 1.0 and m["metrics"]["pass@w"]["mean"] == 0.5
    assert "pass@w" not in benchmark_metrics([one], gpass_k=8, max_new_tokens=4)["metrics"]  # width 1: no groups
    with pytest.raises(ValueError, match=r"16 samples: expected groups of width 5"):
        group_columns([score], 5)


def test_t_quantiles_match_scipy():
    from scipy import stats

    for df in range(1, 201):
        assert intervals.t_975(df) == pytest.approx(stats.t.ppf(0.975, df), abs=1e-3)


def test_a_few_seeds_that_disagree_widen_the_interval():
    """3 seeds whose effects differ much more than problems do: the bootstrap's interval is narrow, the t-interval
    over seed means is the one reported."""
    rng = np.random.default_rng(0)
    shift = np.array([0.0, 0.1, 0.2])[:, None]
    a = rng.random((3, 200)) * 0.01 + shift
    got = intervals.paired_difference(a, np.zeros_like(a), n_boot=200)
    assert got["interval"] == "t over 3 seeds, with problems" and got["low"] < 0 < 0.2 < got["high"]

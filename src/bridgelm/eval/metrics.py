"""Set metrics over n sampled answers per problem, of which c are correct (paper Sec. 4.3).

Design notes:
- Every estimator takes only (n, c, k[, tau]): which samples were correct does not matter, only how
  many, because all of them are expectations over draws of k samples without replacement.
- Pass@k uses the stable product form (no huge binomials); G-Pass@k_tau uses exact integer
  binomials and one correctly rounded division, so it is exact up to the final float.
- tau enters only through the threshold m = ceil(tau * k) ("at least m of k correct"), which is
  computed with a small tolerance so that 0.7 * 10 counts as 7, not 8.
- Intervals are percentile bootstraps over problems, with an explicit seeded generator.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from bridgelm.errors import check_int
from bridgelm.intervals import bootstrap_ci
from bridgelm.tasks.answers import canonical_number

# Slack when turning tau * k into an integer threshold (tau * k is a float product).
_TAU_EPS = 1e-9

# Default G-Pass width: the paper reports G-Pass@8_tau.
_GPASS_K = 8

# Fractions tau of the G-Pass@k_tau summary columns (0 is reported as coverage, "cov").
_SUMMARY_TAUS = (0.25, 0.5, 0.75, 1.0)


def _check_counts(n: int, c: int, k: int) -> None:
    """Validate a (samples, correct, draws) triple: 1 <= n, 0 <= c <= n, 1 <= k <= n."""
    for name, value, low, high in (("n", n, 1, None), ("c", c, 0, n), ("k", k, 1, n)):
        check_int(name, value, 0)
        if value < low or (high is not None and value > high):
            raise ValueError(f"{name}={value} must be {f'>= {low}' if value < low else f'<= n={n}'}")


def _check_tau(tau: float) -> None:
    """Validate a fraction of correct draws."""
    if not (isinstance(tau, (int, float, np.floating)) and 0.0 <= float(tau) <= 1.0):
        raise ValueError(f"tau={tau!r} must be a number in [0, 1]")


def tau_threshold(tau: float, k: int) -> int:
    """Minimum number of correct draws out of k that G-Pass@k_tau asks for: max(1, ceil(tau k)).

    tau = 0 means "at least one", so G-Pass@k_0 is Pass@k (the paper's coverage limit).
    """
    _check_tau(tau)
    return max(1, math.ceil(float(tau) * k - _TAU_EPS))


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased Pass@k = 1 - C(n-c, k) / C(n, k), as a product of ratios (no large binomials)."""
    _check_counts(n, c, k)
    if n - c < k:
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def prob_at_least(n: int, c: int, k: int, m: int) -> float:
    """P(at least m correct among k draws without replacement from n samples, c correct).

    Hypergeometric tail sum_{j=m}^{min(c,k)} C(c,j) C(n-c,k-j) / C(n,k) in exact integers.
    """
    _check_counts(n, c, k)
    if not 0 <= m <= k:
        raise ValueError(f"m={m} must be in [0, k={k}]")
    numerator = sum(math.comb(c, j) * math.comb(n - c, k - j) for j in range(m, min(c, k) + 1))
    return numerator / math.comb(n, k)  # int / int is correctly rounded even for huge values


def g_pass_at_k(n: int, c: int, k: int, tau: float) -> float:
    """G-Pass@k_tau (Liu et al. 2024): P(at least ceil(tau k) of k draws are correct); tau=0 is Pass@k."""
    _check_counts(n, c, k)
    return prob_at_least(n, c, k, tau_threshold(tau, k))


def mg_pass_at_k(n: int, c: int, k: int) -> float:
    """mG-Pass@k = (2/k) sum_{i=ceil(k/2)+1}^{k} G-Pass@k_{i/k}, the mean over tau in (0.5, 1].

    Liu et al.'s discretisation, meant for even k: its sum has k/2 terms only where k is even, so a model always right
    scores 1 at even k, (k - 1) / k at odd k (2/3 at k = 3), and 0 at k = 1 (an empty sum).
    """
    _check_counts(n, c, k)
    total = sum(prob_at_least(n, c, k, i) for i in range(math.ceil(k / 2) + 1, k + 1))
    return 2.0 * total / k


def _check_lists(lists: Sequence[Sequence], name: str, what: str) -> None:
    """ValueError unless `lists` holds one non-empty list of `what` per problem."""
    empty = next((i for i, x in enumerate(lists) if len(x) == 0), None)
    if not lists or empty is not None:
        where = f"{name} is empty" if not lists else f"problem {empty} has no {what}"
        raise ValueError(f"{where}: expected one non-empty list of {what} per problem")


def mean_accuracy(correct_lists: Sequence[Sequence[bool]]) -> float:
    """Mean over problems of the fraction of correct samples (Pass@1)."""
    _check_lists(correct_lists, "correct_lists", "flags")
    return float(np.mean([sum(bool(f) for f in flags) / len(flags) for flags in correct_lists]))


def coverage(correct_lists: Sequence[Sequence[bool]]) -> float:
    """Fraction of problems with at least one correct sample (Pass@n)."""
    _check_lists(correct_lists, "correct_lists", "flags")
    return float(np.mean([any(bool(f) for f in flags) for flags in correct_lists]))


def canonical_answer(text: str | None) -> str | None:
    """Normal form of a parsed answer for voting; None when there is nothing to vote for.

    Removes `$`, `\\left`/`\\right`, LaTeX spacing (`\\!`, `\\,`, `\\;`), a trailing period and
    redundant whitespace; numbers become canonical decimals ("1,000" -> "1000", "2.50" -> "2.5",
    "3.0" -> "3"). Purely textual: "0.5" and "\\frac{1}{2}" stay different answers.
    """
    if text is None:
        return None
    s = str(text)
    for noise in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\$", "$"):
        s = s.replace(noise, "")
    s = " ".join(s.split()).rstrip(".").strip()
    if not s:
        return None
    number = canonical_number(s)
    return number if number is not None else s


def majority_answer(answers: Sequence[str | None]) -> str | None:
    """Most common canonical answer (first seen wins ties); None answers never win."""
    canon = [canonical_answer(a) for a in answers]
    counts = Counter(a for a in canon if a is not None)
    if not counts:
        return None
    best = max(counts.values())
    return next(a for a in canon if a is not None and counts[a] == best)


def majority_vote(answers: Sequence[str | None], correct_flags: Sequence[bool]) -> bool:
    """Is the self-consistency answer correct?

    The vote picks the most common canonical answer; it is counted correct if any sample with that
    canonical answer was graded correct (the grader's judgment, which may accept forms that the
    textual canonicalisation does not merge). All-None answers give False.
    """
    if len(answers) != len(correct_flags):
        raise ValueError(f"len(answers)={len(answers)} must equal len(correct_flags)={len(correct_flags)}")
    winner = majority_answer(answers)
    if winner is None:
        return False
    return any(bool(flag) for a, flag in zip(answers, correct_flags) if canonical_answer(a) == winner)


def _tau_key(tau: float) -> str:
    """Short JSON-friendly spelling of tau: 0.5 -> "0.5", 1.0 -> "1"."""
    return f"{tau:g}"


def summarize(
    per_problem: Sequence[dict],
    gpass_k: int = _GPASS_K,
    n_boot: int = 1000,
    alpha: float = 0.05,
    seed: int = 0,
) -> dict:
    """Benchmark summary from per-problem records {"n": samples, "c": correct[, "majority_correct"]}.

    Returns {"problems": P, "samples": n, "metrics": {name: {"mean", "low", "high"}}} where the
    metrics are accuracy (mean c/n), coverage@n (c > 0), pass@k for k = 1, 2, 4, ... <= n,
    G-Pass@k_tau with k = min(gpass_k, n) for tau = 0 ("cov"), 0.25, 0.5, 0.75, 1 and for every
    count threshold m = 1..k ("atleast{m}", the paper's tau*k axis), mG-Pass@k and, when the
    records carry it, majority-vote accuracy. Every interval resamples the same problems (same seed).
    When n differs between problems, the k values are limited by the smallest n.
    """
    ns, cs = _counts(per_problem)
    n_min = min(ns)
    columns = _count_columns(ns, cs, min(gpass_k, n_min))
    vote = _vote_column(per_problem)
    if vote is not None:
        columns["majority_vote"] = vote
    metrics = with_intervals(columns, n_boot=n_boot, alpha=alpha, seed=seed)
    return {"problems": len(per_problem), "samples": n_min, "metrics": metrics}


def _counts(per_problem: Sequence[dict]) -> tuple[list[int], list[int]]:
    """(samples, correct) of every problem record, each checked."""
    if not per_problem:
        raise ValueError("per_problem is empty: expected one record per problem")
    ns, cs = [], []
    for i, rec in enumerate(per_problem):
        for field in ("n", "c"):
            if field not in rec:
                raise ValueError(f"record {i} has no {field!r} field: expected keys 'n' and 'c'")
        _check_counts(int(rec["n"]), int(rec["c"]), 1)
        ns.append(int(rec["n"]))
        cs.append(int(rec["c"]))
    return ns, cs


def _count_columns(ns: list[int], cs: list[int], k_g: int) -> dict[str, list[float]]:
    """Per-problem values of every count metric: accuracy, coverage, pass@k, G-Pass@k_g and mG-Pass@k_g."""
    n_min = min(ns)
    columns: dict[str, list[float]] = {
        "accuracy": [c / n for n, c in zip(ns, cs)],
        "coverage@n": [float(c > 0) for c in cs],  # at least one of all n right (pooled; the paper's is pass@w)
    }
    k = 1
    while k <= n_min:
        columns[f"pass@{k}"] = [pass_at_k(n, c, k) for n, c in zip(ns, cs)]
        k *= 2
    columns[f"g_pass@{k_g}_cov"] = [g_pass_at_k(n, c, k_g, 0.0) for n, c in zip(ns, cs)]
    for name, tau in _gpass_names(k_g).items():
        columns[name] = [g_pass_at_k(n, c, k_g, tau) for n, c in zip(ns, cs)]
    for m in range(1, k_g + 1):
        columns[f"g_pass@{k_g}_atleast{m}"] = [prob_at_least(n, c, k_g, m) for n, c in zip(ns, cs)]
    columns[f"mg_pass@{k_g}"] = [mg_pass_at_k(n, c, k_g) for n, c in zip(ns, cs)]
    return columns


def _vote_column(per_problem: Sequence[dict]) -> list[float] | None:
    """Majority-vote correctness of every problem, when the records carry it (all or none of them)."""
    with_vote = [i for i, rec in enumerate(per_problem) if "majority_correct" in rec]
    if with_vote and len(with_vote) != len(per_problem):
        missing = next(i for i, rec in enumerate(per_problem) if "majority_correct" not in rec)
        raise ValueError(f"record {missing} has no 'majority_correct' field: expected it in all records or none")
    return [float(bool(rec["majority_correct"])) for rec in per_problem] if with_vote else None


def with_intervals(columns: dict[str, list[float]], n_boot: int = 1000, alpha: float = 0.05, seed: int = 0) -> dict:
    """{name: per-problem values} -> {name: {"mean", "low", "high"}}, each interval resampling the same problems."""
    metrics = {}
    for name, values in columns.items():
        low, high = bootstrap_ci(values, n_boot=n_boot, alpha=alpha, seed=seed)
        metrics[name] = {"mean": float(np.mean(values)), "low": low, "high": high}
    return metrics


def group_columns(scores: Sequence[dict], width: int) -> dict[str, list[float]]:
    """Set metrics of the Bridge groups themselves: per problem, the mean over its groups (`width` consecutive
    samples of its "correct" and "answers") of Pass@w (at least one right: the paper's coverage at the group size),
    all right, the group's majority vote right, and G-Pass@w_tau (at least ceil(tau x w) right) at every summary tau.
    Unlike the pooled G-Pass@k, which draws k of all n samples and so mixes groups, each number is of a real group."""
    names = ["pass@w", "group_all_correct", "group_majority"] + [f"group_g_pass@w_tau{_tau_key(t)}" for t in _SUMMARY_TAUS]
    columns: dict[str, list[float]] = {name: [] for name in names}
    for s in scores:
        correct, answers = list(s["correct"]), list(s["answers"])
        if len(correct) % width:
            raise ValueError(f"problem {s.get('index')} has {len(correct)} samples: expected groups of width {width}")
        groups = [range(i, i + width) for i in range(0, len(correct), width)]
        counts = [sum(bool(correct[j]) for j in g) for g in groups]
        cells = {
            "pass@w": [float(c > 0) for c in counts],
            "group_all_correct": [float(c == width) for c in counts],
            "group_majority": [float(majority_vote([answers[j] for j in g], [correct[j] for j in g])) for g in groups],
        }
        for t in _SUMMARY_TAUS:
            cells[f"group_g_pass@w_tau{_tau_key(t)}"] = [float(c >= tau_threshold(t, width)) for c in counts]
        for name, values in cells.items():
            columns[name].append(float(np.mean(values)))
    return columns


def summarize_scores(
    score_lists: Sequence[Sequence[float]], n_boot: int = 1000, alpha: float = 0.05, seed: int = 0
) -> dict:
    """Benchmark summary of a continuous score (ROUGE), one list of per-sample scores per problem.

    Returns {"problems": P, "samples": n, "metrics": {"score", "score_variance"}}, each {"mean", "low", "high"}:
    `score` is the mean over problems of each problem's mean score; `score_variance` the mean over problems of
    the variance of the scores within a problem's response set (population variance, ddof=0: the spread of the
    set itself; the paper's Table 5). Pass@k and G-Pass need correct/incorrect and are not defined here.
    """
    _check_lists(score_lists, "score_lists", "scores")
    columns = {
        "score": [float(np.mean(s)) for s in score_lists],
        "score_variance": [float(np.var(np.asarray(s, dtype=np.float64))) for s in score_lists],
    }
    metrics = with_intervals(columns, n_boot=n_boot, alpha=alpha, seed=seed)
    return {"problems": len(score_lists), "samples": min(len(s) for s in score_lists), "metrics": metrics}


# ---------------------------------------------------------------------------------------------- an eval run's metrics
# Per-problem score lines (bridgelm.eval.score) -> the metrics of one (benchmark, width), at every generation budget, and
# their unweighted average over benchmarks. Budgets (Figure 6) come from one long run: generation is
# prefix-consistent, so at budget L a sample counts when it finished within L tokens and is correct.


def budgets(max_new_tokens: int) -> list[int]:
    """Generation budgets of the length curves: powers of two below max_new_tokens, then max_new_tokens."""
    out, L = [], 1
    while L < max_new_tokens:
        out.append(L)
        L *= 2
    return out + [max_new_tokens]


def _gpass_names(k: int) -> dict[str, float]:
    """G-Pass@k_tau names of the summary columns, each with its tau."""
    return {f"g_pass@{k}_tau{_tau_key(t)}": t for t in _SUMMARY_TAUS}


def budget_metrics(scores: Sequence[dict], budget: int, gpass_k: int) -> dict[str, float]:
    """Accuracy, coverage and G-Pass@k_tau when only samples that finished within `budget` tokens count."""
    ns, cs = [], []
    for s in scores:
        ns.append(s["n"])
        cs.append(
            sum(ok and fin and length <= budget for ok, fin, length in zip(s["correct"], s["finished"], s["lengths"]))
        )
    k = min(gpass_k, min(ns))
    out = {
        "accuracy": float(np.mean([c / n for n, c in zip(ns, cs)])),
        "coverage@n": float(np.mean([c > 0 for c in cs])),
    }
    for name, tau in _gpass_names(k).items():
        out[name] = float(np.mean([g_pass_at_k(n, c, k, tau) for n, c in zip(ns, cs)]))
    out[f"mg_pass@{k}"] = float(np.mean([mg_pass_at_k(n, c, k) for n, c in zip(ns, cs)]))
    return out


def _score_within(score: dict, budget: int) -> float:
    """Mean score of a problem's samples when those not finished within `budget` tokens score 0."""
    kept = zip(score["scores"], score["finished"], score["lengths"])
    return float(np.mean([v if fin and n <= budget else 0.0 for v, fin, n in kept]))


def continuous_metrics(scores: Sequence[dict], max_new_tokens: int) -> dict[str, Any]:
    """`summarize_scores` of one (benchmark, width) of a continuous task, plus response length, finished
    fraction and budgets (at budget L a sample keeps its score when it finished within L tokens, else 0)."""
    summary = summarize_scores([s["scores"] for s in scores])
    summary["mean_length"] = float(np.mean([x for s in scores for x in s["lengths"]]))
    summary["finished"] = float(np.mean([x for s in scores for x in s["finished"]]))
    summary["budgets"] = {
        str(L): {"score": float(np.mean([_score_within(s, L) for s in scores]))} for L in budgets(max_new_tokens)
    }
    summary["truncated"] = sum(1 for s in scores if s.get("truncated"))
    return summary


def benchmark_metrics(
    scores: Sequence[dict], gpass_k: int, max_new_tokens: int, group_width: int = 1
) -> dict[str, Any]:
    """`summarize` of one (benchmark, width), plus response length, finished fraction and budgets; with
    `group_width` > 1 (samples drawn in Bridge groups of that width) also the groups' own set metrics
    (`group_columns`) and "group_size".

    Problems of a continuous task (score lines with "scores") get `continuous_metrics` instead.
    """
    if scores and "scores" in scores[0]:
        return continuous_metrics(scores, max_new_tokens)
    summary = summarize(
        [{"n": s["n"], "c": s["c"], "majority_correct": s["majority_correct"]} for s in scores], gpass_k=gpass_k
    )
    lengths = [x for s in scores for x in s["lengths"]]
    finished = [x for s in scores for x in s["finished"]]
    summary["mean_length"] = float(np.mean(lengths))
    summary["finished"] = float(np.mean(finished))
    summary["budgets"] = {str(L): budget_metrics(scores, L, gpass_k) for L in budgets(max_new_tokens)}
    if group_width > 1:
        summary["metrics"].update(with_intervals(group_columns(scores, group_width)))
        summary["group_size"] = group_width
    return summary


def average_metrics(entries: dict[str, dict]) -> dict[str, Any]:
    """Unweighted mean over benchmarks (the paper's Avg) of every number they all have; means only."""
    parts = list(entries.values())
    names = [m for m in parts[0]["metrics"] if all(m in p["metrics"] for p in parts)]
    out: dict[str, Any] = {
        "benchmarks": list(entries),
        "problems": sum(p["problems"] for p in parts),
        "metrics": {m: {"mean": float(np.mean([p["metrics"][m]["mean"] for p in parts]))} for m in names},
        "mean_length": float(np.mean([p["mean_length"] for p in parts])),
        "finished": float(np.mean([p["finished"] for p in parts])),
    }
    common = [L for L in parts[0]["budgets"] if all(L in p["budgets"] for p in parts)]
    out["budgets"] = {
        L: {
            m: float(np.mean([p["budgets"][L][m] for p in parts]))
            for m in parts[0]["budgets"][L]
            if all(m in p["budgets"][L] for p in parts)
        }
        for L in common
    }
    return out

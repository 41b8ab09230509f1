"""Scoring an eval run: every sample graded by its task, per-problem score lines, and the run's metrics.

Design notes:
- Scoring reads only the run folder (run.json and the samples files that bridgelm.eval.runner wrote, read back by
  bridgelm.eval.folder) and the data files, checked against the digests recorded at sampling time, so it can be
  re-run alone: after a grader fix, with another G-Pass k, on a partial run (`allow_partial` lists the problems
  missing).
- A sample is correct when its reward is the full reward (`bridgelm.tasks.base.is_correct`). Continuous scores
  (summarisation's ROUGE-1, `Task.continuous`): a problem's score line holds its per-sample scores, their mean and
  variance, and the metrics are the mean score (`rouge1` in metrics.json) and the mean per-prompt variance
  (`score_variance`), not pass@k / G-Pass / majority.
- Outputs: RUN_DIR/scores.jsonl (one line per benchmark, width and problem) and RUN_DIR/metrics.json (per benchmark
  and width, and their average; bridgelm.eval.metrics computes them, generation budgets included).

    bridgelm score runs/x [--allow-partial]
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from bridgelm.errors import UserError
from bridgelm.eval import metrics as M
from bridgelm.eval.datasets import Benchmark, benchmark_difference, load_benchmarks
from bridgelm.eval.folder import read_eval_run, read_samples
from bridgelm.jsonl import check_free, exclusive, write_atomic, write_json
from bridgelm.progress import bar as progress_bar
from bridgelm.runs import FORMATS
from bridgelm.samples import empty_note
from bridgelm.tasks import Task
from bridgelm.tasks.base import is_correct

METRICS_FILE = "metrics.json"  # the run's metrics (per benchmark and width, and their average)
SCORES_FILE = "scores.jsonl"  # one score line per (benchmark, width, problem)

CONTINUOUS = "rouge1"  # the name of a continuous task's score (summarisation's ROUGE-1 F1) in metrics.json

# Completions graded per reward_many call (the progress bar moves once per batch).
GRADE_BATCH = 256


def _grading_benchmarks(run: dict, task: Task | None) -> list[Benchmark]:
    """The run's benchmarks re-read for grading, checked against the digests recorded at sampling time."""
    from bridgelm import tasks

    paths = [b["path"] for b in run["benchmarks"]]
    if task is not None:
        benches = load_benchmarks(task, [], run.get("limit"))
    elif run["task"] not in tasks.REGISTRY:
        raise UserError(
            f"run.json names task {run['task']!r}, which is not in the task registry: score the run with "
            "score_run(run_dir, task=<the Task object>)"
        )
    else:
        benches = load_benchmarks(run["task"], [p for p in paths if p is not None], run.get("limit"), run["split"])
    _benchmark_check(run, benches)
    return benches


def _benchmark_check(run: dict, benches: list[Benchmark]) -> None:
    old = run["benchmarks"]
    new = [b.describe() for b in benches]
    for a, b in zip(old, new):
        b["path"] = a["path"]  # a data file read from elsewhere is fine if its content is the same
    if [b["name"] for b in old] != [b["name"] for b in new] or any(
        (a["problems"], a["digest"]) != (b["problems"], b["digest"]) for a, b in zip(old, new)
    ):
        hint = ""
        if any(b["path"] is None for b in old):
            hint = "; a run of a Task object's own examples is graded with score_run(run_dir, task=<that Task>)"
        raise UserError(f"cannot grade the run: {benchmark_difference(old, new)}{hint}")


def _problem_score(rec: dict, rewards: list[float], task: Task) -> dict[str, Any]:
    """One line of scores.jsonl: a problem's continuous scores, or its correctness, answers and majority vote."""
    samples = rec["samples"]
    head = {"benchmark": rec["benchmark"], "width": int(rec["width"]), "index": int(rec["index"]), "n": len(rewards)}
    ends = {"lengths": [len(s["token_ids"]) for s in samples], "finished": [bool(s["finished"]) for s in samples]}
    if task.continuous:
        spread = {"scores": list(rewards), "mean": float(np.mean(rewards)), "variance": float(np.var(rewards))}
        return {**head, **spread, **ends, "truncated": bool(rec.get("truncated"))}
    answers = [task.extract(task.graded_text(s["text"], bool(s["finished"]))) for s in samples]
    correct = [is_correct(r) for r in rewards]
    return {
        **head,
        "c": sum(correct),
        "correct": correct,
        "answers": answers,
        **ends,
        "majority": M.majority_answer(answers),
        "majority_correct": M.majority_vote(answers, correct),
    }


def score_run(
    run_dir: str | os.PathLike, task: Task | None = None, allow_partial: bool = False, progress: bool = True
) -> dict[str, Any]:
    """Grade every sample of a run; write RUN_DIR/scores.jsonl and RUN_DIR/metrics.json; return the metrics.

    `task` grades a run of a Task object that is not in the registry. A run that misses problems is a
    ValueError unless `allow_partial`, which scores the problems present and lists the missing ones. The run folder
    is locked meanwhile: an eval still sampling into it, or a second score, is refused at once.
    """
    run_dir = Path(run_dir)
    check_free(run_dir, "run folder", folder=True)  # an eval still sampling into it: refused first
    read_eval_run(run_dir)  # not an eval run: refused before a lock file is made in it
    with exclusive(run_dir, "run folder", folder=True):
        return _score_locked(run_dir, task, allow_partial, progress)


def _score_locked(run_dir: Path, task: Task | None, allow_partial: bool, progress: bool) -> dict[str, Any]:
    """score_run's work, under the lock of the run folder."""
    run = read_eval_run(run_dir)
    records = read_samples(run_dir)
    benches = _grading_benchmarks(run, task)
    widths = [int(w) for w in run["widths"]]
    missing = _missing_problems(run_dir, run, records, benches, allow_partial)
    samples = sum(len(r["samples"]) for r in records.values())
    bar = progress_bar(samples, f"grading -> {run_dir / METRICS_FILE}", "sample", enabled=progress)
    try:
        scores = [s for b in benches for s in _grade_benchmark(b, widths, records, bar)]
    finally:
        bar.close()
    gpass_k = min(run["gpass_k"], run["n"])  # the k used: capped at n
    result: dict[str, Any] = {
        "format": FORMATS["eval"],
        "run": {k: run.get(k) for k in ("model", "blocks", "task", "n", "widths", "width", "max_new_tokens", "chat")},
        "samples": samples,
        "empty_samples": sum(not s["text"].strip() for r in records.values() for s in r["samples"]),
        "gpass_k": gpass_k,
        "benchmarks": {},
        "avg": {},
        # a partial run (allow_partial): problems not sampled, by "benchmark w=width" (widths with none included)
        "partial": {f"{b} w={w}": len(v) for (b, w), v in missing.items() if v},
    }
    for b in benches:
        for w in widths:
            mine = [s for s in scores if s["benchmark"] == b.name and s["width"] == w]
            if mine:
                group = 1 if run.get("foreign_groups") else w  # foreign groups: a problem's samples are in 8 groups
                entry = _named(M.benchmark_metrics(mine, gpass_k, int(run["max_new_tokens"]), group), b.task)
                result["benchmarks"].setdefault(b.name, {})[str(w)] = {**entry, "missing": missing[(b.name, w)]}
    for w in widths:
        entries = {b: per[str(w)] for b, per in result["benchmarks"].items() if str(w) in per}
        if entries:
            result["avg"][str(w)] = M.average_metrics(entries)
    write_atomic(run_dir / SCORES_FILE, "".join(json.dumps(s, ensure_ascii=False) + "\n" for s in scores))
    write_json(run_dir / METRICS_FILE, result)
    return result


def _named(entry: dict[str, Any], task: Task) -> dict[str, Any]:
    """A continuous task's metrics entry with its score named for what it is: `rouge1` (ROUGE-1 F1, the score of
    every continuous task, summarisation's), in the metrics and at every budget; the other keys as they are."""
    if task.continuous:
        entry["metrics"] = {(CONTINUOUS if k == "score" else k): v for k, v in entry["metrics"].items()}
        entry["budgets"] = {L: {CONTINUOUS: b["score"]} for L, b in entry["budgets"].items()}
    return entry


def _missing_problems(
    run_dir: Path, run: dict, records: dict, benches: list[Benchmark], allow_partial: bool
) -> dict[tuple[str, int], list[int]]:
    """{(benchmark, width): indices of the problems not sampled}; a ValueError for samples run.json does not describe,
    a problem with other than n samples, and (unless `allow_partial`) a run that misses problems."""
    widths = [int(w) for w in run["widths"]]
    by_name = {b.name: b for b in benches}
    strays = [k for k in records if k[0] not in by_name or k[1] not in widths or k[2] >= len(by_name[k[0]].problems)]
    if strays:
        raise UserError(f"{run_dir} holds samples that run.json does not describe, e.g. {strays[0]}")
    missing = {
        (b.name, w): [i for i in range(len(b.problems)) if (b.name, w, i) not in records]
        for b in benches
        for w in widths
    }
    lacking = {k: v for k, v in missing.items() if v}
    if lacking and not allow_partial:
        detail = "; ".join(
            f"{b} w={w} misses {len(v)} of {len(by_name[b].problems)} problems (#{', #'.join(map(str, v[:5]))}"
            + (" ...)" if len(v) > 5 else ")")
            for (b, w), v in lacking.items()
        )
        raise UserError(
            f"{run_dir} is incomplete: {detail}. Finish it by re-running bridgelm eval with the same --out, "
            "or score what is there with --allow-partial"
        )
    for key, rec in records.items():
        if len(rec["samples"]) != run["n"]:
            raise UserError(f"{run_dir}: {key} has {len(rec['samples'])} samples, expected n={run['n']}")
    return missing


def _grade_benchmark(b: Benchmark, widths: list[int], records: dict, bar) -> list[dict[str, Any]]:
    """The score lines of benchmark `b`'s sampled problems, graded GRADE_BATCH completions at a time."""
    recs = [records[(b.name, w, i)] for w in widths for i in range(len(b.problems)) if (b.name, w, i) in records]
    pairs = [
        (b.task.graded_text(s["text"], bool(s["finished"])), b.problems[int(r["index"])])
        for r in recs
        for s in r["samples"]
    ]
    rewards: list[float] = []
    for start in range(0, len(pairs), GRADE_BATCH):
        chunk = pairs[start : start + GRADE_BATCH]
        rewards.extend(float(x) for x in b.task.reward_many(chunk))
        bar.update(len(chunk))
    scores, at = [], 0
    for r in recs:
        scores.append(_problem_score(r, rewards[at : at + len(r["samples"])], b.task))
        at += len(r["samples"])
    return scores


def summary_lines(result: dict[str, Any]) -> list[str]:
    """`summary_line` at every width the run has scores at, narrowest first; a note when every sample is empty."""
    lines = [summary_line(result, int(w)) for w in sorted(result["avg"], key=int)] or [summary_line(result)]
    if note := empty_note(result.get("samples", 0), result.get("empty_samples", 0), result["run"].get("chat")):
        lines.append(note)
    return lines


def summary_line(result: dict[str, Any], width: int | None = None) -> str:
    """One line for the terminal: the average over benchmarks at the reported width."""
    w = str(width if width is not None else result["run"]["width"])
    avg = result["avg"].get(w)
    if avg is None:
        return f"no scores at width {w}"
    m = avg["metrics"]
    head = f"w={w}, avg over {len(avg['benchmarks'])} benchmarks ({', '.join(avg['benchmarks'])}): "
    if CONTINUOUS in m and "accuracy" not in m:
        variance = 1e4 * m["score_variance"]["mean"]
        return head + (
            f"mean {CONTINUOUS} (ROUGE-1 F1) {100 * m[CONTINUOUS]['mean']:.2f}, per-prompt {CONTINUOUS} variance "
            f"{variance:.2f} (points²), mean length {avg['mean_length']:.0f} tokens" + _cut_text(result, avg)
        )
    parts = [f"accuracy {100 * m['accuracy']['mean']:.2f}%", f"coverage@n {100 * m['coverage@n']['mean']:.2f}%"]
    if "majority_vote" in m:
        parts.append(f"majority vote {100 * m['majority_vote']['mean']:.2f}%")
    parts.append(f"mean length {avg['mean_length']:.0f} tokens")
    return head + ", ".join(parts) + _cut_text(result, avg)


CUT_WARNING = 0.5  # the share of samples cut by max_new_tokens above which the summary says so


def _cut_text(result: dict[str, Any], avg: dict[str, Any]) -> str:
    """A warning when most samples ended at max_new_tokens, not by themselves: their scores then say more about the
    cap than about the model."""
    cut = 1.0 - avg["finished"]
    if cut <= CUT_WARNING:
        return ""
    cap = result["run"]["max_new_tokens"]
    return f"; warning: {100 * cut:.0f}% of samples were cut at max_new_tokens {cap} (raise --max-new-tokens)"

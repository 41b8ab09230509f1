"""The benchmarks of an eval run: one per data file (named by its stem, e.g. `aime24`), or a Task object with its
own examples, each with the task that prompts and grades it and the fingerprint of its problems.

A data file named after its split is named after its folder (gsm8k/test.jsonl: gsm8k; gsm8k/train.jsonl:
gsm8k_train), so that a benchmark's name says what it measures. Used by bridgelm.eval.runner (sampling) and
bridgelm.eval.score (grading, against the fingerprints recorded at sampling time).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bridgelm.errors import UserError
from bridgelm.runs import local_source
from bridgelm.source import refuse_split_of_file
from bridgelm.tasks import Task


@dataclass
class Benchmark:
    """The problems of one data file (or of a Task object), with the task that prompts and grades them."""

    name: str  # file stem ("aime24"), or the task's name (the task's own examples, or a split file: see benchmark_name)
    path: str | None  # data file it was read from; None = the task's own examples
    task: Task  # prompt, gold answer, answer extraction and reward
    problems: list[dict]  # the examples evaluated (the first `limit` of the file)

    def digest(self) -> str:
        """Fingerprint of the prompts and gold answers: a changed data file cannot be mixed into a run."""
        return self.task.digest(self.problems)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "path": self.path, "problems": len(self.problems), "digest": self.digest()}


# Stems that name a data set's split rather than the data set: such a file's benchmark is named after its folder.
SPLIT_STEMS = ("test", "train", "validation", "val", "dev")


def benchmark_name(task_name: str, path: str | os.PathLike, split: str = "test") -> str:
    """The benchmark name of a data file: its stem (math500.jsonl -> math500), or for a file named after its split,
    its folder's name (gsm8k/test.jsonl -> gsm8k; gsm8k/train.jsonl -> gsm8k_train), the task's for a file given
    without a folder (test.jsonl -> the task's name). A data folder is named as its file of `split` would be."""
    src = Path(path).expanduser()
    if src.is_dir():
        src = src / f"{split}.jsonl"
    stem = src.stem if src.suffix else src.name
    if stem.lower() not in SPLIT_STEMS:
        return stem
    folder = src.parent.name if src.parent.name not in ("", ".", "..") else task_name
    return folder if stem.lower() == "test" else f"{folder}_{stem}"


def load_benchmarks(task_or_name: Task | str, data_paths: Sequence[str] | None = None, limit: int | None = None,
                    split: str = "test"):
    """Benchmarks of a run: one per data file of the registry task `task_or_name`, or the Task object itself.

    Without data files a task name gives one benchmark from the task's default source, named after the task; a data
    folder, or the task's source, is read at `split`.
    """
    from bridgelm import tasks

    paths = [str(p) for p in (data_paths or [])]
    if isinstance(task_or_name, Task):
        if paths:
            raise ValueError(
                f"a Task object brings its own examples, got data files {paths} as well: pass the task's registry "
                "name to read data files"
            )
        found = [(task_or_name.name, None, task_or_name)]
    elif isinstance(task_or_name, str):
        if not paths:
            found = [(task_or_name, None, tasks.load(task_or_name, split=split))]
        else:
            for path in paths:
                refuse_split_of_file(split, "test", path)
            found = [(benchmark_name(task_or_name, p, split), local_source(p), tasks.load(task_or_name, p, split))
                     for p in paths]
    else:
        raise TypeError(f"task_or_name must be a Task or a task name, got {type(task_or_name).__name__}")
    benches = []
    for name, path, task in found:
        problems = list(task.examples[:limit] if limit else task.examples)
        if not problems:
            raise UserError(f"benchmark {name!r} ({path or 'task examples'}) holds no problems")
        benches.append(Benchmark(name, path, task, problems))
    seen = {}
    for b in benches:
        if b.name in seen:
            raise UserError(f"two data files make the benchmark {b.name!r}: {seen[b.name]} and {b.path}; rename one")
        seen[b.name] = b.path
    return benches


def benchmark_difference(old: list[dict], new: list[dict]) -> str:
    """What differs between two lists of benchmarks as run.json records them (`Benchmark.describe`): their names, or
    the first problem count or fingerprint (a path is not compared: a moved file is the same data)."""
    old_names, new_names = [b["name"] for b in old], [b["name"] for b in new]
    if old_names != new_names:
        return f"benchmarks: run {old_names} vs now {new_names}"
    for a, b in zip(old, new):
        for key in ("problems", "digest"):
            if a.get(key) != b.get(key):
                why = " (the data changed since it was sampled)" if key == "digest" else ""
                return f"benchmark {a['name']!r} {key}: run {a.get(key)!r} vs now {b.get(key)!r}{why}"
    return "benchmarks differ"

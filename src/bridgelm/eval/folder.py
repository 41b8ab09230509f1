"""An eval run's folder, read back: run.json (its settings), the samples files of its ranks, and the checks that
keep one folder one run.

RUN_DIR/run.json holds the settings (bridgelm.eval.runner writes it, `read_eval_run` reads it); samples.jsonl holds
one line per (benchmark, width, problem), or under torchrun one shard samples.rank{r}.jsonl per rank, which
`read_samples` merges, refusing problems written twice. A re-run with another model, other data or other sampling
settings is refused before anything is written (`check_same_run`: the settings of SAME_RUN), and a folder of another
kind of run, or of an older format version, is refused in one line (bridgelm.runs.check_format). Files edited by
hand are named by their field, or by file and line.

Used by bridgelm.eval.runner, bridgelm.eval.score, bridgelm.eval.report and bridgelm.eval.analyze.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from bridgelm.dist import Dist
from bridgelm.errors import MissingFile, UserError
from bridgelm.eval.datasets import benchmark_difference
from bridgelm.jsonl import parse_json, rank_file, rank_files, read_records
from bridgelm.runs import (
    RUN_FILE,
    SAMPLED_WITH,
    SOURCE_DIGESTS,
    check_format,
    check_settings,
    local_source,
    source_digests,
)

SAMPLES = "samples.jsonl"  # an eval run's samples (under torchrun, each rank's part of them: jsonl.rank_file)

# Settings of run.json that decide what is sampled; a re-run must match them all (an eval run records the list of
# its widths, and which one tables report, in place of one width; the model and blocks by path and by content).
SAME_RUN = (
    "model",
    "blocks",
    *SOURCE_DIGESTS,
    "dtype",
    "task",
    "benchmarks",
    *("widths" if k == "width" else k for k in SAMPLED_WITH),
    "limit",
    "split",
)


def shard_file_name(dist: Dist) -> str:
    """The samples file this process appends to: samples.jsonl, or samples.rank{r}.jsonl under torchrun."""
    return rank_file(Path(SAMPLES), dist.rank, dist.world).name


def shard_files(run_dir: str | os.PathLike) -> list[Path]:
    """samples.jsonl and samples.rank{r}.jsonl of a run, in rank order."""
    whole = Path(run_dir) / SAMPLES
    return [whole] * whole.is_file() + rank_files(whole)


def read_eval_run(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The settings of an eval run (its run.json); UserError when `run_dir` is not an eval run of this bridgelm."""
    path = Path(run_dir) / RUN_FILE
    if not path.is_file():
        raise MissingFile(f"{path} does not exist: {run_dir} is not an eval run (made by bridgelm eval --out)")
    run = parse_json(path.read_bytes(), str(path), "the run.json of bridgelm eval", strict=False)
    check_format(run_dir, run, "eval", expected="a folder made by bridgelm eval --out")
    _check_run_fields(run, path)
    return run


def _check_run_fields(run: dict, path: Path) -> None:
    """UserError naming the first field of run.json that the readers of a run rely on and that is not what bridgelm
    eval writes (a file edited by hand)."""

    def positive(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x > 0

    benches = run.get("benchmarks")
    checks = [
        ("n", positive(run.get("n")), "a positive integer"),
        (
            "widths",
            isinstance(run.get("widths"), list) and run["widths"] and all(map(positive, run["widths"])),
            "a non-empty list of positive integers",
        ),
        ("width", positive(run.get("width")), "a positive integer"),
        ("max_new_tokens", positive(run.get("max_new_tokens")), "a positive integer"),
        ("gpass_k", positive(run.get("gpass_k")), "a positive integer"),
        ("task", isinstance(run.get("task"), str), "a task name"),
        (
            "benchmarks",
            isinstance(benches, list)
            and benches
            and all(
                isinstance(b, dict) and isinstance(b.get("name"), str) and positive(b.get("problems")) for b in benches
            ),
            "a non-empty list of {name, path, problems, digest} objects",
        ),
    ]
    for name, ok, expected in checks:
        if not ok:
            raise UserError(
                f"{path}: field {name!r} is {run.get(name)!r}: expected {expected}, as bridgelm eval writes it"
            )


def _check_sample_line(rec: Any, path: Path, number: int) -> None:
    """UserError unless line `number` of a samples file holds a problem as bridgelm eval writes it: benchmark, width,
    index and a list of samples, each with its text, token ids and whether it finished."""

    def fail(what: str):
        raise UserError(f"{path}, line {number}: {what}, as bridgelm eval writes it (a file edited by hand?)")

    if not isinstance(rec, dict):
        fail("expected a JSON object")
    for key, kind in (("benchmark", str), ("width", int), ("index", int), ("samples", list)):
        if not isinstance(rec.get(key), kind) or isinstance(rec.get(key), bool):
            fail(f"field {key!r} is {rec.get(key)!r}: expected {'a list' if kind is list else kind.__name__}")
    for j, s in enumerate(rec["samples"]):
        ok = (
            isinstance(s, dict)
            and isinstance(s.get("text"), str)
            and isinstance(s.get("token_ids"), list)
            and isinstance(s.get("finished"), bool)
        )
        if not ok:
            fail(f"sample {j} is not an object with 'text' (text), 'token_ids' (a list) and 'finished' (true/false)")


def check_run_model(run_dir: str | os.PathLike, model_id: str, blocks: str | None) -> None:
    """UserError unless the run was sampled with this model and these blocks (its token ids fit only them)."""
    now = {"model": local_source(model_id), "blocks": local_source(blocks), **source_digests(model_id, blocks)}
    check_settings(
        run_dir,
        read_eval_run(run_dir),
        now,
        keys=now,
        saved_as="run",
        why=": its samples must be re-run through the model and blocks that wrote them",
        fix="expected --model and --blocks as in its run.json",
    )


def check_same_run(path: Path, old: dict, new: dict) -> None:
    """UserError naming every setting of `new` that decides what is sampled and differs from the run's. A benchmark
    is its content (name, problems, fingerprint): a data file moved elsewhere continues the run, which then records
    where it is now."""
    check_settings(
        path,
        _by_content(old),
        _by_content(new),
        keys=SAME_RUN,
        saved_as="run",
        describe={"benchmarks": lambda a, b: benchmark_difference(a or [], b)},
        why=": samples of other settings would be scored together as one run, so mixing them is refused and nothing "
        "was written",
        fix="use another --out to compare runs",
    )


def _by_content(settings: dict) -> dict:
    """`settings` with its benchmarks' paths left out."""
    benches = settings.get("benchmarks")
    if not isinstance(benches, list):
        return settings
    return {**settings, "benchmarks": [{k: v for k, v in b.items() if k != "path"} if isinstance(b, dict) else b
                                       for b in benches]}


def _key(rec: dict) -> tuple[str, int, int]:
    return rec["benchmark"], int(rec["width"]), int(rec["index"])


def done_keys(run_dir: Path, own: str) -> set[tuple[str, int, int]]:
    """Keys written in any shard; this process's own shard is repaired (a line cut by a crash is dropped)."""
    done = set()
    for path in shard_files(run_dir):
        done.update(_key(r) for r in read_records(path, repair=path.name == own))
    return done


def read_samples(run_dir: str | os.PathLike) -> dict[tuple[str, int, int], dict]:
    """Every sampled problem of a run, merged over its shards; a problem written twice is a ValueError, and a folder
    that is not an eval run a UserError (`read_eval_run`)."""
    read_eval_run(run_dir)
    merged: dict[tuple[str, int, int], dict] = {}
    where: dict[tuple[str, int, int], str] = {}
    twice = []
    for path in shard_files(run_dir):
        for number, rec in enumerate(read_records(path, repair=False), start=1):
            _check_sample_line(rec, path, number)
            key = _key(rec)
            if key in merged:
                twice.append(f"{key[0]} w={key[1]} #{key[2]} ({where[key]}, {path.name})")
                continue
            merged[key] = rec
            where[key] = path.name
    if twice:
        shown = ", ".join(twice[:5]) + (f" and {len(twice) - 5} more" if len(twice) > 5 else "")
        raise UserError(
            f"{run_dir}: {len(twice)} problems were sampled more than once: {shown}. Each problem must be generated "
            "exactly once; were two eval runs writing into this directory at the same time?"
        )
    return merged


def wait_for(path: Path, seconds: float) -> None:
    """Poll until `path` exists (written by rank 0), or fail after `seconds`."""
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not appear within {seconds:.0f}s: did rank 0 fail?")
        time.sleep(0.1)

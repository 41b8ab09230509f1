"""The demo's stage runner: `Stage`s run one by one, or side by side in worker processes as soon as the stages they
wait on are done, each skipped when its output exists; `Timings` keeps their seconds and the machine's speed."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch

from bridgelm.errors import show_data_warnings
from bridgelm.jsonl import write_json


def _no_summary(result) -> str:
    return ""


@dataclass
class Stage:
    """One stage for `run_stages`."""

    name: str  # the stage's name in the terminal, timings.json and the report
    output: Path  # its output: the stage is skipped when this exists
    fn: Callable[[], object]  # runs it (picklable, e.g. a partial of a module-level function, to run in a worker)
    summary: Callable[[object], str] = _no_summary  # one line about fn's result, for the terminal
    after: tuple[str, ...] = ()  # stages that must be done first


class Timings:
    """OUT/timings.json: seconds per stage, kept across invocations (a re-run that skips a stage still reports its
    time). OUT/peaks.json: the machine's speed the times were taken at, one entry per invocation that ran stages
    (its matmul `peaks`, workers, the stages it ran and its wall time), written as soon as it runs one."""

    def __init__(self, out: Path, peaks: dict):
        self.files = out / "timings.json", out / "peaks.json"
        self.seconds: dict[str, float] = json.loads(self.files[0].read_text()) if self.files[0].exists() else {}
        self.peaks: list[dict] = json.loads(self.files[1].read_text()) if self.files[1].exists() else []
        self.mine = {**peaks, "stages": []}  # this invocation's entry of `peaks`, added when it runs a stage
        self.start = time.perf_counter()

    def add(self, name: str, seconds: float, ran: bool = True) -> None:
        """A stage's time; `ran`: this invocation ran it (else it was timed before, e.g. the cached base model)."""
        self.seconds[name] = round(seconds, 1)
        write_json(self.files[0], self.seconds)
        if ran:
            if not self.mine["stages"]:
                self.peaks.append(self.mine)
            self.mine["stages"].append(name)
            self.mine["wall_s"] = round(time.perf_counter() - self.start, 1)
            write_json(self.files[1], self.peaks)


def run_stages(stages: list[Stage], timings: Timings, log=print, workers: int = 1, threads: int = 1, logs=None):
    """Run `stages` (each listed after the stages it waits on), skipping those whose output exists. One by one in
    this process with `workers` 1; else each as soon as its stages are done and a worker is free, in `workers`
    spawned processes of `threads` torch threads each, its output in LOGS/<stage>.log. A failing stage ends the run
    with its error once the stages running beside it are done; Ctrl-C interrupts them (they save a checkpoint)."""
    unknown = sorted({a for s in stages for a in s.after} - {s.name for s in stages})
    assert not unknown, f"stages wait on stages that are not in the list: {unknown}"
    todo = [s for s in stages if not _skipped(s, log)]
    timings.mine["workers"] = workers
    if workers <= 1:
        for s in todo:
            t0 = time.perf_counter()
            _finish(s, s.fn(), time.perf_counter() - t0, timings, log)
        return
    logs = Path(logs or "logs")
    done = {s.name for s in stages} - {s.name for s in todo}
    context = multiprocessing.get_context("spawn")  # not fork: torch's thread pools do not survive a fork
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_worker_start, initargs=(threads,))
    running: dict = {}  # future -> its stage
    try:
        while todo or running:
            for s in [s for s in todo if done.issuperset(s.after)][: workers - len(running)]:
                todo.remove(s)  # submitted only when a worker is free: it starts now
                log(f"[{s.name}] started (output in {_log_file(logs, s)})")
                running[pool.submit(_in_worker, s.fn, _log_file(logs, s))] = s
            assert running, f"stages wait on each other: {[s.name for s in todo]}"
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                s = running.pop(future)
                if future.exception() is not None:
                    log(f"[{s.name}] failed (its output: {_log_file(logs, s)}); waiting for the stages still running")
                    raise future.exception()
                _finish(s, *future.result(), timings, log)
                done.add(s.name)
    except KeyboardInterrupt:
        names = ", ".join(s.name for s in running.values())
        log(f"interrupted: the stages running ({names}) keep their checkpoints; a re-run resumes them")
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        for future, s in running.items():  # those that finished meanwhile: their times are kept too
            if not future.cancelled() and future.exception() is None:
                _finish(s, *future.result(), timings, log)


def _skipped(stage: Stage, log) -> bool:
    if stage.output.exists():
        log(f"[{stage.name}] already done: {stage.output}")
    return stage.output.exists()


def _finish(stage: Stage, result, seconds: float, timings: Timings, log) -> None:
    timings.add(stage.name, seconds)
    text = stage.summary(result)
    log(f"[{stage.name}] done in {timings.seconds[stage.name]:.0f}s{': ' + text if text else ''} -> {stage.output}")


def _log_file(logs: Path, stage: Stage) -> Path:
    return logs / f"{stage.name.replace(' ', '_')}.log"


def _worker_start(threads: int) -> None:
    """A worker process's setup: its torch threads, and Ctrl-C ignored between stages (an idle worker killed by it
    would break the pool, which then kills the workers still saving their checkpoints); data warnings printed to the
    stage logs as one line, as the command line prints them."""
    show_data_warnings("bridgelm demo")
    torch.set_num_threads(threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _in_worker(fn, log: Path):
    """In a worker process: fn() with this process's stdout and stderr (file descriptors 1 and 2, so C code and
    progress bars too) appended to `log`, and Ctrl-C raising KeyboardInterrupt (the trainers save a checkpoint on
    it); returns (result, seconds)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(log, "a") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            t0 = time.perf_counter()
            result = fn()
            return result, time.perf_counter() - t0
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)

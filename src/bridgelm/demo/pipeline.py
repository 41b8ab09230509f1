"""The paper's pipeline in miniature, offline, on a CPU: `bridgelm demo --out DIR`.

Stages, each with the project's own functions, each writing under DIR and skipped when its output is there:
  base       pre-train a small Qwen2 on worked sums taken in any order (cached; see demo/base.py, tasks/anysum.py)
  warmup     the base model samples 8 answers per training problem; correct ones kept (paper 4.1)
  sft        warm up Bridge blocks and P-Match blocks on them, base frozen (paper 3.2)
  rl         GRPO for the arms "RLVR only", "P-Match" and "Bridge": same prompts, budget, seeds, settings
  eval       held-out test problems, n samples each: every arm, Bridge at widths 1..16 (same random draws at
             every width: the share of samples that change is the interaction), and control (b), foreign
             siblings: the Bridge model with groups made of samples of different problems
  trace      the interaction over the course of RL (Bridge, seed 0)
  report     DIR/report.md, DIR/results.json and PNG figures (demo/report.py)

The stages are in demo/stages.py, their settings in demo/config.py; this module runs them: the base model first, then
every other stage as soon as the stages it reads are done, in `workers` processes (`concurrent.futures`; each one's
output in DIR/logs/<stage>.log). How the demo runs, resumes and times itself: docs/demo.md.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

import torch

from bridgelm.demo import blocks_only
from bridgelm.demo import stages as st
from bridgelm.demo.base import PRETRAIN_FILE, make_problems, make_task, pretrain
from bridgelm.demo.control import ControlDirs
from bridgelm.demo.config import TRACE_SEED, DemoConfig, eval_arms, rl_arms, sft_kinds, sft_of, sft_seed_of, sft_seeds
from bridgelm.demo.report import write_demo_report
from bridgelm.demo.results import RunDirs
from bridgelm.errors import UserError, show_data_warnings
from bridgelm.jsonl import read_json_object, write_atomic, write_json
from bridgelm.runs import check_settings, jsonable, refuse_run_folder
from bridgelm.train.loop import dotted

__all__ = ["DemoConfig", "Stage", "Timings", "choose_bf16", "record_settings", "run_demo", "run_stages"]


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
    if unknown:
        raise RuntimeError(f"stages wait on stages that are not in the list: {unknown}")
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
            if not running:
                raise RuntimeError(f"stages wait on each other: {[s.name for s in todo]}")
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


def run_demo(out: str | Path, cfg: DemoConfig, quick: bool = False, log=print) -> Path:
    """Every stage of the miniature pipeline into `out`; returns the path of report.md."""
    out = Path(out)
    refuse_run_folder(out, "demo")  # an eval or training run's folder: its files and the demo's would mix
    out.mkdir(parents=True, exist_ok=True)
    cfg, timings = _start(out, cfg, quick, log)
    ctx = _base_and_tasks(out, cfg, quick, timings, log)
    stages = demo_stages(ctx)
    workers = max(1, min(cfg.workers, len(stages)))
    threads = max(1, torch.get_num_threads() // workers)
    run_stages(stages, timings, log, workers, threads, logs=out / "logs")
    report = write_demo_report(out, cfg, run_dirs(ctx), timings.seconds, quick, timings.peaks)
    log(f"[report] {report}")
    return report


DEFAULT_SEEDS = {True: 3, False: 1}  # RL seeds without --seeds, by precision (bf16: fast enough for 3 in 20 minutes)

# Settings that a re-run of a folder may change: more seeds add runs; threads and workers change only the speed. The
# precision has its own check (choose_bf16), the base model's settings too (demo.base.pretrain).
DEMO_JSON = "the settings of a demo folder, written by bridgelm demo"  # what demo.json is expected to be
RERUN_MAY_CHANGE = ("seeds", "threads", "workers", "bf16", "precision", "base")


def _start(out: Path, cfg: DemoConfig, quick: bool, log) -> tuple[DemoConfig, Timings]:
    """This machine's matmul peaks, the precision chosen from them, and the folder's settings (DIR/demo.json):
    checked against those it was made with, then recorded."""
    from bridgelm.hardware import bf16_is_slow, matmul_peaks

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    peaks = matmul_peaks()
    log(f"this machine now: fp32 matmul {peaks['fp32_tflops']} TFLOP/s, bf16 {peaks['bf16_tflops']} TFLOP/s")
    bf16, why = choose_bf16(cfg, peaks, out)
    cfg = replace(cfg, bf16=bf16, base=replace(cfg.base, bf16=bf16))
    if cfg.seeds is None:
        cfg = replace(cfg, seeds=DEFAULT_SEEDS[bf16])
        log(f"seeds: {cfg.seeds} ({'bf16' if bf16 else 'fp32'}'s default; --seeds N for more, added to this folder)")
    log(f"precision: {'bf16 forwards (fp32 weights in training)' if bf16 else 'fp32'}, {why}")
    if bf16 and bf16_is_slow(peaks["bf16_tflops"], peaks["fp32_tflops"]):
        log(
            f"warning: bf16 matmuls run at {peaks['bf16_tflops']} TFLOP/s here against fp32's {peaks['fp32_tflops']}: "
            "this demo will take many times longer than in fp32 (--no-bf16, with another --out)"
        )
    record_settings(out, {"quick": quick, **asdict(cfg), "precision": why})
    return cfg, Timings(out, peaks)


def record_settings(out: Path, settings: dict) -> None:
    """OUT/demo.json: the folder's settings, checked first against those its stages were made with (all but
    RERUN_MAY_CHANGE), so that a re-run does not mix its runs with another setting's under one label."""
    settings, record = jsonable(settings), out / "demo.json"
    if record.is_file():  # nested configs compared by dotted key, so that a difference is named (rl.lr)
        now, saved = dotted(settings), dotted(read_json_object(record, DEMO_JSON))
        keys = [k for k in now if k.split(".")[0] not in RERUN_MAY_CHANGE]
        check_settings(record, saved, now, keys, fix="use another --out")
    write_json(record, settings)


def _base_and_tasks(out: Path, cfg: DemoConfig, quick: bool, timings: Timings, log) -> st.Context:
    """The base model (cached by its settings) and the problems; the problems written out for the commands too, as
    DIR/data/<task>/{train,test}.jsonl (the CLI's own generator draws the default spec's problems, not --quick's)."""
    from bridgelm.tokenizer import load_tokenizer

    trained = not (out / "base" / PRETRAIN_FILE).exists()
    base_dir = pretrain(cfg.base, out / "base", log=log)
    timings.add("base", json.loads((base_dir / PRETRAIN_FILE).read_text())["seconds"], ran=trained)
    spec = cfg.base.task
    rl_problems = max(cfg.warmup_problems, cfg.rl.steps * cfg.rl.prompts_per_step)
    ctx = st.Context(
        out=out,
        cfg=cfg,
        base_dir=base_dir,
        tokenizer=load_tokenizer(base_dir),
        # Training prompts may repeat at toy sizes; test problems are always distinct.
        train=make_task(spec, make_problems(spec, rl_problems, "train", 1, distinct=not quick)),
        test=make_task(spec, make_problems(spec, cfg.eval_problems, "test", 0)),
    )
    for split, task in (("train", ctx.train), ("test", ctx.test)):
        rows = "".join(json.dumps(row) + "\n" for row in task.examples)
        write_atomic(out / "data" / task.name / f"{split}.jsonl", rows)
    return ctx


def demo_stages(ctx: st.Context) -> list[Stage]:
    """Warm-up data, SFT, RL, evaluation (then control (b), foreign siblings) and the trace, each after the stages it
    reads."""
    cfg, out = ctx.cfg, ctx.out
    warmup = partial(st.recorded, out / "warmup.done", st.stage_warmup, ctx)
    stages = control_stages(cfg, control_dirs(out)) if cfg.positive_control else []  # first: beside the others
    stages.append(Stage("warmup", out / "warmup.done", warmup, json.dumps))
    for seed in sft_seeds(cfg):
        for kind in sft_kinds(cfg):
            done = ctx.sft_dir(kind, seed) / "done.json"  # blocks.safetensors appears at the first epoch's end
            fn = partial(st.recorded, done, st.stage_sft, ctx, kind, seed)
            stages.append(Stage(f"sft {kind} seed {seed}", done, fn, st.sft_summary, ("warmup",)))
    if cfg.blocks_only:
        stages += lr_choice_stages(ctx)
    for seed in range(cfg.seeds):
        for arm in rl_arms(cfg):
            done = ctx.rl_dir(arm, seed) / "done.json"
            fn = partial(st.recorded, done, st.stage_rl, ctx, arm, seed)
            after = () if sft_of(arm) is None else (f"sft {sft_of(arm)} seed {sft_seed_of(cfg, seed)}",)
            if arm == blocks_only.ARM:
                fn, after = partial(st.recorded, done, blocks_only.stage_rl, ctx, seed), after + ("choose blocks lr",)
            stages.append(Stage(f"rl {arm} seed {seed}", done, fn, st.rl_summary, after))
    for seed in range(cfg.seeds):
        for arm in eval_arms(cfg, seed):
            fn = partial(st.stage_eval, ctx, arm, seed)
            after = () if arm == "base" else (f"rl {arm} seed {seed}",)
            summary = partial(st.eval_summary, arm=arm)
            output = ctx.eval_dir(arm, seed) / "metrics.json"
            stages.append(Stage(f"eval {arm} seed {seed}", output, fn, summary, after))
        if cfg.foreign_control:
            fn = partial(st.stage_eval, ctx, "bridge", seed, foreign=True)
            summary, after = partial(st.eval_summary, arm="bridge"), (f"rl bridge seed {seed}",)
            name = f"eval foreign siblings seed {seed}"
            stages.append(Stage(name, ctx.foreign_dir(seed) / "metrics.json", fn, summary, after))
    trace = partial(st.recorded, out / "trace.json", st.stage_trace, ctx, TRACE_SEED)
    stages.append(Stage("trace", out / "trace.json", trace, st.trace_summary, (f"rl bridge seed {TRACE_SEED}",)))
    return stages


def lr_choice_stages(ctx: st.Context) -> list[Stage]:
    """The blocks-only arm's rate, chosen on validation problems: seed 0's run at every candidate rate, each
    evaluated on validation problems, then the choice (DIR/blocks_lr.json)."""
    stages, out, cfg = [], ctx.out, ctx.cfg
    sft = f"sft bridge seed {sft_seed_of(cfg, blocks_only.TUNE_SEED)}"
    for lr in cfg.blocks_lrs:
        done = blocks_only.candidate_dir(out, lr) / "done.json"
        fn = partial(st.recorded, done, blocks_only.stage_candidate, ctx, lr)
        stages.append(Stage(f"rl bridge_blocks lr {lr:g}", done, fn, st.rl_summary, (sft,)))
        val = partial(blocks_only.stage_validate, ctx, lr)
        output = blocks_only.validation_dir(out, lr) / "metrics.json"
        summary = partial(st.eval_summary, arm=f"validation, lr {lr:g}")
        stages.append(Stage(f"validate bridge_blocks lr {lr:g}", output, val, summary, (f"rl bridge_blocks lr {lr:g}",)))
    choose = partial(st.recorded, out / blocks_only.CHOICE, blocks_only.stage_choose, ctx)
    after = tuple(f"validate bridge_blocks lr {lr:g}" for lr in cfg.blocks_lrs)
    stages.append(Stage("choose blocks lr", out / blocks_only.CHOICE, choose, json.dumps, after))
    return stages


def control_dirs(out: Path) -> ControlDirs:
    return ControlDirs(out / "control")


def control_stages(cfg: DemoConfig, dirs: ControlDirs) -> list[Stage]:
    """The positive control: its base model, then per seed blocks-only GRPO, evaluation at w = 1 and w = 8, and with
    foreign siblings."""
    from bridgelm.demo import control

    base = partial(control.stage_base, cfg.control, dirs, cfg.bf16)
    stages = [Stage("control base", dirs.base / PRETRAIN_FILE, base)]
    for seed in range(cfg.seeds):
        done = dirs.rl(seed) / "done.json"
        rl = partial(st.recorded, done, control.stage_rl, cfg, dirs, seed)
        stages.append(Stage(f"control rl seed {seed}", done, rl, st.rl_summary, ("control base",)))
        for foreign in (False, True):
            fn = partial(control.stage_eval, cfg.control, dirs, seed, foreign, cfg.bf16)
            name = f"control {'foreign siblings' if foreign else 'eval'} seed {seed}"
            summary = partial(st.eval_summary, arm="positive control")
            output = dirs.eval(seed, foreign) / "metrics.json"
            stages.append(Stage(name, output, fn, summary, (f"control rl seed {seed}",)))
    return stages


def run_dirs(ctx: st.Context) -> RunDirs:
    """The run folders the report reads."""
    cfg, seeds = ctx.cfg, range(ctx.cfg.seeds)
    return RunDirs(
        eval={(arm, seed): ctx.eval_dir(arm, seed) for seed in seeds for arm in eval_arms(cfg, seed)},
        rl={(arm, seed): ctx.rl_dir(arm, seed) for seed in seeds for arm in rl_arms(cfg)},
        foreign={seed: ctx.foreign_dir(seed) for seed in seeds} if cfg.foreign_control else {},
        control=control_dirs(ctx.out) if cfg.positive_control else None,
    )


BF16_MARGIN = 1.2  # bf16 is chosen where its matmul peak is at least this many times fp32's: near 1x fp32 is as fast
# and exact, and the margin keeps noise from flipping the choice between runs (a CPU with bf16 instructions reads
# 2-4x, one without 0.01x or less)


def choose_bf16(cfg: DemoConfig, peaks: dict, out: Path) -> tuple[bool, str]:
    """Whether the demo's forwards run in bf16 (`DemoConfig.bf16`), and why: as the folder's earlier stages (its base
    model's settings, else demo.json while the base model trains), so that a re-run skips them and its runs stay
    alike (a flag asking for the other precision is refused; the reason is the one demo.json recorded when they
    began); else as asked; else bf16 where this machine's bf16 matmul peak, measured at the start, is at least
    BF16_MARGIN times its fp32 one (CPUs without AVX-512 run bf16 matmuls ~100x slower than fp32 ones)."""
    marker, saved = out / "base" / PRETRAIN_FILE, out / "demo.json"
    record = read_json_object(saved, DEMO_JSON) if saved.is_file() else {}  # the settings of its first stages
    made = None
    if marker.is_file():
        made = json.loads(marker.read_text())["config"]["bf16"]
    elif (out / "base").exists() and record:
        made = record["bf16"]
    flag = {True: "--bf16", False: "--no-bf16"}
    if made is None:
        if cfg.bf16 is not None:
            return cfg.bf16, f"as asked ({flag[cfg.bf16]})"
        fast = peaks["bf16_tflops"] >= BF16_MARGIN * peaks["fp32_tflops"]
        return fast, (
            f"this machine's bf16 matmul peak is {'at least' if fast else 'under'} {BF16_MARGIN}x its fp32 one "
            f"({peaks['bf16_tflops']} against {peaks['fp32_tflops']} TFLOP/s; --bf16 or --no-bf16 to choose)"
        )
    if cfg.bf16 is not None and cfg.bf16 != made:
        raise UserError(
            f"{out} holds stages made with {flag[made]}, not {flag[cfg.bf16]}: use another --out for "
            f"{flag[cfg.bf16]}, or leave the flag out to continue this folder"
        )
    if record.get("bf16") is made:  # the reason recorded when the folder's stages began, for its report
        return made, record["precision"]
    return made, f"as this folder's earlier stages ({flag[not made]} needs another --out)"

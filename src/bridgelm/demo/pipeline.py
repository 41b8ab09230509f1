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
  control    the positive control, on its own and through each Bridge arm's recipe (demo/control.py,
             demo/recipe_control.py); lr searches on validation problems for the arms that ask (demo/lr_search.py)
  report     DIR/report.md, DIR/results.json and PNG figures (demo/report.py)

The stages are in demo/stages.py, their settings in demo/config.py and demo/arms.py, the list of them in
demo/graph.py; demo/runner.py runs them: the base model first, then every other stage as soon as the stages it reads
are done, in `workers` processes (each one's output in DIR/logs/<stage>.log). How the demo runs, resumes and times
itself: docs/demo.md.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import torch

from bridgelm.demo import stages as st
from bridgelm.demo.base import PRETRAIN_FILE, make_problems, make_task, pretrain
from bridgelm.demo.config import DemoConfig
from bridgelm.demo.graph import arm_results, demo_stages, run_dirs
from bridgelm.demo.lr_search import check_choices
from bridgelm.demo.report import write_demo_report
from bridgelm.demo.runner import Timings, run_stages
from bridgelm.errors import UserError
from bridgelm.jsonl import check_out, read_json_object, write_atomic, write_json
from bridgelm.runs import check_settings, jsonable, refuse_run_folder
from bridgelm.train.loop import dotted

__all__ = ["DemoConfig", "choose_bf16", "record_settings", "run_demo"]


def run_demo(out: str | Path, cfg: DemoConfig, quick: bool = False, log=print) -> Path:
    """Every stage of the miniature pipeline into `out`; returns the path of report.md."""
    cfg.validate()
    check_out(out, "dir")
    out = Path(out)
    refuse_run_folder(out, "demo")  # an eval or training run's folder: its files and the demo's would mix
    log(f"bridgelm demo: every stage writes under {out} (a finished stage is skipped on a re-run)")
    out.mkdir(parents=True, exist_ok=True)
    cfg, timings = _start(out, cfg, quick, log)
    ctx = _base_and_tasks(out, cfg, quick, timings, log)
    stages = demo_stages(ctx)
    workers = max(1, min(cfg.workers, len(stages)))
    threads = max(1, torch.get_num_threads() // workers)
    run_stages(stages, timings, log, workers, threads, logs=out / "logs")
    report = write_demo_report(out, cfg, run_dirs(ctx), arm_results(ctx), timings.seconds, quick, timings.peaks)
    log(f"[report] {report}")
    log(f"bridgelm demo: report at {report} (numbers in {report.parent / 'results.json'})")
    return report


DEFAULT_SEEDS = {True: 3, False: 1}  # RL seeds without --seeds, by precision (bf16: fast enough for 3 in 20 minutes)

# Settings that a re-run of a folder may change: more seeds or arms add runs; threads and workers change only the speed. The
# precision has its own check (choose_bf16), the base model's settings too (demo.base.pretrain).
DEMO_JSON = "the settings of a demo folder, written by bridgelm demo"  # what demo.json is expected to be
RERUN_MAY_CHANGE = ("seeds", "arms", "recipe_control", "misalignment", "threads", "workers", "bf16", "precision", "base")


def _start(out: Path, cfg: DemoConfig, quick: bool, log) -> tuple[DemoConfig, Timings]:
    """This machine's matmul peaks, the precision chosen from them, and the folder's settings (DIR/demo.json):
    checked against those it was made with, then recorded."""
    from bridgelm.hardware import bf16_is_slow, matmul_peaks

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    check_settings_of(out, {"quick": quick, **asdict(cfg)})  # before the peaks' seconds: a refusal comes at once
    check_choices(out)
    earlier = _precision_made(out) is not None  # the folder's stages chose the precision
    peaks = matmul_peaks()
    log(f"this machine now: fp32 matmul {peaks['fp32_tflops']} TFLOP/s, bf16 {peaks['bf16_tflops']} TFLOP/s")
    bf16, why = choose_bf16(cfg, peaks, out)
    cfg = replace(cfg, bf16=bf16, base=replace(cfg.base, bf16=bf16))
    if cfg.seeds is None:
        cfg = replace(cfg, seeds=DEFAULT_SEEDS[bf16])
        log(f"seeds: {cfg.seeds} ({'bf16' if bf16 else 'fp32'}'s default; --seeds N for more, added to this folder)")
    kept = f"kept from this folder's earlier stages, which chose it: {why}" if earlier else why
    log(f"precision: {'bf16 forwards (fp32 weights in training)' if bf16 else 'fp32'}, {kept}")
    if bf16 and bf16_is_slow(peaks["bf16_tflops"], peaks["fp32_tflops"]):
        log(
            f"warning: bf16 matmuls run at {peaks['bf16_tflops']} TFLOP/s here against fp32's {peaks['fp32_tflops']}: "
            "this demo will take many times longer than in fp32 (--no-bf16, with another --out)"
        )
    record_settings(out, {"quick": quick, **asdict(cfg), "precision": why})
    return cfg, Timings(out, peaks)


def check_settings_of(out: Path, settings: dict) -> None:
    """Refuse `settings` where OUT/demo.json records others (all but RERUN_MAY_CHANGE) for the folder's stages, so
    that a re-run does not mix its runs with another setting's under one label; --quick against a full folder (or
    the reverse) is said first, as the one cause of its many differences."""
    record = out / "demo.json"
    if not record.is_file():
        return
    saved = read_json_object(record, DEMO_JSON)
    if saved.get("quick") != settings["quick"]:
        raise UserError(f"{out} was made {'with' if saved.get('quick') else 'without'} --quick: "
                        f"{'add' if saved.get('quick') else 'leave out'} --quick to continue it, or use another --out")
    now, saved = dotted(jsonable(settings)), dotted(saved)  # nested configs by dotted key: a difference is named
    keys = [k for k in now if k.split(".")[0] not in RERUN_MAY_CHANGE]
    check_settings(record, saved, now, keys, fix="use another --out")


def record_settings(out: Path, settings: dict) -> None:
    """OUT/demo.json: the folder's settings, checked first (`check_settings_of`), then written."""
    check_settings_of(out, settings)
    write_json(out / "demo.json", jsonable(settings))


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


BF16_MARGIN = 1.2  # bf16 is chosen where its matmul peak is at least this many times fp32's: near 1x fp32 is as fast
# and exact, and the margin keeps noise from flipping the choice between runs (a CPU with bf16 instructions reads
# 2-4x, one without 0.01x or less)


def _precision_made(out: Path) -> bool | None:
    """Whether the folder's stages run in bf16, by its base model's settings (else demo.json's while the base model
    trains); None before any stage began."""
    marker, saved = out / "base" / PRETRAIN_FILE, out / "demo.json"
    if marker.is_file():
        return json.loads(marker.read_text())["config"]["bf16"]
    if (out / "base").exists() and saved.is_file():
        return read_json_object(saved, DEMO_JSON).get("bf16")
    return None


def choose_bf16(cfg: DemoConfig, peaks: dict, out: Path) -> tuple[bool, str]:
    """Whether the demo's forwards run in bf16 (`DemoConfig.bf16`), and why: as the folder's earlier stages (its base
    model's settings, else demo.json while the base model trains), so that a re-run skips them and its runs stay
    alike (a flag asking for the other precision is refused; the reason is the one demo.json recorded when they
    began); else as asked; else bf16 where this machine's bf16 matmul peak, measured at the start, is at least
    BF16_MARGIN times its fp32 one (CPUs without AVX-512 run bf16 matmuls ~100x slower than fp32 ones)."""
    saved = out / "demo.json"
    record = read_json_object(saved, DEMO_JSON) if saved.is_file() else {}  # the settings of its first stages
    made = _precision_made(out)
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

"""The paper's pipeline in miniature, offline, on a CPU: `bridgelm demo --out DIR`.

Stages, each with the project's own functions, each writing under DIR and skipped when its output is there:
  base       pre-train a small Qwen2 on worked sums taken in any order (cached; see demo/base.py, tasks/anysum.py)
  warmup     the base model samples 8 answers per training problem; correct ones kept (paper 4.1)
  sft        warm up Bridge blocks and P-Match blocks on them, base frozen (paper 3.2)
  rl         GRPO for the arms "RLVR only", "P-Match" and "Bridge": same prompts, budget, seeds, settings
  eval       held-out test problems, n samples each: every arm, Bridge at widths 1..16 (same random draws at
             every width: the share of samples that change is the interaction), and control (b), foreign
             siblings: the Bridge model with groups made of samples of different problems
  report     DIR/report.md, DIR/results.json and PNG figures: the paper's tables, the controls, and paired
             differences between arms with 95% intervals over seeds and problems

The RL arms run over `seeds` seeds (3 by default); the arms share each seed. `--quick` runs the same stages at
toy sizes (numbers mean nothing; it proves the pipeline). Departures from the paper's settings that a model of
this size needs are fields of DemoConfig, listed by the report (`departures`). After the base model, stages that do
not read each other's outputs run side by side in `workers` processes (DIR/logs/<stage>.log holds each one's output).
The problems are written out too (DIR/data/<task>/train.jsonl and test.jsonl), so that the commands evaluate or
train the demo's models on them (`bridgelm eval --task anysum --data DIR/data/anysum/test.jsonl ...`: benchmark
"anysum", as in the demo's own evaluations).
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
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path

import torch

from bridgelm.attach import add_seeded_blocks
from bridgelm.blockfile import load_blocks
from bridgelm.models import load_model
from bridgelm.demo.base import PRETRAIN_FILE, BaseConfig, generate, make_task, pretrain
from bridgelm.demo.results import TITLES, RunDirs, write_demo_report
from bridgelm.errors import UserError, show_data_warnings
from bridgelm.jsonl import write_atomic, write_json
from bridgelm.rng import derive_seed
from bridgelm.runs import list_checkpoints
from bridgelm.tasks import anysum

RL_ARMS = ("rlvr", "pmatch", "bridge")  # the paper's arms; optional: "bridge_cold", "bridge_attn"
TRACE_SEED = 0  # the Bridge run whose checkpoints the trace stage follows


@dataclass
class DemoConfig:
    """Sizes of every stage; `quick()` shrinks them to toy sizes."""

    base: BaseConfig = field(default_factory=BaseConfig)  # the base model and its pre-training
    block_heads: int = 4  # heads of the added blocks
    block_head_dim: int = 16  # their head dim (4 x 16 = 64 wide: 12% of this tiny model, like-for-like for P-Match)
    warmup_problems: int = 400  # training problems the base model answers for the warm-up data
    warmup_n: int = 8  # answers per problem (paper: 8)
    sft_epochs: int = 5  # paper: 5
    sft_lr: float = 1e-3  # the paper's 2e-5 is for 7B models; a 2M model needs larger steps
    rl_steps: int = 80  # GRPO steps per arm
    rl_prompts: int = 16  # P, prompts per step
    rl_rollouts: int = 8  # G (paper: 8)
    rl_width: int = 8  # w of Bridge while training (paper: 4 or 8): every rollout of a prompt sees the others
    rl_steps_per_rollout: int = 2  # K
    rl_lr: float = 1e-4  # constant after 10% warm-up (the paper: 1e-6 for 1.5B-8B models)
    rl_beta: float = 1e-3  # KL weight (paper: 1e-3)
    rl_block_lr: float | None = None  # lr of the added blocks in RL (None: rl_lr, as in the paper)
    bf16: bool | None = None  # bf16 autocast of pre-training, SFT and RL forwards (fp32 weights and optimiser; 1.6x
    # faster on a CPU with AVX-512 BF16), and sampling (warm-up data, RL rollouts, evaluation) with bf16 weights
    # (1.3-1.5x faster); None: as the folder's earlier stages, else bf16 where its matmul is at least BF16_MARGIN
    # times as fast as fp32's (measured at the start: on CPUs without AVX-512 it is about 100x slower), else fp32
    max_new_tokens: int = 56  # the longest worked solution (5 numbers) is 49 tokens with its EOS
    temperature: float = 0.6  # paper: 0.6 for training and evaluation
    top_p: float = 0.95  # evaluation nucleus (paper: 0.95)
    eval_problems: int = 240  # held-out test problems (a multiple of eval_width, for the foreign-siblings control)
    eval_n: int = 16  # samples per problem (divisible by every width)
    eval_width: int = 8  # Bridge's width in the main table (paper: 8)
    widths: tuple[int, ...] = (1, 2, 4, 8, 16)  # Bridge widths of the width table (paper Table 3)
    trace_problems: int = 120  # test problems of the trace (interaction over the course of RL, Bridge seed 0)
    trace_n: int = 8  # samples per problem in the trace (a multiple of eval_width)
    gpass_k: int = 8  # G-Pass@k of the set figures (paper: 8)
    seeds: int = 3  # RL seeds per arm (the arms share each seed)
    sft_per_seed: bool = True  # RL seed s of P-Match and Bridge starts from SFT seed s (off: all from SFT seed 0)
    foreign_control: bool = True  # control (b): Bridge at eval_width with groups of samples of different problems
    cold_start: bool = False  # optional arm: Bridge RL from fresh blocks, no SFT (paper Table 4)
    attn_placement: bool = False  # optional arm: Bridge blocks after attention, SFT + RL (paper App. D)
    threads: int = 0  # torch threads (0 = torch's default); each of the workers gets threads // workers, at least 1
    workers: int = 2  # stages that do not wait on each other run in this many processes at once (1: one by one)

    @staticmethod
    def quick() -> DemoConfig:
        return DemoConfig(
            base=BaseConfig(
                task=anysum.AnySumSpec(min_operands=2, max_operands=3, max_value=20),  # learnable in seconds
                hidden_size=64,
                num_layers=2,
                num_heads=4,
                num_kv_heads=2,
                intermediate_size=128,
                steps=300,
                schedule_steps=300,
                batch_size=32,
                distinct=False,
                check_from=200,
                check_every=50,
                check_problems=20,
            ),
            warmup_problems=48,
            warmup_n=4,
            sft_epochs=1,
            rl_steps=3,
            rl_prompts=4,
            rl_rollouts=4,
            rl_width=2,
            eval_problems=12,
            eval_n=8,
            eval_width=4,
            widths=(1, 2, 4, 8),
            max_new_tokens=32,
            seeds=1,
        )


def _no_summary(result) -> str:
    return ""


@dataclass
class Job:
    """One stage for `Stages.run_all`."""

    name: str  # the stage's name in the log, timings.json and the report
    output: Path  # its output: the stage is skipped when this exists
    fn: Callable[[], object]  # runs it (picklable, e.g. a partial of a module-level function, to run in a worker)
    summary: Callable[[object], str] = _no_summary  # one line about fn's result, for the log
    after: tuple[str, ...] = ()  # stages that must be done first


class Stages:
    """Runs named stages (one by one, or side by side in worker processes: `run_all`); a stage whose output exists is
    skipped. Prints a one-line summary of each.

    Stage times are kept in `record` (a JSON file), so a re-run that skips finished stages still reports them. So is
    the machine's speed they were taken at: `peaks` (this invocation's matmul peaks) goes into `peak_record` (a JSON
    list, one entry per invocation that ran stages, with their names) as soon as this invocation runs one."""

    def __init__(
        self,
        log=print,
        record: Path | None = None,
        peak_record: Path | None = None,
        peaks: dict | None = None,
        logs: Path = Path("logs"),
    ):
        self.log = log
        self.logs = logs  # where each stage run in a worker writes its output
        self.start = time.perf_counter()
        self.record = record
        self.timings: dict[str, float] = json.loads(record.read_text()) if record and record.exists() else {}
        self.peak_record = peak_record
        self.peaks: list[dict] = json.loads(peak_record.read_text()) if peak_record and peak_record.exists() else []
        self.mine = {**(peaks or {}), "stages": []}  # this invocation's entry of `peaks`, added when it runs a stage

    def run(self, name: str, output: Path, fn, summary=_no_summary):
        """One stage, in this process (skipped when `output` exists); returns fn's result (None when skipped)."""
        job = Job(name, output, fn, summary)
        return None if self._skip(job) else self._run_here(job)

    def _skip(self, job: Job) -> bool:
        if job.output.exists():
            self.log(f"[{job.name}] already done: {job.output}")
        return job.output.exists()

    def _run_here(self, job: Job):
        t0 = time.perf_counter()
        result = job.fn()
        self._finish(job, result, time.perf_counter() - t0)
        return result

    def run_all(self, jobs: list[Job], workers: int = 1, threads: int = 1) -> None:
        """Run `jobs` (listed after the jobs they depend on), skipping those already done. With `workers` > 1, jobs
        whose dependencies are done run side by side in that many spawned processes of `threads` torch threads each
        (a 2M model is bound by per-op overhead: two 1-thread processes do ~1.5x the work of one 2-thread process);
        each job's output goes to LOGS/<stage>.log instead of the terminal. A job's result does not depend on which
        worker ran it or what ran beside it: every stage seeds its own random numbers."""
        unknown = sorted({a for j in jobs for a in j.after} - {j.name for j in jobs})
        if unknown:
            raise RuntimeError(f"stages wait on stages that are not in the list: {unknown}")
        todo = [j for j in jobs if not self._skip(j)]
        self.mine["workers"] = workers
        if workers <= 1:
            for j in todo:
                self._run_here(j)
            return
        done = {j.name for j in jobs} - {j.name for j in todo}
        context = multiprocessing.get_context("spawn")  # not fork: torch's thread pools do not survive a fork
        pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_worker_start, initargs=(threads,))
        running: dict = {}  # future -> (job, its log file)
        try:
            while todo or running:
                for j in [j for j in todo if all(a in done for a in j.after)][: workers - len(running)]:
                    todo.remove(j)  # submitted only when a worker is free: it starts now, in list order
                    log = self.logs / f"{j.name.replace(' ', '_')}.log"
                    self.log(f"[{j.name}] started (output in {log})")
                    running[pool.submit(_timed_in_worker, j.fn, log)] = (j, log)
                if not running:
                    raise RuntimeError(f"stages wait on each other: {[j.name for j in todo]}")
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in finished:
                    j, log = running[future]
                    if future.exception() is not None:
                        self.log(f"[{j.name}] failed (its output: {log}); waiting for the stages still running")
                        raise future.exception()
                    del running[future]
                    self._finish(j, *future.result())
                    done.add(j.name)
        except KeyboardInterrupt:
            names = ", ".join(j.name for j, _ in running.values())
            self.log(f"interrupted: the stages running ({names}) keep their checkpoints; a re-run resumes them")
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            for future, (j, _) in running.items():  # those that finished meanwhile: their times are kept too
                if future.done() and not future.cancelled() and future.exception() is None:
                    self._finish(j, *future.result())

    def _finish(self, job: Job, result, seconds: float) -> None:
        self.time(job.name, seconds, ran=True)
        text = job.summary(result)
        self.log(f"[{job.name}] done in {self.timings[job.name]:.0f}s{': ' + text if text else ''} -> {job.output}")

    def time(self, name: str, seconds: float, ran: bool) -> None:
        """Record a stage's time; `ran`: this invocation ran it (else it was timed before, e.g. the cached base)."""
        self.timings[name] = round(seconds, 1)
        if self.record is not None:
            write_json(self.record, self.timings)
        if ran:
            if not self.mine["stages"]:
                self.peaks.append(self.mine)
            self.mine["stages"].append(name)
            self.mine["wall_s"] = round(time.perf_counter() - self.start, 1)
            if self.peak_record is not None:
                write_json(self.peak_record, self.peaks)


def _worker_start(threads: int) -> None:
    """A worker process's setup: its torch threads, and Ctrl-C ignored between stages (an idle worker killed by it
    would break the pool, which then kills the workers still saving their checkpoints); data warnings printed to the
    stage logs as one line, as the command line prints them."""
    show_data_warnings("bridgelm demo")
    torch.set_num_threads(threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _timed_in_worker(fn, log: Path):
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


def _rl_config(cfg: DemoConfig, arm: str, seed: int):
    from bridgelm.train.rl import RLConfig

    return RLConfig(
        steps=cfg.rl_steps,
        prompts_per_step=cfg.rl_prompts,
        rollouts=cfg.rl_rollouts,
        width=cfg.rl_width,
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=1.0,
        steps_per_rollout=cfg.rl_steps_per_rollout,
        micro_batch_groups=64,
        micro_batch_tokens=2048,  # groups by length, <= 2048 padded tokens: a 16% faster update than 64 rows in one
        rollout_dtype="bfloat16" if cfg.bf16 else None,
        lr=cfg.rl_lr,
        block_lr=cfg.rl_block_lr,
        beta=cfg.rl_beta,
        bf16=cfg.bf16,
        seed=seed,
        save_every=20,  # an interrupted demo resumes its RL stage from here (bit-exact)
        # every checkpoint of the traced run kept (the interaction over the course of RL); elsewhere the last one
        keep_last=0 if (arm, seed) == ("bridge", TRACE_SEED) else 1,
        eval_every=0,
        resume=True,  # continue a run found in the stage's folder; start afresh when there is none
    )


@dataclass
class Context:
    """What every stage reads: the output folder, the settings, the base model and the tasks."""

    out: Path
    cfg: DemoConfig
    base_dir: Path
    tokenizer: object
    train: object  # Task: RL prompts (the first warmup_problems are the warm-up problems)
    test: object  # Task: held-out test problems

    def __post_init__(self):
        if not isinstance(self.cfg.bf16, bool):  # None would read as fp32 in every stage, whatever run_demo chose
            raise TypeError(f"Context needs a resolved DemoConfig.bf16 (True or False), not {self.cfg.bf16!r}")

    def sampler(self, path, blocks: Path | None = None) -> torch.nn.Module:
        """A model folder (plus a block file) loaded for sampling: in bf16 when `cfg.bf16` (1.3-1.5x faster on CPU),
        else float32."""
        return load_model(str(path), blocks, dtype=torch.bfloat16 if self.cfg.bf16 else torch.float32)

    def sft_dir(self, kind: str, seed: int) -> Path:
        return self.out / f"sft_{kind}_s{seed}"

    def rl_dir(self, arm: str, seed: int) -> Path:
        return self.out / f"rl_{arm}_s{seed}"

    def eval_dir(self, arm: str, seed: int) -> Path:
        return self.out / f"eval_{arm}_s{seed}"

    def foreign_dir(self, seed: int) -> Path:
        return self.out / f"eval_bridge_foreign_s{seed}"


def rl_arms(cfg: DemoConfig) -> tuple[str, ...]:
    """The RL arms of this run: the paper's three, then the optional ones asked for."""
    return RL_ARMS + (("bridge_cold",) if cfg.cold_start else ()) + (("bridge_attn",) if cfg.attn_placement else ())


def sft_kinds(cfg: DemoConfig) -> tuple[str, ...]:
    """Block sets warmed up by SFT: Bridge and P-Match, and Bridge after attention when that arm is asked for."""
    return ("bridge", "pmatch") + (("bridge_attn",) if cfg.attn_placement else ())


def stage_warmup(ctx: Context) -> dict:
    """The base model samples warmup_n answers per training problem (independently); correct ones are kept."""
    from bridgelm.train.warmup_data import make_warmup_data

    cfg = ctx.cfg
    task = replace(ctx.train, examples=ctx.train.examples[: cfg.warmup_problems])
    stats = make_warmup_data(
        ctx.sampler(ctx.base_dir),
        ctx.tokenizer,
        task,
        ctx.out / "warmup.jsonl",
        n=cfg.warmup_n,
        sampling=_sampling(cfg, cfg.warmup_n, 1),
    )
    stats["distinct_per_kept_problem"] = distinct_traces(ctx.out / "warmup.jsonl")
    return stats


def distinct_traces(path: Path) -> float:
    """Mean number of distinct responses among the kept responses of a problem of a warm-up file."""
    from bridgelm.jsonl import read_records

    kept = [r for r in read_records(path, repair=False) if r.get("kept")]
    counts = [len({json.dumps(x) for x in r["responses"]}) for r in kept]
    return sum(counts) / max(1, len(counts))


def sft_seeds(cfg: DemoConfig) -> tuple[int, ...]:
    """Seeds of the SFT runs: one per RL seed, or seed 0 alone (shared by every RL seed)."""
    return tuple(range(cfg.seeds)) if cfg.sft_per_seed else (0,)


def sft_seed_of(cfg: DemoConfig, seed: int) -> int:
    """The SFT run that RL seed `seed` starts from."""
    return seed if cfg.sft_per_seed else 0


def stage_sft(ctx: Context, kind: str, seed: int) -> dict:
    """SFT warm-up of one block set from `seed`, base frozen (paper 3.2); resumes an interrupted run of its folder."""
    from bridgelm.train.sft import SFTConfig, train_sft

    cfg = ctx.cfg
    blocks = "pmatch" if kind == "pmatch" else "bridge"
    placement = "attn" if kind == "bridge_attn" else "ffn"
    sft_cfg = SFTConfig(
        blocks=blocks,
        num_heads=cfg.block_heads,
        placement=placement,
        epochs=cfg.sft_epochs,
        lr=cfg.sft_lr,
        max_length=256,
        bf16=cfg.bf16,
        progress=True,
        resume=True,  # continue a run found in the stage's folder; start afresh when there is none
        seed=seed,  # the split, the groups and the batch order
    )
    model = _with_blocks(load_model(str(ctx.base_dir)), blocks, cfg, placement, seed=seed)
    result = train_sft(model, ctx.tokenizer, ctx.out / "warmup.jsonl", sft_cfg, ctx.sft_dir(kind, seed))
    return {"best_val_ppl": result.best_val_ppl, "best_epoch": result.best_epoch, "steps": result.steps}


def stage_rl(ctx: Context, arm: str, seed: int) -> dict:
    """GRPO of one arm and seed; every arm shares the prompts, budget, settings and seed."""
    from bridgelm.train.rl import train_rl

    model = load_model(str(ctx.base_dir))
    if arm == "bridge_cold":  # paper Table 4: fresh Bridge blocks (zero output), no SFT
        _with_blocks(model, "bridge", ctx.cfg, seed=seed)
    elif arm != "rlvr":
        load_blocks(model, ctx.sft_dir(arm, sft_seed_of(ctx.cfg, seed)) / "blocks.safetensors")
    result = train_rl(model, ctx.tokenizer, ctx.train, _rl_config(ctx.cfg, arm, seed), ctx.rl_dir(arm, seed))
    return _rl_summary(result)


def model_of(ctx: Context, arm: str, seed: int) -> str:
    if arm == "base":
        return str(ctx.base_dir)
    return str(json.loads((ctx.rl_dir(arm, seed) / "done.json").read_text())["final_dir"])


def stage_eval(ctx: Context, arm: str, seed: int, foreign: bool = False) -> dict:
    """Held-out evaluation of one arm and seed: n samples per problem, every width for Bridge arms.

    `foreign`: control (b), the Bridge model at the main width with groups made of samples of different problems.
    """
    from bridgelm.evaluate import EvalConfig, run_eval
    from bridgelm.score import score_run

    cfg = ctx.cfg
    bridge_like = arm.startswith("bridge")
    widths = [cfg.eval_width] if foreign else list(cfg.widths) if bridge_like else [1]
    ecfg = EvalConfig(
        n=cfg.eval_n,
        width=cfg.eval_width if bridge_like else 1,
        widths=widths,
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        seed=seed,
        gpass_k=cfg.gpass_k,
        foreign_groups=foreign,
    )
    path = model_of(ctx, arm, seed)
    run_dir = ctx.foreign_dir(seed) if foreign else ctx.eval_dir(arm, seed)
    run_eval(ctx.sampler(path), ctx.tokenizer, ctx.test, None, ecfg, run_dir, model_id=path)
    return score_run(run_dir, task=ctx.test)


def stage_trace(ctx: Context, seed: int = TRACE_SEED) -> dict:
    """Diagnostic: the Bridge arm over the course of RL (seed `seed`). For the SFT blocks (step 0) and every RL
    checkpoint: accuracy at w = 1 and w = eval_width on the test problems, and the interaction (share of samples that
    differ from their w = 1 counterpart, drawn with the same random numbers)."""
    from bridgelm.evaluate import grade_samples, sample_examples

    cfg, test = ctx.cfg, ctx.test
    points = [(0, None)] + [(int(c.name.split("-")[1]), c) for c in list_checkpoints(ctx.rl_dir("bridge", seed))]
    problems = test.examples[: cfg.trace_problems]
    rows = []
    for step, folder in points:
        if folder is None:
            model = ctx.sampler(ctx.base_dir, ctx.sft_dir("bridge", sft_seed_of(cfg, seed)) / "blocks.safetensors")
        else:
            model = ctx.sampler(folder)
        drawn, acc = {}, {}
        for w in (1, cfg.eval_width):  # the same random draws at both widths
            samples = sample_examples(model, ctx.tokenizer, test, problems, _sampling(cfg, cfg.trace_n, w, seed))
            drawn[w] = [s.token_ids for outs in samples for s in outs]
            acc[w] = sum(map(sum, grade_samples(test, problems, samples))) / len(drawn[w])
        differ = sum(a != b for a, b in zip(drawn[1], drawn[cfg.eval_width])) / len(drawn[1])
        rows.append({"step": step, "w1": acc[1], f"w{cfg.eval_width}": acc[cfg.eval_width], "interaction": differ})
    return {"seed": seed, "width": cfg.eval_width, "points": rows}


def run_demo(out: str | Path, cfg: DemoConfig, quick: bool = False, log=print) -> Path:
    """Every stage of the miniature pipeline into `out`; returns the path of report.md."""
    from bridgelm.hardware import bf16_is_slow, matmul_peaks
    from bridgelm.tokenizer import load_tokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    check_sft_layout(out, cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    peaks = matmul_peaks()
    log(f"this machine now: fp32 matmul {peaks['fp32_tflops']} TFLOP/s, bf16 {peaks['bf16_tflops']} TFLOP/s")
    bf16, why = choose_bf16(cfg, peaks, out)
    cfg = replace(cfg, bf16=bf16, base=replace(cfg.base, bf16=bf16))
    log(f"precision: {'bf16 forwards (fp32 weights in training)' if bf16 else 'fp32'}, {why}")
    if bf16 and bf16_is_slow(peaks["bf16_tflops"], peaks["fp32_tflops"]):
        log(
            f"warning: bf16 matmuls run at {peaks['bf16_tflops']} TFLOP/s here against fp32's {peaks['fp32_tflops']}: "
            "this demo will take many times longer than in fp32 (--no-bf16, with another --out)"
        )
    stages = Stages(log, out / "timings.json", out / "peaks.json", peaks, logs=out / "logs")
    settings = {"quick": quick, **asdict(cfg), "precision": why}
    write_json(out / "demo.json", settings)

    # 1. base model (cached by its settings)
    trained = not (out / "base" / PRETRAIN_FILE).exists()
    base_dir = pretrain(cfg.base, out / "base", log=log)
    stages.time("base", json.loads((base_dir / PRETRAIN_FILE).read_text())["seconds"], ran=trained)
    spec = cfg.base.task
    # Training prompts may repeat at toy sizes; test problems are always distinct.
    rl_problems = max(cfg.warmup_problems, cfg.rl_steps * cfg.rl_prompts)
    ctx = Context(
        out=out,
        cfg=cfg,
        base_dir=base_dir,
        tokenizer=load_tokenizer(base_dir),
        train=make_task(spec, generate(spec, rl_problems, "train", 1, distinct=not quick)),
        test=make_task(spec, generate(spec, cfg.eval_problems, "test", 0)),
    )

    # The problems, for the commands (the CLI's own generator draws the default spec's problems, not --quick's).
    for split, task in (("train", ctx.train), ("test", ctx.test)):
        rows = "".join(json.dumps(row) + "\n" for row in task.examples)
        write_atomic(out / "data" / task.name / f"{split}.jsonl", rows)

    # 2-6: warm-up data, SFT, RL, evaluation and the trace, each job after the ones it reads
    jobs = [Job("warmup", out / "warmup.done", partial(_recorded, out / "warmup.done", stage_warmup, ctx), json.dumps)]
    for seed in sft_seeds(cfg):  # SFT warm-up of the new blocks (base frozen)
        for kind in sft_kinds(cfg):
            done = ctx.sft_dir(kind, seed) / "done.json"  # blocks.safetensors appears at the first epoch's end
            fn = partial(_recorded, done, stage_sft, ctx, kind, seed)
            jobs.append(Job(f"sft {kind} seed {seed}", done, fn, _sft_summary, ("warmup",)))
    for seed in range(cfg.seeds):  # RL arms: same prompts, budget, seeds and settings
        for arm in rl_arms(cfg):
            done = ctx.rl_dir(arm, seed) / "done.json"
            after = () if arm in ("rlvr", "bridge_cold") else (f"sft {arm} seed {sft_seed_of(cfg, seed)}",)
            jobs.append(
                Job(f"rl {arm} seed {seed}", done, partial(_recorded, done, stage_rl, ctx, arm, seed), _rl_text, after)
            )
    # evaluation on the held-out test split, then control (b): foreign siblings
    eval_dirs: dict[tuple[str, int], Path] = {}
    for seed in range(cfg.seeds):
        for arm in ("base",) + rl_arms(cfg):
            if arm == "base" and seed > 0:
                continue
            eval_dirs[(arm, seed)] = ctx.eval_dir(arm, seed)
            after = () if arm == "base" else (f"rl {arm} seed {seed}",)
            summary = partial(_eval_summary, arm=arm)
            jobs.append(
                Job(
                    f"eval {arm} seed {seed}",
                    eval_dirs[(arm, seed)] / "metrics.json",
                    partial(stage_eval, ctx, arm, seed),
                    summary,
                    after,
                )
            )
        if cfg.foreign_control:
            output = ctx.foreign_dir(seed) / "metrics.json"
            fn = partial(stage_eval, ctx, "bridge", seed, foreign=True)
            summary = partial(_eval_summary, arm="bridge")
            jobs.append(Job(f"eval foreign siblings seed {seed}", output, fn, summary, (f"rl bridge seed {seed}",)))
    # diagnostic: the interaction over the course of RL (Bridge, seed 0)
    trace = partial(_recorded, out / "trace.json", stage_trace, ctx)
    jobs.append(Job("trace", out / "trace.json", trace, _trace_summary, (f"rl bridge seed {TRACE_SEED}",)))
    workers = max(1, min(cfg.workers, len(jobs)))
    stages.run_all(jobs, workers, threads=max(1, torch.get_num_threads() // workers))

    # 7. report
    dirs = RunDirs(
        eval=eval_dirs,
        rl={(arm, seed): ctx.rl_dir(arm, seed) for seed in range(cfg.seeds) for arm in rl_arms(cfg)},
        foreign={seed: ctx.foreign_dir(seed) for seed in range(cfg.seeds)} if cfg.foreign_control else {},
    )
    report = write_demo_report(out, cfg, dirs, stages.timings, quick, stages.peaks)
    log(f"[report] {report}")
    return report


BF16_MARGIN = 1.2  # bf16 is chosen where its matmul peak is at least this many times fp32's: near 1x fp32 is as fast
# and exact, and the margin keeps noise from flipping the choice between runs (a CPU with bf16 instructions reads
# 2-4x, one without 0.01x or less)


def choose_bf16(cfg: DemoConfig, peaks: dict, out: Path) -> tuple[bool, str]:
    """Whether the demo's forwards run in bf16 (`DemoConfig.bf16`), and why: as the folder's earlier stages (its base
    model's settings, else demo.json while the base model trains), so that a re-run skips them and its runs stay
    alike (a flag asking for the other precision is refused; the reason is the one demo.json recorded when they
    began); else as asked; else bf16 where this machine's bf16
    matmul peak, measured at the start, is at least BF16_MARGIN times its fp32 one (CPUs without AVX-512 run bf16
    matmuls ~100x slower than fp32 ones)."""
    marker, saved = out / "base" / PRETRAIN_FILE, out / "demo.json"
    recorded = json.loads(saved.read_text()) if saved.is_file() else {}  # demo.json of the folder's first stages
    made = None
    if marker.is_file():
        made = (json.loads(marker.read_text()).get("config") or {}).get("bf16")
    elif (out / "base").exists():
        made = recorded.get("bf16")
    flag = {True: "--bf16", False: "--no-bf16"}
    if isinstance(made, bool):
        if cfg.bf16 is not None and cfg.bf16 != made:
            raise UserError(
                f"{out} holds stages made with {flag[made]}, not {flag[cfg.bf16]}: use another --out for "
                f"{flag[cfg.bf16]}, or leave the flag out to continue this folder"
            )
        # The reason recorded when the folder's stages began (why that precision), kept for its report.
        if recorded.get("bf16") is made and isinstance(recorded.get("precision"), str) and recorded["precision"]:
            return made, recorded["precision"]
        return made, f"as this folder's earlier stages ({flag[not made]} needs another --out)"
    if cfg.bf16 is not None:
        return cfg.bf16, f"as asked ({flag[cfg.bf16]})"
    fast = peaks["bf16_tflops"] >= BF16_MARGIN * peaks["fp32_tflops"]
    return fast, (
        f"this machine's bf16 matmul peak is {'at least' if fast else 'under'} {BF16_MARGIN}x its fp32 one "
        f"({peaks['bf16_tflops']} against {peaks['fp32_tflops']} TFLOP/s; --bf16 or --no-bf16 to choose)"
    )


def check_sft_layout(out: Path, cfg: DemoConfig) -> None:
    """Refuse a folder whose finished RL stages started from SFT runs laid out otherwise (`sft_per_seed`, or a run
    from before it): they would be skipped and mixed with this setting's runs under its label."""
    saved = out / "demo.json"
    if not saved.is_file() or not any(out.glob("rl_*/done.json")):
        return
    before = json.loads(saved.read_text()).get("sft_per_seed", "absent (one SFT run, from before per-seed SFT)")
    if before != cfg.sft_per_seed:
        raise UserError(
            f"{out} holds RL runs made with sft_per_seed={before}, not {cfg.sft_per_seed}: use another --out, or "
            f"the setting it was made with"
        )


def _sampling(cfg: DemoConfig, n: int, width: int, seed: int = 0):
    from bridgelm.engine import SamplingConfig

    return SamplingConfig(
        n=n, width=width, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, seed=seed
    )


def _trace_summary(trace: dict) -> str:
    w = trace["width"]
    points = trace["points"]
    return "; ".join(
        f"step {p['step']}: w1 {p['w1']:.3f}, w{w} {p[f'w{w}']:.3f}, differ {p['interaction']:.3f}" for p in points
    )


def _with_blocks(model, kind: str, cfg: DemoConfig, placement: str = "ffn", seed: int = 0):
    """Fresh blocks of the demo's size, drawn from `seed` (not from the global generator, whose state depends on
    what this process ran before)."""
    return add_seeded_blocks(
        model,
        kind,
        derive_seed(seed, "demo-blocks", kind, placement),
        num_heads=cfg.block_heads,
        head_dim=cfg.block_head_dim,
        placement=placement,
    )


def _recorded(path: Path, stage, *args, **kwargs):
    """Run `stage(*args, **kwargs)` and write its (JSON) result to `path`, the mark that the stage is done."""
    payload = stage(*args, **kwargs)
    write_json(path, payload)
    return payload


def _sft_summary(result: dict) -> str:
    if result["best_val_ppl"] is None:  # too few kept warm-up problems to hold any out
        return f"{result['steps']} steps, no held-out problems (blocks of the last epoch)"
    return f"best validation perplexity {result['best_val_ppl']:.3f} (epoch {result['best_epoch']})"


def _rl_text(s: dict) -> str:
    return f"reward {s['first_reward']:.3f} -> {s['last_reward']:.3f} over {s['steps']} steps"


def _rl_summary(result) -> dict:
    rewards = [h.get("reward") for h in result.history if h.get("reward") is not None]
    head = rewards[: max(1, len(rewards) // 10)]
    tail = rewards[-max(1, len(rewards) // 10) :]
    return {
        "final_dir": str(result.final_dir),
        "steps": result.steps,
        "first_reward": sum(head) / max(1, len(head)),
        "last_reward": sum(tail) / max(1, len(tail)),
    }


def _eval_summary(metrics: dict, arm: str) -> str:
    avg = metrics.get("avg", {})
    parts = []
    for w, entry in sorted(avg.items(), key=lambda kv: int(kv[0])):
        acc = entry["metrics"]["accuracy"]["mean"]
        parts.append(f"w={w} accuracy {100 * acc:.1f}%")
    return f"{TITLES.get(arm, arm)}: " + ", ".join(parts)

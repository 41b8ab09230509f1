"""What only a GPU can show, in one command that fits one short GPU slot (the default run: about 6 minutes on one
GPU from a cold compile cache, never more than --budget 470 s):

    python benchmarks/gpu_check.py --out runs/gpu_check                    # on a CUDA machine
    python benchmarks/gpu_check.py --out runs/gpu_check --only cuda_tests  # some rows (--only ROW,ROW); --all: all
    python benchmarks/gpu_check.py --dry-run --all --out DIR               # the same code at toy sizes on the CPU

Each row runs in a child process of its own, with a timeout, and is appended to DIR/gpu_check.jsonl (one JSON object
a line, flushed and synced) the moment it ends: a run cut off keeps every row before. A row that times out, crashes
or does not fit in what is left of --budget is a row too (status "timeout", "error" or "skipped", with the last line
its child wrote; wall_s is each child's whole time). Each child's whole output (progress lines included) is kept in
DIR/logs/ROW.log. The table follows at the end; --json adds one object of every row as the last line.

  row              estimate / timeout, cold (s)  what it reports
  env              17 / 45    Python, torch, transformers and bridgelm versions, the GPU
  engine_eager     27 / 60    largest |log-prob - grouped_logits'| of the eager engine (Bridge blocks, ragged prompts)
  engine_compiled  45 / 90    the same for the compiled decode step; compile seconds; dynamo's graphs, graph breaks
                              and recompiles while it ran
  host_syncs       22 / 45    synchronising CUDA calls of the eager engine (set_sync_debug_mode): per decode step
                              (the slope between 16 and 48 tokens) and per call (prefill, samples handed back)
  decode           140 / 240  tok/s of the paper's 1.5B shape (bf16, 64 rows, 128 new tokens, compiled) against its
                              bandwidth roofline. Warmed up on the timed shape itself (same prompts, same settings,
                              so the same graphs); the warm-up's extra seconds are compile_s, apart from decode_s;
                              graphs made or recompiles during the timed run are reported (0 when the figure is clean)
  memory           (decode's child) its peak GPU memory against `bridgelm plan`'s weights and KV cache
  fsdp_rollout     18 / 45    a rollout from a model sharded by FSDP2 in a process group of one: the same tokens
  cuda_tests       170 / 300  tests/test_cuda.py through pytest: its summary line. Not in the default run (a slot of
                              its own: --only cuda_tests)
  grpo_step        100 / 150  benchmarks/train.py --repeats 1: one GRPO step of bridgelm against TRL's GRPOTrainer
                              (needs trl; without it the row says so and the others stand)
  refill           120 / 240  tok/s of 256 samples ending raggedly (mean ~1/3 of 1,024 tokens) through 64 rows, the
                              1.5B shape at 8 layers, compiled: finished groups' rows refilled (SamplingConfig.refill)
                              against plain waves, each warmed on its timed call. Not in the default run
                              (--only refill); its estimate is a guess until a GPU has run it

Estimates: what each row took on an H200 from a cold cache (2026-11-27), where it finished; a child's start-up
(Python, torch, CUDA context) is ~15 s of it. The inductor compile of the 1.5B decode step took over a minute per
graph; the step now compiles one graph however many read buckets a generation meets (it made four for decode's
128 tokens then, and that row timed out). The default rows' estimates add up to ~370 s. Timeouts add up to more
than --budget, so each row's timeout is cut to what is left of it and the whole run stays under the budget whatever
happens.

--dry-run keeps every code path (the compiled step included) with a 2-layer model of hidden size 64 on the CPU, so
that the script cannot rot unseen (tests/test_gpu_check.py); its figures mean nothing, its timeouts are 5 times
longer and it has no budget. --timeouts ROW=SECONDS,... overrides rows' timeouts (the test forces one to expire).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tested reference: test_engine.teacher_forced_logprobs

ROWS_SCRIPT = ROOT / "benchmarks" / "gpu_rows.py"
JSONL = "gpu_check.jsonl"
DRY_SCALE = 5  # a dry run's timeouts: the CPU is slower than the slot's GPU, and no slot bounds it


@dataclass(frozen=True)
class Row:
    """One child process: what it runs, its estimated and its longest time on one H100 from a cold cache."""

    name: str
    estimate_s: float
    timeout_s: float
    default: bool = True  # in the default run (else with --only or --all)

    def command(self, dry: bool) -> list[str]:
        if self.name == "cuda_tests":
            return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "test_cuda.py")]
        if self.name == "grpo_step":
            where = ["--quick", "--device", "cpu"] if dry else ["--device", "cuda", "--repeats", "1"]
            return [sys.executable, str(ROOT / "benchmarks" / "train.py"), "--json", *where]
        return [sys.executable, str(ROWS_SCRIPT), self.name, *(["--dry-run"] if dry else [])]


# Estimates: an H200's first run (2026-11-27, docs/benchmarks.md), where a row finished; decode from the CPU's count
# of compiles since (one graph, not four) and cuda_tests from the 11 of its 15 tests that passed in 120 s.
ROWS = [Row("env", 17, 45), Row("engine_eager", 27, 60), Row("engine_compiled", 45, 90), Row("host_syncs", 22, 45),
        Row("decode", 140, 240), Row("fsdp_rollout", 18, 45), Row("cuda_tests", 170, 300, default=False),
        Row("grpo_step", 100, 150), Row("refill", 120, 240, default=False)]
BUDGET_S = 470.0  # the default run's ceiling: under 8 minutes, within one 10-minute command of a 15-minute slot
MIN_ROW_S = 10.0  # a row is not started with less of the budget left


def parse(row: Row, stdout: str) -> list[dict]:
    """The records a finished child printed: gpu_rows' JSON lines, pytest's summary, train.py's last JSON line."""
    lines = stdout.strip().splitlines()
    if row.name == "cuda_tests":
        return [{"row": row.name, "summary": lines[-1] if lines else ""}]
    if row.name == "grpo_step":
        result = json.loads(lines[-1])
        keys = ("ours_over_trl", "ours_bridge_over_trl_bridge")
        return [{"row": row.name, "ours_seconds": result["ours"]["seconds_per_step"],
                 "trl_seconds": result["trl"]["seconds_per_step"], **{k: result[k] for k in keys}}]
    return [json.loads(line) for line in lines if line.startswith('{"row"')]


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][-500:] if lines else ""


def _keep_log(log: Path | None, stdout: str, stderr: str) -> None:
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"{stderr}\n--- stdout ---\n{stdout}")


def run_row(row: Row, dry: bool, timeout: float, log: Path | None = None) -> list[dict]:
    """Run one row's child under `timeout` seconds; its records, or one record saying why there are none. A child
    that outlives its timeout is killed with its whole process group (inductor's compile workers included). The
    child's whole output goes to `log` (stderr, then stdout), so that a row cut off says how far it came."""
    start = time.monotonic()
    proc = subprocess.Popen(row.command(dry), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        _keep_log(log, stdout, stderr)
        return [{"row": row.name, "status": "timeout", "timeout_s": timeout, "wall_s": _since(start),
                 "last_output": last_line(stderr) or last_line(stdout)}]
    seconds = _since(start)
    _keep_log(log, stdout, stderr)
    failed = proc.returncode != 0 and not (row.name == "cuda_tests" and proc.returncode == 1)  # 1: some tests failed
    if not failed:
        try:
            records = parse(row, stdout)
        except (ValueError, KeyError, IndexError) as e:
            records, failed, stderr = [], True, f"unreadable output ({type(e).__name__}: {e}); {last_line(stdout)}"
    if failed or not records:
        return [{"row": row.name, "status": "error", "exit": proc.returncode, "wall_s": seconds,
                 "last_output": last_line(stderr) or last_line(stdout)}]
    status = {"status": "ok"} if proc.returncode == 0 else {"status": "failed", "exit": proc.returncode}
    return [{"row": r["row"], **status, "wall_s": seconds, **{k: v for k, v in r.items() if k != "row"}}
            for r in records]


def _since(start: float) -> float:
    return round(time.monotonic() - start, 2)


def append(path: Path, record: dict) -> None:
    """One line, on disk before the next row starts (a run cut off keeps it)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def run(rows: list[Row], dry: bool, out: Path, budget: float | None, timeouts: dict[str, float]) -> list[dict]:
    path = out / JSONL
    start = time.monotonic()
    records = []
    append(path, {"row": "run", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "dry_run": dry, "budget_s": budget,
                  "rows": [r.name for r in rows], "estimate_s": sum(r.estimate_s for r in rows)})
    for row in rows:
        timeout = timeouts.get(row.name, row.timeout_s * (DRY_SCALE if dry else 1))
        left = None if budget is None else budget - (time.monotonic() - start)
        if left is not None and left < min(MIN_ROW_S, timeout):
            found = [{"row": row.name, "status": "skipped", "reason": f"{left:.0f} s of the {budget:.0f} s budget left"}]
        else:
            found = run_row(row, dry, timeout if left is None else min(timeout, left), out / "logs" / f"{row.name}.log")
        for record in found:
            append(path, record)
            print(json.dumps(record), flush=True)
        records += found
    return records


def table(records: list[dict]) -> str:
    width = max(len(r["row"]) for r in records)
    return "\n".join(f"{r['row']:<{width}}  {json.dumps({k: v for k, v in r.items() if k != 'row'})}" for r in records)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu_check", help="folder of gpu_check.jsonl")
    ap.add_argument("--only", default="", help="ROW,ROW,...: these rows alone, in the default order")
    ap.add_argument("--budget", type=float, default=None, help=f"seconds for the whole run (default {BUDGET_S:.0f}; "
                    "a dry run: none); each row's timeout is cut to what is left")
    ap.add_argument("--timeouts", default="", help="ROW=SECONDS,...: these rows' timeouts instead of the table's")
    ap.add_argument("--all", action="store_true", help="every row, cuda_tests included (more than one short slot)")
    ap.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU: every code path, no meaning")
    ap.add_argument("--json", action="store_true", help="one JSON object of every row as the last line")
    args = ap.parse_args(argv)
    names = [r.name for r in ROWS]
    args.rows = [r for r in ROWS if (r.name in args.only.split(",") if args.only else args.all or r.default)]
    unknown = [n for n in args.only.split(",") if args.only and n not in names]
    try:
        args.timeouts = {k: float(v) for k, v in (p.split("=", 1) for p in args.timeouts.split(",") if p)}
    except ValueError:
        ap.error(f"--timeouts {args.timeouts!r}: expected ROW=SECONDS,... with SECONDS a number")
    unknown += [n for n in args.timeouts if n not in names]
    if unknown:
        ap.error(f"unknown row(s) {','.join(unknown)}; rows: {','.join(names)}")
    if any(t <= 0 for t in args.timeouts.values()) or (args.budget is not None and args.budget <= 0):
        ap.error("--timeouts and --budget take positive seconds")
    if args.budget is None and not args.dry_run:
        args.budget = BUDGET_S
    return args


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"gpu_check: rows to {args.out / JSONL}", flush=True)
    records = run(args.rows, args.dry_run, args.out, args.budget, args.timeouts)
    print(table(records))
    if args.json:
        print(json.dumps({r["row"]: {k: v for k, v in r.items() if k != "row"} for r in records}))
    sys.exit(0 if all(r["status"] == "ok" for r in records) else 1)


if __name__ == "__main__":
    main()

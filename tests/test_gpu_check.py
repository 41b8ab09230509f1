"""benchmarks/gpu_check.py --dry-run: the GPU check's every code path at toy sizes on the CPU, so that the script a
GPU session runs first cannot rot unseen; and its bookkeeping: a row on disk as it ends, a timeout as a row."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def check(*args, timeout=900):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


def rows_of(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "gpu_check.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_gpu_check_dry_run_reports_every_check(tmp_path):
    proc = check("--dry-run", "--all", "--json", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    on_disk = rows_of(tmp_path)
    assert on_disk[0]["row"] == "run" and on_disk[0]["dry_run"] is True
    assert {r["row"]: {k: v for k, v in r.items() if k != "row"} for r in on_disk[1:]} == out  # every row, as printed
    assert [r["row"] for r in on_disk[1:]] == ["env", "engine_eager", "engine_compiled", "host_syncs", "decode",
                                               "memory", "fsdp_rollout", "cuda_tests", "grpo_step", "refill"]
    assert all(r["status"] == "ok" and r["wall_s"] > 0 for r in out.values())
    assert out["env"]["device"] == "cpu" and out["env"]["torch"].startswith(tuple("0123456789"))
    assert "skipped" in out["cuda_tests"]["summary"]  # no CUDA here: test_cuda.py skips, with its reason
    for step in ("engine_eager", "engine_compiled"):  # the engine's log-probs are the teacher-forced ones
        assert out[step]["max_abs_logprob_error"] < 1e-4
    assert out["engine_compiled"]["graphs"] >= 1 and out["engine_compiled"]["graph_breaks"] == 0
    decode = out["decode"]
    assert decode["tok_per_s"] > 0 and 0 < decode["over_bw_roofline"] < 1
    assert decode["warmup_s"] > 0 and decode["compile_s"] >= 0 and decode["decode_s"] > 0
    assert decode["graphs_in_timed_run"] == 0 and decode["recompiles_in_timed_run"] == 0  # warmed on its own shape
    assert out["memory"]["planned_gib"] > 0 and out["memory"]["peak_gib"] is None  # no CUDA: no peak to hold it to
    assert out["grpo_step"]["ours_seconds"] > 0 and out["grpo_step"]["trl_seconds"] > 0
    assert out["grpo_step"]["ours_bridge_over_trl_bridge"] > 0  # TRL + Bridge (BridgeGRPOTrainer) ran too
    assert out["fsdp_rollout"]["same_tokens"] is True
    assert (out["host_syncs"]["per_step"], out["host_syncs"]["per_call"]) == (None, None)  # no CUDA on the CPU
    refill = out["refill"]  # several waves of ragged samples, refilled and not: the same samples (float32)
    assert refill["same_samples"] is True and 1 < refill["mean_length"] < refill["max_new_tokens"]
    assert refill["refill_tok_per_s"] > 0 and refill["waves_tok_per_s"] > 0 and refill["refill_over_waves"] > 0


def test_a_timed_out_child_is_a_row_and_the_rows_before_it_stay(tmp_path):
    (tmp_path / "gpu_check.jsonl").write_text('{"row": "earlier run"}\n')  # a previous run's rows are kept
    proc = check("--dry-run", "--only", "env,engine_eager", "--timeouts", "engine_eager=0.5", "--out", str(tmp_path),
                 timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]  # a row that did not finish fails the run
    rows = rows_of(tmp_path)
    assert [r["row"] for r in rows] == ["earlier run", "run", "env", "engine_eager"]
    assert rows[2]["status"] == "ok" and rows[2]["python"].startswith("3.")
    assert rows[3]["status"] == "timeout" and rows[3]["timeout_s"] == 0.5 and rows[3]["wall_s"] < 60
    assert (tmp_path / "logs" / "engine_eager.log").exists()  # what the child wrote before it was killed


def test_a_budget_too_small_skips_rows_in_one_line_each(tmp_path):
    proc = check("--only", "env,engine_eager", "--budget", "3", "--timeouts", "env=1", "--out", str(tmp_path),
                 timeout=300)
    rows = rows_of(tmp_path)
    assert proc.returncode == 1 and [r["row"] for r in rows] == ["run", "env", "engine_eager"]
    assert rows[0]["budget_s"] == 3 and rows[2]["status"] == "skipped" and "budget" in rows[2]["reason"]
    assert rows[1]["status"] in ("timeout", "error")  # 1 s: killed while importing torch (or, no CUDA, refused)


@pytest.mark.parametrize("args", [["--only", "decode,nope"], ["--timeouts", "decode=soon"], ["--budget", "0"]])
def test_bad_arguments_are_refused_in_one_line(tmp_path, args):
    proc = check(*args, "--out", str(tmp_path), timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) <= 3  # argparse: usage + one error line
    assert "error:" in proc.stderr.strip().splitlines()[-1] and not (tmp_path / "gpu_check.jsonl").exists()


def test_the_default_run_is_budgeted_under_eight_minutes():
    sys.path.insert(0, str(SCRIPT.parent))
    import gpu_check

    default = [r for r in gpu_check.ROWS if r.default]
    assert sum(r.estimate_s for r in default) < gpu_check.BUDGET_S < 8 * 60
    assert gpu_check.parse_args([]).rows == default and len(gpu_check.parse_args(["--all"]).rows) == len(gpu_check.ROWS)
    assert [r.name for r in gpu_check.parse_args(["--only", "cuda_tests"]).rows] == ["cuda_tests"]
    assert all(r.estimate_s < r.timeout_s for r in gpu_check.ROWS)

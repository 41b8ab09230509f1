"""benchmarks/gpu_check.py --dry-run: the GPU check's every code path at toy sizes on the CPU, so that the script a
GPU session runs first cannot rot unseen."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


@pytest.mark.slow
def test_gpu_check_dry_run_reports_every_check():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--json"], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["dry_run"] is True and out["cuda_tests"]["exit"] == 0
    for step in ("engine_eager", "engine_compiled"):  # the engine's log-probs are the teacher-forced ones
        assert out[step]["max_abs_logprob_error"] < 1e-4
    assert out["engine_compiled"]["graphs"] >= 1 and out["engine_compiled"]["graph_breaks"] == 0
    assert out["decode"]["tok_per_s"] > 0 and 0 < out["decode"]["over_bw_roofline"] < 1
    assert out["memory"]["planned_gib"] > 0 and out["memory"]["peak_gib"] is None  # no CUDA: no peak to hold it to
    assert out["grpo_step"]["ours_seconds"] > 0 and out["grpo_step"]["trl_seconds"] > 0
    assert out["grpo_step"]["ours_bridge_over_trl_bridge"] > 0  # TRL + Bridge (BridgeGRPOTrainer) ran too
    assert out["fsdp_rollout"]["same_tokens"] is True
    assert out["host_syncs_per_step"] is None  # no CUDA on the CPU

"""The scripts in examples/ run as a user runs them, at toy size."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_trl_grpo_example_trains_and_saves_a_model_with_blocks(tmp_path):
    pytest.importorskip("trl", reason="TRL is not installed (pip install 'bridgelm[trl]')")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "trl_grpo.py"), "--toy", "--output-dir",
                           str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"saved the trained model (Bridge blocks included) to {tmp_path}" in proc.stdout

    from transformers import AutoModelForCausalLM

    import bridgelm

    model = AutoModelForCausalLM.from_pretrained(tmp_path)  # the saved folder loads with its blocks
    assert bridgelm.block_config(model).kind == "bridge"
    # and trains on from there, its blocks kept (they were added a second time: an error)
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "trl_grpo.py"), "--model", str(tmp_path),
                           "--max-steps", "1", "--output-dir", str(tmp_path / "again")], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_trl_grpo_example_refuses_a_missing_model_in_one_line(tmp_path):
    pytest.importorskip("trl", reason="TRL is not installed (pip install 'bridgelm[trl]')")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "trl_grpo.py"), "--model", str(tmp_path / "nope"),
                           "--output-dir", str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"trl_grpo.py: error: model folder {tmp_path / 'nope'} does not exist: expected a folder with config.json and "
        "weights")

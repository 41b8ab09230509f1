"""The vLLM comparison of benchmarks/generate.py (--vllm-python), dry: a fake vLLM (tests/fake_vllm) behind the
real child script and harness, so that the protocol, the settings handed to vLLM and the ratios are tested without
installing vLLM. No timing is checked: only that the numbers are made from the runs."""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import vllm_compare  # noqa: E402


def fake_python(tmp_path: Path, body: str = "") -> Path:
    """An executable that runs this python with the fake vLLM importable (as a venv's python would run vLLM)."""
    path = tmp_path / "python"
    fake = ROOT / "tests" / "fake_vllm"
    path.write_text(f'#!/bin/sh\n{body}\nPYTHONPATH="{fake}" exec "{sys.executable}" "$@"\n')
    path.chmod(0o755)
    return path


def settings(**over):
    base = dict(n=2, width=2, new_tokens=3, temperature=0.6, top_p=0.95, repeats=2, prompt_len=5, compile=False,
                pack=True, vllm_rows="4", vllm_kv_gib=1)  # fmt: skip
    return argparse.Namespace(**{**base, **over})


def test_the_comparison_runs_vllm_on_the_same_work(tmp_path, monkeypatch):
    """bridgelm's plain and Bridge engines and the child's vLLM, interleaved: vLLM gets the same token ids, n,
    lengths (EOS ignored), temperature, top-p and threads, pinned to the parent's cores; the ratios are the
    engines' tok/s over vLLM's, repeat by repeat; vLLM's start-up is reported apart."""
    import torch

    log = tmp_path / "vllm.jsonl"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    args = settings(vllm_python=str(fake_python(tmp_path)))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        out = vllm_compare.section(args, "float32", layers=1, smollm2=False)
    finally:
        torch.set_num_threads(threads)
    res = out["4"]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    init, runs = calls[0], calls[1:]
    assert init["kind"] == "init" and init["kwargs"]["dtype"] == "float32" and init["kwargs"]["skip_tokenizer_init"]
    assert init["env"]["OMP_NUM_THREADS"] == "1" and init["env"]["VLLM_CPU_KVCACHE_SPACE"] == "1"  # vLLM: an int
    kw = init["kwargs"]  # no prefix cache reused across repeats; vLLM's sampling defaults, not the folder's
    assert kw["enable_prefix_caching"] is False and kw["generation_config"] == "vllm"
    assert kw["logprobs_mode"] == "processed_logprobs"
    first, last = init["env"]["VLLM_CPU_OMP_THREADS_BIND"].split("-")  # one core: "c-c"
    assert init["cores"] == list(range(int(first), int(last) + 1))
    assert len(init["cores"]) == 1 and Path(init["kwargs"]["model"]).name  # a saved model folder
    assert len(runs) == 1 + args.repeats  # a warm-up, then one per repeat
    for run in runs:
        assert len(run["prompts"]) == 2 and all(len(p) == 5 for p in run["prompts"])  # 4 rows = 2 prompts x n=2
        p = run["params"]
        assert (p["n"], p["max_tokens"], p["min_tokens"], p["ignore_eos"]) == (2, 3, 3, True)
        assert (p["temperature"], p["top_p"]) == (0.6, 0.95) and "seed" not in p  # no per-request seeds
        assert p["logprobs"] == 0 and p["detokenize"] is False  # each token's log-prob, as the engine returns
    assert res["rows"] == 4 and res["vllm_version"] == "0.0+fake" and res["vllm_startup_seconds"] >= 0
    for name in ("plain_over_vllm", "bridge_over_vllm"):
        assert res[name]["min"] <= res[name]["median"] <= res[name]["max"]
    runs = res["runs"]
    want = sorted(a["tok_per_s"] / b["tok_per_s"] for a, b in zip(runs["engine_plain"], runs["vllm"]))
    assert res["plain_over_vllm"]["min"] == round(want[0], 4)
    assert all(r["tokens"] == 2 * 2 * 3 for series in runs.values() for r in series)
    assert os.sched_getaffinity(0)  # the parent's cores given back


def test_a_child_that_fails_is_one_line_with_its_log(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_LOG", str(tmp_path / "vllm.jsonl"))
    setup = {"model": "m", "dtype": "float32", "threads": 1, "cores": vllm_compare.pinned_cores(1), "seed": 0,
             "max_num_seqs": 4, "max_model_len": 16}  # fmt: skip
    with pytest.raises(SystemExit, match="no such executable"):
        vllm_compare.VllmChild(str(tmp_path / "nowhere" / "python"), setup)
    broken = fake_python(tmp_path, body='echo "ImportError: no module named vllm" >&2; exit 3')
    with pytest.raises(SystemExit, match=r"exited \(code 3\).*ImportError: no module named vllm"):
        vllm_compare.VllmChild(str(broken), setup)
    monkeypatch.setenv("FAKE_VLLM_NO_LOGPROBS", "1")  # a vLLM that returns no log-probs does less work: refused
    child = vllm_compare.VllmChild(str(fake_python(tmp_path)), setup)
    with pytest.raises(SystemExit, match="returned 0 log-probs of its 8 tokens"):
        child.run([[1, 2]], n=2, max_tokens=4, temperature=1.0, top_p=1.0)
    child.close()
    monkeypatch.delenv("FAKE_VLLM_NO_LOGPROBS")
    monkeypatch.setenv("FAKE_VLLM_SHORT", "1")  # a vLLM that stops early: unequal work is refused
    child = vllm_compare.VllmChild(str(fake_python(tmp_path)), setup)
    with pytest.raises(SystemExit, match="made 6 tokens where 8 were asked"):
        child.run([[1, 2]], n=2, max_tokens=4, temperature=1.0, top_p=1.0)
    child.close()


def test_vllm_is_held_still_while_the_engines_are_timed(tmp_path, monkeypatch):
    """Idle, vLLM's processes poll for work on the pinned cores: while an engine is timed the child and every
    process under it are stopped (state T), and they run again for vLLM's own calls; the CPU they take idle beside
    the engines' first calls is reported."""
    monkeypatch.setenv("FAKE_VLLM_LOG", str(tmp_path / "vllm.jsonl"))
    setup = {"model": "m", "dtype": "float32", "threads": 1, "cores": vllm_compare.pinned_cores(1), "seed": 0,
             "max_num_seqs": 4, "max_model_len": 16}  # fmt: skip
    child = vllm_compare.VllmChild(str(fake_python(tmp_path, body="sleep 300 &")), setup)  # a process under it
    pids = child.processes()
    try:
        assert len(pids) == 2 and pids[0] == child.proc.pid
        states = []

        def engine():
            states.append([vllm_compare.state(p) for p in pids])
            return 8

        args = argparse.Namespace(n=2, new_tokens=4, temperature=1.0, top_p=1.0, repeats=2)
        out = vllm_compare.compare_with_vllm(
            child, {"engine_plain": engine}, [[1, 2]], args, lambda fn: {"tokens": fn(), "seconds": 1.0, "tok_per_s": 8}
        )
        assert "T" not in states[0]  # the first call: vLLM left running beside it, its idle CPU measured
        assert states[1:] == [["T", "T"]] * 2  # the timed repeats
        deadline = time.monotonic() + 5  # SIGCONT takes effect a moment after it is sent
        while any(vllm_compare.state(p) == "T" for p in pids) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(vllm_compare.state(p) != "T" for p in pids)  # running again
        assert out["vllm_idle_cpu_share"] >= 0 and child.cpu_seconds() >= 0
    finally:
        child.close()
        for pid in pids[1:]:
            os.kill(pid, 9)


def test_vllm_gets_the_libraries_its_cpu_guide_preloads(tmp_path, monkeypatch):
    """Intel's OpenMP from the venv vLLM's wheel installed it in (lib/libiomp5.so beside bin/python), handed to the
    child in LD_PRELOAD; none where the venv has none."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_bytes(fake_python(tmp_path).read_bytes())
    python.chmod(0o755)
    assert not any("libiomp5" in f for f in vllm_compare.preload_libraries(str(python)))
    (venv / "lib").mkdir()
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    assert str(venv / "lib" / "libiomp5.so") in vllm_compare.preload_libraries(str(python))
    log = tmp_path / "vllm.jsonl"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    monkeypatch.setenv("LD_PRELOAD", "")
    setup = {"model": "m", "dtype": "float32", "threads": 1, "cores": vllm_compare.pinned_cores(1), "seed": 0,
             "max_num_seqs": 4, "max_model_len": 16}  # fmt: skip
    child = vllm_compare.VllmChild(str(python), setup)  # ld.so skips the empty file with a warning
    child.close()
    assert str(venv / "lib" / "libiomp5.so") in json.loads(log.read_text().splitlines()[0])["env"]["LD_PRELOAD"]
    assert child.preload == vllm_compare.preload_libraries(str(python))


def test_vllm_only_needs_vllm_python():
    import subprocess

    cmd = [sys.executable, str(ROOT / "benchmarks" / "generate.py"), "--vllm-only"]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert res.returncode == 2 and "--vllm-only: expected --vllm-python PATH" in res.stderr
    assert "Traceback" not in res.stderr

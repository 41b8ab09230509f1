"""SIGTERM stops a command as Ctrl-C does (bridgelm.stop): a trainer in one process saves its last finished step and
exits 143, an update is finished first, and the handlers before are restored."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import tiny_model
from test_sft import TOK, write_warmup

from bridgelm.samples import kept_on_interrupt
from bridgelm.stop import DeferInterrupt, Interrupted, exit_code, stop_on_sigterm
from bridgelm.train.checkpoints import TRAINER_INFO, checkpoint_name

ROOT = Path(__file__).resolve().parents[1]


def signal_me(signum: int) -> None:
    os.kill(os.getpid(), signum)
    time.sleep(0.05)  # the handler runs at the next bytecode of the main thread


def test_sigterm_raises_interrupted_inside_the_block_and_the_old_handler_comes_back():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as stop:
        with stop_on_sigterm():
            signal_me(signal.SIGTERM)
    assert isinstance(stop.value, KeyboardInterrupt) and exit_code(stop.value) == 143
    assert signal.getsignal(signal.SIGTERM) is before
    assert exit_code(KeyboardInterrupt()) == 130  # a plain Ctrl-C


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_in_an_update_waits_for_its_end(signum, capsys):
    finished = False
    with pytest.raises(Interrupted) as stop:
        with stop_on_sigterm(), DeferInterrupt():
            signal_me(signum)
            finished = True  # the rest of the update still runs
    assert finished and stop.value.signum == signum
    assert f"{signal.Signals(signum).name}: finishing this step" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_signal_in_an_update_stops_it_at_once():
    reached = False
    with pytest.raises(Interrupted) as stop:
        with stop_on_sigterm(), DeferInterrupt():
            signal_me(signal.SIGINT)
            signal_me(signal.SIGTERM)
            reached = True
    assert not reached and stop.value.signum == signal.SIGTERM


def test_eval_and_generate_say_what_they_kept_on_sigterm(capsys, tmp_path):
    with pytest.raises(Interrupted) as stop:
        with kept_on_interrupt("bridgelm eval", "problems", tmp_path):
            signal_me(signal.SIGTERM)
    said = capsys.readouterr().err
    assert stop.value.said and f"bridgelm eval: interrupted; the problems sampled so far are kept in {tmp_path}" in said
    with pytest.raises(Interrupted):
        with kept_on_interrupt("bridgelm generate", "prompts", tmp_path / "none.jsonl"):
            signal_me(signal.SIGTERM)
    assert f"interrupted; nothing was written yet ({tmp_path / 'none.jsonl'} does not exist)" in capsys.readouterr().err


def test_sft_stopped_by_sigterm_saves_its_last_step_and_says_how_to_go_on(tmp_path):
    """What `timeout`, Slurm and `docker stop` do to a one-process run: before, it died unsaved."""
    folder = tmp_path / "model"
    model = tiny_model(vocab_size=len(TOK), eos_token_id=TOK.eos_token_id, pad_token_id=TOK.pad_token_id)
    model.save_pretrained(folder)
    TOK.save_pretrained(folder)
    write_warmup(tmp_path / "warmup.jsonl")
    out = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "bridgelm", "sft", "--model", str(folder), "--add", "bridge", "--data",
           str(tmp_path / "warmup.jsonl"), "--epochs", "1000", "--batch-groups", "2", "--val-count", "0",
           "--no-progress", "--out", str(out)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    said, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-3000:]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert f"interrupted; checkpoint of step {steps[-1]}" in said and "the same command with --resume" in said
    assert (out / "checkpoints" / checkpoint_name(steps[-1]) / TRAINER_INFO).is_file()
    assert "Traceback" not in err


def test_ranks_end_when_their_launcher_is_killed(tmp_path):
    """kill -9 of torchrun: its ranks end (SIGTERM on the launcher's death) instead of running on, then waiting at
    the slowest rank's barrier for the whole timeout with the output's lock held."""
    script = ROOT / "tests" / "dist_scripts" / "barrier_interrupt.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    proc = subprocess.Popen(cmd + [str(tmp_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "rank1-waiting").exists() or not (tmp_path / "rank0.pid").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    ranks = [int((tmp_path / f"rank{r}.pid").read_text()) for r in (0, 1)]
    proc.kill()
    proc.communicate()
    deadline = time.monotonic() + 60
    while any(_running(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = [pid for pid in ranks if _running(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, "ranks outlived their launcher"


def test_a_collective_that_fails_because_another_rank_ended_is_one_line(tmp_path):
    """kill -9 of one rank: the others' next collective fails (gloo: connection reset by peer); that is said in one
    line, not announced as a bug in bridgelm with a traceback."""
    import socket

    script = ROOT / "tests" / "dist_scripts" / "peer_lost.py"
    with socket.socket() as s:  # a free port for the two processes to meet at
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    # launched by hand: torchrun would stop rank 0 itself as soon as rank 1 ended
    ranks = [subprocess.Popen([sys.executable, str(script), str(tmp_path)], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    for proc in ranks:
        proc.communicate(timeout=300)
    kind, message = (tmp_path / "rank0-error").read_text().split("\n", 1)
    assert message.startswith("another process of this launch stopped"), (kind, message)
    assert "\n" not in message


def _running(pid: int) -> bool:
    """Whether process `pid` runs (a zombie has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_rank_waiting_for_the_slowest_leaves_at_ctrl_c(tmp_path):
    """eval and warmup-data ranks whose share is done wait for the slowest: Ctrl-C there reaches Python at once (the
    wait runs in a thread), where a blocking wait held it until torchrun killed the rank (SIGKILL after 30 s)."""
    script = ROOT / "tests" / "dist_scripts" / "barrier_interrupt.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    proc = subprocess.Popen(cmd + [str(tmp_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "rank1-waiting").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    time.sleep(2)  # in the wait
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert (tmp_path / "rank1-interrupted").exists(), err[-3000:]
    assert "forcefully exiting via 9" not in err

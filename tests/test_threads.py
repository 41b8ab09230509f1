"""--threads on the long commands (generate, eval, warmup-data, sft, rl): parsed, checked, applied before the
model loads; its default leaves a loaded machine's busy cores alone (bridgelm.hardware.default_threads)."""

import pytest
import torch

from bridgelm import hardware
from bridgelm.cli import build_parser, main
from bridgelm import source

COMMANDS = {
    "generate": ["generate", "--model", "m", "--prompt", "x", "--out", "o.jsonl"],
    "eval": ["eval", "--model", "m", "--out", "o"],
    "warmup-data": ["warmup-data", "--model", "m", "--task", "gsm8k", "--out", "o.jsonl"],
    "sft": ["sft", "--model", "m", "--data", "d.jsonl", "--out", "o"],
    "rl": ["rl", "--model", "m", "--task", "gsm8k", "--out", "o"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_long_commands_take_threads(command):
    parser = build_parser()
    argv = COMMANDS[command]
    try:
        assert parser.parse_args(argv + ["--threads", "3"]).threads == 3
        assert parser.parse_args(argv).threads == 0
    except SystemExit:  # a command that needs more flags than these: its flag still exists
        pytest.fail(f"{command} does not parse --threads")


@pytest.mark.parametrize("value", ["-1", "two", "5000"])
def test_a_bad_thread_count_is_one_line(capsys, value):
    with pytest.raises(SystemExit) as err:
        main(COMMANDS["generate"] + ["--threads", value])
    assert err.value.code == 2
    msg = capsys.readouterr().err
    assert f"argument --threads: {value!r} is not a thread count in [0, 4096]" in msg and "Traceback" not in msg


def test_threads_are_set_as_asked_or_by_the_default(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(hardware, "default_threads", lambda: (1, "a loaded machine"))
        torch.set_num_threads(2)
        source.set_threads(0)
        assert torch.get_num_threads() == 1
        source.set_threads(2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)

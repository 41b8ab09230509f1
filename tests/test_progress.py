"""Progress bars (bridgelm.progress): tqdm on a terminal, a few plain lines in a log."""

import io
import os
import subprocess
import sys

from bridgelm.progress import NoBar, bar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_a_bar_is_a_few_plain_lines(capsys):
    progress = bar(1000, "sampling -> out.jsonl", "sample")
    for _ in range(1000):
        progress.update(1)
    progress.close()
    err = capsys.readouterr().err
    assert "\r" not in err and "\x1b" not in err
    lines = err.splitlines()
    assert 1 <= len(lines) <= 3, lines  # the first state and the last: at most one line per LOG_SECONDS between
    assert lines[-1].startswith("sampling -> out.jsonl: 100%") and "1000/1000" in lines[-1]


def test_on_a_terminal_it_is_tqdms_bar_redrawn_in_place(monkeypatch):
    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    progress = bar(3, "grading", "sample", initial=1)
    progress.update(2)
    progress.close()
    assert "\r" in screen.getvalue() and "3/3" in screen.getvalue()


def test_a_disabled_bar_writes_nothing(capsys):
    progress = bar(5, "x", "step", enabled=False)
    assert isinstance(progress, NoBar)
    progress.update(5)
    progress.set_postfix(loss="1")
    progress.close()
    assert capsys.readouterr().err == ""


def test_tqdm_disable_silences_every_bar():
    """The README's TQDM_DISABLE=1 (tqdm reads it when it is imported: a process of its own)."""
    code = "from bridgelm.progress import bar\nb = bar(3, 'counting', 'it')\nb.update(3)\nb.close()"
    quiet = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=quiet)
    silent = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "TQDM_DISABLE": "1"})
    assert "counting: 100%" in shown.stderr and silent.returncode == 0 and silent.stderr == ""

"""Progress bars: tqdm on a terminal (or a notebook's widget), and off a terminal a plain line at most every
`LOG_SECONDS`, so that a log file of a long run (nohup, Slurm, the demo's stage logs) holds a few readable lines
instead of a bar redrawn up to ten times a second with carriage returns. `TQDM_DISABLE=1` silences every bar.

`bar(...)` is what every bridgelm command shows its progress with; disabled, it returns a stand-in that does nothing.
"""

from __future__ import annotations

import sys
from typing import Any

LOG_SECONDS = 30.0  # off a terminal: at most one line per this many seconds (and the last state on closing)


class _Lines:
    """A file for tqdm off a terminal: each refresh a line of its own (no carriage returns or cursor moves)."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "").replace("\x1b[A", "").strip()
        if text:
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


class NoBar:
    """What a disabled bar is: every call does nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, *args: Any, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


def bar(total: int, desc: str, unit: str, enabled: bool = True, **kwargs: Any):
    """A progress bar of `total` `unit`s on stderr (`kwargs` go to tqdm: initial, position, ...), or a NoBar."""
    if not enabled:
        return NoBar()
    from tqdm import auto
    from tqdm.std import tqdm as plain

    if auto.notebook_tqdm is not plain or sys.stderr.isatty():  # a notebook's widget, or a terminal
        return auto.tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, **kwargs)
    return plain(total=total, desc=desc, unit=unit, file=_Lines(sys.stderr), mininterval=LOG_SECONDS, **kwargs)

"""How a command stops when asked: Ctrl-C (SIGINT) and SIGTERM, what `timeout`, `kill`, Slurm before its time
limit and `docker stop` send, end it alike, as a KeyboardInterrupt that the trainers, eval, generate and
warmup-data catch to save what is finished and say how to go on. (Python's default for SIGTERM kills the process
where it stands: a trainer would lose every step since its last checkpoint.)

- `Interrupted`: the KeyboardInterrupt a SIGTERM raises (or a held-back signal, at the end of its block); the
  command line exits with 128 + `signum` (143 for SIGTERM, 130 for Ctrl-C, as a shell reports them).
- `stop_on_sigterm()`: a block in which SIGTERM raises `Interrupted`.
- `DeferInterrupt`: a block (a trainer's update) in which both signals are held back and raised at its end.

Handlers are installed from the main thread only (elsewhere the blocks change nothing) and the ones before are
restored after. Under torchrun the trainers read both signals as a flag that every rank agrees on (train.agree).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """A KeyboardInterrupt raised for a signal; `signum` decides the exit code."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _raise(signum, frame) -> None:
    raise Interrupted(signum)


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """Inside the block SIGTERM raises `Interrupted`, as Ctrl-C raises KeyboardInterrupt."""
    if not _main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


class DeferInterrupt:
    """Hold back Ctrl-C and SIGTERM inside the block (a step's updates) and raise `Interrupted` at its end.

    A second signal raises at once.
    """

    def __enter__(self) -> DeferInterrupt:
        self.hit: int | None = None
        self.old = {s: signal.signal(s, self._handler) for s in SIGNALS} if _main_thread() else {}
        return self

    def _handler(self, signum, frame) -> None:
        if self.hit is not None:
            raise Interrupted(signum)
        self.hit = signum
        print(f"\n{signal.Signals(signum).name}: finishing this step, then saving a checkpoint (again: stop now)",
              file=sys.stderr)

    def __exit__(self, exc_type, exc, tb) -> bool:
        for s, old in self.old.items():
            signal.signal(s, old)
        if self.hit is not None and exc_type is None:
            raise Interrupted(self.hit)
        return False


def exit_code(err: KeyboardInterrupt) -> int:
    """128 + the signal's number: 130 for Ctrl-C (a plain KeyboardInterrupt), 143 for SIGTERM."""
    return 128 + getattr(err, "signum", signal.SIGINT)

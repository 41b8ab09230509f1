"""Expected failures (bad input) versus bugs, and how the command line tells them apart.

Design: bad input is reported as one line, `bridgelm <command>: error: <message>`, with exit code 2 and no
traceback; the message names the bad value and what was expected. Anything else is a bug in bridgelm and keeps
its traceback. What is which is decided by the exception's type, where the input enters, not by where it was
raised:

- `UserError` (a ValueError) is bad input: config validation, the file and data readers, model and block loading
  and the CLI's parse raise it, once, where the input enters (`check_int` / `check_number` for numbers,
  `check_choice` for a name among a few;
  `MissingFile` for a file or folder that is not there). Inside the library, a broken invariant (something only
  a bridgelm bug can cause) is an `assert` or a RuntimeError, and keeps its traceback.
- An OSError about a file (permission denied, is a folder, disk full) is the machine's answer to a path the
  user gave, reported with the path; a full disk (or quota, or read-only file system) even without a path.
  bridgelm.jsonl's writers say which file, and what of it was kept.
- A collective that fails because another rank's process ended (`peer_lost`) is said in one line too: that rank's
  own output says why.
- Any other exception (a plain ValueError included) is a bug.

`DataWarning` is for input that is accepted but probably not meant (a data file that repeats a problem); the
command line prints it as `bridgelm <command>: warning: <message>`.
"""
from __future__ import annotations

import errno
import math
import numbers

class UserError(ValueError):
    """Bad input: the message names the value and what was expected; the CLI prints it and exits with 2."""


class MissingFile(UserError, FileNotFoundError):
    """A file or folder the user named is not there (a UserError, and a FileNotFoundError for `except`)."""


class DataWarning(UserWarning):
    """Input accepted, but probably not what was meant."""


def check_int(name: str, value, low: int = 1, note: str = "") -> None:
    """UserError naming `name` unless `value` is an integer (not a bool) of at least `low`."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
        what = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise UserError(f"{name}={value!r}: expected {what}{note}")


def check_choice(name: str, value, options, note: str = "") -> None:
    """UserError naming `name` unless `value` is one of `options` (listed in the message)."""
    if value not in options:
        raise UserError(f"{name}={value!r}: expected one of {', '.join(map(str, options))}{note}")


def check_number(
    name: str, value, low: float | None = None, high: float | None = None, *, open_low=False, open_high=False, note=""
) -> None:
    """UserError naming `name` unless `value` is a finite real number within [low, high] (None: no bound;
    `open_low`/`open_high`: the bound itself excluded). NaN and infinities are refused: `nan <= 0` is False, so a
    plain comparison would let NaN through into a run that then trains to NaN. `note` ends the message."""
    try:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value))
    except OverflowError:  # an int beyond any float
        ok = False
    if ok and low is not None:
        ok = value > low if open_low else value >= low
    if ok and high is not None:
        ok = value < high if open_high else value <= high
    if ok:
        return
    if low is not None and high is not None:
        bounds = f" in {'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"
    elif low is not None:
        bounds = f" {'>' if open_low else '>='} {low}"
    elif high is not None:
        bounds = f" {'<' if open_high else '<='} {high}"
    else:
        bounds = ""
    raise UserError(f"{name}={value!r}: expected a finite number{bounds}{note}")


def show_data_warnings(prog: str):
    """From now on, `warnings` prints a DataWarning as the one line `<prog>: warning: <message>` on stderr (other
    warnings as before). Returns the previous `warnings.showwarning`, to put back."""
    import sys
    import warnings

    show = warnings.showwarning

    def show_data_warning(message, category, *rest, **kw):
        if issubclass(category, DataWarning):
            print(f"{prog}: warning: {message}", file=sys.stderr)
        else:
            show(message, category, *rest, **kw)

    warnings.showwarning = show_data_warning
    return show


def user_message(err: BaseException) -> str | None:
    """The one-line message of an expected failure, or None when `err` is a bug (it keeps its traceback)."""
    if isinstance(err, UserError):
        return str(err)
    if isinstance(err, OSError) and err.filename is not None:
        return f"cannot use {err.filename}: {err.strerror or err}"
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        return f"cannot write an output: {err.strerror or err}; what was written before is kept"
    if peer_lost(err):
        first = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
        return (f"another process of this launch stopped (its own output says why), so this one cannot go on "
                f"({first}); what was saved is kept: the same command (sft and rl: with --resume) continues from it")
    return None


# What torch.distributed says when another rank's process ended (gloo's words, NCCL's): by its words only, since
# the same error types also carry a collective's timeout or a desync, which keep their traceback
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "remote process exited")


def peer_lost(err: BaseException) -> bool:
    """Whether `err` is a collective's failure because another rank's process ended (kill -9, its own error)."""
    return isinstance(err, RuntimeError) and any(words in str(err) for words in _PEER_LOST)

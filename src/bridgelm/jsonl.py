"""Crash-safe files: append-only JSONL that resumes, atomic whole-file writes, and outputs checked before any work
(`check_out`: writable, of the right kind; `exclusive`: one writer).

A line is appended with one write of its complete bytes followed by fsync; should a crash still cut a line,
`read_records` drops (and truncates away) the unterminated tail, so a re-run redoes exactly that record. Any
other line that is not a record is refused, and the file left untouched.
Whole files (metrics, reports, checkpoints' manifests) are written to a temporary name and renamed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import json
import math
import os
import re
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bridgelm.errors import MissingFile, UserError


LOCK_FILE = ".lock"  # inside an output folder; beside an output file it is `.NAME.lock`


@contextlib.contextmanager
def exclusive(path: str | os.PathLike, flag: str = "--out", folder: bool | None = None) -> Iterator[Path]:
    """Hold an exclusive lock on the output `path` (a folder or a file, as `folder` says; None: a folder unless the
    path is a file or has a suffix) while the body writes it: a second process that asks for the same output is
    refused at once, naming the first one's pid, instead of both writing every record twice. The lock is the
    kernel's (flock): it goes with its process, even a killed one, so there is never a stale lock to remove."""
    path = Path(path).expanduser()
    lock = _lock_file(path, folder)
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _take(fd, path, flag)
    except BaseException:
        os.close(fd)
        raise
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield path
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def check_free(path: str | os.PathLike, flag: str = "--out", folder: bool | None = None) -> None:
    """Refuse at once, as `exclusive` would, an output that another process is writing, creating nothing: a command
    asks before it loads a model, and takes the lock (`exclusive`) when it writes."""
    try:
        fd = os.open(_lock_file(Path(path).expanduser(), folder), os.O_RDWR)
    except (FileNotFoundError, NotADirectoryError):
        return  # never locked
    try:
        _take(fd, Path(path).expanduser(), flag)
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def check_out(path: str | os.PathLike, kind: str, flag: str = "--out") -> None:
    """UserError, before any work, for an output path that cannot be written: a folder where a file is expected
    ("file") or a file where a folder is expected ("dir"), or a place without write permission. Creates nothing."""
    p = Path(path).expanduser()
    if kind == "file" and p.is_dir():
        raise UserError(f"{flag} {path} is a folder: expected a file name")
    if kind == "dir" and p.exists() and not p.is_dir():
        raise UserError(f"{flag} {path} is a file: expected a folder (created when missing)")
    if p.exists():
        if not os.access(p, os.W_OK | (os.X_OK if p.is_dir() else 0)):
            raise UserError(
                f"{flag} {path} is not writable: expected a {'folder' if kind == 'dir' else 'file'} you may write"
            )
        return
    parent = next(q for q in p.absolute().parents if q.exists())
    if not parent.is_dir():
        raise UserError(f"{flag} {path}: {parent} is a file, so nothing can be created under it")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path}: folder {parent} is not writable, so {path} cannot be created there")


def _lock_file(path: Path, folder: bool | None) -> Path:
    if folder is None:
        folder = path.is_dir() or not (path.suffix or path.exists())
    return path / LOCK_FILE if folder else path.with_name(f".{path.name}.lock")


def _take(fd: int, path: Path, flag: str) -> None:
    """flock `fd` (a lock file's) without waiting, or a UserError naming the process that holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        raise UserError(
            f"{flag} {path} is being written by another process (pid {holder}): wait for it to end, or use another "
            f"{flag}"
        ) from None


def check_regular_file(path: str | os.PathLike, what: str = "file", expected: str = "a regular file") -> Path:
    """`path` (with `~` expanded) if it is a regular file; a folder, FIFO, device or socket is a UserError before
    anything reads it (a FIFO would block forever, /dev/zero never ends), and a missing path a MissingFile; both
    name the file as `what` and say what was `expected`. The one check of the file readers."""
    path = Path(path).expanduser()
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise MissingFile(f"{what} {path} does not exist: expected {expected}") from None
    if not stat.S_ISREG(mode):
        kind = ("folder" if stat.S_ISDIR(mode) else "FIFO (named pipe)" if stat.S_ISFIFO(mode)
                else "special file (a device or a socket)")  # fmt: skip
        raise UserError(f"{what} {path} is a {kind}: expected {expected}")
    return path


# What the machine answers when an output cannot be written (a full disk, a quota, a read-only or locked-down
# place): bad luck of the user's machine, told in one line that says what was kept, not a traceback.
CANNOT_WRITE = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}


def rank_file(path: Path, rank: int, world: int) -> Path:
    """The file a process appends its lines to in place of `path`: `path` itself in one process, under torchrun its
    rank's part beside it (samples.jsonl: samples.rank1.jsonl)."""
    return path if world == 1 else path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def rank_files(path: Path) -> list[Path]:
    """The ranks' parts of `path` there are (`rank_file`), in rank order; not `path` itself."""
    pattern = re.compile(rf"{re.escape(path.stem)}\.rank(\d+){re.escape(path.suffix)}")
    found = {int(m.group(1)): p for p in path.parent.glob(f"{glob.escape(path.stem)}.rank*")
             if (m := pattern.fullmatch(p.name))}
    return [found[r] for r in sorted(found)]


def append_record(path: str | os.PathLike, record: dict[str, Any]) -> None:
    """Append one JSON line to `path` (created with its folder when missing). A disk that is full (CANNOT_WRITE) is a
    UserError saying that the lines written before are kept: a line cut short is dropped when the file is read back,
    so a re-run resumes after them."""
    path = Path(path)
    data = (json.dumps(record, ensure_ascii=False) + "\n").encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        if err.errno not in CANNOT_WRITE:
            raise
        raise UserError(
            f"cannot write {path}: {err.strerror or err}; the lines written so far are kept, and the same command "
            "run again resumes after them"
        ) from err


def read_records(path: str | os.PathLike, repair: bool = True, allow_cut: bool = True) -> list[dict[str, Any]]:
    """All records (JSON objects, one a line) of `path`; [] when it does not exist.

    Only an unterminated last line that begins like a record (`{`) is a line cut by a crash: it is dropped, and
    cut off the file when `repair`, so that the caller redoes that record (`allow_cut=False`, for files written
    by hand: an error too, and the file is read as strictly as a data file, `STRICT`). Any other line that is not
    a JSON object (malformed, not UTF-8, a list, plain text) is a UserError naming the file and line, and the file
    is left as it is: it is not one of ours.
    """
    path = Path(path).expanduser()
    if not path.exists():
        return []
    raw = check_regular_file(path, "file", "a JSON-lines file (one JSON object per line)").read_bytes()
    rows, cut = json_lines(raw, path, allow_cut=allow_cut, strict=not allow_cut)
    if repair and cut is not None:
        with open(path, "r+b") as f:
            f.truncate(cut)
    elif repair and raw.strip() and not raw.endswith(b"\n"):  # a complete last record without its newline
        with open(path, "ab") as f:
            f.write(b"\n")
    return [row for _, row in rows]


def json_lines(
    raw: bytes, path: str | os.PathLike, allow_cut: bool = False, strict: bool = True
) -> tuple[list[tuple[int, dict[str, Any]]], int | None]:
    """The JSON objects of `raw` (the bytes of `path`), one a line, each with its line number (blank lines skipped),
    read by `parse_json`; and where the unterminated last line starts when `allow_cut` and it is a record cut by a
    crash (None: none is). The one reader of JSON lines: any other line that is not a JSON object is a UserError
    naming the file and the line."""
    lines = raw.split(b"\n")
    rows = []
    offset = 0  # where the current line starts
    for number, line in enumerate(lines, start=1):
        if line.strip():
            if allow_cut and number == len(lines) and line.lstrip().startswith(b"{") and not _parses(line):
                return rows, offset
            where = f"{path}, line {number}"
            row = parse_json(line, where, "one JSON object per line", strict)
            if not isinstance(row, dict):
                raise UserError(f"{where}: a JSON {json_kind(row)}: expected one JSON object per line")
            rows.append((number, row))
        offset += len(line) + 1
    return rows, None


def _parses(line: bytes) -> bool:
    """Whether `line` is JSON at all (a last line that is not may have been cut by a crash)."""
    try:
        json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    except (RecursionError, ValueError):  # JSON, refused by parse_json with its reason
        pass
    return True


def _finite_float(text: str) -> float:
    """A JSON number as a float, unless the float would not be that number: 1e400 (inf) and 1e-400 (0.0) are
    ValueErrors that say to write such a number as a string."""
    value = float(text)
    if math.isinf(value) or (value == 0 and any(c in "123456789" for c in text.split("e")[0].split("E")[0])):
        raise ValueError(f"the number {text} is beyond a float's range: write it as a string (\"{text}\")")
    return value


def _whole_number(text: str) -> int:
    """A JSON integer, unless it has more digits than Python turns into an int (sys.get_int_max_str_digits)."""
    limit = sys.get_int_max_str_digits()
    if limit and len(text.lstrip("-")) > limit:
        raise ValueError(f"a number of {len(text.lstrip('-'))} digits: expected at most {limit} digits (write a longer "
                         "one as a string)")
    return int(text)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    """A JSON object whose keys are each given once (json keeps the last of a repeated key, silently)."""
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise ValueError(f"field {key!r} is given twice in one object: expected each field once")
        seen.add(key)
    return dict(pairs)


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number: expected a finite number or a string")


# How files users write are read: numbers a float holds, each key once, no NaN or Infinity.
STRICT = dict(parse_float=_finite_float, parse_int=_whole_number, parse_constant=_no_constant,
              object_pairs_hook=_unique_keys)


def parse_json(data: bytes, where: str, expected: str, strict: bool = True) -> Any:
    """The JSON value of `data` (UTF-8), read `STRICT`ly unless not `strict` (files bridgelm wrote, whose numbers
    may be NaN); anything else (not UTF-8, malformed, nested past the parser's depth, a number no float holds, a
    repeated key, a lone surrogate) is a UserError "`where`: what is wrong (and where in it): expected `expected`".
    The one JSON parser of the files bridgelm reads."""
    try:
        text = data.decode("utf-8")
        value = json.loads(text, **(STRICT if strict else {}))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{where}: {_not_json(err)}: expected {expected}") from None
    except RecursionError:
        raise UserError(f"{where}: nests deeper than JSON is read here: expected {expected}") from None
    except ValueError as err:  # STRICT's refusals, and an int of more digits than Python reads
        raise UserError(f"{where}: {err}") from None
    if "\\ud" in text.lower():  # an escaped surrogate: text only in a pair (JSON escapes are its one source)
        check_text(value, where)
    return value


def check_text(record: Any, where: str) -> None:
    """UserError naming `where` when a string of `record` holds a lone surrogate (a JSON escape from \\ud800 to \\udfff without its
    pair): JSON parses it, but it is no text, and a tokenizer or a UTF-8 write fails on it later."""
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as err:
        bad = err.object[err.start : err.end].encode("unicode_escape").decode()
        raise UserError(
            f"{where}: a string holds {bad}, half of a surrogate pair: expected text (UTF-8)"
        ) from None


def json_kind(value: Any) -> str:
    """What JSON calls the type of a parsed value: object, array, string, number, true/false, null."""
    kinds = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return kinds.get(type(value), "number")


def read_json_object(path: str | os.PathLike, expected: str, strict: bool = False) -> dict[str, Any]:
    """A JSON file that must hold an object (a run's state file: trainer.json, demo.json; a model's config.json),
    read whole by `parse_json` (`strict`: as a file users write); anything else (not UTF-8, malformed, nested past
    the parser's depth, an array or null) is a UserError naming the file and `expected` ("a demo folder's
    settings")."""
    path = Path(path)
    value = parse_json(path.read_bytes(), str(path), f"{expected} (a JSON object)", strict)
    if not isinstance(value, dict):
        raise UserError(f"{path} holds a JSON {json_kind(value)}: expected {expected} (a JSON object)")
    return value


def _not_json(err: UnicodeDecodeError | json.JSONDecodeError) -> str:
    """What is wrong, and where: at a line and column in a text of several lines, else at a column."""
    if isinstance(err, UnicodeDecodeError):
        data, at = err.object, err.start
        what, line, column = f"not UTF-8 text (byte 0x{data[at]:02x}", data.count(b"\n", 0, at) + 1, at + 1
        column -= data.rfind(b"\n", 0, at) + 1
        lines = data.rstrip().count(b"\n") + 1
    else:
        what, line, column = f"malformed JSON ({err.msg}", err.lineno, err.colno
        lines = err.doc.rstrip().count("\n") + 1
    return f"{what} at {f'line {line} column {column}' if lines > 1 else f'column {column}'})"


def as_umask(path: str | os.PathLike) -> None:
    """Give the file `path`, or every file and folder under the folder `path`, the mode a new file gets (0o666 or
    0o777 less the umask): safetensors' save_file makes its files 0o600, unreadable to the rest of a team."""
    mask = os.umask(0)
    os.umask(mask)
    path = Path(path)
    if path.is_dir():
        for sub in path.rglob("*"):
            os.chmod(sub, (0o777 if sub.is_dir() else 0o666) & ~mask)
    else:
        os.chmod(path, 0o666 & ~mask)


def write_atomic(path: str | os.PathLike, text: str | bytes) -> Path:
    """Write `text` to `path` through a temporary file and a rename: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    data = text.encode() if isinstance(text, str) else text
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        if path.is_dir():  # os.replace names the temporary file
            raise UserError(f"cannot write {path}: a folder is in its place; expected a file (or nothing)") from err
        if err.errno not in CANNOT_WRITE:
            raise
        kept = "is left as it was" if path.exists() else "was not written"
        raise UserError(f"cannot write {path}: {err.strerror or err}; {path.name} {kept}") from err
    return path


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    return write_atomic(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")

"""Crash-safe files: append-only JSONL that resumes, and atomic whole-file writes.

A line is appended with one write of its complete bytes followed by fsync; should a crash still cut a line,
`read_records` drops (and truncates away) the incomplete tail, so a re-run redoes exactly that record.
Whole files (metrics, reports, checkpoints' manifests) are written to a temporary name and renamed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def append_record(path: str | os.PathLike, record: dict[str, Any]) -> None:
    """Append one JSON line to `path` (created with its folder when missing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = (json.dumps(record, ensure_ascii=False) + "\n").encode()
    with open(path, "ab") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def read_records(path: str | os.PathLike, repair: bool = True) -> list[dict[str, Any]]:
    """All complete JSON lines of `path` ([] when missing). An incomplete last line is cut off when `repair`.

    A malformed line other than the last is an error naming the file and line.
    """
    path = Path(path)
    if not path.exists():
        return []
    raw = path.read_bytes()
    records = []
    good_end = 0
    lines = raw.split(b"\n")
    for number, line in enumerate(lines, start=1):
        is_last = number == len(lines)
        if not line.strip():
            good_end += len(line) + (0 if is_last else 1)
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if is_last or (number == len(lines) - 1 and lines[-1] == b""):
                break  # a line cut by a crash: dropped, redone by the caller
            raise ValueError(f"{path}, line {number}: malformed JSON ({err.msg})") from err
        if is_last:  # complete JSON but no newline: keep it, and end the file properly
            good_end = len(raw)
            if repair:
                with open(path, "ab") as f:
                    f.write(b"\n")
            return records
        good_end += len(line) + 1
    if repair and good_end < len(raw):
        with open(path, "r+b") as f:
            f.truncate(good_end)
    return records


def write_atomic(path: str | os.PathLike, text: str | bytes) -> Path:
    """Write `text` to `path` through a temporary file and a rename: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    data = text.encode() if isinstance(text, str) else text
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    return write_atomic(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")

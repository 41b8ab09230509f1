"""The math grading worker: a child process that grades with math-verify, one JSON request a line on stdin, one
reply a line on stdout, under resource limits (`bridgelm.tasks.math` starts it, bounds every call from outside and
kills it on a timeout; its notes say why)."""

from __future__ import annotations

import json
import os
import sys
import time

from bridgelm.tasks.answers import last_boxed

# Default bound on one grading call, in seconds.
DEFAULT_TIMEOUT = 5.0

# Address space the grading worker may add to what it holds at start-up, in bytes (grading needs < 100 MB).
MEMORY_LIMIT = 2 * 1024**3

# CPU seconds a request may use beyond its timeout before the kernel ends the worker (SIGXCPU).
CPU_MARGIN = 5.0


def _parsed_gold(gold: str):
    """math-verify parse of a gold answer, wrapped so that it is read as LaTeX."""
    from math_verify import parse

    text = gold.strip()
    if "\\boxed" in text or text.startswith("$"):
        return parse(text, parsing_timeout=None)
    parsed = parse(f"\\boxed{{{text}}}", parsing_timeout=None)
    return parsed or parse(f"${text}$", parsing_timeout=None)


def _grade_one(gold: str, completion: str) -> float:
    """1.0 if math-verify finds `completion` equivalent to `gold` (runs inside the worker)."""
    from math_verify import parse, verify

    gold_parsed = _parsed_gold(gold)
    if not gold_parsed:
        return 0.0
    pred = parse(completion, parsing_timeout=None)
    if pred and verify(gold_parsed, pred, timeout_seconds=None):
        return 1.0
    boxed = last_boxed(completion)
    if boxed:
        pred = parse(f"\\boxed{{{boxed}}}", parsing_timeout=None)
        if pred and verify(gold_parsed, pred, timeout_seconds=None):
            return 1.0
    return 0.0


def _answer_of(completion: str) -> str | None:
    """The final answer math-verify reads in `completion` (the text it matched: "5" of "So the answer is 5."), or
    None when it finds none."""
    from math_verify import parse

    found = parse(completion, parsing_timeout=None)
    return str(found[-1]) if found else None


def _handle(request: dict) -> dict:
    """One request -> one reply; grading errors count as a wrong answer."""
    op = request.get("op")
    if op == "ping":
        return {"ok": True}
    if op == "grade":
        try:
            return {"score": _grade_one(request["gold"], request["completion"])}
        except Exception as exc:  # a crash in sympy is a wrong answer, not a dead worker
            return {"score": 0.0, "error": f"{type(exc).__name__}: {exc}"[:500]}
    if op == "extract":
        try:
            return {"answer": _answer_of(request["completion"])}
        except Exception as exc:  # no answer read, as a grading error is a wrong one
            return {"answer": None, "error": f"{type(exc).__name__}: {exc}"[:500]}
    if op == "sleep":  # test hook: a grading call that takes `seconds`
        time.sleep(float(request["seconds"]))
        return {"score": 0.0}
    if op == "burn":  # test hook: a grading call that computes for `seconds` of CPU time
        end = time.process_time() + float(request["seconds"])
        while time.process_time() < end:
            pass
        return {"score": 0.0}
    if op == "limits":  # test hook: the worker's resource limits
        import resource

        return {name: resource.getrlimit(getattr(resource, name))[0] for name in ("RLIMIT_AS", "RLIMIT_CPU")}
    return {"error": f"unknown op {op!r}: expected ping, grade, extract, sleep, burn or limits"}


def _address_space() -> int | None:
    """Bytes of address space this process maps now (Linux), else None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _set_limits(memory: int | None, cpu_seconds: float | None) -> None:
    """Let this process map `memory` more bytes than now, compute `cpu_seconds` more, and write no core files.

    (The address space is counted from now because imports differ in size: a CUDA build of torch maps GBs.)
    """
    import resource

    def limit(kind: int, soft: int, fixed: bool) -> None:
        _, hard = resource.getrlimit(kind)
        if hard != resource.RLIM_INFINITY:
            soft = min(soft, hard)
        resource.setrlimit(kind, (soft, soft if fixed else hard))

    if memory is not None:
        now = _address_space()
        if now is not None:
            limit(resource.RLIMIT_AS, now + int(memory), fixed=True)
        limit(resource.RLIMIT_CORE, 0, fixed=True)
    if cpu_seconds is not None:
        used = resource.getrusage(resource.RUSAGE_SELF)
        limit(resource.RLIMIT_CPU, int(used.ru_utime + used.ru_stime + cpu_seconds) + 1, fixed=False)


def serve(memory: int | None = MEMORY_LIMIT, cpu_seconds: float | None = DEFAULT_TIMEOUT + CPU_MARGIN) -> None:
    """Worker main loop: JSON requests on stdin, JSON replies on the original stdout.

    Anything the grading code prints goes to stderr, so it cannot corrupt the protocol. Each request may use
    `cpu_seconds` of CPU time, and the process `memory` bytes of address space beyond its start-up size (None:
    no limit).
    """
    import logging

    _set_limits(memory, cpu_seconds)
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # silences "timeout disabled"
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    import math_verify  # noqa: F401  (import once, before the first timed call)

    for line in sys.stdin:
        if not line.strip():
            continue
        _set_limits(None, cpu_seconds)  # a fresh CPU budget for every request
        reply = _handle(json.loads(line))
        out.write(json.dumps(reply) + "\n")
        out.flush()

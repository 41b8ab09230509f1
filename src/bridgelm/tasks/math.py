"""MATH-style problems (MATH-500, AIME, AMC, HMMT) graded with math-verify in a worker process.

Design notes:
- math-verify's own timeouts use SIGALRM, which only works in the main thread, so they are turned
  off (`parsing_timeout=None`, `timeout_seconds=None`) and every grading call is bounded from
  outside instead: grading runs in one long-lived child Python process, and a call whose answer
  does not arrive within the timeout gets the child killed (it is restarted on the next call) and
  scores 0. Pathological answers such as `\\boxed{9^{9^{9^{9}}}}` make sympy run for minutes.
- The child is a plain `subprocess` talking JSON lines over stdin/stdout, not `multiprocessing`:
  it starts from any thread, from daemonic pool workers, and never re-imports the caller's
  `__main__`. Startup (importing sympy) is not counted in the per-call timeout.
- Calls are serialised by a lock; `grade_many` sends a batch under one lock so the per-item cost is
  one pipe round trip. A process that forks after starting the worker gets its own worker.
- math-verify's parser can hand model text to sympy's `parse_expr`, which calls `eval`. The worker is
  therefore a separate process with resource limits set before it reads any request: address space
  (MEMORY_LIMIT beyond its size at start-up), a CPU-time budget per request (the timeout plus
  CPU_MARGIN seconds; SIGXCPU ends a worker whose parent is gone or stuck) and no core files. These
  bound runaway or hostile arithmetic; they are not a sandbox (see the README's security paragraph).
- Gold answers are wrapped as `\\boxed{gold}` (then `$gold$` if that does not parse) so that
  math-verify reads them as LaTeX; the prediction is the whole completion (math-verify finds the
  last boxed answer itself), with the bare `\\boxed{}` content as a second chance. A sample's answer (what majority
  votes count) is its boxed one, else the text math-verify reads as its answer (`MathGrader.answers`).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bridgelm.errors import check_number
from bridgelm.tasks.answers import last_boxed
from bridgelm.tasks.base import Task, load_rows, require_text, with_instruction
from bridgelm.tasks.math_worker import CPU_MARGIN, DEFAULT_TIMEOUT, MEMORY_LIMIT

# Fields every row must have.
FIELDS = ("problem", "answer")

# Hub fallback when no local path is given.
HUB_ID = "HuggingFaceH4/MATH-500"

# Bound on starting the worker (importing sympy and math-verify), in seconds.
START_TIMEOUT = 120.0



# ----------------------------------------------------------------------------- caller side


class GradingTimeout(Exception):
    """The worker did not answer in time (it has been killed)."""


class MathGrader:
    """Client of one grading worker process; thread-safe, restarts the worker after a timeout."""

    def __init__(
        self,
        timeout: float = DEFAULT_TIMEOUT,
        start_timeout: float = START_TIMEOUT,
        memory_limit: int | None = MEMORY_LIMIT,
        cpu_limit: float | None = None,
    ):
        check_number("timeout", timeout, 0, open_low=True, note=" (seconds)")
        self.timeout = float(timeout)  # default bound on one grading call, seconds
        self.start_timeout = float(start_timeout)  # bound on worker startup, seconds
        self.memory_limit = memory_limit  # address space the worker may add after start-up, bytes (None: no limit)
        self.cpu_limit = timeout + CPU_MARGIN if cpu_limit is None else float(cpu_limit)  # CPU s per request
        self.restarts = 0  # how many workers were killed after a timeout or crash
        self._lock = threading.Lock()  # one request in flight at a time
        self._proc: subprocess.Popen | None = None  # the worker, started lazily
        self._owner_pid = os.getpid()  # process that started the worker (forks get their own)
        self._buf = b""  # bytes read from the worker but not yet consumed

    # -- process management

    def _start(self) -> None:
        # -I (isolated): the current folder, PYTHONPATH and the user's site-packages are not on the worker's import
        # path, so a `math_verify.py` or `json.py` where the command runs is never imported; the folder holding
        # this bridgelm package is put first explicitly.
        src = str(Path(__file__).resolve().parents[2])
        code = (
            f"import sys; sys.path.insert(0, {src!r}); from bridgelm.tasks.math_worker import serve; "
            f"serve({self.memory_limit!r}, {self.cpu_limit!r})"
        )
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True
        )
        self._owner_pid = os.getpid()
        self._buf = b""
        try:
            self._request({"op": "ping"}, self.start_timeout)
        except GradingTimeout as exc:
            raise RuntimeError(f"math grading worker did not start within {self.start_timeout} s") from exc

    def _ensure_started(self) -> None:
        if self._proc is not None and self._owner_pid != os.getpid():
            self._proc = None  # inherited through fork: the worker belongs to the parent
        if self._proc is None or self._proc.poll() is not None:
            self._start()

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        self._buf = b""
        if proc is None:
            return
        try:
            proc.kill()
            proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass

    def close(self) -> None:
        """Stop the worker (a later call starts a new one)."""
        with self._lock:
            if self._owner_pid == os.getpid():
                self._kill()
            self._proc = None

    # -- protocol

    def _read_line(self, deadline: float) -> bytes:
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise GradingTimeout()
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError("math grading worker exited")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def _request(self, request: dict, timeout: float) -> dict:
        """Send one request and wait for its reply; kill the worker on timeout or crash."""
        try:
            self._proc.stdin.write((json.dumps(request) + "\n").encode("utf-8"))
            self._proc.stdin.flush()
            return json.loads(self._read_line(time.monotonic() + timeout))
        except (GradingTimeout, EOFError, OSError, ValueError) as exc:
            self._kill()
            self.restarts += 1
            raise GradingTimeout(str(exc)) from exc

    def _reply(self, request: dict, timeout: float | None) -> dict:
        """The worker's reply to `request`; {} when it did not come within the timeout (the worker is killed)."""
        self._ensure_started()
        try:
            return self._request(request, self.timeout if timeout is None else timeout)
        except GradingTimeout:
            return {}

    def _score(self, request: dict, timeout: float | None) -> float:
        return float(self._reply(request, timeout).get("score", 0.0))

    # -- public API

    def grade(self, gold: str, completion: str, timeout: float | None = None) -> float:
        """1.0 if `completion`'s final answer equals `gold` per math-verify, 0.0 otherwise/on timeout."""
        return self.grade_many([(gold, completion)], timeout=timeout)[0]

    def grade_many(self, pairs: Iterable[tuple[str, str]], timeout: float | None = None) -> list[float]:
        """Scores of (gold, completion) pairs; each pair gets its own timeout."""
        pairs = list(pairs)
        with self._lock:
            return [self._score({"op": "grade", "gold": str(g), "completion": str(c)}, timeout) for g, c in pairs]

    def answers(self, completions: Iterable[str], timeout: float | None = None) -> list[str | None]:
        """The final answer math-verify reads in each completion, as it grades it (None: none, or not in time)."""
        with self._lock:
            return [self._reply({"op": "extract", "completion": str(c)}, timeout).get("answer") for c in completions]

    def debug_sleep(self, seconds: float, timeout: float | None = None) -> float:
        """Test hook: a grading call that sleeps `seconds` in the worker (0.0 either way)."""
        with self._lock:
            return self._score({"op": "sleep", "seconds": seconds}, timeout)

    def debug_burn(self, seconds: float, timeout: float | None = None) -> float:
        """Test hook: a grading call that computes for `seconds` of CPU time in the worker (0.0 either way)."""
        with self._lock:
            return self._score({"op": "burn", "seconds": seconds}, timeout)

    def debug_limits(self) -> dict:
        """Test hook: the worker's soft limits {"RLIMIT_AS": bytes, "RLIMIT_CPU": seconds} (-1: unlimited)."""
        with self._lock:
            self._ensure_started()
            return self._request({"op": "limits"}, self.timeout)


_DEFAULT_GRADER: MathGrader | None = None
_DEFAULT_LOCK = threading.Lock()


def default_grader() -> MathGrader:
    """The process-wide shared grader (one worker process), created on first use."""
    global _DEFAULT_GRADER
    with _DEFAULT_LOCK:
        if _DEFAULT_GRADER is None:
            _DEFAULT_GRADER = MathGrader()
            atexit.register(_DEFAULT_GRADER.close)
        return _DEFAULT_GRADER


def grade(gold: str, completion: str, timeout: float = DEFAULT_TIMEOUT) -> float:
    """Grade one completion against a LaTeX gold answer with the shared worker."""
    return default_grader().grade(gold, completion, timeout=timeout)


def grade_many(pairs: Iterable[tuple[str, str]], timeout: float = DEFAULT_TIMEOUT) -> list[float]:
    """Grade (gold, completion) pairs with the shared worker, one timeout per pair."""
    return default_grader().grade_many(pairs, timeout=timeout)


# ----------------------------------------------------------------------------- task


@dataclass
class MathTask(Task):
    """Problems with a LaTeX `answer`, graded by math-verify with a per-call timeout."""

    timeout: float = DEFAULT_TIMEOUT  # seconds allowed for grading one completion

    def prompt(self, example: dict) -> str:
        return with_instruction(example["problem"])

    def answer(self, example: dict) -> str:
        return str(example["answer"])

    def extract(self, completion: str) -> str | None:
        # the boxed answer, else what math-verify reads as the answer when it grades ("So the answer is 5."): a
        # sample graded correct without a box votes in the majority with its answer
        boxed = last_boxed(completion)
        if boxed is not None or not completion.strip():
            return boxed
        return default_grader().answers([completion], timeout=self.timeout)[0]

    def answered(self, completion: str) -> bool:
        # a boxed answer; math-verify would fall back on a bare number ("Step 2: the total number of")
        return last_boxed(completion) is not None

    def reward(self, completion: str, example: dict) -> float:
        return grade(self.answer(example), completion, timeout=self.timeout)

    def reward_many(self, pairs: Sequence[tuple[str, dict]]) -> list[float]:
        return grade_many(
            [(self.answer(example), completion) for completion, example in pairs],
            timeout=self.timeout,
        )


def check_row(row: dict) -> None:
    """ValueError unless the row has a problem and a gold answer: non-empty text (or a number) with balanced
    braces. (Whether math-verify parses it is known only in the grading worker.)"""
    require_text(row, "problem")
    gold = row["answer"]
    if isinstance(gold, bool) or not isinstance(gold, (str, int, float)) or not str(gold).strip():
        raise ValueError(f"field 'answer' is {gold!r}: expected a non-empty LaTeX answer or a number")
    depth = 0
    for ch in str(gold).replace("\\{", "").replace("\\}", ""):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth < 0:
            break
    if depth != 0:
        raise ValueError(f"field 'answer' is {gold!r}: expected a LaTeX answer with balanced braces")


def load(path: str | None = None, split: str = "test", timeout: float = DEFAULT_TIMEOUT) -> MathTask:
    """Rows with `problem` and `answer` from a local file, or MATH-500 from the hub when path is None."""
    check_number("timeout", timeout, 0, open_low=True, note=" (seconds)")
    rows = load_rows(HUB_ID if path is None else path, split, FIELDS, check=check_row)
    return MathTask(name="math", examples=rows, timeout=timeout)

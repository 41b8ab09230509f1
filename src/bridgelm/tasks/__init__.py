"""Benchmarks: `load(name, path, split)` returns a Task (prompts, gold answers, graders).

Design: the registry maps names to modules that are imported only when used, so importing
`bridgelm.tasks` stays cheap (no sympy, math-verify or reasoning-gym until a task needs them).
"""

from __future__ import annotations

import importlib
import warnings

from bridgelm.errors import DataWarning, UserError
from bridgelm.tasks.base import BOXED_INSTRUCTION, Task, format_chat, read_rows, with_instruction

# Task name -> module with a `load(path=None, split="test", **kwargs)` function ("module:function" names
# another loader of that signature).
REGISTRY = {
    "gsm8k": "bridgelm.tasks.gsm8k",
    "math": "bridgelm.tasks.math",
    "countdown": "bridgelm.tasks.countdown",
    "arith": "bridgelm.tasks.arith",
    "anysum": "bridgelm.tasks.anysum",
    "pairsum": "bridgelm.tasks.pairsum",
    "hint": "bridgelm.tasks.hint",
    "numeric": "bridgelm.tasks.numeric",
    "xsum": "bridgelm.tasks.summarize:load_xsum",
    "cnn_dailymail": "bridgelm.tasks.summarize:load_cnn_dailymail",
    "gpqa": "bridgelm.tasks.gpqa",
    "zebra": "bridgelm.tasks.zebra",
}

__all__ = ["BOXED_INSTRUCTION", "REGISTRY", "Task", "format_chat", "load", "read_rows", "with_instruction"]


def load(name: str, path: str | None = None, split: str = "test", **kwargs) -> Task:
    """The task `name` with examples from `path` (local file/folder or hub id; None = default source).

    Extra keyword arguments go to the task's loader (e.g. `timeout` for math, `size`/`seed` for
    countdown and zebra, `seed` of the option shuffle for gpqa).
    """
    if name not in REGISTRY:
        raise UserError(f"unknown task {name!r}: expected one of {', '.join(sorted(REGISTRY))}")
    module_name, _, loader = REGISTRY[name].partition(":")
    module = importlib.import_module(module_name)
    task = getattr(module, loader or "load")(path=path, split=split, **kwargs)
    warn_repeats(task, path or f"task {name!r} ({split})")
    return task


def warn_repeats(task: Task, source: str) -> list[tuple[int, int]]:
    """Warn (DataWarning) when two examples of `task` make the same prompt; returns the (row, first row) pairs."""
    first: dict[str, int] = {}
    repeats = []
    for row, example in enumerate(task.examples, start=1):
        seen = first.setdefault(task.prompt(example), row)
        if seen != row:
            repeats.append((row, seen))
    if repeats:
        shown = ", ".join(f"row {r} repeats row {f}" for r, f in repeats[:3])
        more = f" and {len(repeats) - 3} more" if len(repeats) > 3 else ""
        warnings.warn(
            f"{source} repeats problems: {shown}{more}; each copy is sampled and scored as a problem of its own",
            DataWarning,
            stacklevel=2,
        )
    return repeats

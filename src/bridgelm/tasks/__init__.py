"""Benchmarks: `load(name, path, split)` returns a Task (prompts, gold answers, graders).

Design: the registry maps names to modules that are imported only when used, so importing
`bridgelm.tasks` stays cheap (no sympy, math-verify or reasoning-gym until a task needs them).
"""

from __future__ import annotations

import importlib

from bridgelm.tasks.base import BOXED_INSTRUCTION, Task, format_chat, read_rows, with_instruction

# Task name -> module with a `load(path=None, split="test", **kwargs)` function ("module:function" names
# another loader of that signature).
REGISTRY = {
    "gsm8k": "bridgelm.tasks.gsm8k",
    "math": "bridgelm.tasks.math",
    "countdown": "bridgelm.tasks.countdown",
    "arith": "bridgelm.tasks.arith",
    "anysum": "bridgelm.tasks.anysum",
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
        raise ValueError(f"unknown task {name!r}: expected one of {', '.join(sorted(REGISTRY))}")
    module_name, _, loader = REGISTRY[name].partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, loader or "load")(path=path, split=split, **kwargs)

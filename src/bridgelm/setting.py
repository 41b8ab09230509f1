"""A config dataclass's field with its help text as data: `lr: float = setting(1e-6, "AdamW learning rate")`.

The text is the field's `metadata["help"]`; `bridgelm.cli.fields` makes it the help of the field's flag. Being data,
it reaches --help wherever the dataclass does, an install without .py sources included.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def setting(default: Any = dataclasses.MISSING, help: str = "", **field_kwargs: Any) -> Any:
    """A `dataclasses.field` with `default` (or `default_factory=...` and the like in `field_kwargs`) and `help`."""
    return dataclasses.field(default=default, metadata={"help": help}, **field_kwargs)


def help_of(f: dataclasses.Field) -> str:
    """The help text of a dataclass field ("" when it has none)."""
    return f.metadata.get("help", "")

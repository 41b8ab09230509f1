"""bridgelm train commands (to be filled in)."""

from __future__ import annotations


def add_commands(sub) -> None:
    """Register this family's subcommands on `sub`."""

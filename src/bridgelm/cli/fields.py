"""Command-line flags made from the fields of a config dataclass, so that each default lives in one place.

A field `max_new_tokens: int = setting(256, "generated tokens per sample, at most")` becomes `--max-new-tokens` with
the annotation's type, the dataclass's default and the field's help text as help; `build` makes the dataclass back
from the parsed arguments (each flag's dest is its field's name). By annotation:

- `int`, `float`, `str`: one value; `X | None`: an X, and None (the field's own meaning of it) when not given
- `bool`, `bool | None`: `--x` / `--no-x`
- `list[int]`, `tuple[int, ...]` (or float): comma-separated values, `--widths 1,4,8`
- `list[str]`: repeatable, `--stop A --stop B` (text may hold commas)

A command changes a flag only where it must, with `Flag`: another spelling (`--add` for `SFTConfig.blocks`),
choices, a parser of its own, or a default that deliberately differs from the dataclass's.

A field that is itself a config dataclass (`RLConfig.rollout: SamplingConfig`) is flattened with `Nested`: each of
its fields becomes a flag of its own, named after it with a prefix (`Nested(prefix="eval-")` makes
`validation.limit` `--eval-limit`) or spelled by a `Flag` (`rollout.n` as `--rollouts`), with the nested default's
values as defaults; the flag's dest is the dotted path ("validation.limit"), and `build` makes the nested dataclass
back. A `Nested` may hold a `Nested` of its own (`validation.sampling.n` is `--eval-n`).
`add_groups` shows a config's flags in titled groups in --help.

Help texts are data, each field's `metadata["help"]` (`bridgelm.setting.setting`), so --help needs no source files.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from bridgelm.setting import help_of

NUMBERS = (int, float)
FIELD_DEFAULT = object()  # Flag.default that keeps the dataclass's default


@dataclasses.dataclass(frozen=True)
class Flag:
    """How one field's flag departs from what the field itself gives."""

    name: str | None = None  # the flag, e.g. "--add"; None: "--" + the field's name with dashes
    default: Any = FIELD_DEFAULT  # the command's own default, where it deliberately differs from the dataclass's
    help: str | None = None  # None: the field's help text
    choices: Sequence | None = None  # the values allowed, when the annotation does not say
    type: Callable[[str], Any] | None = None  # parses one value; None: by the annotation


@dataclasses.dataclass(frozen=True)
class Nested:
    """How a field that is itself a config dataclass becomes flags: one for each field of its own."""

    prefix: str = ""  # put before each of its flags' names: "eval-" makes `n` --eval-n ("": the fields' own names)
    only: Sequence[str] | None = None  # its fields that get a flag (None: all but `skip`)
    skip: Sequence[str] = ()  # its fields without a flag: they keep the default config's values
    flags: Mapping[str, Flag | Nested] = dataclasses.field(default_factory=dict)  # by field: how its flag departs


def add_fields(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    only: Sequence[str] | None = None,
    skip: Sequence[str] = (),
    **changes: Flag | Nested,
) -> None:
    """Add a flag for each field of dataclass `cls` (those in `only`, when given, less those in `skip`), in the
    order of the fields; `changes` maps a field name to the `Flag` that departs from it, or to the `Nested` that
    flattens a dataclass-typed field."""
    _add_fields(parser, cls, None, "", "--", only, skip, changes)


def add_groups(
    parser: argparse.ArgumentParser, cls: type, groups: Mapping[str, Sequence[str]], **changes: Flag | Nested
) -> None:
    """`add_fields` for each titled group of fields (`groups`: title -> field names), each an argparse argument
    group in --help; every field of `cls` is in exactly one group."""
    listed = [name for names in groups.values() for name in names]
    fields = [f.name for f in dataclasses.fields(cls) if f.init]
    if sorted(listed) != sorted(fields):
        missing, extra = sorted(set(fields) - set(listed)), sorted(set(listed) - set(fields))
        twice = sorted({n for n in listed if listed.count(n) > 1})
        raise TypeError(f"{cls.__name__} groups: fields in none {missing}, not fields {extra}, in two {twice}")
    for title, names in groups.items():
        add_fields(parser.add_argument_group(title), cls, only=names, **changes)


def _add_fields(parser, cls: type, defaults: Any, dests: str, flags: str, only, skip, changes: Mapping) -> None:
    """add_fields of `cls` whose defaults are those of the instance `defaults` (None: the dataclass's), with flags
    named `flags` + the field's name (dashed) and dests `dests` + the field's name."""
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted((set(changes) | set(skip) | set(only or ())) - set(names))
    if unknown:
        raise TypeError(f"{cls.__name__} has no fields {unknown}")
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name not in names or f.name in skip or (only is not None and f.name not in only):
            continue
        change = changes.get(f.name, Flag())
        default = getattr(defaults, f.name) if defaults is not None else _default(f)
        if isinstance(change, Nested):
            if not dataclasses.is_dataclass(hints[f.name]):
                raise TypeError(f"{cls.__name__}.{f.name}: Nested for a field that is not a dataclass")
            inner = (hints[f.name], default, f"{dests}{f.name}.", flags + change.prefix)
            _add_fields(parser, *inner, change.only, change.skip, change.flags)
            continue
        if change.default is not FIELD_DEFAULT:
            default = change.default
        text = (change.help or help_of(f)).replace("%", "%%")  # argparse %-formats help
        kwargs = dict(dest=dests + f.name, default=default, help=text, **_parsing(cls, f.name, hints[f.name], change))
        if change.choices is not None:
            kwargs["choices"] = change.choices
        if kwargs.get("action") == "append":
            kwargs["help"] += " (repeatable)"
        flag = change.name or flags + f.name.replace("_", "-")
        if change.choices is None and kwargs.get("action") in (None, "append"):  # a value named by its flag, not dest
            kwargs["metavar"] = flag.lstrip("-").replace("-", "_").upper()
        action = parser.add_argument(flag, **kwargs)
        if default not in (None, [], (), argparse.SUPPRESS) and "%(default)" not in action.help:
            action.help += " (default: %(default)s)"


def _default(f: dataclasses.Field) -> Any:
    """The default of a dataclass field."""
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def build(cls: type, args: argparse.Namespace, base: Any = None, **fixed: Any):
    """A `cls` from parsed `args`: each field with a flag takes the flag's value, `fixed` sets fields by hand, and
    the others keep their values in `base` (default: the dataclass's defaults). A flag whose default is
    `argparse.SUPPRESS` and which was not given leaves its field to `base`. A nested config (flags whose dests are
    "field.name") is built back the same way, its other fields from `base`'s (or the default's) nested config."""
    values = vars(args)
    given = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.name in values:
            given[f.name] = values[f.name]
        inner = {k.removeprefix(f.name + "."): v for k, v in values.items() if k.startswith(f.name + ".")}
        if inner and dataclasses.is_dataclass(hints[f.name]):
            nested = getattr(base, f.name) if base is not None else _default(f)
            given[f.name] = build(hints[f.name], argparse.Namespace(**inner), base=nested)
    given.update(fixed)
    return dataclasses.replace(base, **given) if base is not None else cls(**given)


def _parsing(cls: type, name: str, hint: Any, change: Flag) -> dict:
    """The add_argument keywords that parse a field of type `hint`."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        hint = inner[0] if len(inner) == 1 else hint  # `X | None`: an X, None when not given
    origin, items = typing.get_origin(hint), typing.get_args(hint)
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}
    if hint in (int, float, str):
        return {"type": change.type or hint}
    if origin in (list, tuple) and items and items[0] in NUMBERS and (origin is list or items[1:] in ((), (...,))):
        item = change.type or items[0]
        return {"action": _Commas, "type": item, "collection": origin, "metavar": f"{items[0].__name__.upper()},..."}
    if origin is list and items == (str,):
        return {"action": "append", "type": change.type or str}
    if change.type is not None:
        return {"type": change.type}
    raise TypeError(f"{cls.__name__}.{name}: no flag for type {hint}; skip the field or give it a Flag(type=...)")


class _Commas(argparse.Action):
    """Comma-separated values of one type: `--widths 1,4,8` -> [1, 4, 8] (a tuple for tuple fields)."""

    def __init__(self, option_strings, dest, type, collection, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.item_type, self.collection = type, collection  # argparse itself must not parse the whole text

    def __call__(self, parser, namespace, values, option_string=None):
        out = []
        for entry in values.split(","):
            try:
                out.append(self.item_type(entry.strip()))
            except ValueError:
                kind, example = ("an integer", "1,4,8,16") if self.item_type is int else ("a number", "0.5,1,2")
                raise argparse.ArgumentError(
                    None, f"{option_string} entry {entry.strip()!r} is not {kind} (expected e.g. {example})"
                ) from None
        setattr(namespace, self.dest, self.collection(out))

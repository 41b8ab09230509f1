"""`--config run.yaml` for every command: a YAML mapping of the command's flags, each key a flag's name without
its dashes (`max-new-tokens` or `max_new_tokens`, `rollouts`), each value what the flag takes (`true`/`false` for
--x/--no-x, a list for a comma-separated or repeatable flag). The file's settings are put before the command line's
own flags, so argparse checks them as it checks flags, and a flag given on the command line replaces the file's
value. A key that names no flag of the command is refused in one line naming it.

    # run.yaml                         bridgelm rl --config run.yaml --steps 10
    model: HuggingFaceTB/SmolLM2-135M-Instruct
    task: gsm8k
    rollouts: 8
    widths: [1, 4]
"""

from __future__ import annotations

import argparse
from collections.abc import Hashable
from pathlib import Path

from bridgelm.cli.fields import _Commas as Commas

FLAG = "--config"
HELP = ("YAML file of this command's flags (keys: flag names without --, values as the flags take them); flags "
        "given on the command line override it")


def add_to_commands(sub: argparse._SubParsersAction) -> None:
    """Give every command that parses its own flags a `--config` (not lm-eval, which passes its arguments on and has
    a --config of its own, nor a command with commands of its own)."""
    for parser in sub.choices.values():
        if any(isinstance(a, argparse._SubParsersAction) or a.nargs == argparse.REMAINDER for a in parser._actions):
            continue
        parser.add_argument(FLAG, metavar="FILE", help=HELP)


def expand(top: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`argv` (command first) with its `--config FILE`'s settings as flags put before the command line's own."""
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.choices.get(argv[0]) if argv else None
    path = _config_path(argv[1:]) if parser is not None and FLAG in _flags(parser) else None
    if path is None:
        return argv
    settings = _load(parser, path)
    flags = _flags(parser)
    given = {action.dest for action, _ in given_flags(parser, argv[1:])}  # what the line sets, however spelled
    tokens = []
    for key, value in settings.items():
        flag = "--" + str(key).replace("_", "-")
        action = flags.get(flag)
        if action is None or flag in (FLAG, "--help"):
            parser.error(f"{FLAG} {path}: unknown key {key!r}: not a flag of bridgelm {argv[0]}")
        if action.dest not in given:
            tokens += _tokens(parser, path, key, flag, action, value)
    return [argv[0], *tokens, *argv[1:]]


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: a for a in parser._actions for flag in a.option_strings}


def given_flags(parser: argparse.ArgumentParser, argv: list[str]) -> list[tuple[argparse.Action, str]]:
    """The flags of `parser` that `argv` gives, in order, each as (its action, the option it names: "--prompt" for
    an abbreviated "--prom"), resolved as argparse resolves them (an exact option, else the one it abbreviates);
    a flag's value is passed over ("--stop --x": a stop string)."""
    flags, found = _flags(parser), []
    tokens = iter(argv)
    for token in tokens:
        name = token.split("=", 1)[0]
        if not token.startswith("--"):
            continue
        options = [name] if name in flags else [o for o in flags if o.startswith(name)]
        if len({id(flags[o]) for o in options}) != 1:
            continue  # not a flag of the command (argparse refuses it), or an ambiguous abbreviation
        action = flags[options[0]]
        if action.nargs != 0 and "=" not in token:
            next(tokens, None)  # its value
        found.append((action, options[0]))
    return found


def _config_path(args: list[str]) -> str | None:
    """The value of the last `--config` in `args` (`--config F` or `--config=F`), or None."""
    path = None
    for i, arg in enumerate(args):
        if arg == FLAG and i + 1 < len(args):
            path = args[i + 1]
        elif arg.startswith(FLAG + "="):
            path = arg.split("=", 1)[1]
    return path


def _load(parser: argparse.ArgumentParser, path: str) -> dict:
    """The YAML mapping in `path`; anything else (no file, not YAML, not a mapping) is a one-line error."""
    import yaml

    from bridgelm.errors import UserError
    from bridgelm.jsonl import check_regular_file

    if not path:
        parser.error(f"{FLAG} '': expected a path, not an empty string")
    try:
        settings = yaml.load(check_regular_file(Path(path).expanduser(), f"{FLAG}").read_text(), _unique_keys_loader())
    except (OSError, UserError) as err:
        parser.error(str(err))
    except UnicodeDecodeError as err:
        parser.error(f"{FLAG} {path} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start})")
    except yaml.YAMLError as err:
        parser.error(f"{FLAG} {path} is not YAML: {' '.join(str(err).split())}")
    if settings is None:
        return {}
    if not isinstance(settings, dict):
        parser.error(f"{FLAG} {path}: expected a mapping of flag names to values, not a {type(settings).__name__}")
    spelled: dict[str, str] = {}
    for key in settings:  # max-new-tokens and max_new_tokens name one flag: the file would give it twice
        other = spelled.setdefault(str(key).replace("_", "-"), str(key))
        if other != str(key):
            parser.error(f"{FLAG} {path}: keys {other!r} and {key!r} name one flag: expected it once")
    return settings


def _unique_keys_loader():
    """yaml's safe loader refusing a key given twice in one mapping (safe_load keeps the last one, silently)."""
    import yaml

    class UniqueKeys(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            self.flatten_mapping(node)  # merge keys (<<: *base) first, as safe_load does
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if not isinstance(key, Hashable):
                    break  # the base loader says what is wrong with it
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} is given twice", key_node.start_mark
                    )
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return UniqueKeys


def _tokens(parser, path: str, key, flag: str, action: argparse.Action, value) -> list[str]:
    """The command-line words that give `flag` the config's `value`."""
    if action.nargs == 0:  # --x / --no-x, or a switch
        if not isinstance(value, bool):
            parser.error(f"{FLAG} {path}: {key}={value!r}: expected true or false")
        if isinstance(action, argparse.BooleanOptionalAction):
            return [flag if value else "--no-" + flag[2:]]
        return [flag] if value else []
    if isinstance(value, list):
        if isinstance(action, (argparse._AppendAction, argparse._ExtendAction)):
            return [word for item in value for word in (flag, _text(item))]
        if isinstance(action, Commas):
            return [flag, ",".join(_text(item) for item in value)]
        parser.error(f"{FLAG} {path}: {key}={value!r}: expected one value, not a list")
    if isinstance(value, dict) or value is None:
        parser.error(f"{FLAG} {path}: {key}={value!r}: expected a value for {flag}")
    _check_type(parser, path, key, action, _text(value))
    return [flag, _text(value)]


def _check_type(parser, path: str, key, action: argparse.Action, text: str) -> None:
    """The file's value converted as its flag converts it, so that a bad one is refused naming the file, not only the
    flag it became (argparse would say "argument --n: invalid int value")."""
    if action.type is None or action.choices is not None:
        return
    try:
        action.type(text)
    except (TypeError, ValueError, argparse.ArgumentTypeError) as err:
        name = getattr(action.type, "__name__", "value")
        why = str(err) if isinstance(err, argparse.ArgumentTypeError) else f"not a valid {name}"
        parser.error(f"{FLAG} {path}: {key}={text!r}: {why}")


def _text(value) -> str:
    """A YAML scalar as the command line would spell it (true/false as the flags' own values do)."""
    return str(value).lower() if isinstance(value, bool) else str(value)

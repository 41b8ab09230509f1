"""Command line: argument parsing only; every command builds configs and makes one call into the library.

Each module of this package adds the commands of one family with `add_commands(subparsers)`. The flags of a
config dataclass are made from its fields by `fields.add_fields`, and the config is built back by `fields.build`:
a default lives in its dataclass only.

    bridgelm params --preset ds-qwen-7b
    bridgelm generate --model DIR --prompt "1+2=" --n 8 --width 4 --out samples.jsonl
    bridgelm rl --config run.yaml --steps 10    # every command: flags from a YAML file, the command line's win
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import warnings
from importlib.metadata import PackageNotFoundError, version

from bridgelm.cli import config_file

# Modules whose add_commands(sub) registers subcommands, in --help order.
FAMILIES = ["params", "plan", "generate", "evaluate", "train", "demo", "integrations"]


class _Parser(argparse.ArgumentParser):
    """argparse whose errors (a missing flag, a value of the wrong type) are one line and exit code 2, like every other
    bad input; the usage is one `--help` away. Its subcommand parsers are of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="bridgelm", description="Bridge: interdependent parallel generations")
    try:
        installed = version("bridgelm")
    except PackageNotFoundError:  # run from a source tree that was never installed
        installed = "unknown (not installed)"
    parser.add_argument("--version", action="version", version=f"bridgelm {installed}")
    sub = parser.add_subparsers(dest="command", required=True)
    for family in FAMILIES:
        importlib.import_module(f"bridgelm.cli.{family}").add_commands(sub)
    config_file.add_to_commands(sub)
    return parser


def _in_flag_words(parser: argparse.ArgumentParser, args: argparse.Namespace, message: str) -> str:
    """A message that opens with a setting as a config names it ("width=8 does not divide n=4: ..."), written in the
    command's flags instead ("--width 8 (its default) does not divide --n 4: ..."): every `name=value` of it whose
    name is a flag of the command, a value the user left at its default said to be one."""
    from bridgelm.cli.fit import flag_names

    if re.match(r"[a-z_]+=\S", message) is None:
        return message
    command = _command_parser(parser, args)
    if command is parser:
        return message
    flags = flag_names(command)
    actions = {o: a for a in command._actions for o in a.option_strings}

    def in_words(m: re.Match) -> str:
        flag = flags.get(m.group(1))
        if flag is None:
            return m.group()
        action = actions[flag]
        value = getattr(args, action.dest, None)
        left = value == action.default and m.group(2) in (str(value), repr(value))  # the value it runs with: a default
        return f"{flag} {m.group(2)}{' (its default)' if left else ''}"

    return re.sub(r"(?<![\w.-])([a-z_][\w.]*)=([^\s:;,)]+)", in_words, message)


def _command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the command `args` ran (`analyze`'s analysis too); `parser` itself when there is none."""
    command = parser
    while subs := [a for a in command._actions if isinstance(a, argparse._SubParsersAction)]:
        if getattr(args, subs[0].dest, None) not in subs[0].choices:
            break
        command = subs[0].choices[getattr(args, subs[0].dest)]
    return command


# Flags that may be given several times (each adds values); argparse keeps the last of any other, silently.
_REPEATABLE = (argparse._AppendAction, argparse._ExtendAction, argparse._HelpAction, argparse._VersionAction)


def refuse_repeats(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> None:
    """Exit 2 in one line when a flag of one value is given twice (`--prompt A --prompt B` sampled B alone), or two
    flags set one setting (`--chat --no-chat`, `--n 4 --num-samples 2`). A --config file's settings are only those the
    line does not set (`config_file.expand`)."""
    command = _command_parser(parser, args)
    if any(a.nargs == argparse.REMAINDER for a in command._actions):
        return  # lm-eval's own arguments follow
    seen: dict[str, tuple[argparse.Action, str]] = {}
    for action, flag in config_file.given_flags(command, argv):
        if isinstance(action, _REPEATABLE) or action.dest not in seen:
            seen.setdefault(action.dest, (action, flag))
            continue
        before, spelled = seen[action.dest]
        if before is action and action.nargs == 0 and spelled == flag:
            continue  # a switch given twice says the same thing twice (--chat --no-chat do not)
        again = f"{flag} given twice" if spelled == flag else f"{spelled} and {flag} both given"
        command.error(f"{again}: expected one value (argparse would keep the last one, silently)")


TEXT_ARGS = ("prompt", "stop")  # flags whose values are text, not paths


def expand_home(args: argparse.Namespace) -> None:
    """`~` expanded once in every path argument, as the shell would have: a quoted '~/x' is then checked and written
    as the same $HOME/x (expanding it only where it is checked wrote a literal ./~ folder)."""
    for name, value in vars(args).items():
        if name in TEXT_ARGS:
            continue
        if isinstance(value, str) and value.startswith("~"):
            setattr(args, name, os.path.expanduser(value))
        elif isinstance(value, list) and any(isinstance(v, str) and v.startswith("~") for v in value):
            setattr(args, name, [os.path.expanduser(v) if isinstance(v, str) else v for v in value])


# Flags whose values are paths: an empty one would be the current folder (`--data ''` read ./train.jsonl).
PATH_ARGS = ("data", "val_data", "model", "blocks", "prompts", "out")


def refuse_empty_paths(args: argparse.Namespace) -> None:
    """Exit 2 in one line when a path flag is given as '' (a shell variable that was not set)."""
    for name in PATH_ARGS:
        value = getattr(args, name, None)
        if value == "" or (isinstance(value, list) and "" in value):
            flag = "--" + name.replace("_", "-")
            print(f"bridgelm {args.command}: error: {flag} '': expected a path, not an empty string", file=sys.stderr)
            sys.exit(2)


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """parse_args, but an argument no parser took is refused by the command it was given to (`bridgelm score:
    error: unrecognized arguments: ...`), where argparse names the top parser."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        _command_parser(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _rank_tag() -> str:
    """" [rank R]" under torchrun, where every rank prints its own warnings and errors (about its own share of the
    work), so that eight alike lines say whose each is; "" in one process."""
    world, rank = os.environ.get("WORLD_SIZE", "1"), os.environ.get("RANK", "0")
    return f" [rank {rank}]" if world.isdigit() and int(world) > 1 else ""


def main(argv: list[str] | None = None) -> None:
    """Run one command. Bad input ends it with `bridgelm <command>: error: ...` and exit code 2 (see
    bridgelm.errors); any other exception is a bug: it is announced as one and raised with its traceback."""
    from bridgelm.errors import show_data_warnings, user_message
    from bridgelm.stop import exit_code

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    argv = config_file.expand(parser, sys.argv[1:] if argv is None else list(argv))
    args = parse(parser, argv)
    refuse_repeats(parser, args, argv)
    expand_home(args)
    refuse_empty_paths(args)
    prog = " ".join(["bridgelm", args.command, *([args.analysis] if getattr(args, "analysis", None) else [])])
    prog += _rank_tag()
    show = show_data_warnings(prog)
    try:
        args.func(args)
    except KeyboardInterrupt as err:
        if not getattr(err, "said", False):  # the trainers and warmup-data say what they saved
            print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(0 if getattr(err, "saved", False) else exit_code(err))  # 0: all ranks saved one step (train.agree)
    except Exception as err:
        message = user_message(err)
        if message is None:
            print(
                f"{prog}: unexpected {type(err).__name__}: this is a bug in bridgelm, not a problem with your input; "
                "please report it with the traceback below",
                file=sys.stderr,
            )
            raise
        message = _in_flag_words(parser, args, " ".join(message.split()))
        print(f"{prog}: error: {message}", file=sys.stderr)
        sys.exit(2)
    finally:
        warnings.showwarning = show

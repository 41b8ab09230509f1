"""Flags made from config dataclasses: defaults are the dataclass's, every field is reachable, bad values are one
line with exit code 2."""

import argparse
import dataclasses
import functools
import typing

import pytest

from bridgelm.cli import build_parser, main
from bridgelm.cli.fields import Flag, Nested, add_fields, add_groups, build
from bridgelm.demo.pipeline import DemoConfig
from bridgelm.eval.runner import EvalConfig
from bridgelm.engine import SamplingConfig
from bridgelm.setting import help_of, setting
from bridgelm.train.rl_config import RLConfig
from bridgelm.train.sft import SFTConfig
from bridgelm.train.warmup_data import MAX_NEW_TOKENS as WARMUP_MAX_NEW_TOKENS

# Each command that builds a config: its config, the least it must be given, and the fields it has no flag for.
COMMANDS = {
    "generate": (SamplingConfig, ["--model", "m", "--prompt", "x", "--out", "o"], {"foreign_groups"}),
    "warmup-data": (SamplingConfig, ["--model", "m", "--task", "t", "--out", "o"], {"width", "foreign_groups"}),
    "eval": (EvalConfig, ["--model", "m", "--out", "o"], {f"sampling.{n}" for n in ("compact_fraction", "compile",
                                                                                    "pack_weights")}),
    "sft": (SFTConfig, ["--model", "m", "--data", "d", "--out", "o"], set()),
    "rl": (
        RLConfig,
        ["--model", "m", "--task", "t", "--out", "o"],
        {f"rollout.{n}" for n in ("top_k", "seed", "compact_fraction", "foreign_groups", "compile", "pack_weights")}
        | {f"validation.{f.name}" for f in dataclasses.fields(EvalConfig)} - {"validation.sampling", "validation.limit"}
        | {f"validation.sampling.{f.name}" for f in dataclasses.fields(SamplingConfig)}
        - {f"validation.sampling.{n}" for n in ("n", "width", "max_new_tokens", "temperature", "top_p")},
    ),
    "demo": (
        DemoConfig,
        [],
        {f.name for f in dataclasses.fields(DemoConfig)}
        - {"seeds", "sft_per_seed", "bf16", "arms", "primary", "recipe_control", "misalignment", "threads", "workers"},
    ),
}


def _config(command, argv, base=None):
    cls = COMMANDS[command][0]
    return build(cls, build_parser().parse_args([command, *COMMANDS[command][1], *argv]), base=base)


def _actions(command) -> dict[str, argparse.Action]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in sub.choices[command]._actions}


def test_defaults_are_the_dataclasses():
    assert _config("generate", []) == SamplingConfig()
    assert _config("eval", []) == EvalConfig()
    assert _config("sft", []) == SFTConfig()
    assert _config("rl", []) == RLConfig()
    # the one deliberate departure: warm-up answers are sampled independently, and may be long
    assert _config("warmup-data", []) == SamplingConfig(width=1, max_new_tokens=WARMUP_MAX_NEW_TOKENS)
    assert _config("demo", [], base=DemoConfig()) == DemoConfig()
    assert _config("demo", ["--quick"], base=DemoConfig.quick()) == DemoConfig.quick()


def _other_value(action: argparse.Action, default):
    """(argv, value) that sets `action`'s field to something other than `default`."""
    flag = action.option_strings[0]
    if isinstance(action, argparse.BooleanOptionalAction):
        return ([action.option_strings[1]], False) if default is True else ([flag], True)
    if action.choices is not None:
        value = next(c for c in action.choices if c != default)
        return [flag, value], value
    if hasattr(action, "collection"):  # comma-separated numbers
        return [flag, "1,2"], action.collection([1, 2])
    if isinstance(action, argparse._AppendAction):
        return [flag, "A", flag, "B,C"], ["A", "B,C"]
    if action.type is int:
        value = (default or 0) + 3
    elif action.type is float:
        value = (default or 0.0) + 0.25
    else:
        value = "x"
    return [flag, str(value)], value


def _leaves(cls, without, prefix=""):
    """The dotted names of the fields of `cls`, a nested config's (one not in `without`) by its own fields."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        if dataclasses.is_dataclass(hints[f.name]) and name not in without:
            yield from _leaves(hints[f.name], without, name + ".")
        else:
            yield name


def _get(config, name):
    return functools.reduce(getattr, name.split("."), config)


def _set(config, name, value):
    head, _, rest = name.partition(".")
    return dataclasses.replace(config, **{head: _set(getattr(config, head), rest, value) if rest else value})


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_field_is_reachable_through_its_own_flag(command):
    cls, _, without = COMMANDS[command]
    actions = _actions(command)
    base = DemoConfig() if command == "demo" else None
    default = base or _config(command, [])
    for name in _leaves(cls, without):
        if name in without:
            assert name not in actions, f"{command} has a flag for {name}, listed as without one"
            continue
        assert name in actions, f"{command}: no flag sets {cls.__name__}.{name}"
        argv, value = _other_value(actions[name], _get(default, name))
        got = _config(command, argv, base=base)
        assert _get(got, name) == value, (command, name, argv)
        # ... and that field only
        assert _set(got, name, _get(default, name)) == default, (command, name)


@pytest.mark.parametrize("cls", [SamplingConfig, EvalConfig, SFTConfig, RLConfig, DemoConfig])
def test_every_config_field_has_its_help(cls):
    assert [f.name for f in dataclasses.fields(cls) if not help_of(f)] == []


def test_kept_spellings_mean_the_same_fields():
    assert _config("sft", ["--add", "pmatch", "--placement", "attn"]).blocks == "pmatch"
    assert _config("rl", ["--block-lr", "3e-4"]).block_lr == 3e-4
    assert _config("eval", ["--foreign-groups"]).sampling.foreign_groups is True
    assert _config("eval", ["--num-samples", "4"]).sampling.n == 4
    assert _config("eval", ["--widths", "1,4", "--stop", "a,b", "--stop", "c"]).widths == [1, 4]
    assert _config("eval", ["--stop", "a,b", "--stop", "c"]).stop == ["a,b", "c"]
    assert _config("generate", ["--no-compile"]).compile is False
    assert _config("rl", ["--bf16", "--resume", "--freeze-base"]).freeze_base is True
    # rl's nested rollout and validation configs keep the flat spellings
    rl = _config("rl", ["--rollouts", "6", "--width", "3", "--top-p", "0.9", "--eval-n", "2", "--eval-limit", "5"])
    assert (rl.rollout.n, rl.rollout.width, rl.rollout.top_p) == (6, 3, 0.9)
    v = rl.validation
    assert (v.sampling.n, v.limit, v.sampling.width) == (2, 5, RLConfig().validation.sampling.width)
    assert v.sampling.max_new_tokens is None  # None: the rollouts' max_new_tokens, as --eval-max-new-tokens says
    assert _config("demo", ["--quick", "--seeds", "2"], base=DemoConfig.quick()).seeds == 2


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["rl", "--model", "m", "--task", "t", "--out", "o", "--lr", "fast"], "argument --lr: invalid float value"),
        (["sft", "--model", "m", "--data", "d", "--out", "o", "--placement", "middle"], "argument --placement"),
        (["eval", "--model", "m", "--out", "o", "--widths", "1,x"], "--widths entry 'x' is not an integer"),
        (
            ["generate", "--model", "m", "--prompt", "x", "--out", "o", "--top-p", "2"],
            "--top-p 2.0: expected a finite number in (0, 1]",
        ),
        (["sft", "--model", "m", "--data", "d", "--out", "o", "--min-width", "1"], "expected 2 <= min_width"),
        (["demo", "--seeds", "0"], "--seeds 0 must be >= 1"),
        (["eval", "--model", "m", "--data", "d", "--out", "o", "--n", "-3"], "--n -3: expected a positive integer"),
        (["warmup-data", "--model", "m", "--task", "t", "--out", "o", "--limit", "0"], "--limit 0: expected a positive integer"),
        (
            ["generate", "--model", "m", "--prompt", "x", "--out", "o", "--compact-fraction", "2"],
            "--compact-fraction 2.0",
        ),
        (["demo", "--threads", "-1", "--out", "never-made"], "--threads -1 must be in [0, 4096] (0: torch's default)"),
        (["rl", "--model", "m", "--task", "t", "--out", "o", "--rollouts", "1", "--width", "1"], "--rollouts 1 must"),
    ],
)
def test_a_bad_value_is_one_line_and_exit_code_2(capsys, argv, expected):
    with pytest.raises(SystemExit) as err:
        main(argv)
    assert err.value.code == 2
    stderr = capsys.readouterr().err
    assert stderr.count("\n") == 1 and ": error: " in stderr and expected in stderr, stderr  # one line, no usage


@dataclasses.dataclass
class Toy:
    """Every kind of field the flags know."""

    steps: int = setting(3, "optimiser steps (100% of them)")
    rate: float | None = setting(None, "None: the default rate")
    name: str = setting("a", "a name that goes on over two more lines")

    # a heading of the fields below, not part of the name's help
    on: bool = setting(False, "switch it on")
    auto: bool | None = setting(None, "None: decide by device")
    widths: list[int] = setting(default_factory=lambda: [1], help="widths")
    sizes: tuple[float, ...] = setting((0.5,), "sizes")
    tags: list[str] = setting(default_factory=list, help="tags")
    blob: dict = setting(default_factory=dict, help="no flag can hold it")


def _toy_parser(**changes):
    p = argparse.ArgumentParser(prog="toy", exit_on_error=False)
    add_fields(p, Toy, skip=["blob"], **changes)
    return p


def test_a_toy_dataclass_round_trips():
    p = _toy_parser(name=Flag("--title", choices=["a", "b"]))
    assert build(Toy, p.parse_args([])) == Toy()
    argv = "--steps 5 --rate 0.1 --title b --on --no-auto --widths 2,4 --sizes 1,2.5 --tags x --tags y,z".split()
    got = build(Toy, p.parse_args(argv))
    assert got == Toy(5, 0.1, "b", True, False, [2, 4], (1.0, 2.5), ["x", "y,z"])
    assert build(Toy, p.parse_args([]), blob={"k": 1}).blob == {"k": 1}
    helps = {a.dest: a.help for a in p._actions}
    assert helps["steps"] == "optimiser steps (100%% of them) (default: %(default)s)"  # shown as "100%"
    assert "optimiser steps (100% of them) (default: 3)" in " ".join(p.format_help().split())
    assert helps["rate"] == "None: the default rate" and helps["tags"] == "tags (repeatable)"
    assert helps["name"].startswith("a name that goes on over two more lines (") and "heading" not in helps["on"]


def test_a_flag_for_no_field_or_no_type_is_a_bug_of_the_command():
    with pytest.raises(TypeError, match=r"Toy has no fields \['stpes'\]"):
        _toy_parser(stpes=Flag(default=4))
    with pytest.raises(TypeError, match="Toy.blob: no flag for type"):
        add_fields(argparse.ArgumentParser(), Toy)
    p = argparse.ArgumentParser()
    add_fields(p, Toy, only=["blob"], blob=Flag(type=lambda text: dict([text.split("=")])))  # a parser of its own
    assert build(Toy, p.parse_args(["--blob", "k=v"])).blob == {"k": "v"}


@dataclasses.dataclass
class Outer:
    """A config made of configs."""

    lr: float = setting(0.1, "learning rate")
    inner: Toy = setting(default_factory=lambda: Toy(steps=7), help="the toy, 7 steps")
    other: Toy = setting(default_factory=Toy, help="another toy")


def test_a_nested_config_is_flattened_and_built_back():
    p = argparse.ArgumentParser(prog="outer", exit_on_error=False)
    groups = {"main": ["lr", "inner"], "more": ["other"]}
    other = Nested(prefix="other-", only=["steps", "rate"], flags={"rate": Flag(help="the other rate")})
    add_groups(p, Outer, groups, inner=Nested(skip=["blob", "tags"], flags={"steps": Flag("--count")}), other=other)
    assert build(Outer, p.parse_args([])) == Outer()
    got = build(Outer, p.parse_args("--count 3 --widths 2,4 --other-steps 5 --other-rate 0.5 --lr 1".split()))
    assert got == Outer(1.0, Toy(steps=3, widths=[2, 4]), Toy(steps=5, rate=0.5))
    assert build(Outer, p.parse_args([]), base=Outer(inner=Toy(tags=["t"]))).inner == Toy(steps=7, tags=["t"])
    actions = {a.dest: a for a in p._actions}
    assert actions["inner.steps"].option_strings == ["--count"] and actions["inner.steps"].default == 7
    assert actions["other.rate"].help == "the other rate" and actions["other.steps"].metavar == "OTHER_STEPS"
    assert "inner.tags" not in actions and "other.name" not in actions
    assert [g.title for g in p._action_groups[2:]] == ["main", "more"]
    with pytest.raises(TypeError, match=r"fields in none \['other'\], not fields \[\], in two \['lr'\]"):
        add_groups(argparse.ArgumentParser(), Outer, {"a": ["lr", "inner"], "b": ["lr"]}, inner=Nested(skip=["blob"]))
    with pytest.raises(TypeError, match="Toy.steps: Nested for a field that is not a dataclass"):
        add_fields(argparse.ArgumentParser(), Toy, only=["steps"], steps=Nested())


def test_a_bad_list_entry_names_the_flag_and_the_entry():
    p = _toy_parser()
    with pytest.raises(argparse.ArgumentError, match=r"--sizes entry 'big' is not a number \(expected e.g. 0.5,1,2\)"):
        p.parse_args(["--sizes", "1,big"])


def test_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as err:
        main(["--version"])
    assert err.value.code == 0 and capsys.readouterr().out == f"bridgelm {version('bridgelm')}\n"


# `bridgelm rl --help` lines as they read when help was parsed from source comments (captured before the change,
# whitespace collapsed): the move to help data kept every word.
RL_HELP = [
    "--rollouts ROLLOUTS G, rollouts per prompt: the GRPO group (paper: 8) (default: 8)",
    "--eval-n EVAL_N samples per validation problem (paper: 4 on MATH-500, every 100 optimiser steps) (default: 4)",
    "--steps STEPS rollout steps; each samples P x G rollouts, then takes K optimiser steps (paper: 125 of K = 8, its "
    "1000 optimiser steps) (default: 100)",
    "--temperature TEMPERATURE sampling temperature; log-probs use logits / temperature as well (default: 0.6)",
    '--rollout-dtype ROLLOUT_DTYPE sample from a copy of the policy in this dtype ("bfloat16"), refreshed before each '
    "step (1.3-1.5x faster sampling on CPU); the update recomputes every log-prob. None: the policy itself",
    '--reward {sample,majority,distinct,sibling} "sample": each rollout\'s correctness (paper); "majority": a Bridge '
    'group\'s majority vote correct, for all its rollouts (needs rollouts >= 2 x width); "distinct": its distinct '
    'correct answers, shared by their holders (countdown); "sibling": r_i + sibling_weight x the mean of its group\'s '
    "other rewards (needs rollouts >= 2 x width) (default: sample)",
    "--micro-batch-tokens MICRO_BATCH_TOKENS also cut micro-batches, groups sorted by length, at this many padded "
    "tokens (rows x longest row); None: micro_batch_groups groups each, in mini-batch order",
    "--dist-timeout DIST_TIMEOUT minutes a collective waits for the slowest rank before the run fails (uneven long "
    "rollouts, rank 0 gathering a large checkpoint); torch's own default is 10 (default: 60.0)",
]


def _rl_help(capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        main(["rl", "--help"])
    assert stop.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_rl_help_reads_as_before(capsys):
    text = _rl_help(capsys)
    for line in RL_HELP:
        assert line in text, line


def test_help_needs_no_source_files(capsys, monkeypatch):
    """An install without .py files (only bytecode) keeps every flag's help: nothing reads the configs' source."""
    import inspect

    def no_source(obj):
        raise OSError(f"could not get source code of {obj!r}")

    monkeypatch.setattr(inspect, "getsource", no_source)
    monkeypatch.setattr(inspect, "getsourcelines", no_source)
    text = _rl_help(capsys)
    for line in RL_HELP:
        assert line in text, line
    helps = {a.dest: a.help for a in _actions("demo").values()}
    assert helps["workers"].startswith("stages that do not wait on each other run in this many processes at once")

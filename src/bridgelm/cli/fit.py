"""`rl`'s first-run defaults and flag-worded errors: settings the user did not give are fitted to the run, out loud,
and a config's refusal names the flags the user types (`--steps-per-rollout 8`), not the fields behind them."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import re
import sys

from bridgelm.errors import UserError


def fit_steps_per_rollout(cfg, args: argparse.Namespace, world: int, say: bool = True):
    """`cfg` with steps_per_rollout (K mini-batches per rollout, each of whole Bridge groups) cut to the Bridge groups
    a rank holds when --steps-per-rollout was not given (its flag's default is SUPPRESS) and the default would not
    fit; the choice is said on stderr. Settings that cannot work at all are left to `cfg.validate`."""
    G, w, P = cfg.rollout.n, cfg.rollout.width, cfg.prompts_per_step
    if "steps_per_rollout" in vars(args) or w < 1 or G % w or world < 1 or P % world:
        return cfg
    groups = P // world * (G // w)
    if not 1 <= groups < cfg.steps_per_rollout:
        return cfg
    if say:
        print(
            f"bridgelm rl: --steps-per-rollout {groups} (a rank holds {P // world} prompts x {G // w} Bridge groups "
            f"= {groups}, one group at least per mini-batch; the default is {cfg.steps_per_rollout}): give the flag "
            "to choose",
            file=sys.stderr,
        )
    return dataclasses.replace(cfg, steps_per_rollout=groups)


def flag_names(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each setting's name as a config's messages write it ("steps_per_rollout", "rollouts", "width", the dotted
    "validation.sampling.n") -> its flag."""
    by_flag, by_field, by_dest, seen = {}, {}, {}, set()
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if not longs or action.dest in ("help",):
            continue
        by_flag[longs[0][2:].replace("-", "_")] = longs[0]
        if "." in action.dest:
            by_dest[action.dest] = longs[0]
        field = action.dest.rsplit(".", 1)[-1]
        if field in seen:
            by_field.pop(field, None)  # "n" of the rollouts and of validation: ambiguous, left as written
        else:
            seen.add(field)
            by_field[field] = longs[0]
    return {**by_field, **by_flag, **by_dest}


def in_flags(err: Exception, flags: dict[str, str]) -> UserError:
    """`err`'s message with every `name=value` of a setting written as `--flag value`."""
    names = "|".join(sorted(map(re.escape, flags), key=len, reverse=True))
    text = re.sub(rf"(?<![\w.-])({names})=", lambda m: f"{flags[m.group(1)]} ", str(err)) if names else str(err)
    return UserError(text)


@contextlib.contextmanager
def flag_words(flags: dict[str, str]):
    """A refused setting (bridgelm.launch.SettingError) raised in the body with every `name=value` of `flags` written
    as `--flag value` (in_flags); other errors as they are."""
    from bridgelm.launch import SettingError

    try:
        yield
    except SettingError as err:
        raise in_flags(err, flags) from err

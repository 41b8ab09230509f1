"""The demo's verdict: which of the paper's claims the miniature reproduces, read off the paired intervals (the first
lines of report.md's claim list). It opens with the positive control and the recipe-matched control, names the one
primary comparison, says what one seed cannot show, and closes by saying the secondary claims are uncorrected."""

from __future__ import annotations

import re

from bridgelm.demo.arms import TITLES
from bridgelm.demo.sections import diff_text

INTERACTION_TARGET = 0.2  # design target: share of samples at w = 8 that differ from w = 1
# Differences of one set of weights (w=8 against w=1, foreign siblings against w=1): one training run is their unit,
# where the arms' differences (Bridge against RLVR) are claims about training runs, which one seed cannot test.
SAME_WEIGHTS = re.compile(r"(w\d+|foreign)-w1")


def _claim(text: str, holds: bool, detail: str) -> str:
    return f"- {text}: **{'reproduced' if holds else 'not reproduced'}** ({detail})."


def _interval_claim(text: str, key: str, ctl: dict, sign: int = 1) -> list[str]:
    """A claim read off the paired interval of `ctl["diffs"][key]` (sign -1: the claim is that it is below 0), set
    against the paper's effect scaled to this run where the paper measured it; none without that difference."""
    d = ctl["diffs"].get(key)
    if d is None:
        return []
    low, high = (d["low"], d["high"]) if sign > 0 else (-d["high"], -d["low"])
    effect = ctl["paper_effects"].get(key)
    word = "reproduced" if low > 0 else "reversed" if high < 0 else "not shown: the interval holds 0"
    if low > 0 and effect is not None and effect["position_unscaled"] == "above":
        word = "shown, but smaller than the paper's effect, which lies above the interval"
    side = "above" if d["low"] > 0 else "below"  # of the difference itself, whichever way the claim reads it
    if ctl["seeds"] < 2 and not SAME_WEIGHTS.fullmatch(key) and (low > 0 or high < 0):
        word = f"{side} 0 for this one training run; seed-to-seed variation is not measured, so this does not test " \
               "the method"
    role = "primary" if key == ctl.get("primary", "bridge-rlvr") else "secondary"
    if role == "secondary" and word == "reversed":  # one of many, uncorrected
        word = f"reversed ({side} 0), uncorrected: one comparison of many"
    elif role == "secondary" and (word == "reproduced" or word.startswith("shown")):
        below_paper = " (below the paper's effect)" if word.startswith("shown") else ""
        word = f"{side} 0, uncorrected: a lead, not a finding{below_paper}"
    line = f"- ({role}) {text}: **{word}** ({diff_text(d)}, paired 95% interval: {d.get('interval', 'bootstrap')}"
    smallest = ctl.get("power", {}).get(key)
    line += f"; found 80% of the time at {smallest:.1f} points)" if smallest is not None else ")"
    if effect is not None:
        above = ": an effect that large is excluded" if low <= 0 else ""
        meaning = {"above": above, "inside": ": neither shown nor excluded", "below": ": the effect here is larger"}
        unscaled = effect["position_unscaled"]
        sc, n = effect["scaled"], effect["of_models"]
        which = f"smallest effect over its {n} models" if n > 1 else "effect"
        line += (
            f". The paper's {which}, {effect['paper_points']:+.2f} points ({effect['source']}), is "
            f"{unscaled} the interval{meaning[unscaled]}. Scaled by RLVR's gain (this project's assumption, not the paper's: "
            f"{effect['paper_rlvr_gain']:+.2f} points there), it would be {100 * sc['mean']:+.1f} points "
            f"[{100 * sc['low']:+.1f}, {100 * sc['high']:+.1f}] here, {effect['position']} the interval"
        )
    return [line + "."]


def _recipe_claims(recipe: dict | None, cfg) -> list[str]:
    """First, per Bridge arm: can its recipe learn a sibling channel where one is worth having?"""
    if not recipe:
        return []
    w, lines = cfg.control.eval.sampling.width, []
    for arm, r in recipe.items():
        if "learns" not in r:  # only its search's candidates are done
            continue
        room = "" if r["headroom"] is None else f"; the majority's headroom: {100 * r['headroom']:.1f} points"
        can = "**can**" if r["learns"] else "**cannot** (on this evidence)"
        lines.append(
            f"- The {TITLES[arm]} arm's recipe {can} learn a sibling channel on the control task (w={w} − w=1 "
            f"{diff_text(r[f'w{w}-w1'])}, foreign − w=1 {diff_text(r['foreign-w1'])}{room}). "
            + ("" if r["learns"] else "A null on the main task from this recipe does not show that Bridge leaves its "
               "siblings unused.")
        )
    return lines


def _primary_extra_claim(ctl: dict, cfg) -> list[str]:
    """The primary comparison's claim when it is an extra arm's ("bridge_tuned-rlvr"), read like the others; none when
    it is one of the main differences (extra Bridge arms have a "w8-w1" of their own)."""
    if cfg.primary in ctl["diffs"]:
        return []
    for arm, d in (ctl.get("extra_arms") or {}).items():
        if cfg.primary.startswith(f"{arm}-") and cfg.primary in d:
            other = cfg.primary.split("-", 1)[1]
            view = {**ctl, "diffs": {cfg.primary: d[cfg.primary]}, "power": d["power"], "paper_effects": {}}
            view["seeds"] = d["seeds"]
            return _interval_claim(f"{TITLES[arm]} beats {TITLES.get(other, other)}", cfg.primary, view)
    return []


def verdict(arms: dict, ctl: dict, cfg) -> str:
    """Which of the paper's claims the miniature reproduces, read off the paired intervals."""
    k, w = cfg.eval.gpass_k, cfg.eval.sampling.width
    lines = [*_control_claim(ctl.get("positive_control"), cfg), *_recipe_claims(ctl.get("recipe_control"), cfg)]
    lines += _primary_extra_claim(ctl, cfg)
    lines += [
        *_interval_claim("Bridge improves accuracy after RLVR more than RLVR alone", "bridge-rlvr", ctl),
        *_interval_claim("Bridge beats P-Match, the parameter-matched control", "bridge-pmatch", ctl),
        *_interval_claim(f"Bridge at w={w} beats independent generation (w=1) with the same weights", f"w{w}-w1", ctl),
        *_interval_claim(
            "Bridge reads what its siblings write: with foreign siblings it falls below w=1", "foreign-w1", ctl, -1
        ),
    ]
    share = ctl["interaction"].get(str(w))
    if share is not None:
        target = f"{100 * INTERACTION_TARGET:.0f}%"
        lines.append(
            _claim(
                f"The samples interact: at least {target} of them change at w={w} (design target)",
                share >= INTERACTION_TARGET,
                f"{100 * share:.1f}% differ from their w=1 counterpart with the same random draws",
            )
        )
    gain = ctl.get("rlvr_gain")
    if gain is not None:  # a claim about RLVR's training runs, read like the arms' differences
        view = {**ctl, "diffs": {"rlvr-base": gain}, "power": {}, "paper_effects": {}}
        lines += _interval_claim("RLVR improves on the base model", "rlvr-base", view)
    lines += _interval_claim(
        f"Bridge answers more consistently: a Bridge group of {k} is all right more often than {k} of RLVR's "
        "independent samples", "sets-all bridge-rlvr", ctl)
    lines += _interval_claim(
        f"Bridge raises coverage: a Bridge group of {k} holds a right answer more often than {k} independent samples "
        "(Pass@w)", "sets-any bridge-rlvr", ctl)
    lines.append(
        "- Only the primary comparison, named before the run, is a test; the secondary ones are not corrected for "
        "their number (at 95%, about one interval in twenty excludes 0 by chance alone), so a secondary result above "
        "0 is a lead for a study that names it first, not a finding."
    )
    return "\n".join(lines)


def _control_claim(pc: dict | None, cfg) -> list[str]:
    """First of all: could this pipeline see sibling use at all (the positive control), where it ran?"""
    if not cfg.positive_control:
        return ["- No positive control ran: nothing here shows that this pipeline can detect sibling use where it "
                "exists, so the sibling claims below cannot show that Bridge leaves its siblings unused."]
    if not pc:
        return []  # still running: its section says so
    if all(pc["shown"].values()):
        return ["- The positive control **passed**: this pipeline produces and detects sibling use where siblings "
                "carry the answer."]
    return ["- The positive control **failed**: this pipeline did not show sibling use even where siblings carry the "
            "answer, so the sibling claims below cannot show that Bridge leaves its siblings unused."]

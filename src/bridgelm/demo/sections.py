"""The demo report's sections about its controls and extra arms: the recipe-matched control, the positive control,
the arms beyond the paper's three (with their rates chosen on validation problems) and the trace."""

from __future__ import annotations

from bridgelm.demo.arms import TITLES
from bridgelm.demo.numbers import power_text
from bridgelm.eval.tables import markdown_table, pct


def _pct(x) -> str:
    return pct(x, 1)


def diff_text(d: dict) -> str:
    return f"{100 * d['mean']:+.1f} points [{100 * d['low']:+.1f}, {100 * d['high']:+.1f}]"


def recipe_section(recipe: dict | None, cfg) -> list[str]:
    """Per Bridge arm, whether its own recipe learns a sibling channel on the control's task: read before any claim
    about whether Bridge uses its siblings on the main task."""
    if not recipe:
        return []
    rows, w = [], cfg.control.eval.sampling.width

    def row(title: str, r: dict) -> list[str]:
        room = "" if r["headroom"] is None else f"{100 * r['headroom']:.1f}"
        learns = "**yes**" if r["learns"] else "no"
        return [title, diff_text(r[f"w{w}-w1"]), diff_text(r["foreign-w1"]), room, learns, str(r["seeds"])]

    for arm, r in recipe.items():
        if "learns" in r:
            rows.append(row(TITLES[arm], r))
        for name, c in r.get("candidates", {}).items():  # the search's candidates, at its TUNE_SEED
            rows.append(row(f"{TITLES[arm]}, candidate {name}", c))
    head = ["Arm's recipe on the control task", f"w={w} − w=1", "foreign − w=1", "Headroom (majority − w=1, points)",
            "Learns a sibling channel", "Seeds"]
    return [
        "## Can each Bridge arm's recipe learn a sibling channel? (recipe-matched positive control)",
        "",
        "Each Bridge arm's own recipe (its SFT warm-up, learning rates, KL weight, temperature, steps, K, groups and "
        "rewards) run on the positive control's task, where a group's majority is right far more often than one "
        "sample. It learns a channel when w=8 − w=1 reaches a quarter of that headroom and foreign siblings fall below "
        "w=1, each interval excluding 0. An arm whose recipe cannot learn one here says nothing, by its null on the "
        "main task, about whether Bridge uses its siblings.",
        "",
        markdown_table(head, rows),
        "",
    ]


def control_section(pc: dict | None) -> list[str]:
    """The positive control (demo/control.py) as report lines: can this pipeline produce and detect a sibling gain
    where one exists? None until its runs are done."""
    if not pc:
        return []
    acc = pc["accuracy"]
    ok = pc["shown"]["w8-w1"] and pc["shown"]["foreign-w1"]
    verdict = (
        "**shown**: the pipeline produces and detects a sibling gain where one exists"
        if ok
        else "**not shown**: the pipeline does not show sibling use even where siblings carry the answer, so a null "
        "result on the main task says nothing about Bridge"
    )
    rows = [
        ["Bridge w=8 − Bridge w=1 (same weights, same draws)", diff_text(pc["w8-w1"]), power_text(pc["power"]["w8-w1"])],
        ["Bridge w=8 with foreign siblings − w=1", diff_text(pc["foreign-w1"]), power_text(pc["power"]["foreign-w1"])],
    ]
    return [
        "## Positive control: noisy clues, where the siblings carry the answer",
        "",
        f"Fresh Bridge blocks trained by GRPO with the base frozen ({pc['seeds']} seed(s)); accuracy w=1 "
        f"{_pct(acc['w1'])}%, w=8 {_pct(acc['w8'])}%, foreign siblings {_pct(acc['foreign'])}%; the majority vote "
        f"of w=1's samples (the independent ceiling) {_pct(pc['majority_vote_w1'])}%. Sibling use {verdict}.",
        "",
        markdown_table(["Paired difference (seeds and problems)", "Mean and 95% interval", "Detects (points)"], rows),
        "",
    ]


def misalignment_section(found: dict | None) -> list[str]:
    """The positive control at each preamble (demo/misalign.py): does the sibling channel survive misalignment?"""
    if not found:
        return []
    rows = []
    for p, r in found.items():
        shown = "yes" if r["shown"]["w8-w1"] and r["shown"]["foreign-w1"] else "no"
        rows.append([p, diff_text(r["w8-w1"]), diff_text(r["foreign-w1"]), shown, str(r["seeds"])])
    head = ["Preamble (0..p filler tokens a sample)", "w=8 − w=1", "foreign − w=1", "Channel shown", "Seeds"]
    return [
        "## The positive control under misalignment",
        "",
        "Each sample starts with its own random number of filler tokens (0 to p), so siblings reach their reads at "
        "different positions; Bridge reads a sibling only at the same position.",
        "",
        markdown_table(head, rows),
        "",
    ]


def extra_arms_section(extra: dict, searched: dict, cfg) -> list[str]:
    """The arms beyond the paper's three: paired differences against their reference arm and, for Bridge arms, w=8
    against w=1 with the same weights; the rates chosen on validation problems where an arm searched them."""
    if not extra:
        return []
    rows = []
    for arm, d in extra.items():
        for key, diff in d.items():
            if isinstance(diff, dict) and "mean" in diff:
                role = "primary" if key == cfg.primary and key.startswith(f"{arm}-") else "secondary"
                detects = power_text(d["power"][key])
                rows.append([f"{TITLES[arm]}: {key} ({role})", diff_text(diff), detects, str(d["seeds"])])
    lines = ["## The other arms", "", markdown_table(
        ["Paired difference (seeds and problems)", "Mean and 95% interval", "Detects (points)", "Seeds"], rows), ""]
    for arm, choice in searched.items():
        if choice:
            val = ", ".join(f"{name}: {_pct(acc)}%" for name, acc in choice["validation_accuracy"].items())
            blr = "" if choice["block_lr"] is None else f", block lr {choice['block_lr']:g}"
            lines += [f"{TITLES[arm]}: lr {choice['lr']:g}{blr}, chosen on validation problems (runs of a seed no evaluated run has; {val}).", ""]
    return lines


def trace_section(trace: dict | None) -> list[str]:
    """The interaction over the course of RL (the demo's trace stage), as report lines; none without a trace."""
    if not trace:
        return []
    w = trace["width"]
    rows = [
        [str(p["step"]), _pct(p["w1"]), _pct(p[f"w{w}"]), _pct(p[f"w{w}"] - p["w1"]), _pct(p["interaction"])]
        for p in trace["points"]
    ]
    return [
        f"## The interaction over the course of RL (Bridge, seed {trace['seed']}; step 0: the SFT blocks)",
        "",
        markdown_table(["RL step", "w=1", f"w={w}", f"w={w} - w=1", f"samples that differ at w={w}"], rows),
        "",
    ]



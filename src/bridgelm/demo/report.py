"""The demo's report: DIR/report.md and its figures, from the numbers of demo/results.py.

Rows follow the paper's Table 1 (Base, RLVR only, P-Match, Bridge), built on report.py's tables; the set figures
follow Figure 4 (G-Pass@8 against tau*k) and Table 3 (Bridge at every width); training curves come from each RL
run's metrics.jsonl. The claim list (demo/verdict.py) is written from the paired intervals: it says which of the
paper's claims the miniature reproduces and which not, and whether each interval excludes the paper's effect scaled
to this run.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from bridgelm.demo.arms import ARMS, ORDER, TITLES
from bridgelm.demo.base import task_name
from bridgelm.demo.results import RunDirs, demo_results
from bridgelm.demo.sections import (
    control_section,
    diff_text,
    extra_arms_section,
    misalignment_section,
    recipe_section,
    trace_section,
)
from bridgelm.demo.verdict import verdict
from bridgelm.eval.figures import new_figure, plot_gpass, plot_width, save_png
from bridgelm.eval.tables import markdown_table, pct, table_numbers
from bridgelm.jsonl import write_atomic


def _pct(x) -> str:
    """The demo's percentages: one decimal."""
    return pct(x, 1)


def accuracy_table(arms: dict, cfg) -> str:
    """The paper's Table 1 for the demo's arms: a row per arm, accuracy with its 95% interval, set metrics, and Avg
    and the improvement over Base as report.py's Table 1 counts them (`table_numbers`)."""
    k = cfg.eval.gpass_k
    seeds = max(len(a["seeds"]) for a in arms.values())
    of_first = " (seed 0)" if seeds > 1 else ""  # the set metrics, as the interval, are the first seed's
    head = [
        "Method",
        f"Accuracy (%){' mean ± sd over seeds' if seeds > 1 else ''}",
        f"95% interval{of_first}",
        f"Coverage@{cfg.eval.sampling.n}{of_first}",
        f"Pass@{k} (a set of {k}){of_first}",
        f"All of a set of {k} right{of_first}",
        f"G-Pass@{k} τ=0.5 (pooled){of_first}",
        f"Majority vote{of_first}",
        "Avg",
        "↑Δ",
    ]
    shown = [arm for arm in ORDER if arm in arms]
    table = table_numbers({arm: {"accuracy": {"mean": arms[arm]["accuracy_mean"]}} for arm in shown}, base="base")
    rows = []
    for arm in shown:
        data, numbers = arms[arm], table["rows"][arm]
        first = data["seeds"][min(data["seeds"])]
        title = TITLES[arm] + (f" (w={first['width']})" if arm in ARMS and ARMS[arm].bridge else "")
        acc = _pct(data["accuracy_mean"])
        if seeds > 1 and len(data["seeds"]) > 1:
            acc += f" ± {100 * data['accuracy_sd']:.1f}"
        interval = f"[{_pct(first['accuracy']['low'])}, {_pct(first['accuracy']['high'])}]"
        sets = first.get("sets", {})
        set_metrics = [first["coverage@n"]["mean"], sets.get("pass"), sets.get("all_correct"), first["gpass"].get(k // 2)]
        maj = first.get("majority_vote", {}).get("mean")
        delta = f"{100 * numbers['delta']:+.1f}"
        rows.append([title, acc, interval, *map(_pct, set_metrics), _pct(maj), _pct(numbers["avg"]), delta])
    return markdown_table(head, rows)


def width_table(arms: dict, cfg) -> str:
    """Bridge at every width: accuracy averaged over seeds, the rest of seed 0, and the interaction."""
    k = cfg.eval.gpass_k
    by_seed = arms["bridge"]["widths"]
    first = by_seed[min(by_seed)]  # seed 0: {width: cell}
    diverged = arms["bridge"].get("diverged_by_seed", {})
    head = [
        "Bridge width w",
        f"Accuracy (%), mean over {len(by_seed)} seed(s)",
        "95% interval (seed 0)",
        f"Coverage@{cfg.eval.sampling.n} (seed 0)",
        f"G-Pass@{k} τ=1 (pooled, seed 0)",
        "Samples that differ from w=1 (%)",
    ]
    rows = []
    for w in sorted(first):
        c = first[w]
        mean = statistics.fmean(by_seed[s][w]["accuracy"]["mean"] for s in by_seed)
        changed = [d[w] for d in diverged.values() if w in d]
        rows.append(
            [
                f"{w}{' (independent)' if w == 1 else ''}",
                _pct(mean),
                f"[{_pct(c['accuracy']['low'])}, {_pct(c['accuracy']['high'])}]",
                _pct(c["coverage@n"]["mean"]),
                _pct(c["gpass"].get(k)),
                _pct(statistics.fmean(changed)) if changed else "0.0",
            ]
        )
    return markdown_table(head, rows)


def controls_table(ctl: dict, cfg) -> str:
    """Paired differences (same problems, same seeds), and the controls."""
    w = cfg.eval.sampling.width
    names = {
        "bridge-rlvr": f"Bridge (w={w}) − RLVR only",
        "bridge-pmatch": f"Bridge (w={w}) − P-Match (control c: same parameters, no cross-sample attention)",
        f"w{w}-w1": f"Bridge w={w} − Bridge w=1 (same weights)",
        "foreign-w1": f"Bridge w={w} with foreign siblings (control b) − Bridge w=1",
    }
    runs = "its own SFT and RL runs" if cfg.sft_per_seed else "its own RL run, one shared SFT run"
    head = [f"Paired difference of accuracy, over {ctl['seeds']} seed(s) (each: {runs})", "Mean and 95% interval"]
    lines = [markdown_table(head, [[names[k], diff_text(d)] for k, d in ctl["diffs"].items() if k in names])]
    if ctl["interaction"]:
        shares = [f"{100 * v:.1f}" for v in ctl["interaction"].values()]
        lines += [
            "",
            markdown_table(
                ["Width w", *ctl["interaction"]], [["Samples that differ from w=1 (control a), %", *shares]]
            ),
        ]
    return "\n".join(lines)


def task_text(cfg) -> str:
    spec = cfg.base.task
    if task_name(spec) == "anysum":
        return (
            f"sums of {spec.min_operands}-{spec.max_operands} numbers in {spec.min_value}..{spec.max_value}, "
            "added in any order (anysum)"
        )
    return (
        f"step-by-step addition and subtraction ({spec.min_operands}-{spec.max_operands} numbers in "
        f"1..{spec.max_value}; arith)"
    )


def _peaks_text(peaks: list[dict]) -> str:
    if not peaks:
        return "not recorded"
    parts = []
    for p in peaks:
        text = f"fp32 {p['fp32_tflops']} TFLOP/s, bf16 {p['bf16_tflops']} TFLOP/s"
        if len(peaks) > 1:  # name the stages each invocation ran
            text += f" (stages {', '.join(p.get('stages', []))})"
        parts.append(text + _wall_text(p))
    return "; ".join(parts)


def _precision_text(cfg, why: str | None) -> str:
    why = f" ({why})" if why else ""
    if cfg.bf16:
        return f"Forwards in bf16{why}: autocast in training (fp32 weights and optimiser), bf16 weights in sampling."
    return (
        f"Forwards in fp32{why}. A bf16 run gives other numbers: its rounding differs from the first step on, so it "
        "trains another base model and other runs."
    )


def _wall_text(peak: dict) -> str:
    """The wall time of the invocation that measured `peak`, and its worker processes (stages ran side by side, so
    the stage times add up to more than the wall time)."""
    if "wall_s" not in peak:
        return ""
    return f", {peak.get('workers', 1)} worker process(es), {peak['wall_s']:.0f} s wall time from start to last stage"


def gpass_curves(arms: dict) -> dict[str, dict[int, float]]:
    """G-Pass@k at every tau*k of each arm's seed 0, by the arm's title."""
    return {
        TITLES[a] + (f" (w={arms[a]['seeds'][0]['width']})" if a == "bridge" else ""): arms[a]["seeds"][0]["gpass"]
        for a in ORDER
        if a in arms
    }


def plot_training(curves: dict[str, list[float]], path: Path) -> Path | None:
    """The reward of every RL run's rollouts per step, smoothed over a tenth of its steps; None without runs."""
    if not curves:
        return None
    fig, (ax,) = new_figure(1, width=6.5, height=3.6)
    for name, ys in curves.items():
        window = max(1, len(ys) // 10)
        smooth = [statistics.fmean(ys[max(0, i - window + 1) : i + 1]) for i in range(len(ys))]
        ax.plot(range(1, len(ys) + 1), [100 * y for y in smooth], label=name)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean reward of rollouts (%), smoothed")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return save_png(fig, path)


def draw_figures(out: Path, cfg, results: dict) -> list[str]:
    """OUT/gpass.png, OUT/widths.png and OUT/training.png; returns the names of those drawn."""
    k = cfg.eval.gpass_k
    plot_gpass(gpass_curves(results["arms"]), out / "gpass.png", k)
    width_curve = {
        w: {
            "accuracy": c["accuracy"]["mean"],
            "coverage@n": c["coverage@n"]["mean"],
            "g_pass_tau0.5": c["gpass"].get(k // 2, 0.0),
            "g_pass_tau1": c["gpass"].get(k, 0.0),
        }
        for w, c in results["arms"]["bridge"]["widths"][0].items()
    }
    plot_width({"Bridge": width_curve}, out / "widths.png")
    figures = ["gpass.png"] + (["widths.png"] if (out / "widths.png").exists() else [])
    return figures + (["training.png"] if plot_training(results["training_rewards"], out / "training.png") else [])


def write_demo_report(
    out: Path, cfg, dirs: RunDirs, found: dict, timings: dict, quick: bool, peaks: list[dict]
) -> Path:
    """OUT/report.md, OUT/results.json and the figures from the runs in `dirs`; returns the report's path.

    `peaks`: the matmul peaks measured by each invocation that ran stages, with the stages it ran."""
    results = demo_results(out, cfg, dirs, found, timings, quick, peaks)
    figures = draw_figures(out, cfg, results)
    text = [*_opening(cfg, results), *_tables(cfg, results), *_closing(cfg, results, figures)]
    return write_atomic(out / "report.md", "\n".join(text))


def _opening(cfg, results: dict) -> list[str]:
    quick, why = results["quick"], results["precision"]["why"]
    return [
        "# Bridge in miniature" + (" (--quick: toy sizes, the numbers mean nothing)" if quick else ""),
        "",
        f"Task: {task_text(cfg)}, {cfg.eval_problems} held-out test problems, {cfg.eval.sampling.n} samples each at "
        f"temperature {cfg.eval.sampling.temperature}, top-p {cfg.eval.sampling.top_p}; "
        f"RL over {results['seeds']} seed(s). Machine: "
        f"{results['machine']}; matmul peak measured when the stages ran: {_peaks_text(results['matmul_peaks'])}. "
        f"{_precision_text(cfg, why)} Stage times: {_times_text(results['timings_s'])}.",
        "",
    ]


def _times_text(seconds: dict) -> str:
    return ", ".join(f"{name} {value:.1f} s" for name, value in seconds.items()) or "none recorded"


def _size_text(params: int | None) -> str:
    return "small" if params is None else f"{params / 1e6:.2f}M"


def _tables(cfg, results: dict) -> list[str]:
    k, arms = cfg.eval.gpass_k, results["arms"]
    gpass = [[name, *(_pct(c.get(j)) for j in range(1, k + 1))] for name, c in gpass_curves(arms).items()]
    return [
        "## Accuracy and set metrics (layout of the paper's Table 1)",
        "",
        accuracy_table(arms, cfg),
        "",
        f"## G-Pass@{k}_τ against τ·k (paper Figure 4)",
        "",
        f"Pooled over each problem's {cfg.eval.sampling.n} samples, as the paper counts it: for Bridge a draw of {k} "
        "mixes its groups, so it is the rate of neither a real group nor independent samples; a real group's rates are "
        "the set columns above.",
        "",
        markdown_table(["Method", *(str(j) for j in range(1, k + 1))], gpass),
        "",
        "## Bridge at every width, same weights (paper Table 3)",
        "",
        width_table(arms, cfg),
        "",
        "## Does Bridge use its siblings? Controls and paired differences",
        "",
        controls_table(results, cfg),
        "",
        *recipe_section(results.get("recipe_control"), cfg),
        *control_section(results.get("positive_control")),
        *misalignment_section(results.get("misalignment")),
        *extra_arms_section(results["extra_arms"], results.get("lr_search", {}), cfg),
        *trace_section(results["trace"]),
    ]


def _closing(cfg, results: dict, figures: list[str]) -> list[str]:
    return [
        "## What the miniature reproduces",
        "",
        verdict(results["arms"], results, cfg),
        "",
        f"The miniature is a {_size_text(results['base_params'])} parameter model on a synthetic task, trained for "
        "minutes: it tests the mechanics",
        "of the method and its direction, not the paper's numbers. Differences are paired (same test problems,",
        "same seeds, same random draws) with 95% intervals that count both the seeds' and the problems' variation",
        "(with one seed, the problems' only: such an interval speaks of that training run). An interval",
        "that holds 0 does not show an effect. Each difference the paper measured is set first against the paper's",
        "own effect, in points (1-2 points), and then against that effect scaled by RLVR's gain here over its gain",
        "in the paper: an assumption of this project (Bridge's advantage grows with what RLVR gains on the task),",
        "not a finding of the paper's, so the scaled comparison excludes nothing unless the assumption holds.",
        "",
        "## Departures from the paper's settings",
        "",
        *[f"- {line}" for line in results["departures"]],
        "",
        "## Figures",
        "",
        *[f"![{f}]({f})" for f in figures],
        "",
    ]

"""bridgelm eval / score / report / analyze: evaluation runs, their scores, reports and analyses.

bridgelm eval --model DIR --task math --data math500.jsonl --data aime24.jsonl --n 32 --width 8 --out runs/x
torchrun --nproc_per_node 8 -m bridgelm eval ...        (one shard per rank; rank 0 scores)
bridgelm score runs/x
bridgelm report runs/base runs/bridge --names base,bridge --out reports/x
bridgelm analyze features --model DIR --run runs/x --out reports/features
bridgelm analyze siblings --model DIR (--run runs/x | --data warmup.jsonl) --out reports/siblings
bridgelm analyze similarity runs/x
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bridgelm.cli.common import add_model_args, model_source, positive_int, stop_string
from bridgelm.cli.fields import Flag, Nested, add_fields, build
from bridgelm.errors import UserError
from bridgelm.jsonl import check_out
from bridgelm.source import width_is_moot
from bridgelm.eval.runner import EvalConfig


def _cmd_eval(args) -> None:
    from bridgelm.dist import Dist
    from bridgelm.eval.datasets import load_benchmarks
    from bridgelm.eval.folder import shard_file_name
    from bridgelm.eval.runner import run_eval
    from bridgelm.eval.score import METRICS_FILE, score_run, summary_lines
    from bridgelm.jsonl import check_free

    cfg = build(EvalConfig, args)
    cfg.validate()
    check_out(args.out, "dir")
    benches = load_benchmarks(args.task, args.data, cfg.limit)  # data errors before the model is loaded
    dist = Dist.from_env()
    if dist.is_main:  # another eval (or score) writing the run: refused before the model loads
        check_free(args.out, folder=True)
    check_free(Path(args.out) / shard_file_name(dist), folder=False)
    if dist.world > 1:
        args.device = str(dist.device)
    lead = dist.is_main
    if lead:
        names = ", ".join(f"{b.name} ({len(b.problems)})" for b in benches)
        print(
            f"bridgelm eval: {names} x widths {cfg.all_widths()} x {cfg.sampling.n} samples -> {args.out}/ "
            f"(run.json, samples{'.rank*' if dist.world > 1 else ''}.jsonl"
            f"{'' if args.no_score else ', scores.jsonl, metrics.json'})"
        )
    model, tokenizer = model_source(args).load()
    what = width_is_moot(model)
    if lead and what and len(cfg.all_widths()) > 1:
        print(
            f"bridgelm eval: note: {what}, so its samples do not depend on the width: widths {cfg.all_widths()} "
            "sample the same sets (up to the rounding of other batch shapes), each again"
        )
    done = run_eval(model, tokenizer, args.task, args.data, cfg, args.out, args.model, args.blocks, dist=dist)
    who = f"rank {dist.rank}: " if dist.world > 1 else ""
    what = "problems" if len(cfg.all_widths()) == 1 else f"sets (a problem at one of {len(cfg.all_widths())} widths)"
    print(f"bridgelm eval: {who}sampled {done['sampled']} {what} now, {done['skipped']} were already in {args.out}")
    if done["truncated"]:
        print(
            f"bridgelm eval: {who}the long document of {done['truncated']} of them was cut to fit the context minus "
            "--max-new-tokens (recorded as 'truncated' on its line of the samples file)"
        )
    if lead and not args.no_score:
        result = score_run(args.out)
        print(f"bridgelm eval: metrics -> {Path(args.out) / METRICS_FILE}")
        for line in summary_lines(result):
            print(f"bridgelm eval: {line}")


def _cmd_score(args) -> None:
    from bridgelm.eval.score import METRICS_FILE, SCORES_FILE, score_run, summary_lines

    result = score_run(args.run_dir, allow_partial=args.allow_partial)
    run = Path(args.run_dir)
    print(f"bridgelm score: {run / METRICS_FILE}, {run / SCORES_FILE}")
    for line in summary_lines(result):
        print(f"bridgelm score: {line}")


def _cmd_report(args) -> None:
    import json

    from bridgelm.eval.report import write_report

    names = [x.strip() for x in args.names.split(",")] if args.names is not None else None
    check_out(args.out, "dir")
    path = write_report(args.run_dirs, args.out, names=names, base=args.base)
    report = json.loads((Path(args.out) / "report.json").read_text())
    files = ", ".join(Path(f).name for f in report["files"])
    print(f"bridgelm report: {path} (and report.json{', ' + files if files else ''} in {args.out})")
    for line in report["setting_differences"]:
        print(f"bridgelm report: warning: {line}")
    acc = report["accuracy"]
    for name, row in acc["rows"].items() if acc["columns"] else ():  # ROUGE-only runs: the non-math lines below
        avg = "–" if row["avg"] is None else f"{100 * row['avg']:.2f}%"
        delta = "" if row["delta"] is None else f" (Δ {100 * row['delta']:+.2f} vs {acc['base']})"
        print(f"bridgelm report: {name}: mean accuracy {avg}{delta}")
    table2 = report.get("nonmath")
    for name, cells in (table2 or {}).get("rows", {}).items():
        shown = [f"{table2['titles'][b]} {100 * cells[b]['mean']:.2f}" for b in table2["columns"] if cells.get(b)]
        if shown:
            print(f"bridgelm report: {name}: non-math (ROUGE-1 / accuracy, %): {', '.join(shown)}")


def _cmd_features(args) -> None:
    from bridgelm.eval.analyze import plot_feature_ratios, run_feature_ratios
    from bridgelm.eval.folder import check_run_model
    from bridgelm.jsonl import write_json

    check_out(args.out, "dir")
    check_run_model(args.run, args.model, args.blocks)
    model = model_source(args).load_model()
    out = Path(args.out)
    print(f"bridgelm analyze features: {args.sets} response sets of {args.run} -> {out}/features.json, features.png")
    result = run_feature_ratios(model, args.run, args.sets, args.benchmark, args.width, args.max_tokens)
    result.update(model=args.model, blocks=args.blocks, run=str(args.run))
    write_json(out / "features.json", result)
    plot_feature_ratios({f"{result['kind']} ({Path(args.model).name})": result["ratios"]}, out / "features.png")
    ratios = ", ".join(f"{r:.4f}" for r in result["ratios"])
    print(f"bridgelm analyze features: {result['kind']} ratio per layer over {result['tokens']} tokens: {ratios}")


def _cmd_siblings(args) -> None:
    from bridgelm.eval.analyze import run_response_sets, sibling_gain, warmup_response_sets
    from bridgelm.eval.folder import check_run_model
    from bridgelm.jsonl import write_json

    if (args.run is None) == (args.data is None):
        raise UserError("give one of --run (an eval run) or --data (a warm-up file)")
    check_out(args.out, "dir")
    if args.run is not None:
        check_run_model(args.run, args.model, args.blocks)
        sets = run_response_sets(args.run, args.sets, args.benchmark, args.width, args.max_tokens)
    else:
        sets = warmup_response_sets(args.data, args.sets)
    model = model_source(args).load_model()
    out = Path(args.out) / "siblings.json"
    print(f"bridgelm analyze siblings: {len(sets)} response sets of {args.run or args.data} -> {out}")
    result = sibling_gain(model, sets)
    result.update(model=args.model, blocks=args.blocks, source=str(args.run or args.data))
    write_json(out, result)
    d = result["diff"]
    print(
        f"bridgelm analyze siblings: NLL per response token {result['nll_with_siblings']:.5f} with siblings, "
        f"{result['nll_alone']:.5f} alone: {d['mean']:+.5f} [{d['low']:+.5f}, {d['high']:+.5f}] over "
        f"{result['sets']} sets ({result['tokens']} tokens; negative: the siblings help)"
    )


def _cmd_similarity(args) -> None:
    from bridgelm.eval.similarity import DEFAULT_EMBEDDER, run_similarity

    out = Path(args.out) if args.out else Path(args.run_dir) / "similarity.json"
    check_out(str(out), "file")
    embedder = DEFAULT_EMBEDDER if args.embedding_model is None else (args.embedding_model or None)
    result = run_similarity(args.run_dir, args.benchmark, args.width, args.max_samples, embedder, out)
    print(f"bridgelm analyze similarity: -> {out}")
    for bench, per in result.items():
        for w, entry in per.items():
            r, r1 = entry["rouge_l"], entry["rouge_1"]
            emb = entry.get("embedding", {})
            tail = f", embedding cosine {emb['cosine']['mean']:.4f}" if "cosine" in emb else ""
            skipped = f" (embedding skipped: {emb['skipped']})" if "skipped" in emb else ""
            print(
                f"bridgelm analyze similarity: {bench} w={w}: ROUGE-L {r['mean']:.4f} "
                f"[{r['low']:.4f}, {r['high']:.4f}], ROUGE-1 {r1['mean']:.4f} "
                f"over {entry['problems']} sets{tail}{skipped}"
            )


def add_commands(sub) -> None:
    _add_eval(sub)
    p = sub.add_parser("score", help="grade a run's samples; writes metrics.json and scores.jsonl")
    p.add_argument("run_dir")
    p.add_argument("--allow-partial", action="store_true", help="score an unfinished run (lists missing problems)")
    p.set_defaults(func=_cmd_score)

    p = sub.add_parser("report", help="tables (markdown) and plots (PNG) over scored runs")
    p.add_argument("run_dirs", nargs="+")
    p.add_argument("--out", required=True, help="report folder: table.md, report.json, *.png")
    p.add_argument("--names", help="comma-separated row names, one per run (equal names merge runs into a row)")
    p.add_argument("--base", help="row that the improvement column compares with (default: the first)")
    p.set_defaults(func=_cmd_report)
    _add_analyze(sub)


# EvalConfig.sampling's flags: the sampling settings by their own names, told as an evaluation samples
EVAL_SAMPLING_FLAGS = Nested(
    skip=["compact_fraction", "compile", "pack_weights"],
    flags={
        "n": Flag(help="samples per problem"),
        "width": Flag(help="Bridge group width that tables report (when `widths` leave it out: the widest of them)"),
        "seed": Flag(help="seeds the sampler of every (benchmark, width)"),
        "max_batch_sequences": Flag(help="rows decoded together, at most (does not change what is measured)"),
        "max_batch_tokens": Flag(help="rows x (prompt + max_new_tokens) of a batch, at most"),
        "foreign_groups": Flag(help="control: groups of sample j of `width` different problems (see bridgelm.engine)"),
    },
)


def _add_eval(sub) -> None:
    p = sub.add_parser("eval", help="sample n responses per problem for benchmarks and widths, then score them")
    add_model_args(p)
    p.add_argument(
        "--task",
        default="math",
        help="task of the data files (gsm8k, math, countdown, xsum, cnn_dailymail, gpqa, zebra, ...)",
    )
    p.add_argument(
        "--data", action="extend", nargs="+", default=[], help="data file(s), one benchmark each (named by stem)"
    )
    add_fields(
        p,
        EvalConfig,
        sampling=EVAL_SAMPLING_FLAGS,
        widths=Flag(
            help="widths to sample, each dividing --n; tables report --width when it is listed, else the widest"
        ),
        stop=Flag(type=stop_string),
    )
    p.add_argument(
        "--num-samples",
        dest="sampling.n",
        metavar="N",
        type=int,
        default=argparse.SUPPRESS,
        help="same as --n (torchrun takes --n for its own options)",
    )
    p.add_argument("--out", required=True, help="run directory (re-runs resume; other settings are refused)")
    p.add_argument("--no-score", action="store_true", help="only sample; score later with bridgelm score")
    p.set_defaults(func=_cmd_eval)


def _add_analyze(sub) -> None:
    p = sub.add_parser("analyze", help="feature contributions of the blocks; similarity of responses")
    asub = p.add_subparsers(dest="analysis", required=True)
    f = asub.add_parser("features", help="||block output|| / ||residual|| per layer over sampled response sets")
    add_model_args(f)
    f.add_argument("--run", required=True, help="eval run whose samples are re-run through the model")
    f.add_argument("--out", required=True, help="folder for features.json and features.png")
    f.add_argument("--sets", type=positive_int, default=8, help="response sets (one group each) to re-run")
    f.add_argument("--benchmark", help="only this benchmark's problems")
    f.add_argument("--width", type=positive_int, help="only samples of this width")
    f.add_argument("--max-tokens", type=positive_int, default=4096, help="cut each sequence (prompt + response) here")
    f.set_defaults(func=_cmd_features)
    g = asub.add_parser("siblings", help="NLL of response sets with their siblings as a group vs each alone (w=1)")
    add_model_args(g)
    g.add_argument("--run", help="eval run whose sampled sets are re-run (the first group of each problem)")
    g.add_argument("--data", help="warm-up file (bridgelm warmup-data) whose kept problems' traces are the sets")
    g.add_argument("--out", required=True, help="folder for siblings.json")
    g.add_argument("--sets", type=positive_int, default=64, help="response sets, spread evenly over the run or file")
    g.add_argument("--benchmark", help="only this benchmark's problems (--run)")
    g.add_argument("--width", type=positive_int, help="only samples of this width (--run)")
    g.add_argument(
        "--max-tokens", type=positive_int, default=4096, help="cut each sequence (prompt + response) here (--run)"
    )
    g.set_defaults(func=_cmd_siblings)
    s = asub.add_parser(
        "similarity", help="mean pairwise ROUGE-L and ROUGE-1 (rouge-score; and embedding cosine) within response sets"
    )
    s.add_argument("run_dir")
    s.add_argument("--benchmark", help="only this benchmark")
    s.add_argument("--width", type=positive_int, help="only this width")
    s.add_argument("--max-samples", type=positive_int, help="first responses of each set only (pairs grow as n^2)")
    s.add_argument("--embedding-model", help="local sentence-transformers model (default: MiniLM-L6; '' = skip)")
    s.add_argument("--out", help="output JSON (default RUN_DIR/similarity.json)")
    s.set_defaults(func=_cmd_similarity)

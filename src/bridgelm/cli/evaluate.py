"""bridgelm eval / score / report / analyze: evaluation runs, their scores, reports and analyses.

bridgelm eval --model DIR --task math --data math500.jsonl --data aime24.jsonl --n 32 --width 8 --out runs/x
torchrun --nproc_per_node 8 -m bridgelm eval ...        (one shard per rank; rank 0 scores)
bridgelm score runs/x
bridgelm report runs/base runs/bridge --names base,bridge --out reports/x
bridgelm analyze features --model DIR --run runs/x --out reports/features
bridgelm analyze siblings --model DIR (--run runs/x | --data warmup.jsonl) --out reports/siblings
bridgelm analyze similarity --run runs/x                 (writes runs/x/similarity.json, which report reads)
"""

from __future__ import annotations

from bridgelm.cli.common import add_model_args, add_num_samples, model_source, positive_int, stop_string
from bridgelm.cli.fields import Flag, Nested, add_fields, build
from bridgelm.eval import launch
from bridgelm.eval.runner import EvalConfig


def _cmd_eval(args) -> None:
    launch.run_evaluate(build(EvalConfig, args), model_source(args), args.task, args.data, args.out, not args.no_score)


def _cmd_score(args) -> None:
    launch.run_score(args.run_dir, args.allow_partial)


def _cmd_report(args) -> None:
    names = [x.strip() for x in args.names.split(",")] if args.names is not None else None
    launch.run_report(args.run_dirs, args.out, names, args.base)


def _cmd_features(args) -> None:
    launch.run_features(model_source(args), args.run, args.out, args.sets, args.benchmark, args.width, args.max_tokens)


def _cmd_siblings(args) -> None:
    launch.run_siblings(
        model_source(args), args.out, args.run, args.data, args.sets, args.benchmark, args.width, args.max_tokens
    )


def _cmd_similarity(args) -> None:
    launch.run_similarity(
        args.run, args.out, args.benchmark, args.width, args.max_samples, args.embedding_model
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
    add_num_samples(p, "sampling.n")
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
    s.add_argument("--run", required=True, help="eval run whose response sets are compared")
    s.add_argument("--benchmark", help="only this benchmark")
    s.add_argument("--width", type=positive_int, help="only this width")
    s.add_argument("--max-samples", type=positive_int, help="first responses of each set only (pairs grow as n^2)")
    s.add_argument("--embedding-model", help="local sentence-transformers model (default: MiniLM-L6; '' = skip)")
    s.add_argument("--out", help="a .json file (default RUN/similarity.json, which bridgelm report reads)")
    s.set_defaults(func=_cmd_similarity)

"""bridgelm demo: the paper's pipeline in miniature, offline (pre-train, warm up, RL, evaluate, report)."""

from __future__ import annotations

from dataclasses import replace


def _cmd_demo(args) -> None:
    from bridgelm.demo.pipeline import DemoConfig, run_demo

    cfg = DemoConfig.quick() if args.quick else DemoConfig()
    if args.seeds is not None and args.seeds < 1:
        raise ValueError(f"--seeds {args.seeds} must be >= 1")
    cfg = replace(cfg, seeds=args.seeds or cfg.seeds, threads=args.threads)
    out = args.out or ("runs/demo-quick" if args.quick else "runs/demo")
    print(f"bridgelm demo: every stage writes under {out} (a finished stage is skipped on a re-run)")
    report = run_demo(out, cfg, quick=args.quick)
    print(f"bridgelm demo: report at {report} (numbers in {report.parent / 'results.json'})")


def add_commands(sub) -> None:
    p = sub.add_parser("demo", help="the paper's pipeline in miniature on a CPU, offline; writes a report")
    p.add_argument("--out", help="output folder (default runs/demo, or runs/demo-quick with --quick)")
    p.add_argument(
        "--quick", action="store_true", help="toy sizes (~3 minutes): proves the pipeline, numbers mean nothing"
    )
    p.add_argument("--seeds", type=int, help="RL seeds per arm (default 3; 1 with --quick); arms share each seed")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.set_defaults(func=_cmd_demo)

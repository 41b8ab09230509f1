"""bridgelm params: parameter counts by part (the paper's Appendix B)."""

from __future__ import annotations


def _cmd_params(args) -> None:
    from bridgelm.params import PRESETS, count, meta_model, table

    names = args.preset or ([] if args.model else list(PRESETS))
    rows = [count(meta_model(preset=p), p, args.kind, args.heads) for p in names]
    rows += [count(meta_model(model_dir=m), m, args.kind, args.heads) for m in args.model or []]
    print(table(rows, args.kind))


def add_commands(sub) -> None:
    p = sub.add_parser("params", help="parameter counts by part (paper Appendix B), built on the meta device")
    p.add_argument("--preset", action="append", help="ds-qwen-1.5b | ds-qwen-7b | ds-llama-8b (repeatable)")
    p.add_argument("--model", action="append", help="a model directory or hub id (only its config is read)")
    p.add_argument("--kind", default="bridge", choices=["bridge", "pmatch"])
    p.add_argument("--heads", type=int, default=4)
    p.set_defaults(func=_cmd_params)

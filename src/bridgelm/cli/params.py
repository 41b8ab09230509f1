"""bridgelm params: parameter counts by part (the paper's Appendix B)."""

from __future__ import annotations


def _cmd_params(args) -> None:
    from bridgelm.params import PRESETS, count, meta_model, table

    names = args.preset or ([] if args.model else list(PRESETS))
    rows = [count(meta_model(preset=p), p, args.add, args.num_heads) for p in names]
    rows += [count(meta_model(model_dir=m), m, args.add, args.num_heads) for m in args.model or []]
    print(table(rows))


def add_commands(sub) -> None:
    from bridgelm.blocks import KINDS, BlockConfig
    from bridgelm.cli.common import positive_int

    p = sub.add_parser("params", help="parameter counts by part (paper Appendix B), built on the meta device")
    p.add_argument("--preset", action="append", help="ds-qwen-1.5b | ds-qwen-7b | ds-llama-8b (repeatable)")
    p.add_argument("--model", action="append", help="a model directory or hub id (only its config is read)")
    p.add_argument("--add", default="bridge", choices=KINDS, help="the blocks counted (as plan, sft and rl --add)")
    p.add_argument("--num-heads", type=positive_int, default=BlockConfig.num_heads, help="heads of the blocks")
    p.set_defaults(func=_cmd_params)

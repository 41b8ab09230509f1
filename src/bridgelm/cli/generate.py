"""bridgelm generate: sample n interdependent responses per prompt into a resumable JSONL file."""

from __future__ import annotations

from bridgelm.cli.common import add_model_args, model_source, read_prompts, stop_string
from bridgelm.cli.fields import add_fields, build
from bridgelm.engine import SamplingConfig
from bridgelm.errors import UserError
from bridgelm.jsonl import check_out
from bridgelm.source import width_is_moot


def _cmd_generate(args) -> None:
    from bridgelm.jsonl import check_free
    from bridgelm.runs import local_source
    from bridgelm.samples import run_settings, sample_to_file

    cfg = build(SamplingConfig, args)
    cfg.validate()
    if (args.prompts is None) == (args.prompt is None):
        raise UserError("give exactly one of --prompts FILE.jsonl or --prompt TEXT")
    if args.prompt is not None and not args.prompt:
        raise UserError("--prompt is empty: expected the text of a prompt")
    check_out(args.out, "file")
    check_free(args.out, folder=False)  # another process writing it: refused before the model loads
    prompts = read_prompts(args.prompts) if args.prompts else [args.prompt]
    model, tokenizer = model_source(args).load()
    settings = run_settings(
        "generate", cfg, local_source(args.model), local_source(args.blocks), args.chat, stop=args.stop
    )
    print(f"bridgelm generate: {len(prompts)} prompts x {cfg.n} samples (width {cfg.width}) -> {args.out}")
    moot = width_is_moot(model)
    if moot and cfg.width > 1:
        print(f"bridgelm generate: note: {moot}, so width {cfg.width} samples like width 1: independently")
    source = f"--prompts {args.prompts}" if args.prompts else "--prompt"
    made = sample_to_file(model, tokenizer, prompts, args.out, cfg, settings, args.chat, args.stop, source=source)
    print(f"bridgelm generate: sampled {made} prompts now, {len(prompts) - made} were already in {args.out}")


def add_commands(sub) -> None:
    p = sub.add_parser("generate", help="sample n interdependent responses per prompt into a JSONL file")
    add_model_args(p)
    p.add_argument("--prompts", help="JSONL file, one object with a 'prompt' field per line")
    p.add_argument("--prompt", help="a single prompt")
    # foreign_groups is a control of evaluations (bridgelm eval --foreign-groups): a samples file does not record it
    add_fields(p, SamplingConfig, skip=["foreign_groups"])
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    p.add_argument("--stop", action="append", default=[], type=stop_string, help="stop string (repeatable)")
    p.add_argument("--out", required=True, help="output JSONL (one line per prompt; re-runs resume)")
    p.set_defaults(func=_cmd_generate)

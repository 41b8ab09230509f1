"""bridgelm generate: sample n interdependent responses per prompt into a resumable JSONL file."""

from __future__ import annotations

from bridgelm.cli.common import add_model_args, model_source, stop_string
from bridgelm.cli.fields import add_fields, build
from bridgelm.engine import SamplingConfig


def _cmd_generate(args) -> None:
    from bridgelm.samples import run_generate

    cfg = build(SamplingConfig, args)
    run_generate(cfg, model_source(args), args.out, args.prompts, args.prompt, args.chat, args.stop)


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

"""bridgelm plan: per-GPU memory of a GRPO run before it starts (the arithmetic is bridgelm.plan's), and the batch
bound that fills a rank's waves, with the `bridgelm rl` command that uses it.

    bridgelm plan --model M --world-size 8 --fsdp --gpu-memory-gib 80 --json
    bridgelm plan --preset ds-qwen-7b --world-size 8 --fsdp --max-new-tokens 4096 --gpu-memory-gib 80
"""

from __future__ import annotations

import argparse
import json

from bridgelm.blocks import KINDS, BlockConfig
from bridgelm.cli.common import block_heads, positive_int
from bridgelm.cli.fields import Nested, add_fields, build
from bridgelm.cli.train import RL_OPTIM_FLAGS, ROLLOUT_FLAGS, VALIDATION_FLAGS
from bridgelm.errors import UserError
from bridgelm.train.rl_config import RLConfig

# RLConfig's settings that decide the memory of a run (their flags are rl's own)
PLAN_FIELDS = [
    "prompts_per_step",
    "rollout",
    "rollout_dtype",
    "steps_per_rollout",
    "micro_batch_groups",
    "micro_batch_tokens",
    "beta",
    "freeze_base",
    "optim",
    "fsdp",
    "validation",
]

# How PLAN_FIELDS' nested configs become flags: as rl's, of the optimiser only what decides memory
PLAN_FLAGS = dict(
    rollout=ROLLOUT_FLAGS,
    validation=VALIDATION_FLAGS,
    optim=Nested(only=["bf16", "gradient_checkpointing"], flags=RL_OPTIM_FLAGS.flags),
)


def _gib(text: str) -> float:
    """argparse type of --gpu-memory-gib: a positive number."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of GiB")
    return value


def _model(args):
    """The model on the meta device, from --preset or --model's config.json, with --add blocks."""
    from bridgelm.attach import add_bridge, add_pmatch
    from bridgelm.params import PRESETS, meta_model

    if (args.preset is None) == (args.model is None):
        raise UserError("give one of --model and --preset: the model whose run is planned")
    if args.preset is not None and args.preset not in PRESETS:
        raise UserError(f"--preset {args.preset}: expected one of {', '.join(PRESETS)}")
    model = meta_model(preset=args.preset, model_dir=args.model)
    if args.add:
        (add_bridge if args.add == "bridge" else add_pmatch)(model, num_heads=block_heads(args))
    return model


def _cmd_plan(args) -> None:
    from bridgelm import plan, plan_fit
    from bridgelm.shape import shape_of

    cfg = build(RLConfig, args)
    if cfg.fsdp and args.world_size < 2:  # what rl says of --fsdp in one process, in plan's own flags
        raise UserError("--fsdp with --world-size 1: FSDP shards the model over several processes: expected "
                        "--world-size 2 or more, or no --fsdp")
    cfg.validate(args.world_size)
    block_heads(args)
    model = _model(args)  # which model first: the budget is asked for only once there is one to plan
    budget = args.gpu_memory_gib if args.gpu_memory_gib is not None else plan_fit.device_memory_gib()
    if budget is None:
        raise UserError("no CUDA device here to read the GPU's memory from: give it, e.g. --gpu-memory-gib 80")
    setup = plan.Setup(shape_of(model), cfg, args.world_size, args.dtype, args.prompt_tokens)
    rows = plan.plan_rows(setup)
    total = plan.per_gpu(rows) / plan.GIB
    print(plan_fit.table(setup, rows, budget))
    waves = plan_fit.filled_waves(setup, budget)
    print(_recommendation(args, waves, budget))
    if args.json:
        gib = {name: value / plan.GIB for name, value in rows.items()}
        phases = {name: value / plan.GIB for name, value in plan.phases(rows).items()}
        out = {"per_gpu_gib": total, "fits": total <= budget, "gpu_memory_gib": budget, "phases_gib": phases}
        print(json.dumps({**out, "rows_gib": gib, "recommended": _recommended_json(args, waves)}))


def _recommendation(args, waves, budget: float) -> str:
    """The batch bound that fills a rank's waves, in words, and the command that uses it."""
    if waves is None:
        return f"no batch bound fits {budget:g} GiB, not even with one prompt's rollouts a wave"
    s = waves.setup
    what = "one wave a rank" if waves.waves == 1 else f"{waves.waves} waves a rank, of whole prompts"
    line = f"{what}: {waves.rows} rows x {s.row_tokens} tokens, --max-batch-tokens {s.cfg.rollout.max_batch_tokens}"
    line += f" (peak {waves.peak_gib:.2f} GiB of {budget:g})"
    return line + "\nrecommended: " + " ".join(_command(args, s.cfg))


def _recommended_json(args, waves) -> dict | None:
    if waves is None:
        return None
    r = waves.setup.cfg.rollout
    bounds = {"max_batch_tokens": r.max_batch_tokens, "max_batch_sequences": r.max_batch_sequences}
    command = " ".join(_command(args, waves.setup.cfg))
    return {"waves": waves.waves, "rows": waves.rows, **bounds, "per_gpu_gib": waves.peak_gib, "command": command}


def _command(args, cfg: RLConfig) -> list[str]:
    """`bridgelm rl` with `cfg`'s memory settings that differ from rl's defaults (flags as rl spells them)."""
    launch = ["bridgelm", "rl"]
    if args.world_size > 1:
        launch = ["torchrun", "--nproc_per_node", str(args.world_size), "-m", "bridgelm", "rl"]
    words = [*launch, "--model", args.model or "MODEL", "--device", "cuda"]  # the plan is of GPUs: rl's default is cpu
    if args.add:
        words += ["--add", args.add]
        words += ["--num-heads", str(args.num_heads)] if block_heads(args) != BlockConfig.num_heads else []
    if args.dtype != "float32":
        words += ["--dtype", args.dtype]
    parser = argparse.ArgumentParser(add_help=False)
    add_fields(parser, RLConfig, only=PLAN_FIELDS, **PLAN_FLAGS)
    for action in parser._actions:
        value = cfg
        for part in action.dest.split("."):
            value = getattr(value, part)
        if value == action.default:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            words.append(action.option_strings[0 if value else 1])
        else:
            words += [action.option_strings[0], str(value)]
    return words + ["--task", "TASK", "--out", "OUT"]


def add_commands(sub) -> None:
    p = sub.add_parser("plan", help="per-GPU memory of an rl run before it starts (the model's config only)")
    p.add_argument("--model", help="a model directory or hub id (only its config.json is read)")
    p.add_argument("--preset", help="instead of --model: ds-qwen-1.5b | ds-qwen-7b | ds-llama-8b")
    p.add_argument("--add", choices=KINDS, help="count the blocks rl --add would add")
    p.add_argument("--num-heads", type=int, help=f"heads of the --add blocks (default: {BlockConfig.num_heads})")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="the weights'")
    p.add_argument("--world-size", type=positive_int, default=1, help="processes, one GPU each (default: 1)")
    p.add_argument("--prompt-tokens", type=positive_int, default=512, help="the longest prompt's tokens (default: 512)")
    p.add_argument("--gpu-memory-gib", type=_gib, help="memory of one GPU (default: this machine's first GPU's)")
    p.add_argument("--json", action="store_true", help="also one JSON object on the last line")
    add_fields(p, RLConfig, only=PLAN_FIELDS, **PLAN_FLAGS)
    p.set_defaults(func=_cmd_plan)

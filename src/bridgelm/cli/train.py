"""bridgelm warmup-data / sft / rl: the training stages (argument parsing only; each calls bridgelm.launch).

bridgelm warmup-data --model M --task gsm8k --data train.jsonl --n 8 --out warmup.jsonl
bridgelm sft --model M --add bridge --data warmup.jsonl --out sft_run
bridgelm rl --model M --blocks sft_run/blocks.safetensors --task gsm8k --data train.jsonl --out rl_run
torchrun --nproc_per_node 2 -m bridgelm rl ...   (data parallel; add --fsdp to shard the model)
bridgelm consolidate rl_run/checkpoints/step-00000300 --out rl_run_step300   (an --fsdp checkpoint as a model folder)
"""

from __future__ import annotations

import argparse
import sys

from bridgelm.blocks import KINDS, PLACEMENTS, BlockConfig
from bridgelm.cli.common import add_model_args, add_num_samples, add_threads_arg, block_heads, model_source
from bridgelm.cli.fields import Flag, Nested, add_fields, add_groups, build
from bridgelm.cli.fit import fit_steps_per_rollout, flag_names, flag_words
from bridgelm.dist import Dist, DistConfig
from bridgelm.engine import SamplingConfig
from bridgelm.errors import UserError
from bridgelm.grpo import ADVANTAGES
from bridgelm.source import TaskSource, refuse_split_of_file
from bridgelm.train import warmup_data
from bridgelm.train.rl_config import RLConfig
from bridgelm.train.set_rewards import REWARDS
from bridgelm.train.sft import SFTConfig


VAL_SPLIT = "test"  # --val-split's default

SPLIT_HELP = "split read from a data folder (FOLDER/SPLIT.jsonl) or the hub's copy (default: %(default)s)"
SPLIT = "train"  # --split's default


def _task_source(name: str, data: str | None, split: str, default: str, flags=("--split", "--data")) -> TaskSource:
    """The TaskSource of the flags; a split other than the default beside a data file is refused (it was ignored,
    silently), as eval refuses it."""
    refuse_split_of_file(split, default, data, flags)
    return TaskSource(name, data, split)


def _cmd_warmup_data(args) -> None:
    from bridgelm.launch import run_warmup_data

    sampling, task = build(SamplingConfig, args, width=1), _task_source(args.task, args.data, args.split, SPLIT)
    with flag_words({"n": "--n", "limit": "--limit"}):
        run_warmup_data(model_source(args), task, args.out, args.n, sampling, args.chat, args.limit)


def _cmd_sft(args) -> None:
    from bridgelm.launch import run_sft

    cfg, launch = build(SFTConfig, args), build(DistConfig, args)
    with flag_words(args.flags):
        run_sft(cfg, launch, model_source(args), args.data, args.out)


def _refuse_contradictions(args) -> None:
    """Flags that contradict each other or that nothing would read: refused as the command line is read (settings
    of RLConfig that nothing would read are run_rl's to refuse)."""
    block_heads(args)
    if not args.val_task and (args.val_data is not None or args.val_split != VAL_SPLIT):
        given = f"--val-data {args.val_data}" if args.val_data is not None else f"--val-split {args.val_split}"
        raise UserError(f"{given} is read only with --val-task (the task to validate on): expected --val-task "
                        "TASK, or no validation settings")
    if args.placement and not args.add:
        raise UserError(f"--placement {args.placement} is read only with --add (where the blocks it adds sit): "
                        "expected --add bridge or --add pmatch, or no --placement")
    if args.blocks and (args.no_blocks or args.add):
        flag = "--no-blocks" if args.no_blocks else f"--add {args.add}"
        raise UserError(f"--blocks {args.blocks} and {flag} contradict each other: expected one of them")


def _cmd_rl(args) -> None:
    from bridgelm.launch import run_rl

    cfg, launch = build(RLConfig, args), build(DistConfig, args)
    here = Dist.from_env()
    cfg = fit_steps_per_rollout(cfg, args, here.world, say=here.is_main)
    with flag_words(args.flags):  # a refused setting of RLConfig in the words of its flag (--steps-per-rollout 8)
        _refuse_contradictions(args)
        task = _task_source(args.task, args.data, args.split, SPLIT)
        val = None
        if args.val_task:
            val = _task_source(args.val_task, args.val_data, args.val_split, VAL_SPLIT, ("--val-split", "--val-data"))
        if val is not None and val.split == "test" and args.val_data is None and here.is_main:
            print(f"bridgelm rl: note: the best checkpoint (best/) is chosen on {val.name}'s test split (the paper's protocol): "
                  "its score on that split is optimistic; --val-split validation (where the task has one) or a "
                  "held-out --val-data keeps the test split for the final evaluation", file=sys.stderr)
        run_rl(cfg, launch, model_source(args), task, args.out, val_task=val, add=args.add,
               num_heads=block_heads(args), no_blocks=args.no_blocks, placement=args.placement)


# rl --help shows RLConfig's flags in these groups.
RL_GROUPS = {
    "run": ["steps", "prompts_per_step", "chat", "seed"],
    "rollouts (sampling)": ["rollout", "rollout_dtype", "reward", "sibling_weight", "advantage"],
    "update (optimiser)": [
        "steps_per_rollout",
        "epochs_per_rollout",
        "micro_batch_groups",
        "micro_batch_tokens",
        "optim",
        "block_lr",
        "clip_eps",
        "clip_eps_high",
        "beta",
        "freeze_base",
        "fsdp",
    ],
    "LoRA of the base (peft: pip install 'bridgelm[lora]')": ["lora"],
    "validation (with --val-task)": ["eval_every", "validation"],
    "run control": ["run"],
}
# RLConfig.rollout's flags keep the names of the sampling settings, but n: --rollouts (G).
ROLLOUT_FLAGS = Nested(
    skip=["top_k", "seed", "compact_fraction", "foreign_groups", "compile", "pack_weights"],
    flags={
        "n": Flag("--rollouts", help="G, rollouts per prompt: the GRPO group (paper: 8)"),
        "width": Flag(help="w, Bridge group width while sampling; divides G (paper: 4 or 8)"),
        "max_new_tokens": Flag(help="tokens per rollout, at most (paper: 4096)"),
        "temperature": Flag(help="sampling temperature; log-probs use logits / temperature as well"),
        "top_p": Flag(help="nucleus of the rollouts (1: exactly the policy the ratios assume)"),
    },
)
# RLConfig.optim's flags: --lr, --warmup-fraction, ... (their own names), told as GRPO's update uses them
RL_OPTIM_FLAGS = Nested(
    flags={
        "lr": Flag(help="AdamW learning rate after warm-up (constant)"),
        "bf16": Flag(help="bf16 autocast of the training forwards; with fsdp, mixed precision (bf16 compute, fp32 "
                          "master weights and reductions) where the device has bf16, and rollouts from a bf16 copy "
                          "(rollout_dtype's default) (paper: on)"),
    },
)
# RLConfig.run's flags: --save-every, --keep-last, --resume, --progress, --tensorboard
RL_RUN_FLAGS = Nested(flags={"keep_last": Flag(help="checkpoints kept, best/ apart (0: all)")})
# SFTConfig.run's flags, the same names
SFT_RUN_FLAGS = Nested(
    flags={
        "save_every": Flag(help="optimiser steps between resumable checkpoints (0: at the end of each epoch)"),
        "keep_last": Flag(help="resumable checkpoints kept (0: all)"),
    },
)
# RLConfig.lora's and SFTConfig.lora's flags: --lora-r, --lora-alpha, --lora-targets
LORA_FLAGS = Nested(prefix="lora-")
# RLConfig.validation's flags: --eval-n, --eval-width, ...
VALIDATION_FLAGS = Nested(
    prefix="eval-",
    only=["sampling", "limit"],
    flags={
        "sampling": Nested(
            only=["n", "width", "max_new_tokens", "temperature", "top_p"],
            flags={
                "n": Flag(help="samples per validation problem (paper: 4 on MATH-500, every 100 optimiser steps)"),
                "width": Flag(help="Bridge width of validation sampling (divides --eval-n)"),
                "max_new_tokens": Flag(help="tokens per validation sample, at most (None: --max-new-tokens)"),
                "temperature": Flag(help="validation sampling temperature (paper: 0.6)"),
                "top_p": Flag(help="validation nucleus (paper: 0.95)"),
            },
        ),
        "limit": Flag(help="first problems of the val_task to use (None: all)"),
    },
)


def _cmd_consolidate(args) -> None:
    from bridgelm.train.consolidate import consolidate

    out = consolidate(args.checkpoint, args.out, args.model)
    print(f"bridgelm consolidate: the model of {args.checkpoint} is {out} (a folder for --model)")


def add_commands(sub) -> None:
    """Register warmup-data, sft, rl and consolidate on `sub`."""
    _add_warmup_data(sub)
    _add_sft(sub)
    _add_rl(sub)
    _add_consolidate(sub)


def _add_consolidate(sub) -> None:
    p = sub.add_parser("consolidate", help="an --fsdp run's checkpoint (each rank's shards) as one model folder")
    p.add_argument("checkpoint", help="RUN/checkpoints/step-N of an rl run with --fsdp")
    p.add_argument("--out", required=True, help="the model folder to write (a new folder)")
    p.add_argument("--model", help="the run's base model, where it has moved (default: the one the run recorded)")
    p.set_defaults(func=_cmd_consolidate)


def _add_warmup_data(sub) -> None:
    p = sub.add_parser("warmup-data", help="sample, grade and filter the base model's answers for SFT warm-up")
    add_model_args(p)
    p.add_argument("--task", required=True, help="gsm8k, math, countdown, ...")
    p.add_argument("--data", help="local data file/folder (default: the task's own source)")
    p.add_argument("--split", default=SPLIT, help=SPLIT_HELP)
    add_fields(
        p,
        SamplingConfig,
        skip=["width", "foreign_groups"],  # independent answers: width 1
        n=Flag(help="responses sampled per problem"),
        # not the sampling config's default: warm-up answers may be long worked solutions (make_warmup_data's own)
        max_new_tokens=Flag(default=warmup_data.MAX_NEW_TOKENS),
    )
    add_num_samples(p, "n")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    p.add_argument("--limit", type=int, help="first problems only")
    p.add_argument("--out", required=True, help="warm-up JSONL (re-runs resume; torchrun: ranks' parts beside it)")
    p.set_defaults(func=_cmd_warmup_data)


def _add_sft(sub) -> None:
    p = sub.add_parser("sft", help="SFT warm-up of new Bridge/P-Match blocks on warm-up data (base frozen)")
    p.add_argument("--model", required=True, help="base model directory or hub id")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    add_threads_arg(p)
    p.add_argument("--data", required=True, help="warm-up JSONL from bridgelm warmup-data")
    add_fields(
        p,
        SFTConfig,
        blocks=Flag("--add", choices=KINDS, help="kind of blocks to add and warm up"),
        placement=Flag(choices=PLACEMENTS),
        optim=Nested(),
        run=SFT_RUN_FLAGS,
        lora=LORA_FLAGS,
    )
    p.add_argument("--out", required=True, help="run directory: metrics.jsonl, checkpoints/, blocks.safetensors")
    add_fields(p.add_argument_group("distributed (torchrun)"), DistConfig)
    # LoRA's refusals in the words of its flags; sft's other messages name its settings
    p.set_defaults(func=_cmd_sft, flags={k: v for k, v in flag_names(p).items() if k.startswith("lora_")})


def _add_rl(sub) -> None:
    p = sub.add_parser("rl", help="GRPO with interdependent rollouts (Bridge groups of width w)")
    add_model_args(p)
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--add", choices=KINDS, help="add fresh (zero-contribution) blocks")
    kind.add_argument("--no-blocks", action="store_true", help="plain GRPO; refuses a model with blocks")
    p.add_argument("--num-heads", type=int, help=f"heads of blocks added with --add (default: {BlockConfig.num_heads})")
    p.add_argument("--placement", choices=PLACEMENTS, help=f"where blocks added with --add sit (default: "
                   f"{BlockConfig.placement}: after each feed-forward block; attn: after each attention block)")
    p.add_argument("--task", required=True)
    p.add_argument("--data", help="training data file/folder")
    p.add_argument("--split", default=SPLIT, help=SPLIT_HELP)
    p.add_argument("--val-task", help="validation task (periodic accuracy; best checkpoint kept)")
    p.add_argument("--val-data")
    p.add_argument("--val-split", default=VAL_SPLIT)
    p.add_argument("--out", required=True, help="run directory: metrics.jsonl, checkpoints/, best/")
    reward, advantage = Flag(choices=REWARDS), Flag(choices=ADVANTAGES)
    steps = Flag(default=argparse.SUPPRESS, help=f"K: optimiser steps per rollout batch, on K mini-batches of whole "
                 f"groups (default: {RLConfig.steps_per_rollout}, or the Bridge groups a rank holds when fewer)")
    groups = dict(rollout=ROLLOUT_FLAGS, validation=VALIDATION_FLAGS, lora=LORA_FLAGS, optim=RL_OPTIM_FLAGS,
                  run=RL_RUN_FLAGS, reward=reward, advantage=advantage)
    before = flag_names(p)
    add_groups(p, RLConfig, RL_GROUPS, steps_per_rollout=steps, **groups)
    settings = {k: v for k, v in flag_names(p).items() if k not in before}  # RLConfig's refusals, in flag words
    add_fields(p.add_argument_group("distributed (torchrun)"), DistConfig)
    p.set_defaults(func=_cmd_rl, flags=settings)

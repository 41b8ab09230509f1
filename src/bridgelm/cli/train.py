"""bridgelm warmup-data / sft / rl: the training stages (argument parsing only; the work is in bridgelm.train).

bridgelm warmup-data --model M --task gsm8k --data train.jsonl --n 8 --out warmup.jsonl
bridgelm sft --model M --add bridge --data warmup.jsonl --out sft_run
bridgelm rl --model M --blocks sft_run/blocks.safetensors --task gsm8k --data train.jsonl --out rl_run
torchrun --nproc_per_node 2 -m bridgelm rl ...   (data parallel; add --fsdp to shard the model)
"""

from __future__ import annotations

import argparse
import functools
import os

from bridgelm.blocks import KINDS, PLACEMENTS, BlockConfig
from bridgelm.cli.common import (
    add_model_args,
    add_threads_arg,
    block_heads,
    check_out,
    load_model_and_tokenizer,
    load_model_of,
    load_tokenizer,
    warn_slow_bf16,
)
from bridgelm.cli.fields import Flag, Nested, add_fields, add_groups, build
from bridgelm.cli.fit import fit_steps_per_rollout, flag_names, in_flags
from bridgelm.dist import Dist, DistConfig
from bridgelm.errors import UserError
from bridgelm.engine import SamplingConfig
from bridgelm.grpo import ADVANTAGES
from bridgelm.train import warmup_data
from bridgelm.train.rl_config import RLConfig
from bridgelm.train.set_rewards import REWARDS
from bridgelm.train.sft import SFTConfig


VAL_SPLIT = "test"  # --val-split's default


def _main_process() -> bool:
    """Under torchrun only rank 0 reports."""
    return os.environ.get("RANK", "0") == "0"


def _load_task(name: str, path: str | None, split: str):
    from bridgelm import tasks

    return tasks.load(name, path, split=split)


def _cmd_warmup_data(args) -> None:
    from bridgelm.runs import local_source
    from bridgelm.train.warmup_data import make_warmup_data, warmup_sampling

    sampling = build(SamplingConfig, args, width=1)
    try:
        warmup_sampling(args.n, sampling, args.limit)  # before the model loads
    except UserError as err:
        raise in_flags(err, {"n": "--n", "limit": "--limit"}) from err
    check_out(args.out, "file")
    if Dist.from_env().world > 1:
        raise UserError(
            "warmup-data runs in one process: it does not shard problems, and each torchrun rank would sample every "
            "problem into the same file; run it without torchrun"
        )
    task = _load_task(args.task, args.data, args.split)
    model, tokenizer = load_model_and_tokenizer(args)
    count = len(task.examples) if args.limit is None else min(args.limit, len(task.examples))
    print(f"bridgelm warmup-data: {count} problems x {args.n} samples -> {args.out}")
    stats = make_warmup_data(
        model, tokenizer, task, args.out, args.n, sampling, args.chat, args.limit, blocks=local_source(args.blocks)
    )
    cut = f", {stats['cut']} correct but cut by --max-new-tokens and left out" if stats["cut"] else ""
    print(
        f"bridgelm warmup-data: {stats['kept']} problems kept with {stats['responses']} correct responses, "
        f"{stats['dropped']} dropped{cut}; accuracy over all samples {stats['accuracy']:.3f}; in {args.out}"
    )


def _join(model, launch: DistConfig) -> None:
    """Join torchrun's process group (when launched so) with --dist-timeout; the trainer then uses that group."""
    from bridgelm.dist import setup_distributed

    setup_distributed(next(model.parameters()).device, launch.dist_timeout)


def _cmd_sft(args) -> None:
    from bridgelm import plan
    from bridgelm.dist import teardown_distributed
    from bridgelm.tokenizer import check_vocab
    from bridgelm.train.sft import ensure_blocks, train_sft
    from bridgelm.warmup_file import read_warmup

    cfg, launch = build(SFTConfig, args), build(DistConfig, args)
    try:
        cfg.lora.validate()  # in flag words (sft's other messages name its settings)
    except ValueError as err:
        raise in_flags(err, args.flags) from err
    cfg.validate()
    launch.validate()
    check_out(args.out, "dir")
    warn_slow_bf16(cfg.optim.bf16, args.device, "--bf16")
    read_warmup(args.data)  # a bad file is refused before the model loads (train_sft reads it again, with the model)
    _need_peft(cfg.lora)
    model = ensure_blocks(load_model_of(args, None), cfg)  # --add's blocks (train_sft keeps them), for the plan
    _check_lora_targets(model, cfg.lora, args)
    tokenizer = load_tokenizer(args.model)
    check_vocab(model, tokenizer, args.model)
    device = next(model.parameters()).device
    _plan_or_refuse(device, "sft", lambda: plan.SFTSetup(plan.shape_of(model), cfg, Dist.from_env().world, args.dtype))
    try:
        _join(model, launch)
        res = train_sft(model, tokenizer, args.data, cfg, args.out)
        if not _main_process():
            return
        if res.best_val_ppl is not None:
            print(f"bridgelm sft: best validation perplexity {res.best_val_ppl:.3f} (epoch {res.best_epoch})")
        what = "model (LoRA merged, blocks; a folder for --model)" if cfg.lora.enabled else "blocks"
        print(f"bridgelm sft: {what} in {res.blocks_path}, metrics in {res.out_dir / 'metrics.jsonl'}")
    finally:
        teardown_distributed()


def _need_peft(settings) -> None:
    """With --lora-r: peft installed, checked before the model loads."""
    if settings.enabled:
        from bridgelm.lora import require_peft

        require_peft()


def _check_lora_targets(model, settings, args) -> None:
    """With --lora-r: every --lora-targets name a module of the loaded base (outside the blocks), in flag words."""
    if settings.enabled:
        from bridgelm.lora import check_targets

        try:
            check_targets(model, settings)
        except ValueError as err:
            raise in_flags(err, {"lora_targets": "--lora-targets"}) from err


def _plan_or_refuse(device, command: str, make_setup) -> None:
    """On a CUDA device: the run's per-GPU memory plan (`make_setup()`, a bridgelm.plan setup; rank 0 prints it), and
    a run that cannot fit refused, with the numbers, before it starts."""
    from bridgelm import plan_fit

    budget = plan_fit.device_memory_gib(device)
    if budget is None:  # not a GPU: nothing to plan against
        return
    text = plan_fit.check_fits(make_setup(), budget)
    if _main_process():
        print(f"bridgelm {command}: memory per GPU (bridgelm plan)\n{text}")


def _rl_setup(model, tokenizer, task, cfg: RLConfig, dtype: str):
    """The plan's setup of an rl run; its prompts' length is the task's longest prompt."""
    from bridgelm import plan
    from bridgelm.engine import encode_prompts

    prompts = encode_prompts(tokenizer, [task.prompt(ex) for ex in task.examples], cfg.chat)
    return plan.Setup(plan.shape_of(model), cfg, Dist.from_env().world, dtype, max(map(len, prompts)))


def _refuse_unread_validation(args, cfg: RLConfig) -> None:
    """--val-data, --val-split and the --eval-* settings are read only with --val-task: given without it, refused."""
    if args.val_task:
        return
    given = [f"--val-data {args.val_data}"] if args.val_data is not None else []
    given += [f"--val-split {args.val_split}"] if args.val_split != VAL_SPLIT else []
    for dest, value in vars(args).items():  # the --eval-* flags' dests: "validation.limit", "validation.sampling.n"
        path = dest.split(".")
        if path[0] == "validation" and value != functools.reduce(getattr, path, RLConfig()):
            given.append(f"--eval-{path[-1].replace('_', '-')} {value}")
    if given:
        raise UserError(f"{given[0]} is read only with --val-task (the task to validate on): expected --val-task "
                        "TASK, or no validation settings")


def _cmd_rl(args) -> None:
    import bridgelm
    from bridgelm.attach import add_seeded_blocks
    from bridgelm.dist import teardown_distributed
    from bridgelm.rng import derive_seed
    from bridgelm.train.rl import train_rl

    cfg, launch = build(RLConfig, args), build(DistConfig, args)
    world = Dist.from_env().world
    cfg = fit_steps_per_rollout(cfg, args, world, say=_main_process())
    try:
        cfg.validate(world)  # the launch's processes: refused before any model loads
    except ValueError as err:
        raise in_flags(err, args.flags) from err
    launch.validate()
    if args.no_blocks and cfg.block_lr is not None:
        raise UserError(f"--block-lr {cfg.block_lr} with --no-blocks: there are no blocks to train at that rate")
    block_heads(args)
    _refuse_unread_validation(args, cfg)
    if args.blocks and (args.no_blocks or args.add):
        flag = "--no-blocks" if args.no_blocks else f"--add {args.add}"
        raise UserError(f"--blocks {args.blocks} and {flag} contradict each other: expected one of them")
    check_out(args.out, "dir")
    _need_peft(cfg.lora)
    task = _load_task(args.task, args.data, args.split)
    val_task = _load_task(args.val_task, args.val_data, args.val_split) if args.val_task else None
    warn_slow_bf16(cfg.optim.bf16, args.device, "--bf16")
    warn_slow_bf16(cfg.rollout_dtype == "bfloat16", args.device, "--rollout-dtype bfloat16")
    model, tokenizer = load_model_and_tokenizer(args)
    have = bridgelm.block_config(model)
    if args.no_blocks and have is not None:
        raise UserError(f"--no-blocks, but {args.model} holds {have.kind} blocks; load a model without blocks")
    if args.add:  # the same blocks on every rank and on every --resume
        add_seeded_blocks(model, args.add, derive_seed(args.seed, "rl-blocks"), num_heads=block_heads(args))
    _check_lora_targets(model, cfg.lora, args)
    device = next(model.parameters()).device
    _plan_or_refuse(device, "rl", lambda: _rl_setup(model, tokenizer, task, cfg, args.dtype))
    try:
        _join(model, launch)
        res = train_rl(model, tokenizer, task, cfg, args.out, val_task=val_task)
        if not _main_process():
            return
        print(f"bridgelm rl: {res.steps} steps; the trained model is {res.final_dir} (a folder for --model)")
        if res.best_dir is not None:
            best = f"{res.best_accuracy:.3f} (step {res.best_step})"
            print(f"bridgelm rl: best validation accuracy {best} in {res.best_dir}")
    finally:
        teardown_distributed()


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
        "max_new_tokens": Flag(help="tokens per rollout, at most"),
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
                          "(rollout_dtype's default)"),
    },
)
# RLConfig.run's flags: --save-every, --keep-last, --resume, --progress, --tensorboard
RL_RUN_FLAGS = Nested(flags={"keep_last": Flag(help="checkpoints kept (best/ is kept apart)")})
# SFTConfig.run's flags, the same names
SFT_RUN_FLAGS = Nested(
    flags={
        "save_every": Flag(help="optimiser steps between resumable checkpoints (0: at the end of each epoch)"),
        "keep_last": Flag(help="resumable checkpoints kept"),
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
                "n": Flag(help="samples per validation problem (paper: 4 on MATH-500)"),
                "width": Flag(help="Bridge width of validation sampling (divides --eval-n)"),
                "max_new_tokens": Flag(help="tokens per validation sample, at most (None: --max-new-tokens)"),
                "temperature": Flag(help="validation sampling temperature (paper: 0.6)"),
                "top_p": Flag(help="validation nucleus (paper: 0.95)"),
            },
        ),
        "limit": Flag(help="first problems of the val_task to use (None: all)"),
    },
)


def add_commands(sub) -> None:
    """Register warmup-data, sft and rl on `sub`."""
    _add_warmup_data(sub)
    _add_sft(sub)
    _add_rl(sub)


def _add_warmup_data(sub) -> None:
    p = sub.add_parser("warmup-data", help="sample, grade and filter the base model's answers for SFT warm-up")
    add_model_args(p)
    p.add_argument("--task", required=True, help="gsm8k, math, countdown, ...")
    p.add_argument("--data", help="local data file/folder (default: the task's own source)")
    p.add_argument("--split", default="train")
    add_fields(
        p,
        SamplingConfig,
        skip=["width", "foreign_groups"],  # independent answers: width 1
        n=Flag(help="responses sampled per problem"),
        # not the sampling config's default: warm-up answers may be long worked solutions (make_warmup_data's own)
        max_new_tokens=Flag(default=warmup_data.MAX_NEW_TOKENS),
    )
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    p.add_argument("--limit", type=int, help="first problems only")
    p.add_argument("--out", required=True, help="warm-up JSONL (re-runs resume)")
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
    p.set_defaults(func=_cmd_sft, flags=flag_names(p))


def _add_rl(sub) -> None:
    p = sub.add_parser("rl", help="GRPO with interdependent rollouts (Bridge groups of width w)")
    add_model_args(p)
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--add", choices=KINDS, help="add fresh (zero-contribution) blocks")
    kind.add_argument("--no-blocks", action="store_true", help="plain GRPO; refuses a model with blocks")
    p.add_argument("--num-heads", type=int, help=f"heads of blocks added with --add (default: {BlockConfig.num_heads})")
    p.add_argument("--task", required=True)
    p.add_argument("--data", help="training data file/folder")
    p.add_argument("--split", default="train")
    p.add_argument("--val-task", help="validation task (periodic accuracy; best checkpoint kept)")
    p.add_argument("--val-data")
    p.add_argument("--val-split", default=VAL_SPLIT)
    p.add_argument("--out", required=True, help="run directory: metrics.jsonl, checkpoints/, best/")
    reward, advantage = Flag(choices=REWARDS), Flag(choices=ADVANTAGES)
    steps = Flag(default=argparse.SUPPRESS, help=f"K: optimiser steps per rollout batch, on K mini-batches of whole "
                 f"groups (default: {RLConfig.steps_per_rollout}, or the Bridge groups a rank holds when fewer)")
    groups = dict(rollout=ROLLOUT_FLAGS, validation=VALIDATION_FLAGS, lora=LORA_FLAGS, optim=RL_OPTIM_FLAGS,
                  run=RL_RUN_FLAGS, reward=reward, advantage=advantage)
    add_groups(p, RLConfig, RL_GROUPS, steps_per_rollout=steps, **groups)
    add_fields(p.add_argument_group("distributed (torchrun)"), DistConfig)
    p.set_defaults(func=_cmd_rl, flags=flag_names(p))

"""bridgelm warmup-data / sft / rl: the training stages (argument parsing only; the work is in bridgelm.train).

bridgelm warmup-data --model M --task gsm8k --data train.jsonl --n 8 --out warmup.jsonl
bridgelm sft --model M --add bridge --data warmup.jsonl --out sft_run
bridgelm rl --model M --blocks sft_run/blocks.safetensors --task gsm8k --data train.jsonl --out rl_run
torchrun --nproc_per_node 2 -m bridgelm rl ...   (data parallel; add --fsdp to shard the model)
"""

from __future__ import annotations

import argparse
import os

from bridgelm.cli.common import add_model_args, check_out, dtype_of, load_model_and_tokenizer, load_tokenizer
from bridgelm.errors import UserError


def _main_process() -> bool:
    """Under torchrun only rank 0 reports."""
    return os.environ.get("RANK", "0") == "0"


def _load_task(name: str, path: str | None, split: str):
    from bridgelm import tasks

    return tasks.load(name, path, split=split)


def _cmd_warmup_data(args) -> None:
    from bridgelm.sampling import SamplingConfig
    from bridgelm.train.warmup_data import make_warmup_data

    sampling = SamplingConfig(
        n=args.n,
        width=1,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        max_batch_sequences=args.max_batch_sequences,
        max_batch_tokens=args.max_batch_tokens,
    )
    sampling.validate()
    check_out(args.out, "file")
    task = _load_task(args.task, args.data, args.split)
    model, tokenizer = load_model_and_tokenizer(args)
    print(f"bridgelm warmup-data: {args.limit or len(task.examples)} problems x {args.n} samples -> {args.out}")
    stats = make_warmup_data(model, tokenizer, task, args.out, args.n, sampling, args.chat, args.limit)
    print(
        f"bridgelm warmup-data: {stats['kept']} problems kept, {stats['dropped']} dropped, "
        f"{stats['responses']} correct responses (accuracy {stats['accuracy']:.3f}) in {args.out}"
    )


def _cmd_sft(args) -> None:
    from bridgelm.attach import load_model
    from bridgelm.dist import teardown_distributed
    from bridgelm.train.sft import SFTConfig, train_sft

    if args.blocks is not None:  # `--blocks` is a file path everywhere else; here it was the kind to add
        raise UserError(
            f"bridgelm sft takes the kind of blocks to add as --add {args.blocks} (--blocks is a block file in the "
            "other commands)"
        )
    cfg = SFTConfig(
        blocks=args.add,
        num_heads=args.num_heads,
        placement=args.placement,
        epochs=args.epochs,
        lr=args.lr,
        warmup_fraction=args.warmup_fraction,
        weight_decay=args.weight_decay,
        batch_groups=args.batch_groups,
        micro_batch_groups=args.micro_batch_groups,
        min_width=args.min_width,
        max_width=args.max_width,
        max_length=args.max_length,
        val_fraction=args.val_fraction,
        val_count=args.val_count,
        max_grad_norm=args.max_grad_norm,
        bf16=args.bf16,
        gradient_checkpointing=args.gradient_checkpointing,
        seed=args.seed,
        save_every=args.save_every,
        keep_last=args.keep_last,
        resume=args.resume,
        tensorboard=args.tensorboard,
    )
    cfg.validate()
    check_out(args.out, "dir")
    model = load_model(args.model, dtype=dtype_of(args.dtype), device=args.device)
    tokenizer = load_tokenizer(args.model)
    try:
        res = train_sft(model, tokenizer, args.data, cfg, args.out)
        if not _main_process():
            return
        if res.best_val_ppl is not None:
            print(f"bridgelm sft: best validation perplexity {res.best_val_ppl:.3f} (epoch {res.best_epoch})")
        print(f"bridgelm sft: blocks in {res.blocks_path}, metrics in {res.out_dir / 'metrics.jsonl'}")
    finally:
        teardown_distributed()


def _rl_config(args):
    from bridgelm.train.rl import RLConfig

    cfg = RLConfig(
        steps=args.steps,
        prompts_per_step=args.prompts_per_step,
        rollouts=args.rollouts,
        width=args.width,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        steps_per_rollout=args.steps_per_rollout,
        epochs_per_rollout=args.epochs_per_rollout,
        micro_batch_groups=args.micro_batch_groups,
        lr=args.lr,
        warmup_fraction=args.warmup_fraction,
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm,
        clip_eps=args.clip_eps,
        clip_eps_high=args.clip_eps_high,
        beta=args.beta,
        freeze_base=args.freeze_base,
        block_lr=args.block_lr,
        bf16=args.bf16,
        gradient_checkpointing=args.gradient_checkpointing,
        fsdp=args.fsdp,
        chat=args.chat,
        seed=args.seed,
        max_batch_sequences=args.max_batch_sequences,
        max_batch_tokens=args.max_batch_tokens,
        eval_every=args.eval_every,
        eval_n=args.eval_n,
        eval_width=args.eval_width,
        eval_limit=args.eval_limit,
        eval_max_new_tokens=args.eval_max_new_tokens,
        save_every=args.save_every,
        keep_last=args.keep_last,
        resume=args.resume,
        tensorboard=args.tensorboard,
    )
    cfg.validate()
    return cfg


def _cmd_rl(args) -> None:
    import bridgelm
    from bridgelm.dist import teardown_distributed
    from bridgelm.rng import derive_seed
    from bridgelm.train.rl import train_rl

    cfg = _rl_config(args)
    if args.blocks and (args.no_blocks or args.add):
        flag = "--no-blocks" if args.no_blocks else f"--add {args.add}"
        raise UserError(f"--blocks {args.blocks} and {flag} contradict each other: expected one of them")
    check_out(args.out, "dir")
    task = _load_task(args.task, args.data, args.split)
    val_task = _load_task(args.val_task, args.val_data, args.val_split) if args.val_task else None
    model, tokenizer = load_model_and_tokenizer(args)
    have = bridgelm.block_config(model)
    if args.no_blocks and have is not None:
        raise ValueError(f"--no-blocks, but {args.model} holds {have.kind} blocks; load a model without blocks")
    if args.add:
        import torch

        add = bridgelm.add_bridge if args.add == "bridge" else bridgelm.add_pmatch
        with torch.random.fork_rng(devices=[]):  # same blocks on every rank and on every --resume
            torch.manual_seed(derive_seed(args.seed, "rl-blocks"))
            add(model, num_heads=args.num_heads)
    try:
        res = train_rl(model, tokenizer, task, cfg, args.out, val_task=val_task)
        if not _main_process():
            return
        print(f"bridgelm rl: {res.steps} steps; last checkpoint {res.final_dir}")
        if res.best_dir is not None:
            best = f"{res.best_accuracy:.3f} (step {res.best_step})"
            print(f"bridgelm rl: best validation accuracy {best} in {res.best_dir}")
    finally:
        teardown_distributed()


def _add_run_args(p, save_every: int) -> None:
    p.add_argument("--out", required=True, help="run directory: metrics.jsonl, checkpoints/, ...")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast of the training forwards")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--warmup-fraction", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--save-every", type=int, default=save_every, help="steps between checkpoints (0: end only)")
    p.add_argument("--keep-last", type=int, default=2, help="checkpoints kept")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--tensorboard", action="store_true", help="also log to OUT/tensorboard")


def add_commands(sub) -> None:
    """Register warmup-data, sft and rl on `sub`."""
    p = sub.add_parser("warmup-data", help="sample, grade and filter the base model's answers for SFT warm-up")
    add_model_args(p)
    p.add_argument("--task", required=True, help="gsm8k, math, countdown, ...")
    p.add_argument("--data", help="local data file/folder (default: the task's own source)")
    p.add_argument("--split", default="train")
    p.add_argument("--n", type=int, default=8, help="responses sampled per problem")
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-batch-sequences", type=int, default=256)
    p.add_argument("--max-batch-tokens", type=int, default=262_144)
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    p.add_argument("--limit", type=int, help="first problems only")
    p.add_argument("--out", required=True, help="warm-up JSONL (re-runs resume)")
    p.set_defaults(func=_cmd_warmup_data)

    p = sub.add_parser("sft", help="SFT warm-up of new Bridge/P-Match blocks on warm-up data (base frozen)")
    p.add_argument("--model", required=True, help="base model directory or hub id")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--add", default="bridge", choices=["bridge", "pmatch"], help="kind of blocks to add and warm up")
    p.add_argument("--blocks", help=argparse.SUPPRESS)  # the old spelling of --add: refused with a message
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--placement", default="ffn", choices=["ffn", "attn"])
    p.add_argument("--data", required=True, help="warm-up JSONL from bridgelm warmup-data")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--batch-groups", type=int, default=8, help="groups per optimiser step (all ranks)")
    p.add_argument("--micro-batch-groups", type=int, default=8, help="groups per forward on a rank")
    p.add_argument("--min-width", type=int, default=2)
    p.add_argument("--max-width", type=int, default=4)
    p.add_argument("--max-length", type=int, default=2048, help="prompt + response tokens per row")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--val-count", type=int, help="held-out problems (overrides --val-fraction)")
    _add_run_args(p, save_every=0)
    p.set_defaults(func=_cmd_sft)

    p = sub.add_parser("rl", help="GRPO with interdependent rollouts (Bridge groups of width w)")
    add_model_args(p)
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--add", choices=["bridge", "pmatch"], help="add fresh (zero-contribution) blocks")
    kind.add_argument("--no-blocks", action="store_true", help="plain GRPO; refuses a model with blocks")
    p.add_argument("--num-heads", type=int, default=4, help="heads of blocks added with --add")
    p.add_argument("--task", required=True)
    p.add_argument("--data", help="training data file/folder")
    p.add_argument("--split", default="train")
    p.add_argument("--val-task", help="validation task (periodic accuracy; best checkpoint kept)")
    p.add_argument("--val-data")
    p.add_argument("--val-split", default="test")
    p.add_argument("--steps", type=int, default=100, help="rollout steps (each: sample, then K optimiser steps)")
    p.add_argument("--prompts-per-step", type=int, default=8, help="P, over all processes")
    p.add_argument("--rollouts", type=int, default=8, help="G, rollouts per prompt")
    p.add_argument("--width", type=int, default=4, help="w, Bridge group width (divides G)")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--steps-per-rollout", type=int, default=8, help="K optimiser steps per rollout batch")
    p.add_argument("--epochs-per-rollout", type=int, default=1)
    p.add_argument("--micro-batch-groups", type=int, default=4, help="Bridge groups per forward/backward")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--clip-eps", type=float, default=0.2)
    p.add_argument("--clip-eps-high", type=float)
    p.add_argument("--beta", type=float, default=1e-3, help="KL weight (0: no reference model)")
    p.add_argument("--freeze-base", action="store_true", help="train only the blocks")
    p.add_argument(
        "--block-lr", type=float, default=None, help="lr of the added blocks (default: --lr, as in the paper)"
    )
    p.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (under torchrun)")
    p.add_argument("--chat", action="store_true")
    p.add_argument("--max-batch-sequences", type=int, default=256)
    p.add_argument("--max-batch-tokens", type=int, default=262_144)
    p.add_argument("--eval-every", type=int, default=0, help="steps between validations (0: end only)")
    p.add_argument("--eval-n", type=int, default=4)
    p.add_argument("--eval-width", type=int, default=4)
    p.add_argument("--eval-limit", type=int)
    p.add_argument("--eval-max-new-tokens", type=int)
    _add_run_args(p, save_every=50)
    p.set_defaults(func=_cmd_rl)

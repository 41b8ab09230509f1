"""RLVR with GRPO where the rollouts of a prompt are generated interdependently (paper Sec. 3.3, 4.1, App. A, C).

A step samples G rollouts for each of P prompts in Bridge groups of width w and grades them (train/rollouts.py),
then takes K optimiser steps on K mini-batches of whole groups (train/update.py); every `eval_every` steps, and
after the last, the policy is validated on a val_task. The rollouts' sampling is a `SamplingConfig`
(`RLConfig.rollout`), the validation's an `EvalConfig` (`RLConfig.validation`); their seeds are drawn from the run's
`seed`. The reference is the policy at the start of RL (blocks included), kept only when beta > 0. Per-step
randomness (sampling seed, mini-batch shuffles, data order) derives from (seed, step), so a resumed run ends with the
same weights as an uninterrupted one.

Outputs in OUT: metrics.jsonl (one record per step), checkpoints/step-N/ (each a model directory that
`bridgelm.load_model` reads, plus trainer_state.pt and trainer.json; the last `keep_last` are kept; under FSDP each
rank's shards, the last one a model directory as well, the others made one by `bridgelm consolidate`), best/ (best
validation accuracy), run.json.

    bridgelm rl --model M --add bridge --task gsm8k --data train.jsonl --out rl_run
    torchrun --nproc_per_node 2 -m bridgelm rl --model M --blocks sft_run/blocks.safetensors --task gsm8k ...
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bridgelm.attach import added_parameters, block_config
from bridgelm.dist import Dist, prepare_model, setup_distributed
from bridgelm.engine import eos_ids, pad_id
from bridgelm.errors import UserError
from bridgelm.eval.runner import accuracy
from bridgelm.jsonl import write_json
from bridgelm.lora import has_lora, train_adapters
from bridgelm.lora import prepare as prepare_lora
from bridgelm.models import enable_checkpointing
from bridgelm.runs import local_source, model_fingerprint
from bridgelm.train.checkpoints import latest_checkpoint
from bridgelm.train.loop import Run, settings_of
from bridgelm.train.optim import gradient_parts, make_optimizer, make_scheduler
from bridgelm.train.reference import make_reference, skeleton
from bridgelm.train.rl_config import FREE_FIELDS, RLConfig, validation_sampling
from bridgelm.train.rl_metrics import step_record
from bridgelm.train.rollouts import RolloutPolicy, collect_rollouts, step_examples
from bridgelm.train.set_rewards import check_reward_task
from bridgelm.train.update import Learner, update_policy
from bridgelm.train.weights import load_checkpoint, save_model, write_on_main

BEST = "best"  # OUT/best: the checkpoint with the best validation accuracy


@dataclass
class RLResult:
    history: list[dict]  # metrics.jsonl records, one per step
    final_dir: Path | None  # the last checkpoint: a model directory for bridgelm.load_model
    best_dir: Path | None  # OUT/best (best validation accuracy), None without validation
    best_accuracy: float | None  # its validation accuracy
    best_step: int | None  # its step
    steps: int  # steps completed
    out_dir: Path


def _checksum(model) -> float:
    with torch.no_grad():
        total = sum(float(p.detach().sum(dtype=torch.float64)) for p in model.parameters())
    return float(f"{total:.9g}")


def _identity(model, task, cfg: RLConfig, val_task, processes: int) -> dict:
    blocks = block_config(model)
    validation = None if val_task is None else val_task.digest(val_task.examples[: cfg.validation.limit])
    return {
        **settings_of(cfg, FREE_FIELDS),
        "model": local_source(str(getattr(model.config, "_name_or_path", ""))),
        "model_digest": model_fingerprint(str(getattr(model.config, "_name_or_path", ""))),  # a folder saved over
        "blocks": None if blocks is None else asdict(blocks),
        "task": task.name,
        "examples": len(task.examples),
        "digest": task.digest(),  # the training problems: a resume on other data is refused
        "validation": validation,  # the validation problems (--val-data, --eval-limit): best/ compares on one set
        "processes": processes,  # rollouts are drawn per rank: another process count would draw others
        "initial_checksum": _checksum(model),
    }


def _set_trainable(model, cfg: RLConfig) -> None:
    if has_lora(model):
        train_adapters(model)  # the LoRA weights and the blocks
    elif cfg.freeze_base:
        blocks = added_parameters(model)
        if not blocks:
            raise UserError("freeze_base=True trains only the added blocks, but the model has none")
        for name, p in model.named_parameters():
            p.requires_grad_(name in blocks)
    else:
        model.requires_grad_(True)


def _learner(model, tokenizer, cfg: RLConfig, run: Run, dist: Dist) -> Learner:
    """The policy (its resumed weights loaded, placed on the ranks), its reference, optimiser and schedule, tracked
    by `run` (restored when resuming)."""
    _set_trainable(model, cfg)
    model.to(dist.device)  # the rank's own device (dist.rank_device)
    ref_model = skeleton(model) if cfg.beta > 0 else None  # the reference (beta > 0): allocated once sharded
    if cfg.optim.gradient_checkpointing:
        enable_checkpointing(model)
    prepare_model(model, dist, cfg.fsdp, cfg.optim.bf16)
    if ref_model is not None:  # the policy at the start of RL: copied before resumed weights are loaded
        ref_model = make_reference(ref_model, model, dist, cfg.optim.bf16)
    if run.resume_from is not None:
        load_checkpoint(model, run.resume_from, dist)  # under FSDP each rank reads its own shards
    params = [p for p in model.parameters() if p.requires_grad]
    lr_of = None
    if cfg.block_lr is not None:
        lr_of = {id(p): cfg.block_lr for p in added_parameters(model).values() if p.requires_grad}
    optimizer = make_optimizer(params, cfg.optim.lr, cfg.optim.weight_decay, lr_of=lr_of)
    parts = {k: v for k, v in gradient_parts(model).items() if k != "base"}  # the blocks' parts (logged per step)
    total = cfg.steps * cfg.steps_per_rollout * cfg.epochs_per_rollout
    scheduler = make_scheduler(optimizer, total, cfg.optim.warmup_fraction, "constant")
    run.track(model, optimizer, scheduler, lambda folder, state_dict: save_model(model, tokenizer, folder, state_dict))
    return Learner(model, ref_model, params, optimizer, scheduler, parts)


def _banner(model, cfg: RLConfig, dist: Dist, out_dir: Path, problems: int) -> str:
    """What the run does, in a line (and a note when a step holds more prompts than the task has problems)."""
    blocks = block_config(model)
    trained = f"{blocks.kind} blocks" if blocks else "no blocks: plain GRPO (RLVR only)"
    trained += ", base frozen" if cfg.freeze_base else ""
    trained += f", LoRA r={cfg.lora.r} on the base" if cfg.lora.enabled else ""
    repeats = (f"\nbridgelm rl: note: a step's {cfg.prompts_per_step} prompts are more than the task's {problems} "
               "problems: each step holds some of them more than once") if cfg.prompts_per_step > problems else ""
    return (
        f"bridgelm rl: {cfg.steps} steps of {cfg.prompts_per_step} prompts x {cfg.rollout.n} rollouts "
        f"(width {cfg.rollout.width}; {trained}), {dist.world} process(es) -> {out_dir}{repeats}"
    )


def _check_run(model, task, cfg: RLConfig, val_task, dist: Dist) -> None:
    """UserError for a run that cannot work, before anything is written."""
    cfg.validate(dist.world)
    if cfg.eval_every and val_task is None:
        raise UserError(f"eval_every={cfg.eval_every} needs a val_task (--val-task): the problems to validate on")
    if not task.examples:
        raise UserError(f"task {task.name!r} has no examples to train on")
    check_reward_task(cfg.reward, task)
    if cfg.block_lr is not None and not added_parameters(model):
        raise UserError(f"block_lr={cfg.block_lr}, but the model has no added blocks to train at that rate")


def train_rl(model, tokenizer, task, cfg: RLConfig, out_dir: str | os.PathLike, val_task=None) -> RLResult:
    """GRPO on `task` starting from `model` (with or without blocks); see the module docstring for the outputs."""
    out_dir = Path(out_dir)
    dist = setup_distributed(next(model.parameters()).device)
    _check_run(model, task, cfg, val_task, dist)
    prepare_lora(model, cfg.lora, cfg.seed, "rl")
    identity = _identity(model, task, cfg, val_task, dist.world)
    run = Run(out_dir, "rl", identity, cfg.run, dist, best_accuracy=None, best_step=None)
    sampler = RolloutPolicy(model, cfg.replica_dtype())  # made before the policy is sharded
    learner = _learner(model, tokenizer, cfg, run, dist)
    run.say(_banner(model, cfg, dist, out_dir, len(task.examples)))
    pad = pad_id(tokenizer, eos_ids(model, tokenizer))
    was_training = model.training
    try:
        with run.running(cfg.steps, "GRPO"):
            first = run.step
            for step in range(first, cfg.steps):
                t0 = time.perf_counter()
                examples = step_examples(task, cfg, step, dist)
                rollouts = collect_rollouts(sampler.current(), tokenizer, task, examples, cfg, step, dist)
                with run.update():
                    lr = learner.scheduler.get_last_lr()[0]
                    t1 = time.perf_counter()
                    stats = update_policy(learner, rollouts, cfg, step, pad, dist)
                    run.state["step"] = step + 1
                    record = step_record(step, rollouts, stats, cfg, lr, t0, t1, dist)
                    due = step + 1 == cfg.steps or (cfg.eval_every and (step + 1) % cfg.eval_every == 0)
                    if val_task is not None and due:
                        record.update(_validate(model, sampler, tokenizer, val_task, cfg, run.state, out_dir, dist))
                    val = record.get("val_accuracy", "")
                    run.log(record, reward=f"{record['reward']:.3f}", kl=record["kl"], val=val)
                    if record["empty"] == 1 and not cfg.chat and step == first:  # said once
                        run.say(f"bridgelm rl: note: every rollout of step {step + 1} ended at once (empty): an "
                                "Instruct model sampled without --chat often does, and equal rewards train nothing")
                run.save_if_due()
    finally:
        model.train(was_training)
    best = run.state["best_step"]
    return RLResult(
        history=run.history,
        final_dir=latest_checkpoint(out_dir),
        best_dir=out_dir / BEST if best is not None else None,
        best_accuracy=run.state["best_accuracy"],
        best_step=best,
        steps=run.step,
        out_dir=out_dir,
    )


def _validate(model, sampler, tokenizer, val_task, cfg: RLConfig, state: dict, out_dir: Path, dist: Dist) -> dict:
    """Validation accuracy, sampled as the rollouts are (from the rollout copy when there is one: under FSDP no
    gathered policy beside it); OUT/best holds the model of the best one so far."""
    t0 = time.perf_counter()
    acc = accuracy(sampler.current(), tokenizer, val_task, validation_sampling(cfg), dist)
    is_best = state["best_accuracy"] is None or acc > state["best_accuracy"]
    if is_best:
        state["best_accuracy"], state["best_step"] = acc, state["step"]
        info = {"step": state["step"], "val_accuracy": acc}

        def write(folder: Path, state_dict: dict | None) -> None:
            save_model(model, tokenizer, folder, state_dict)
            write_json(folder / "best.json", info)

        write_on_main(out_dir / BEST, model, dist, write)
    return {"val_accuracy": acc, "val_best": is_best, "val_seconds": time.perf_counter() - t0}

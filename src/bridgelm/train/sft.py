"""SFT warm-up of the new blocks only (paper Sec. 3.2, 4.1, App. A): the base is frozen, and correct responses the
base model wrote itself (warmup_data.py) are fed in groups, so that the responses of a group see each other
through the Bridge blocks.

- A group is w in [min_width, max_width] (paper [2, 4]) correct responses of one problem; every epoch reshuffles
  each problem's responses and redraws the widths with a generator seeded by (seed, epoch), so that all responses
  are used once per epoch. A batch holds `batch_groups` groups, shuffled over problems.
- A group is one grouped forward of right-padded prompt + response rows; the loss is next-token cross-entropy on
  response tokens only, averaged over all response tokens of the batch (over all ranks under torchrun).
- AdamW on the block parameters, linear schedule with 10% warm-up. After each epoch, perplexity on held-out
  problems (grouped the same way, once); the best block file is `OUT/blocks.safetensors` (load_blocks reads it),
  and the model ends with the best blocks loaded.
- Resumable checkpoints in `OUT/checkpoints/step-N/` (blocks, optimiser, scheduler, RNG); Ctrl-C saves one.
- With LoRA (`lora.r`, bridgelm.lora) the base's projections get LoRA weights that train beside the blocks; the
  best is then `OUT/model/`, a model folder (LoRA merged into the base, the blocks, the adapter in model/lora/), and
  no block file (blocks trained beside LoRA belong with it).

    bridgelm sft --model M --add bridge --data warmup.jsonl --out sft_run
    torchrun --nproc_per_node 2 -m bridgelm sft --model M --add bridge --data warmup.jsonl --out sft_run
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bridgelm.attach import add_seeded_blocks, added_parameters, block_config
from bridgelm.blockfile import load_blocks, save_blocks
from bridgelm.dist import Dist, all_reduce_sum, barrier, prepare_model, setup_distributed
from bridgelm.errors import UserError, check_choice, check_int, check_number
from bridgelm.jsonl import write_json
from bridgelm.logprobs import Row, pack_rows, response_logprobs
from bridgelm.lora import ADAPTER_DIR, LoraSettings, load_adapter, load_trained, save_adapter, train_adapters
from bridgelm.lora import prepare as prepare_lora
from bridgelm.models import enable_checkpointing
from bridgelm.rng import derive_seed, generator
from bridgelm.runs import fingerprint, local_source, model_fingerprint
from bridgelm.setting import setting
from bridgelm.train.batches import autocast, chunks, mode
from bridgelm.train.loop import Run, RunControl, settings_of
from bridgelm.train.checkpoints import write_dir_atomic
from bridgelm.train.optim import OptimConfig, gradient_parts, make_optimizer, make_scheduler, optimizer_step
from bridgelm.train.weights import save_model
from bridgelm.warmup_file import Problem, WarmupData, load_warmup

BLOCKS_FILE = "blocks.safetensors"  # the best blocks of the run (by validation perplexity)
MODEL_DIR = "model"  # with LoRA, the best instead: a model folder (LoRA merged, blocks, model/lora/)
SFT_LR = 2e-5  # SFTConfig.optim.lr's default: the blocks' peak learning rate


@dataclass
class SFTConfig:
    """SFT warm-up settings; defaults follow the paper's Appendix A where it gives one."""

    blocks: str = setting("bridge", 'kind of blocks to add when the model has none: "bridge" or "pmatch"')
    num_heads: int = setting(4, "heads of the added blocks (head dim = the host's)")
    placement: str = setting("ffn", 'where the blocks sit: "ffn" (paper) or "attn"')
    epochs: int = setting(5, "passes over the training problems")
    optim: OptimConfig = setting(default_factory=lambda: OptimConfig(lr=SFT_LR), help="AdamW and its schedule "
                                 "(linear decay after the warm-up), clipping, bf16, gradient checkpointing")
    batch_groups: int = setting(8, "groups per optimiser step, over all ranks (paper: 32 responses; 8 "
                                                "groups of 2-4 hold about 24)")
    micro_batch_groups: int = setting(8, "groups per forward/backward on a rank (gradient accumulation)")
    min_width: int = setting(2, "smallest group")
    max_width: int = setting(4, "largest group")
    max_length: int = setting(2048, "prompt + response tokens per row; longer responses are cut")
    val_fraction: float = setting(0.1, "share of the problems held out for validation perplexity")
    val_count: int | None = setting(None, "held-out problems; overrides val_fraction (paper: 500)")
    seed: int = setting(0, "seeds the block initialisation, the split, the groups and the batch order")
    run: RunControl = setting(default_factory=RunControl, help="checkpoints (save_every 0: at the end of each "
                              "epoch), resume, progress, tensorboard")
    lora: LoraSettings = setting(default_factory=LoraSettings, help="LoRA of the base (bridgelm.lora); off by default")

    def validate(self) -> None:
        self.lora.validate()
        self.optim.validate()
        self.run.validate()
        check_choice("blocks", self.blocks, ("bridge", "pmatch"))
        for name in ("epochs", "batch_groups", "micro_batch_groups", "max_length", "min_width", "max_width"):
            check_int(name, getattr(self, name))
        if not 2 <= self.min_width <= self.max_width:
            raise UserError(f"group widths [{self.min_width}, {self.max_width}]: expected 2 <= min_width <= max_width")
        check_number("val_fraction", self.val_fraction, 0, 1, open_high=True)
        if self.val_count is not None:
            check_int("val_count", self.val_count, low=0, note=" (or None: val_fraction of the problems)")


@dataclass
class SFTResult:
    history: list[dict]  # metrics.jsonl records, one per optimiser step (epoch ends carry val_loss / val_ppl)
    blocks_path: Path  # OUT/blocks.safetensors: the best blocks (with LoRA: OUT/model, the best model folder)
    best_val_ppl: float | None  # perplexity of the best blocks on the held-out problems (None without any)
    best_epoch: int  # epoch (1-based) of the best blocks
    steps: int  # optimiser steps taken in all
    out_dir: Path
    stats: dict = field(default_factory=dict)  # problems, responses and groups used


def split_widths(count: int, lo: int, hi: int, gen: torch.Generator) -> list[int]:
    """Random widths in [lo, hi] summing to `count` (never leaving fewer than `lo` behind)."""
    widths, rest = [], count
    while rest >= lo:
        choices = [w for w in range(lo, min(hi, rest) + 1) if rest - w == 0 or rest - w >= lo]
        w = choices[int(torch.randint(len(choices), (1,), generator=gen))]
        widths.append(w)
        rest -= w
    return widths


def make_groups(problems: list[Problem], cfg: SFTConfig, gen: torch.Generator) -> list[list[Row]]:
    """Each problem's responses, shuffled and cut into groups of random width; group ids are unique."""
    groups: list[list[Row]] = []
    for prob in problems:
        room = cfg.max_length - len(prob.prompt_ids)
        if room < 1:
            continue
        order = torch.randperm(len(prob.responses), generator=gen).tolist()
        at = 0
        for w in split_widths(len(order), cfg.min_width, cfg.max_width, gen):
            gid = len(groups)
            groups.append([Row(prob.prompt_ids, prob.responses[j][:room], gid) for j in order[at : at + w]])
            at += w
    return groups


def epoch_batches(problems: list[Problem], cfg: SFTConfig, epoch: int) -> list[list[list[Row]]]:
    """The batches (lists of groups) of `epoch`, a pure function of (seed, epoch)."""
    gen = generator(cfg.seed, "sft-groups", epoch)
    groups = make_groups(problems, cfg, gen)
    order = torch.randperm(len(groups), generator=gen).tolist()
    return chunks([groups[i] for i in order], cfg.batch_groups)


def split_problems(problems: list[Problem], cfg: SFTConfig) -> tuple[list[Problem], list[Problem]]:
    n_val = cfg.val_count if cfg.val_count is not None else int(round(cfg.val_fraction * len(problems)))
    if n_val < 0 or n_val >= len(problems):
        raise UserError(
            f"{n_val} validation problems leave none of the {len(problems)} problems for training; lower val_count"
        )
    order = torch.randperm(len(problems), generator=generator(cfg.seed, "sft-split")).tolist()
    return [problems[i] for i in order[n_val:]], [problems[i] for i in order[:n_val]]


# ---------------------------------------------------------------------------------------------- steps


def batch_backward(model, groups: list[list[Row]], cfg: SFTConfig, pad_id: int, dist: Dist) -> tuple[float, int]:
    """Cross-entropy of this rank's share of a batch, normalised by the batch's global token count; backward.

    Returns (global mean loss, global response tokens).
    """
    mine = groups[dist.rank :: dist.world]
    local_tokens = sum(len(r.response) for g in mine for r in g)
    total = all_reduce_sum([local_tokens], dist)[0]
    loss_sum = 0.0
    for micro in chunks(mine, cfg.micro_batch_groups):
        batch = pack_rows([r for g in micro for r in g], pad_id, dist.device)
        with autocast(dist.device, cfg.optim.bf16):
            lp = response_logprobs(model, batch).logprobs  # [B, T]
        loss = -(lp * batch.response_mask).sum() / max(total, 1.0)
        loss.backward()
        loss_sum += float(loss.detach())
    return all_reduce_sum([loss_sum], dist)[0], int(total)


@torch.no_grad()
def validation_loss(model, groups: list[list[Row]], cfg: SFTConfig, pad_id: int, dist: Dist) -> float:
    """Mean next-token NLL over the response tokens of the validation groups (all ranks)."""
    nll, tokens = 0.0, 0
    with mode(model, False):
        for micro in chunks(groups[dist.rank :: dist.world], cfg.micro_batch_groups):
            batch = pack_rows([r for g in micro for r in g], pad_id, dist.device)
            with autocast(dist.device, cfg.optim.bf16):
                lp = response_logprobs(model, batch).logprobs
            nll -= float((lp * batch.response_mask).sum())
            tokens += batch.tokens
    nll, tokens = all_reduce_sum([nll, tokens], dist)
    return nll / max(tokens, 1.0)


# ---------------------------------------------------------------------------------------------- the run


def ensure_blocks(model, cfg: SFTConfig):
    """Add `cfg.blocks` blocks (seeded) unless the model already has blocks: then they are warmed up, and must be
    what cfg describes (its kind, num_heads and placement, which the run records)."""
    have = block_config(model)
    if have is not None:
        asked = {"blocks": cfg.blocks, "num_heads": cfg.num_heads, "placement": cfg.placement}
        held = {"blocks": have.kind, "num_heads": have.num_heads, "placement": have.placement}
        differ = [f"{k}={asked[k]!r} (the model's: {held[k]!r})" for k in asked if asked[k] != held[k]]
        if differ:
            raise UserError(
                f"the model already has {have.kind} blocks, which sft warms up as they are, but {', '.join(differ)} "
                "was asked: give the model's settings, or a model without blocks"
            )
        return model
    return add_seeded_blocks(
        model, cfg.blocks, derive_seed(cfg.seed, "sft-blocks"), num_heads=cfg.num_heads, placement=cfg.placement
    )


def train_sft(
    model, tokenizer, data: str | os.PathLike | WarmupData, cfg: SFTConfig, out_dir: str | os.PathLike
) -> SFTResult:
    """Warm up the blocks of `model` (added when absent) on the warm-up file `data` (its path, or the file read:
    `load_warmup`); writes OUT/blocks.safetensors."""
    cfg.validate()
    out_dir = Path(out_dir)
    dist = setup_distributed(next(model.parameters()).device)
    data = data if isinstance(data, WarmupData) else load_warmup(data)
    problems = data.checked(tokenizer, vocab_size=model.get_input_embeddings().num_embeddings)
    train, val = split_problems(problems, cfg)
    plan = _epoch_plans(train, cfg)  # checked before the run folder is touched
    total = sum(len(b) for b in plan)
    prepare_lora(ensure_blocks(model, cfg), cfg.lora, cfg.seed, "sft")
    identity = _identity(model, data.path, problems, cfg)
    run = Run(out_dir, "sft", identity, cfg.run, dist, best={"val_ppl": None, "epoch": 0})
    params = _trainable_blocks(model, cfg, run, dist)
    parts = gradient_parts(model)
    flat = [(e, i) for e, batches in enumerate(plan) for i in range(len(batches))]  # step -> (epoch, batch)
    val_groups = make_groups(val, cfg, generator(cfg.seed, "sft-val"))
    optimizer = make_optimizer(params, cfg.optim.lr, cfg.optim.weight_decay)
    scheduler = make_scheduler(optimizer, total, cfg.optim.warmup_fraction, "linear")
    run.track(model, optimizer, scheduler, lambda folder, _: _save_trained(model, cfg, folder))
    best_path = out_dir / (MODEL_DIR if cfg.lora.enabled else BLOCKS_FILE)
    run.left_behind = lambda: _left_behind(run.state["best"]["epoch"], bool(val_groups), best_path)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    run.say(f"bridgelm sft: {len(train)} training problems, {len(val)} held out, {total} steps -> {out_dir}")
    with mode(model, True), run.running(total, "SFT"):
        for step in range(run.step, total):
            epoch, index = flat[step]
            epoch_end = index == len(plan[epoch]) - 1
            t0, lr = time.perf_counter(), scheduler.get_last_lr()[0]
            loss, tokens = batch_backward(model, plan[epoch][index], cfg, pad, dist)
            with run.update():
                part_norms: dict[str, float] = {}
                norm = optimizer_step(params, optimizer, scheduler, cfg.optim.max_grad_norm, dist, parts, part_norms)
                run.state["step"] = step + 1
                record = {"step": step + 1, "epoch": epoch + 1, "loss": loss, "lr": lr, "grad_norm": norm,
                          **{f"grad_norm_{k}": v for k, v in part_norms.items()}, "tokens": tokens}  # fmt: skip
                record.update(_speed(plan[epoch][index], tokens, time.perf_counter() - t0))
                if epoch_end:
                    best = _best_writer(model, tokenizer, best_path)
                    record.update(_end_epoch(model, val_groups, cfg, pad, dist, epoch, run.state, out_dir, best))
                run.log(record, loss=f"{loss:.3f}", ppl=record.get("val_ppl", ""))
            run.save_if_due(now=epoch_end)  # and at the end of every epoch
    barrier(dist)
    (load_trained if cfg.lora.enabled else load_blocks)(model, best_path)  # the model ends with the best weights
    best, stats = run.state["best"], _stats(train, val, val_groups, plan)
    return SFTResult(run.history, best_path, best["val_ppl"], best["epoch"], run.step, out_dir, stats)


def _stats(train: list[Problem], val: list[Problem], val_groups: list, plan: list) -> dict:
    """SFTResult.stats: the problems, groups and steps of the run."""
    steps = sum(len(b) for b in plan)
    stats = {"train_problems": len(train), "val_problems": len(val), "val_groups": len(val_groups), "steps": steps}
    return {**stats, "groups_per_epoch": [sum(len(b) for b in batches) for batches in plan]}


def _epoch_plans(train: list[Problem], cfg: SFTConfig) -> list[list[list[list[Row]]]]:
    """Each epoch's batches (a pure function of the settings); ValueError when there is not one training group."""
    plan = [epoch_batches(train, cfg, e) for e in range(cfg.epochs)]
    if not any(plan):
        shortest = min(len(p.prompt_ids) for p in train)
        most = max(len(p.responses) for p in train)
        raise UserError(
            f"no training group: max_length={cfg.max_length} must exceed a prompt (the shortest has {shortest} "
            f"tokens) and min_width={cfg.min_width} must not exceed a problem's responses (at most {most})"
        )
    return plan


def _identity(model, data_path: str | os.PathLike, problems: list[Problem], cfg: SFTConfig) -> dict:
    """The settings a resume must match: the config's, the data's and the model's."""
    return {
        **settings_of(cfg),
        "data": str(Path(data_path).resolve()),
        "problems": len(problems),
        "digest": fingerprint([p.prompt_ids, p.responses] for p in problems),  # a resume on edited data is refused
        "model": local_source(str(getattr(model.config, "_name_or_path", ""))),
        # the base's folder by content: a model saved over it since the run began is refused by name
        "model_digest": model_fingerprint(str(getattr(model.config, "_name_or_path", ""))),
    }


def _trainable_blocks(model, cfg: SFTConfig, run: Run, dist: Dist) -> list[torch.nn.Parameter]:
    """Add the blocks (when absent), freeze the base, load the resumed checkpoint's blocks, place the model on the
    ranks; the trained parameters: the blocks'."""
    ensure_blocks(model, cfg)
    trainable = added_parameters(model)
    for name, p in model.named_parameters():
        p.requires_grad_(name in trainable)
    if cfg.lora.enabled:
        train_adapters(model)  # the blocks and the LoRA weights
    if run.resume_from is not None:
        load_blocks(model, run.resume_from / BLOCKS_FILE)
        if cfg.lora.enabled:
            load_adapter(model, run.resume_from / ADAPTER_DIR)
    prepare_model(model, dist, fsdp=False)
    if cfg.optim.gradient_checkpointing:
        enable_checkpointing(model)
    return [p for p in model.parameters() if p.requires_grad]


def _save_trained(model, cfg: SFTConfig, folder: Path) -> None:
    """A checkpoint's weights: the blocks, and with LoRA the adapter in folder/lora (the base is the run's --model)."""
    save_blocks(model, folder / BLOCKS_FILE)
    if cfg.lora.enabled:
        save_adapter(model, folder / ADAPTER_DIR)


def _best_writer(model, tokenizer, best_path: Path):
    """What writes the best so far: the block file, or with LoRA the model folder (written atomically)."""
    if best_path.name == BLOCKS_FILE:
        return lambda: save_blocks(model, best_path)
    return lambda: write_dir_atomic(best_path, lambda tmp: save_model(model, tokenizer, tmp))


def _left_behind(best_epoch: int, validated: bool, best_path: Path) -> str:
    """What an interrupted run leaves in OUT/blocks.safetensors (with LoRA: OUT/model)."""
    if not best_epoch:
        return f"no epoch finished, so no {best_path.name} yet"
    which = "the best so far by validation" if validated else "the last finished"
    what = "blocks" if best_path.name == BLOCKS_FILE else "model (LoRA merged, blocks)"
    return f"{best_path} holds the {what} of epoch {best_epoch} ({which}), not the whole run's"


def _speed(groups: list[list[Row]], tokens: int, seconds: float) -> dict:
    """The step's sequences, tokens per second and seconds."""
    sequences = sum(len(g) for g in groups)
    return {"sequences": sequences, "tokens_per_s": tokens / max(seconds, 1e-9), "seconds": seconds}


def _end_epoch(model, val_groups, cfg, pad, dist, epoch, state, out_dir, save_best) -> dict:
    """Validation perplexity; writes the best (`save_best()`: OUT/blocks.safetensors, or with LoRA OUT/model) when it
    is the best so far (or without validation)."""
    extra = {}
    is_best = True
    if val_groups:
        val_loss = validation_loss(model, val_groups, cfg, pad, dist)
        ppl = math.exp(min(val_loss, 700.0))
        best = state["best"]["val_ppl"]
        is_best = best is None or ppl < best
        extra = {"val_loss": val_loss, "val_ppl": ppl, "best": is_best}
        if is_best:
            state["best"] = {"val_ppl": ppl, "epoch": epoch + 1}
    else:
        state["best"] = {"val_ppl": None, "epoch": epoch + 1}
    if is_best and dist.is_main:
        save_best()
        write_json(out_dir / "best.json", {"epoch": epoch + 1, "step": state["step"], **extra})
    return extra

"""The demo's base model, built on the spot: a character tokenizer and a small Qwen2, pre-trained on worked
solutions of the demo's task (`anysum` by default, `arith` too), saved with `save_pretrained` like any Hugging
Face model.

Pre-training is pinned by step count and seed (accuracy jumps sharply during training, so a time budget would
give a different model on another machine). The result is cached: a folder holding a `pretrain.json` whose
settings equal the requested ones is reused as it is.

    bridgelm demo --out runs/demo      # builds runs/demo/base first
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from bridgelm.attention import fast_attention
from bridgelm.dist import Dist
from bridgelm.eval import runner
from bridgelm.jsonl import write_json
from bridgelm.runs import METRICS, check_settings, jsonable
from bridgelm.setting import setting
from bridgelm.tasks import anysum, arith, hint, pairsum
from bridgelm.tokenizer import BOS, CHAT_TEMPLATE, EOS, PAD
from bridgelm.train.batches import autocast
from bridgelm.train.loop import Run, RunControl
from bridgelm.train.optim import CosineSchedule, make_optimizer, optimizer_step, scheduled
from bridgelm.train.weights import load_weights, save_model

BOXED = "\\boxed{"  # one token: the answer marker
SAVE_EVERY = 250  # pre-training steps between checkpoints (an interrupted pre-training resumes from the last)
PRETRAIN_FILE = "pretrain.json"  # written when pre-training ends: its settings, steps, seconds and accuracy


@dataclass(frozen=True)
class BaseConfig:
    """The base model and its pre-training."""

    # which problems (its task)
    task: anysum.AnySumSpec | arith.ArithSpec | pairsum.PairSumSpec | hint.HintSpec = field(
        default_factory=anysum.AnySumSpec
    )

    hidden_size: int = setting(192, "D")
    num_layers: int = 4
    num_heads: int = setting(4, "attention heads (head dim D / heads)")
    num_kv_heads: int = 2
    intermediate_size: int = setting(512, "feed-forward width")
    steps: int = setting(1500, "optimiser steps of pre-training, at most (pinned by count and seed, not by time)")
    schedule_steps: int = setting(1000, "horizon of the lr schedule (warm-up 5%, cosine to 10% at this step)")
    target_accuracy: float = setting(0.4, "stop at the first check whose validation "
                                          "accuracy reaches this (RL needs room)")
    check_every: int = setting(25, "steps between validation checks (from check_from on)")
    check_from: int = setting(300, "first step checked")
    check_problems: int = setting(100, "validation problems per check (4 samples each, temperature 0.6)")
    batch_size: int = setting(64, "problems per step")
    lr: float = setting(2e-3, "AdamW peak learning rate (1e-3 reaches 40% sooner, "
                              "but RL from that model barely learns: docs/demo.md)")
    weight_decay: float = 0.01
    bf16: bool = setting(True, "bf16 autocast of the forward (weights, optimiser and loss in fp32); 1.6x faster on CPU")
    seed: int = setting(0, "model init, data order")
    distinct: bool = setting(True, "every training problem seen once (False for toy problem spaces)")
    threads: int = setting(0, "torch threads (0 = leave as is)")


# The demo's tasks, by the type of their spec: (registry name, module with make_problems(), task class, new tokens per
# sample in pre-training's validation checks: its worked solutions within the demo's budget).
_TASKS = {
    anysum.AnySumSpec: ("anysum", anysum, anysum.AnySum, 48),
    arith.ArithSpec: ("arith", arith, arith.Arith, 48),
    pairsum.PairSumSpec: ("pairsum", pairsum, pairsum.PairSum, 63),
    hint.HintSpec: ("hint", hint, hint.Hint, 8),
}
CHECK_TOKENS = {name: tokens for name, _, _, tokens in _TASKS.values()}  # by registry name


def check_config(task_name: str) -> runner.EvalConfig:
    """How pre-training's validation checks sample: 4 independent samples per problem, the evaluation's sampling."""
    return runner.EvalConfig(sampling=runner.eval_sampling(n=4, width=1, max_new_tokens=CHECK_TOKENS[task_name]))


def task_name(spec) -> str:
    """The registry name of the task whose problems `spec` describes."""
    return _TASKS[type(spec)][0]


def make_problems(spec, size: int, split: str, seed: int, distinct: bool = True) -> list[dict]:
    """Problems (with one worked solution each) of the task that `spec` describes."""
    return _TASKS[type(spec)][1].make_problems(size, split, seed, spec, distinct=distinct)


def make_task(spec, examples: list[dict]):
    """The task object of `spec`'s task over `examples`."""
    name, _, cls, _ = _TASKS[type(spec)]
    return cls(name=name, examples=examples)


def train_tokenizer(texts) -> PreTrainedTokenizerFast:
    """A character-level tokenizer learned from `texts` with the `tokenizers` package (plus one `\\boxed{` token)."""
    tok = Tokenizer(models.WordLevel(unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=[PAD, BOS, EOS], min_frequency=1))
    tok.add_tokens([BOXED])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(cfg: BaseConfig, tokenizer) -> Qwen2ForCausalLM:
    torch.manual_seed(cfg.seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return Qwen2ForCausalLM(config)


def encode_examples(tokenizer, task, examples) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded prompt+solution+EOS ids [N, S] and the loss mask [N, S] (1 on solution tokens and EOS)."""
    rows, masks = [], []
    for ex in examples:
        prompt = tokenizer(task.prompt(ex))["input_ids"]
        answer = tokenizer(ex["solution"])["input_ids"]
        rows.append(prompt + answer + [tokenizer.eos_token_id])
        masks.append([0] * len(prompt) + [1] * (len(answer) + 1))
    S = max(map(len, rows))
    ids = torch.full((len(rows), S), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), S, dtype=torch.long)
    for i, (r, m) in enumerate(zip(rows, masks)):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(m)] = torch.tensor(m)
    return ids, mask


def pretrain(cfg: BaseConfig, out: str | Path, progress: bool = True, log=print) -> Path:
    """Build, pre-train and save the base model into `out` (reused when already there with these settings).

    A training run of its own (bridgelm.train.loop): OUT/metrics.jsonl and checkpoints every SAVE_EVERY steps, so an
    interrupted pre-training resumes exactly where it stopped. It ends at `cfg.steps`, or at the first validation
    check that reaches `target_accuracy`.
    """
    out = Path(out)
    settings = jsonable(asdict(cfg))
    if _made_with(out, settings):
        log(f"base model: reusing {out}")
        return out
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    task, tokenizer, model = _build(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    control = RunControl(resume=True, save_every=SAVE_EVERY, keep_last=1, progress=progress)
    run = Run(out, "pretrain", {"config": settings}, control, Dist(), val_accuracy=None, reached=False)
    if run.resume_from is not None:
        load_weights(model, run.resume_from)
    params = list(model.parameters())
    optimizer = make_optimizer(params, cfg.lr, cfg.weight_decay, betas=(0.9, 0.95))
    horizon = max(cfg.steps, cfg.schedule_steps)
    scheduler = scheduled(optimizer, CosineSchedule(horizon, max(1, horizon // 20), floor=0.1))
    run.track(model, optimizer, scheduler, lambda folder, _: save_model(model, tokenizer, folder))
    checks = cfg.check_from < cfg.steps
    val = make_task(cfg.task, make_problems(cfg.task, cfg.check_problems, "validation", cfg.seed)) if checks else None
    t0 = time.perf_counter()
    last = run.step if run.state["reached"] else cfg.steps  # a run that reached its target is over
    with run.running(last, f"pre-training {n_params / 1e6:.1f}M model"):
        for step in range(run.step, last):
            batch = task.examples[step * cfg.batch_size : (step + 1) * cfg.batch_size]
            loss, tokens = _loss(model, tokenizer, task, batch, cfg.bf16, run.dist.device)
            loss.backward()
            with run.update():
                lr = scheduler.get_last_lr()[0]
                norm = optimizer_step(params, optimizer, scheduler, 1.0, run.dist)
                run.state["step"] = step + 1
                record = {"step": step + 1, "loss": loss.item(), "lr": lr, "grad_norm": norm, "tokens": tokens}
                if checks and step + 1 >= cfg.check_from and (step + 1 - cfg.check_from) % cfg.check_every == 0:
                    val_accuracy = runner.accuracy(model, tokenizer, val, check_config(task.name))
                    record["val_accuracy"] = run.state["val_accuracy"] = val_accuracy
                    run.state["reached"] = val_accuracy >= cfg.target_accuracy
                run.log(record, loss=f"{record['loss']:.3f}", val=run.state["val_accuracy"])
            run.save_if_due(now=run.state["reached"])
            if run.state["reached"]:
                break
    _save(cfg, out, model, tokenizer, run, time.perf_counter() - t0, log)
    return out


def _made_with(out: Path, settings: dict) -> bool:
    """Whether `out` holds a base model pre-trained with `settings`; one pre-trained with others is refused, naming
    each setting that differs."""
    if not (out / PRETRAIN_FILE).exists():
        return False
    done = json.loads((out / PRETRAIN_FILE).read_text())["config"]
    if done == settings:
        return True
    check_settings(out, done, settings, fix="use another --out for another base model")
    return False


def _build(cfg: BaseConfig):
    """The training problems (as a task), a tokenizer learned from them, and the fresh model."""
    examples = make_problems(cfg.task, cfg.steps * cfg.batch_size, "train", cfg.seed, distinct=cfg.distinct)
    alphabet = "0123456789+-=\n{}" + "".join(sorted(set(BOXED)))
    task = make_task(cfg.task, examples)
    tokenizer = train_tokenizer([alphabet] + [task.prompt(e) + e["solution"] for e in task.examples[:2000]])
    return task, tokenizer, build_model(cfg, tokenizer).train()


def _loss(model, tokenizer, task, batch: list[dict], bf16: bool, device) -> tuple[torch.Tensor, int]:
    """The mean cross-entropy of the solution tokens (and EOS) of `batch`, and how many there are."""
    ids, mask = encode_examples(tokenizer, task, batch)  # [B, S] each
    with autocast(device, bf16), fast_attention(model):
        logits = model(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long()).logits  # [B, S, V]
    target_mask = mask[:, 1:].bool()  # [B, S - 1]: position s predicts a solution token
    loss = torch.nn.functional.cross_entropy(logits[:, :-1][target_mask].float(), ids[:, 1:][target_mask])
    return loss, int(mask.sum())


def _save(cfg: BaseConfig, out: Path, model, tokenizer, run, seconds: float, log) -> None:
    """The model in eval mode with its tokenizer, and OUT/pretrain.json: its settings, steps, seconds, accuracy."""
    model.eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    save_model(model, tokenizer, out)
    n_params = sum(p.numel() for p in model.parameters())
    val_accuracy = run.state["val_accuracy"]
    info = {"config": asdict(cfg), "params": n_params, "steps": run.step, "val_accuracy": val_accuracy}
    write_json(out / PRETRAIN_FILE, {**info, "seconds": round(seconds, 1), "metrics": str(out / METRICS)})
    log(
        f"base model: {n_params / 1e6:.2f}M parameters, {run.step} steps (this session: {seconds:.0f}s), validation "
        f"accuracy {val_accuracy if val_accuracy is None else round(val_accuracy, 3)} -> {out}"
    )

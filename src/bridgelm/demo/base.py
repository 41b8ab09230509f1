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
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from bridgelm.jsonl import write_json
from bridgelm.tasks import anysum, arith
from bridgelm.tokenizer import BOS, CHAT_TEMPLATE, EOS, PAD

BOXED = "\\boxed{"  # one token: the answer marker


@dataclass(frozen=True)
class BaseConfig:
    """The base model and its pre-training."""

    task: anysum.AnySumSpec | arith.ArithSpec = field(default_factory=anysum.AnySumSpec)  # which problems (its task)

    hidden_size: int = 192  # D
    num_layers: int = 4
    num_heads: int = 4  # attention heads (head dim D / heads)
    num_kv_heads: int = 2
    intermediate_size: int = 512  # feed-forward width
    steps: int = 1500  # optimiser steps of pre-training, at most (pinned by count and seed, not by time)
    schedule_steps: int = 1000  # horizon of the lr schedule (warm-up 5%, cosine to 10% at this step)
    target_accuracy: float = 0.4  # stop at the first check whose validation accuracy reaches this (RL needs room)
    check_every: int = 25  # steps between validation checks (from check_from on)
    check_from: int = 300  # first step checked
    check_problems: int = 100  # validation problems per check (4 samples each, temperature 0.6)
    batch_size: int = 64  # problems per step
    lr: float = 2e-3  # AdamW peak learning rate
    weight_decay: float = 0.01
    seed: int = 0  # model init, data order
    distinct: bool = True  # every training problem seen once (False for toy problem spaces)
    threads: int = 0  # torch threads (0 = leave as is)


def _module(spec):
    return anysum if isinstance(spec, anysum.AnySumSpec) else arith


def task_name(spec) -> str:
    """The registry name of the task whose problems `spec` describes."""
    return "anysum" if isinstance(spec, anysum.AnySumSpec) else "arith"


def generate(spec, size: int, split: str, seed: int, distinct: bool = True) -> list[dict]:
    """Problems (with one worked solution each) of the task that `spec` describes."""
    return _module(spec).generate(size, split, seed, spec, distinct=distinct)


def make_task(spec, examples: list[dict]):
    """The task object of `spec`'s task over `examples`."""
    cls = anysum.AnySum if isinstance(spec, anysum.AnySumSpec) else arith.Arith
    return cls(name=task_name(spec), examples=examples)


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


def accuracy(model, tokenizer, task, n: int = 4, max_new_tokens: int = 48) -> float:
    """Mean accuracy of n independent samples per problem (temperature 0.6, top-p 0.95), through the engine."""
    from bridgelm.train.rl import evaluate_accuracy

    return evaluate_accuracy(model, tokenizer, task, n=n, width=1, max_new_tokens=max_new_tokens)


def pretrain(cfg: BaseConfig, out: str | Path, progress: bool = True, log=print) -> Path:
    """Build, pre-train and save the base model into `out` (reused when already there with these settings)."""
    out = Path(out)
    marker = out / "pretrain.json"
    if marker.exists() and json.loads(marker.read_text()).get("config") == asdict(cfg):
        log(f"base model: reusing {out}")
        return out
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    examples = generate(cfg.task, cfg.steps * cfg.batch_size, "train", cfg.seed, distinct=cfg.distinct)
    alphabet = "0123456789+-=\n{}" + "".join(sorted(set(BOXED)))
    task = make_task(cfg.task, examples)
    tokenizer = train_tokenizer([alphabet] + [task.prompt(e) + e["solution"] for e in task.examples[:2000]])
    model = build_model(cfg, tokenizer).train()
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    horizon = max(cfg.steps, cfg.schedule_steps)
    warm = max(1, horizon // 20)

    def lr_at(step: int) -> float:
        if step < warm:
            return cfg.lr * (step + 1) / warm
        t = (step - warm) / max(1, horizon - warm)
        return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.steps, desc=f"pre-training {n_params / 1e6:.1f}M model -> {out}", unit="step")
    t0 = time.perf_counter()
    tokens = 0
    history = []
    checks = cfg.check_from < cfg.steps
    val = make_task(cfg.task, generate(cfg.task, cfg.check_problems, "validation", cfg.seed)) if checks else None
    val_accuracy = None
    steps = 0  # optimiser steps taken
    for step in range(cfg.steps):
        if checks and step >= cfg.check_from and (step - cfg.check_from) % cfg.check_every == 0:
            val_accuracy = accuracy(model, tokenizer, val)
            history.append({"step": step, "val_accuracy": val_accuracy})
            if bar is not None:
                bar.set_postfix(val=f"{val_accuracy:.2f}")
            if val_accuracy >= cfg.target_accuracy:
                break
        batch = task.examples[step * cfg.batch_size : (step + 1) * cfg.batch_size]
        ids, mask = encode_examples(tokenizer, task, batch)
        logits = model(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long()).logits
        target_mask = mask[:, 1:].bool()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1][target_mask], ids[:, 1:][target_mask])
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens += int(mask.sum())
        steps = step + 1
        if step % 20 == 0 or step == cfg.steps - 1:
            history.append({"step": step, "loss": round(loss.item(), 4)})
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - t0
    model.eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    info = {"config": asdict(cfg), "params": n_params, "steps": steps, "val_accuracy": val_accuracy}
    write_json(marker, {**info, "seconds": round(seconds, 1), "history": history})
    log(
        f"base model: {n_params / 1e6:.2f}M parameters, {steps} steps in {seconds:.0f}s, validation accuracy "
        f"{val_accuracy if val_accuracy is None else round(val_accuracy, 3)} -> {out}"
    )
    return out

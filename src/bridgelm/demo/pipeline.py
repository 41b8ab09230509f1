"""The paper's pipeline in miniature, offline, on a CPU: `bridgelm demo --out DIR`.

Stages, each with the project's own functions, each writing under DIR and skipped when its output is there:
  base       pre-train a small Qwen2 on worked arithmetic (cached; see demo/base.py)
  warmup     the base model samples 8 answers per training problem; correct ones kept (paper 4.1)
  sft        warm up Bridge blocks and P-Match blocks on them, base frozen (paper 3.2)
  rl         GRPO for the arms "RLVR only", "P-Match" and "Bridge": same prompts, budget, seeds, settings
  eval       held-out test problems, n samples each: every arm, and Bridge at widths 1..16
  report     DIR/report.md, DIR/results.json and PNG figures

`--quick` runs the same stages at toy sizes (numbers mean nothing; it proves the pipeline); `--seeds 3`
repeats the RL arms over seeds and reports their spread.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from bridgelm.attach import add_bridge, add_pmatch, load_blocks, load_model
from bridgelm.demo.base import BaseConfig, pretrain
from bridgelm.tasks import arith

ARMS = ("base", "rlvr", "pmatch", "bridge")
ARM_TITLES = {"base": "Base", "rlvr": "RLVR only", "pmatch": "P-Match", "bridge": "Bridge"}


@dataclass
class DemoConfig:
    """Sizes of every stage; `quick()` shrinks them to toy sizes."""

    base: BaseConfig = field(default_factory=BaseConfig)  # the base model and its pre-training
    block_heads: int = 4  # heads of the added blocks
    block_head_dim: int = 16  # their head dim (4 x 16 = 64 wide: 12% of this tiny model, like-for-like for P-Match)
    warmup_problems: int = 400  # training problems the base model answers for the warm-up data
    warmup_n: int = 8  # answers per problem (paper: 8)
    sft_epochs: int = 5  # paper: 5
    sft_lr: float = 1e-3  # the paper's 2e-5 is for 7B models; a 2M model needs larger steps
    rl_steps: int = 150  # GRPO steps per arm
    rl_prompts: int = 16  # P, prompts per step
    rl_rollouts: int = 8  # G (paper: 8)
    rl_width: int = 4  # w of Bridge while training (paper: 4 or 8)
    rl_steps_per_rollout: int = 2  # K
    rl_lr: float = 1e-4  # constant after 10% warm-up (the paper: 1e-6 for 1.5B-8B models)
    rl_beta: float = 1e-3  # KL weight (paper: 1e-3)
    max_new_tokens: int = 48  # the longest worked solution is ~40 tokens
    temperature: float = 0.6  # paper: 0.6 for training and evaluation
    top_p: float = 0.95  # evaluation nucleus (paper: 0.95)
    eval_problems: int = 400  # held-out test problems
    eval_n: int = 16  # samples per problem (divisible by every width)
    eval_width: int = 8  # Bridge's width in the main table (paper: 8)
    widths: tuple[int, ...] = (1, 2, 4, 8, 16)  # Bridge widths of the width table (paper Table 3)
    gpass_k: int = 8  # G-Pass@k of the set figures (paper: 8)
    seeds: int = 1  # RL seeds per arm
    threads: int = 0  # torch threads (0 = leave as is)

    @staticmethod
    def quick() -> DemoConfig:
        return DemoConfig(
            base=BaseConfig(
                task=arith.ArithSpec(max_operands=2, max_value=20),  # learnable in seconds by a 0.1M model
                hidden_size=64,
                num_layers=2,
                num_heads=4,
                num_kv_heads=2,
                intermediate_size=128,
                steps=300,
                schedule_steps=300,
                batch_size=32,
                distinct=False,
                check_from=200,
                check_every=50,
                check_problems=20,
            ),
            warmup_problems=48,
            warmup_n=4,
            sft_epochs=1,
            rl_steps=3,
            rl_prompts=4,
            rl_rollouts=4,
            rl_width=2,
            eval_problems=12,
            eval_n=8,
            eval_width=4,
            widths=(1, 2, 4, 8),
            max_new_tokens=40,
        )


class Stages:
    """Runs named stages in order; a stage whose output exists is skipped. Prints a one-line summary of each."""

    def __init__(self, log=print):
        self.log = log
        self.timings: dict[str, float] = {}

    def run(self, name: str, output: Path, fn, summary=lambda result: ""):
        if output.exists():
            self.log(f"[{name}] already done: {output}")
            return None
        t0 = time.perf_counter()
        result = fn()
        self.timings[name] = round(time.perf_counter() - t0, 1)
        text = summary(result)
        self.log(f"[{name}] done in {self.timings[name]:.0f}s{': ' + text if text else ''} -> {output}")
        return result


def _rl_config(cfg: DemoConfig, seed: int, quick: bool):
    from bridgelm.train.rl import RLConfig

    return RLConfig(
        steps=cfg.rl_steps,
        prompts_per_step=cfg.rl_prompts,
        rollouts=cfg.rl_rollouts,
        width=cfg.rl_width,
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=1.0,
        steps_per_rollout=cfg.rl_steps_per_rollout,
        micro_batch_groups=64,
        lr=cfg.rl_lr,
        beta=cfg.rl_beta,
        seed=seed,
        save_every=0,
        keep_last=1,
        eval_every=0,
    )


def run_demo(out: str | Path, cfg: DemoConfig, quick: bool = False, log=print) -> Path:
    """Every stage of the miniature pipeline into `out`; returns the path of report.md."""
    from bridgelm.evaluate import EvalConfig, run_eval, score_run
    from bridgelm.train.rl import train_rl
    from bridgelm.train.sft import SFTConfig, train_sft
    from bridgelm.train.warmup_data import make_warmup_data

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    stages = Stages(log)
    settings = {"quick": quick, **asdict(cfg)}
    (out / "demo.json").write_text(json.dumps(settings, indent=2))

    # 1. base model (cached by its settings)
    t0 = time.perf_counter()
    base_dir = pretrain(cfg.base, out / "base", log=log)
    stages.timings["base"] = round(time.perf_counter() - t0, 1)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    spec = asdict(cfg.base.task)
    # Training prompts may repeat at toy sizes; test problems are always distinct.
    rl_problems = max(cfg.warmup_problems, cfg.rl_steps * cfg.rl_prompts)
    train = arith.Arith("arith", arith.generate(rl_problems, "train", 1, cfg.base.task, distinct=not quick))
    test = arith.load(split="test", size=cfg.eval_problems, seed=0, **spec)
    test.name = "arith"

    # 2. warm-up data from the base model, independent samples
    warm_path = out / "warmup.jsonl"
    warm_task = replace(train, examples=train.examples[: cfg.warmup_problems])
    stages.run(
        "warmup",
        out / "warmup.done",
        lambda: _touch(
            out / "warmup.done",
            make_warmup_data(
                load_model(str(base_dir)),
                tokenizer,
                warm_task,
                warm_path,
                n=cfg.warmup_n,
                sampling=_sampling(cfg, cfg.warmup_n, 1),
            ),
        ),
        lambda stats: json.dumps(stats),
    )

    # 3. SFT warm-up of the new blocks (base frozen)
    for kind in ("bridge", "pmatch"):
        sft_dir = out / f"sft_{kind}"
        sft_cfg = SFTConfig(
            blocks=kind, num_heads=cfg.block_heads, epochs=cfg.sft_epochs, lr=cfg.sft_lr, max_length=256, progress=True
        )
        stages.run(
            f"sft {kind}",
            sft_dir / "blocks.safetensors",
            lambda kind=kind, sft_dir=sft_dir, sft_cfg=sft_cfg: train_sft(
                _with_blocks(load_model(str(base_dir)), kind, cfg), tokenizer, warm_path, sft_cfg, sft_dir
            ),
            lambda r: f"best validation perplexity {r.best_val_ppl:.3f} (epoch {r.best_epoch})",
        )

    # 4. RL arms: same prompts, budget, seeds and settings
    rl_train = replace(train, examples=train.examples)
    for seed in range(cfg.seeds):
        for arm in ("rlvr", "pmatch", "bridge"):
            rl_dir = out / f"rl_{arm}_s{seed}"

            def start(arm=arm):
                model = load_model(str(base_dir))
                if arm != "rlvr":
                    load_blocks(model, out / f"sft_{arm}" / "blocks.safetensors")
                return model

            stages.run(
                f"rl {arm} seed {seed}",
                rl_dir / "done.json",
                lambda rl_dir=rl_dir, start=start, seed=seed: _touch(
                    rl_dir / "done.json",
                    _rl_summary(train_rl(start(), tokenizer, rl_train, _rl_config(cfg, seed, quick), rl_dir)),
                ),
                lambda s: f"reward {s['first_reward']:.3f} -> {s['last_reward']:.3f} over {s['steps']} steps",
            )

    # 5. evaluation on the held-out test split
    def model_of(arm: str, seed: int):
        if arm == "base":
            return str(base_dir)
        return str(json.loads((out / f"rl_{arm}_s{seed}" / "done.json").read_text())["final_dir"])

    eval_dirs: dict[tuple[str, int], Path] = {}
    for seed in range(cfg.seeds):
        for arm in ARMS:
            if arm == "base" and seed > 0:
                continue
            run_dir = out / f"eval_{arm}_s{seed}"
            eval_dirs[(arm, seed)] = run_dir
            widths = list(cfg.widths) if arm == "bridge" else [1]
            ecfg = EvalConfig(
                n=cfg.eval_n,
                width=cfg.eval_width if arm == "bridge" else 1,
                widths=widths,
                max_new_tokens=cfg.max_new_tokens,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                seed=seed,
                gpass_k=cfg.gpass_k,
            )

            def evaluate(arm=arm, seed=seed, run_dir=run_dir, ecfg=ecfg):
                path = model_of(arm, seed)
                run_eval(load_model(path), tokenizer, test, None, ecfg, run_dir, model_id=path)
                return score_run(run_dir, task=test)

            stages.run(
                f"eval {arm} seed {seed}",
                run_dir / "metrics.json",
                evaluate,
                lambda m, arm=arm: _eval_summary(m, arm, cfg),
            )

    # 6. report
    from bridgelm.demo.results import write_demo_report

    report = write_demo_report(out, cfg, eval_dirs, stages.timings, quick)
    log(f"[report] {report}")
    return report


def _sampling(cfg: DemoConfig, n: int, width: int):
    from bridgelm.sampling import SamplingConfig

    return SamplingConfig(
        n=n, width=width, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p
    )


def _with_blocks(model, kind: str, cfg: DemoConfig):
    add = add_bridge if kind == "bridge" else add_pmatch
    return add(model, num_heads=cfg.block_heads, head_dim=cfg.block_head_dim)


def _touch(path: Path, payload):
    from bridgelm.jsonl import write_json

    write_json(path, payload)
    return payload


def _rl_summary(result) -> dict:
    rewards = [h.get("reward") for h in result.history if h.get("reward") is not None]
    head = rewards[: max(1, len(rewards) // 10)]
    tail = rewards[-max(1, len(rewards) // 10) :]
    return {
        "final_dir": str(result.final_dir),
        "steps": result.steps,
        "first_reward": sum(head) / max(1, len(head)),
        "last_reward": sum(tail) / max(1, len(tail)),
    }


def _eval_summary(metrics: dict, arm: str, cfg: DemoConfig) -> str:
    avg = metrics.get("avg", {})
    parts = []
    for w, entry in sorted(avg.items(), key=lambda kv: int(kv[0])):
        acc = entry["metrics"]["accuracy"]["mean"]
        parts.append(f"w={w} accuracy {100 * acc:.1f}%")
    return f"{ARM_TITLES[arm]}: " + ", ".join(parts)

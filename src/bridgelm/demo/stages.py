"""The demo's stages after the base model, each a module-level function of a `Context` (so that a worker process can
run it), each calling the project's own functions: warm-up data, SFT, RL, evaluation and the trace. Every stage
seeds its own random numbers: its result does not depend on which process ran it or what ran beside it.

Each has a one-line summary for the terminal (`*_summary`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from bridgelm.blockfile import load_blocks
from bridgelm.demo.arms import ARMS, TITLES
from bridgelm.demo.config import DemoConfig, eval_config, rl_config, sft_config, sft_seed_of, trace_sampling
from bridgelm.demo.training import rl_numbers, with_blocks
from bridgelm.jsonl import read_records, write_json
from bridgelm.models import load_model
from bridgelm.train.checkpoints import list_checkpoints


@dataclass
class Context:
    """What every stage reads: the output folder, the settings, the base model and the tasks."""

    out: Path
    cfg: DemoConfig
    base_dir: Path
    tokenizer: object
    train: object  # Task: RL prompts (the first warmup_problems are the warm-up problems)
    test: object  # Task: held-out test problems

    def __post_init__(self):
        # None would read as fp32 in every stage, whatever run_demo chose
        assert isinstance(self.cfg.bf16, bool), (
            f"Context needs a resolved DemoConfig.bf16 (True or False), not {self.cfg.bf16!r}")

    def sampler(self, path, blocks: Path | None = None) -> torch.nn.Module:
        """A model folder (plus a block file) loaded for sampling: in bf16 when `cfg.bf16` (1.3-1.5x faster on CPU),
        else float32."""
        return load_model(str(path), blocks, dtype=torch.bfloat16 if self.cfg.bf16 else torch.float32)

    def sft_dir(self, kind: str, seed: int) -> Path:
        return self.out / f"sft_{kind}_s{seed}"

    def rl_dir(self, arm: str, seed: int) -> Path:
        return self.out / f"rl_{arm}_s{seed}"

    def eval_dir(self, arm: str, seed: int) -> Path:
        return self.out / f"eval_{arm}_s{seed}"

    def foreign_dir(self, seed: int) -> Path:
        return self.out / f"eval_bridge_foreign_s{seed}"


def recorded(path: Path, stage, *args, **kwargs):
    """Run `stage(*args, **kwargs)` and write its (JSON) result to `path`, the mark that the stage is done."""
    payload = stage(*args, **kwargs)
    write_json(path, payload)
    return payload


def stage_warmup(ctx: Context) -> dict:
    """The base model samples warmup.n answers per training problem (independently); correct ones are kept."""
    from bridgelm.train.warmup_data import make_warmup_data

    cfg = ctx.cfg
    task = replace(ctx.train, examples=ctx.train.examples[: cfg.warmup_problems])
    path = ctx.out / "warmup.jsonl"
    stats = make_warmup_data(ctx.sampler(ctx.base_dir), ctx.tokenizer, task, path, n=cfg.warmup.n, sampling=cfg.warmup)
    stats["distinct_per_kept_problem"] = distinct_traces(path)
    return stats


def distinct_traces(path: Path) -> float:
    """Mean number of distinct responses among the kept responses of a problem of a warm-up file."""
    kept = [r for r in read_records(path, repair=False) if r.get("kept")]
    counts = [len({json.dumps(x) for x in r["responses"]}) for r in kept]
    return sum(counts) / max(1, len(counts))


def stage_sft(ctx: Context, kind: str, seed: int) -> dict:
    """SFT warm-up of one block set from `seed`, base frozen (paper 3.2); resumes an interrupted run of its folder."""
    from bridgelm.train.sft import train_sft

    sft_cfg = sft_config(ctx.cfg, kind, seed)
    model = with_blocks(load_model(str(ctx.base_dir)), sft_cfg.blocks, ctx.cfg, sft_cfg.placement, seed=seed)
    result = train_sft(model, ctx.tokenizer, ctx.out / "warmup.jsonl", sft_cfg, ctx.sft_dir(kind, seed))
    return {"best_val_ppl": result.best_val_ppl, "best_epoch": result.best_epoch, "steps": result.steps}


def stage_rl(ctx: Context, arm: str, seed: int) -> dict:
    """GRPO of one arm and seed; every arm shares the prompts, budget, settings and seed."""
    return train_arm(ctx, arm, seed, ctx.rl_dir(arm, seed))


def train_arm(ctx: Context, arm: str, seed: int, out_dir: Path, lrs: tuple | None = None) -> dict:
    """GRPO of `arm` from the base model with the blocks its registry entry names: its SFT blocks of the seed's SFT
    run, fresh ones drawn from the seed (the cold start), or none (RLVR); `lrs`: a searched arm's (lr, block_lr)."""
    from bridgelm.train.rl import train_rl

    spec, model = ARMS[arm], load_model(str(ctx.base_dir))
    if spec.sft is not None:
        load_blocks(model, ctx.sft_dir(spec.sft, sft_seed_of(ctx.cfg, seed)) / "blocks.safetensors")
    elif spec.blocks is not None:  # paper Table 4: fresh blocks (zero output), no SFT
        with_blocks(model, spec.blocks, ctx.cfg, spec.placement, seed=seed)
    result = train_rl(model, ctx.tokenizer, ctx.train, rl_config(ctx.cfg, arm, seed, lrs), out_dir)
    return rl_numbers(result)


def model_of(ctx: Context, arm: str, seed: int) -> str:
    if arm == "base":
        return str(ctx.base_dir)
    return str(json.loads((ctx.rl_dir(arm, seed) / "done.json").read_text())["final_dir"])


def stage_eval(ctx: Context, arm: str, seed: int, foreign: bool = False) -> dict:
    """Held-out evaluation of one arm and seed: n samples per problem, every width for Bridge arms.

    `foreign`: control (b), the Bridge model at the main width with groups made of samples of different problems.
    """
    from bridgelm.eval.runner import run_eval
    from bridgelm.eval.score import score_run

    path = model_of(ctx, arm, seed)
    run_dir = ctx.foreign_dir(seed) if foreign else ctx.eval_dir(arm, seed)
    ecfg = eval_config(ctx.cfg, arm, seed, foreign)
    run_eval(ctx.sampler(path), ctx.tokenizer, ctx.test, None, ecfg, run_dir, model_id=path)
    return score_run(run_dir, task=ctx.test)


def stage_trace(ctx: Context, seed: int) -> dict:
    """Diagnostic: the Bridge arm over the course of RL (seed `seed`). For the SFT blocks (step 0) and every RL
    checkpoint: accuracy at w = 1 and w = eval_width on the test problems, and the interaction (share of samples that
    differ from their w = 1 counterpart, drawn with the same random numbers)."""
    from bridgelm.eval.runner import grade_samples, sample_examples

    cfg, test = ctx.cfg, ctx.test
    points = [(0, None)] + [(int(c.name.split("-")[1]), c) for c in list_checkpoints(ctx.rl_dir("bridge", seed))]
    problems = test.examples[: cfg.trace_problems]
    rows, wide = [], cfg.eval.sampling.width
    for step, folder in points:
        if folder is None:
            model = ctx.sampler(ctx.base_dir, ctx.sft_dir("bridge", sft_seed_of(cfg, seed)) / "blocks.safetensors")
        else:
            model = ctx.sampler(folder)
        drawn, acc = {}, {}
        for w in (1, wide):  # the same random draws at both widths
            sampling = trace_sampling(cfg, w, seed)
            samples = sample_examples(model, ctx.tokenizer, test, problems, sampling)
            drawn[w] = [s.token_ids for outs in samples for s in outs]
            acc[w] = sum(map(sum, grade_samples(test, problems, samples))) / len(drawn[w])
        differ = sum(a != b for a, b in zip(drawn[1], drawn[wide])) / len(drawn[1])
        rows.append({"step": step, "w1": acc[1], f"w{wide}": acc[wide], "interaction": differ})
    return {"seed": seed, "width": wide, "points": rows}


def warmup_summary(stats: dict) -> str:
    return (f"{stats['kept']} of {stats['problems']} problems kept ({stats['responses']} correct responses), base "
            f"accuracy {100 * stats['accuracy']:.1f}%")


def sft_summary(result: dict) -> str:
    if result["best_val_ppl"] is None:  # too few kept warm-up problems to hold any out
        return f"{result['steps']} steps, no held-out problems (blocks of the last epoch)"
    return f"best validation perplexity {result['best_val_ppl']:.3f} (epoch {result['best_epoch']})"


def rl_summary(s: dict) -> str:
    return f"reward {s['first_reward']:.3f} -> {s['last_reward']:.3f} over {s['steps']} steps"


def eval_summary(metrics: dict, arm: str) -> str:
    avg = metrics.get("avg", {})
    parts = []
    for w, entry in sorted(avg.items(), key=lambda kv: int(kv[0])):
        acc = entry["metrics"]["accuracy"]["mean"]
        parts.append(f"w={w} accuracy {100 * acc:.1f}%")
    return f"{TITLES.get(arm, arm)}: " + ", ".join(parts)


def trace_summary(trace: dict) -> str:
    w = trace["width"]
    points = trace["points"]
    return "; ".join(
        f"step {p['step']}: w1 {p['w1']:.3f}, w{w} {p[f'w{w}']:.3f}, differ {p['interaction']:.3f}" for p in points
    )

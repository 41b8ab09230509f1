"""The training commands as calls: `run_warmup_data`, `run_sft` and `run_rl` do what `bridgelm warmup-data`, `sft`
and `rl` do, from their configs and sources (bridgelm.source), for the command line and a Python user alike.

Each refuses settings that cannot work before any model loads, then loads the task and the model, checks the run
against its memory plan on a GPU (bridgelm.plan; rank 0 prints it), joins torchrun's process group (when launched
so), runs the trainer of bridgelm.train, and says what it wrote:

    from bridgelm.launch import run_rl
    run_rl(RLConfig(steps=10), DistConfig(), ModelSource("M", device="cuda"), TaskSource("gsm8k"), "rl_run", add="bridge")
"""

from __future__ import annotations

import contextlib
import dataclasses

from bridgelm.blocks import BlockConfig
from bridgelm.dist import Dist, DistConfig
from bridgelm.engine import SamplingConfig
from bridgelm.errors import UserError
from bridgelm.jsonl import check_out
from bridgelm.runs import check_run_folder
from bridgelm.source import ModelSource, TaskSource, warn_slow_bf16
from bridgelm.train.rl_config import RLConfig
from bridgelm.train.sft import SFTConfig


class SettingError(UserError):
    """A refused setting of a run's configs, its message naming the setting (`steps_per_rollout=8`): the command
    line writes it in the words of the setting's flag (`--steps-per-rollout 8`)."""


@contextlib.contextmanager
def settings_checked():
    """A UserError of the body (a config's validation) raised as a SettingError."""
    try:
        yield
    except SettingError:
        raise
    except UserError as err:
        raise SettingError(str(err)) from err


def run_warmup_data(
    source: ModelSource, task: TaskSource, out: str, n: int, sampling: SamplingConfig | None = None,
    chat: bool = False, limit: int | None = None,
) -> dict:
    """`bridgelm warmup-data`: sample `n` answers of the model to each problem of `task` (the first `limit`), grade
    and filter them into the warm-up JSONL `out` (re-runs resume); returns make_warmup_data's counts."""
    from bridgelm.runs import local_source
    from bridgelm.samples import empty_note
    from bridgelm.train.warmup_data import make_warmup_data, warmup_sampling

    with settings_checked():
        warmup_sampling(n, sampling, limit)  # before the model loads
    check_out(out, "file")
    dist = Dist.from_env(source.device)  # under torchrun a cuda source loads on each rank's own GPU
    problems = task.load()
    model, tokenizer = source.load()
    count = len(problems.examples) if limit is None else min(limit, len(problems.examples))
    parts = f" (each of {dist.world} processes its share, merged at the end)" if dist.world > 1 else ""
    if dist.is_main:
        print(f"bridgelm warmup-data: {count} problems x {n} samples -> {out}{parts}")
    stats = make_warmup_data(
        model, tokenizer, problems, out, n, sampling, chat, limit, blocks=local_source(source.blocks), dist=dist
    )
    if not dist.is_main:
        return stats
    cut = f", {stats['cut']} correct but cut by --max-new-tokens and left out" if stats["cut"] else ""
    print(
        f"bridgelm warmup-data: {stats['kept']} problems kept with {stats['responses']} correct responses, "
        f"{stats['dropped']} dropped{cut}; accuracy over all samples {stats['accuracy']:.3f}; in {out}"
    )
    if note := empty_note(stats["samples"], stats["empty"], chat):
        print(f"bridgelm warmup-data: {note}")
    return stats


def run_sft(cfg: SFTConfig, launch: DistConfig, source: ModelSource, data: str, out: str):
    """`bridgelm sft`: warm up `cfg.blocks` blocks added to the model of `source` (its base frozen) on the warm-up
    file `data`, read once; writes the run folder `out`. Returns train_sft's SFTResult."""
    from bridgelm import plan
    from bridgelm.shape import shape_of
    from bridgelm.tokenizer import check_vocab
    from bridgelm.train.sft import ensure_blocks, train_sft
    from bridgelm.warmup_file import load_warmup

    with settings_checked():
        cfg.validate()
    launch.validate()
    check_out(out, "dir")
    check_run_folder(out, "sft")
    warn_slow_bf16(cfg.optim.bf16, source.device, "--bf16")
    warmup = load_warmup(data)  # a bad file is refused before the model loads (checked against it in train_sft)
    _need_peft(cfg.lora)
    model = ensure_blocks(source.load_model(None), cfg)  # --add's blocks (train_sft keeps them), for the plan
    _check_lora_targets(model, cfg.lora)
    tokenizer = source.load_tokenizer()
    check_vocab(model, tokenizer, source.model)
    setup = lambda: plan.SFTSetup(shape_of(model), cfg, Dist.from_env().world, source.dtype)  # noqa: E731
    plan_or_refuse(next(model.parameters()).device, "sft", setup)
    with _joined(model, launch):
        res = train_sft(model, tokenizer, warmup, cfg, out)
        if Dist.from_env().is_main:  # under torchrun only rank 0 reports
            if res.best_val_ppl is not None:
                print(f"bridgelm sft: best validation perplexity {res.best_val_ppl:.3f} (epoch {res.best_epoch})")
            what = "model (LoRA merged, blocks; a folder for --model)" if cfg.lora.enabled else "blocks"
            print(f"bridgelm sft: {what} in {res.blocks_path}, metrics in {res.out_dir / 'metrics.jsonl'}")
    return res


def run_rl(
    cfg: RLConfig, launch: DistConfig, source: ModelSource, task: TaskSource, out: str, *,
    val_task: TaskSource | None = None, add: str | None = None, num_heads: int = BlockConfig.num_heads,
    no_blocks: bool = False, placement: str | None = None,
):
    """`bridgelm rl`: GRPO on `task` from the model of `source`, with fresh blocks of kind `add` (seeded alike on
    every rank and resume), or plain GRPO with `no_blocks` (a model with blocks refused); validated on `val_task`.
    Writes the run folder `out`; returns train_rl's RLResult."""
    from bridgelm.train.rl import train_rl

    with settings_checked():
        cfg.validate(Dist.from_env().world)  # the launch's processes: refused before any model loads
        _refuse_unread(cfg, val_task, no_blocks)
    launch.validate()
    check_out(out, "dir")
    check_run_folder(out, "rl")
    _need_peft(cfg.lora)
    problems = task.load()
    val_problems = val_task.load() if val_task is not None else None
    warn_slow_bf16(cfg.optim.bf16, source.device, "--bf16")
    warn_slow_bf16(cfg.rollout_dtype == "bfloat16", source.device, "--rollout-dtype bfloat16")
    model, tokenizer = source.load()
    _with_blocks(model, source, cfg, add, num_heads, no_blocks, placement or BlockConfig.placement)
    _check_lora_targets(model, cfg.lora)
    setup = lambda: rl_setup(model, tokenizer, problems, cfg, source.dtype)  # noqa: E731
    plan_or_refuse(next(model.parameters()).device, "rl", setup)
    with _joined(model, launch):
        res = train_rl(model, tokenizer, problems, cfg, out, val_task=val_problems)
        if Dist.from_env().is_main:
            print(f"bridgelm rl: {res.steps} steps; the trained model is {res.final_dir} (a folder for --model)")
            if res.best_dir is not None:
                best = f"{res.best_accuracy:.3f} (step {res.best_step})"
                print(f"bridgelm rl: best validation accuracy {best} in {res.best_dir}")
    return res


def _refuse_unread(cfg: RLConfig, val_task: TaskSource | None, no_blocks: bool) -> None:
    """Settings nothing would read: a block_lr without blocks, validation settings without a val_task."""
    if no_blocks and cfg.block_lr is not None:
        raise UserError(f"block_lr={cfg.block_lr} with --no-blocks: there are no blocks to train at that rate")
    if val_task is not None:
        return
    default = RLConfig().validation
    changed = _changed("validation.sampling", cfg.validation.sampling, default.sampling)
    changed += _changed("validation", cfg.validation, default)
    if changed:
        name, value = changed[0]
        raise UserError(f"{name}={value} is read only with --val-task (the task to validate on): expected --val-task "
                        "TASK, or no validation settings")


def _changed(prefix: str, config, default) -> list[tuple[str, object]]:
    """(dotted name, value) of each plain field of `config` whose value differs from `default`'s."""
    values = [(f.name, getattr(config, f.name), getattr(default, f.name)) for f in dataclasses.fields(config)]
    return [(f"{prefix}.{n}", v) for n, v, d in values if v != d and not dataclasses.is_dataclass(v)]


def _with_blocks(model, source: ModelSource, cfg: RLConfig, add: str | None, num_heads: int, no_blocks: bool,
                 placement: str) -> None:
    """`add`'s fresh blocks (`num_heads`, at `placement`) added to the loaded model (the same on every rank and on
    every resume), or, with `no_blocks`, a model that holds blocks refused."""
    from bridgelm.attach import add_seeded_blocks, block_config
    from bridgelm.rng import derive_seed

    have = block_config(model)
    if no_blocks and have is not None:
        raise UserError(f"--no-blocks, but {source.model} holds {have.kind} blocks; load a model without blocks")
    if add:
        add_seeded_blocks(model, add, derive_seed(cfg.seed, "rl-blocks"), num_heads=num_heads, placement=placement)


@contextlib.contextmanager
def _joined(model, launch: DistConfig):
    """Inside torchrun's process group (when launched so; its timeout launch.dist_timeout), which the trainer then
    uses; left on the way out: after every rank gets there when the run ends, at once when it raised."""
    from bridgelm.dist import setup_distributed, teardown_distributed

    try:
        setup_distributed(next(model.parameters()).device, launch.dist_timeout)
        yield
    except BaseException:
        teardown_distributed(wait=False)
        raise
    teardown_distributed()


def _need_peft(settings) -> None:
    """With a LoRA rank: peft installed, checked before the model loads."""
    if settings.enabled:
        from bridgelm.lora import require_peft

        require_peft()


def _check_lora_targets(model, settings) -> None:
    """With a LoRA rank: every LoRA target names a module of the loaded base (outside the blocks)."""
    if settings.enabled:
        from bridgelm.lora import check_targets

        with settings_checked():
            check_targets(model, settings)


def plan_or_refuse(device, command: str, make_setup) -> None:
    """On a CUDA device: the run's per-GPU memory plan (`make_setup()`, a bridgelm.plan setup; rank 0 prints it), and
    a run that cannot fit refused, with the numbers, before it starts."""
    from bridgelm import plan_fit

    budget = plan_fit.device_memory_gib(device)
    if budget is None:  # not a GPU: nothing to plan against
        return
    text = plan_fit.check_fits(make_setup(), budget)
    if Dist.from_env().is_main:
        print(f"bridgelm {command}: memory per GPU (bridgelm plan)\n{text}")


def rl_setup(model, tokenizer, task, cfg: RLConfig, dtype: str):
    """The plan's setup of an rl run; its prompts' length is the task's longest prompt."""
    from bridgelm import plan
    from bridgelm.shape import shape_of
    from bridgelm.engine import encode_prompts

    prompts = encode_prompts(tokenizer, [task.prompt(ex) for ex in task.examples], cfg.chat)
    return plan.Setup(shape_of(model), cfg, Dist.from_env().world, dtype, max(map(len, prompts)))

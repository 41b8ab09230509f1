"""Bridge inside TRL's GRPOTrainer (TRL 1.16.0, pinned): `BridgeGRPOTrainer` draws each prompt's
`num_generations` rollouts as Bridge groups and keeps those groups whole through every step TRL takes.

    from datasets import Dataset
    import bridgelm
    from bridgelm.integrations.trl import BridgeGRPOConfig, BridgeGRPOTrainer

    model = bridgelm.load_model("HuggingFaceTB/SmolLM2-135M-Instruct", blocks="blocks.safetensors")
    args = BridgeGRPOConfig(output_dir="out", num_generations=8, per_device_train_batch_size=16,
                            max_completion_length=256, temperature=0.6, loss_type="dapo",
                            bridge_width=4)  # groups of 4 (default: num_generations); must divide it

    def reward(completions, **kwargs):  # conversational prompts: each completion is a list of messages
        return [float("42" in c[0]["content"]) for c in completions]

    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": "What is 6 x 7?"}]}] * 64)
    trainer = BridgeGRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset)
    trainer.train()

examples/trl_grpo.py is this, complete and runnable (`--toy` for a tiny random model). `bridge_width` is a field of
`BridgeGRPOConfig` (GRPOConfig's subclass), so TrlParser and YAML configs set it and the run records it; a plain
GRPOConfig gives groups of `num_generations`.

What changes against GRPOTrainer, and nothing else (rewards, advantages and the loss are TRL's own):
- rollouts come from bridgelm's engine (`generate_ids`): each run of `width` consecutive rows (copies of one
  prompt, as TRL's sampler lays them out) is one Bridge group;
- the generated batch is shuffled group by group, not row by row, before TRL splits it into micro-batches;
- every teacher-forced forward (old, reference and trained log-probs) gets the group layout (`bridge_groups`, a
  `grouped.Groups` of consecutive runs of `width`), through a forward pre-hook held only for that call;
- with beta > 0 and an in-memory model the reference is a frozen copy of the model given, blocks included, taken
  before TRL or peft change it (TRL would reload the model's folder, which drops blocks attached in memory, and an
  in-memory model may have none); TRL's reference set-up (dropout, fp32 head, fused head) is applied to it.
- with `peft_config` (a peft LoraConfig, as GRPOTrainer takes it) LoRA goes on the base only: modules inside the
  blocks are excluded from its targets and the blocks stay trainable beside the LoRA weights; with beta > 0 the
  reference is the starting policy without LoRA (a fresh LoRA changes nothing); `save_model` and the
  checkpoints write one model folder, LoRA merged into the base with the blocks, and the adapter in `lora/`
  (bridgelm.lora), which a resumed run reads back.
Settings it cannot honour are refused at construction, in one line naming the setting: batch settings that would
split a group (the eval batch settings too where an eval set is given, whatever eval_strategy says), a width that is
not a positive integer, temperature 0, FSDP and DeepSpeed ZeRO-3 (rollouts would decode on sharded weights), vLLM,
continuous batching, `rollout_func`, and `tools` or `environment_factory` at a width above 1 (their rollouts, or the
turns after a tool call, would not be Bridge groups), sampling settings the engine does not take (min_p,
repetition_penalty, generation_kwargs), mask_truncated_completions at a width above 1 (a truncated sibling would be
hidden from its group in training, not while sampling), and sync_ref_model with peft_config (as GRPOTrainer refuses
it). Rollout seeds are keyed by the optimizer step, so a run resumed from a checkpoint at a rollout boundary
(save_steps a multiple of steps_per_generation / gradient_accumulation_steps) draws what the run it resumes would
have drawn; TRL keeps no rollouts in a checkpoint, so one saved inside a generation batch samples it anew. Text
prompts, plain or conversational; no images.
TRL's private methods are wrapped with their arguments forwarded as given.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import os
import re
from dataclasses import dataclass, field

from pathlib import Path

import torch
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.callbacks import SyncRefModelCallback
from trl.trainer.utils import add_fused_lm_head, disable_dropout_in_model, split_tensor_dict

from bridgelm import lora
from bridgelm.attach import added_parameters, block_config
from bridgelm.blocks import KINDS
from bridgelm.engine import SamplingConfig, generate_ids
from bridgelm.errors import UserError, check_int, check_number
from bridgelm.grouped import KWARG, Groups
from bridgelm.integrations.loading import in_own_words
from bridgelm.rng import derive_seed


@dataclass
class BridgeGRPOConfig(GRPOConfig):
    """TRL's GRPOConfig with the Bridge width: `bridge_width` rows of one prompt sample as one Bridge group."""

    bridge_width: int | None = field(
        default=None,
        metadata={"help": "Rows of one prompt sampled as one Bridge group (default: num_generations); must divide "
                          "num_generations and the per-device batch sizes; 1: independent rollouts, no blocks needed."},
    )

    def __post_init__(self):
        check_width(self.bridge_width, "BridgeGRPOConfig")
        super().__post_init__()


def check_width(width, name: str) -> None:
    """UserError unless `width` is None or a positive integer (2.7, "two", True and 0 are refused, not rounded)."""
    if width is not None:
        check_int(f"{name}: bridge_width", width, note=" (rows per Bridge group)")


def bridge_width_of(args) -> int:
    """The Bridge width of TRL config `args`: its `bridge_width` field, else `num_generations`."""
    width = getattr(args, "bridge_width", None)
    check_width(width, "BridgeGRPOTrainer")
    return args.num_generations if width is None else width


def check_sharding(args) -> None:
    """Refuse FSDP and DeepSpeed ZeRO-3: the engine decodes on the module's own weights, which are shards there."""
    deepspeed = getattr(args, "hf_deepspeed_config", None)
    zero3 = (deepspeed is not None and deepspeed.is_zero3()) or (
        os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true")
        and os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3"
    )
    fsdp = bool(getattr(args, "fsdp", None)) or os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true")
    if fsdp or zero3:
        what = "fsdp" if fsdp else "DeepSpeed ZeRO-3"
        raise UserError(
            f"BridgeGRPOTrainer: {what} is not supported (rollouts would decode on sharded weights): use DDP or "
            "DeepSpeed ZeRO-1/2 here, or `bridgelm rl --fsdp`, which samples from a gathered copy"
        )


def check_arguments(given: dict, width: int) -> None:
    """Refuse GRPOTrainer arguments (`given` by name) whose rollouts would not be Bridge groups of `width`."""
    name = "BridgeGRPOTrainer"
    if given.get("rollout_func") is not None:
        raise UserError(f"{name}: rollout_func is not supported: rollouts come from bridgelm's engine")
    if width > 1:
        for key in ("tools", "environment_factory"):
            if given.get(key):
                raise UserError(f"{name}: {key} at bridge_width={width}: TRL samples the turns after a tool call row "
                                f"by row, outside their Bridge group: use bridge_width=1, or no {key}")
    args = given.get("args")
    if given.get("peft_config") is not None and args is not None and args.beta != 0.0 and args.sync_ref_model:
        raise UserError(f"{name}: sync_ref_model=True with peft_config is not supported (the reference is the base "
                        "without LoRA): use sync_ref_model=False")  # as GRPOTrainer refuses it


def check_group_settings(args, width: int, evaluates: bool = False) -> None:
    """Refuse TRL settings that cannot keep Bridge groups of `width` whole (one line, naming the numbers);
    `evaluates`: an eval set was given (the eval batch settings count whatever eval_strategy says)."""
    name = "BridgeGRPOTrainer"
    check_number(f"{name}: temperature", args.temperature, 0, open_low=True, note=" (GRPO samples)")
    try:  # top_p, top_k, max_completion_length: what the engine would refuse at the first rollout
        rollout_sampling(args, width, seed=0).validate()
    except UserError as err:  # said in TRL's words
        raise in_own_words(err, name, "max_completion_length") from None
    # the counts of rows that groups of `width` must fill whole (a batch that splits a group mixes its prompts)
    counts = {"num_generations": args.num_generations, "per_device_train_batch_size": args.per_device_train_batch_size}
    if evaluates or args.eval_strategy != "no":
        counts["num_generations_eval"] = args.num_generations_eval or args.num_generations
        counts["per_device_eval_batch_size"] = args.per_device_eval_batch_size
    split = [key for key, count in counts.items() if count % width]
    if split:
        raise UserError(f"{name}: {split[0]}={counts[split[0]]} is not a multiple of the Bridge width {width} "
                        f"(bridge_width={width}; default: num_generations): a batch would split a group")
    engine_only = {"use_vllm": False, "use_transformers_continuous_batching": False, "min_p": None,
                   "repetition_penalty": 1.0, "generation_kwargs": None}  # settings bridgelm's engine does not take
    for key, default in engine_only.items():
        if getattr(args, key, default) not in (default, {}):
            raise UserError(f"{name}: {key}={getattr(args, key)!r}: rollouts come from bridgelm's engine, which "
                            f"samples with temperature, top_p and top_k only: leave {key} at {default!r}")
    if width > 1 and getattr(args, "mask_truncated_completions", False):
        raise UserError(f"{name}: mask_truncated_completions=True at bridge_width={width}: TRL masks a truncated "
                        "completion out of every forward, so its siblings' blocks would not read it in training, "
                        "though they read it while sampling: leave it False, or bridge_width=1")


def rollout_sampling(args, width: int, seed: int) -> SamplingConfig:
    """The engine's sampling for one rollout call: groups of `width` rows, with TRL's sampling settings."""
    return SamplingConfig(n=width, width=width, max_new_tokens=args.max_completion_length,
                          temperature=args.temperature, top_p=args.top_p, top_k=args.top_k or 0, seed=seed)


def group_shuffle(batch: dict, width: int) -> dict:
    """`batch`'s rows permuted group by group: runs of `width` rows move together (TRL's shuffle, per group)."""
    size = len(next(v for v in batch.values() if v is not None))
    groups = torch.randperm(size // width)  # [B / w]
    rows = (groups[:, None] * width + torch.arange(width)).reshape(-1)  # [B]

    def permute(v):
        if v is None or (isinstance(v, torch.Tensor) and v.ndim == 0):
            return v
        return v[rows] if isinstance(v, torch.Tensor) else [v[i] for i in rows]

    return {k: permute(v) for k, v in batch.items()}


class BridgeGRPOTrainer(GRPOTrainer):
    """TRL's GRPOTrainer with Bridge groups of `args.bridge_width` (default `num_generations`) rows of one prompt."""

    def __init__(self, model, reward_funcs, args: GRPOConfig | None = None, *rest, **kwargs):
        bound = inspect.signature(GRPOTrainer.__init__).bind(self, model, reward_funcs, args, *rest, **kwargs)
        given = bound.arguments  # GRPOTrainer's arguments by name, however they were passed
        if args is not None:  # checked before TRL loads anything; TRL's default config after
            check_sharding(args)
            check_group_settings(args, bridge_width_of(args), evaluates=given.get("eval_dataset") is not None)
        check_arguments(given, 1 if args is None else bridge_width_of(args))
        check_lora_outside_blocks(model)
        if given.get("peft_config") is not None:
            given["peft_config"] = lora_on_base(given["peft_config"], model)
        own_reference = isinstance(model, torch.nn.Module) and args is not None and args.beta != 0.0
        if own_reference:  # TRL would reload the model's folder for a reference: it gets a frozen copy instead
            beta, sync = args.beta, args.sync_ref_model
            args.beta, args.sync_ref_model = 0.0, False
            reference = copy.deepcopy(model)  # before TRL patches the policy's forward (see frozen_reference)
        try:
            super().__init__(*bound.args[1:], **bound.kwargs)
        finally:
            if own_reference:
                args.beta, args.sync_ref_model = beta, sync
        check_sharding(self.args)
        self.bridge_width = bridge_width_of(self.args)
        check_group_settings(self.args, self.bridge_width, evaluates=self.eval_dataset is not None)
        check_arguments(given, self.bridge_width)
        policy = self.accelerator.unwrap_model(self.model)
        has_blocks = block_config(policy) is not None
        for p in added_parameters(policy).values():  # peft froze everything but its adapter: the blocks train too
            p.requires_grad_(True)
        if self.bridge_width > 1 and not has_blocks:
            raise UserError(
                f"BridgeGRPOTrainer: bridge_width={self.bridge_width} needs a model with Bridge blocks, and this one "
                "has none: attach them (bridgelm.add_bridge, or load_model(..., blocks=FILE)), or bridge_width=1"
            )
        if own_reference:
            self.beta = beta
            reference = frozen_reference(reference, self.args, self.temperature)
            self.ref_model = self.accelerator.prepare_model(reference, evaluation_mode=True)
            if sync:
                self.add_callback(SyncRefModelCallback(ref_model=self.ref_model, accelerator=self.accelerator))

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        """Completion ids of each row of `prompt_ids` (each prompt repeated in runs of the width), one Bridge group
        per run; log-probs None, as TRL's own transformers path returns. TRL's other arguments are read by name."""
        given = inspect.signature(super()._generate_single_turn).bind(prompt_ids, *args, **kwargs).arguments
        width = self.bridge_width
        if given.get("images") is not None or given.get("multimodal_fields") or len(prompt_ids) % width:
            raise UserError(f"BridgeGRPOTrainer: {len(prompt_ids)} text prompt rows expected in runs of {width}")
        firsts = prompt_ids[::width]  # one prompt per group
        # TRL repeats each prompt num_generations times, which the width divides (checked at __init__, and here: an
        # evaluate() of an eval set the trainer was not given, with other batch settings, could split a group)
        if any(prompt_ids[i] != firsts[i // width] for i in range(len(prompt_ids))):
            raise UserError(f"BridgeGRPOTrainer: a run of {width} rows holds different prompts: a batch split a Bridge "
                            "group; num_generations(_eval) and per_device_(train|eval)_batch_size must be multiples "
                            f"of bridge_width={width}")
        sampling = rollout_sampling(self.args, width, self._rollout_seed())
        model = base_of(self.accelerator.unwrap_model(self.model))  # with peft: the model its LoRA layers are in
        training = model.training
        model.eval()
        try:
            with torch.no_grad():
                pad = self._tokenizer.pad_token_id
                pad = self.eos_token_ids[0] if pad is None else pad
                try:
                    drawn = generate_ids(model, firsts, sampling, self.eos_token_ids, pad)
                except UserError as err:  # a prompt with no room for max_completion_length, in TRL's words
                    raise in_own_words(err, "BridgeGRPOTrainer", "max_completion_length") from None
        finally:
            model.train(training)
        return [sample.token_ids for group in drawn for sample in group], None

    def _rollout_seed(self) -> int:
        """A seed no other rollout call of this run takes, the same when the run resumes: keyed by the optimizer
        step (which a resume restores, where TRL's own micro-step counter restarts at 0), train or eval, the call's
        place within that step, and the rank."""
        key = (self.state.global_step, "train" if self.model.training else "eval")
        calls = getattr(self, "_rollout_calls", {})
        self._rollout_calls = {key: calls.get(key, 0) + 1}
        return derive_seed(self.args.seed, "trl-rollouts", *key, calls.get(key, 0), self.accelerator.process_index)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """TRL's save, but with peft one model folder: the LoRA merged into the base, the blocks, lora/ (the
        adapter); without peft, transformers' own."""
        policy = self.accelerator.unwrap_model(self.model)
        if not is_peft(policy):
            return super()._save(output_dir, state_dict)
        if not self.args.should_save:
            return None
        folder = Path(output_dir if output_dir is not None else self.args.output_dir)
        base = base_of(policy)
        base._bridgelm_lora = policy.peft_config[lora.ADAPTER]
        lora.save_folder(base, folder)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(folder)
        return None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """A checkpoint of `_save`: with peft, its LoRA weights and blocks (the base is the model given)."""
        policy = self.accelerator.unwrap_model(model if model is not None else self.model)
        if not is_peft(policy):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        lora.load_trained(base_of(policy), Path(resume_from_checkpoint))
        return None

    def _prepare_inputs(self, generation_batch):
        """TRL's `_prepare_inputs`, with the generated batch shuffled group by group before it is split."""
        if not self.model.training:
            return self._generate_and_score_completions(generation_batch)
        steps = self.args.steps_per_generation
        if self._step % (steps * self.num_iterations) == 0 or self._buffered_inputs is None:
            batch = group_shuffle(self._generate_and_score_completions(generation_batch), self.bridge_width)
            self._buffered_inputs = split_tensor_dict(batch, steps)
        return self._buffered_inputs[self._step % steps]

    def _get_per_token_logps_and_entropies(self, model, input_ids, *args, **kwargs):
        """TRL's per-token log-probs, each forward given the Bridge groups of its rows (runs of the width); TRL's
        arguments forwarded as given (its chunk size read by name)."""
        given = inspect.signature(super()._get_per_token_logps_and_entropies).bind(model, input_ids, *args, **kwargs)
        rows = given.arguments.get("batch_size") or input_ids.size(0)
        # check_group_settings made the batches multiples of the width
        assert rows % self.bridge_width == 0 and input_ids.size(0) % self.bridge_width == 0, (
            f"BridgeGRPOTrainer: log-probs of {input_ids.size(0)} rows in chunks of {rows} would split groups of "
            f"{self.bridge_width}")
        with grouped_forwards(self.accelerator.unwrap_model(model), self.bridge_width):
            return super()._get_per_token_logps_and_entropies(model, input_ids, *args, **kwargs)


def frozen_reference(reference: torch.nn.Module, args, temperature: float) -> torch.nn.Module:
    """`reference` (a copy of the model given, taken before TRL touched it) frozen and set up as TRL sets up a
    reference it loads: dropout off, the LM head in fp32 if asked, TRL's fused LM head (its KL log-probs).

    The copy is taken first because TRL replaces the policy's `forward` (and, with cast_lm_head_to_fp32, its LM
    head's) by functions that close over the policy's own modules; deepcopy shares functions, so a copy taken after
    would run the trained policy in its plain forward."""
    reference = reference.eval().requires_grad_(False)
    if args.disable_dropout:
        disable_dropout_in_model(reference)
    model = base_of(reference)
    if args.cast_lm_head_to_fp32:  # as TRL casts its own reference's head (the fused head reads its weight)
        head = model.get_output_embeddings()
        dtype = head.weight.dtype
        head.float()
        head.forward = lambda hidden: torch.nn.functional.linear(hidden.float(), head.weight.float(),
                                                                 None if head.bias is None else head.bias.float())
        if model.config.tie_word_embeddings:  # the embeddings are that fp32 weight: their output keeps its dtype
            model.get_input_embeddings().register_forward_hook(lambda module, args, out: out.to(dtype))
    add_fused_lm_head(model, temperature=temperature, cast_lm_head_to_fp32=args.cast_lm_head_to_fp32)
    return reference


def is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def base_of(model: torch.nn.Module) -> torch.nn.Module:
    """The model a PeftModel wraps (its LoRA layers are injected there), or `model` itself."""
    return model.get_base_model() if is_peft(model) else model


def check_lora_outside_blocks(model) -> None:
    """UserError for a PeftModel whose LoRA wraps modules inside the Bridge blocks (its checkpoints would not load
    back: bridgelm keeps the blocks whole beside LoRA on the base)."""
    pattern = lora.block_pattern(base_of(model)) if is_peft(model) else None
    inside = pattern and next((n for n, m in base_of(model).named_modules()
                               if hasattr(m, "lora_A") and re.fullmatch(pattern, n)), None)
    if inside:
        raise UserError(f"BridgeGRPOTrainer: the PeftModel given has LoRA inside the Bridge blocks ({inside}): give "
                        "the model without LoRA and a peft_config (LoRA on the base, the blocks trained whole), or "
                        "leave the blocks out of its targets (exclude_modules)")


def lora_on_base(config, model):
    """A copy of peft config `config` whose targets leave out every module inside the Bridge blocks (a block's
    o_proj is not the attention's); a config that is not LoRA is refused."""
    peft = lora.require_peft()
    if not isinstance(config, peft.LoraConfig):
        raise UserError(f"BridgeGRPOTrainer: peft_config of type {type(config).__name__}: expected a peft.LoraConfig "
                        "(LoRA on the base beside the trainable blocks)")
    # a model given by its folder or hub id is loaded by TRL: the blocks' names, whichever kind it has
    blocks = lora.block_pattern(model) if isinstance(model, torch.nn.Module) else rf"(.*\.)?({'|'.join(KINDS)})(\..*)?"
    if blocks is None:
        return config
    exclude = config.exclude_modules
    if isinstance(exclude, (list, tuple, set)):
        exclude = "|".join(rf"(.*\.)?{re.escape(e)}" for e in exclude)
    return dataclasses.replace(config, exclude_modules=blocks if not exclude else rf"(?:{exclude})|(?:{blocks})")


@contextlib.contextmanager
def grouped_forwards(model: torch.nn.Module, width: int):
    """While open, every forward of `model` gets `bridge_groups`: its rows in consecutive groups of `width`."""

    def add_groups(module, args, kwargs):
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]  # [B, S]
        valid = kwargs.get("attention_mask")  # [B, S] or None
        kwargs[KWARG] = Groups.contiguous_width(ids.shape[0], width, valid)
        return args, kwargs

    handle = model.register_forward_pre_hook(add_groups, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()

"""Bridge inside TRL's GRPOTrainer (TRL 1.16.0, pinned): `BridgeGRPOTrainer` draws each prompt's
`num_generations` rollouts as Bridge groups and keeps those groups whole through every step TRL takes.

    from datasets import Dataset
    from trl import GRPOConfig
    import bridgelm
    from bridgelm.integrations.trl import BridgeGRPOTrainer

    model = bridgelm.load_model("HuggingFaceTB/SmolLM2-135M-Instruct", blocks="blocks.safetensors")
    args = GRPOConfig(output_dir="out", num_generations=8, per_device_train_batch_size=16,
                      max_completion_length=256, temperature=0.6, loss_type="dapo")

    def reward(completions, **kwargs):
        return [float("42" in c) for c in completions]

    dataset = Dataset.from_list([{"prompt": "What is 6 x 7?"}] * 64)
    trainer = BridgeGRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                                bridge_width=4)  # groups of 4 (default: num_generations); must divide it
    trainer.train()

What changes against GRPOTrainer, and nothing else (rewards, advantages and the loss are TRL's own):
- rollouts come from bridgelm's engine (`generate_ids`): each run of `width` consecutive rows (copies of one
  prompt, as TRL's sampler lays them out) is one Bridge group;
- the generated batch is shuffled group by group, not row by row, before TRL splits it into micro-batches;
- every teacher-forced forward (old, reference and trained log-probs) gets the group layout (`bridge_groups`, a
  `grouped.Groups` of consecutive runs of `width`), through a forward pre-hook held only for that call;
- with beta > 0 the reference is a frozen copy of the starting policy, blocks included (TRL would reload the
  model's folder, which drops blocks attached in memory).
Batch settings that would split a group are refused before training, in one line naming the numbers. Text prompts
only; vLLM, continuous batching and `rollout_func` are refused (their rollouts would not be Bridge groups), and so
are sampling settings the engine does not take (min_p, repetition_penalty, generation_kwargs).
"""

from __future__ import annotations

import contextlib
import copy

import torch
from trl import GRPOTrainer
from trl.trainer.utils import split_tensor_dict

from bridgelm.attach import block_config
from bridgelm.engine import SamplingConfig, generate_ids
from bridgelm.errors import UserError
from bridgelm.grouped import KWARG, Groups
from bridgelm.rng import derive_seed


def check_group_settings(args, width: int) -> None:
    """Refuse TRL settings that cannot keep Bridge groups of `width` whole (one line, naming the numbers)."""
    name = "BridgeGRPOTrainer"
    if width < 1 or args.num_generations % width:
        raise UserError(f"{name}: bridge_width={width} does not divide num_generations={args.num_generations}")
    if args.per_device_train_batch_size % width:
        raise UserError(
            f"{name}: per_device_train_batch_size={args.per_device_train_batch_size} is not a multiple of the Bridge "
            f"width {width} (num_generations={args.num_generations}): a micro-batch would split a group"
        )
    if args.eval_strategy != "no":
        n_eval = args.num_generations_eval or args.num_generations
        if n_eval % width or args.per_device_eval_batch_size % width:
            raise UserError(
                f"{name}: num_generations_eval={n_eval} and per_device_eval_batch_size="
                f"{args.per_device_eval_batch_size} must both be multiples of the Bridge width {width}"
            )
    engine_only = {"use_vllm": False, "use_transformers_continuous_batching": False, "min_p": None,
                   "repetition_penalty": 1.0, "generation_kwargs": None}  # settings bridgelm's engine does not take
    for key, default in engine_only.items():
        if getattr(args, key, default) not in (default, {}):
            raise UserError(f"{name}: {key}={getattr(args, key)!r}: rollouts come from bridgelm's engine, which "
                            f"samples with temperature, top_p and top_k only: leave {key} at {default!r}")


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
    """TRL's GRPOTrainer with Bridge groups of `bridge_width` (default `num_generations`) rows of one prompt."""

    def __init__(self, *args, bridge_width: int | None = None, **kwargs):
        config = kwargs.get("args") if "args" in kwargs else (args[2] if len(args) > 2 else None)
        if config is not None:  # checked before TRL loads anything; TRL's default config after
            check_group_settings(config, config.num_generations if bridge_width is None else int(bridge_width))
        if kwargs.get("rollout_func") is not None:
            raise UserError("BridgeGRPOTrainer: rollout_func is not supported: rollouts come from bridgelm's engine")
        super().__init__(*args, **kwargs)
        self.bridge_width = self.args.num_generations if bridge_width is None else int(bridge_width)
        check_group_settings(self.args, self.bridge_width)
        has_blocks = block_config(self.accelerator.unwrap_model(self.model)) is not None
        if self.bridge_width > 1 and not has_blocks:
            raise UserError(
                f"BridgeGRPOTrainer: bridge_width={self.bridge_width} needs a model with Bridge blocks, and this one "
                "has none: attach them (bridgelm.add_bridge, or load_model(..., blocks=FILE)), or bridge_width=1"
            )
        reference = None if self.ref_model is None else self.accelerator.unwrap_model(self.ref_model)
        if has_blocks and reference is not None and block_config(reference) is None:
            # TRL reloads the reference from the model's folder, without the blocks attached in memory: use a
            # frozen copy of the starting policy, blocks included
            reference = copy.deepcopy(self.accelerator.unwrap_model(self.model)).eval().requires_grad_(False)
            self.ref_model = self.accelerator.prepare_model(reference, evaluation_mode=True)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """Completion ids of each row of `prompt_ids` (each prompt repeated in runs of the width), one Bridge group
        per run; log-probs None, as TRL's own transformers path returns."""
        width = self.bridge_width
        if images is not None or multimodal_fields or len(prompt_ids) % width:
            raise UserError(f"BridgeGRPOTrainer: {len(prompt_ids)} text prompt rows expected in runs of {width}")
        firsts = prompt_ids[::width]  # one prompt per group
        if any(prompt_ids[i] != firsts[i // width] for i in range(len(prompt_ids))):
            raise ValueError(f"BridgeGRPOTrainer: a run of {width} rows holds different prompts: groups were split")
        sampling = SamplingConfig(
            n=width, width=width, max_new_tokens=self.max_completion_length, temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k or 0,
            seed=derive_seed(self.args.seed, "trl-rollouts", self._step, self.accelerator.process_index),
        )
        model = self.accelerator.unwrap_model(self.model)
        training = model.training
        model.eval()
        try:
            with torch.no_grad():
                pad = self._tokenizer.pad_token_id
                pad = self.eos_token_ids[0] if pad is None else pad
                drawn = generate_ids(model, firsts, sampling, self.eos_token_ids, pad)
        finally:
            model.train(training)
        return [sample.token_ids for group in drawn for sample in group], None

    def _prepare_inputs(self, generation_batch):
        """TRL's `_prepare_inputs`, with the generated batch shuffled group by group before it is split."""
        if not self.model.training:
            return self._generate_and_score_completions(generation_batch)
        steps = self.args.steps_per_generation
        if self._step % (steps * self.num_iterations) == 0 or self._buffered_inputs is None:
            batch = group_shuffle(self._generate_and_score_completions(generation_batch), self.bridge_width)
            self._buffered_inputs = split_tensor_dict(batch, steps)
        return self._buffered_inputs[self._step % steps]

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        pixel_values=None,
        image_grid_thw=None,
        num_images=None,
        pixel_attention_mask=None,
        spatial_shapes=None,
        num_tiles=None,
        image_sizes=None,
        token_type_ids=None,
        mm_token_type_ids=None,
        image_position_ids=None,
    ):
        """TRL's per-token log-probs, each forward given the Bridge groups of its rows (runs of the width)."""
        rows = batch_size or input_ids.size(0)
        if rows % self.bridge_width or input_ids.size(0) % self.bridge_width:
            raise ValueError(
                f"BridgeGRPOTrainer: log-probs of {input_ids.size(0)} rows in chunks of {rows} would split groups of "
                f"{self.bridge_width}"
            )
        with grouped_forwards(self.accelerator.unwrap_model(model), self.bridge_width):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                pixel_values, image_grid_thw, num_images, pixel_attention_mask, spatial_shapes, num_tiles,
                image_sizes, token_type_ids, mm_token_type_ids, image_position_ids,
            )


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

"""Per-GPU memory of a GRPO (or SFT) run before it starts: pure arithmetic on the model's shapes and the run's settings.

The model is built on the meta device from its config.json (nothing else is read or downloaded); one function per
row, each in bytes on one GPU (W ranks, b bytes per weight of --dtype, P parameters, T of them trained, h hidden
size, i intermediate size, n layers, V vocabulary, L = prompt tokens + max_new_tokens a row):

- weights         P x b, / W under FSDP (each rank holds a shard)
- gradients       T x b, / W under FSDP (freed by the optimiser step: held during the update only)
- optimiser       AdamW's two moments, T x b each (fp32 with the default --dtype float32), / W under FSDP
- reference       beta > 0: a frozen copy of the policy, P x b, / W under FSDP
- rollout replica the copy the rollouts sample from (RLConfig.replica_dtype: rollout_dtype, or bf16 under --fsdp
                  --bf16), P x its bytes, kept between steps (rollouts.RolloutPolicy; with or without FSDP)
- rollout model   without a replica under FSDP, what sampling gathers: the rest of the model in fp32,
                  P x b x (W - 1) / W, during the rollout phase only
- KV cache        n x 2 x kv_heads x head_dim x rows x L x bytes of the sampling dtype (the replica's, else b),
                  rows = a rank's rollouts (prompts_per_step / W x G) bounded by max_batch_sequences and
                  max_batch_tokens / L (whole groups)
- activations     of one micro-batch of m rows (micro_batch_groups x w, bounded by a mini-batch's groups and by
                  micro_batch_tokens / L, whole groups, at least one): m x L x a x (n x (10 h + 4 i)) values kept for
                  the backward, or with gradient checkpointing m x L x a x (n x h + 10 h + 4 i) (every layer's
                  input, one layer recomputed), a the bytes of the compute dtype (2 under --bf16); plus the response
                  tokens' logits in fp32 and their log-softmax: m x max_new_tokens x V x 4 x 2. (10 h + 4 i: the
                  layer's norms, q/k/v, attention output, projections and residuals, and the SwiGLU's gate, up,
                  activation and product; attention scores are not kept by sdpa.)

The run holds weights, optimiser, reference and rollout replica throughout, and at a time either the rollout phase
(rollout model and KV cache) or the update phase (gradients and activations): per GPU = weights + optimiser +
reference + rollout replica + max(rollout model + KV cache, gradients + activations). Decode-step logits, the
allocator's fragmentation and CUDA's own context (~0.5 GiB) are not counted.

SFT (`SFTSetup`: every rank holds the whole model, no FSDP) trains the blocks alone (T = the blocks' parameters,
B): weights P x b, gradients B x b, optimiser 2 x B x b, no reference, replica or rollouts; activations as above
for m = micro-batch groups (micro_batch_groups, bounded by a rank's share of batch_groups) x max_width rows of
L = max_length tokens, with the logits of max_length tokens a row (its response is shorter).

    bridgelm plan --model M --world-size 8 --fsdp --gpu-memory-gib 80 --json
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from bridgelm.attach import added_parameters

if TYPE_CHECKING:
    from bridgelm.train.rl_config import RLConfig
    from bridgelm.train.sft import SFTConfig

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class Shape:
    """What the arithmetic needs of a model."""

    params: int  # P: every parameter (added blocks included), tied ones once
    blocks: int  # of which the added Bridge / P-Match blocks'
    layers: int  # n, decoder layers
    hidden: int  # h
    intermediate: int  # i, the feed-forward's inner size
    kv_heads: int  # key/value heads
    head_dim: int  # per head
    vocab: int  # V


def shape_of(model) -> Shape:
    """The Shape of a (meta-device) model."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    unique = {id(p): p.numel() for p in model.parameters()}
    blocks = sum(p.numel() for p in added_parameters(model).values())
    return Shape(sum(unique.values()), blocks, c.num_hidden_layers, c.hidden_size, c.intermediate_size, kv_heads,
                 head_dim, c.vocab_size)  # fmt: skip


@dataclass
class Setup:
    """The settings of a run that decide its memory."""

    shape: Shape
    cfg: RLConfig  # rollout batch and lengths, micro-batches, beta, fsdp, bf16, checkpointing, rollout_dtype
    world: int  # W, processes (GPUs)
    dtype: str  # the weights' dtype (--dtype)
    prompt_tokens: int  # prompt tokens of a row (the longest prompt of a batch)

    @property
    def bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def shards(self) -> int:
        return self.world if self.cfg.fsdp else 1

    @property
    def trained(self) -> int:
        return self.shape.blocks if self.cfg.freeze_base else self.shape.params

    @property
    def row_tokens(self) -> int:
        return self.prompt_tokens + self.cfg.rollout.max_new_tokens

    advice = (
        "lower --max-new-tokens, --max-batch-tokens or --micro-batch-groups, or add --micro-batch-tokens, "
        "--gradient-checkpointing, --bf16, --fsdp or GPUs"
    )

    def rows(self) -> dict[str, float]:
        """Each row's bytes on one GPU."""
        return {name: fn(self) for name, fn in ROWS.items()}

    def head(self) -> str:
        where = f"{self.world} GPU(s), {'FSDP' if self.cfg.fsdp else 'replicated'}, {self.dtype}"
        head = f"{self.shape.params / 1e9:.2f}B parameters on {where}; waves of {rollout_rows(self)} rows"
        return head + f" x {self.row_tokens} tokens, micro-batches of {micro_rows(self)} rows"


def weights(setup: Setup) -> float:
    return setup.shape.params * setup.bytes / setup.shards


def gradients(setup: Setup) -> float:
    return setup.trained * setup.bytes / setup.shards


def optimiser(setup: Setup) -> float:
    return 2 * setup.trained * setup.bytes / setup.shards


def reference(setup: Setup) -> float:
    return weights(setup) if setup.cfg.beta > 0 else 0.0


def rollout_replica(setup: Setup) -> float:
    dtype = setup.cfg.replica_dtype()
    return setup.shape.params * DTYPE_BYTES[dtype] if dtype else 0.0


def rollout_model(setup: Setup) -> float:
    if setup.cfg.replica_dtype() or not setup.cfg.fsdp:
        return 0.0  # the replica, or the policy itself, samples
    return setup.shape.params * setup.bytes * (setup.world - 1) / setup.world


def rollout_rows(setup: Setup) -> int:
    """Rows of the largest wave a rank decodes: its rollouts, bounded by the batch bounds, in whole groups."""
    s, w = setup.cfg.rollout, setup.cfg.rollout.width
    rollouts = setup.cfg.prompts_per_step // setup.world * s.n
    rows = min(rollouts, s.max_batch_sequences, s.max_batch_tokens // setup.row_tokens)
    return max(w, rows // w * w)


def kv_cache(setup: Setup) -> float:
    s = setup.shape
    cache_bytes = DTYPE_BYTES[setup.cfg.replica_dtype() or setup.dtype]
    return s.layers * 2 * s.kv_heads * s.head_dim * rollout_rows(setup) * setup.row_tokens * cache_bytes


def micro_rows(setup: Setup) -> int:
    """Rows of the largest micro-batch: micro_batch_groups groups of width w, bounded by a mini-batch's groups and
    by micro_batch_tokens."""
    cfg, w = setup.cfg, setup.cfg.rollout.width
    minibatch = -(-cfg.prompts_per_step // setup.world * (cfg.rollout.n // w) // cfg.steps_per_rollout)  # ceil
    groups = min(cfg.micro_batch_groups, minibatch)
    if cfg.micro_batch_tokens is not None:
        groups = min(groups, max(1, cfg.micro_batch_tokens // (w * setup.row_tokens)))
    return groups * w


def activations(setup: Setup) -> float:
    compute_bytes = 2 if setup.cfg.bf16 else setup.bytes
    checkpointing = setup.cfg.gradient_checkpointing
    tokens, scored = setup.row_tokens, setup.cfg.rollout.max_new_tokens
    return activation_bytes(setup.shape, micro_rows(setup), tokens, scored, checkpointing, compute_bytes)


def activation_bytes(s: Shape, m: int, tokens: int, scored: int, checkpointing: bool, compute_bytes: int) -> float:
    """What a micro-batch of m rows of `tokens` tokens keeps for its backward, with the fp32 logits (and their
    log-softmax) of `scored` tokens a row."""
    layer = 10 * s.hidden + 4 * s.intermediate  # values a token keeps in one layer
    per_token = s.layers * s.hidden + layer if checkpointing else s.layers * layer
    logits = m * scored * s.vocab * 4 * 2
    return m * tokens * per_token * compute_bytes + logits


ROWS = {  # row name -> its function, in the table's order
    "weights": weights,
    "gradients": gradients,
    "optimiser": optimiser,
    "reference": reference,
    "rollout replica": rollout_replica,
    "rollout model": rollout_model,
    "KV cache": kv_cache,
    "activations": activations,
}


@dataclass
class SFTSetup:
    """The settings of an SFT run that decide its memory (no FSDP: every rank holds the whole model)."""

    shape: Shape  # with the blocks the run trains
    cfg: SFTConfig  # micro-batches, group widths, max_length, bf16, checkpointing
    world: int  # W, processes (GPUs): each takes its share of a batch's groups
    dtype: str  # the weights' dtype (--dtype)

    advice = "lower --max-length or --micro-batch-groups, or add --gradient-checkpointing or --bf16"

    def micro_rows(self) -> int:
        """Rows of the largest micro-batch: micro_batch_groups groups of max_width, bounded by a rank's groups."""
        share = -(-self.cfg.batch_groups // self.world)  # ceil
        return min(self.cfg.micro_batch_groups, share) * self.cfg.max_width

    def rows(self) -> dict[str, float]:
        s, cfg, b = self.shape, self.cfg, DTYPE_BYTES[self.dtype]
        compute_bytes = 2 if cfg.bf16 else b
        acts = activation_bytes(s, self.micro_rows(), cfg.max_length, cfg.max_length, cfg.gradient_checkpointing,
                                compute_bytes)  # fmt: skip
        trained = {"weights": s.params * b, "gradients": s.blocks * b, "optimiser": 2 * s.blocks * b}
        return {**dict.fromkeys(ROWS, 0.0), **trained, "activations": acts}

    def head(self) -> str:
        where = f"{self.world} GPU(s), each the whole model, {self.dtype}"
        head = f"{self.shape.params / 1e9:.2f}B parameters ({self.shape.blocks / 1e6:.2f}M trained: the blocks) on "
        return head + f"{where}; micro-batches of {self.micro_rows()} rows x {self.cfg.max_length} tokens"


def plan_rows(setup: Setup | SFTSetup) -> dict[str, float]:
    """Each row's bytes on one GPU."""
    return setup.rows()


def per_gpu(rows: dict[str, float]) -> float:
    """The peak on one GPU: what is always held, plus the larger of the rollout and the update phase."""
    held = rows["weights"] + rows["optimiser"] + rows["reference"] + rows["rollout replica"]
    return held + max(rows["rollout model"] + rows["KV cache"], rows["gradients"] + rows["activations"])


def table(setup: Setup | SFTSetup, rows: dict[str, float], budget_gib: float | None) -> str:
    """The plan as a markdown table in GiB, with the total and the verdict against `budget_gib`."""
    lines = ["| per GPU | GiB |", "|---|---|"]
    lines += [f"| {name} | {value / GIB:.2f} |" for name, value in rows.items()]
    total = per_gpu(rows) / GIB
    verdict = "" if budget_gib is None else f" of {budget_gib:g} ({'fits' if total <= budget_gib else 'does not fit'})"
    lines.append(f"| **peak** (held + larger phase) | **{total:.2f}**{verdict} |")
    return setup.head() + "\n" + "\n".join(lines)


def device_memory_gib(device: str | torch.device = "cuda:0") -> float | None:
    """A CUDA device's memory (None for another device, or without CUDA)."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.device(device)).total_memory / GIB


def check_fits(setup: Setup | SFTSetup, budget_gib: float) -> str:
    """The plan's table; UserError, with the numbers, when the run's peak passes `budget_gib` (one GPU's memory)."""
    from bridgelm.errors import UserError

    rows = plan_rows(setup)
    need = per_gpu(rows) / GIB
    if need > budget_gib:
        parts = ", ".join(f"{name} {value / GIB:.1f}" for name, value in rows.items())
        raise UserError(
            f"this run needs about {need:.1f} GiB per GPU ({parts}), more than the {budget_gib:.1f} GiB a GPU has: "
            f"{setup.advice} (see bridgelm plan)"
        )
    return table(setup, rows, budget_gib)

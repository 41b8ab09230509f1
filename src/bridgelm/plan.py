"""Per-GPU memory of a GRPO (or SFT) run before it starts: pure arithmetic on the model's shapes and the run's settings.

The model is built on the meta device from its config.json (nothing else is read or downloaded); one function per
row, each in bytes on one GPU (W ranks, b bytes per weight of --dtype, P parameters, T of them trained, h hidden
size, i intermediate size, n layers, V vocabulary, L = prompt tokens + max_new_tokens a row):

- weights         P x b, / W under FSDP (each rank holds a shard)
- gradients       T x b, / W under FSDP (freed by the optimiser step: held during the update only)
- optimiser       AdamW's two moments, T x b each (fp32 with the default --dtype float32), / W under FSDP
- reference       beta > 0: a frozen copy of the policy, P x b, / W under FSDP (copied shard by shard after the
                  policy is sharded, train/reference.py; its root resharded after each pass)
- rollout replica the copy the rollouts sample from (RLConfig.replica_dtype: rollout_dtype, or bf16 under --fsdp
                  --bf16), P x its bytes, kept between steps (rollouts.RolloutPolicy; with or without FSDP)
- rollout model   without a replica under FSDP, what sampling gathers: the rest of the model in fp32,
                  P x b x (W - 1) / W, during the rollout phase only
- KV cache        2 x kv_heads x head_dim summed over the layers that keep a cache (n x 2 x kv_heads x head_dim where
                  every layer keeps its own alike) x rows x C x bytes of the sampling dtype (the replica's, else b),
                  rows = a rank's rollouts (prompts_per_step / W x G) bounded by max_batch_sequences and
                  max_batch_tokens / L (whole groups), C the slab's positions: where the decode step is compiled (on a
                  GPU, the replica or an unsharded policy) the smallest bucket of at least L (64, 96, 128, 192, ...,
                  4096, 6144) and a spare slot (6145 for L = 4608), else L (the gathered sharded policy, eager)
- gathered weights  under FSDP, during the update: the root unit's parameters R (embeddings, head, final norm: FSDP2
                  keeps the root gathered through its forward and backward), two decoder layers' (E each, its block
                  included: the one computing and the one prefetched) and the gradients computed whole before their
                  reduce-scatter (at most the root's and one layer's trained ones), a x (R + 2 E + trained), a the
                  compute dtype's bytes (2 under --bf16); 0 without FSDP
- activations     of one micro-batch of m rows (micro_batch_groups x w, bounded by a mini-batch's groups and by
                  micro_batch_tokens / L, whole groups, at least one): what autograd keeps for the backward, m x L x
                  (n x l + f), or with gradient checkpointing m x L x (n x a x h + l + f) (every layer's input, one
                  layer recomputed), a the bytes of the compute dtype (2 under --bf16), f = 4 h + 4 + a h the final
                  norm's (an RMSNorm keeps its input in float32, its reciprocal root and its normalised values), l a
                  layer's: two norms and their outputs, q, k, v (h + 2 x kv_heads x head_dim) and the attention's
                  output as sdpa keeps them, that output again as o_proj reads it, the SwiGLU's gate, up, activation
                  and product (4 i), and the added block's (a Bridge block: its norm and output, q, k, v and output
                  of its D = heads x head_dim wide attention, o_proj's input: 5 D; P-Match: its norm and output, 4 D)
                  (8 h + 8 + a (7 h + 2 x kv_heads x head_dim + 4 i) bytes without blocks); plus,
                  for the response positions only, as logprobs.py keeps them: the head's input, the logits, the
                  target id and the log-normaliser, m x max_new_tokens x (a h + a V + 12) (the logits' gradient is
                  written over them), and two float32 chunk buffers of 2^26 values (logprobs.chunk_rows) at most.
                  Attention scores are not kept by sdpa.
- validation model   what validation samples with beside what is held: the rollout replica when there is one
                  (nothing more), else as the rollout model (rl._validate samples as the rollouts are)
- validation KV cache  as the KV cache, for a wave of validation rows (eval_n per problem, a rank's share of
                  eval_limit problems when given) of prompt tokens + the validation's max_new_tokens, under the
                  rollouts' batch bounds (rl_config.validation_sampling)
- start-up        the whole policy on each GPU before it is sharded, P x b (without FSDP with its reference: the
                  weights and reference rows again; the optimiser's state comes at the first step)
- overhead        stated margin for what no tensor of ours holds: 1.5 GiB (CUDA context with its kernels and
                  cuBLAS workspaces, NCCL buffers, the compiled decode's CUDA graphs) plus 5% of the largest phase
                  (the allocator's fragmentation)

The run holds weights, optimiser, reference and rollout replica throughout, and at a time one phase:
  rollout    = held + rollout model + KV cache
  update     = held + gradients + gathered weights + activations
  validation = held + validation model + validation KV cache
  startup    = start-up
each plus the overhead; per GPU = the largest phase. Decode-step logits are not counted.

SFT (`SFTSetup`: every rank holds the whole model, no FSDP) trains the blocks alone (T = the blocks' parameters,
B): weights P x b, gradients B x b, optimiser 2 x B x b, no reference, replica or rollouts; activations as above
for m = micro-batch groups (micro_batch_groups, bounded by a rank's share of batch_groups) x max_width rows of
L = max_length tokens, with the logits of max_length tokens a row (its response is shorter).

    bridgelm plan --model M --world-size 8 --fsdp --gpu-memory-gib 80 --json
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from bridgelm.engine.cache import slab_capacity
from bridgelm.errors import UserError
from bridgelm.shape import Shape

if TYPE_CHECKING:
    from bridgelm.train.rl_config import RLConfig
    from bridgelm.train.sft import SFTConfig

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
OVERHEAD_BYTES = 1.5 * GIB  # CUDA context, NCCL buffers, CUDA graphs (the docstring's "overhead")
FRAGMENTATION = 0.05  # of the largest phase
CHUNK_VALUES = 2**26  # float32 values of one of token_logprobs' chunk buffers on an accelerator (logprobs.chunk_rows)


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
        """Each row's bytes on one GPU, the overhead last."""
        return with_overhead({name: fn(self) for name, fn in ROWS.items()})

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


def wave_rows(total: int | None, s, row_tokens: int, what: str) -> int:
    """Rows of the largest wave of `total` rows (None: unbounded) under SamplingConfig `s`'s batch bounds, in whole
    groups of s.width; ValueError, with the numbers, when a wave cannot hold one group."""
    fit = min(s.max_batch_sequences, s.max_batch_tokens // row_tokens)
    if fit < s.width:
        raise UserError(
            f"{what}: max_batch_tokens={s.max_batch_tokens} holds {fit} rows of {row_tokens} tokens, less than one "
            f"Bridge group of {s.width}: expected at least {s.width * row_tokens}"
        )
    rows = fit if total is None else min(total, fit)
    return rows // s.width * s.width


def rank_rollouts(setup: Setup) -> int:
    """A rank's rollouts a step: its prompts x G."""
    return setup.cfg.prompts_per_step // setup.world * setup.cfg.rollout.n


def rollout_rows(setup: Setup) -> int:
    """Rows of the largest wave a rank decodes: its rollouts, bounded by the batch bounds, in whole groups."""
    return wave_rows(rank_rollouts(setup), setup.cfg.rollout, setup.row_tokens, "rollouts")


def _cache(setup: Setup, rows: int, tokens: int, sampling) -> float:
    """The slab of a wave of `rows` rows of `tokens` positions, sampled under SamplingConfig `sampling`: on a GPU
    the decode step is compiled (unless sampling.compile is False) for a plain model, the replica or an unsharded
    policy, and its slab holds a bucket of positions and a spare slot (engine.cache.slab_capacity); the sharded
    policy decodes eagerly (engine.step.uncompiled_reason)."""
    s, cfg = setup.shape, setup.cfg
    compiled = sampling.compile is not False and (cfg.replica_dtype() is not None or not cfg.fsdp)
    cache_bytes = DTYPE_BYTES[cfg.replica_dtype() or setup.dtype]
    return s.cache_width * rows * slab_capacity(tokens, compiled) * cache_bytes


def kv_cache(setup: Setup) -> float:
    return _cache(setup, rollout_rows(setup), setup.row_tokens, setup.cfg.rollout)


def _validation(setup: Setup):
    """The validation's SamplingConfig and its row tokens."""
    v = setup.cfg.validation_sampling()
    return v.sampling, setup.prompt_tokens + v.sampling.max_new_tokens, v.limit


def validation_rows(setup: Setup) -> int:
    s, tokens, limit = _validation(setup)
    total = None if limit is None else -(-limit // setup.world) * s.n  # a rank's share of the problems
    return wave_rows(total, s, tokens, "validation")


def validation_model(setup: Setup) -> float:
    return rollout_model(setup)  # validation samples as the rollouts do (rl._validate)


def validation_kv_cache(setup: Setup) -> float:
    sampling, tokens, _ = _validation(setup)
    return _cache(setup, validation_rows(setup), tokens, sampling)


def startup(setup: Setup) -> float:
    whole = setup.shape.params * setup.bytes  # the policy before it is sharded
    return whole if setup.cfg.fsdp else whole + reference(setup)


def micro_rows(setup: Setup) -> int:
    """Rows of the largest micro-batch: micro_batch_groups groups of width w, bounded by a mini-batch's groups and
    by micro_batch_tokens."""
    cfg, w = setup.cfg, setup.cfg.rollout.width
    minibatch = -(-cfg.prompts_per_step // setup.world * (cfg.rollout.n // w) // cfg.steps_per_rollout)  # ceil
    groups = min(cfg.micro_batch_groups, minibatch)
    if cfg.micro_batch_tokens is not None:
        groups = min(groups, max(1, cfg.micro_batch_tokens // (w * setup.row_tokens)))
    return groups * w


def gathered(setup: Setup) -> float:
    """Under FSDP, the update's whole parameters and gradients beside the shards: the root unit's parameters (FSDP2
    keeps the root gathered from its forward to the end of its backward), two layers' (the one computing and the one
    prefetched) and the gradients computed whole before their reduce-scatter, at most the root's and one layer's
    trained ones; all in the compute dtype."""
    if setup.shards == 1:
        return 0.0
    s, a = setup.shape, 2 if setup.cfg.optim.bf16 else setup.bytes
    frozen = setup.cfg.freeze_base
    trained = (0 if frozen else s.root_params) + (s.blocks // s.layers if frozen else s.layer_params)
    return a * (s.root_params + 2 * s.layer_params + trained)


def activations(setup: Setup) -> float:
    compute_bytes = 2 if setup.cfg.optim.bf16 else setup.bytes
    checkpointing = setup.cfg.optim.gradient_checkpointing
    tokens, scored = setup.row_tokens, setup.cfg.rollout.max_new_tokens
    return activation_bytes(setup.shape, micro_rows(setup), tokens, scored, checkpointing, compute_bytes)


def activation_bytes(s: Shape, m: int, tokens: int, scored: int, checkpointing: bool, compute_bytes: int) -> float:
    """What a micro-batch of m rows of `tokens` tokens keeps for its backward, with the logits of `scored` tokens a
    row in the compute dtype and two float32 chunk buffers of token_logprobs (at most the logits' rows each)."""
    a = compute_bytes
    kept, attention = layer_bytes(s, a)
    layers = s.layers * a * s.hidden + kept + attention if checkpointing else s.layers * (kept + attention)
    per_token = layers + norm_bytes(s.hidden, a)  # the final norm's
    per_scored = a * s.hidden + a * s.vocab + 12  # the head's input, the logits, the target id and log-normaliser
    buffers = 2 * min(max(1, CHUNK_VALUES // s.vocab), m * scored) * s.vocab * 4
    return m * tokens * per_token + m * scored * per_scored + buffers


def norm_bytes(h: int, a: int) -> int:
    """What an RMSNorm keeps a token: its input in float32 (a copy of a bf16 input; 4 h bytes), the reciprocal root
    (4 bytes) and the normalised values cast back to values of `a` bytes (a h)."""
    return 4 * h + 4 + a * h


def layer_bytes(s: Shape, a: int) -> tuple[int, int]:
    """Bytes a token keeps in one decoder layer with its added block, values of `a` bytes (see the module's
    docstring): (around the attention, the attention's own as sdpa keeps them on a GPU: q, k, v and output). The CPU's
    two-matmul attention keeps its scores instead: tests/test_plan_measured.py measures the rest on CPU ranks."""
    h, kv, norm = s.hidden, 2 * s.kv_heads * s.head_dim, norm_bytes(s.hidden, a)
    kept, attention = 2 * norm + a * (3 * h + 4 * s.intermediate), a * (2 * h + kv)
    if s.block_kind == "bridge":
        kept, attention = kept + norm + a * (h + s.block_inner), attention + a * 4 * s.block_inner
    elif s.block_kind == "pmatch":
        kept += norm + a * (h + 4 * s.block_inner)
    return kept, attention


ROWS = {  # row name -> its function, in the table's order
    "weights": weights,
    "gradients": gradients,
    "optimiser": optimiser,
    "reference": reference,
    "rollout replica": rollout_replica,
    "rollout model": rollout_model,
    "KV cache": kv_cache,
    "gathered weights": gathered,
    "activations": activations,
    "validation model": validation_model,
    "validation KV cache": validation_kv_cache,
    "start-up": startup,
}
PHASES = {  # phase -> its rows besides what is held throughout (weights, optimiser, reference, rollout replica)
    "rollout": ("rollout model", "KV cache"),
    "update": ("gradients", "gathered weights", "activations"),
    "validation": ("validation model", "validation KV cache"),
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
        compute_bytes = 2 if cfg.optim.bf16 else b
        acts = activation_bytes(s, self.micro_rows(), cfg.max_length, cfg.max_length, cfg.optim.gradient_checkpointing,
                                compute_bytes)  # fmt: skip
        trained = {"weights": s.params * b, "gradients": s.blocks * b, "optimiser": 2 * s.blocks * b}
        return with_overhead({**dict.fromkeys(ROWS, 0.0), **trained, "activations": acts, "start-up": s.params * b})

    def head(self) -> str:
        where = f"{self.world} GPU(s), each the whole model, {self.dtype}"
        head = f"{self.shape.params / 1e9:.2f}B parameters ({self.shape.blocks / 1e6:.2f}M trained: the blocks) on "
        return head + f"{where}; micro-batches of {self.micro_rows()} rows x {self.cfg.max_length} tokens"


def plan_rows(setup: Setup | SFTSetup) -> dict[str, float]:
    """Each row's bytes on one GPU."""
    return setup.rows()


def _tensor_phases(rows: dict[str, float]) -> dict[str, float]:
    held = rows["weights"] + rows["optimiser"] + rows["reference"] + rows["rollout replica"]
    out = {name: held + sum(rows[r] for r in parts) for name, parts in PHASES.items()}
    return {**out, "startup": rows["start-up"]}


def with_overhead(rows: dict[str, float]) -> dict[str, float]:
    """`rows` and the overhead row: the stated margin plus the allocator's share of the largest phase."""
    return {**rows, "overhead": OVERHEAD_BYTES + FRAGMENTATION * max(_tensor_phases(rows).values())}


def phases(rows: dict[str, float]) -> dict[str, float]:
    """Bytes on one GPU in each phase (rollout, update, validation, startup), the overhead included."""
    return {name: value + rows["overhead"] for name, value in _tensor_phases(rows).items()}


def per_gpu(rows: dict[str, float]) -> float:
    """The peak on one GPU: the largest phase."""
    return max(phases(rows).values())

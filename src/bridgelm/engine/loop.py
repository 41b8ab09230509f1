"""The engine's loop, token ids in and out: `stream_ids` yields each prompt's n samples as soon as they are done.

A batch starts as a wave (`bridgelm.engine.waves`, `bridgelm.engine.batch`): each distinct prompt prefilled ONCE
(left-padded, ragged lengths, per-row position ids) into a preallocated cache, its samples pointed at its cache row
(held once: `bridgelm.prompt_attention`, where the step's attention reads it so) or given copies of it: the samples
of a group are identical there, so Bridge acts on identical rows and prefill needs no grouping. Samples
j*w .. (j+1)*w-1 of a prompt form one Bridge group; the rows of a batch are contiguous groups, so the blocks use
the reshape layout (no gather). A row that emitted EOS at step t is still fed at t+1 (its EOS is valid at that
position, its siblings attend to it) and masked from then on, exactly as `grouped_logits` defines validity. The
rows of finished groups take waiting prompts' groups where more prompts wait than the batch holds
(`bridgelm.engine.refill`); else they are dropped from the batch, and a next wave starts where the steps are
compiled.

Foreign groups (`foreign_groups=True`, a control, not a way to sample): sample j of `width` consecutive prompts
form one group, so that a Bridge block sees the samples of other prompts, aligned by generation step, instead of
its siblings. Prefill is unchanged (each prompt alone); grouping starts with the first generated token.

The engine decodes under `bridgelm.attention.fast_attention`, and on CPU with weights packed for oneDNN
(`bridgelm.packed`). How it all performs: docs/engine.md.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from bridgelm.attention import fast_attention
from bridgelm.engine import sampler
from bridgelm.engine.batch import Batch, GeneratedIds, Outputs, expand, prefill, share_pays
from bridgelm.engine.cache import slab_capacity
from bridgelm.engine.config import SamplingConfig
from bridgelm.engine.randomness import SampleRandomness
from bridgelm.engine.refill import admit, freed_groups, refill_plan
from bridgelm.engine.step import Stepper, bucket_keep, decodes_compiled, group_rows, reads_whole, shares_prompts
from bridgelm.engine.waves import Job, Wave, plan_waves
from bridgelm.errors import UserError
from bridgelm.layout import config_value, other_layer_types
from bridgelm.packed import packed_linears


@dataclass
class Ends:
    """How a sample ends, and what fills the rows after it."""

    eos: torch.Tensor  # [E] long: ids that end a sample
    pad_id: int  # fills finished rows and padding
    stop: Callable[[list[int]], bool] | None  # stop(token_ids) -> True ends a sample (stop strings)


class StepEnd(NamedTuple):
    """What the loop decides on after a step's draws: its one host sync."""

    tokens: torch.Tensor  # [B] the tokens drawn
    n_done: int  # samples that ended at this step
    live: int  # groups with a live row
    all_valid: bool  # every row's token is a real input of the next step (taken before compaction)
    group_alive: torch.Tensor  # [G] bool: groups with a live row


def record(out: Outputs, rows, steps, tok, lp, alive, ends: Ends) -> torch.Tensor:
    """The step's writes that depend on its tokens tok, lp [B], at each row's own step steps [B] -> done [B]
    (emitted EOS or a stop string now)."""
    # Rows that finished earlier keep what they hold; index writes, no boolean masks (no device sync).
    out.tokens[rows, steps] = torch.where(alive, tok, out.tokens[rows, steps])
    out.logprobs[rows, steps] = torch.where(alive, lp, out.logprobs[rows, steps])
    done = alive & torch.isin(tok, ends.eos)
    if ends.stop is not None:
        for b in torch.nonzero(alive & ~done)[:, 0].tolist():
            if ends.stop(out.tokens[int(rows[b]), : int(steps[b]) + 1].tolist()):
                done[b] = True
    return done


def settle(batch: Batch, out: Outputs, steps, drawn, logits, ends: Ends, cfg, rand) -> StepEnd:
    """One step's bookkeeping after its draws (tokens, logprobs, unsure or None), at each row's own step steps [B]:
    record them, end the samples that ended (or reached max_new_tokens), sync once; rows the deferred draws left
    unsure are redrawn (`sampler.finish_deferred`) and recorded again."""
    tok, lp, unsure = drawn
    room = steps < cfg.max_new_tokens - 1  # rows that may go on after this step
    batch.valid = batch.alive  # inputs of the next step: live tokens, a just-emitted EOS included
    out.lengths[batch.rows] += batch.alive.long()
    done = record(out, batch.rows, steps, tok, lp, batch.valid, ends)
    out.ended[batch.rows] |= done
    batch.alive = batch.valid & ~done & room
    group_alive = batch.alive.view(-1, cfg.width).any(-1)  # [G]
    # The loop's one host sync of a step (the CPU's nucleus sampling and stop strings add their own).
    stats = [done.sum(), group_alive.sum(), batch.valid.all().long()]
    n_done, live, all_valid, *n_unsure = torch.stack(stats + ([unsure.sum()] if unsure is not None else [])).tolist()
    if n_unsure and n_unsure[0]:  # rare: rows with no accepted draw in the sync-free rounds
        tok, lp = sampler.finish_deferred(logits, tok, unsure, cfg.temperature, cfg.top_p, rand)
        first_done, done = done, record(out, batch.rows, steps, tok, lp, batch.valid, ends)
        out.ended[batch.rows] = (out.ended[batch.rows] & ~first_done) | done  # done now: live, so not ended before
        batch.alive = batch.valid & ~done & room
        group_alive = batch.alive.view(-1, cfg.width).any(-1)
        n_done, live = torch.stack([done.sum(), group_alive.sum()]).tolist()
    return StepEnd(tok, n_done, live, bool(all_valid), group_alive)


def rows_to_keep(end: StepEnd, cfg: SamplingConfig, compiled: bool, waiting: int) -> torch.Tensor | None:
    """The rows to keep once finished groups are dropped, or None to keep them all: in compiled mode the next
    smaller bucket; else the live groups, once the finished ones are `compact_fraction` of the batch and no group
    waits for their rows."""
    if waiting:
        return None
    if compiled:
        return bucket_keep(end.group_alive, cfg.width, end.live)
    groups = end.group_alive.numel()
    if groups - end.live >= max(1, cfg.compact_fraction * groups):
        return torch.nonzero(end.group_alive.repeat_interleave(cfg.width))[:, 0]
    return None


def next_logits(stepper: Stepper, batch: Batch, end: StepEnd, step: int, at: int, rand, cfg, pad_id: int, waiting):
    """Step `step` of the decode: feed the previous step's tokens (pad in finished rows) at the wave's position
    `at`, after dropping finished groups (none while `waiting` groups wait for rows). -> (logits [B, V], the
    step's draws when the compiled step made them, else None)."""
    inputs = torch.where(batch.valid, end.tokens, pad_id)  # [B]
    keep = rows_to_keep(end, cfg, stepper.compiled, waiting)
    if keep is not None:
        inputs = batch.keep(keep, inputs)
    batch.mask[:, batch.cache.column(at)] = True  # the input token's own slot
    u = None
    if stepper.draws:  # the next step's draws too, with its uniforms
        rand.rows, rand.step = batch.rows, batch.steps(step, cfg.max_new_tokens)
        u = rand.rounds(torch.arange(len(batch.rows), device=inputs.device))  # [B, DEFERRED_ROUNDS]
    logits, drawn = stepper(batch.cache, inputs, batch.pos, batch.mask, batch.valid, end.all_valid, at, u)
    # The next step feeds a real token where a row is alive now; a finished row stays at its last position (one
    # waiting for a refill would run past the context, and RoPEs scaled by the batch's largest position change).
    batch.pos = batch.pos + batch.alive.long()
    return logits, drawn


def owners_of(jobs) -> list[tuple[int, int]]:
    """(prompt, sample index) of each row of `jobs`, in order."""
    return [(job.prompt, job.first + j) for job in jobs for j in range(job.count)]


def harvest(out: Outputs, owners: list, slots: list[int], on_step) -> list[tuple[int, int, GeneratedIds]]:
    """The samples in `slots` (emptied for others) as (prompt, sample index, sample); `on_step` hears of those
    that ran out of tokens (the others were counted as they ended)."""
    samples = out.samples(slots)
    if on_step is not None:
        on_step(sum(not s.finished for s in samples))
    done = [(*owners[slot], s) for slot, s in zip(slots, samples)]
    for slot in slots:
        owners[slot] = None
    return done


def start(model, prompts, first: Wave, cfg: SamplingConfig, ends: Ends, keys, compiled: bool, deferred: bool):
    """A batch's first rows, prefilled -> (batch, logits [B, V], stepper, outputs, the slots' owners, randomness)."""
    device = next(model.parameters()).device
    capacity = slab_capacity(first.longest + cfg.max_new_tokens, compiled)  # compiled: a bucket and a spare slot
    filled = prefill(model, prompts, first, ends.pad_id, capacity)
    share = share_pays(first) if cfg.share_prompts is None else cfg.share_prompts
    batch, logits = expand(*filled, first, cfg, share and shares_prompts(model, compiled))
    stepper = Stepper.build(model, batch.cache, cfg, compiled, deferred)
    out = Outputs.empty(len(batch.rows), cfg.max_new_tokens, ends.pad_id, device)
    owners = owners_of(first.jobs)
    rand = None
    if cfg.temperature > 0:
        rand = SampleRandomness(cfg.seed, keys, cfg.max_new_tokens, len(owners), device)
        rand.assign(range(len(owners)), first.jobs)
    return batch, logits, stepper, out, owners, rand


@torch.no_grad()
def run_stream(model, prompts, first: Wave, waiting: list[Job], cfg: SamplingConfig, ends: Ends, keys, on_step):
    """Every sample of the wave `first` and of the `waiting` groups, which take the rows of finished groups
    (`bridgelm.engine.refill`), as (prompt, sample index, sample) when its row is emptied. `on_step(k)` hears of k
    more finished samples."""
    device = next(model.parameters()).device
    compiled, deferred = decodes_compiled(model, cfg, device), sampler.defers_draws(device, cfg)
    batch, logits, stepper, out, owners, rand = start(model, prompts, first, cfg, ends, keys, compiled, deferred)
    waiting = list(waiting)
    buffers, drawn, end = sampler.SamplerBuffers(), None, None  # drawn: the step's draws, made inside the compiled step
    at = first.longest  # the wave's position of the next write
    for step in itertools.count():
        freed = [] if end is None else freed_groups(end.group_alive, end.live, cfg, len(waiting))
        if freed:
            rows = group_rows(torch.tensor(freed, device=device), cfg.width)
            slots = batch.rows[rows].tolist()
            yield from harvest(out, owners, slots, on_step)
            logits, jobs = admit(model, prompts, batch, logits, waiting[: len(freed)], rows, step, at, ends.pad_id)
            del waiting[: len(freed)]
            drawn = None  # the compiled step drew from the old rows' logits
            for slot, owner in zip(slots, owners_of(jobs)):
                owners[slot] = owner
            if rand is not None:
                rand.assign(slots, jobs)
        steps = batch.steps(step, cfg.max_new_tokens)
        if rand is not None:
            rand.rows, rand.step = batch.rows, steps
        if drawn is None:
            drawn = sampler.draw(logits, cfg, rand, buffers, deferred)
        end = settle(batch, out, steps, drawn, logits, ends, cfg, rand)
        if on_step is not None:
            on_step(end.n_done)
        if end.live == 0 and not waiting:
            break
        if end.live == 0:  # every row finished: the waiting groups take them before the next write
            drawn = None
            continue
        logits, drawn = next_logits(stepper, batch, end, step + 1, at, rand, cfg, ends.pad_id, len(waiting))
        at += 1
    yield from harvest(out, owners, [slot for slot, owner in enumerate(owners) if owner is not None], on_step)


def check_model(model) -> None:
    """UserError unless the engine's cache (keys and values, a slab per layer) and its padded decode steps serve
    `model`: hybrid models' recurrent layers keep another state, and transformers' multi-head latent attention
    (DeepSeek V2/V3) fails on a padded batch's decode step."""
    name, config = type(model).__name__, model.config.get_text_config()
    if other := other_layer_types(model):
        raise UserError(f"the engine cannot sample {name}: its {other} layers keep a state its key/value cache lacks")
    if rank := config_value(config, "kv_lora_rank"):
        raise UserError(
            f"the engine cannot sample {name}: transformers' multi-head latent attention (kv_lora_rank={rank}) fails "
            "on its padded decode steps"
        )


def check_prompts(model, prompts: Sequence[Sequence[int]], cfg: SamplingConfig) -> None:
    """UserError unless there are prompts (whole blocks of `width` with foreign groups), none empty, each with room
    for max_new_tokens in the model's context: the one check of the prompts, of generate and generate_ids."""
    if len(prompts) == 0:
        raise UserError("prompts is empty: expected at least one prompt")
    if cfg.foreign_groups and len(prompts) % cfg.width:
        raise UserError(f"foreign_groups: {len(prompts)} prompts is not a multiple of width={cfg.width}")
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(embeddings, "num_embeddings", None)
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise UserError(f"prompt {i} is empty: expected at least one token")
        bad = None if vocab is None else next((t for t in p if not 0 <= t < vocab), None)
        if bad is not None:
            raise UserError(f"prompt {i} holds token id {bad}: expected ids in [0, {vocab}), the model's vocabulary")
        if context is not None and len(p) + cfg.max_new_tokens > context:
            room = context - max(map(len, prompts))  # what the longest prompt leaves
            fix = f"lower max_new_tokens (--max-new-tokens) to at most {room}, or shorten the prompts"
            raise UserError(
                f"prompt {i} has {len(p)} tokens; with max_new_tokens={cfg.max_new_tokens} it exceeds the "
                f"model's context of {context} positions: " + (fix if room > 0 else "shorten the prompts")
            )


def streams(lengths: Sequence[int], cfg: SamplingConfig, ring: bool) -> list[tuple[Wave, list[Job]]]:
    """The batches to decode, each a first wave and the groups waiting for its rows: one refilled stream where
    `refill_plan` gives one (`ring`: whether the model can read a ring), else the waves one after another."""
    waves = plan_waves(lengths, cfg)
    plan = refill_plan(lengths, cfg, waves, ring)
    return [(wave, []) for wave in waves] if plan is None else [plan]


def stream_ids(
    model,
    prompts: Sequence[Sequence[int]],
    cfg: SamplingConfig,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    stop: Callable[[list[int]], bool] | None = None,
    progress: Callable[[int], None] | None = None,
    keys: Sequence | None = None,
) -> Iterator[tuple[int, list[GeneratedIds]]]:
    """The engine, token ids in and out: yield (prompt index, its n samples) as prompts complete, in prompt order.

    `stop(token_ids) -> bool` ends a sample early (stop strings); `progress(k)` is called with the number of
    samples that completed since its last call (n * len(prompts) in all). `keys[i]` (default i) names prompt i's
    random stream: with the same seed and key a prompt gets the same samples whatever else is in the batch (up to
    the rounding differences of other batch shapes).
    """
    cfg.validate()
    model = getattr(model, "_orig_mod", model)  # a torch.compile'd module: the engine compiles its own step (cfg)
    check_model(model)
    check_prompts(model, prompts, cfg)
    device = next(model.parameters()).device
    eos = torch.tensor(list(eos_token_ids) or [-1], dtype=torch.long, device=device)  # [-1]: only max_new_tokens
    if keys is None:
        keys = list(range(len(prompts)))
    if len(keys) != len(prompts):
        raise UserError(f"keys has {len(keys)} entries: expected one per prompt ({len(prompts)})")
    # Packed weights serve the eager step only: the compiled one would see new tensors every wave and recompile.
    pack = cfg.pack_weights and not decodes_compiled(model, cfg, device)
    was_training = model.training
    model.eval()
    pending: dict[int, list[GeneratedIds | None]] = {}
    ready = 0  # the next prompt to yield
    ends = Ends(eos, pad_token_id, stop)
    # The model is the engine's until the stream ends or is closed: its weights must not change between yields.
    packed = packed_linears(model) if pack else contextlib.nullcontext()
    try:
        with fast_attention(model), packed:
            for first, waiting in streams([len(p) for p in prompts], cfg, reads_whole(model)):
                for prompt, j, sample in run_stream(model, prompts, first, waiting, cfg, ends, keys, progress):
                    pending.setdefault(prompt, [None] * cfg.n)[j] = sample
                    while ready in pending and all(x is not None for x in pending[ready]):
                        yield ready, pending.pop(ready)
                        ready += 1
    finally:
        model.train(was_training)


def generate_ids(model, prompts, cfg: SamplingConfig, eos_token_ids, pad_token_id, stop=None, progress=None, keys=None):
    """All samples: a list (per prompt) of n `GeneratedIds` (`stream_ids`, collected)."""
    stream = stream_ids(model, prompts, cfg, eos_token_ids, pad_token_id, stop, progress, keys)
    return [samples for _, samples in stream]

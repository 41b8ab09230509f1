"""The engine's loop, token ids in and out: `stream_ids` yields each prompt's n samples as soon as they are done.

Prompts stream through the batch in waves (`bridgelm.engine.waves`). A wave prefills each distinct prompt ONCE
(left-padded, ragged lengths, per-row position ids) into a preallocated cache, then points the prompt's samples at
its cache row (held once: `bridgelm.prompt_attention`, where the step's attention reads it so) or copies the row to
them: the samples of a group are identical there, so Bridge acts on identical rows and prefill needs no grouping. Samples j*w .. (j+1)*w-1 of a prompt form one Bridge group; the rows of a wave are contiguous groups,
so the blocks use the reshape layout (no gather). A row that emitted EOS at step t is still fed at t+1 (its EOS is
valid at that position, its siblings attend to it) and masked from then on, exactly as `grouped_logits` defines
validity. Groups whose rows all finished are dropped from the batch.

Foreign groups (`foreign_groups=True`, a control, not a way to sample): sample j of `width` consecutive prompts
form one group, so that a Bridge block sees the samples of other prompts, aligned by generation step, instead of
its siblings. Prefill is unchanged (each prompt alone); grouping starts with the first generated token.

Each wave decodes under `bridgelm.attention.fast_attention`, and on CPU with weights packed for oneDNN
(`bridgelm.packed`). How it all performs: docs/engine.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from bridgelm.attention import fast_attention
from bridgelm.engine import sampler
from bridgelm.engine.cache import SlabCache, slab_capacity
from bridgelm.engine.config import SamplingConfig
from bridgelm.engine.randomness import SampleRandomness
from bridgelm.engine.step import Stepper, bucket_keep, decodes_compiled, reads_whole, shares_prompts
from bridgelm.engine.waves import Wave, plan_waves
from bridgelm.errors import UserError
from bridgelm.packed import packed_linears


@dataclass
class GeneratedIds:
    """One sample, as token ids."""

    token_ids: list[int]  # generated ids, ending with the EOS id when `finished`
    logprobs: list[float]  # log-prob of each generated id, under softmax(logits / temperature)
    finished: bool  # ended by EOS or a stop string (False: ran out of max_new_tokens)


@dataclass
class Ends:
    """How a sample ends, and what fills the rows after it."""

    eos: torch.Tensor  # [E] long: ids that end a sample
    pad_id: int  # fills finished rows and padding
    stop: Callable[[list[int]], bool] | None  # stop(token_ids) -> True ends a sample (stop strings)


@dataclass
class Outputs:
    """What a wave's W samples generated, by wave row (prompt-major sample order)."""

    tokens: torch.Tensor  # [W, T] long: generated ids, pad after a sample's end
    logprobs: torch.Tensor  # [W, T] float: their log-probs, 0 after a sample's end
    lengths: torch.Tensor  # [W] long: generated tokens
    ended: torch.Tensor  # [W] bool: emitted EOS or a stop string

    @classmethod
    def empty(cls, rows: int, steps: int, pad_id: int, device) -> Outputs:
        tokens = torch.full((rows, steps), pad_id, dtype=torch.long, device=device)
        lengths = torch.zeros(rows, dtype=torch.long, device=device)
        ended = torch.zeros(rows, dtype=torch.bool, device=device)
        return cls(tokens, torch.zeros(rows, steps, device=device), lengths, ended)

    def samples(self) -> list[GeneratedIds]:
        if not bool(torch.isfinite(self.logprobs).all()):  # checked once a wave, where the results reach the host
            raise UserError(
                "the model's log-probs were not finite while sampling (NaN or infinite logits): its weights or blocks "
                "overflow (values as large as 1e30?), or training diverged; expected a model with finite outputs"
            )
        out = []
        for r, n in enumerate(self.lengths.tolist()):
            out.append(GeneratedIds(self.tokens[r, :n].tolist(), self.logprobs[r, :n].tolist(), bool(self.ended[r])))
        return out


@dataclass
class Batch:
    """The B rows decoded together: the samples of the groups not dropped yet."""

    cache: SlabCache  # their keys and values
    mask: torch.Tensor  # [B, capacity] bool: the slots each row attends to (its prompt, then its inputs)
    pos: torch.Tensor  # [B] long: position of the next input token
    rows: torch.Tensor  # [B] long: wave row of each batch row
    alive: torch.Tensor  # [B] bool: still generating
    valid: torch.Tensor  # [B] bool: rows whose last token is a real input (live ones and a just-emitted EOS)

    def keep(self, keep: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """Keep the rows `keep [B']` (finished groups dropped) -> the kept rows of inputs [B]."""
        self.cache.select_rows(keep)
        self.mask, self.pos, self.rows, self.alive, self.valid, inputs = (
            t[keep] for t in (self.mask, self.pos, self.rows, self.alive, self.valid, inputs)
        )
        return inputs


class StepEnd(NamedTuple):
    """What the loop decides on after a step's draws: its one host sync."""

    tokens: torch.Tensor  # [B] the tokens drawn
    n_done: int  # samples that ended at this step
    live: int  # groups with a live row
    all_valid: bool  # every row's token is a real input of the next step (taken before compaction)
    group_alive: torch.Tensor  # [G] bool: groups with a live row


# Prompt positions that copies per sample would add to a wave's cache, from which holding each prompt once pays:
# it saves their reads at every step, for a dozen more small ops per layer (docs/benchmarks.md: SmolLM2, 2 threads,
# 16 rows x ~110-token prompts, 1.6k positions: 0.90x; 128 rows x ~500, 68k: 1.25x; 128 x ~140, 18k: 0.98-1.14x).
SHARE_MIN_POSITIONS = 16_384


def share_pays(wave: Wave) -> bool:
    """Whether the wave's samples hold each prompt once by default: the copies would add SHARE_MIN_POSITIONS."""
    rows = sum(job.count for job in wave.jobs)
    return (rows - len(wave.jobs)) * wave.longest >= SHARE_MIN_POSITIONS


def prefill(model, prompts: Sequence[Sequence[int]], wave: Wave, pad_id: int, capacity: int):
    """Each distinct prompt of the wave once through the model, left-padded to the longest: -> (cache [P rows],
    mask [P, capacity] bool, lengths [P], logits [P, V] of each prompt's next token)."""
    device = next(model.parameters()).device
    P, L = len(wave.jobs), wave.longest
    ids = torch.full((P, L), pad_id, dtype=torch.long, device=device)  # [P, L]
    mask = torch.zeros(P, capacity, dtype=torch.bool, device=device)  # [P, capacity]
    for i, job in enumerate(wave.jobs):
        toks = torch.as_tensor(prompts[job.prompt], dtype=torch.long, device=device)
        ids[i, L - len(toks) :] = toks
        mask[i, L - len(toks) : L] = True
    positions = (mask[:, :L].long().cumsum(-1) - 1).clamp(min=0)  # [P, L]
    cache = SlabCache(model.config.get_text_config().num_hidden_layers, capacity, reads_whole(model))
    out = model(
        input_ids=ids,
        attention_mask=mask[:, :L].long(),
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    lengths = torch.tensor([len(prompts[j.prompt]) for j in wave.jobs], device=device)
    return cache, mask, lengths, out.logits[:, -1]


def expand(cache: SlabCache, mask, lengths, logits, wave: Wave, cfg: SamplingConfig, shared: bool = False):
    """Copy each prompt's cache row (`shared`: only point its samples at it), mask and logits to its samples
    -> (the batch, logits [B, V])."""
    device = mask.device
    P = len(wave.jobs)
    counts = torch.tensor([j.count for j in wave.jobs], device=device)
    src = torch.repeat_interleave(torch.arange(P, device=device), counts)  # [B] prompt of each row
    B = int(counts.sum())
    rows = torch.arange(B, device=device)  # wave row (prompt-major sample order) of each batch row
    if cfg.foreign_groups:  # batch order [block, sample j, prompt of the block]: groups of `width` prompts
        rows = rows.view(P // cfg.width, cfg.width, cfg.n).transpose(1, 2).reshape(-1)
        src = src[rows]
    if shared:
        cache.share_prompts(src, P)
    else:
        cache.select_rows(src)
    alive = torch.ones(B, dtype=torch.bool, device=device)
    return Batch(cache, mask[src], lengths[src].clone(), rows, alive, alive), logits[src]


def record(out: Outputs, rows, step: int, tok, lp, alive, ends: Ends) -> torch.Tensor:
    """The step's writes that depend on its tokens tok, lp [B] -> done [B] (emitted EOS or a stop string now)."""
    # Rows that finished earlier keep pad / 0 at `step`; index writes, no boolean masks (no device sync).
    out.tokens[rows, step] = torch.where(alive, tok, ends.pad_id)
    out.logprobs[rows, step] = torch.where(alive, lp, 0.0)
    done = alive & torch.isin(tok, ends.eos)
    if ends.stop is not None:
        for b in torch.nonzero(alive & ~done)[:, 0].tolist():
            if ends.stop(out.tokens[int(rows[b]), : step + 1].tolist()):
                done[b] = True
    return done


def settle(batch: Batch, out: Outputs, step: int, drawn, logits, ends: Ends, cfg, rand) -> StepEnd:
    """One step's bookkeeping after its draws (tokens, logprobs, unsure or None): record them, end the samples that
    ended, sync once; rows the deferred draws left unsure are redrawn (`sampler.finish_deferred`) and recorded
    again."""
    tok, lp, unsure = drawn
    batch.valid = batch.alive  # inputs of the next step: live tokens, a just-emitted EOS included
    out.lengths[batch.rows] += batch.alive.long()
    done = record(out, batch.rows, step, tok, lp, batch.valid, ends)
    out.ended[batch.rows] |= done
    batch.alive = batch.valid & ~done
    group_alive = batch.alive.view(-1, cfg.width).any(-1)  # [G]
    # The loop's one host sync of a step (the CPU's nucleus sampling and stop strings add their own).
    stats = [done.sum(), group_alive.sum(), batch.valid.all().long()]
    n_done, live, all_valid, *n_unsure = torch.stack(stats + ([unsure.sum()] if unsure is not None else [])).tolist()
    if n_unsure and n_unsure[0]:  # rare: rows with no accepted draw in the sync-free rounds
        tok, lp = sampler.finish_deferred(logits, tok, unsure, cfg.temperature, cfg.top_p, rand)
        first_done, done = done, record(out, batch.rows, step, tok, lp, batch.valid, ends)
        out.ended[batch.rows] = (out.ended[batch.rows] & ~first_done) | done  # done now: live, so not ended before
        batch.alive = batch.valid & ~done
        group_alive = batch.alive.view(-1, cfg.width).any(-1)
        n_done, live = torch.stack([done.sum(), group_alive.sum()]).tolist()
    return StepEnd(tok, n_done, live, bool(all_valid), group_alive)


def rows_to_keep(end: StepEnd, cfg: SamplingConfig, compiled: bool) -> torch.Tensor | None:
    """The rows to keep once finished groups are dropped, or None to keep them all: in compiled mode the next
    smaller bucket; else the live groups, once the finished ones are `compact_fraction` of the batch."""
    if compiled:
        return bucket_keep(end.group_alive, cfg.width, end.live)
    groups = end.group_alive.numel()
    if groups - end.live >= max(1, cfg.compact_fraction * groups):
        return torch.nonzero(end.group_alive.repeat_interleave(cfg.width))[:, 0]
    return None


def next_logits(stepper: Stepper, batch: Batch, end: StepEnd, step: int, at: int, rand, cfg, pad_id: int):
    """Step `step` of the decode: feed the previous step's tokens (pad in finished rows) at cache slot `at`, after
    dropping finished groups. -> (logits [B, V], the step's draws when the compiled step made them, else None)."""
    inputs = torch.where(batch.valid, end.tokens, pad_id)  # [B]
    keep = rows_to_keep(end, cfg, stepper.compiled)
    if keep is not None:
        inputs = batch.keep(keep, inputs)
    batch.mask[:, at] = True  # the input token's own slot
    u = None
    if stepper.draws:  # the next step's draws too, with its uniforms
        rand.rows, rand.step = batch.rows, step
        u = rand.rounds(torch.arange(len(batch.rows), device=inputs.device))  # [B, DEFERRED_ROUNDS]
    logits, drawn = stepper(batch.cache, inputs, batch.pos, batch.mask, batch.valid, end.all_valid, at, u)
    batch.pos = batch.pos + 1
    return logits, drawn


@torch.no_grad()
def run_wave(model, prompts, wave: Wave, cfg: SamplingConfig, ends: Ends, keys, on_step) -> list[GeneratedIds]:
    """Every sample of one wave, in wave-row order. `on_step(k)` hears of k more finished samples."""
    device = next(model.parameters()).device
    compiled = decodes_compiled(model, cfg, device)
    deferred = sampler.defers_draws(device, cfg)
    capacity = slab_capacity(wave.longest + cfg.max_new_tokens, compiled)  # compiled: a bucket and a spare slot
    filled = prefill(model, prompts, wave, ends.pad_id, capacity)
    share = share_pays(wave) if cfg.share_prompts is None else cfg.share_prompts
    batch, logits = expand(*filled, wave, cfg, share and shares_prompts(model, compiled))
    stepper = Stepper.build(model, batch.cache, cfg, compiled, deferred)
    out = Outputs.empty(len(batch.rows), cfg.max_new_tokens, ends.pad_id, device)
    rand = None
    if cfg.temperature > 0:
        rand = SampleRandomness(cfg.seed, wave.jobs, keys, cfg.n, cfg.max_new_tokens, device)
    buffers, drawn = sampler.SamplerBuffers(), None  # drawn: the step's draws, made inside the compiled step
    for step in range(cfg.max_new_tokens):
        if rand is not None:
            rand.rows, rand.step = batch.rows, step
        if drawn is None:
            drawn = sampler.draw(logits, cfg, rand, buffers, deferred)
        end = settle(batch, out, step, drawn, logits, ends, cfg, rand)
        if on_step is not None:
            on_step(end.n_done)
        if step + 1 == cfg.max_new_tokens or end.live == 0:
            break
        logits, drawn = next_logits(stepper, batch, end, step + 1, wave.longest + step, rand, cfg, ends.pad_id)
    if on_step is not None:
        on_step(int((~out.ended).sum()))  # samples that ran out of tokens
    return out.samples()


def check_prompts(model, prompts: Sequence[Sequence[int]], cfg: SamplingConfig) -> None:
    """UserError unless there are prompts (whole blocks of `width` with foreign groups), none empty, each with room
    for max_new_tokens in the model's context: the one check of the prompts, of generate and generate_ids."""
    if len(prompts) == 0:
        raise UserError("prompts is empty: expected at least one prompt")
    if cfg.foreign_groups and len(prompts) % cfg.width:
        raise UserError(f"foreign_groups: {len(prompts)} prompts is not a multiple of width={cfg.width}")
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise UserError(f"prompt {i} is empty: expected at least one token")
        if context is not None and len(p) + cfg.max_new_tokens > context:
            room = context - max(map(len, prompts))  # what the longest prompt leaves
            fix = f"lower max_new_tokens (--max-new-tokens) to at most {room}, or shorten the prompts"
            raise UserError(
                f"prompt {i} has {len(p)} tokens; with max_new_tokens={cfg.max_new_tokens} it exceeds the "
                f"model's context of {context} positions: " + (fix if room > 0 else "shorten the prompts")
            )


def _completed(pending: dict, wave: Wave, samples: list[GeneratedIds], n: int):
    """File a wave's samples under their prompts; yield (prompt, its n samples) for each prompt now complete."""
    at = 0
    for job in wave.jobs:
        slot = pending.setdefault(job.prompt, [None] * n)
        slot[job.first : job.first + job.count] = samples[at : at + job.count]
        at += job.count
        if all(s is not None for s in slot):
            yield job.prompt, pending.pop(job.prompt)


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
    check_prompts(model, prompts, cfg)
    device = next(model.parameters()).device
    eos = torch.tensor(list(eos_token_ids) or [-1], dtype=torch.long, device=device)  # [-1]: only max_new_tokens
    if keys is None:
        keys = list(range(len(prompts)))
    assert len(keys) == len(prompts), f"keys has {len(keys)} entries: expected one per prompt ({len(prompts)})"
    # Packed weights serve the eager step only: the compiled one would see new tensors every wave and recompile.
    pack = cfg.pack_weights and not decodes_compiled(model, cfg, device)
    was_training = model.training
    model.eval()
    pending: dict[int, list[GeneratedIds | None]] = {}
    try:
        for wave in plan_waves([len(p) for p in prompts], cfg):
            # Switched per wave: the model is the caller's between yields (it may change its weights there).
            packed = packed_linears(model) if pack else contextlib.nullcontext()
            with fast_attention(model), packed:
                samples = run_wave(model, prompts, wave, cfg, Ends(eos, pad_token_id, stop), keys, progress)
            yield from _completed(pending, wave, samples, cfg.n)
    finally:
        model.train(was_training)


def generate_ids(model, prompts, cfg: SamplingConfig, eos_token_ids, pad_token_id, stop=None, progress=None, keys=None):
    """All samples: a list (per prompt) of n `GeneratedIds` (`stream_ids`, collected)."""
    stream = stream_ids(model, prompts, cfg, eos_token_ids, pad_token_id, stop, progress, keys)
    return [samples for _, samples in stream]

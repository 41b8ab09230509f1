"""Refilling finished groups' rows with waiting prompts (bridgelm.engine.refill) against the slow reference: one wave
that holds every sample, and grouped_logits."""

from dataclasses import replace

import pytest
import torch
from conftest import randomize_blocks, tiny_model
from test_engine import EOS, teacher_forced_logprobs
from test_prompt_attention import _through_bridgelm_attention

import bridgelm
from bridgelm.engine import SamplingConfig, cache, generate_ids, loop, sampler, step, stream_ids
from bridgelm.engine.refill import freed_groups, merged, refill_plan
from bridgelm.engine.waves import Job, plan_waves


def _spy(monkeypatch, owner, name, seen: list, what):
    real = getattr(owner, name)

    def spy(*args, **kwargs):
        seen.append(what(*args))
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("temperature,top_p", [(1.0, 0.9), (0.0, 1.0)])
def test_refilled_rows_sample_what_one_wave_samples(monkeypatch, share, temperature, top_p):
    """Two rows of groups for 8 ragged prompts (the longest waits in the queue): every admission, the ring's
    wrap-around, per-row steps in the random streams, outputs and stop checks give one big wave's samples."""
    if share:
        _through_bridgelm_attention(monkeypatch)
    model = randomize_blocks(bridgelm.add_bridge(tiny_model()), std=0.2)
    torch.manual_seed(5)
    prompts = [torch.randint(7, 97, (n,)).tolist() for n in (5, 2, 9, 3, 12, 4, 7, 1)]
    stop = lambda ids: ids[-1] >= 94  # noqa: E731  (a stop check reads each row's own tokens)
    cfg = SamplingConfig(n=4, width=2, max_new_tokens=12, temperature=temperature, top_p=top_p, seed=3,
                         share_prompts=share, refill=True)
    big = generate_ids(model, prompts, cfg, EOS, 0, stop=stop)
    admitted, rows, wrapped, held = [], [], [], []
    _spy(monkeypatch, loop, "admit", admitted, lambda *a: len(a[5]))
    _spy(monkeypatch, step, "decode_step", rows, lambda model, cache, tokens, *a: tokens.shape[0])
    _spy(monkeypatch, cache.SlabLayer, "update", wrapped, lambda layer, *a: layer.length - layer.prompt >= layer.own)
    _spy(monkeypatch, cache.SlabLayer, "admit_prompts", held, lambda *a: 1)
    small = generate_ids(model, prompts, replace(cfg, max_batch_sequences=4), EOS, 0, stop=stop)
    assert len(admitted) >= 5 and max(rows) == 4 and any(wrapped)  # refilled often, 4 rows, around the ring
    assert bool(held) == share  # the shared layout took the new prompts in
    flat = lambda res: [s for r in res for s in r]  # noqa: E731
    assert [s.token_ids for s in flat(small)] == [s.token_ids for s in flat(big)]
    assert [s.finished for s in flat(small)] == [s.finished for s in flat(big)]
    lengths = [len(s.token_ids) for s in flat(small)]
    assert min(lengths) < 12 and max(lengths) == 12  # ragged ends: groups freed at different steps
    for a, b in zip(flat(small), flat(big)):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
    if temperature > 0:
        want = teacher_forced_logprobs(model, prompts, small, 2, temperature)
        for s, ref in zip(flat(small), want):
            assert torch.allclose(torch.tensor(s.logprobs), ref, atol=2e-3)


def test_a_refilled_stream_yields_every_prompt_once_in_order_and_counts_every_sample():
    model = tiny_model()
    prompts = [[10 + i] * (1 + i % 4) for i in range(7)]
    cfg = SamplingConfig(n=4, width=2, max_new_tokens=6, temperature=1.0, seed=2, max_batch_sequences=4, refill=True)
    counted = []
    streamed = list(stream_ids(model, prompts, cfg, EOS, 0, progress=counted.append))
    assert [i for i, _ in streamed] == list(range(7)) and all(len(s) == 4 for _, s in streamed)
    assert sum(counted) == 7 * 4


def test_the_plan_queues_groups_in_prompt_order_under_the_bounds_of_the_longest_prompt():
    cfg = SamplingConfig(n=4, width=2, max_new_tokens=6, max_batch_sequences=8, max_batch_tokens=60, refill=True)
    lengths = [3, 4, 2, 4, 1]
    first, waiting = refill_plan(lengths, cfg, plan_waves(lengths, cfg))
    assert first.longest == 4 and sum(j.count for j in first.jobs) == 6  # 60 // (4 + 6) rows, whole groups
    assert [(j.prompt, j.first, j.count) for j in first.jobs] == [(0, 0, 4), (1, 0, 2)]
    assert [(g.prompt, g.first) for g in waiting] == [(1, 2), (2, 0), (2, 2), (3, 0), (3, 2), (4, 0), (4, 2)]
    assert merged([Job(1, 0, 2), Job(1, 2, 2), Job(2, 0, 2)]) == [Job(1, 0, 4), Job(2, 0, 2)]
    one_wave = replace(cfg, max_batch_sequences=64, max_batch_tokens=10**6)
    assert refill_plan(lengths, one_wave, plan_waves(lengths, one_wave)) is None
    assert refill_plan(lengths, replace(cfg, refill=False), plan_waves(lengths, cfg)) is None
    assert refill_plan([3] * 4, replace(cfg, foreign_groups=True, width=2, n=2), plan_waves([3] * 4, cfg)) is None


def test_finished_groups_are_refilled_once_they_are_compact_fraction_of_the_batch():
    alive = torch.tensor([True, False, True, False, False, True, True, True])
    cfg = SamplingConfig(n=2, width=2, compact_fraction=0.5)
    assert freed_groups(alive, 5, cfg, waiting=9) == []  # 3 of 8 finished: under half
    assert freed_groups(alive, 5, replace(cfg, compact_fraction=0.25), waiting=9) == [1, 3, 4]
    assert freed_groups(alive, 5, replace(cfg, compact_fraction=0.25), waiting=2) == [1, 3]
    assert freed_groups(alive, 5, replace(cfg, compact_fraction=0.0), waiting=0) == []


def test_by_default_the_stream_runs_in_waves_with_the_samples_a_refill_gives(monkeypatch):
    model = randomize_blocks(bridgelm.add_bridge(tiny_model()), std=0.2)
    prompts = [[10, 11, 12], [20, 21], [30, 31, 32, 33], [40]]
    cfg = SamplingConfig(n=4, width=2, max_new_tokens=8, temperature=1.0, seed=4, max_batch_sequences=4)
    assert cfg.refill is False  # measured slower than waves (docs/engine.md): opt-in
    admitted = []
    _spy(monkeypatch, loop, "admit", admitted, lambda *a: 1)
    waves = generate_ids(model, prompts, cfg, EOS, 0)
    assert admitted == []
    refilled = generate_ids(model, prompts, replace(cfg, refill=True), EOS, 0)
    assert admitted
    assert [s.token_ids for r in waves for s in r] == [s.token_ids for r in refilled for s in r]


def test_one_prompt_held_once_for_all_its_rows(monkeypatch):
    """One prompt, its rows in order: the prompt's output regrouped by row is a view that must be made whole."""
    _through_bridgelm_attention(monkeypatch)
    model = randomize_blocks(bridgelm.add_bridge(tiny_model()), std=0.2)
    cfg = SamplingConfig(n=4, width=2, max_new_tokens=5, temperature=1.0, seed=1)
    shared = generate_ids(model, [[10, 11, 12]], replace(cfg, share_prompts=True), EOS, 0)
    copied = generate_ids(model, [[10, 11, 12]], replace(cfg, share_prompts=False), EOS, 0)
    assert [s.token_ids for s in shared[0]] == [s.token_ids for s in copied[0]]


@pytest.mark.parametrize("draws", [False, True])
def test_the_compiled_step_refills_rows_in_its_bucket_with_the_same_samples(monkeypatch, draws):
    """Static shapes: the batch stays at its bucket while groups wait, the write slot goes around the ring; the
    samples are those of one eager wave, the log-probs grouped_logits'. `draws`: the GPU's step that draws inside
    (forced here), whose draws of a step with new rows are made again from their prefill's logits."""
    model = randomize_blocks(bridgelm.add_bridge(tiny_model()), std=0.2)
    torch.manual_seed(6)
    prompts = [torch.randint(7, 97, (n,)).tolist() for n in (5, 2, 9, 3, 12, 4)]
    cfg = SamplingConfig(n=4, width=2, max_new_tokens=10, temperature=0.9, top_p=0.9, seed=3, refill=True)
    big = generate_ids(model, prompts, cfg, EOS, 0)
    if draws:
        monkeypatch.setattr(sampler, "defers_draws", lambda device, cfg: True)
    admitted, columns = [], []
    _spy(monkeypatch, loop, "admit", admitted, lambda *a: len(a[5]))
    real_column = cache.SlabCache.column

    def column(c, position):
        columns.append((position, real_column(c, position)))
        return columns[-1][1]

    monkeypatch.setattr(cache.SlabCache, "column", column)
    small = generate_ids(model, prompts, replace(cfg, compile=True, max_batch_sequences=4), EOS, 0)
    assert len(admitted) >= 4 and any(col < position for position, col in columns)  # refilled, around the ring
    assert [s.token_ids for r in small for s in r] == [s.token_ids for r in big for s in r]
    want = teacher_forced_logprobs(model, prompts, small, 2, 0.9)
    for s, ref in zip([s for r in small for s in r], want):
        assert torch.allclose(torch.tensor(s.logprobs), ref, atol=2e-3)


def test_a_model_that_builds_its_own_masks_keeps_waves():
    """Sliding-window layers build their masks from the cache's length, which a ring does not have: refill falls
    back to waves there (it crashed at the first refill), with the waves' samples."""
    model = tiny_model("mistral", sliding_window=4)
    prompts = [[10, 11, 12], [20, 21], [30, 31, 32, 33]]
    cfg = SamplingConfig(n=2, width=1, max_new_tokens=8, temperature=1.0, top_p=1.0, seed=0, max_batch_sequences=2)
    refilled = generate_ids(model, prompts, replace(cfg, refill=True), EOS, 0)
    assert [[s.token_ids for s in r] for r in refilled] == [[s.token_ids for s in r] for r in
                                                            generate_ids(model, prompts, cfg, EOS, 0)]
    assert not step.reads_whole(model) and step.reads_whole(tiny_model())


def test_rows_waiting_for_a_refill_stay_within_the_context(monkeypatch):
    """A finished row keeps its last position while its group waits (it counted on past the model's context): under
    a RoPE scaled by the batch's largest position (rope_type "dynamic") refill gives one wave's samples."""
    model = tiny_model("llama", max_position_embeddings=32,
                       rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10.0})
    torch.manual_seed(174)
    prompts = [torch.randint(7, 97, (n,)).tolist() for n in (2, 20, 2, 20, 18, 2, 5, 5, 2)]
    ends = list(range(7, 20))  # frequent ends: rows finish early and wait
    cfg = SamplingConfig(n=2, width=1, max_new_tokens=12, temperature=1.0, top_p=1.0, seed=174, compact_fraction=0.5)
    big = generate_ids(model, prompts, cfg, ends, 0)
    fed = []
    _spy(monkeypatch, step, "decode_step", fed, lambda model, cache, tokens, pos, *a: int(pos.max()))
    small = generate_ids(model, prompts, replace(cfg, max_batch_sequences=4, refill=True), ends, 0)
    assert max(fed) < 32  # every position fed is one of the context's
    flat = lambda res: [s for r in res for s in r]  # noqa: E731
    assert [s.token_ids for s in flat(small)] == [s.token_ids for s in flat(big)]
    for a, b in zip(flat(small), flat(big)):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)

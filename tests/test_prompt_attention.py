"""Decode attention over a shared prompt (bridgelm.prompt_attention) against the slow reference: each row's whole
keys (its prompt's copied, then its own) through matmul_attention; and the engine holding each prompt once against
the engine copying it to every row."""

from dataclasses import replace

import pytest
import torch
from conftest import randomize_blocks, tiny_model
from test_engine import EOS, teacher_forced_logprobs

import bridgelm
from bridgelm import attention
from bridgelm.attention import matmul_attention
from bridgelm.engine import SamplingConfig, batch, generate_ids
from bridgelm.engine.waves import plan_waves
from bridgelm.prompt_attention import PromptRows, SharedPrompt, shared_prompt_attention


def test_prompt_rows_place_every_row_in_one_slot_of_its_prompt():
    src = torch.tensor([2, 0, 2, 2, 0, 3])  # prompt 1 has no row; prompt 2 three
    rows = PromptRows.of(src, 4)
    assert rows.k == 3 and rows.slots.numel() == 12
    assert torch.equal(rows.slots[rows.where], torch.arange(6))  # each row in its slot
    assert torch.equal(rows.where // 3, src)  # the slot belongs to the row's prompt
    assert int((rows.slots == 6).sum()) == 12 - 6  # the rest empty
    assert rows.where.unique().numel() == 6
    assert not rows.in_order
    in_order = PromptRows.of(torch.tensor([0, 0, 1, 1, 2, 2]), 3)  # as a wave starts: k rows per prompt, in order
    assert in_order.in_order and torch.equal(in_order.where, torch.arange(6))
    assert not PromptRows.of(torch.tensor([0, 0, 1, 2, 2]), 3).in_order  # a prompt short of a row


def test_rows_in_order_skip_the_gathers_with_the_same_result():
    """A layout with every prompt's rows in order (`in_order`) takes no gathers, and gives what the gathers give."""
    got, _, shared, (own_k, own_v) = _case(torch.bfloat16, [0, 0, 1, 1, 2, 2])
    assert shared.rows.in_order
    gathered = replace(shared, rows=replace(shared.rows, in_order=False))
    g = torch.Generator().manual_seed(0)
    query = torch.randn(6, 4, 1, 8, generator=g).to(torch.bfloat16)
    mask = (torch.rand(6, 12, generator=g) > 0.3)[:, None, None, :]
    fast = shared_prompt_attention(query, own_k, own_v, shared, mask, 0.3)
    assert torch.equal(fast, shared_prompt_attention(query, own_k, own_v, gathered, mask, 0.3))


def _case(dtype, src, prompts=3, heads=4, kv_heads=2, Lp=7, Lg=5, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    B = len(src)
    src = torch.tensor(src)
    prompt_k, prompt_v = (torch.randn(prompts, kv_heads, Lp, D, generator=g).to(dtype) for _ in range(2))
    own_k, own_v = (torch.randn(B, kv_heads, Lg, D, generator=g).to(dtype) for _ in range(2))
    query = torch.randn(B, heads, 1, D, generator=g).to(dtype)
    mask = torch.rand(B, Lp + Lg, generator=g) > 0.3
    mask[:, : 2] = False  # left padding of the shortest prompt
    mask[0, :] = False  # a row with no key: a finite average, as matmul_attention gives
    shared = SharedPrompt(prompt_k, prompt_v, PromptRows.of(src, prompts))
    key, value = torch.cat([prompt_k[src], own_k], 2), torch.cat([prompt_v[src], own_v], 2)
    want = matmul_attention(query, key, value, mask[:, None, None, :], 0.3, False)
    got = shared_prompt_attention(query, own_k, own_v, shared, mask[:, None, None, :], 0.3)
    return got, want, shared, (own_k, own_v)


@pytest.mark.parametrize("src", [[0, 0, 1, 1, 2, 2], [2, 0, 2, 1, 0, 2, 2], [1, 1, 1]])
def test_shared_prompt_attention_equals_attention_over_copied_prompts(src):
    got, want, _, _ = _case(torch.float32, src)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-6), (got - want).abs().max()


def test_bf16_shared_prompt_attention_is_as_close_to_float64_as_the_copies():
    got, want, _, _ = _case(torch.bfloat16, [2, 0, 2, 1, 0, 2, 2])
    exact, _, _, _ = _case(torch.float64, [2, 0, 2, 1, 0, 2, 2])
    assert (got.double() - exact).abs().max() <= 2 * (want.double() - exact).abs().max() + 1e-3


def test_calls_it_does_not_cover_see_the_whole_rows():
    """A key carrying a shared prompt in a call the two-matmul path does not take (more than one query): the
    attention copies the prompt back to each row and hands the whole rows to sdpa."""
    _, _, shared, (own_k, own_v) = _case(torch.float32, [0, 1, 1])
    setattr(own_k, attention.SHARED, shared)
    query = torch.randn(3, 4, 2, 8)
    mask = torch.ones(3, 1, 2, 12, dtype=torch.bool)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = False, 2
    got, _ = attention.attention(module, query, own_k, own_v, mask, scaling=0.3)
    key, value = (t.repeat_interleave(2, 1) for t in shared.expanded(own_k, own_v))
    want = torch.nn.functional.scaled_dot_product_attention(query, key, value, mask, scale=0.3).transpose(1, 2)
    assert torch.allclose(got, want, atol=1e-6)


def _through_bridgelm_attention(monkeypatch):
    """float32 through bridgelm's attention (which float32 leaves to sdpa by default)."""
    monkeypatch.setattr(attention, "wins", lambda model: True)
    monkeypatch.setattr(attention, "_covered", lambda *a: True)


@pytest.mark.parametrize("foreign", [False, True])
def test_the_engine_holding_each_prompt_once_samples_what_it_samples_with_copies(monkeypatch, foreign):
    """Ragged prompts, groups finishing and dropped (prompts left with no row), foreign groups: the same samples
    and log-probs as the cache that copies each prompt to its rows, and both equal grouped_logits."""
    model = randomize_blocks(bridgelm.add_bridge(tiny_model()), std=0.2)
    torch.manual_seed(0)
    prompts = [torch.randint(7, 97, (n,)).tolist() for n in (5, 2, 9, 3)]
    cfg = SamplingConfig(n=4, width=2, max_new_tokens=70, temperature=0.9, top_p=0.9, seed=0, compact_fraction=0.2)
    cfg = replace(cfg, foreign_groups=foreign, share_prompts=True)
    held = []
    real_share = bridgelm.engine.cache.SlabCache.share_prompts

    def spy(cache, src, count):
        held.append((count, src.numel()))
        return real_share(cache, src, count)

    monkeypatch.setattr(bridgelm.engine.cache.SlabCache, "share_prompts", spy)
    _through_bridgelm_attention(monkeypatch)
    shared = generate_ids(model, prompts, cfg, EOS[:1], 0)
    copied = generate_ids(model, prompts, replace(cfg, share_prompts=False), EOS[:1], 0)
    assert held == [(4, 16)]  # 4 prompts held once for 16 rows
    lengths = [len(s.token_ids) for r in shared for s in r]
    assert min(lengths) < 20 and max(lengths) == 70  # groups dropped long before the end
    assert [s.token_ids for r in shared for s in r] == [s.token_ids for r in copied for s in r]
    for a, b in zip([s for r in shared for s in r], [s for r in copied for s in r]):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
    if not foreign:
        want = teacher_forced_logprobs(model, prompts, shared, 2, 0.9)
        for s, ref in zip([s for r in shared for s in r], want):
            assert torch.allclose(torch.tensor(s.logprobs), ref, atol=2e-3)


def test_compaction_drops_prompts_with_no_row_left():
    cache = bridgelm.engine.cache.SlabCache(num_layers=1, capacity=40, whole_reads=True)
    layer = cache.layers[0]
    prefill = torch.randn(3, 2, 6, 4)
    layer.update(prefill, prefill + 1)
    cache.share_prompts(torch.tensor([0, 0, 1, 1, 2, 2]), 3)
    step = torch.randn(6, 2, 1, 4)
    layer.update(step, step)
    cache.select_rows(torch.tensor([0, 1, 4, 5]))  # prompt 1's rows finished
    assert torch.equal(layer.shared.keys, prefill[[0, 2]]) and torch.equal(layer.shared.values, prefill[[0, 2]] + 1)
    assert torch.equal(layer.shared.rows.src, torch.tensor([0, 0, 1, 1]))
    assert torch.equal(layer.keys[:, :, :1], step[[0, 1, 4, 5]])
    assert getattr(layer.keys, attention.SHARED) is layer.shared  # the attention finds it on the slab
    assert cache.read_length(8) == 6 + 16  # the prompt, then the own slab: its first step (16 positions)
    assert cache.read_length(39) == 6 + 34  # ... grown, capped by what is left


def test_by_default_the_prompt_is_held_once_where_the_copies_would_be_large(monkeypatch):
    """share_prompts=None: a wave shares its prompts when copies would add SHARE_MIN_POSITIONS prompt positions
    (where it was measured to pay), and copies them below that."""
    assert batch.SHARE_MIN_POSITIONS == 16_384
    held = []
    real = bridgelm.engine.cache.SlabCache.share_prompts
    monkeypatch.setattr(bridgelm.engine.cache.SlabCache, "share_prompts", lambda c, *a: held.append(a) or real(c, *a))
    _through_bridgelm_attention(monkeypatch)
    model = tiny_model()
    cfg = SamplingConfig(n=8, max_new_tokens=2, temperature=0.0)
    assert cfg.share_prompts is None
    small = [[7] * 20] * 2  # copies would add 2 x 7 x 20 = 280 positions
    large = [[7] * 200] * 8  # n=16: 8 x 15 x 200 = 24,000
    generate_ids(model, small, cfg, [], 0)
    assert held == []
    generate_ids(model, large, replace(cfg, n=16), [], 0)
    assert len(held) == 1 and held[0][1] == 8
    assert not batch.share_pays(plan_waves([292] * 8, cfg)[0]) and batch.share_pays(plan_waves([293] * 8, cfg)[0])

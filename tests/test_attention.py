"""The two-matmul attention against PyTorch's sdpa (float64 math kernel as the reference), and its switch."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model
from torch.nn.attention import SDPBackend, sdpa_kernel

import bridgelm
from bridgelm import attention, packed
from bridgelm.attention import fast_attention, matmul_attention
from bridgelm.logprobs import Row, forward_logits, pack_rows
from bridgelm.models import enable_checkpointing
from bridgelm.scores import keys_first, scores_of


def reference(q, k, v, mask, scale, causal):
    """sdpa's math kernel in float64, keys repeated per query head."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.double()
    with sdpa_kernel([SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q.double(), k, v, attn_mask=mask, scale=scale, is_causal=causal)


def padded_causal(lengths, S):
    keep = torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]  # [B, S]
    return torch.ones(S, S, dtype=torch.bool).tril()[None, None] & keep[:, None, None, :]  # [B, 1, S, S]


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 6), (8, 1)])
@pytest.mark.parametrize("case", ["decode", "train-mask", "train-causal", "float-mask"])
@pytest.mark.parametrize("layout", ["dense", "strided"])  # strided: the cache slice / transposed projection layouts
def test_matmul_attention_equals_sdpa(heads, kv_heads, case, layout):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    B, D, L = 3, 8, 7
    S = 1 if case == "decode" else L
    shapes = ((heads, S), (kv_heads, L), (kv_heads, L))
    q, k, v = (torch.randn(B, h, n, D, generator=g, dtype=torch.float64) for h, n in shapes)
    if layout == "strided" and case == "decode":  # keys and values: the first L positions of a larger cache
        k, v = (torch.cat([t, torch.randn_like(t)[:, :, :3]], 2)[:, :, :L] for t in (k, v))
    elif layout == "strided":  # as a projection hands them over: [B, L, KVH, D] transposed
        k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
    if kv_heads > 1 or case == "decode":  # (one key/value head transposed is still contiguous)
        assert (layout == "strided") != (k.is_contiguous() and v.is_contiguous())
    causal = case == "train-causal"
    mask = None
    if case == "decode":
        mask = torch.tensor([[1, 1, 1, 0, 1, 1, 1], [1] * 7, [0, 0, 1, 1, 1, 1, 0]], dtype=torch.bool)[:, None, None]
    elif case == "train-mask":
        mask = padded_causal([7, 4, 5], L)
    elif case == "float-mask":
        mask = torch.randn(B, heads, S, L, generator=g, dtype=torch.float64)
    got = matmul_attention(q, k, v, mask, 0.3, causal)
    want = reference(q, k, v, mask, 0.3, causal)
    if case == "train-mask":  # padded query rows attend to nothing of theirs beyond the pad; compare live rows
        live = torch.arange(L)[None, :] < torch.tensor([7, 4, 5])[:, None]
        got, want = got.transpose(1, 2)[live], want.transpose(1, 2)[live]
    assert torch.allclose(got, want, atol=1e-12)


def test_matmul_attention_gradients_equal_sdpa():
    g = torch.Generator().manual_seed(0)
    B, H, KVH, S, D = 2, 4, 2, 6, 8
    leaves = [torch.randn(B, h, S, D, generator=g, dtype=torch.float64, requires_grad=True) for h in (H, KVH, KVH)]
    mask = padded_causal([6, 6], S)
    weights = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    grads = []
    for fn in (lambda *a: matmul_attention(*a, mask, 0.35, False), lambda *a: reference(*a, mask, 0.35, False)):
        (fn(*leaves) * weights).sum().backward()
        grads.append([t.grad.clone() for t in leaves])
        for t in leaves:
            t.grad = None
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-12)


def test_bf16_matmul_attention_is_as_close_to_float64_as_sdpa():
    g = torch.Generator().manual_seed(1)
    B, H, KVH, L, D = 16, 8, 2, 40, 32
    q = torch.randn(B, H, 1, D, generator=g).bfloat16()
    k, v = (torch.randn(B, KVH, L, D, generator=g).bfloat16() for _ in range(2))
    mask = (torch.rand(B, 1, 1, L, generator=g) > 0.2) | (torch.arange(L) == 0)
    want = reference(q, k, v, mask, D**-0.5, False)
    ours = (matmul_attention(q, k, v, mask, D**-0.5, False).double() - want).abs().max()
    fused = (F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).double() - want).abs().max()
    assert ours < 3 * fused + 1e-3


def test_switch_is_used_for_bf16_on_cpu_and_restored(monkeypatch):
    """Inside fast_attention a bf16 Qwen2 computes its attention with the matmuls (and the same logits as sdpa),
    float32 calls go to sdpa, and the model's setting is back afterwards, also after an error. On a CPU without
    bf16 instructions bf16 keeps sdpa too."""
    calls = []
    real = attention.matmul_attention
    monkeypatch.setattr(attention, "matmul_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(packed, "half_instructions", lambda dtype: True)  # a CPU with AVX-512 BF16, say
    model = bridgelm.add_bridge(tiny_model(dtype=torch.bfloat16))
    ids = torch.randint(7, 97, (3, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    want = model(input_ids=ids, attention_mask=mask).logits.float()
    with fast_attention(model):
        assert model.config._attn_implementation == attention.NAME
        got = model(input_ids=ids, attention_mask=mask).logits.float()
    assert model.config._attn_implementation == "sdpa"
    assert len(calls) == model.config.num_hidden_layers
    live = mask.bool()
    assert (got - want)[live].abs().max() < 0.05 * want[live].abs().max()
    with pytest.raises(RuntimeError), fast_attention(model):
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
    enable_checkpointing(model)  # the backward's recomputation would run outside the context
    model.train()
    with fast_attention(model):
        assert model.config._attn_implementation == "sdpa"
    with torch.no_grad(), fast_attention(model):  # nothing is recomputed without gradients
        assert model.config._attn_implementation == attention.NAME
    model.eval()
    with fast_attention(model):  # nor in eval mode (the engine's)
        assert model.config._attn_implementation == attention.NAME
    calls.clear()
    fp32 = tiny_model()
    with fast_attention(fp32):
        fp32(input_ids=ids, attention_mask=mask)
    assert calls == []  # float32: the fused kernel is as fast (benchmarks/attention.py)
    monkeypatch.setattr(packed, "half_instructions", lambda dtype: False)  # an AVX2-only CPU
    bf16 = tiny_model(dtype=torch.bfloat16)
    with fast_attention(bf16):
        assert bf16.config._attn_implementation == "sdpa"
        bf16(input_ids=ids, attention_mask=mask)
    assert calls == []


def test_gradient_checkpointing_keeps_the_engines_decode_attention(monkeypatch):
    """A model that recomputes its layers in training (gradient checkpointing, as RL's policy) still decodes its
    rollouts with the two-matmul attention (one query per row), and samples what it samples without checkpointing."""
    from bridgelm.engine import SamplingConfig, generate_ids

    queries = []
    real = attention.matmul_attention
    monkeypatch.setattr(
        attention, "matmul_attention", lambda q, *a, **k: queries.append(q.shape[2]) or real(q, *a, **k)
    )
    shared = attention.shared_prompt_attention  # the decode steps' path, each prompt's keys held once
    monkeypatch.setattr(
        attention, "shared_prompt_attention", lambda q, *a, **k: queries.append(q.shape[2]) or shared(q, *a, **k)
    )
    monkeypatch.setattr(packed, "half_instructions", lambda dtype: True)  # a CPU with AVX-512 BF16, say
    cfg = SamplingConfig(n=2, width=2, max_new_tokens=4, temperature=1.0, seed=3, pack_weights=False)
    model = bridgelm.add_bridge(tiny_model(dtype=torch.bfloat16))
    want = generate_ids(model, [[7, 8, 9]], cfg, [], 0)
    enable_checkpointing(model)
    model.train()
    queries.clear()
    got = generate_ids(model, [[7, 8, 9]], cfg, [], 0)
    assert 1 in queries  # the decode steps
    assert [[s.token_ids for s in row] for row in got] == [[s.token_ids for s in row] for row in want]
    assert model.training  # given back as it was


def test_half_matmuls_are_those_of_the_cpus_onednn():
    assert packed.half_instructions(torch.bfloat16) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert packed.half_instructions(torch.float16) == torch.ops.mkldnn._is_mkldnn_fp16_supported()
    assert not packed.half_instructions(torch.float32)


def test_trainer_forward_under_autocast_uses_it_and_keeps_gradients(monkeypatch):
    """The trainers' grouped forward (bf16 autocast on CPU) goes through the matmul path; its log-prob gradients
    agree with the sdpa forward's."""
    calls = []
    real = attention.matmul_attention
    monkeypatch.setattr(attention, "matmul_attention", lambda *a, **k: calls.append(on) or real(*a, **k))
    monkeypatch.setattr(packed, "half_instructions", lambda dtype: True)  # a CPU with AVX-512 BF16, say
    torch.manual_seed(3)
    model = bridgelm.add_bridge(tiny_model())
    rows = [Row([5, 6, 7], [8, 9, 10, 2], 0), Row([5, 6, 7], [11, 2], 0), Row([9, 9], [12, 13, 14, 15, 2], 1)]
    batch = pack_rows(rows, 0)
    grads, max_keys = [], attention.MAX_KEYS
    for on in (True, False):
        monkeypatch.setattr(attention, "MAX_KEYS", max_keys if on else -1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = forward_logits(model, batch)
        logits.float().logsumexp(-1).sum().backward()
        grads.append(torch.cat([p.grad.flatten().clone() for p in model.parameters() if p.grad is not None]))
        model.zero_grad()
    assert calls == [True] * model.config.num_hidden_layers  # on: every layer; off (MAX_KEYS -1): none
    assert torch.isfinite(grads[0]).all()
    assert (grads[0] - grads[1]).norm() < 0.05 * grads[1].norm()


def test_a_query_with_every_key_masked_stays_finite():
    """Left-padded prompts: a pad position's query sees no key. Its output must be finite (masked keys of the next
    layer multiply it by 0), where -inf scores would give NaN and spread it."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g).bfloat16() for _ in range(3))
    keep = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()[None, None] & keep[:, None, None, :]  # row 0, query 0: none
    out = matmul_attention(q, k, v, mask, 0.3, False)
    assert torch.isfinite(out).all()
    want = reference(q, k, v, mask, 0.3, False)
    assert torch.allclose(out[:, :, 2:].double(), want[:, :, 2:], atol=0.05)  # the live queries


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_scores_put_the_keys_first_and_equal_q_k_transposed(dtype):
    """`scores_of` multiplies k q^T on CPU in bf16 for a few queries per row (a decode step's stacked heads) against
    many keys, q k^T otherwise: float32 scores, contiguous, within the output's rounding of the float64 product
    either way."""
    torch.manual_seed(0)
    q, k = torch.randn(6, 3, 3, 64, dtype=dtype), torch.randn(6, 3, 64, 64, dtype=dtype)
    long_q = torch.randn(6, 3, 96, 64, dtype=dtype)
    assert keys_first(q, k) == (dtype == torch.bfloat16)  # float32 keeps q k^T (MKL: faster so)
    assert not keys_first(long_q, k) and not keys_first(q, k[:, :, :32])  # many queries; few keys
    for query in (q, long_q):
        got = scores_of(query, k)
        want = query.double() @ k.double().transpose(-1, -2)
        assert got.dtype == torch.float32 and got.is_contiguous() and got.shape == want.shape
        size = query.double().abs() @ k.double().abs().transpose(-1, -2)  # what the rounding errors scale with
        ulp = 2**-8 if dtype == torch.bfloat16 else 2**-16  # bf16: the output's rounding; float32: accumulation
        assert ((got.double() - want).abs() <= ulp * size).all()


def test_the_orders_benchmark_times_both_orders_of_the_same_scores(monkeypatch):
    """`benchmarks/attention.py --decode-orders` on a small shape: both orders timed, and equal where the kernels
    compute them alike (float32 here: the same products summed; reported, not assumed, elsewhere)."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "benchmarks"))
    import attention as bench  # benchmarks/attention.py

    monkeypatch.setattr(bench, "LAYERS", 3)
    r = bench.measure_orders((4, 4, 2, 8, 16), torch.float32, repeats=2)
    assert r["q_first_us"] > 0 and r["k_first_us"] > 0 and r["q_first_over_k_first"] > 0
    assert isinstance(r["bit_equal"], bool)

"""The sampler's two-level inverse-CDF draw (bridgelm.engine.sampler.search): the softmax's distribution, no scan
of the vocabulary, never a token of zero probability."""

import pytest
import torch
from conftest import tiny_model

import bridgelm
from bridgelm.engine import SamplingConfig, generate_ids, sampler


def full_cdf_draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The slow reference: a float64 CDF over the whole vocabulary, searched for u x total."""
    cdf = torch.cumsum(probs.double(), -1)
    return torch.searchsorted(cdf, (u.double() * cdf[:, -1])[:, None], right=True)[:, 0]


@pytest.mark.parametrize("V", [97, 256, 600, 1300])  # one short block, one full block, full blocks + a short one
def test_block_draw_equals_the_full_cdf_draw(V):
    """Same uniforms, same tokens as a float64 CDF over the whole row, except where a uniform falls within float32
    rounding of a token's boundary (then a neighbour of positive probability)."""
    g = torch.Generator().manual_seed(V)
    logits = torch.randn(4000, V, generator=g) * torch.linspace(0.1, 6, 4000)[:, None]  # flat to peaked rows
    probs = torch.softmax(logits, -1)
    u = torch.rand(4000, generator=g)
    got = sampler.search(probs, sampler.block_cdf(probs), u)
    want = full_cdf_draw(probs, u)
    differ = torch.nonzero(got != want)[:, 0]
    assert len(differ) <= 4, len(differ)
    cdf = torch.cumsum(probs.double(), -1)
    for r in differ.tolist():  # each a rounding case: the uniform within 1e-5 of the reference token's boundary
        edge = cdf[r, min(got[r], want[r])]  # the upper end of the lower token's interval
        assert abs(float(edge) - float(u[r]) * float(cdf[r, -1])) < 1e-5 and probs[r, got[r]] > 0


def test_fast_draw_follows_the_softmax():
    """sample_tokens at top_p = 1, top-k off: 60,000 draws of one row of 600 tokens (two full blocks and a short
    one) against softmax(logits / T) by a chi-square test (599 degrees of freedom: mean 599, sd 35)."""
    g = torch.Generator().manual_seed(0)
    V, N = 600, 60_000
    logits = torch.randn(1, V, generator=g)
    table = torch.rand(N, generator=g)
    uniform = lambda rows, attempt: table[rows]  # noqa: E731
    tokens, logprobs = sampler.sample_tokens(logits.expand(N, V), 0.8, 1.0, 0, uniform)
    p = torch.softmax(logits[0].double() / 0.8, 0)
    counts = torch.bincount(tokens, minlength=V).double()
    chi2 = float(((counts - N * p) ** 2 / (N * p)).sum())
    assert chi2 < 599 + 5 * 35, chi2
    torch.testing.assert_close(logprobs, p.log().float()[tokens], rtol=0, atol=1e-5)
    # The same statistic notices a draw from another distribution (temperature 1 instead of 0.8).
    other = torch.bincount(sampler.sample_tokens(logits.expand(N, V), 1.0, 1.0, 0, uniform)[0], minlength=V)
    assert float(((other - N * p) ** 2 / (N * p)).sum()) > 599 + 5 * 35


def test_no_zero_probability_token_is_ever_drawn():
    """Tokens of probability 0 (masked logits) on block edges and in the short last block, uniforms at 0 and
    just under 1: only the five tokens of positive probability come out, at their rates."""
    V = 1000
    logits = torch.full((1, V), float("-inf"))
    live = [0, 255, 256, 511, 999]
    logits[0, live] = torch.tensor([1.0, 2.0, 0.0, 3.0, 1.0])
    u = torch.cat([torch.tensor([0.0, 1 - 2**-24]), torch.rand(19_998, generator=torch.Generator().manual_seed(1))])
    tokens, _ = sampler.sample_tokens(logits.expand(len(u), V), 1.0, 1.0, 0, lambda rows, a: u[rows])
    assert set(tokens.tolist()) == set(live)
    freq = torch.bincount(tokens, minlength=V)[live].double() / len(u)
    torch.testing.assert_close(freq, torch.softmax(logits[0, live].double(), 0), rtol=0, atol=0.015)


@pytest.mark.parametrize("deferred", [False, True])
def test_the_draw_at_top_p_1_scans_no_vocabulary(monkeypatch, deferred):
    """At top_p = 1 with top-k off, no cumulative sum (and no sort) runs over the vocabulary: the widest scan is
    a block's or the block sums'. Through the engine, CPU path and GPU (deferred) path."""
    V = 1300
    widths, real_cumsum = [], torch.cumsum

    def spy_cumsum(x, dim, *a, **k):
        widths.append(x.shape[dim])
        return real_cumsum(x, dim, *a, **k)

    def no_sort(*a, **k):
        raise AssertionError("the sampler sorted")

    monkeypatch.setattr(torch, "cumsum", spy_cumsum)
    for name in ("sort", "argsort", "topk"):
        monkeypatch.setattr(torch, name, no_sort)
        monkeypatch.setattr(torch.Tensor, name, no_sort)
    monkeypatch.setattr(sampler, "defers_draws", lambda device, cfg: deferred)
    model = tiny_model(vocab_size=V)
    cfg = SamplingConfig(n=4, width=2, max_new_tokens=6, temperature=1.0, top_p=1.0, seed=3)
    widths.clear()
    results = generate_ids(bridgelm.add_bridge(model), [[10, 11, 12], [20, 21]], cfg, [], 0)
    assert widths and max(widths) <= sampler.BLOCK < V
    assert all(len(s.token_ids) == 6 for r in results for s in r)


def test_a_seed_is_an_integer_taken_by_value():
    """numpy's integers seed as Python's do (a loop over np.arange(3) reproduces seeds 0, 1, 2); anything else that
    is not an integer >= 0 is refused in one line, not hashed into other draws."""
    import numpy as np

    from bridgelm.errors import UserError
    from bridgelm.tokenizer import char_tokenizer

    tok = char_tokenizer("0123456789+= ")
    model = tiny_model(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    draw = lambda seed: [s.text for s in bridgelm.generate(model, tok, ["1+1="], n=4, max_new_tokens=6, seed=seed)[0]]
    assert draw(np.int64(1)) == draw(1) != draw(2)
    for bad in (1.0, "1", None, -1, True):
        with pytest.raises(UserError, match=rf"seed={bad!r}: expected an integer >= 0"):
            draw(bad)


def test_settings_as_a_dict_are_refused_naming_the_keywords_form():
    from bridgelm.errors import UserError
    from bridgelm.tokenizer import char_tokenizer

    tok = char_tokenizer("0123456789+= ")
    model = tiny_model(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with pytest.raises(UserError, match=r"cfg=\{'n': 2\}: expected a SamplingConfig, or the settings as keywords"):
        bridgelm.generate(model, tok, ["1+1="], cfg={"n": 2})


@pytest.mark.parametrize("eos", [-1, 10**6, "x", [2, 99]])
def test_an_end_id_the_model_cannot_draw_is_refused(eos):
    """An eos_token_id outside the vocabulary would never end a sample (every one would run to max_new_tokens)."""
    from bridgelm.errors import UserError
    from bridgelm.tokenizer import char_tokenizer

    tok = char_tokenizer("0123456789+= ")
    model = tiny_model(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with pytest.raises(UserError, match=rf"eos_token_id=.*: expected a token id from 0 to {len(tok) - 1}"):
        bridgelm.generate(model, tok, ["1+1="], n=1, max_new_tokens=2, eos_token_id=eos)


def test_keys_make_a_prompts_samples_independent_of_the_list_around_it():
    """By default a prompt's streams are keyed by its position; with `keys`, a subset or a shuffled list at the same
    seed draws each prompt's samples again."""
    from bridgelm.errors import UserError
    from bridgelm.tokenizer import char_tokenizer

    tok = char_tokenizer("0123456789+-=() ")
    model = tiny_model(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    prompts, keys = ["1+1=", "2+3=", "10-4=", "(3)"], [10, 11, 12, 13]

    def texts(ps, ks=None):
        drawn = bridgelm.generate(model, tok, ps, n=4, width=2, max_new_tokens=6, seed=3, keys=ks)
        return {p: [s.text for s in samples] for p, samples in zip(ps, drawn)}

    assert texts(prompts[::-1], keys[::-1]) == texts(prompts, keys) == {**texts(prompts[2:], keys[2:]),
                                                                        **texts(prompts[:2], keys[:2])}
    assert texts(prompts[::-1]) != texts(prompts)  # keyed by position: another order, other samples
    with pytest.raises(UserError, match=r"keys has 3 entries: expected one per prompt \(4\)"):
        texts(prompts, keys[:3])

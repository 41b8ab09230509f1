"""The engine (bridgelm.engine) against slow references: grouped_logits, transformers' generate, a full-sort top-p."""

import warnings
from dataclasses import replace

import pytest
import torch
from conftest import randomize_blocks, tiny_model

import bridgelm
from bridgelm.engine import SamplingConfig, encode_prompts, generate_ids, sampler, step, stream_ids, text
from bridgelm.engine.sampler import in_nucleus
from bridgelm.engine.waves import plan_waves
from bridgelm.errors import UserError
from bridgelm.tokenizer import char_tokenizer

EOS = [2, 3, 4, 5, 6]  # several stop ids, so that some samples end early in a random tiny model


def teacher_forced_logprobs(model, prompts, results, width, temperature, group_of=None):
    """Log-probs of the sampled tokens under grouped_logits on the finished batch. `group_of(i, j)` is the group
    of sample j of prompt i (default: the engine's, consecutive samples of one prompt)."""
    group_of = group_of or (lambda i, j: i * 1000 + j // width)
    rows, gids, spans = [], [], []
    for i, (prompt, samples) in enumerate(zip(prompts, results)):
        for j, s in enumerate(samples):
            rows.append(list(prompt) + s.token_ids)
            gids.append(group_of(i, j))
            spans.append((len(prompt), s.token_ids))
    S = max(map(len, rows))
    ids = torch.zeros(len(rows), S, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, row in enumerate(rows):
        ids[r, : len(row)] = torch.tensor(row)
        mask[r, : len(row)] = 1
    logp = torch.log_softmax(bridgelm.grouped_logits(model, ids, mask, gids).float() / temperature, -1)
    out = []
    for r, (start, toks) in enumerate(spans):
        pos = torch.arange(start - 1, start - 1 + len(toks))
        out.append(logp[r, pos, torch.tensor(toks, dtype=torch.long)])
    return out


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("width,compact", [(4, 0.125), (2, 1.0), (1, 0.125)])
def test_logprobs_match_grouped_logits(arch, width, compact):
    model = randomize_blocks(bridgelm.add_bridge(tiny_model(arch)), std=0.2)
    torch.manual_seed(0)
    prompts = [torch.randint(7, 97, (n,)).tolist() for n in (5, 2, 9, 3)]  # ragged
    cfg = SamplingConfig(
        n=8,
        width=width,
        max_new_tokens=20,
        temperature=0.9,
        top_p=0.9,
        seed=3,
        compact_fraction=compact,
        max_batch_sequences=16,  # two waves
    )
    results = generate_ids(model, prompts, cfg, EOS, 0)
    lengths = [len(s.token_ids) for r in results for s in r]
    assert min(lengths) < 20 and max(lengths) == 20  # some finished early, some ran on
    if width > 1:  # a group where one sample ended while a sibling went on: the finished-mask matters
        assert any(len({len(s.token_ids) for s in r[g : g + width]}) > 1 for r in results for g in range(0, 8, width))
    want = teacher_forced_logprobs(model, prompts, results, width, 0.9)
    flat = [s for r in results for s in r]
    for s, ref in zip(flat, want):
        assert s.finished == (s.token_ids[-1] in EOS)
        assert torch.allclose(torch.tensor(s.logprobs), ref, atol=2e-3), (torch.tensor(s.logprobs) - ref).abs().max()


def test_finished_rows_must_be_masked(monkeypatch):
    """A mutation that keeps finished samples visible to their siblings breaks the consistency."""
    model = randomize_blocks(bridgelm.add_bridge(tiny_model()), std=0.3)
    torch.manual_seed(1)
    prompts = [torch.randint(7, 97, (4,)).tolist() for _ in range(3)]
    cfg = SamplingConfig(n=4, width=4, max_new_tokens=16, temperature=1.0, top_p=1.0, seed=5)
    real = step.Groups.contiguous_width

    def leaky(batch_size, width, valid=None):
        return real(batch_size, width, None)  # everyone valid, always

    monkeypatch.setattr(step.Groups, "contiguous_width", staticmethod(leaky))
    results = generate_ids(model, prompts, cfg, EOS, 0)
    want = teacher_forced_logprobs(model, prompts, results, 4, 1.0)
    errors = [(torch.tensor(s.logprobs) - ref).abs().max() for s, ref in zip([s for r in results for s in r], want)]
    assert max(errors) > 2e-3


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_greedy_without_blocks_equals_transformers(arch):
    model = tiny_model(arch)
    torch.manual_seed(2)
    prompts = [torch.randint(7, 97, (n,)).tolist() for n in (6, 3, 8)]
    cfg = SamplingConfig(n=2, width=1, max_new_tokens=12, temperature=0.0)
    results = generate_ids(model, prompts, cfg, [], 0)
    for prompt, samples in zip(prompts, results):
        ref = model.generate(
            torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0
        )[0, len(prompt) :].tolist()
        for s in samples:
            assert s.token_ids == ref and not s.finished


def test_same_seed_same_samples_other_seed_other_samples():
    model = randomize_blocks(bridgelm.add_bridge(tiny_model()))
    prompts = [[10, 11, 12], [20, 21]]
    cfg = SamplingConfig(n=4, width=2, max_new_tokens=10, temperature=1.0, seed=7)
    a = generate_ids(model, prompts, cfg, EOS, 0)
    b = generate_ids(model, prompts, cfg, EOS, 0)
    c = generate_ids(model, prompts, SamplingConfig(n=4, width=2, max_new_tokens=10, temperature=1.0, seed=8), EOS, 0)
    ids = lambda res: [s.token_ids for r in res for s in r]  # noqa: E731
    assert ids(a) == ids(b)
    assert ids(a) != ids(c)


def test_memory_bound_is_respected(monkeypatch):
    model = tiny_model()
    torch.manual_seed(3)
    prompts = [torch.randint(7, 97, (n,)).tolist() for n in (4, 7, 3, 5, 6, 2, 8)]
    seen = []
    real = step.decode_step

    def spy(model, cache, tokens, *args):
        seen.append(tokens.shape[0])
        return real(model, cache, tokens, *args)

    monkeypatch.setattr(step, "decode_step", spy)
    small = SamplingConfig(n=4, width=2, max_new_tokens=6, temperature=0.0, max_batch_sequences=8, max_batch_tokens=100)
    waves = plan_waves([len(p) for p in prompts], small)
    assert len(waves) > 2
    for wave in waves:
        rows = sum(j.count for j in wave.jobs)
        assert rows <= 8 and rows * (wave.longest + 6) <= 100
    got = generate_ids(model, prompts, small, [], 0)
    assert max(seen) <= 8
    big = generate_ids(model, prompts, SamplingConfig(n=4, width=2, max_new_tokens=6, temperature=0.0), [], 0)
    assert [s.token_ids for r in got for s in r] == [s.token_ids for r in big for s in r]


def test_a_prompt_larger_than_a_batch_is_split_into_whole_groups():
    cfg = SamplingConfig(n=16, width=4, max_new_tokens=4, max_batch_sequences=6)
    waves = plan_waves([3], cfg)
    assert [j.count for w in waves for j in w.jobs] == [4, 4, 4, 4]


def reference_nucleus(probs, top_p):
    """Full sort: keep the most probable tokens until their mass reaches top_p."""
    keep = torch.zeros_like(probs, dtype=torch.bool)
    for b in range(probs.shape[0]):
        order = torch.argsort(probs[b], descending=True)
        mass = 0.0
        for tok, p in zip(order.tolist(), probs[b, order].tolist()):
            keep[b, tok] = True
            mass += p
            if mass >= top_p:
                break
    return keep


@pytest.mark.parametrize("scale", [0.1, 1.0, 8.0])  # flat (nucleus spans most of the vocabulary) to peaked
@pytest.mark.parametrize("top_p", [0.95, 0.5, 0.1])
def test_nucleus_membership_equals_full_sort(scale, top_p):
    torch.manual_seed(4)
    probs = torch.softmax(scale * torch.randn(4, 300, dtype=torch.float64), -1)
    want = reference_nucleus(probs, top_p)
    fast = torch.stack([in_nucleus(probs, torch.full((4,), t), top_p) for t in range(300)], 1)
    assert torch.equal(fast, want)
    scratch = torch.full_like(probs, float("nan"))  # the engine's buffer: whatever it held before is overwritten
    fast = torch.stack([in_nucleus(probs, torch.full((4,), t), top_p, scratch) for t in range(300)], 1)
    assert torch.equal(fast, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [0, 5])
def test_sampler_buffers_change_no_draw_and_are_reused(dtype, top_k):
    """The engine's per-wave buffers: the same tokens and log-probs as fresh tensors, over a batch that shrinks
    (groups dropped) and grows back (a new wave), and no new buffer while the batch fits."""
    g = torch.Generator().manual_seed(3)
    buffers = sampler.SamplerBuffers()
    pointers, pairs = [], []
    for rows in [6, 6, 4, 2, 4, 8]:
        logits = (3 * torch.randn(rows, 50, generator=g)).to(dtype)
        u = torch.rand(rows, 8, generator=g)  # this step's uniforms, the same for both calls
        uniform = lambda r, attempt, u=u: u[r, attempt]  # noqa: E731
        want = sampler.sample_tokens(logits, 0.7, 0.9, top_k, uniform)
        got = sampler.sample_tokens(logits, 0.7, 0.9, top_k, uniform, buffers)
        pairs.append((got, want))
        pointers.append(buffers.probs.data_ptr())
    for got, want in pairs:  # compared after every step: no result is a view of the reused buffers
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert len(set(pointers[:5])) == 1 and pointers[5] != pointers[0]  # grown once, for 8 rows


def test_a_row_of_nan_logits_does_not_stall_the_sampler():
    """Diverged logits (NaN) give some token, as before the mask-free nucleus sum, instead of redrawing forever."""
    g = torch.Generator().manual_seed(0)
    tokens, _ = sampler.sample_tokens(torch.full((2, 50), float("nan")), 1.0, 0.9, 0, g)
    assert tokens.shape == (2,)


def test_sampling_follows_the_truncated_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]])
    g = torch.Generator().manual_seed(0)
    toks = torch.stack([sampler.sample_tokens(logits, 1.0, 0.8, 0, g)[0] for _ in range(4000)])
    p = torch.softmax(logits[0], 0)
    kept = p[:2] / p[:2].sum()  # 0.607 + 0.223 = 0.83 >= 0.8: two tokens
    freq = torch.bincount(toks[:, 0], minlength=5).float() / len(toks)
    assert freq[2:].sum() == 0
    assert torch.allclose(freq[:2], kept, atol=0.03)
    # top-k 3 then top-p 0.9 of the renormalised three: 0.607/0.965 = 0.63, + 0.23 = 0.86 < 0.9 -> all three
    toks = torch.stack([sampler.sample_tokens(logits, 1.0, 0.9, 3, g)[0] for _ in range(4000)])
    freq = torch.bincount(toks[:, 0], minlength=5).float() / len(toks)
    assert freq[3:].sum() == 0
    assert torch.allclose(freq[:3], p[:3] / p[:3].sum(), atol=0.03)


def test_text_api_with_a_tokenizer_chat_and_stop_strings():
    tok = char_tokenizer("0123456789+-=() \nabc")
    model = randomize_blocks(bridgelm.add_bridge(tiny_model(vocab_size=len(tok))))
    out = bridgelm.generate(model, tok, ["1+2=", "a b"], n=4, width=2, max_new_tokens=8, temperature=1.0, top_p=1.0)
    assert len(out) == 2 and all(len(r) == 4 for r in out)
    s = out[0][0]
    assert s.prompt_ids == tok("1+2=")["input_ids"] and len(s.logprobs) == len(s.token_ids)
    assert s.text == tok.decode(s.token_ids, skip_special_tokens=True)
    chat = bridgelm.generate(model, tok, ["1+2="], n=2, width=2, max_new_tokens=4, chat=True)
    assert tok.decode(chat[0][0].prompt_ids) == "<|user|>1+2=<|assistant|>"
    stop = bridgelm.generate(
        model, tok, ["1+2="], n=8, width=2, max_new_tokens=30, temperature=1.0, top_p=1.0, stop_strings=["1"]
    )
    for s in stop[0]:
        assert ("1" in s.text) == s.finished or tok.eos_token_id in s.token_ids
        if "1" in s.text:
            assert s.text.endswith("1") and s.text.count("1") == 1


class _ByteTokenizer:
    """One token per UTF-8 byte, as byte-level BPE splits characters it has no merge for (a Chinese character: 3)."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_a_stop_string_of_many_tokens_per_character_is_found():
    """The stop check decodes a tail long enough for the stop string in bytes, not characters: a 6-character string
    of 18 byte tokens ends the sample at its last token, and not before."""
    stop_string = "答案是四十二"  # 6 characters, 18 bytes
    stop = text.stop_checker(_ByteTokenizer(), [stop_string, "end"])
    ids = list("数学的".encode()) + list(stop_string.encode()) + list("。".encode())
    ends = [t for t in range(1, len(ids) + 1) if stop(ids[:t])]
    assert ends and ends[0] == len("数学的".encode()) + len(stop_string.encode())


def test_a_stop_string_that_is_a_special_token_ends_the_sample():
    """A stop string may be a special token that is not EOS (a chat turn's end): it ends the sample there, though the
    sample's text, decoded without special tokens, does not show it."""
    tok = char_tokenizer("0123456789+=")
    stop = text.stop_checker(tok, ["<|user|>"])
    ids = tok("1+2=3")["input_ids"]
    assert not stop(ids) and stop(ids + [tok.convert_tokens_to_ids("<|user|>")])


def test_a_stop_string_is_not_found_inside_a_special_token():
    """"user" is text the sample writes, not a part of the special token "<|user|>": it stops at the letters, and
    not at the token (whose text the sample does not show)."""
    tok = char_tokenizer("0123456789+=user")
    stop = text.stop_checker(tok, ["user", "<|assistant|>"])
    ids = tok("1+2=3")["input_ids"]
    assert not stop(ids + [tok.convert_tokens_to_ids("<|user|>")])
    assert stop(ids + tok("user")["input_ids"]) and stop(ids + [tok.convert_tokens_to_ids("<|assistant|>")])


def test_a_prompt_that_starts_with_bos_gets_no_second_one():
    """A tokenizer that adds BOS adds it to a plain prompt, but not to one that already starts with it (a chat
    template's output, as lm-eval hands it over)."""
    tok = char_tokenizer("0123456789+=", add_bos=True)
    plain, templated = encode_prompts(tok, ["1+2=", tok.bos_token + "1+2="])
    assert plain == templated and plain.count(tok.bos_token_id) == 1 and plain[0] == tok.bos_token_id


@pytest.mark.parametrize("template, words", [("{% for m in messages %}{{ m.content", "TemplateSyntaxError"),
                                              ("{{ raise_exception('no system role') }}", "no system role")])
def test_a_chat_template_that_fails_is_one_line(template, words):
    """A broken chat_template.jinja (or one that raises) was jinja2's traceback, announced as a bridgelm bug."""
    tok = char_tokenizer("0123456789+=")
    tok.chat_template = template
    with pytest.raises(UserError, match=f"chat: the tokenizer's chat template fails .*{words}.*leave out --chat"):
        encode_prompts(tok, ["1+2="], chat=True)


def test_prompts_as_a_generator_and_ids_outside_the_vocabulary():
    """A generator of prompts is read once (it was read by the length check, then found empty: "prompts is empty");
    an id the embedding lacks is refused by prompt and id (an IndexError of the embedding)."""
    tok = char_tokenizer("0123456789+=")
    model = tiny_model(vocab_size=len(tok))
    cfg = dict(n=2, width=1, max_new_tokens=3, temperature=0.0)
    listed = bridgelm.generate(model, tok, ["1+2=", "3="], **cfg)
    made = bridgelm.generate(model, tok, (p for p in ["1+2=", "3="]), **cfg)
    assert [[s.token_ids for s in r] for r in made] == [[s.token_ids for s in r] for r in listed]
    for ids, bad in (([5, len(tok)], len(tok)), ([-1, 5], -1)):
        with pytest.raises(UserError, match=rf"prompt 0 holds token id {bad}: expected ids in \[0, {len(tok)}\)"):
            generate_ids(model, [ids], SamplingConfig(**cfg), [2], 0)


def test_generate_takes_one_sampling_config_and_changes_of_it():
    """`cfg` and keyword changes make one SamplingConfig (its defaults written once); a name that is no setting is
    refused in one line naming it, before anything is sampled."""
    tok = char_tokenizer("0123456789+=")
    model = randomize_blocks(bridgelm.add_bridge(tiny_model(vocab_size=len(tok))))
    cfg = SamplingConfig(n=4, width=2, max_new_tokens=5, temperature=1.0, top_p=1.0, seed=3)
    by_cfg = bridgelm.generate(model, tok, ["1+2="], cfg)
    by_words = bridgelm.generate(model, tok, ["1+2="], n=4, width=2, max_new_tokens=5, temperature=1.0, top_p=1.0,
                                 seed=3)
    changed = bridgelm.generate(model, tok, ["1+2="], replace(cfg, seed=0), seed=3)
    assert [s.token_ids for s in by_cfg[0]] == [s.token_ids for s in by_words[0]] == [s.token_ids for s in changed[0]]
    assert len(bridgelm.generate(model, tok, ["1"], max_new_tokens=2)[0]) == SamplingConfig().n
    with pytest.raises(ValueError, match=r"^max_tokens=5: not a sampling setting \(expected one of n, width, "):
        bridgelm.generate(model, tok, ["1+2="], n=2, max_tokens=5)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(n=6, width=4), "width=4 must divide n=6"),
        (dict(width=0), "width=0"),
        (dict(max_new_tokens=0), "max_new_tokens=0"),
        (dict(top_p=0.0), "top_p=0.0"),
        (dict(top_p=1.5), "top_p=1.5"),
    ],
)
def test_bad_settings(kwargs, match):
    tok = char_tokenizer("0123456789")
    model = tiny_model(vocab_size=len(tok))
    with pytest.raises(ValueError, match=match):
        bridgelm.generate(model, tok, ["12"], **{"n": 4, **kwargs})


def test_bad_prompts():
    tok = char_tokenizer("0123456789")
    model = tiny_model(vocab_size=len(tok), max_position_embeddings=32)
    with pytest.raises(ValueError, match="prompts is empty"):
        bridgelm.generate(model, tok, [], n=2)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        bridgelm.generate(model, tok, ["1", ""], n=2)
    with pytest.raises(ValueError, match="context of 32"):
        bridgelm.generate(model, tok, ["1" * 30], n=2, max_new_tokens=8)


def test_a_prompts_samples_do_not_depend_on_its_batch():
    """Per-sample random streams: alone, in a batch, or split over waves, a prompt draws the same samples."""
    model = randomize_blocks(bridgelm.add_bridge(tiny_model()), std=0.2)
    torch.manual_seed(7)
    prompts = [torch.randint(7, 97, (n,)).tolist() for n in (5, 3, 8, 4)]
    cfg = SamplingConfig(n=4, width=2, max_new_tokens=12, temperature=1.0, top_p=0.9, seed=11)
    together = generate_ids(model, prompts, cfg, EOS, 0)
    alone = generate_ids(model, prompts[2:3], cfg, EOS, 0, keys=[2])
    assert [s.token_ids for s in alone[0]] == [s.token_ids for s in together[2]]
    small = SamplingConfig(n=4, width=2, max_new_tokens=12, temperature=1.0, top_p=0.9, seed=11, max_batch_sequences=2)
    split = generate_ids(model, prompts, small, EOS, 0)
    assert [s.token_ids for r in split for s in r] == [s.token_ids for r in together for s in r]
    other_key = generate_ids(model, prompts[2:3], cfg, EOS, 0, keys=[99])
    assert [s.token_ids for s in other_key[0]] != [s.token_ids for s in together[2]]


def test_generation_is_prefix_consistent_in_max_new_tokens():
    """The first L tokens do not depend on the budget: Figure 6's budgets can be read off one long run."""
    model = randomize_blocks(bridgelm.add_bridge(tiny_model()), std=0.2)
    prompts = [[10, 11, 12], [20, 21]]
    long = generate_ids(model, prompts, SamplingConfig(n=4, width=2, max_new_tokens=16, temperature=1.0), [], 0)
    short = generate_ids(model, prompts, SamplingConfig(n=4, width=2, max_new_tokens=6, temperature=1.0), [], 0)
    assert [s.token_ids[:6] for r in long for s in r] == [s.token_ids for r in short for s in r]


def test_more_samples_keep_the_first_ones():
    """Sample j's draws are its own (seed, prompt, j): at width 1 the first samples of n = 1, 2 and 4 are the same,
    so a run can be widened to more samples (pass@k at larger k) without changing those it has."""
    model = tiny_model()
    prompts = [[10, 11, 12], [20, 21]]
    runs = {n: generate_ids(model, prompts, SamplingConfig(n=n, width=1, max_new_tokens=8, temperature=1.0,
                                                            top_p=1.0, seed=5), [], 0) for n in (1, 2, 4)}
    for n in (1, 2):
        assert [[s.token_ids for s in r[:n]] for r in runs[4]] == [[s.token_ids for s in r] for r in runs[n]]
    assert runs[4][0][0].token_ids != runs[4][0][1].token_ids  # the samples differ from each other


def test_bf16_logprobs_follow_grouped_logits():
    """In bf16 the engine and the teacher-forced forward round differently; they still agree closely."""
    model = randomize_blocks(bridgelm.add_bridge(tiny_model(dtype=torch.bfloat16)), std=0.2)
    torch.manual_seed(8)
    prompts = [torch.randint(7, 97, (n,)).tolist() for n in (4, 6)]
    cfg = SamplingConfig(n=4, width=2, max_new_tokens=10, temperature=1.0, top_p=1.0, seed=2)
    results = generate_ids(model, prompts, cfg, EOS, 0)
    want = teacher_forced_logprobs(model, prompts, results, 2, 1.0)
    got = torch.cat([torch.tensor(s.logprobs) for r in results for s in r])
    want = torch.cat(want)
    assert torch.isfinite(got).all() and (got - want).abs().mean() < 0.05


@pytest.mark.parametrize(
    "overrides",
    [
        {"attn_implementation": "eager"},  # additive float mask instead of a boolean one
        {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0},  # masks built by the model
    ],
    ids=["eager", "sliding-window"],
)
def test_other_attention_setups_match_grouped_logits(overrides):
    model = randomize_blocks(bridgelm.add_bridge(tiny_model(**overrides)), std=0.2)
    torch.manual_seed(9)
    prompts = [torch.randint(7, 97, (n,)).tolist() for n in (3, 7)]
    cfg = SamplingConfig(n=4, width=2, max_new_tokens=12, temperature=1.0, top_p=1.0, seed=4)
    results = generate_ids(model, prompts, cfg, EOS, 0)
    want = teacher_forced_logprobs(model, prompts, results, 2, 1.0)
    for s, ref in zip([s for r in results for s in r], want):
        assert torch.allclose(torch.tensor(s.logprobs), ref, atol=2e-3)


def test_foreign_groups_match_grouped_logits_and_keep_the_draws():
    """Foreign groups: sample j of `width` prompts form a group. With copies of one prompt (distinct keys), the
    teacher-forced reference can express that grouping: log-probs must follow it. Without Bridge effect, the
    samples must equal those of ordinary grouping (same draws per (key, sample))."""
    model = randomize_blocks(bridgelm.add_bridge(tiny_model("qwen2")), std=0.2)
    prompt = torch.randint(7, 97, (6,), generator=torch.Generator().manual_seed(1)).tolist()
    width, n, P = 4, 3, 8
    keys = [("copy", i) for i in range(P)]
    cfg = SamplingConfig(
        n=n,
        width=width,
        max_new_tokens=16,
        temperature=0.9,
        top_p=0.9,
        seed=5,
        foreign_groups=True,
        max_batch_sequences=width * n,
        compact_fraction=0.3,  # two waves of one block each; compaction happens
    )
    results = generate_ids(model, [prompt] * P, cfg, EOS, 0, keys=keys)
    block_and_sample = lambda i, j: (i // width) * 1000 + j  # noqa: E731
    want = teacher_forced_logprobs(model, [prompt] * P, results, width, 0.9, block_and_sample)
    for s, ref in zip([s for r in results for s in r], want):
        torch.testing.assert_close(torch.tensor(s.logprobs), ref, atol=1e-4, rtol=0)
    # The grouping is real: ordinary grouping of the same prompts gives other samples.
    plain = generate_ids(model, [prompt] * P, replace(cfg, foreign_groups=False, width=1, n=n), EOS, 0, keys=keys)
    assert [s.token_ids for r in plain for s in r] != [s.token_ids for r in results for s in r]
    # A fresh Bridge (no effect): foreign groups draw exactly what independent sampling draws.
    fresh = bridgelm.add_bridge(tiny_model("qwen2"))
    a = generate_ids(fresh, [prompt] * P, cfg, EOS, 0, keys=keys)
    b = generate_ids(fresh, [prompt] * P, replace(cfg, foreign_groups=False, width=1), EOS, 0, keys=keys)
    assert [s.token_ids for r in a for s in r] == [s.token_ids for r in b for s in r]


def test_foreign_groups_need_whole_blocks_of_prompts():
    with pytest.raises(UserError, match="not a multiple of width"):
        generate_ids(tiny_model("qwen2"), [[1, 2, 3]] * 5, SamplingConfig(n=2, width=2, foreign_groups=True), EOS, 0)
    with pytest.raises(ValueError, match="width x n"):
        SamplingConfig(n=8, width=4, foreign_groups=True, max_batch_sequences=16).validate()


@pytest.mark.slow
def test_compiled_decode_step_matches_grouped_logits():
    """torch.compile'd decode step (static cache, batch buckets): log-probs still equal grouped_logits, and the
    samples equal the eager engine's (same draws; the logits differ only by rounding)."""
    model = randomize_blocks(bridgelm.add_bridge(tiny_model("qwen2")), std=0.2)
    torch.manual_seed(0)
    prompts = [torch.randint(7, 97, (n,)).tolist() for n in (5, 3)]
    cfg = SamplingConfig(n=4, width=2, max_new_tokens=12, temperature=0.9, top_p=0.9, seed=3, compile=True)
    results = generate_ids(model, prompts, cfg, EOS, 0)
    lengths = [len(s.token_ids) for r in results for s in r]
    assert min(lengths) < 12 and max(lengths) == 12  # finished groups: the batch moved to a smaller bucket
    want = teacher_forced_logprobs(model, prompts, results, 2, 0.9)
    for s, ref in zip([s for r in results for s in r], want):
        assert torch.allclose(torch.tensor(s.logprobs), ref, atol=2e-3), (torch.tensor(s.logprobs) - ref).abs().max()
    eager = generate_ids(model, prompts, replace(cfg, compile=False), EOS, 0)
    assert [s.token_ids for r in eager for s in r] == [s.token_ids for r in results for s in r]


def test_bucket_compaction_keeps_live_groups_first_in_order():
    alive = torch.tensor([False, True, False, False, True, False, False, False])  # 8 groups, 2 live
    rows = step.bucket_keep(alive, 2, 2)
    assert rows.tolist() == [0, 1, 2, 3, 4, 5, 8, 9]  # groups 0, 1, 2, 4: live 1 and 4, padded with 0 and 2
    assert step.bucket_keep(torch.tensor([True, True, False, True]), 2, 3) is None  # 3 live do not fit in 2


@pytest.mark.parametrize("top_p", [0.9, 0.02])  # 0.02 on flat rows: many rows need more than the deferred rounds
def test_deferred_draws_equal_sample_tokens(top_p):
    """The GPU's sync-free sampler (all rows, DEFERRED_ROUNDS attempts, then the rare rest) draws what
    `sample_tokens` draws, with the same uniforms."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(64, 50, generator=g) * torch.linspace(0.1, 4, 64)[:, None]  # flat to peaked rows
    table = torch.rand(64, 1000, generator=g)  # uniform of (row, attempt)
    uniform = lambda rows, attempt: table[rows, attempt]  # noqa: E731
    want_tok, want_lp = sampler.sample_tokens(logits, 0.8, top_p, 0, uniform)
    tok, lp, unsure = sampler.sample_tokens_deferred(logits, 0.8, top_p, uniform)
    assert (unsure.sum() > 0) == (top_p < 0.1)
    tok, lp = sampler.finish_deferred(logits, tok, unsure, 0.8, top_p, uniform)
    assert torch.equal(tok, want_tok)
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-6)


@pytest.mark.parametrize("top_p", [0.9, 0.05])
def test_engine_with_deferred_draws_gives_the_same_samples(monkeypatch, top_p):
    """The engine's GPU path (deferred draws, one sync per step, a step redone when rows were unsure) forced on
    the CPU: the same samples as the CPU path."""
    model = randomize_blocks(bridgelm.add_bridge(tiny_model()), std=0.2)
    torch.manual_seed(3)
    prompts = [torch.randint(7, 97, (n,)).tolist() for n in (4, 7, 2)]
    cfg = SamplingConfig(n=4, width=2, max_new_tokens=16, temperature=1.5, top_p=top_p, seed=6)
    want = generate_ids(model, prompts, cfg, EOS, 0)
    calls = []
    real = sampler.finish_deferred
    monkeypatch.setattr(sampler, "defers_draws", lambda device, cfg: True)
    monkeypatch.setattr(sampler, "finish_deferred", lambda *a: calls.append(1) or real(*a))
    got = generate_ids(model, prompts, cfg, EOS, 0)
    assert [[s.token_ids for s in r] for r in got] == [[s.token_ids for s in r] for r in want]
    assert [[s.finished for s in r] for r in got] == [[s.finished for s in r] for r in want]
    for r, w in zip(got, want):
        for a, b in zip(r, w):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-6)
    assert bool(calls) == (top_p < 0.1)  # the rare path ran (and only) where rows were unsure


@pytest.mark.slow
def test_compiled_step_that_draws_gives_the_same_samples(monkeypatch):
    """The GPU's compiled step (the forward and the deferred draws in one compiled function, `decode_and_draw`)
    forced on the CPU, with inductor: the samples of the CPU path, log-probs within rounding; many rows need the
    rounds after the sync (a small nucleus of flat rows), and only the first step of a wave draws outside."""
    model = randomize_blocks(bridgelm.add_bridge(tiny_model()), std=0.2)
    torch.manual_seed(3)
    prompts = [torch.randint(7, 97, (n,)).tolist() for n in (4, 7, 2, 5)]
    cfg = SamplingConfig(n=4, width=2, max_new_tokens=12, temperature=1.5, top_p=0.05, seed=6)
    want = generate_ids(model, prompts, cfg, EOS, 0)
    calls, finished = [], []
    real, real_finish = sampler.sample_tokens_deferred, sampler.finish_deferred
    monkeypatch.setattr(sampler, "defers_draws", lambda device, cfg: True)
    monkeypatch.setattr(sampler, "sample_tokens_deferred", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(sampler, "finish_deferred", lambda *a: finished.append(1) or real_finish(*a))
    got = generate_ids(model, prompts, replace(cfg, compile=True), EOS, 0)
    assert [[s.token_ids for s in r] for r in got] == [[s.token_ids for s in r] for r in want]
    assert min(len(s.token_ids) for r in got for s in r) < 12  # finished groups: the batch moved to a smaller bucket
    for r, w in zip(got, want):
        for a, b in zip(r, w):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)
    assert len(calls) == 1 and finished  # one wave: its prefill's logits; the rare path after the sync ran
    # Another temperature and nucleus reuse the compiled step (no EOS: the full batch's shape only, compiled above).
    import torch._dynamo.utils as dynamo_utils

    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    assert graphs > 0
    other = generate_ids(model, prompts, replace(cfg, compile=True, temperature=0.7, top_p=0.5), [], 0)
    assert dynamo_utils.counters["stats"].get("unique_graphs") == graphs
    assert [s.token_ids for s in other[0]] != [s.token_ids for s in got[0]]


@pytest.mark.slow
def test_compiled_step_compiles_once_for_every_read_bucket():
    """A long compiled generation meets the read buckets 64, 96, 128, 192 and 256: the read length is a symbolic
    size and every read a strict slice (a spare slot past the capacity), so inductor compiles one graph (a graph
    per bucket made 5 here, and 13 for 4096 tokens), with the eager path's samples."""
    import torch._dynamo.utils as dynamo_utils

    model = randomize_blocks(bridgelm.add_bridge(tiny_model()), std=0.2)
    prompts = [[7, 8, 9], [10, 11, 12, 13, 14]]
    cfg = SamplingConfig(n=2, width=2, max_new_tokens=240, temperature=0.8, seed=2)
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    got = generate_ids(model, prompts, replace(cfg, compile=True), [], 0)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 1
    want = generate_ids(model, prompts, cfg, [], 0)
    assert [[s.token_ids for s in r] for r in got] == [[s.token_ids for s in r] for r in want]


def test_stream_ids_yields_each_prompt_once_in_order_and_generate_ids_collects_it():
    """The ids entry point streams prompts as their last wave ends (here over several waves, prompts split over
    two); the list form is that stream, collected."""
    model = tiny_model()
    prompts = [[10, 11, 12], [20, 21], [30, 31, 32, 33]]
    cfg = SamplingConfig(n=8, width=2, max_new_tokens=5, temperature=1.0, seed=2, max_batch_sequences=6)
    waves = plan_waves([len(p) for p in prompts], cfg)
    assert len({j.prompt for j in waves[1].jobs} & {j.prompt for j in waves[0].jobs}) == 1  # prompt 0 split
    streamed = list(stream_ids(model, prompts, cfg, EOS, 0))
    assert [i for i, _ in streamed] == [0, 1, 2] and all(len(samples) == 8 for _, samples in streamed)
    listed = generate_ids(model, prompts, cfg, EOS, 0)
    assert [[s.token_ids for s in samples] for _, samples in streamed] == [[s.token_ids for s in r] for r in listed]


def test_an_uncompilable_model_says_why_once_and_samples_eagerly():
    model = tiny_model("mistral", sliding_window=4)  # sliding-window layers: no single ready mask
    cfg = SamplingConfig(n=2, width=1, max_new_tokens=3, compile=True)
    step._TOLD.clear()
    with pytest.warns(RuntimeWarning, match="runs uncompiled: its layers need masks of their own"):
        assert step.decodes_compiled(model, cfg, "cpu") is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per process, not at every wave
        assert step.decodes_compiled(model, cfg, "cpu") is False
    assert step.uncompiled_reason(tiny_model()) is None


def test_a_torch_compiled_model_samples_as_the_model_itself():
    """torch.compile(model) given to the engine (which compiles its own step where it pays): its module is sampled,
    the same draws (it failed in inductor's lowering of the packed CPU weights)."""
    model = randomize_blocks(bridgelm.add_bridge(tiny_model("qwen2"))).eval()
    cfg = SamplingConfig(n=4, width=2, max_new_tokens=5)
    want = generate_ids(model, [[1, 5, 6], [7, 8]], cfg, [2], 0)
    got = generate_ids(torch.compile(model), [[1, 5, 6], [7, 8]], cfg, [2], 0)
    assert [[s.token_ids for s in g] for g in got] == [[s.token_ids for s in g] for g in want]

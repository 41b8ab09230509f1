"""The engine's cache read in place (bridgelm.engine.cache) and balanced waves (bridgelm.engine.waves), against the
slow references: log-probs against grouped_logits, samples independent of the batch and its bounds."""

from dataclasses import replace

import pytest
import torch
from conftest import randomize_blocks, tiny_model
from test_engine import EOS, teacher_forced_logprobs

import bridgelm
from bridgelm import attention, packed
from bridgelm.engine import SamplingConfig, generate_ids
from bridgelm.engine.cache import READ_STEP, SlabCache, bucket, grow_step, rounded
from bridgelm.engine.waves import plan_waves


def test_buckets_are_few_and_hold_at_most_one_and_a_half_times_what_they_must():
    assert [bucket(n) for n in (1, 64, 65, 96, 97, 129, 200, 300, 4096, 4200)] == [
        64, 64, 96, 96, 128, 192, 256, 384, 4096, 6144,
    ]  # fmt: skip
    sizes = {bucket(n) for n in range(1, 8193)}
    assert len(sizes) == 15  # two per doubling from 64 to 8192
    assert all(n <= bucket(n) <= max(READ_STEP, 1.5 * n) for n in range(1, 8193))


def test_an_eager_slab_grows_by_steps_of_about_twice_the_root_of_its_size():
    """`rounded(n)`, the size of an eager slab holding n positions: at least n, at most one step more, the step a
    power of two near 2 sqrt(n) (16 to 256), and the same for every n up to it (a slab is read at the size it grew
    to until it is full)."""
    assert [grow_step(n) for n in (0, 64, 65, 256, 257, 1024, 1025, 4096, 4097, 10**6)] == [
        16, 16, 32, 32, 64, 64, 128, 128, 256, 256,
    ]  # fmt: skip
    for n in range(1, 20_000):
        size = rounded(n)
        assert n <= size < n + grow_step(n) and size % grow_step(n) == 0
        assert rounded(size) == size and rounded(n + (size - n) // 2) == size


def test_the_decode_step_reads_the_dense_slab_in_place(monkeypatch):
    """bf16 on a CPU with bf16 instructions (the two-matmul attention): every decode step hands the attention each
    prompt's keys once and the rows' own positions as the cache's whole slab, dense tensors (no copy of the cache
    per step and layer), the slab grown in steps (`rounded`) as the samples pass its end; the
    log-probs still follow grouped_logits."""
    monkeypatch.setattr(packed, "half_instructions", lambda dtype: True)
    seen = []
    real = attention.shared_prompt_attention

    def spy(query, key, value, shared, mask, scale):
        dense = all(t.is_contiguous() for t in (key, value, shared.keys, shared.values))
        seen.append((dense, shared.keys.shape[:3], key.shape[:3], mask.shape[-1]))
        return real(query, key, value, shared, mask, scale)

    monkeypatch.setattr(attention, "shared_prompt_attention", spy)
    model = randomize_blocks(bridgelm.add_bridge(tiny_model(dtype=torch.bfloat16)), std=0.2)
    torch.manual_seed(8)
    prompts = [torch.randint(7, 97, (n,)).tolist() for n in (4, 9)]
    cfg = SamplingConfig(n=4, width=2, max_new_tokens=70, temperature=1.0, top_p=1.0, seed=2, share_prompts=True)
    results = generate_ids(model, prompts, cfg, [], 0)
    assert len(seen) == 69 * 2  # every decode step (the first token comes from the prefill), both layers
    assert all(dense for dense, *_ in seen)
    heads = model.config.num_key_value_heads
    assert {prompt for _, prompt, _, _ in seen} == {(2, heads, 9)}  # 2 prompts, held once, left-padded to 9
    # 8 rows; the own slab grown by 16 up to 64 positions, then to what is left: 79 - 9
    assert {own for _, _, own, _ in seen} == {(8, heads, n) for n in (16, 32, 48, 64, 70)}
    assert all(prompt[2] + own[2] == masked for _, prompt, own, masked in seen)
    want = torch.cat(teacher_forced_logprobs(model, prompts, results, 2, 1.0))
    got = torch.cat([torch.tensor(s.logprobs) for r in results for s in r])
    assert torch.isfinite(got).all() and (got - want).abs().mean() < 0.05


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_growing_slab_matches_grouped_logits(arch):
    """float32 (sdpa reads the slab under the mask): samples that pass 64 and 128 positions, ragged prompts, some
    groups finishing and dropped (rows selected from a grown slab): log-probs equal grouped_logits."""
    model = randomize_blocks(bridgelm.add_bridge(tiny_model(arch)), std=0.2)
    torch.manual_seed(0)
    prompts = [torch.randint(7, 97, (n,)).tolist() for n in (5, 2, 9)]
    cfg = SamplingConfig(n=4, width=2, max_new_tokens=130, temperature=0.9, top_p=0.9, seed=3, compact_fraction=0.2)
    results = generate_ids(model, prompts, cfg, EOS[:1], 0)
    lengths = [len(s.token_ids) for r in results for s in r]
    assert max(lengths) > 128 - 9 and min(lengths) < 64  # past two growths; some ended early
    want = teacher_forced_logprobs(model, prompts, results, 2, 0.9)
    for s, ref in zip([s for r in results for s in r], want):
        assert torch.allclose(torch.tensor(s.logprobs), ref, atol=2e-3), (torch.tensor(s.logprobs) - ref).abs().max()


def test_a_slab_grows_keeping_what_was_written():
    cache = SlabCache(num_layers=1, capacity=150, whole_reads=True)
    layer = cache.layers[0]
    k = torch.randn(2, 3, 60, 4)
    keys, _ = layer.update(k, k.clone())
    assert keys.shape[2] == 60 and layer.keys.shape[2] == 64  # the prefill reads its own positions
    sizes = set()
    for t in range(60, 150):
        step = torch.full((2, 3, 1, 4), float(t))
        keys, values = layer.update(step, step.clone())
        assert keys.shape[2] == cache.read_length(t + 1) == min(150, rounded(t + 1))
        sizes.add(keys.shape[2])
        assert keys.is_contiguous()
    assert torch.equal(layer.keys[:, :, :60], k) and torch.equal(layer.values[:, :, 60:, 0], torch.arange(60.0, 150)
                                                                  .expand(2, 3, 90))  # fmt: skip
    assert sizes == {64, 96, 128, 150}  # grown by 32 past 64 positions, then to the capacity
    with pytest.raises(AssertionError, match="capacity 150 exceeded"):
        layer.update(step, step)


def test_waves_are_balanced_and_give_the_same_samples():
    """64 rows under a bound of 56: two waves of 32, not 56 and a lone tail of 8; the samples are those of one wave
    of 64 (per-sample streams), up to the rounding of another batch shape (greedy here: the same tokens)."""
    cfg = SamplingConfig(n=8, width=4, max_new_tokens=6, temperature=0.0, max_batch_sequences=56)
    waves = plan_waves([5] * 8, cfg)
    assert [sum(j.count for j in w.jobs) for w in waves] == [32, 32]
    assert [sum(j.count for j in w.jobs) for w in plan_waves([5] * 8, replace(cfg, max_batch_sequences=40))] == [32, 32]
    # groups of 8 cannot share 24 rows more evenly between two waves: the greedy plan stays
    wide = replace(cfg, width=8, max_batch_sequences=16)
    assert [sum(j.count for j in w.jobs) for w in plan_waves([5] * 3, wide)] == [16, 8]
    model = tiny_model()
    prompts = [torch.randint(7, 97, (5,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(8)]
    one = generate_ids(model, prompts, replace(cfg, max_batch_sequences=64), [], 0)
    two = generate_ids(model, prompts, cfg, [], 0)
    assert [s.token_ids for r in two for s in r] == [s.token_ids for r in one for s in r]
    sampled = replace(cfg, temperature=1.0, seed=4)
    one = generate_ids(model, prompts, replace(sampled, max_batch_sequences=64), [], 0)
    two = generate_ids(model, prompts, sampled, [], 0)
    assert [s.token_ids for r in two for s in r] == [s.token_ids for r in one for s in r]


@pytest.mark.slow
def test_the_compiled_step_reads_buckets_and_matches_grouped_logits(monkeypatch):
    """The compiled step (inductor on the CPU) reads the live positions rounded up to a bucket (64, then 96 of a
    capacity of 96), not the whole capacity; log-probs equal grouped_logits and the samples the eager engine's."""
    reads = []
    real = SlabCache.set_read
    monkeypatch.setattr(SlabCache, "set_read", lambda self, live: reads.append(real(self, live)) or reads[-1])
    model = randomize_blocks(bridgelm.add_bridge(tiny_model("qwen2")), std=0.2)
    torch.manual_seed(0)
    prompts = [torch.randint(7, 97, (n,)).tolist() for n in (5, 3)]
    cfg = SamplingConfig(n=4, width=2, max_new_tokens=70, temperature=0.9, top_p=0.9, seed=3, compile=True)
    results = generate_ids(model, prompts, cfg, [], 0)
    assert set(reads) == {64, 96}
    want = teacher_forced_logprobs(model, prompts, results, 2, 0.9)
    for s, ref in zip([s for r in results for s in r], want):
        assert torch.allclose(torch.tensor(s.logprobs), ref, atol=2e-3), (torch.tensor(s.logprobs) - ref).abs().max()
    eager = generate_ids(model, prompts, replace(cfg, compile=False), [], 0)
    assert [s.token_ids for r in eager for s in r] == [s.token_ids for r in results for s in r]


def test_the_cache_goes_by_the_name_the_models_forward_takes():
    """transformers 5.24 renamed forward's `past_key_values` to `cache` (the old name warns, and goes in 5.40): the
    engine hands its cache by the name the model's forward takes, and samples the same either way."""
    from bridgelm.engine.step import cache_arg

    model = tiny_model()
    bridgelm.add_bridge(model)
    randomize_blocks(model)
    old_name, seen = cache_arg(model), []

    class Renamed(type(model)):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, **kwargs):
            assert "past_key_values" not in kwargs
            seen.append(cache)
            return super().forward(input_ids, attention_mask, position_ids, **{old_name: cache}, **kwargs)

    prompts, cfg = [[7, 8, 9], [10, 11]], SamplingConfig(n=4, width=2, max_new_tokens=6, seed=3)
    before = generate_ids(model, prompts, cfg, eos_token_ids=EOS, pad_token_id=0)
    model.__class__ = Renamed
    assert cache_arg(model) == "cache"
    after = generate_ids(model, prompts, cfg, eos_token_ids=EOS, pad_token_id=0)
    assert seen and all(isinstance(c, SlabCache) for c in seen)  # prefill and every decode step
    assert [[s.token_ids for s in r] for r in after] == [[s.token_ids for s in r] for r in before]


_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
# (config, model, settings) of each layout whose attention PASSES_CACHE_THROUGH names, and of two it leaves out
_SHARING = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {**_MOE, "shared_expert_intermediate_size": 32}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**_MOE, "head_dim": 16}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16, "layer_types": ["full_attention"] * 2}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"residual_multiplier": 0.5, "attention_multiplier": 0.3}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"head_dim": 16}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"no_rope_layer_interval": 2}),
    "diffllama": ("DiffLlamaConfig", "DiffLlamaForCausalLM", {}),  # splits its values after the cache
    "doge": ("DogeConfig", "DogeForCausalLM", {}),  # masks by its values after the cache
}


@pytest.mark.parametrize("arch", list(_SHARING))
def test_prompts_are_shared_only_where_the_attention_takes_the_cache_as_it_is(arch, monkeypatch):
    """bridgelm's attention (as on a GPU) with prompts shared: a listed layout samples what it samples with the
    prompts copied; DiffLlama and Doge change the cache's values before attending (wrong samples, a crash), so their
    prompts are copied."""
    import transformers

    from bridgelm.engine.step import PASSES_CACHE_THROUGH
    from bridgelm.prompt_attention import SharedPrompt

    config_name, model_name, settings = _SHARING[arch]
    config_cls, model_cls = getattr(transformers, config_name, None), getattr(transformers, model_name, None)
    if config_cls is None or model_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**common, **settings}, attn_implementation="sdpa")).eval()
    monkeypatch.setattr(attention, "wins", lambda m: True)
    calls = []  # each attention call that reads a shared prompt (through bridgelm's kernel, or expanded for sdpa)
    real, expanded = attention.shared_prompt_attention, SharedPrompt.expanded
    monkeypatch.setattr(attention, "shared_prompt_attention", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(SharedPrompt, "expanded", lambda *a: calls.append(1) or expanded(*a))
    prompts = [torch.randint(7, 97, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 9)]
    cfg = SamplingConfig(n=4, width=1, max_new_tokens=6, temperature=1.0, top_p=1.0, seed=3)
    copied = generate_ids(model, prompts, replace(cfg, share_prompts=False), EOS, 0)
    shared = generate_ids(model, prompts, replace(cfg, share_prompts=True), EOS, 0)
    assert [[s.token_ids for s in r] for r in shared] == [[s.token_ids for s in r] for r in copied]
    got, want = ([x for r in out for s in r for x in s.logprobs] for out in (shared, copied))
    assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-4)
    kind = type(model.model.layers[0].self_attn).__name__
    assert bool(calls) == (kind in PASSES_CACHE_THROUGH) == (arch not in ("diffllama", "doge"))

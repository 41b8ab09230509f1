"""Bridge and P-Match blocks on tiny random models, against slow references."""

import copy
import math

import pytest
import torch
from conftest import ARCHS, randomize_blocks, tiny_model

import bridgelm
from bridgelm.errors import UserError
from bridgelm.grouped import Groups
from bridgelm.models import enable_checkpointing

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)]


def close(a, b, tol):
    """Equal up to `tol` relative to the larger magnitude (bf16 rounds every op at ~0.4%)."""
    a, b = a.float(), b.float()
    return bool((a - b).abs().max() <= tol * max(1.0, b.abs().max().item()))


def reference_bridge(block, x, group_ids, valid):
    """Algorithm 1 of the paper, loop by loop: per position s, per row b, per head."""
    B, S, D = x.shape
    H, Dh = block.num_heads, block.head_dim
    h = block.norm(x).float()
    w_q, w_k, w_v = block.qkv_proj.weight.float().chunk(3)
    q, k, v = h @ w_q.T, h @ w_k.T, h @ w_v.T
    out = torch.zeros(B, S, H * Dh)
    for s in range(S):
        for b in range(B):
            keys = [c for c in range(B) if group_ids[c] == group_ids[b] and bool(valid[c, s])]
            if not valid[b, s]:
                continue  # unspecified: nobody reads it
            for head in range(H):
                sl = slice(head * Dh, (head + 1) * Dh)
                scores = torch.stack([q[b, s, sl] @ k[c, s, sl] / math.sqrt(Dh) for c in keys])
                weights = torch.softmax(scores, 0)
                out[b, s, sl] = sum(wt * v[c, s, sl] for wt, c in zip(weights, keys))
    return out @ block.o_proj.weight.float().T


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize(
    "group_ids",
    [[0, 0, 0, 0, 1, 1, 1, 1], [5, 5, 2, 2, 2, 7, 5, 9], [3, 3, 3, 3, 3, 3, 3, 3], [0, 1, 2, 3, 4, 5, 6, 7]],
    ids=["contiguous", "ragged", "one-group", "width1"],
)
def test_block_matches_algorithm_1(group_ids, dtype, tol):
    model = randomize_blocks(bridgelm.add_bridge(tiny_model(dtype=dtype)))
    block = model.model.layers[0].bridge
    torch.manual_seed(3)
    B, S = len(group_ids), 5
    x = torch.randn(B, S, 64).to(dtype)
    valid = torch.ones(B, S, dtype=torch.bool)
    valid[1, 3:] = False  # rows ending early
    valid[4, 1:] = False
    valid[6, 4:] = False
    got = block(x, Groups.build(group_ids, valid)).float()
    want = reference_bridge(block, x, group_ids, valid)
    assert torch.isfinite(got).all()
    assert close(got[valid], want[valid], tol), (got[valid] - want[valid]).abs().max()


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("history", [None, 1, 6], ids=["all-valid", "one-column", "six-columns"])
def test_one_position_matches_algorithm_1(history, dtype, tol):
    """A decode step's input (one position, contiguous groups) takes the 4-D path with the step's mask made once;
    it equals the loop reference on live rows, and rows that ended stay finite."""
    model = randomize_blocks(bridgelm.add_bridge(tiny_model(dtype=dtype)))
    block = model.model.layers[0].bridge
    torch.manual_seed(4)
    group_ids = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    x = torch.randn(12, 1, 64).to(dtype)
    valid = None
    if history is not None:
        valid = torch.ones(12, history, dtype=torch.bool)
        valid[[1, 2, 5, 6, 7], -1] = False  # ended rows; one group down to one live row
        valid[0, 0] = history == 1  # an earlier column says nothing about this position
    groups = Groups.contiguous_width(12, 4, valid)
    got = block(x, groups).float()
    last = torch.ones(12, 1, dtype=torch.bool) if valid is None else valid[:, -1:]
    want = reference_bridge(block, x, group_ids, last)
    assert torch.isfinite(got).all()
    assert close(got[last], want[last], tol), (got[last] - want[last]).abs().max()
    assert (groups._last_keys is not None) == (valid is not None)  # the one-position path ran and kept its mask


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("kind", ["bridge", "pmatch"])
@pytest.mark.parametrize("placement", ["ffn", "attn"])
def test_fresh_blocks_change_nothing(arch, kind, placement):
    model = tiny_model(arch)
    ids = torch.randint(3, 97, (4, 7))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    base = model(input_ids=ids, attention_mask=mask).logits
    add = bridgelm.add_bridge if kind == "bridge" else bridgelm.add_pmatch
    add(model, placement=placement)
    got = bridgelm.grouped_logits(model, ids, mask, [0, 0, 1, 1])
    assert torch.equal(got[mask.bool()], base[mask.bool()])


def layer_reference(layer, block, x, position_embeddings, placement, groups):
    """The pre-norm layer written out, with the block at its place: the usual layout, or Gemma's (norms after
    attention and around the MLP)."""
    attn_mask = torch.ones(x.shape[0], 1, x.shape[1], x.shape[1], dtype=torch.bool).tril()
    a = layer.self_attn(layer.input_layernorm(x), position_embeddings, attn_mask)[0]
    gemma = hasattr(layer, "pre_feedforward_layernorm")
    h = x + (layer.post_attention_layernorm(a) if gemma else a)
    if placement == "attn":
        h = h + block(h, groups)
    if gemma:
        h = h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))
    else:
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    if placement == "ffn":
        h = h + block(h, groups)
    return h


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("placement", ["ffn", "attn"])
@pytest.mark.parametrize("kind", ["bridge", "pmatch"])
def test_block_sits_where_placement_says(arch, placement, kind):
    model = tiny_model(arch)
    (bridgelm.add_bridge if kind == "bridge" else bridgelm.add_pmatch)(model, placement=placement)
    randomize_blocks(model)
    layer = model.model.layers[0]
    torch.manual_seed(0)
    x = torch.randn(4, 6, 64)
    pos = torch.arange(6)[None].expand(4, 6)
    pe = model.model.rotary_emb(x, pos)
    groups = Groups.build([0, 0, 1, 1], torch.ones(4, 6))
    attn_mask = torch.ones(4, 1, 6, 6, dtype=torch.bool).tril()
    got = layer(x, attention_mask=attn_mask, position_embeddings=pe, position_ids=pos, bridge_groups=groups)
    want = layer_reference(layer, getattr(layer, kind), x, pe, placement, groups)
    assert torch.allclose(got, want, atol=1e-5)


def _bridge_model(arch="qwen2", dtype=torch.float32):
    return randomize_blocks(bridgelm.add_bridge(tiny_model(arch, dtype=dtype)))


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_permutation_equivariance_within_a_group(dtype, tol):
    model = _bridge_model(dtype=dtype)
    torch.manual_seed(1)
    prompt = torch.randint(3, 97, (1, 3)).expand(4, 3)
    ids = torch.cat([prompt, torch.randint(3, 97, (4, 5))], 1)
    mask = torch.ones_like(ids)
    mask[2, 6:] = 0
    logits = bridgelm.grouped_logits(model, ids, mask, [0, 0, 0, 0]).float()
    perm = torch.tensor([2, 0, 3, 1])
    permuted = bridgelm.grouped_logits(model, ids[perm], mask[perm], [0, 0, 0, 0]).float()
    m = mask[perm].bool()
    assert close(permuted[m], logits[perm][m], tol)
    # and the group matters: alone, a row's logits differ
    alone = bridgelm.grouped_logits(model, ids, mask, [0, 1, 2, 3]).float()
    assert not close(alone[0], logits[0], tol)


def test_groups_are_isolated():
    model = _bridge_model()
    torch.manual_seed(2)
    ids = torch.randint(3, 97, (6, 8))
    ids[3:, :3] = ids[3, :3]
    ids[:3, :3] = ids[0, :3]
    mask = torch.ones_like(ids)
    gid = [0, 0, 0, 1, 1, 1]
    ref = bridgelm.grouped_logits(model, ids, mask, gid)
    other = ids.clone()
    other[3:, 4:] = torch.randint(3, 97, (3, 4))  # change group 1's responses only
    got = bridgelm.grouped_logits(model, other, mask, gid)
    assert torch.allclose(got[:3], ref[:3], atol=1e-6)
    assert not torch.allclose(got[3:], ref[3:], atol=1e-3)


def test_positions_past_the_end_influence_nobody():
    model = _bridge_model()
    torch.manual_seed(3)
    ids = torch.randint(3, 97, (4, 9))
    ids[:, :3] = ids[0, :3]
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0  # row 1 ended at position 4
    gid = [0, 0, 0, 0]
    ref = bridgelm.grouped_logits(model, ids, mask, gid)
    other = ids.clone()
    other[1, 5:] = torch.randint(3, 97, (4,))  # garbage after row 1's end
    got = bridgelm.grouped_logits(model, other, mask, gid)
    keep = mask.bool()
    assert torch.allclose(got[keep], ref[keep], atol=1e-6)
    assert torch.isfinite(got).all()
    # but while row 1 is valid, its tokens do reach its siblings
    other[1, 4] = (ids[1, 4] + 1) % 97
    got = bridgelm.grouped_logits(model, other, mask, gid)
    assert not torch.allclose(got[0, 4:], ref[0, 4:], atol=1e-4)


def test_a_siblings_token_changes_later_logits_only():
    model = _bridge_model()
    torch.manual_seed(4)
    ids = torch.randint(3, 97, (2, 10))
    ids[1, :3] = ids[0, :3]
    mask = torch.ones_like(ids)
    ref = bridgelm.grouped_logits(model, ids, mask, [0, 0])
    t = 6
    other = ids.clone()
    other[1, t] = (ids[1, t] + 5) % 97
    got = bridgelm.grouped_logits(model, other, mask, [0, 0])
    assert torch.allclose(got[0, :t], ref[0, :t], atol=1e-6)
    assert (got[0, t:] - ref[0, t:]).abs().amax(-1).min() > 1e-4  # every step >= t moves


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_width_one_equals_independent_sequences(arch):
    model = _bridge_model(arch)
    torch.manual_seed(5)
    ids = torch.randint(3, 97, (3, 7))
    mask = torch.ones_like(ids)
    mask[2, 4:] = 0
    got = bridgelm.grouped_logits(model, ids, mask, [0, 1, 2])
    for b in range(3):
        n = int(mask[b].sum())
        alone = model(input_ids=ids[b : b + 1, :n]).logits[0]
        assert torch.allclose(got[b, :n], alone, atol=1e-5)
    # without group information the model behaves the same
    plain = model(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(plain[mask.bool()], got[mask.bool()], atol=1e-6)


@pytest.mark.parametrize("kind", ["bridge", "pmatch"])
def test_save_load_round_trip(tmp_path, kind):
    add = bridgelm.add_bridge if kind == "bridge" else bridgelm.add_pmatch
    model = randomize_blocks(add(tiny_model(), placement="attn"))
    path = bridgelm.save_blocks(model, tmp_path / "blocks.safetensors")
    ids = torch.randint(3, 97, (4, 6))
    ids[:, :2] = ids[0, :2]
    mask = torch.ones_like(ids)
    want = bridgelm.grouped_logits(model, ids, mask, [0, 0, 0, 0])
    fresh = bridgelm.load_blocks(tiny_model(), path)  # same base weights (seed 0), blocks added by the loader
    cfg = bridgelm.block_config(fresh)
    assert (cfg.kind, cfg.placement, cfg.num_heads, cfg.head_dim) == (kind, "attn", 4, 16)
    assert torch.equal(bridgelm.grouped_logits(fresh, ids, mask, [0, 0, 0, 0]), want)
    # into a model that already has the same blocks
    again = bridgelm.load_blocks(add(tiny_model(), placement="attn"), path)
    assert torch.equal(bridgelm.grouped_logits(again, ids, mask, [0, 0, 0, 0]), want)
    # only the blocks were written
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
        meta = f.metadata()
    assert len(keys) == len(bridgelm.added_parameters(model))
    assert meta["kind"] == kind and meta["num_heads"] == "4" and meta["head_dim"] == "16"
    assert meta["placement"] == "attn" and "base_model" in meta


def test_save_pretrained_and_generate_keep_working(tmp_path):
    model = _bridge_model()
    out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 7)
    model.save_pretrained(tmp_path / "ckpt")
    loaded = bridgelm.load_model(str(tmp_path / "ckpt"))
    assert bridgelm.block_config(loaded) == bridgelm.block_config(model)
    ids = torch.randint(3, 97, (2, 5))
    ids[1, :2] = ids[0, :2]
    mask = torch.ones_like(ids)
    assert torch.equal(
        bridgelm.grouped_logits(loaded, ids, mask, [0, 0]), bridgelm.grouped_logits(model, ids, mask, [0, 0])
    )


@pytest.mark.parametrize("kind", ["bridge", "pmatch"])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("placement", ["ffn", "attn"])
def test_gradients_reach_every_new_parameter(kind, checkpointing, placement):
    add = bridgelm.add_bridge if kind == "bridge" else bridgelm.add_pmatch
    model = randomize_blocks(add(tiny_model(), placement=placement), std=0.1)
    model.train()
    if checkpointing:
        enable_checkpointing(model)
    torch.manual_seed(6)
    ids = torch.randint(3, 97, (4, 6))
    ids[:, :2] = ids[0, :2]
    mask = torch.ones_like(ids)
    logits = bridgelm.grouped_logits(model, ids, mask, [0, 0, 1, 1])
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 97), ids[:, 1:].reshape(-1)).backward()
    params = bridgelm.added_parameters(model)
    assert params
    for name, p in params.items():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    grads = {n: p.grad.clone() for n, p in params.items()}
    if checkpointing:  # the recomputation saw the same groups: gradients equal those without checkpointing
        (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
        model.zero_grad()
        logits = bridgelm.grouped_logits(model, ids, mask, [0, 0, 1, 1])
        torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 97), ids[:, 1:].reshape(-1)).backward()
        for n, p in params.items():
            assert torch.allclose(p.grad, grads[n], atol=1e-6), n


@pytest.mark.parametrize("placement", ["ffn", "attn"])
def test_a_deep_copy_runs_its_own_blocks(placement):
    """GRPO's reference model is a deep copy: it computes the same logits, then keeps them when the original's
    blocks change."""
    model = randomize_blocks(bridgelm.add_bridge(tiny_model(), placement=placement))
    ids = torch.randint(3, 97, (4, 6))
    mask = torch.ones_like(ids)
    want = bridgelm.grouped_logits(model, ids, mask, [0, 0, 1, 1])
    ref = copy.deepcopy(model)
    assert torch.equal(bridgelm.grouped_logits(ref, ids, mask, [0, 0, 1, 1]), want)
    randomize_blocks(model, seed=2)
    assert torch.equal(bridgelm.grouped_logits(ref, ids, mask, [0, 0, 1, 1]), want)
    assert not torch.allclose(bridgelm.grouped_logits(model, ids, mask, [0, 0, 1, 1]), want, atol=1e-3)


@pytest.mark.parametrize("placement", ["ffn", "attn"])
def test_a_layer_with_blocks_traces_as_one_graph(placement):
    """The compiled decode step needs the whole forward in one graph: no break at the blocks (dynamo's eager
    backend traces without compiling)."""
    model = randomize_blocks(bridgelm.add_bridge(tiny_model(), placement=placement))
    ids = torch.randint(3, 97, (4, 5))

    def logits(ids):
        return model(input_ids=ids, bridge_groups=Groups.contiguous_width(4, 2, torch.ones(4, 5, dtype=torch.bool)))

    want = logits(ids).logits
    torch._dynamo.reset()
    # Equal on torch 2.13; torch 2.8's traced graph rounds a few float ops differently (a model without blocks
    # differs by ~1e-7 as well), so the values are compared to a float32 rounding, the graph by fullgraph=True.
    torch.testing.assert_close(torch.compile(logits, backend="eager", fullgraph=True)(ids).logits, want, rtol=0,
                               atol=1e-6)


def test_models_built_from_one_config_keep_their_own_blocks(tmp_path):
    """Models made from one config object (`from_config(cfg)` shares it): blocks added to one of them show up in
    neither the config nor the other model, and each saves and reloads with its own kind."""
    template = tiny_model()
    config = copy.deepcopy(template.config)
    a, b = type(template)(config), type(template)(config)
    assert a.config is config and b.config is config
    bridgelm.add_bridge(a)
    bridgelm.add_pmatch(b)
    assert not hasattr(config, "bridgelm")
    assert bridgelm.block_config(a).kind == "bridge" and bridgelm.block_config(b).kind == "pmatch"
    assert a.model.config is a.config and a.model.layers[0].self_attn.config is a.config  # the modules follow it
    a.save_pretrained(tmp_path / "a")
    assert bridgelm.block_config(bridgelm.load_model(str(tmp_path / "a"))).kind == "bridge"


def test_pmatch_matches_bridge_parameter_count():
    bridge = sum(p.numel() for p in bridgelm.added_parameters(bridgelm.add_bridge(tiny_model())).values())
    pmatch = sum(p.numel() for p in bridgelm.added_parameters(bridgelm.add_pmatch(tiny_model())).values())
    assert abs(bridge - pmatch) <= 0.01 * bridge


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_follow_device_and_dtype(dtype):
    with torch.device("meta"):
        model = tiny_model(dtype=dtype)
    bridgelm.add_bridge(model)
    for p in bridgelm.added_parameters(model).values():
        assert p.device.type == "meta" and p.dtype == dtype
    model = bridgelm.add_bridge(tiny_model(dtype=dtype))
    for p in bridgelm.added_parameters(model).values():
        assert p.device.type == "cpu" and p.dtype == dtype
    norm = model.model.layers[0].bridge.norm
    assert type(norm) is type(model.model.layers[0].post_attention_layernorm)
    assert norm.variance_epsilon == model.config.rms_norm_eps


def test_frozen_model_gets_trainable_blocks_only_if_layers_train():
    model = tiny_model()
    model.requires_grad_(False)
    bridgelm.add_bridge(model)
    assert not any(p.requires_grad for p in bridgelm.added_parameters(model).values())


# ---- bad input: a clear error, and nothing changed ----


def test_unsupported_architecture_is_named():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        bridgelm.add_bridge(model)


_COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_LINEAR = dict(head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
               linear_value_head_dim=16)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
# Layouts Bridge blocks do not fit: (config, model, settings, the words of the refusal)
_OTHER_LAYOUTS = {
    "parallel residual": ("StableLmConfig", "StableLmForCausalLM", {"use_parallel_residual": True},
                          "lacks ['post_attention_layernorm'] (a parallel-residual layer"),
    "norm without eps": ("OlmoConfig", "OlmoForCausalLM", {}, "which OlmoLayerNorm does not take"),
    "hybrid, attention first": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                                {**_LINEAR, **_MOE, "layer_types": ["full_attention", "linear_attention"]},
                                "it has 'linear_attention' layers"),
    "hybrid, linear first": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                             {**_LINEAR, **_MOE, "layer_types": ["linear_attention", "full_attention"]},
                             "it has 'linear_attention' layers"),
    "AltUp": ("Gemma3nTextConfig", "Gemma3nForCausalLM",
              {"head_dim": 16, "sliding_window": 4, "num_kv_shared_layers": 0, "intermediate_size": [128, 128],
               "layer_types": ["sliding_attention", "full_attention"], "activation_sparsity_pattern": [0.0, 0.0],
               "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 97},
              "its layers carry several residual streams (AltUp)"),
}


def _other(config_name: str, model_name: str, settings: dict):
    import transformers

    config_cls, model_cls = getattr(transformers, config_name, None), getattr(transformers, model_name, None)
    if config_cls is None or model_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    torch.manual_seed(0)
    return model_cls(config_cls(**{**_COMMON, **settings})).eval()


@pytest.mark.parametrize("layout", list(_OTHER_LAYOUTS))
def test_a_layout_blocks_do_not_fit_is_refused_by_what_differs(layout):
    """Refused in one line naming the class and what differs, the model untouched (a hybrid model was accepted when
    its first layer attends, and its engine then failed; a parallel-residual layer was refused as a norm 'NoneType')."""
    config_name, model_name, settings, words = _OTHER_LAYOUTS[layout]
    model = _other(config_name, model_name, settings)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UserError, match="unsupported architecture") as err:
        bridgelm.add_bridge(model)
    assert words in str(err.value) and "\n" not in str(err.value)
    assert model.state_dict().keys() == before.keys()


@pytest.mark.parametrize(
    "config_name, model_name, settings, words",
    [
        ("Qwen3NextConfig", "Qwen3NextForCausalLM", {**_LINEAR, **_MOE, "layer_types": ["full_attention",
         "linear_attention"]}, "its 'linear_attention' layers keep a state its key/value cache lacks"),
        ("DeepseekV3Config", "DeepseekV3ForCausalLM", {"n_routed_experts": 4, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32, "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 32,
         "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "n_group": 1, "topk_group": 1},
         "multi-head latent attention (kv_lora_rank=16) fails"),
    ],
)
def test_the_engine_refuses_a_model_its_cache_cannot_serve(config_name, model_name, settings, words):
    """A base model the engine cannot sample is refused before any prompt runs (it failed with transformers'
    traceback in the first prefill or decode step)."""
    from bridgelm.engine import SamplingConfig, generate_ids

    model = _other(config_name, model_name, settings)
    with pytest.raises(UserError, match="the engine cannot sample") as err:
        generate_ids(model, [[1, 5, 6]], SamplingConfig(n=2, width=1, max_new_tokens=3), [2], 0)
    assert words in str(err.value)


def test_a_config_with_per_layer_head_dims_takes_blocks_of_its_top_level_head_dim(tmp_path):
    """Gemma 4's config refuses to read head_dim as one value (its full-attention layers have others): the blocks
    take the value it states at the top, and load_model, params and plan read its folder (they raised
    transformers' error)."""
    from bridgelm.cli import main
    from bridgelm.shape import shape_of

    model = _other("Gemma4TextConfig", "Gemma4ForCausalLM", {"head_dim": 16, "sliding_window": 4})
    base = model(torch.tensor([[1, 5, 6, 7]])).logits
    bridgelm.add_bridge(model)
    assert bridgelm.block_config(model).head_dim == 16
    assert torch.equal(model(torch.tensor([[1, 5, 6, 7]])).logits, base)  # fresh blocks change nothing
    model.save_pretrained(tmp_path / "m")
    again = bridgelm.load_model(str(tmp_path / "m"))
    assert bridgelm.block_config(again).head_dim == 16 and shape_of(again).head_dim == 16
    main(["params", "--model", str(tmp_path / "m")])
    main(["plan", "--model", str(tmp_path / "m"), "--gpu-memory-gib", "80"])


# Layers beyond the usual ones, for placement "attn": (config, model, settings, refused)
_ATTN_HOSTS = {
    "phi3 (dropout)": ("Phi3Config", "Phi3ForCausalLM", {}, False),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {}, False),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}, False),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"residual_multiplier": 0.5}, True),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"head_dim": 16}, True),
    "minimax": ("MiniMaxConfig", "MiniMaxForCausalLM",
                {"head_dim": 16, "layer_types": ["full_attention"] * 2, "num_local_experts": 2}, True),
}


@pytest.mark.parametrize("host", list(_ATTN_HOSTS))
def test_placement_attn_joins_the_residual_stream_as_it_is_or_is_refused(host):
    """With placement "attn" the stream after the attention residual is s + block(s), s the stream without the block
    (App. D), where the feed-forward's norm reads it; a layer that scales, weighs or normalises its attention's output
    before adding it (Granite, MiniMax, GLM-4) is refused: the hook there computed another architecture."""
    config_name, model_name, settings, refused = _ATTN_HOSTS[host]
    model = _other(config_name, model_name, settings)
    if refused:
        with pytest.raises(UserError, match="placement 'attn' on .*use placement 'ffn'"):
            bridgelm.add_bridge(model, placement="attn")
        return
    randomize_blocks(bridgelm.add_bridge(model, placement="attn"))
    layer, seen = model.model.layers[0], {}
    norm = getattr(layer, "pre_feedforward_layernorm", layer.post_attention_layernorm)
    norm.register_forward_pre_hook(lambda mod, args: seen.update(stream=args[0]))
    layer.bridge.register_forward_hook(lambda mod, args, out: seen.update(into=args[0], update=out))
    bridgelm.grouped_logits(model, torch.randint(5, 97, (2, 6)), None, [0, 0])
    torch.testing.assert_close(seen["stream"], seen["into"] + seen["update"])


def test_adding_twice_is_refused():
    model = bridgelm.add_bridge(tiny_model())
    n = len(bridgelm.added_parameters(model))
    with pytest.raises(ValueError, match="already has bridge blocks"):
        bridgelm.add_pmatch(model)
    assert len(bridgelm.added_parameters(model)) == n and bridgelm.block_config(model).kind == "bridge"


def test_wrong_group_ids_length():
    model = bridgelm.add_bridge(tiny_model())
    ids = torch.randint(3, 97, (4, 5))
    with pytest.raises(ValueError, match="group_ids has 3 entries"):
        bridgelm.grouped_logits(model, ids, torch.ones_like(ids), [0, 0, 1])


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="placement='middle'"):
        bridgelm.add_bridge(tiny_model(), placement="middle")
    with pytest.raises(ValueError, match="num_heads=0"):
        bridgelm.add_bridge(tiny_model(), num_heads=0)


def test_block_file_that_does_not_fit_leaves_model_untouched(tmp_path):
    path = bridgelm.save_blocks(randomize_blocks(bridgelm.add_bridge(tiny_model())), tmp_path / "b.safetensors")
    other = tiny_model(hidden_size=32, intermediate_size=64)  # another width
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError, match="does not fit this model"):
        bridgelm.load_blocks(other, path)
    assert bridgelm.block_config(other) is None
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
    # a model with P-Match blocks refuses a Bridge file
    pm = bridgelm.add_pmatch(tiny_model())
    before = {k: v.clone() for k, v in pm.state_dict().items()}
    with pytest.raises(ValueError, match="holds blocks"):
        bridgelm.load_blocks(pm, path)
    assert all(torch.equal(before[k], v) for k, v in pm.state_dict().items())
    # another head count
    with pytest.raises(ValueError, match="does not fit"):
        bridgelm.load_blocks(tiny_model(num_hidden_layers=3), path)
    # not a block file at all
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="junk.safetensors"):
        bridgelm.load_blocks(tiny_model(), junk)


def test_grouped_logits_refuses_a_group_whose_rows_are_left_padded_apart():
    """Left padding shifts a row against its siblings (position s is another token of each): refused in one line,
    where right padding, or a group padded alike, is what the blocks read."""
    model = tiny_model()
    randomize_blocks(bridgelm.add_bridge(model))
    ids = torch.tensor([[3, 4, 5, 6, 7], [0, 3, 4, 5, 8]])
    left = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match="rows 0 and 1 of group 0 start after 0 and 1 padding tokens"):
        bridgelm.grouped_logits(model, ids, left, [0, 0])
    bridgelm.grouped_logits(model, ids, left, [0, 1])  # apart, each row is its own group: nothing to shift
    right = torch.tensor([[3, 4, 5, 6, 7], [3, 4, 5, 8, 0]])
    bridgelm.grouped_logits(model, right, torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]), [0, 0])


@pytest.mark.parametrize("not_a_model", ["gpt2", torch.nn.Linear(3, 3)])
def test_add_bridge_refuses_what_is_not_a_causal_lm_in_one_line(not_a_model):
    with pytest.raises(ValueError, match=r"add_bridge\((str|Linear)\): expected a Hugging Face causal LM"):
        bridgelm.add_bridge(not_a_model)


def test_a_composite_model_takes_blocks_in_its_language_part(tmp_path):
    """Gemma 3 with its vision tower (AutoModelForCausalLM builds Gemma3ForConditionalGeneration): the block sizes
    come from its text config (the composite config has no hidden_size of its own); saved, it loads with them."""
    from conftest import tiny_composite

    model = tiny_composite()
    assert not hasattr(model.config, "hidden_size")
    ids = torch.randint(3, 97, (4, 6))
    base = model(input_ids=ids).logits
    bridgelm.add_bridge(model)
    assert bridgelm.grouped_logits(model, ids, torch.ones_like(ids), [0, 0, 1, 1]).equal(base)
    randomize_blocks(model)
    model.save_pretrained(tmp_path / "g3")
    again = bridgelm.load_model(str(tmp_path / "g3"))
    assert bridgelm.block_config(again) == bridgelm.block_config(model)
    got = bridgelm.grouped_logits(again, ids, torch.ones_like(ids), [0, 0, 1, 1])
    assert torch.allclose(got, bridgelm.grouped_logits(model, ids, torch.ones_like(ids), [0, 0, 1, 1]), atol=1e-6)


@pytest.mark.parametrize("kind", ["llava", "mistral3"])
def test_a_composite_model_only_image_text_to_text_builds_saves_and_loads(tmp_path, kind):
    """LLaVA and Mistral 3 are not AutoModelForCausalLM's: a folder of one (with blocks, or without) loads through
    AutoModelForImageTextToText, under the names save_pretrained writes (LLaVA's lm_head as
    language_model.lm_head), and samples (load_model refused them with transformers' error, and a saved LLaVA with
    blocks lacked its lm_head)."""
    import transformers

    from bridgelm.engine import SamplingConfig, generate_ids

    text = {k: _COMMON[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings")}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    if kind == "llava":
        config = transformers.LlavaConfig(text_config=transformers.LlamaConfig(**text), image_token_id=96,
                                          vision_config=transformers.CLIPVisionConfig(**vision))
    else:
        config = transformers.Mistral3Config(text_config=transformers.MistralConfig(**text, sliding_window=None),
                                             vision_config=transformers.PixtralVisionConfig(**vision, head_dim=16),
                                             image_token_id=96)
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(config).eval()
    model.save_pretrained(tmp_path / "base")
    assert bridgelm.load_model(str(tmp_path / "base")).state_dict().keys() == model.state_dict().keys()
    randomize_blocks(bridgelm.add_bridge(model))
    model.save_pretrained(tmp_path / "b")
    again = bridgelm.load_model(str(tmp_path / "b"))
    assert bridgelm.block_config(again) == bridgelm.block_config(model)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in model.state_dict().items())
    cfg = SamplingConfig(n=4, width=2, max_new_tokens=4, temperature=0.0)
    assert generate_ids(again, [[1, 5, 6]], cfg, [2], 0) == generate_ids(model, [[1, 5, 6]], cfg, [2], 0)


def test_grouped_logits_takes_no_mask():
    """attention_mask None: no padding (as transformers takes it), not an AttributeError; wrong group ids stay a
    ValueError naming them (the API misused: tests/test_bad_input.py tells it from the command line's bad input)."""
    model = _bridge_model()
    ids = torch.randint(3, 97, (2, 5))
    assert torch.equal(bridgelm.grouped_logits(model, ids, None, [0, 0]),
                       bridgelm.grouped_logits(model, ids, torch.ones_like(ids), [0, 0]))
    with pytest.raises(ValueError, match="group_ids has 3 entries"):
        bridgelm.grouped_logits(model, ids, None, [0, 0, 1])

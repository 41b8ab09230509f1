"""LoRA on the base beside trainable Bridge blocks (bridgelm.lora, through peft): which modules get LoRA, what trains,
the reference, one saved folder that loads back, resume, and the three trainers (rl, sft, BridgeGRPOTrainer); on
tiny random models, offline, on the CPU."""

import json
from dataclasses import replace

import pytest

pytest.importorskip("peft", reason="peft is not installed (pip install 'bridgelm[lora]')")

import torch  # noqa: E402
from conftest import randomize_blocks, tiny_model  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import bridgelm  # noqa: E402
from bridgelm import lora  # noqa: E402
from bridgelm.dist import Dist  # noqa: E402
from bridgelm.rng import derive_seed  # noqa: E402
from bridgelm.train.reference import make_reference, skeleton  # noqa: E402
from bridgelm.train.rl import train_rl  # noqa: E402
from test_rl import CFG, TASK, TOK, interrupt_and_resume  # noqa: E402

LORA = lora.LoraSettings(r=4)
IDS = torch.tensor([[3, 5, 7, 9, 11, 4], [6, 6, 2, 8, 10, 12]])


def policy(seed=0):
    model = tiny_model(seed=seed, vocab_size=len(TOK), eos_token_id=TOK.eos_token_id, pad_token_id=TOK.pad_token_id)
    return randomize_blocks(bridgelm.add_bridge(model), std=0.1)


def grouped(model, ids=IDS):
    return bridgelm.grouped_logits(model, ids, torch.ones_like(ids), group_ids=[0, 0])


def split(model):
    """The model's weights in three parts: base (frozen), blocks, LoRA; each name -> a copy."""
    blocks, adapters = set(bridgelm.added_parameters(model)), set(lora.lora_parameters(model))
    parts = {"base": {}, "blocks": {}, "lora": {}}
    for name, p in model.named_parameters():
        part = "blocks" if name in blocks else "lora" if name in adapters else "base"
        parts[part][name] = p.detach().clone()
    return parts


def test_lora_wraps_the_base_projections_only_and_the_blocks_train_beside_it():
    model = lora.add_lora(policy(), LORA, seed=0)
    wrapped = set(lora.lora_layers(model))
    want = {f"model.layers.{i}.{m}" for i in range(2) for m in
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj")}
    assert wrapped == want  # the blocks' own o_proj is not the attention's
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained == set(bridgelm.added_parameters(model)) | set(lora.lora_parameters(model))
    # a fresh LoRA changes nothing; the same seed draws the same LoRA weights
    torch.testing.assert_close(grouped(model), grouped(policy()), rtol=0, atol=0)
    again = lora.add_lora(policy(), LORA, seed=0)
    for (n, a), (_, b) in zip(lora.lora_parameters(model).items(), lora.lora_parameters(again).items()):
        assert torch.equal(a, b), n
    only_q = lora.add_lora(policy(), lora.LoraSettings(r=2, alpha=8, targets="q_proj"), seed=0)
    assert set(lora.lora_layers(only_q)) == {"model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"}
    layer = lora.lora_layers(only_q)["model.layers.0.self_attn.q_proj"]
    assert layer.scaling["default"] == 4.0 and layer.r["default"] == 2


def test_a_block_file_of_a_model_with_lora_loads_onto_its_base(tmp_path):
    """The base digest a block file records leaves LoRA out (trained LoRA weights, peft's base_layer names): the
    blocks saved mid-run load back onto the run's base with its LoRA, and onto the bare base; not onto another."""
    from bridgelm.blockfile import base_digest

    model = lora.add_lora(policy(), LORA, seed=0)
    with torch.no_grad():
        for p in lora.lora_parameters(model).values():
            p.add_(0.5)  # trained
    assert base_digest(model) == base_digest(policy()) != base_digest(policy(seed=1))
    path = bridgelm.save_blocks(model, tmp_path / "b.safetensors")
    bridgelm.load_blocks(lora.add_lora(policy(), LORA, seed=1), path)
    bridgelm.load_blocks(policy(), path)
    with pytest.raises(ValueError, match="digest"):  # UserError is a ValueError
        bridgelm.load_blocks(policy(seed=1), path)


def test_peft_lora_on_every_linear_reaches_a_row_alone_in_its_group(tmp_path):
    """peft's all-linear LoRA wraps the blocks' projections too: a row alone in its group (width 1, transformers'
    generate) is W_O W_V h with the LoRA's update (the shortcut read W_V's plain weight, dropping it), so two equal
    rows give what one group of them gives; a block file of such blocks is refused (peft's names, no model loads
    it) until the LoRA is merged."""
    from peft import LoraConfig, get_peft_model

    model = randomize_blocks(bridgelm.add_bridge(tiny_model()))
    wrapped = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    ids = torch.randint(5, 97, (1, 6)).repeat(2, 1)
    alone = bridgelm.grouped_logits(wrapped, ids, None, [0, 1])
    torch.testing.assert_close(alone, bridgelm.grouped_logits(wrapped, ids, None, [0, 0]))
    with pytest.raises(ValueError, match="wrapped by peft's LoRA .*merge it into them first"):
        bridgelm.save_blocks(wrapped, tmp_path / "b.safetensors")
    assert not (tmp_path / "b.safetensors").exists()
    merged = wrapped.merge_and_unload()
    torch.testing.assert_close(bridgelm.grouped_logits(merged, ids, None, [0, 1]), alone)
    bridgelm.save_blocks(merged, tmp_path / "b.safetensors")


def test_saved_folder_is_one_unit_merged_with_its_blocks_and_the_adapter(tmp_path):
    model = lora.add_lora(policy(), LORA, seed=0)
    with torch.no_grad():
        for p in lora.lora_parameters(model).values():
            p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    want = grouped(model)
    assert not torch.allclose(want, grouped(policy()), atol=1e-4)  # the LoRA does change the model
    lora.save_folder(model, tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == "bridgelm"
    for loaded in (bridgelm.load_model(str(tmp_path / "m")), AutoModelForCausalLM.from_pretrained(tmp_path / "m")):
        assert not lora.has_lora(loaded) and bridgelm.block_config(loaded) is not None
        torch.testing.assert_close(grouped(loaded), want, rtol=1e-4, atol=1e-5)
    # lora/ is a peft adapter folder: PeftModel puts it onto the unmerged base with the same blocks
    from peft import PeftModel

    base = policy()
    unmerged = PeftModel.from_pretrained(base, str(tmp_path / "m" / "lora"))
    torch.testing.assert_close(grouped(unmerged), want, rtol=1e-5, atol=1e-6)
    # and load_trained puts back exactly what trained: the LoRA weights and the blocks
    fresh = lora.add_lora(bridgelm.add_bridge(tiny_model(vocab_size=len(TOK), eos_token_id=TOK.eos_token_id,
                                                         pad_token_id=TOK.pad_token_id)), LORA, seed=1)
    lora.load_trained(fresh, tmp_path / "m")
    assert torch.equal(grouped(fresh), want)


def test_the_reference_is_the_base_without_lora_and_the_starting_blocks():
    start = policy()
    model = lora.add_lora(policy(), LORA, seed=0)
    with torch.no_grad():  # as if trained: LoRA B no longer 0, blocks moved
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1)
    ref = make_reference(skeleton(lora.add_lora(policy(), LORA, seed=0)), lora.add_lora(policy(), LORA, seed=0),
                         Dist.from_env(), bf16=False)
    torch.testing.assert_close(grouped(ref), grouped(start), rtol=0, atol=0)
    ref_of_trained = make_reference(skeleton(model), model, Dist.from_env(), bf16=False)
    without = policy()  # the base without LoRA, with the (moved) blocks of `model`
    with torch.no_grad():
        for name, p in bridgelm.added_parameters(without).items():
            p.copy_(dict(model.named_parameters())[name])
    torch.testing.assert_close(grouped(ref_of_trained), grouped(without), rtol=0, atol=0)
    assert not torch.allclose(grouped(model), grouped(without), atol=1e-3)  # the policy itself has its LoRA


def test_rl_step_trains_the_blocks_and_lora_not_the_base_and_saves_one_folder(tmp_path):
    model = policy()
    start = split(lora.add_lora(policy(), LORA, seed=derive_seed(CFG.seed, "rl-lora")))  # what train_rl injects
    cfg = replace(CFG, steps=1, beta=0.05, lora=LORA)
    res = train_rl(model, TOK, TASK, cfg, tmp_path)
    assert lora.has_lora(model)
    now = split(model)
    assert start["base"].keys() == now["base"].keys() and start["lora"].keys() == now["lora"].keys()
    assert all(torch.equal(t, now["base"][n]) for n, t in start["base"].items())  # the base never moved
    assert all(not torch.equal(t, now["blocks"][n]) for n, t in start["blocks"].items())
    assert all(not torch.equal(t, now["lora"][n]) for n, t in start["lora"].items())  # A and B (K=2 steps)
    folder = res.final_dir
    assert (folder / "lora" / "adapter_model.safetensors").is_file()
    back = bridgelm.load_model(str(folder))
    torch.testing.assert_close(grouped(back), grouped(model), rtol=1e-4, atol=1e-5)
    assert json.loads((tmp_path / "run.json").read_text())["identity"]["lora.r"] == 4


def test_rl_resume_with_lora_ends_with_the_same_weights(tmp_path, monkeypatch):
    cfg = replace(CFG, steps=3, lora=LORA)
    straight = policy()
    train_rl(straight, TOK, TASK, cfg, tmp_path / "a")
    resumed, _ = interrupt_and_resume(monkeypatch, cfg, tmp_path / "b", policy)
    a, b = dict(straight.named_parameters()), dict(resumed.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_bridge_grpo_trainer_with_peft_config_trains_blocks_and_lora_and_saves_one_folder(tmp_path):
    """BridgeGRPOTrainer(peft_config=LoraConfig) as GRPOTrainer takes it: LoRA on the base only (the config's
    o_proj does not reach the blocks'), blocks and LoRA train, the base does not, the reference is the starting
    policy, and save_model writes one folder that loads back with the LoRA merged and the blocks."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from peft import LoraConfig
    from test_trl import PROMPTS, config as trl_config, length_reward, tiny_policy

    from bridgelm.integrations.trl import BridgeGRPOTrainer

    def trainer(out, **overrides):
        model, tok = tiny_policy()
        return BridgeGRPOTrainer(model=model, reward_funcs=length_reward, args=trl_config(out, **overrides),
                                 train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS * 2]),
                                 processing_class=tok, peft_config=config)

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj", "down_proj"])
    t = trainer(tmp_path, beta=0.1, learning_rate=1e-2)
    policy = t.accelerator.unwrap_model(t.model)
    base = policy.get_base_model()
    assert config.exclude_modules is None  # the user's config is left as it was
    assert {n.split(".", 3)[-1] for n in lora.lora_layers(base)} == {"self_attn.q_proj", "self_attn.o_proj",
                                                                     "mlp.down_proj"}
    start = split(base)
    t.train()
    now = split(base)
    assert all(torch.equal(v, now["base"][n]) for n, v in start["base"].items())
    assert all(not torch.equal(v, now["blocks"][n]) for n, v in start["blocks"].items())
    assert any(not torch.equal(v, now["lora"][n]) for n, v in start["lora"].items() if ".lora_B." in n)
    reference = t.accelerator.unwrap_model(t.ref_model)  # the starting policy, untouched: the base without LoRA
    assert not lora.has_lora(reference)
    ref = split(reference)
    assert not ref["lora"]
    for part in ("base", "blocks"):
        want = {n.replace(".base_layer.", "."): v for n, v in start[part].items()}  # peft's wrapped names
        assert ref[part].keys() == want.keys() and all(torch.equal(v, ref[part][n]) for n, v in want.items())
    t.save_model(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "lora" / "adapter_config.json").is_file()
    assert not (tmp_path / "saved" / "adapter_config.json").exists()  # transformers would load the bare base
    back = bridgelm.load_model(str(tmp_path / "saved"))
    assert bridgelm.block_config(back) is not None and not lora.has_lora(back)
    torch.testing.assert_close(grouped(back), grouped(base), rtol=1e-4, atol=1e-5)
    again = trainer(tmp_path / "again")
    again._load_from_checkpoint(str(tmp_path / "saved"))
    assert torch.equal(grouped(again.accelerator.unwrap_model(again.model).get_base_model()), grouped(base))


def test_fsdp_with_lora_is_refused_naming_what_works():
    from bridgelm.train.rl_config import RLConfig

    with pytest.raises(ValueError, match=r"lora_r=4 with fsdp=True: it is not supported with LoRA: run LoRA in one "
                                         r"process or data-parallel under torchrun \(no fsdp\)"):
        RLConfig(lora=LORA, fsdp=True).validate(2)


def test_sft_with_lora_writes_one_model_folder_and_trains_blocks_and_lora_only(tmp_path):
    from test_sft import CFG as SFT, base_model, write_warmup

    from bridgelm.train.sft import ensure_blocks, train_sft

    write_warmup(tmp_path / "w.jsonl")
    cfg = replace(SFT, epochs=1, lora=LORA)
    model = ensure_blocks(base_model(), cfg)
    start = split(ensure_blocks(base_model(), cfg))
    res = train_sft(model, TOK, tmp_path / "w.jsonl", cfg, tmp_path / "out")
    now = split(model)
    base = {n.replace(".base_layer.", "."): v for n, v in now["base"].items()}  # LoRA wraps the projections
    assert base.keys() == start["base"].keys() and all(torch.equal(v, base[n]) for n, v in start["base"].items())
    assert all(not torch.equal(v, now["blocks"][n]) for n, v in start["blocks"].items())
    assert any(".lora_B." in n and v.any() for n, v in now["lora"].items())
    assert res.blocks_path == tmp_path / "out" / "model" and not (tmp_path / "out" / "blocks.safetensors").exists()
    back = bridgelm.load_model(str(res.blocks_path))
    torch.testing.assert_close(grouped(back), grouped(model), rtol=1e-4, atol=1e-5)

"""A model saved with blocks is a "bridgelm" model type: it loads with its blocks through transformers' Auto classes
once bridgelm is imported, and without bridgelm transformers refuses it instead of returning the base model."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import bridgelm
from bridgelm.errors import UserError
from bridgelm.grouped import Groups
from conftest import randomize_blocks, save_tiny_model_dir, tiny_model


def _logits(model, ids):
    groups = Groups.contiguous_width(ids.shape[0], 2, torch.ones(ids.shape, dtype=torch.bool))
    return model(input_ids=ids, bridge_groups=groups).logits


@pytest.mark.parametrize("arch, kind, placement", [("qwen2", "bridge", "ffn"), ("llama", "pmatch", "attn"),
                                                   ("gemma2", "bridge", "attn")])
def test_auto_classes_load_the_blocks(tmp_path, arch, kind, placement):
    model = tiny_model(arch)
    randomize_blocks(bridgelm.add_bridge(model, placement=placement) if kind == "bridge"
                     else bridgelm.add_pmatch(model, placement=placement))
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "bridgelm" and saved["base_model_type"] == arch
    assert AutoConfig.from_pretrained(tmp_path).model_type == arch  # the base's config class, every field kept

    auto = AutoModelForCausalLM.from_pretrained(tmp_path)
    loaded = bridgelm.load_model(str(tmp_path))
    assert bridgelm.block_config(auto) == bridgelm.block_config(model) == bridgelm.block_config(loaded)
    ids = torch.randint(3, 97, (4, 6))
    want = _logits(model.eval(), ids)
    assert torch.equal(_logits(auto.eval(), ids), want) and torch.equal(_logits(loaded, ids), want)
    assert not torch.allclose(_logits(tiny_model(arch), ids), want, atol=1e-3)  # the blocks matter

    auto.save_pretrained(tmp_path / "again")  # and it stays one: a second round trip keeps the blocks
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    assert torch.equal(_logits(again.eval(), ids), want)
    fresh = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))  # from_config builds them too
    assert bridgelm.block_config(fresh) == bridgelm.block_config(model)


def test_without_bridgelm_transformers_refuses_the_folder(tmp_path):
    """No silent base model: a process that never imports bridgelm gets transformers' unknown-model-type error."""
    save_tiny_model_dir(tmp_path, blocks="bridge")
    code = "import sys; import transformers as t; t.AutoModelForCausalLM.from_pretrained(sys.argv[1])"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode != 0 and "model type `bridgelm`" in proc.stderr, proc.stderr[-2000:]
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    with_import = "import bridgelm; " + code + ".get_decoder().layers[0].bridge"  # importing bridgelm is enough
    proc = subprocess.run([sys.executable, "-c", with_import, str(tmp_path)], capture_output=True, text=True,
                          env={**env, "PYTHONPATH": src}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_lm_evals_hf_backend_loads_the_blocks(tmp_path):
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed")
    from lm_eval.models.huggingface import HFLM

    model, _ = save_tiny_model_dir(tmp_path, blocks="bridge")
    lm = HFLM(pretrained=str(tmp_path), device="cpu", batch_size=1)
    assert bridgelm.block_config(lm.model) == bridgelm.block_config(model)
    ids = torch.randint(3, 20, (2, 5))
    assert torch.equal(lm.model(input_ids=ids).logits, model.eval()(input_ids=ids).logits)


def test_a_loader_that_picks_the_class_from_architectures_loads_the_blocks(tmp_path):
    """config.json names no transformers class (it named the base's, so TRL's loader built the bare base from a
    path): TRL falls back to AutoModelForCausalLM, which builds the blocks; a reload saves the same name."""
    import transformers

    model, _ = save_tiny_model_dir(tmp_path / "a", blocks="bridge")
    saved = json.loads((tmp_path / "a" / "config.json").read_text())
    assert saved["architectures"] == ["BridgeQwen2ForCausalLM"] and not hasattr(transformers, saved["architectures"][0])
    assert "auto_map" not in saved  # no code of its own
    trl_utils = pytest.importorskip("trl.trainer.utils", reason="trl is not installed")
    loaded = trl_utils.create_model_from_path(str(tmp_path / "a"))
    assert bridgelm.block_config(loaded) == bridgelm.block_config(model)
    loaded.save_pretrained(tmp_path / "b")
    assert json.loads((tmp_path / "b" / "config.json").read_text())["architectures"] == saved["architectures"]


def test_a_folder_of_an_older_layout_is_refused_in_one_line(tmp_path):
    save_tiny_model_dir(tmp_path, blocks="bridge")
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = config.pop("base_model_type")  # blocks recorded in a plain qwen2 config (older bridgelm)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="older bridgelm.*expected model type 'bridgelm'") as err:
        bridgelm.load_model(str(tmp_path))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("change, words", [
    ({"base_model_type": "no_such_type"}, "base_model_type 'no_such_type'"),
    ({"base_model_type": None}, "base_model_type None"),
    ({"bridgelm": None}, "records blocks None"),
    ({"bridgelm": {"format": "bridgelm-blocks-1", "kind": "nope", "num_heads": 4, "head_dim": 16,
                   "placement": "ffn"}}, "cannot build"),
])
def test_a_damaged_bridgelm_config_is_one_line(tmp_path, change, words):
    save_tiny_model_dir(tmp_path, blocks="bridge")
    config = {**json.loads((tmp_path / "config.json").read_text()), **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=words) as err:
        bridgelm.load_model(str(tmp_path))
    assert "\n" not in str(err.value)


def test_missing_block_tensors_are_refused(tmp_path):
    """Weights without the blocks the config records: refused, not filled with random blocks."""
    save_tiny_model_dir(tmp_path / "plain")
    save_tiny_model_dir(tmp_path / "blocks", blocks="bridge")
    (tmp_path / "plain" / "config.json").write_text((tmp_path / "blocks" / "config.json").read_text())
    with pytest.raises(UserError, match=r"lack \d+ tensor.*bridge"):
        bridgelm.load_model(str(tmp_path / "plain"))


def test_a_config_with_blocks_pickles_and_copies():
    import copy
    import pickle

    config = bridgelm.add_bridge(tiny_model()).config
    for other in (pickle.loads(pickle.dumps(config)), copy.deepcopy(config)):
        assert type(other) is type(config) and other.to_dict() == config.to_dict() and other.bridgelm == config.bridgelm


def test_blocks_left_out_of_the_weights_start_fresh_through_the_auto_class(tmp_path):
    """transformers fills a missing tensor by the model's init; a block's output projection starts at zero, so a
    block the weights lack changes nothing (bridgelm.load_model refuses such weights, above)."""
    from safetensors.torch import load_file, save_file

    model = bridgelm.add_bridge(tiny_model("qwen2")).eval()
    model.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    save_file({k: v for k, v in load_file(weights).items() if ".bridge." not in k}, weights, metadata={"format": "pt"})
    auto = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    block = auto.model.layers[0].bridge
    assert block.qkv_proj.weight.std() > 0 and not block.o_proj.weight.any()
    ids = torch.randint(3, 97, (4, 6))
    assert torch.equal(_logits(auto, ids), _logits(model, ids))


@pytest.mark.parametrize("kind", ["bridge", "pmatch"])
def test_init_weights_leaves_the_blocks(kind):
    """transformers' init_weights() re-draws what it has not drawn itself: not the blocks (a fresh one stays zero)."""
    for trained in (False, True):
        model = tiny_model("llama")
        (bridgelm.add_bridge if kind == "bridge" else bridgelm.add_pmatch)(model)
        if trained:
            randomize_blocks(model)
        before = {k: v.clone() for k, v in model.state_dict().items() if f".{kind}." in k}
        model.init_weights()
        after = model.state_dict()
        assert all(torch.equal(after[k], v) for k, v in before.items())


def test_transformers_generate_on_a_bridge_model_says_its_rows_are_drawn_alone(monkeypatch):
    """transformers' generate gives a Bridge model no groups: its samples are width 1's. It says so once; the engine,
    which passes the layout at every width (None at width 1, prompts of one token too), never does."""
    import warnings

    from bridgelm.grouped import RowsAloneWarning
    from bridgelm.engine import SamplingConfig, generate_ids

    model = randomize_blocks(bridgelm.add_bridge(tiny_model("qwen2"))).eval()
    monkeypatch.setattr(bridgelm.grouped, "_ROWS_ALONE_SAID", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RowsAloneWarning)
        for width in (1, 2):
            generate_ids(model, [[1, 5, 6], [7]], SamplingConfig(n=4, width=width, max_new_tokens=4), [2], 0)
    with pytest.warns(RowsAloneWarning, match=r"drawn alone.*bridgelm.generate") as said:
        model.generate(torch.tensor([[1, 5, 6]]), do_sample=True, num_return_sequences=4, max_new_tokens=3)
        model.generate(torch.tensor([[1, 5, 6]]), do_sample=True, num_return_sequences=4, max_new_tokens=3)
    assert len([w for w in said if w.category is RowsAloneWarning]) == 1


def test_a_peft_adapter_on_a_saved_bridge_model_loads_back_with_its_blocks(tmp_path, monkeypatch):
    """peft reads the folder's config through the model's config class when it saves an adapter (transformers then
    warned of a model of another type), and AutoPeftModelForCausalLM loads base and blocks through the Auto class."""
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install 'bridgelm[lora]')")
    import transformers.configuration_utils as config_utils

    model = randomize_blocks(bridgelm.add_bridge(tiny_model("qwen2"))).eval()
    model.save_pretrained(tmp_path / "base")
    said = []
    monkeypatch.setattr(config_utils.logger, "warning", lambda msg, *a, **k: said.append(str(msg)))
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    adapted = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), lora)
    adapted.save_pretrained(tmp_path / "adapter")
    assert not [m for m in said if "to instantiate a model of type" in m], said
    again = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter").eval()
    assert bridgelm.block_config(again.base_model.model) == bridgelm.block_config(model)
    ids = torch.randint(3, 97, (4, 6))
    assert torch.equal(_logits(again, ids), _logits(model, ids))  # a fresh LoRA changes nothing

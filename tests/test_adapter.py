"""Blocks as an adapter folder (blocks.safetensors + bridge_config.json), pushed to and loaded from the hub (offline:
huggingface_hub's calls are replaced by copies to and from a local folder)."""

import json
import shutil
import warnings
from pathlib import Path

import huggingface_hub
import pytest
import torch
from conftest import randomize_blocks, save_tiny_model_dir, tiny_model

import bridgelm
from bridgelm.adapter import BLOCKS_FILE, CONFIG_FILE, base_digest
from bridgelm.errors import UserError

IDS = torch.tensor([[3, 5, 7, 11, 13, 17]])


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _trained(name="org/tiny-base", add=bridgelm.add_bridge, **kw):
    model = randomize_blocks(add(tiny_model(), **kw))
    model.config._name_or_path = name
    return model


def _base(name="org/tiny-base", seed=0, **overrides):
    model = tiny_model(seed=seed, **overrides)
    model.config._name_or_path = name
    return model


@pytest.mark.parametrize("kind", ["bridge", "pmatch"])
def test_folder_round_trip_records_base_and_settings(tmp_path, kind):
    add = bridgelm.add_bridge if kind == "bridge" else bridgelm.add_pmatch
    model = _trained(add=add)
    out = bridgelm.save_blocks(model, tmp_path / "adapter")
    assert out == tmp_path / "adapter" and sorted(p.name for p in out.iterdir()) == [BLOCKS_FILE, CONFIG_FILE]
    record = json.loads((out / CONFIG_FILE).read_text())
    assert record["base_model"] == "org/tiny-base" and record["base_model_digest"] == base_digest(tiny_model())
    assert record["base_model_digest"].startswith("sha256:") and record["kind"] == kind
    cfg = bridgelm.block_config(model)
    settings = (record["num_heads"], record["head_dim"], record["placement"])
    assert settings == (cfg.num_heads, cfg.head_dim, cfg.placement)
    assert (record["model_type"], record["hidden_size"], record["num_layers"]) == ("qwen2", 64, 2)
    fresh = bridgelm.load_blocks(_base(), out)
    assert bridgelm.block_config(fresh) == cfg
    torch.testing.assert_close(_logits(fresh), _logits(model), rtol=0, atol=0)
    assert not torch.equal(_logits(fresh), _logits(tiny_model()))  # the blocks do something


def test_digest_is_cheap_but_tells_bases_apart():
    a = base_digest(tiny_model())
    assert a == base_digest(tiny_model()) == base_digest(bridgelm.add_bridge(tiny_model()))  # blocks left out
    assert a == base_digest(tiny_model(dtype=torch.bfloat16).float())  # dtype of one checkpoint: same digest
    assert a != base_digest(tiny_model(seed=1))
    assert a != base_digest(tiny_model(num_hidden_layers=3))
    other = tiny_model()
    with torch.no_grad():
        other.lm_head.weight[-1, -1] += 1.0  # a sampled value (the last of each tensor)
    assert a != base_digest(other)


def test_other_base_refused_same_weights_other_name_warned(tmp_path):
    out = bridgelm.save_blocks(_trained(), tmp_path / "adapter")
    target = _base(seed=1)
    with pytest.raises(UserError, match=r"trained on base 'org/tiny-base' \(weights digest sha256:") as err:
        bridgelm.load_blocks(target, out)
    assert "\n" not in str(err.value) and bridgelm.block_config(target) is None  # the model is untouched
    with pytest.warns(UserWarning, match=r"names base 'org/tiny-base' and this model is 'me/renamed'"):
        loaded = bridgelm.load_blocks(_base("me/renamed"), out)
    assert bridgelm.block_config(loaded) is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bridgelm.load_blocks(_base(), out)  # same name, same digest: silent


def test_the_single_file_form_checks_the_base_too(tmp_path):
    model = _trained()
    path = bridgelm.save_blocks(model, tmp_path / "b.safetensors")
    assert path.is_file() and not (tmp_path / CONFIG_FILE).exists()
    fresh = bridgelm.load_blocks(_base(), path)
    assert bridgelm.block_config(fresh) == bridgelm.block_config(model)
    other = _base(seed=1)  # another base of the same shapes: refused by its digest, as the folder form refuses it
    with pytest.raises(UserError, match=r"b.safetensors holds blocks trained on base .*digest sha256:.*expected the "
                                        "base model the blocks were trained on"):
        bridgelm.load_blocks(other, path)
    assert bridgelm.block_config(other) is None
    with pytest.raises(UserError, match="push_to_hub with .*b.safetensors: expected an adapter folder"):
        bridgelm.save_blocks(model, tmp_path / "b.safetensors", push_to_hub=True)
    for typo in ("b.bin", "b.pt", "b.safetensor"):  # a weight file's name that is not .safetensors: no folder made
        with pytest.raises(UserError, match=f"cannot save blocks to .*{typo}: expected a name ending in .safetensors"):
            bridgelm.save_blocks(model, tmp_path / typo)
        assert not (tmp_path / typo).exists()


def test_load_model_takes_an_adapter_folder(tmp_path):
    model_dir = tmp_path / "m"
    save_tiny_model_dir(model_dir)
    base = bridgelm.load_model(str(model_dir))
    adapter = bridgelm.save_blocks(randomize_blocks(bridgelm.add_bridge(base)), tmp_path / "adapter")
    assert json.loads((adapter / CONFIG_FILE).read_text())["base_model"] == str(model_dir)
    again = bridgelm.load_model(str(model_dir), blocks=adapter)
    torch.testing.assert_close(_logits(again), _logits(base), rtol=0, atol=0)


def test_a_base_loaded_by_a_relative_path_is_recorded_absolute(tmp_path, monkeypatch):
    """The block file names its base so that it can be found again from any folder (run.json does the same)."""
    save_tiny_model_dir(tmp_path / "m")
    monkeypatch.chdir(tmp_path)
    model = bridgelm.add_bridge(bridgelm.load_model("m"))
    adapter = bridgelm.save_blocks(model, tmp_path / "adapter")
    assert json.loads((adapter / CONFIG_FILE).read_text())["base_model"] == str((tmp_path / "m").resolve())


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """huggingface_hub's create_repo / upload_folder / snapshot_download as copies into and out of a local folder."""
    hub, calls = tmp_path / "hub", []

    def create_repo(repo_id, **kw):
        calls.append(("create_repo", repo_id, kw))

    def upload_folder(*, repo_id, folder_path, allow_patterns, **kw):
        calls.append(("upload_folder", repo_id, sorted(allow_patterns)))
        for name in allow_patterns:
            (hub / repo_id).mkdir(parents=True, exist_ok=True)
            shutil.copy(Path(folder_path) / name, hub / repo_id / name)

    def snapshot_download(repo_id, revision=None, allow_patterns=None, **kw):
        calls.append(("snapshot_download", repo_id, revision, sorted(allow_patterns)))
        return str(hub / repo_id)

    for fn in (create_repo, upload_folder, snapshot_download):
        monkeypatch.setattr(huggingface_hub, fn.__name__, fn)
    return hub, calls


def test_push_to_hub_and_load_by_hub_id(tmp_path, fake_hub):
    hub, calls = fake_hub
    model = _trained()
    bridgelm.save_blocks(model, tmp_path / "local", push_to_hub=True, repo_id="me/tiny-bridge", private=True)
    files = sorted([BLOCKS_FILE, CONFIG_FILE])
    assert calls == [
        ("create_repo", "me/tiny-bridge", {"token": None, "private": True, "exist_ok": True}),
        ("upload_folder", "me/tiny-bridge", files),
    ]
    assert sorted(p.name for p in (hub / "me/tiny-bridge").iterdir()) == files
    loaded = bridgelm.load_blocks(_base(), "me/tiny-bridge", revision="main")
    assert calls[-1] == ("snapshot_download", "me/tiny-bridge", "main", files)
    torch.testing.assert_close(_logits(loaded), _logits(model), rtol=0, atol=0)
    bridgelm.save_blocks(model, tmp_path / "named", push_to_hub=True)  # repo id defaults to the folder's name
    assert calls[-1] == ("upload_folder", "named", files)


def test_hub_id_offline_and_not_cached_is_one_line(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    model = _base()
    with pytest.raises(UserError, match=r"blocks 'nobody/no-blocks': .*HF_HUB_OFFLINE=1 and it is not cached") as err:
        bridgelm.load_blocks(model, "nobody/no-blocks")
    assert "\n" not in str(err.value) and bridgelm.block_config(model) is None


def _adapter(tmp_path):
    return bridgelm.save_blocks(_trained(), tmp_path / "adapter")


def test_bad_adapter_folders_are_one_line(tmp_path):
    out = _adapter(tmp_path)
    config = out / CONFIG_FILE
    record = json.loads(config.read_text())
    cases = [
        (lambda: config.unlink(), rf"block file {out} is a folder: expected .* adapter folder with its {CONFIG_FILE}"),
        (lambda: config.write_text("[1, 2]"), rf"{config} holds a JSON array: expected an adapter config"),
        (lambda: config.write_text("{not json"),
         rf"{config}: malformed JSON \(.* at column 2\): expected an adapter config"),
        (lambda: config.write_text(json.dumps({k: v for k, v in record.items() if k != "base_model_digest"})),
         rf"{config} lacks base_model_digest: expected"),
        (lambda: config.write_text(json.dumps({**record, "format": "old"})), r"has format 'old': expected"),
        (lambda: config.write_text(json.dumps({**record, "kind": "pmatch"})),
         r"says kind='pmatch' but blocks.safetensors holds 'bridge'"),
        (lambda: (out / BLOCKS_FILE).unlink(), rf"adapter folder {out} has no {BLOCKS_FILE}"),
    ]  # fmt: skip
    for damage, message in cases:
        shutil.rmtree(out)
        _adapter(tmp_path)
        damage()
        model = _base()
        with pytest.raises(UserError, match=message) as err:
            bridgelm.load_blocks(model, out)
        assert "\n" not in str(err.value) and bridgelm.block_config(model) is None


def test_saving_a_folder_over_a_file_is_refused(tmp_path):
    taken = tmp_path / "adapter"
    taken.write_text("mine")
    with pytest.raises(UserError, match=f"cannot save an adapter folder at {taken}: a file is in its place"):
        bridgelm.save_blocks(_trained(), taken)
    assert taken.read_text() == "mine"


def test_cli_blocks_takes_an_adapter_folder(tmp_path, capsys):
    from bridgelm.cli import main
    from bridgelm.jsonl import read_records

    save_tiny_model_dir(tmp_path / "m")
    adapter = bridgelm.save_blocks(bridgelm.add_bridge(bridgelm.load_model(str(tmp_path / "m"))), tmp_path / "a")
    out = tmp_path / "s.jsonl"
    argv = ["generate", "--blocks", str(adapter), "--prompt", "1", "--max-new-tokens", "2", "--n", "1", "--width", "1"]
    main([*argv, "--model", str(tmp_path / "m"), "--out", str(out)])
    assert len(read_records(out)) == 1
    other, _ = save_tiny_model_dir(tmp_path / "other")  # another base: same architecture, other weights
    with torch.no_grad():
        other.lm_head.weight.mul_(2)
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--model", str(tmp_path / "other"), "--out", str(tmp_path / "t.jsonl")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    assert "trained on base" in err.strip().splitlines()[-1] and "digest" in err.strip().splitlines()[-1]
    assert not (tmp_path / "t.jsonl").exists()


def test_blocks_that_cannot_fit_are_refused_before_the_weights_load(tmp_path, monkeypatch):
    """A missing block file, one of another architecture or size, an adapter folder of one: said from the headers
    and the config alone, before from_pretrained reads the weights (minutes for a large model)."""
    from bridgelm import models

    model, _ = save_tiny_model_dir(tmp_path / "m", blocks="bridge")
    bridgelm.save_blocks(model, tmp_path / "b.safetensors")
    bridgelm.save_blocks(model, tmp_path / "folder")
    small = tiny_model(hidden_size=32, vocab_size=model.config.vocab_size)
    small.save_pretrained(tmp_path / "small")
    wide = tiny_model("llama", vocab_size=model.config.vocab_size)
    wide.save_pretrained(tmp_path / "llama")
    loads = []
    real = models._from_pretrained
    monkeypatch.setattr(models, "_from_pretrained", lambda *a: loads.append(a) or real(*a))
    cases = [
        ("small", tmp_path / "b.safetensors", r"hidden size 64\) does not fit this model \(hidden size 32\)"),
        ("small", tmp_path / "folder", "does not fit this model"),
        ("llama", tmp_path / "b.safetensors", "trained in a qwen2 model .* this model is a llama"),
        ("small", tmp_path / "nope.safetensors", "nope.safetensors does not exist"),
    ]
    for base, blocks, match in cases:
        with pytest.raises(UserError, match=match):
            bridgelm.load_model(str(tmp_path / base), blocks=blocks)
    assert loads == []
    bridgelm.load_model(str(tmp_path / "small"))  # the same bases load without them
    assert len(loads) == 1

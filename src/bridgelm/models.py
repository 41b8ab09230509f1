"""Loading model folders: a causal LM from a folder or hub id, with its recorded blocks rebuilt, and every way a
folder can be wrong told in one line (a UserError naming the file or value) before transformers reads it.

Nothing in a model folder runs: configs, models and tokenizers load with `trust_remote_code=False`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from bridgelm.attach import MODEL_TYPE, auto_class, has_block_type
from bridgelm.layout import config_value
from bridgelm.adapter import check_local_blocks, load_blocks
from bridgelm.blockfile import check_finite
from bridgelm.dist import check_device
from bridgelm.errors import UserError, check_int
from bridgelm.jsonl import read_json_object

# Every load says it: a model folder's own code (auto_map) is never run, and transformers never asks whether to.
NO_REMOTE_CODE = {"trust_remote_code": False}

# The dtypes a model loads in, by name (every front end's --dtype / dtype=).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(name_or_path: str, blocks: str | os.PathLike | None = None, dtype=torch.float32, device="cpu", **kwargs):
    """Load a causal LM (local dir or hub id), rebuilding blocks recorded in its config, then `blocks` if given.

    Bad input (no such folder, a cut config.json, a truncated weights file, weights that do not fit the config,
    a device this machine lacks) is a UserError naming the file or value.
    """
    check_device(device)
    if "torch_dtype" in kwargs:  # transformers' older name: dtype would win over it, silently
        raise UserError(f"torch_dtype={kwargs['torch_dtype']!r}: give it as dtype= (load_model's own argument)")
    dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if dtype != "auto" and dtype not in DTYPES.values():  # "auto": the dtype the weights were saved in
        raise UserError(f"dtype={dtype!r}: expected one of {', '.join(DTYPES)} (a name or the torch dtype) or 'auto'")
    config = load_config(name_or_path, weights=True, **kwargs)
    recorded = getattr(config, "bridgelm", None)
    if recorded is not None and not has_block_type(config):
        raise UserError(
            f"model {name_or_path} records blocks in a config.json of model type {config.model_type!r} (written by an "
            f"older bridgelm, which this one does not read): expected model type {MODEL_TYPE!r}"
        )
    if recorded and blocks is not None:
        raise UserError(
            f"model {name_or_path} has {recorded.get('kind')} blocks of its own (recorded in its config.json), which "
            f"blocks={str(blocks)!r} would replace: load that file into the model without blocks, or leave it out"
        )
    if blocks is not None:
        check_local_blocks(blocks, config)  # a wrong --blocks is said before the weights load
    # A config with blocks is a "bridgelm" model type: its Auto class builds them and loads their tensors.
    model = _from_pretrained(name_or_path, config, dtype, kwargs).to(device)
    if blocks is not None:
        load_blocks(model, blocks)
    for name, tensor in model.state_dict().items():  # everything loaded: base, recorded blocks, a block file
        check_finite(tensor, f"model {name_or_path}: weight {name}")
    return model


def enable_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer in the backward (non-reentrant activation checkpointing). transformers 5.23 calls
    it `activation_checkpointing_enable` (`gradient_checkpointing_enable` a deprecated alias); 5.17 has only the
    latter. Chosen by which the model has, not by a version string."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": False})


def load_config(name_or_path: str, weights: bool = False, **kwargs):
    """A model's config (local folder or hub id), with a folder or id that cannot give one reported as a UserError;
    `weights`: a local folder must hold weights too (see `check_model_folder`)."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    check_model_folder(name_or_path, weights)
    try:
        config = AutoConfig.from_pretrained(name_or_path, **{**NO_REMOTE_CODE, **kwargs})
    except StrictDataclassError as err:  # a field of the wrong type or value ("hidden_size": "64", 0 layers)
        detail = str(err).splitlines()[-1].strip()
        raise UserError(f"model {name_or_path!r}: its config.json does not describe a valid model: {detail}") from err
    except OSError as err:  # not a folder here, and the hub cannot give it (offline, unknown id, gated)
        raise UserError(
            f"model {name_or_path!r}: no such folder here, and loading it as a Hugging Face hub id failed: "
            f"{str(err).splitlines()[0]}"
        ) from err
    except ValueError as err:  # a model_type this transformers does not know
        import transformers

        if "trust_remote_code" in str(err):
            raise UserError(
                f"model {name_or_path!r}: its config.json names code of its own (auto_map), and bridgelm does not run "
                "code from a model folder: expected a model_type this transformers knows"
            ) from err

        raise UserError(
            f"model {name_or_path!r}: transformers {transformers.__version__} cannot read its config: "
            f"{str(err).splitlines()[0]}"
        ) from err
    check_model_config(config, name_or_path)
    return config


# The sizes of a decoder's config that must be positive integers (those the config has).
_SIZES = ("vocab_size", "max_position_embeddings", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "intermediate_size", "head_dim")  # fmt: skip


def check_model_config(config, name: str | os.PathLike) -> None:
    """UserError in one line unless the config's sizes can make a model: each a positive integer, the hidden size
    split evenly into heads (unless head_dim is given), the heads into key/value groups. The one check of
    load_model, plan and params (transformers accepts 0 heads, or 14 heads in groups of 3, until a forward fails)."""
    text = config.get_text_config()  # a composite model's (Gemma 3, Mistral 3) language part
    sizes = {key: config_value(text, key) for key in _SIZES}
    for key, value in sizes.items():
        for each in value if isinstance(value, list) and key == "intermediate_size" else [value]:  # or one a layer
            if each is not None:
                check_int(f"model {name}: config.json has {key}", each)
    heads, kv = sizes["num_attention_heads"], sizes["num_key_value_heads"]
    hidden, head_dim = sizes["hidden_size"], sizes["head_dim"]
    if heads and hidden and head_dim is None and hidden % heads:
        raise UserError(
            f"model {name}: config.json has hidden_size={hidden} and num_attention_heads={heads}: expected a hidden "
            "size that the heads divide"
        )
    if heads and kv and heads % kv:
        raise UserError(
            f"model {name}: config.json has num_attention_heads={heads} and num_key_value_heads={kv}: expected a "
            "number of key/value heads that divides the heads"
        )


# What from_pretrained reads weights from (one of them, or the shards an index names).
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.gguf")


def _safetensors_files(folder: Path) -> list[Path]:
    """The safetensors files from_pretrained reads in `folder` and that are there: the shards its index names, else
    model.safetensors; an index that cannot be read is a UserError."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = json.loads(index.read_bytes().decode("utf-8"))["weight_map"].values()
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError, RecursionError) as err:
            raise UserError(
                f"{index} is unreadable ({err!r}): expected the weight_map written by save_pretrained"
            ) from err
        for name in sorted(set(names)):
            if not isinstance(name, str) or Path(name).name != name or not (folder / name).is_file():
                raise UserError(
                    f"{index} names the weights file {name!r}, which is not in {folder}: expected every shard its "
                    "weight_map names beside it (a download that stopped early?)"
                )
        return [folder / name for name in sorted(set(names))]
    single = folder / "model.safetensors"
    return [single] if single.is_file() else []


def check_model_folder(name_or_path: str | os.PathLike, weights: bool = False) -> None:
    """UserError for a model path that cannot be a model: a missing folder, a file, a folder without a readable
    config.json, or with a cut or corrupt *.safetensors file; with `weights`, one without any weights file. Names
    that may be hub ids are left to the hub."""
    name = str(name_or_path)
    folder = Path(name).expanduser()
    if not folder.exists():
        if name.startswith((".", "/", "~")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name):
            raise UserError(f"model folder {name} does not exist: expected a folder with config.json and weights")
        return  # perhaps a hub id ("Qwen/Qwen2.5-1.5B-Instruct"): AutoConfig decides
    if not folder.is_dir():
        raise UserError(f"model {name} is a file: expected a model folder (config.json and *.safetensors) or a hub id")
    config = folder / "config.json"
    if not config.is_file():
        shards = " (it holds an --fsdp checkpoint's shards: `bridgelm consolidate` makes it one)" if (
            folder / "shards").is_dir() else ""
        raise UserError(f"model folder {name} has no config.json: expected a folder written by save_pretrained{shards}")
    read_json_object(config, "a model config")
    for file in _safetensors_files(folder):  # what from_pretrained will read
        try:
            file.open("rb").close()  # safetensors says a file it may not read is not there
        except OSError as err:
            raise UserError(f"cannot read {file}: {err.strerror}") from err
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except Exception as err:  # safetensors raises its own error type for every kind of damage
            raise UserError(f"{file} is unreadable ({err}): a truncated or damaged weights file?") from err
    if weights and not any(next(folder.glob(pattern), None) for pattern in WEIGHT_FILES):
        raise UserError(
            f"model folder {name} has config.json but no weights file (model.safetensors, pytorch_model.bin, ...): "
            "expected a folder written by save_pretrained"
        )


def _from_pretrained(name_or_path: str, config, dtype, kwargs: dict):
    """`from_pretrained` of the config's Auto class (`attach.auto_class`: AutoModelForCausalLM for all but a few
    composite models), with weights that do not fit the config reported as a UserError."""

    def misfit(detail: str) -> UserError:
        return UserError(
            f"the weights of model {name_or_path} do not fit the shapes its config.json describes ({detail}): "
            "expected the config.json saved with these weights"
        )

    folder = Path(name_or_path).expanduser()
    # A plain local checkpoint's safetensors headers are checked before transformers loads it (and prints its report
    # of every misfit tensor); loading options that change what is read or what fits are left to transformers.
    plain = not {"gguf_file", "subfolder", "ignore_mismatched_sizes", "quantization_config"} & set(kwargs)
    if plain and folder.is_dir() and getattr(config, "quantization_config", None) is None:
        found = _shape_mismatches(folder, config)
        if found:
            raise misfit("; ".join(found[:3]))
    try:
        model, info = auto_class(config).from_pretrained(
            name_or_path, dtype=dtype, output_loading_info=True, **{**NO_REMOTE_CODE, **kwargs}
        )
    except RuntimeError as err:  # other weight formats (*.bin), and the options above
        if "mismatched_sizes" not in str(err) and "size mismatch" not in str(err):
            raise
        raise misfit("; ".join(_shape_mismatches(folder, config)[:3]) or "see the load report above") from err
    missing = sorted(info.get("missing_keys") or ())
    if missing:  # transformers would fill them with random values and sample from those
        raise UserError(
            f"the weights of model {name_or_path} lack {len(missing)} tensor(s) its config.json needs "
            f"({', '.join(missing[:3])}): expected every weight (an untied lm_head.weight too)"
        )
    return model


def _shape_mismatches(folder: Path, config) -> list[str]:
    """'file: tensor is [a, b], config.json makes it [c, d]' for each weight whose shape the config contradicts."""
    files = _safetensors_files(folder)
    if not files:
        return []
    with torch.device("meta"):
        shapes = {k: list(v.shape) for k, v in auto_class(config).from_config(config).state_dict().items()}
    found = []
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                got = list(f.get_slice(key).get_shape())
                if key in shapes and shapes[key] != got:
                    found.append(f"{file.name}: {key} is {got}, config.json makes it {shapes[key]}")
    return found


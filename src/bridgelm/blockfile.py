"""Block files: only the added blocks, in one safetensors file with their settings as metadata.

`save_blocks` writes them atomically; `load_blocks` checks a file's kind, settings, base, tensor names and shapes
against the model, and that every tensor is finite, before the model is touched, then adds the blocks when it has
none.

The base is checked by digest (`base_digest`): sha256 over every base parameter's name and shape and 16 values
sampled at evenly spaced positions, rounded to bfloat16 so that float32, bfloat16 and float16 loads of one bf16
checkpoint agree; the blocks and LoRA weights are left out, and peft's `base_layer` names read as the plain ones. It
reads 16 numbers per tensor (no pass over the weights), so it costs milliseconds on a 7B model; it tells apart
different checkpoints and sizes (Qwen2.5-1.5B from Qwen2.5-Math-1.5B), not a deliberate edit of an unsampled weight.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from bridgelm.attach import FORMAT, added_parameters, attach_blocks, block_config, new_norm
from bridgelm.layout import decoder_layers, text_config
from bridgelm.blocks import BlockConfig, make_block
from bridgelm.errors import UserError
from bridgelm.jsonl import as_umask, check_regular_file


def _block_state(model: nn.Module, cfg: BlockConfig) -> dict[str, torch.Tensor]:
    """Blocks' tensors keyed `layers.{i}.{param}` (independent of where the decoder sits in the model)."""
    state = {}
    for i, layer in enumerate(decoder_layers(model)):
        for name, t in getattr(layer, cfg.kind).state_dict().items():
            state[f"layers.{i}.{name}"] = t
    return state


_SAMPLES = 16  # values of each base tensor that the digest reads


def base_digest(model: nn.Module) -> str:
    """sha256 over the base's parameter names, shapes and a few sampled values (blocks and LoRA weights left out)."""
    added = set(added_parameters(model))
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        if name in added or ".lora_" in name:
            continue
        h.update(f"{name.replace('.base_layer.', '.')}:{tuple(p.shape)};".encode())
        if p.is_meta or p.numel() == 0:
            continue
        flat = p.detach().reshape(-1)
        idx = torch.arange(_SAMPLES, device=flat.device) * (flat.numel() - 1) // (_SAMPLES - 1)  # exact on any device
        h.update(flat[idx].to(torch.bfloat16).float().cpu().numpy().tobytes())
    return "sha256:" + h.hexdigest()


def _base_name(model: nn.Module) -> str:
    """The base model as a reader can find it again: a local folder made absolute, a hub id as it is."""
    name = str(getattr(model.config, "_name_or_path", "") or type(model).__name__)
    return str(Path(name).resolve()) if name and Path(name).is_dir() else name


def save_blocks(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write only the added blocks to a safetensors file (atomically), with their settings as metadata."""
    cfg = block_config(model)
    if cfg is None:
        raise ValueError("the model has no Bridge or P-Match blocks to save: call add_bridge/add_pmatch first")
    path = Path(path)
    state = {k: v.detach().contiguous().cpu() for k, v in _block_state(model, cfg).items()}
    wrapped = next((k for k in state if "lora_" in k or ".base_layer." in k), None)
    if wrapped is not None:  # a file no model could load: its tensors under peft's names
        raise ValueError(
            f"the blocks are wrapped by peft's LoRA ({wrapped}): merge it into them first (merge_and_unload), so "
            "that the file holds the blocks' own weights"
        )
    text_cfg = text_config(model)
    meta = {
        **{k: str(v) for k, v in asdict(cfg).items()},
        "format": FORMAT,
        "base_model": _base_name(model),
        "base_model_digest": base_digest(model),
        "model_type": str(model.config.model_type),
        "hidden_size": str(text_cfg.hidden_size),
        "num_layers": str(len(decoder_layers(model))),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    save_file(state, str(tmp), metadata=meta)
    as_umask(tmp)
    os.replace(tmp, path)
    return path


def read_block_settings(path: str | os.PathLike) -> tuple[BlockConfig, dict[str, str]]:
    """The BlockConfig and raw metadata stored in a block file."""
    path = check_regular_file(path, "block file", "a .safetensors file of blocks")  # a FIFO: named, never opened
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as err:
        raise UserError(f"{path} is not a safetensors block file: {err}") from err
    if meta.get("format") != FORMAT:
        raise UserError(f"{path} is not a bridgelm block file (format {meta.get('format')!r}, expected {FORMAT!r})")
    missing = [key for key in _SETTINGS if key not in meta]
    if missing:
        raise UserError(
            f"{path} has no {', '.join(missing)} in its metadata (written by an older bridgelm, or edited): expected "
            "a block file written by save_blocks"
        )
    try:
        cfg = BlockConfig(
            kind=meta["kind"], num_heads=int(meta["num_heads"]), head_dim=int(meta["head_dim"]),
            placement=meta["placement"],
        )  # fmt: skip
    except ValueError as err:
        raise UserError(f"{path}: its metadata does not describe blocks ({err}): expected save_blocks' settings") from None
    return cfg, meta


# What a block file's metadata records: the blocks' settings and the architecture they were trained in.
_SETTINGS = ("kind", "num_heads", "head_dim", "placement", "model_type", "hidden_size", "num_layers",
             "base_model_digest")
_FLOATS = ("F64", "F32", "F16", "BF16")  # safetensors' names of the dtypes a block's weights may have


def check_architecture(path: str | os.PathLike, config) -> None:
    """UserError in one line unless the block file `path` is one and was trained in a model of `config`'s type and
    hidden size: what its header says, checked against the config before the weights load (minutes for a large
    model). `load_blocks` checks every tensor (the layers too) and the base's digest once the model is there."""
    _, meta = read_block_settings(path)
    text = config.get_text_config()
    if meta["model_type"] != str(config.model_type):
        raise UserError(
            f"{path} holds blocks trained in a {meta['model_type']} model ({meta.get('base_model')!r}), and this model "
            f"is a {config.model_type}: expected blocks of this architecture"
        )
    if meta["hidden_size"] != str(text.hidden_size):
        raise UserError(
            f"{path} ({meta['kind']} blocks for base {meta.get('base_model')!r}, hidden size {meta['hidden_size']}) "
            f"does not fit this model (hidden size {text.hidden_size}): expected the blocks of this base model"
        )


def load_blocks(model: nn.Module, path: str | os.PathLike) -> nn.Module:
    """Load a block file into `model`, adding the blocks first when the model has none.

    Everything is checked before the model is touched: kind and settings against blocks already attached,
    and every tensor's name and shape against what the model's blocks would hold.
    """
    check_architecture(path, model.config)
    cfg, meta = read_block_settings(path)
    existing = block_config(model)
    if existing is not None and existing != cfg:
        raise UserError(
            f"{path} holds blocks {asdict(cfg)} but the model has {asdict(existing)}; "
            "load it into a model without blocks or with the same ones"
        )
    layers = decoder_layers(model)
    got = _check_tensors(model, path, cfg, meta, layers)
    digest = base_digest(model)
    if meta["base_model_digest"] != digest:
        raise UserError(
            f"{path} holds blocks trained on base {meta.get('base_model')!r} (weights digest "
            f"{meta['base_model_digest'][:19]}), and this model ({_base_name(model)!r}) has digest {digest[:19]}: "
            "expected the base model the blocks were trained on"
        )
    if existing is None:
        attach_blocks(model, cfg)
    with safe_open(str(path), framework="pt") as f:
        for i, layer in enumerate(layers):
            block = getattr(layer, cfg.kind)
            ref = next(block.parameters())
            prefix = f"layers.{i}."
            sub = {k[len(prefix) :]: f.get_tensor(k) for k in got if k.startswith(prefix)}
            for name, tensor in sub.items():
                check_finite(tensor, f"block file {path}: tensor {prefix}{name}")
            block.load_state_dict(
                {k: v.to(device=ref.device, dtype=ref.dtype) for k, v in sub.items()}, assign=ref.is_meta
            )
    return model


def _check_tensors(model: nn.Module, path, cfg: BlockConfig, meta: dict, layers: list) -> dict[str, tuple]:
    """{name: shape} of the file's tensors, once each is known to be a floating-point tensor of the name and shape
    that the model's blocks would hold (a throwaway block built on the meta device says which)."""
    text_cfg = text_config(model)
    with torch.device("meta"):
        norm = new_norm(layers[0].post_attention_layernorm, text_cfg.hidden_size, 1e-6)
        probe = make_block(cfg, text_cfg.hidden_size, norm, 0.0)
    expected = {
        f"layers.{i}.{name}": tuple(t.shape) for i in range(len(layers)) for name, t in probe.state_dict().items()
    }
    with safe_open(str(path), framework="pt") as f:
        got = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    not_float = sorted(k for k, dtype in dtypes.items() if dtype not in _FLOATS)
    if not_float:
        first = not_float[0]
        raise UserError(
            f"{path}: tensor {first} is {dtypes[first]}{f' (and {len(not_float) - 1} more)' if len(not_float) > 1 else ''}: "
            "expected floating-point weights (F32, BF16, F16)"
        )
    check_fits(
        f"{path} ({meta.get('kind')} blocks for base {meta.get('base_model')!r}, hidden size "
        f"{meta.get('hidden_size')}, {meta.get('num_layers')} layers) does not fit this model "
        f"({type(model).__name__}, hidden size {text_cfg.hidden_size}, {len(layers)} layers)", got, expected,
    )
    return got


def check_fits(where: str, found: dict[str, tuple], expected: dict[str, tuple], fix: str = "") -> None:
    """UserError in one line (`where`: what was read, `fix`: what was expected) unless the tensors `found` ({name:
    shape}) are those `expected`, by name and shape: the one check of every reader that loads tensors into a model
    (block files, checkpoints' weights, LoRA adapters), before any is copied."""
    unexpected = sorted(set(found) - set(expected))
    missing = sorted(set(expected) - set(found))
    wrong = sorted(k for k in set(found) & set(expected) if tuple(found[k]) != tuple(expected[k]))
    detail = [f"holds weights the model lacks: {unexpected[:3]}"] if unexpected else []
    detail += [f"lacks weights of the model: {missing[:3]}"] if missing else []
    detail += [f"{k} has shape {tuple(found[k])}, the model's is {tuple(expected[k])}" for k in wrong[:3]]
    if detail:
        raise UserError(f"{where}: {'; '.join(detail)}{fix}")


def check_finite(tensor: torch.Tensor, what: str) -> None:
    """UserError naming `what` when `tensor` holds a NaN or an infinity (a model would sample garbage from it)."""
    if tensor.is_floating_point() and not tensor.is_meta and not bool(torch.isfinite(tensor).all()):
        bad = "NaN" if bool(torch.isnan(tensor).any()) else "infinite"
        raise UserError(f"{what} holds {bad} values: expected finite weights (a damaged or diverged file?)")

"""Attaching Bridge / P-Match blocks to a Hugging Face decoder, and saving or loading only those blocks.

Each decoder layer keeps its modules and weights; it gains one submodule (`bridge` or `pmatch`) and its class
is swapped for a subclass with the same name that runs the layer's own forward and adds the block's update to
the residual stream: to the layer's output, i.e. after the feed-forward residual ("ffn", the paper's default), or
after the attention residual ("attn", App. D), through a forward hook on the attention branch whose output the
layer adds to its input (`attention_branch`). Neither re-implements the layer, so both fit every layout
`decoder_layers` accepts (Gemma's extra norms included).
The model keeps its whole interface (`model(...)`, `generate`, `save_pretrained`, gradient checkpointing):
the subclass is checkpointed like the original layer, and the group layout arrives as the keyword argument
`bridge_groups` that Hugging Face decoders pass down to their layers (see grouped.py).

The settings are recorded in `model.config.bridgelm`, so `save_pretrained` writes them into config.json
and `load_model` rebuilds the blocks from such a checkpoint.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from bridgelm.blocks import BlockConfig, make_block
from bridgelm.errors import UserError
from bridgelm.grouped import KWARG

FORMAT = "bridgelm-blocks-1"
# Every load says it: a model folder's own code (auto_map) is never run, and transformers never asks whether to.
NO_REMOTE_CODE = {"trust_remote_code": False}
_USUAL_LAYOUT = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")


class _BlockLayer:
    """Mixin of the swapped decoder-layer classes; the original class follows it in the MRO."""

    _bridgelm_kind: str  # attribute name of the added block: "bridge" or "pmatch"
    _bridgelm_placement: str

    def forward(self, hidden_states, *args, **kwargs):
        groups = kwargs.pop(KWARG, None)
        block = getattr(self, self._bridgelm_kind)
        if self._bridgelm_placement == "ffn":
            out = super().forward(hidden_states, *args, **kwargs)
            if isinstance(out, tuple):
                return (out[0] + block(out[0], groups), *out[1:])
            return out + block(out, groups)
        # "attn": the layer's own forward, with the block joining its attention branch (see _add_block_after_attn)
        branch = attention_branch(self)
        branch._bridgelm_pending = (block, hidden_states, groups)
        try:
            return super().forward(hidden_states, *args, **kwargs)
        finally:
            branch._bridgelm_pending = None


def attention_branch(layer: nn.Module) -> nn.Module:
    """The sub-module whose output a pre-norm layer adds to its input after attention: `self_attn`, or in
    Gemma-like layouts (norms before and after the feed-forward) the `post_attention_layernorm` that follows it."""
    return layer.post_attention_layernorm if hasattr(layer, "pre_feedforward_layernorm") else layer.self_attn


def _add_block_after_attn(branch: nn.Module, inputs, out):
    """Forward hook of the attention branch (placement "attn"). The layer adds the branch's output `a` to its input
    `x`; with `a + block(x + a)` in its place, the stream after the attention residual becomes x + a + block(x + a).
    Outside a call of its layer (nothing pending) the branch is left as it is."""
    pending = getattr(branch, "_bridgelm_pending", None)
    if pending is None:
        return None
    block, x, groups = pending
    a = out[0] if isinstance(out, tuple) else out
    a = a + block(x + a, groups)
    return (a, *out[1:]) if isinstance(out, tuple) else a


_SWAPPED: dict[tuple[type, str, str], type] = {}


def _swapped_class(cls: type, kind: str, placement: str) -> type:
    key = (cls, kind, placement)
    if key not in _SWAPPED:
        # Same name as the original, so that name-based lookups (no-split modules, FSDP wrap policies) still match.
        new = type(cls.__name__, (_BlockLayer, cls), {"_bridgelm_kind": kind, "_bridgelm_placement": placement})
        new.__qualname__ = cls.__qualname__
        new.__module__ = cls.__module__
        _SWAPPED[key] = new
    return _SWAPPED[key]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a Hugging Face causal LM in the usual layout, or a ValueError naming its class."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            f"unsupported architecture {type(model).__name__}: expected a decoder with a `layers` list "
            "(Qwen2, Qwen3, Llama, Mistral and other models in the usual layout)"
        )
    first = layers[0]
    missing = [a for a in _USUAL_LAYOUT if not hasattr(first, a)]
    if missing:
        raise ValueError(
            f"unsupported architecture {type(model).__name__}: its layer {type(first).__name__} lacks {missing}; "
            f"expected the usual layout {list(_USUAL_LAYOUT)}"
        )
    return layers


def block_config(model: nn.Module) -> BlockConfig | None:
    """The settings of the blocks attached to `model`, or None when it has none."""
    layers = decoder_layers(model)
    if not isinstance(layers[0], _BlockLayer):
        return None
    return BlockConfig(**{k: v for k, v in model.config.bridgelm.items() if k in BlockConfig.__dataclass_fields__})


def _text_config(model):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _resolve(model: nn.Module, kind: str, num_heads: int, head_dim: int | None, placement: str) -> BlockConfig:
    cfg = _text_config(model)
    if head_dim is not None and (not isinstance(head_dim, int) or head_dim < 1):
        raise ValueError(f"head_dim={head_dim!r} must be a positive integer (None: the model's own head dim)")
    if head_dim is None:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return BlockConfig(kind=kind, num_heads=num_heads, head_dim=int(head_dim), placement=placement)


def _new_norm(src: nn.Module, hidden_size: int, default_eps: float) -> nn.Module:
    """A fresh norm of the host's class and eps (weight = ones), on the current default device."""
    eps = getattr(src, "variance_epsilon", getattr(src, "eps", default_eps))
    try:
        return type(src)(hidden_size, eps=eps)
    except TypeError as err:
        raise ValueError(
            f"cannot build an input norm of class {type(src).__name__} as {type(src).__name__}(hidden_size, eps=...)"
        ) from err


def _attach(model: nn.Module, cfg: BlockConfig) -> nn.Module:
    layers = decoder_layers(model)
    existing = block_config(model)
    if existing is not None:
        raise ValueError(
            f"the model already has {existing.kind} blocks (placement {existing.placement!r}); "
            "blocks can be added once. Load a fresh model to change them."
        )
    text_cfg = _text_config(model)
    hidden = text_cfg.hidden_size
    init_std = getattr(text_cfg, "initializer_range", 0.02)
    default_eps = getattr(text_cfg, "rms_norm_eps", 1e-6)
    for layer in layers:
        ref = next(p for p in layer.parameters() if p.is_floating_point())
        # Drawn on the CPU, then moved: a seed gives the same blocks whatever device the model is on (a meta model's
        # blocks are built on meta: shapes only, nothing to draw).
        with torch.device("meta" if ref.is_meta else "cpu"):
            norm = _new_norm(layer.post_attention_layernorm, hidden, default_eps)
            block = make_block(cfg, hidden, norm, init_std)
        block.to(device=ref.device, dtype=ref.dtype)
        block.requires_grad_(any(p.requires_grad for p in layer.parameters()))
        layer.add_module(cfg.kind, block)
        layer.__class__ = _swapped_class(type(layer), cfg.kind, cfg.placement)
        if cfg.placement == "attn":
            attention_branch(layer).register_forward_hook(_add_block_after_attn)
    _own_config(model)
    model.config.bridgelm = {**asdict(cfg), "format": FORMAT}
    return model


def _own_config(model: nn.Module) -> None:
    """Give `model` (and every module of it that holds its config or a sub-config) a copy of its own before the blocks
    are recorded in it: models built by `from_config(cfg)` share `cfg`, and one model's blocks must not show up in
    another's config."""
    memo: dict[int, object] = {}
    model.config = copy.deepcopy(model.config, memo)
    for module in model.modules():
        held = module.__dict__.get("config")
        if held is not None and id(held) in memo:
            module.config = memo[id(held)]


def add_bridge(model: nn.Module, num_heads: int = 4, head_dim: int | None = None, placement: str = "ffn") -> nn.Module:
    """Add a Bridge block (attention across a group's rows) to every decoder layer; returns the model."""
    return _attach(model, _resolve(model, "bridge", num_heads, head_dim, placement))


def add_pmatch(model: nn.Module, num_heads: int = 4, head_dim: int | None = None, placement: str = "ffn") -> nn.Module:
    """Add the parameter-matched P-Match MLP to every decoder layer; returns the model."""
    return _attach(model, _resolve(model, "pmatch", num_heads, head_dim, placement))


def add_seeded_blocks(model: nn.Module, kind: str, seed: int, **kwargs) -> nn.Module:
    """add_bridge / add_pmatch (`kind`) with the new weights drawn from `seed`, the global generator left as it was:
    the same blocks on every rank, every resume and in every process, whatever ran before."""
    add = add_bridge if kind == "bridge" else add_pmatch
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)  # the CPU generator alone: blocks are drawn on the CPU
        return add(model, **kwargs)


def added_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The added blocks' parameters only, by their names in `model.named_parameters()`."""
    cfg = block_config(model)
    if cfg is None:
        return {}
    marker = f".{cfg.kind}."
    return {name: p for name, p in model.named_parameters() if marker in name}


def _block_state(model: nn.Module, cfg: BlockConfig) -> dict[str, torch.Tensor]:
    """Blocks' tensors keyed `layers.{i}.{param}` (independent of where the decoder sits in the model)."""
    state = {}
    for i, layer in enumerate(decoder_layers(model)):
        for name, t in getattr(layer, cfg.kind).state_dict().items():
            state[f"layers.{i}.{name}"] = t
    return state


def _base_name(model: nn.Module) -> str:
    return str(getattr(model.config, "_name_or_path", "") or type(model).__name__)


def save_blocks(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write only the added blocks to a safetensors file (atomically), with their settings as metadata."""
    cfg = block_config(model)
    if cfg is None:
        raise ValueError("the model has no Bridge or P-Match blocks to save: call add_bridge/add_pmatch first")
    path = Path(path)
    state = {k: v.detach().contiguous().cpu() for k, v in _block_state(model, cfg).items()}
    text_cfg = _text_config(model)
    meta = {
        **{k: str(v) for k, v in asdict(cfg).items()},
        "format": FORMAT,
        "base_model": _base_name(model),
        "hidden_size": str(text_cfg.hidden_size),
        "num_layers": str(len(decoder_layers(model))),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    save_file(state, str(tmp), metadata=meta)
    os.replace(tmp, path)
    return path


def read_block_settings(path: str | os.PathLike) -> tuple[BlockConfig, dict[str, str]]:
    """The BlockConfig and raw metadata stored in a block file."""
    path = Path(path)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise FileNotFoundError(f"block file {path} {what}: expected a .safetensors file of blocks")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as err:
        raise ValueError(f"{path} is not a safetensors block file: {err}") from err
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a bridgelm block file (format {meta.get('format')!r}, expected {FORMAT!r})")
    cfg = BlockConfig(
        kind=meta["kind"], num_heads=int(meta["num_heads"]), head_dim=int(meta["head_dim"]), placement=meta["placement"]
    )
    return cfg, meta


def load_blocks(model: nn.Module, path: str | os.PathLike) -> nn.Module:
    """Load a block file into `model`, adding the blocks first when the model has none.

    Everything is checked before the model is touched: kind and settings against blocks already attached,
    and every tensor's name and shape against what the model's blocks would hold.
    """
    cfg, meta = read_block_settings(path)
    existing = block_config(model)
    if existing is not None and existing != cfg:
        raise ValueError(
            f"{path} holds blocks {asdict(cfg)} but the model has {asdict(existing)}; "
            "load it into a model without blocks or with the same ones"
        )
    # Expected names and shapes, from a throwaway block built on the meta device.
    text_cfg = _text_config(model)
    layers = decoder_layers(model)
    with torch.device("meta"):
        norm = _new_norm(layers[0].post_attention_layernorm, text_cfg.hidden_size, 1e-6)
        probe = make_block(cfg, text_cfg.hidden_size, norm, 0.0)
    expected = {
        f"layers.{i}.{name}": tuple(t.shape) for i in range(len(layers)) for name, t in probe.state_dict().items()
    }
    with safe_open(str(path), framework="pt") as f:
        got = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    wrong = sorted(k for k in set(got) & set(expected) if got[k] != expected[k])
    if missing or unexpected or wrong:
        detail = []
        if missing:
            detail.append(f"missing {missing[:3]}")
        if unexpected:
            detail.append(f"unexpected {unexpected[:3]}")
        if wrong:
            detail.append(", ".join(f"{k}: file {got[k]} vs model {expected[k]}" for k in wrong[:3]))
        raise ValueError(
            f"{path} ({meta.get('kind')} blocks for base {meta.get('base_model')!r}, hidden size "
            f"{meta.get('hidden_size')}, {meta.get('num_layers')} layers) does not fit this model "
            f"({type(model).__name__}, hidden size {text_cfg.hidden_size}, {len(layers)} layers): " + "; ".join(detail)
        )
    if existing is None:
        _attach(model, cfg)
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


def load_model(name_or_path: str, blocks: str | os.PathLike | None = None, dtype=torch.float32, device="cpu", **kwargs):
    """Load a causal LM (local dir or hub id), rebuilding blocks recorded in its config, then `blocks` if given.

    Bad input (no such folder, a cut config.json, a truncated weights file, weights that do not fit the config,
    a device this machine lacks) is a UserError naming the file or value.
    """
    check_device(device)
    config = load_config(name_or_path, weights=True, **kwargs)
    recorded = getattr(config, "bridgelm", None)
    if recorded and blocks is not None:
        raise UserError(
            f"model {name_or_path} has {recorded.get('kind')} blocks of its own (recorded in its config.json), which "
            f"blocks={str(blocks)!r} would replace: load that file into the model without blocks, or leave it out"
        )
    if not recorded:
        model = _from_pretrained(name_or_path, config, dtype, kwargs).to(device)
    else:
        # The block tensors are loaded below, once the blocks exist: tell the loader they are expected extras.
        from transformers import AutoModelForCausalLM

        cls = AutoModelForCausalLM._model_mapping[type(config)]
        saved = cls.__dict__.get("_keys_to_ignore_on_load_unexpected")
        cls._keys_to_ignore_on_load_unexpected = [*(saved or []), rf"\.{recorded['kind']}\."]
        try:
            model = _from_pretrained(name_or_path, config, dtype, kwargs).to(device)
        finally:
            if saved is None:
                del cls._keys_to_ignore_on_load_unexpected
            else:
                cls._keys_to_ignore_on_load_unexpected = saved
    if recorded:
        cfg = BlockConfig(**{k: v for k, v in recorded.items() if k in BlockConfig.__dataclass_fields__})
        _attach(model, cfg)
        _load_recorded_blocks(model, Path(name_or_path), cfg)
    if blocks is not None:
        load_blocks(model, blocks)
    return model


def check_device(device: str | torch.device) -> None:
    """UserError unless `device` names a device of this machine (cpu, cuda:i with i < the GPU count, mps, meta)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise UserError(f"device {device!r} is not a device name: expected cpu, cuda, cuda:0, ...") from err
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UserError(
                f"device {device!r}: this machine has no CUDA GPU (or torch was built without CUDA); use cpu"
            )
        if dev.index is not None and dev.index >= count:
            raise UserError(f"device {device!r}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"device {device!r}: MPS is not available on this machine; use cpu")


def load_config(name_or_path: str, weights: bool = False, **kwargs):
    """A model's config (local folder or hub id), with a folder or id that cannot give one reported as a UserError;
    `weights`: a local folder must hold weights too (see `check_model_folder`)."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    check_model_folder(name_or_path, weights)
    try:
        return AutoConfig.from_pretrained(name_or_path, **{**NO_REMOTE_CODE, **kwargs})
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


# What from_pretrained reads weights from (one of them, or the shards an index names).
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.gguf")


def _safetensors_files(folder: Path) -> list[Path]:
    """The safetensors files from_pretrained reads in `folder` and that are there: the shards its index names, else
    model.safetensors; an index that cannot be read is a UserError."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = json.loads(index.read_bytes().decode("utf-8"))["weight_map"].values()
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
            raise UserError(
                f"{index} is unreadable ({err!r}): expected the weight_map written by save_pretrained"
            ) from err
        return [folder / name for name in sorted(set(names)) if (folder / name).is_file()]
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
        raise UserError(f"model folder {name} has no config.json: expected a folder written by save_pretrained")
    try:
        json.loads(config.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        where = f" (line {err.lineno}, column {err.colno}: {err.msg})" if isinstance(err, json.JSONDecodeError) else ""
        raise UserError(f"{config} is not valid JSON{where}: a cut or damaged file? expected a model config") from err
    for file in _safetensors_files(folder):  # what from_pretrained will read
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
    """AutoModelForCausalLM.from_pretrained, with weights that do not fit the config reported as a UserError."""
    from transformers import AutoModelForCausalLM

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
        model, info = AutoModelForCausalLM.from_pretrained(
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
    for name, tensor in model.state_dict().items():
        check_finite(tensor, f"model {name_or_path}: weight {name}")
    return model


def check_finite(tensor: torch.Tensor, what: str) -> None:
    """UserError naming `what` when `tensor` holds a NaN or an infinity (a model would sample garbage from it)."""
    if tensor.is_floating_point() and not tensor.is_meta and not bool(torch.isfinite(tensor).all()):
        bad = "NaN" if bool(torch.isnan(tensor).any()) else "infinite"
        raise UserError(f"{what} holds {bad} values: expected finite weights (a damaged or diverged file?)")


def _shape_mismatches(folder: Path, config) -> list[str]:
    """'file: tensor is [a, b], config.json makes it [c, d]' for each weight whose shape the config contradicts."""
    from transformers import AutoModelForCausalLM

    files = _safetensors_files(folder)
    if not files:
        return []
    with torch.device("meta"):
        shapes = {k: list(v.shape) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    found = []
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                got = list(f.get_slice(key).get_shape())
                if key in shapes and shapes[key] != got:
                    found.append(f"{file.name}: {key} is {got}, config.json makes it {shapes[key]}")
    return found


def _load_recorded_blocks(model: nn.Module, folder: Path, cfg: BlockConfig) -> None:
    """Copy the block tensors that `save_pretrained` wrote into the model's safetensors shards."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} records {cfg.kind} blocks in config.json but holds no safetensors weights")
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    loaded = 0
    marker = f".{cfg.kind}."
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if marker in key and key in params:
                    with torch.no_grad():
                        params[key].copy_(f.get_tensor(key))
                    loaded += 1
    wanted = sum(1 for k in params if marker in k)
    if loaded != wanted:
        raise ValueError(f"{folder}: found {loaded} of the {wanted} {cfg.kind} tensors that config.json records")


__all__ = [
    "add_bridge",
    "add_pmatch",
    "added_parameters",
    "save_blocks",
    "load_blocks",
    "load_model",
    "block_config",
    "decoder_layers",
    "read_block_settings",
]

"""Attaching Bridge / P-Match blocks to a Hugging Face decoder (saving and loading them: blockfile.py, models.py).

Each decoder layer keeps its modules and weights; it gains one submodule (`bridge` or `pmatch`) and its class
is swapped for a subclass with the same name that runs the layer's own forward and adds the block's update to
the residual stream: to the layer's output, i.e. after the feed-forward residual ("ffn", the paper's default), or
after the attention residual ("attn", App. D), through a forward hook on the attention branch whose output the
layer adds to its input (`attention_branch`). Neither re-implements the layer: "ffn" fits every layout
`decoder_layers` accepts (Gemma's extra norms included), "attn" those that add the attention's output as it is
(`check_attn_placement`: not Granite's, MiniMax's or GLM-4's).
The model keeps its whole interface (`model(...)`, `generate`, `save_pretrained`, gradient checkpointing):
the subclass is checkpointed like the original layer, and the group layout arrives as the keyword argument
`bridge_groups` that Hugging Face decoders pass down to their layers (see grouped.py).

The settings are recorded in `model.config.bridgelm`, and the config becomes a subclass of its own class that
`save_pretrained` writes with `"model_type": "bridgelm"` (the base's type kept as `base_model_type`). Importing
bridgelm registers that type with transformers' AutoConfig and AutoModelForCausalLM (AutoModelForImageTextToText for
the composite models only it builds: LLaVA, Mistral 3), so such a folder loads with its blocks through
`AutoModelForCausalLM.from_pretrained` (and so through every tool that loads models that way); without bridgelm
imported, transformers refuses the unknown model type instead of returning the base model without its blocks (a base
class named outright, `Qwen2ForCausalLM.from_pretrained`, still loads the base alone and lists the blocks' tensors as
unexpected). No code from the folder runs: the classes are bridgelm's own.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from bridgelm.blocks import OUTPUT, BlockConfig, make_block
from bridgelm.errors import UserError, check_int
from bridgelm.grouped import KWARG, note_rows_alone
from bridgelm.layout import check_attn_placement, decoder_layers, head_dim_of, text_config

FORMAT = "bridgelm-blocks-1"



class _BlockLayer:
    """Mixin of the swapped decoder-layer classes; the original class follows it in the MRO."""

    _bridgelm_kind: str  # attribute name of the added block: "bridge" or "pmatch"
    _bridgelm_placement: str

    def forward(self, hidden_states, *args, **kwargs):
        if KWARG not in kwargs and self._bridgelm_kind == "bridge":
            note_rows_alone(hidden_states)
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


def block_config(model: nn.Module) -> BlockConfig | None:
    """The settings of the blocks attached to `model`, or None when it has none."""
    layers = decoder_layers(model)
    if not isinstance(layers[0], _BlockLayer):
        return None
    return BlockConfig(**{k: v for k, v in model.config.bridgelm.items() if k in BlockConfig.__dataclass_fields__})


def _resolve(model: nn.Module, kind: str, num_heads: int, head_dim: int | None, placement: str) -> BlockConfig:
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise UserError(f"add_{kind}({type(model).__name__}): expected a Hugging Face causal LM (a PreTrainedModel, "
                        "e.g. AutoModelForCausalLM.from_pretrained(...)), not a model's name or another module")
    cfg = text_config(model)
    if head_dim is not None:
        check_int("head_dim", head_dim, note=" (None: the model's own head dim)")
    if head_dim is None:
        head_dim = head_dim_of(cfg)
    return BlockConfig(kind=kind, num_heads=num_heads, head_dim=int(head_dim), placement=placement)


def new_norm(src: nn.Module, hidden_size: int, default_eps: float) -> nn.Module:
    """A fresh norm of the host's class and eps (weight = ones), on the current default device."""
    eps = getattr(src, "variance_epsilon", getattr(src, "eps", default_eps))
    try:
        return type(src)(hidden_size, eps=eps)
    except TypeError as err:
        cls = type(src).__name__
        raise UserError(
            f"unsupported architecture: a block's input norm is built as its layer's own, {cls}(hidden_size, "
            f"eps=...), which {cls} does not take"
        ) from err


def attach_blocks(model: nn.Module, cfg: BlockConfig) -> nn.Module:
    layers = decoder_layers(model)
    existing = block_config(model)
    if existing is not None:
        raise UserError(
            f"the model already has {existing.kind} blocks (placement {existing.placement!r}); "
            "blocks can be added once. Load a fresh model to change them."
        )
    if cfg.placement == "attn":
        check_attn_placement(model, layers[0])
    text_cfg = text_config(model)
    hidden = text_cfg.hidden_size
    init_std = getattr(text_cfg, "initializer_range", 0.02)
    default_eps = getattr(text_cfg, "rms_norm_eps", 1e-6)
    for layer in layers:
        ref = next(p for p in layer.parameters() if p.is_floating_point())
        # Drawn on the CPU, then moved: a seed gives the same blocks whatever device the model is on (a meta model's
        # blocks are built on meta: shapes only, nothing to draw).
        with torch.device("meta" if ref.is_meta else "cpu"):
            norm = new_norm(layer.post_attention_layernorm, hidden, default_eps)
            block = make_block(cfg, hidden, norm, init_std)
        block.to(device=ref.device, dtype=ref.dtype)
        for p in block.parameters():  # drawn here: transformers' init_weights() leaves them (and a fresh block zero)
            p._is_hf_initialized = not p.is_meta
        block.requires_grad_(any(p.requires_grad for p in layer.parameters()))
        layer.add_module(cfg.kind, block)
        layer.__class__ = _swapped_class(type(layer), cfg.kind, cfg.placement)
        if cfg.placement == "attn":
            attention_branch(layer).register_forward_hook(_add_block_after_attn)
    _own_config(model)
    model.config.__class__ = bridge_config_class(type(model.config))
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
    return attach_blocks(model, _resolve(model, "bridge", num_heads, head_dim, placement))


def add_pmatch(model: nn.Module, num_heads: int = 4, head_dim: int | None = None, placement: str = "ffn") -> nn.Module:
    """Add the parameter-matched P-Match MLP to every decoder layer; returns the model."""
    return attach_blocks(model, _resolve(model, "pmatch", num_heads, head_dim, placement))


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


# --- The "bridgelm" model type: what a model with blocks saves as, and what transformers loads it with -------------

MODEL_TYPE = "bridgelm"
ARCH_PREFIX = "Bridge"  # the classes of models with blocks, and their config.json's architectures: "BridgeQwen2..."


class _BridgeConfig:
    """Mixin of the config classes of models with blocks (`bridge_config_class`): the config keeps behaving as its
    base class (`model_type` included) and serialises as the "bridgelm" model type, its base type recorded."""

    # No code of its own (an empty auto_map, never saved): loaders that read it (TRL's, from a path) fall back to
    # AutoModelForCausalLM, as they do for the architecture named in config.json, which no transformers class has.
    auto_map: dict = {}

    def to_dict(self) -> dict:
        out = super().to_dict()
        out["base_model_type"] = out["model_type"]
        out["model_type"] = MODEL_TYPE
        names = out.get("architectures") or []  # the base's class would load the bare base from a path
        out["architectures"] = [a if a.startswith(ARCH_PREFIX) else ARCH_PREFIX + a for a in names]
        return out

    @classmethod
    def get_config_dict(cls, *args, **kwargs):
        """A "bridgelm" config.json read by this class (peft does, through the model's config class) reads as its
        base type's, which this class is: transformers warned of a model of another type."""
        config_dict, rest = super().get_config_dict(*args, **kwargs)
        if config_dict.get("model_type") == MODEL_TYPE and config_dict.get("base_model_type") == cls.model_type:
            config_dict = {**config_dict, "model_type": cls.model_type}
            del config_dict["base_model_type"]
        return config_dict, rest

    def __reduce__(self):  # the class is made at run time: pickle names its base class instead
        base = next(c for c in type(self).__mro__[1:] if not issubclass(c, _BridgeConfig))
        return _unpickle_config, (base, self.__dict__)


def _unpickle_config(base: type, state: dict):
    config = object.__new__(bridge_config_class(base))
    config.__dict__.update(state)
    return config


_CONFIG_CLASSES: dict[type, type] = {}


def save_with_own_names(model: nn.Module, folder, state_dict: dict | None = None) -> None:
    """`model.save_pretrained(folder)` with the tensors under the module's own names. By default transformers writes a
    composite model's (Gemma 3 with its vision tower) under its older names, which from_pretrained renames back but a
    checkpoint read back tensor by tensor (a resume) would not find; every loader reads the own names."""
    own = "save_original_format" in inspect.signature(model.save_pretrained).parameters
    model.save_pretrained(folder, state_dict=state_dict, **({"save_original_format": False} if own else {}))


def has_block_type(config) -> bool:
    """Whether `config` is of a "bridgelm" model type (a config of a model with blocks)."""
    return isinstance(config, _BridgeConfig)


def _auto_classes() -> list[tuple[type, Any]]:
    """The Auto classes that build a text-generating model, each with its mapping (config class -> model class):
    AutoModelForCausalLM, then AutoModelForImageTextToText for composite models the first lacks (LLaVA, Mistral 3)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto import modeling_auto as auto

    return [
        (AutoModelForCausalLM, auto.MODEL_FOR_CAUSAL_LM_MAPPING),
        (AutoModelForImageTextToText, auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING),
    ]


def auto_class(config) -> type:
    """The Auto class that builds the model of `config`: AutoModelForCausalLM where it can (its error names a type
    none of them knows), else AutoModelForImageTextToText (Mistral 3, LLaVA: a language model and a vision tower)."""
    classes = _auto_classes()
    return next((auto for auto, mapping in classes if type(config) in mapping), classes[0][0])


def bridge_config_class(base: type) -> type:
    """The subclass of config class `base` that saves as the "bridgelm" model type, registered with the Auto class
    that builds a model of `base` (`auto_class`) so that `from_pretrained`/`from_config` build the blocks."""
    if issubclass(base, _BridgeConfig):
        return base
    if base not in _CONFIG_CLASSES:
        cls = type(f"Bridge{base.__name__}", (_BridgeConfig, base), {"__module__": __name__})
        _CONFIG_CLASSES[base] = cls
        auto, mapping = next(((a, m) for a, m in _auto_classes() if base in m), (None, None))
        if auto is not None:
            auto.register(cls, _bridge_model_class(mapping[base], cls))
    return _CONFIG_CLASSES[base]


def _recorded(config) -> BlockConfig:
    recorded = getattr(config, "bridgelm", None)
    if not isinstance(recorded, dict) or recorded.get("format") != FORMAT:
        raise UserError(
            f"config.json of model type {MODEL_TYPE!r} records blocks {recorded!r}: expected a 'bridgelm' entry of "
            f"format {FORMAT!r} (kind, num_heads, head_dim, placement), as bridgelm writes it"
        )
    try:
        return BlockConfig(**{k: v for k, v in recorded.items() if k in BlockConfig.__dataclass_fields__})
    except (TypeError, ValueError) as err:
        raise UserError(f"config.json records blocks {recorded!r} that bridgelm cannot build: {err}") from err


def _bridge_model_class(base: type, config_class: type) -> type:
    """A subclass of causal LM class `base` whose instances are built with the blocks their config records, so that
    `from_pretrained` loads the block tensors with the rest (and reports them missing like any other weight)."""

    def __init__(self, config, *args, **kwargs):
        base.__init__(self, config, *args, **kwargs)
        attach_blocks(self, _recorded(config))

    def initialize_weights(self):
        _zero_fresh_outputs(self)
        base.initialize_weights(self)

    body = {"__init__": __init__, "initialize_weights": initialize_weights, "config_class": config_class,
            "__module__": __name__}
    cls = type(ARCH_PREFIX + base.__name__, (base,), body)
    _rename_as(cls, base)
    return cls


@torch.no_grad()
def _zero_fresh_outputs(model: nn.Module) -> None:
    """Zero the output projection of every block that nothing loaded (`from_pretrained` of weights that lack them), so
    that such a block starts fresh and changes nothing, where transformers' own init would draw it at random."""
    cfg = block_config(model)
    if cfg is None:  # the base's own post_init, before the blocks are attached
        return
    for layer in decoder_layers(model):
        weight = getattr(getattr(layer, cfg.kind), OUTPUT[cfg.kind]).weight
        if not weight.is_meta and not getattr(weight, "_is_hf_initialized", False):
            weight.zero_()
            weight._is_hf_initialized = True


def _rename_as(cls: type, base: type) -> None:
    """Give class `cls` the renaming of tensors that transformers applies to `base` (found by the class's name, or
    its model type), so that a folder written under a composite model's older names (LLaVA's lm_head as
    language_model.lm_head, which save_pretrained writes) loads into `cls` too."""
    from transformers import conversion_mapping as mapping

    known = mapping.get_checkpoint_conversion_mapping
    renames = known(base.__name__) or known(getattr(base.config_class, "model_type", None))
    if renames:
        mapping.register_checkpoint_conversion_mapping(cls.__name__, renames, overwrite=True)


def _base_config_class(config_dict: dict) -> type:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    base = config_dict.get("base_model_type")
    if not isinstance(base, str) or base not in CONFIG_MAPPING or base == MODEL_TYPE:
        raise UserError(
            f"config.json of model type {MODEL_TYPE!r} names base_model_type {base!r}: expected the model type of "
            "the model the blocks were added to, one this transformers knows (qwen2, llama, ...)"
        )
    return CONFIG_MAPPING[base]


def _register() -> None:
    """Register the "bridgelm" model type with AutoConfig: a config.json of that type loads as its base model type's
    config class with blocks (`bridge_config_class`), so every field keeps its meaning."""
    from transformers import AutoConfig, PretrainedConfig

    class BridgeLMConfig(PretrainedConfig):
        model_type = MODEL_TYPE

        @classmethod
        def from_dict(cls, config_dict, **kwargs):
            base = _base_config_class(config_dict)
            fields = {k: v for k, v in config_dict.items() if k not in ("model_type", "base_model_type")}
            config = bridge_config_class(base).from_dict(fields, **kwargs)
            _recorded(config[0] if isinstance(config, tuple) else config)
            return config

    AutoConfig.register(MODEL_TYPE, BridgeLMConfig, exist_ok=True)


_register()

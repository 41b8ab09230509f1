"""Which Hugging Face decoders Bridge blocks fit, read from the model and its config: the usual layout of every layer
(`decoder_layers`), no layers of another kind than attention (`other_layer_types`: hybrid linear-attention or
state-space layers), an attention output added to the stream as it is where placement "attn" hooks it
(`check_attn_placement`), and config values read safely (`config_value`, `text_config`). The engine reads it too:
its cache holds attention layers' keys and values only."""

from __future__ import annotations

from torch import nn

from bridgelm.errors import UserError

_USUAL_LAYOUT = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a Hugging Face causal LM in the usual layout, or a UserError naming its class and what
    differs: every layer attends (no linear-attention or state-space layers) and has the usual sub-modules, a norm
    before the feed-forward (not a parallel-residual layer) and one residual stream (not Gemma 3n's AltUp)."""
    name = type(model).__name__
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise UserError(
            f"unsupported architecture {name}: expected a decoder with a `layers` list "
            "(Qwen2, Qwen3, Llama, Mistral and other models in the usual layout)"
        )
    if other := other_layer_types(model):
        raise UserError(f"unsupported architecture {name}: it has {other} layers; Bridge blocks need attention layers")
    for i, layer in enumerate(layers):
        missing = [a for a in _USUAL_LAYOUT if not isinstance(getattr(layer, a, None), nn.Module)]
        if missing:
            raise UserError(
                f"unsupported architecture {name}: its layer {i} ({type(layer).__name__}) lacks {missing} (a "
                f"parallel-residual layer has no norm after attention); expected the usual layout {list(_USUAL_LAYOUT)}"
            )
        if hasattr(layer, "altup"):
            raise UserError(f"unsupported architecture {name}: its layers carry several residual streams (AltUp)")
    return layers


# The kinds of layer a config's layer_types may name that attend with a plain key/value cache, and those that name
# a layer's feed-forward (a mixture of experts or not) instead.
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
FEED_FORWARD_LAYER_TYPES = ("dense", "sparse")


def other_layer_types(model: nn.Module) -> str | None:
    """The kinds of layer of a hybrid model other than attention ones ('linear_attention', 'conv', ...), listed;
    None when every layer attends."""
    types = config_value(text_config(model), "layer_types") or ()
    other = sorted({str(t) for t in types if t not in ATTENTION_LAYER_TYPES + FEED_FORWARD_LAYER_TYPES})
    return ", ".join(repr(t) for t in other) or None


def config_value(config, key: str):
    """`config.key` (None: the config has no such key). A heterogeneous config (one with per-layer values, Gemma 4's
    head_dim) refuses to read a per-layer key as one value: its top-level value is read then."""
    try:
        return getattr(config, key, None)
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return vars(config).get(key)


def head_dim_of(config) -> int:
    """A config's attention head dim: its `head_dim` (the top-level one of a heterogeneous config), else
    hidden_size / heads."""
    return config_value(config, "head_dim") or config.hidden_size // config.num_attention_heads


def kv_heads_of(config) -> int:
    """A config's key/value heads (the top-level value of a heterogeneous config), else its attention heads."""
    return config_value(config, "num_key_value_heads") or config.num_attention_heads


def layer_configs(config) -> list:
    """Each decoder layer's config: a heterogeneous config's per-layer ones (Gemma 4's full-attention layers have
    another head_dim and key/value heads), else `config` for every layer."""
    if getattr(config, "is_heterogeneous", False):
        return list(config.per_layer_config)
    return [config] * config.num_hidden_layers


def text_config(model):
    """The config of the model's language part: its own, or a composite model's text config (Gemma 3, Mistral 3)."""
    return model.config.get_text_config()


# The sub-modules of a layer whose attention branch's output is added to its input as it is (the usual layout, and
# Gemma's with norms before and after the feed-forward): where placement "attn" is what it says.
_ADDS_ATTENTION_AS_IS = (*_USUAL_LAYOUT, "pre_feedforward_layernorm", "post_feedforward_layernorm")


# What a layer whose attention branch does not join the residual as it is has: a config value that scales it
# (Granite), attributes that weigh it against a residual taken after the input norm (MiniMax).
_RESIDUAL_SCALE = "residual_multiplier"
_RESIDUAL_WEIGHTS = ("attn_alpha_factor", "attn_beta_factor")


def check_attn_placement(model: nn.Module, layer: nn.Module) -> None:
    """UserError unless `layer` adds its attention branch's output to its input unchanged, which the "attn"
    placement's hook assumes: a layer that scales it (Granite's residual_multiplier), weighs it against its normed
    input (MiniMax) or normalises it (GLM-4's post_self_attn_layernorm) would take the block's update scaled or
    normalised, another architecture than App. D's, silently."""
    other = [
        name
        for name, child in layer.named_children()
        if name not in _ADDS_ATTENTION_AS_IS and not isinstance(child, nn.Dropout)  # Phi-3's: as the attention's own
    ]
    scale = config_value(text_config(model), _RESIDUAL_SCALE)
    weights = [name for name in _RESIDUAL_WEIGHTS if hasattr(layer, name)]
    if other or weights or scale not in (None, 1, 1.0):
        what = f"modules {other}" if other else f"weights {weights}" if weights else f"{_RESIDUAL_SCALE}={scale}"
        raise UserError(
            f"placement 'attn' on {type(model).__name__}: its layers have {what} beside the usual layout, so the "
            "block's update would not join the residual stream as it is; use placement 'ffn' (the paper's default)"
        )

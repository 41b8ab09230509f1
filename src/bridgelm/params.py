"""Parameter counts by part (the paper's Appendix B table), from shapes only.

Models are built on the meta device: no weights are allocated or downloaded (`--model` reads only config.json).

    bridgelm params --preset ds-qwen-7b
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bridgelm.attach import add_bridge, add_pmatch, added_parameters, auto_class, block_config
from bridgelm.layout import decoder_layers
from bridgelm.errors import UserError
from bridgelm.models import load_config

# Config numbers of the paper's three models (DeepSeek-R1-Distill-*), as published in their config.json.
PRESETS: dict[str, tuple[str, dict]] = {
    "ds-qwen-1.5b": (
        "qwen2",
        dict(
            vocab_size=151936,
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            max_position_embeddings=131072,
            tie_word_embeddings=False,
            rms_norm_eps=1e-6,
        ),
    ),
    "ds-qwen-7b": (
        "qwen2",
        dict(
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            max_position_embeddings=131072,
            tie_word_embeddings=False,
            rms_norm_eps=1e-6,
        ),
    ),
    "ds-llama-8b": (
        "llama",
        dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=131072,
            tie_word_embeddings=False,
            rms_norm_eps=1e-5,
        ),
    ),
}


@dataclass
class ParamCounts:
    """Parameter counts of one model, by part."""

    name: str  # preset or model path
    embed_head: int  # input embedding and output head (counted once when tied)
    attn: int  # attention blocks (projections and their biases)
    ffn: int  # feed-forward blocks
    other: int  # norms and anything else of the original model
    added: int  # the added Bridge / P-Match blocks
    kind: str = "bridge"  # which (a model's own blocks, or those added)

    @property
    def original(self) -> int:
        return self.embed_head + self.attn + self.ffn + self.other

    @property
    def new_total(self) -> int:
        return self.original + self.added


def meta_model(preset: str | None = None, model_dir: str | None = None, config=None):
    """A model with the preset's, the directory's or the given transformers `config`, on the meta device (no
    weights): what `bridgelm plan` reads a model's shapes from."""
    from transformers import LlamaConfig, Qwen2Config

    if config is not None:
        preset = model_dir = None  # the config given is the model's
    if preset is not None:
        if preset not in PRESETS:
            raise UserError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
        family, numbers = PRESETS[preset]
        config = (Qwen2Config if family == "qwen2" else LlamaConfig)(**numbers)
    elif model_dir is not None:
        config = load_config(model_dir)
    elif config is None:
        raise UserError("give a preset, a model directory or a config")
    with torch.device("meta"):
        return auto_class(config).from_config(config)


def count(model, name: str, kind: str = "bridge", num_heads: int = 4) -> ParamCounts:
    """Count `model`'s parameters by part, then add `kind` blocks (on its device) and count those; a model that has
    blocks (a trained run's) is counted with its own, named in the row."""
    seen: set[int] = set()
    own = block_config(model)
    if own is None:
        (add_bridge if kind == "bridge" else add_pmatch)(model, num_heads=num_heads)
    else:
        name, kind = f"{name} (its own {own.kind} blocks, {own.num_heads} heads)", own.kind

    def total(params) -> int:
        n = 0
        for p in params:
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
        return n

    added = total(added_parameters(model).values())  # first: the parts below leave them out
    embed_head = total(model.get_input_embeddings().parameters())
    head = model.get_output_embeddings()
    if head is not None:
        embed_head += total(head.parameters())
    layers = decoder_layers(model)
    attn = total(p for layer in layers for p in layer.self_attn.parameters())
    ffn = total(p for layer in layers for p in layer.mlp.parameters())
    other = total(model.parameters())
    return ParamCounts(name, embed_head, attn, ffn, other, added, kind)


# Units of the table, largest first: the first in which the smallest model's total reads at least 0.1.
UNITS = ((1e9, "billions"), (1e6, "millions"), (1e3, "thousands"))


def table(rows: list[ParamCounts]) -> str:
    """The Appendix B table as markdown, in billions like the paper's (millions or thousands for small models); the
    blocks' column is named after the rows' kind (Bridge, P-Match; Blocks where they differ)."""
    kinds = {r.kind for r in rows}
    label = {"bridge": "Bridge", "pmatch": "P-Match"}[kinds.pop()] if len(kinds) == 1 else "Blocks"
    smallest = min((r.original for r in rows), default=1e9)
    scale, unit = next(((v, n) for v, n in UNITS if smallest >= 0.1 * v), UNITS[-1])
    head = f"| Model (parameters in {unit}) | Embed & Head | Attn | FF | {label} | Orig. Total | New Total | Added % |"
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        cells = [r.embed_head, r.attn, r.ffn, r.added, r.original, r.new_total]
        pct = 100.0 * r.added / r.original
        lines.append(f"| {r.name} | " + " | ".join(f"{c / scale:.2f}" for c in cells) + f" | {pct:.1f}% |")
    return "\n".join(lines)

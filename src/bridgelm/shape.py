"""What the memory plan (bridgelm.plan) needs of a model: its sizes read from a (meta-device) model and its config,
the added blocks included; each layer's own cache width where layers differ (Gemma 4)."""

from __future__ import annotations

from dataclasses import dataclass

from bridgelm.attach import added_parameters, block_config
from bridgelm.layout import decoder_layers, head_dim_of, kv_heads_of, layer_configs


@dataclass
class Shape:
    """What the arithmetic needs of a model."""

    params: int  # P: every parameter (added blocks included), tied ones once
    blocks: int  # of which the added Bridge / P-Match blocks'
    layers: int  # n, decoder layers
    hidden: int  # h
    intermediate: int  # i, the feed-forward's inner size
    kv_heads: int  # key/value heads
    head_dim: int  # per head
    vocab: int  # V
    block_kind: str | None = None  # the added blocks' kind ("bridge", "pmatch"), None without
    block_inner: int = 0  # D, their inner width: heads x head_dim (a Bridge block's attention, half P-Match's MLP)
    layer_params: int = 0  # one decoder layer's, its block included (FSDP's unit)
    cache_width: int = 0  # key and value elements a token keeps in the cache, all layers (0: n x 2 x kv_heads x Dh)

    def __post_init__(self):
        if not self.cache_width:
            self.cache_width = self.layers * 2 * self.kv_heads * self.head_dim

    @property
    def root_params(self) -> int:
        """What no decoder layer holds (embeddings, head, final norm): FSDP's root unit."""
        return self.params - self.layers * self.layer_params


def shape_of(model) -> Shape:
    """The Shape of a (meta-device) model."""
    c = model.config.get_text_config()  # a composite model's (Gemma 3, Mistral 3) language part
    unique = {id(p): p.numel() for p in model.parameters()}
    blocks = sum(p.numel() for p in added_parameters(model).values())
    added = block_config(model)
    kind, inner = (None, 0) if added is None else (added.kind, added.num_heads * added.head_dim)
    layer = sum({id(p): p.numel() for p in decoder_layers(model)[0].parameters()}.values())
    return Shape(sum(unique.values()), blocks, c.num_hidden_layers, c.hidden_size, c.intermediate_size, kv_heads_of(c),
                 head_dim_of(c), c.vocab_size, kind, inner, layer, _cache_width(c))  # fmt: skip


def _cache_width(c) -> int:
    """Key and value elements a token keeps in the cache: each layer's own heads and head dim (Gemma 4's differ by
    layer), none for a layer that reads an earlier layer's (Gemma 4's num_kv_shared_layers)."""
    owners = layer_configs(c)[: c.num_hidden_layers - (getattr(c, "num_kv_shared_layers", 0) or 0)]
    return sum(2 * kv_heads_of(lc) * head_dim_of(lc) for lc in owners)

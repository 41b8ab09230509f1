"""The Bridge block and its parameter-matched baseline, P-Match.

Bridge (paper Sec. 3.1, Algorithm 1): at every position s, the rows of a group attend to each other along
the BATCH axis. Input RMSNorm (the host model's class and eps), Q/K/V projections D -> H*Dh and an output
projection H*Dh -> D, no biases, no positional encoding, no KV cache. The output projection starts at zero,
so a freshly added block changes nothing. Row b attends to the rows of its group that are valid at s, and
always to itself, so that rows past their end (whose outputs nobody reads) stay finite.

P-Match: a 2-layer MLP D -> 2*H*Dh -> D with SiLU and its own input norm, zero-initialised output; it has
exactly the same parameter count as Bridge (D + 4*D*H*Dh) and ignores the batch axis.

Both return the residual update; the caller adds it to the residual stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from bridgelm.errors import check_choice, check_int
from bridgelm.setting import setting

if TYPE_CHECKING:  # the layout object is built one level up, in grouped.py
    from bridgelm.grouped import Groups

KINDS = ("bridge", "pmatch")
OUTPUT = {"bridge": "o_proj", "pmatch": "down_proj"}  # each kind's output projection: zero in a fresh block
PLACEMENTS = ("ffn", "attn")


@dataclass(frozen=True)
class BlockConfig:
    """Settings of the blocks added to a model (saved next to their weights)."""

    kind: str = setting(help='"bridge" or "pmatch"')
    num_heads: int = setting(4, "H, attention heads of a Bridge block (P-Match uses 2*H*Dh hidden units)")
    head_dim: int = setting(0, "Dh; 0 until resolved to the host model's head dimension")
    placement: str = setting("ffn", '"ffn": after each feed-forward block (paper default); "attn": after attention')

    def __post_init__(self):
        check_choice("kind", self.kind, KINDS)
        check_choice("placement", self.placement, PLACEMENTS)
        check_int("num_heads", self.num_heads)
        check_int("head_dim", self.head_dim, 0, note=" (0: the model's own)")


class BridgeBlock(nn.Module):
    """Attention across the rows of a group at each position. forward: x [B, S, D] -> update [B, S, D]."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, norm: nn.Module):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        inner = num_heads * head_dim
        self.norm = norm
        self.qkv_proj = nn.Linear(hidden_size, 3 * inner, bias=False)  # W_Q, W_K, W_V stacked: one matmul
        self.o_proj = nn.Linear(inner, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, groups: Groups | None = None) -> torch.Tensor:
        h = self.norm(x)  # [B, S, D]
        H, Dh = self.num_heads, self.head_dim
        if groups is None or (groups.contiguous and groups.width == 1):
            # Each row alone in its group: softmax over one key is 1, the block is W_O W_V h: W_V's rows alone of a
            # plain Linear, the whole module's output where it is wrapped (peft's LoRA adds to every row)
            if type(self.qkv_proj) is nn.Linear:
                return self.o_proj(F.linear(h, self.qkv_proj.weight[2 * H * Dh :]))
            return self.o_proj(self.qkv_proj(h)[..., 2 * H * Dh :])
        B, S, _ = h.shape
        assert groups.batch_size == B, f"bridge_groups describes {groups.batch_size} rows but the batch has {B}"
        qkv = self.qkv_proj(h)  # [B, S, 3*H*Dh]
        if S == 1 and groups.contiguous:
            return self.o_proj(_one_position(qkv, groups, H, Dh))
        valid = groups.valid  # [B, S'] with S' >= S: the current inputs are its last S positions
        if valid is not None:
            valid = valid[:, -S:]
        if groups.contiguous:
            w = groups.width
            G = B // w
            slots = qkv.view(G, w, S, 3, H, Dh)  # rows of a group are consecutive
            key_ok = None if valid is None else valid.view(G, w, S).transpose(1, 2)  # [G, S, w]
        else:
            idx, w = groups.index, groups.width
            G = idx.shape[0]
            slots = qkv[idx].view(G, w, S, 3, H, Dh)  # gather rows into [G, w_max] slots
            used = groups.slot_used[:, None, :].expand(G, S, w)  # [G, S, w]
            key_ok = used if valid is None else used & valid[idx].transpose(1, 2)
        q, k, v = slots.permute(3, 0, 2, 4, 1, 5)  # each [G, S, H, w, Dh]: attention runs over w
        mask = None
        if key_ok is not None:  # keys: valid rows of the group, and always the row itself
            eye = torch.eye(w, dtype=torch.bool, device=h.device)
            mask = (key_ok[:, :, None, :] | eye)[:, :, None]  # [G, S, 1, w(query), w(key)]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [G, S, H, w, Dh]
        out = out.permute(0, 3, 1, 2, 4)  # [G, w, S, H, Dh]
        if groups.contiguous:
            out = out.reshape(B, S, H * Dh)
        else:
            out = out.reshape(G * w, S, H * Dh)[groups.slot_of_row]
        return self.o_proj(out)


def _one_position(qkv: torch.Tensor, groups: Groups, H: int, Dh: int) -> torch.Tensor:
    """Algorithm 1 at one position (a decode step), contiguous groups: qkv [B, 1, 3*H*Dh] -> [B, 1, H*Dh]. The same
    attention as the general path, as one 4-D sdpa call (its fused kernel; sdpa runs the general path's 5-D call
    unfused), with the mask made once per step (`Groups.last_position_keys`), not once per layer."""
    B, w = groups.batch_size, groups.width
    q, k, v = qkv.view(B // w, w, 3, H, Dh).permute(2, 0, 3, 1, 4)  # each [G, H, w, Dh]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=groups.last_position_keys(q.dtype))  # [G, H, w, Dh]
    return out.transpose(1, 2).reshape(B, 1, H * Dh)


class PMatchBlock(nn.Module):
    """Parameter-matched MLP baseline. forward: x [B, S, D] -> update [B, S, D]; ignores groups."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, norm: nn.Module):
        super().__init__()
        inner = 2 * num_heads * head_dim
        self.norm = norm
        self.up_proj = nn.Linear(hidden_size, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, groups: Groups | None = None) -> torch.Tensor:
        return self.down_proj(F.silu(self.up_proj(self.norm(x))))


def make_block(cfg: BlockConfig, hidden_size: int, norm: nn.Module, init_std: float) -> nn.Module:
    """A block of `cfg.kind` with its input `norm`; inputs drawn N(0, init_std), output projection zero."""
    cls = BridgeBlock if cfg.kind == "bridge" else PMatchBlock
    block = cls(hidden_size, cfg.num_heads, cfg.head_dim, norm)
    out_name = OUTPUT[cfg.kind]
    for name, module in block.named_children():
        if isinstance(module, nn.Linear) and module.weight.device.type != "meta":
            with torch.no_grad():
                if name == out_name:
                    module.weight.zero_()
                else:
                    module.weight.normal_(0.0, init_std)
    return block

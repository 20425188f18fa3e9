"""Zamba2's shared transformer blocks: one block's weights used at several depths, per-use adapters.

A use reads [h | token embeddings] (B, T, 2 * d_model) and returns what Zamba2 adds to the next
Mamba-2 layer's input: out_proj_use(MLP(norm(attention(norm([h | e]))))). Each use has its own
KV cache (an attention sublayer's), so the cache, verify and replay paths are the attention
layer's, with the use's adapters added to q, k and v.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..ops.gemv.naive import ACTIVATIONS
from .attention import Attention
from .config import ModelConfig


def _adapter(d_in: int, rank: int, d_out: int) -> nn.Sequential:
    # transformers' layout: Sequential(down, up), tensors named 0.weight and 1.weight
    return nn.Sequential(nn.Linear(d_in, rank, bias=False), nn.Linear(rank, d_out, bias=False))


class SharedBlock(nn.Module):
    """The weights every use of one block shares (held once, by LanguageModel.shared_blocks)."""

    def __init__(self, cfg: ModelConfig, norm_cls):
        super().__init__()
        sb, d = cfg.shared_blocks, cfg.d_model
        if sb.activation not in ACTIVATIONS:
            raise ValueError(f"unsupported shared-block activation {sb.activation!r}; one of {sorted(ACTIVATIONS)}")
        self.input_norm = norm_cls(2 * d, cfg.norm_eps)
        self.attention = Attention(d, cfg.attention, d_in=2 * d)
        self.ff_norm = norm_cls(d, cfg.norm_eps)
        self.gate_up_proj = nn.Linear(d, 2 * sb.d_intermediate, bias=False)  # [gate | up] rows
        self.down_proj = nn.Linear(sb.d_intermediate, d, bias=False)
        self.act = ACTIVATIONS[sb.activation]


class SharedBlockUse(nn.Module):
    """One use of a shared block: its adapters and output projection, with the attention
    sublayer's interface (forward / step / verify / replay / new_cache) over [h | e]."""

    def __init__(self, block: SharedBlock, cfg: ModelConfig):
        super().__init__()
        # Not a submodule: the block's weights are saved and moved once, as LanguageModel.shared_blocks.
        object.__setattr__(self, "block", block)
        sb, d = cfg.shared_blocks, cfg.d_model
        a = cfg.attention
        r = sb.adapter_rank
        if r and sb.attention_adapters:
            self.q_adapter = _adapter(2 * d, r, a.n_heads * a.head_dim)
            self.k_adapter = _adapter(2 * d, r, a.n_kv_heads * a.head_dim)
            self.v_adapter = _adapter(2 * d, r, a.n_kv_heads * a.head_dim)
        if r:
            self.gate_up_adapter = _adapter(d, r, 2 * sb.d_intermediate)
        self.out_proj = nn.Linear(d, d, bias=False)

    @property
    def _adapters(self):
        return (self.q_adapter, self.k_adapter, self.v_adapter) if hasattr(self, "q_adapter") else None

    def _after_attention(self, a: torch.Tensor) -> torch.Tensor:
        """(B, T, d_model) attention output -> what the next Mamba-2 layer's input gets added."""
        b = self.block
        x = b.ff_norm(a)
        gate_up = b.gate_up_proj(x)
        if hasattr(self, "gate_up_adapter"):
            gate_up = gate_up + self.gate_up_adapter(x)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.out_proj(b.down_proj(b.act(gate) * up))

    def new_cache(self, batch: int, max_len: int, device, dtype):
        return self.block.attention.new_cache(batch, max_len, device, dtype)

    def forward(self, he: torch.Tensor, cache=None, seqlen=None) -> torch.Tensor:
        """he: (B, T, 2 * d_model) [h | e]; cache / seqlen as Attention.forward. -> (B, T, d_model)."""
        a = self.block.attention(self.block.input_norm(he), cache, seqlen, adapters=self._adapters)
        return self._after_attention(a)

    def step(self, he: torch.Tensor, cache, seqlen) -> torch.Tensor:
        return self.forward(he, cache, seqlen)

    def verify(self, he: torch.Tensor, cache, seqlen, depth, tree_mask):
        """Every node of a packed tree under the tree mask; writes nothing (Attention.verify)."""
        a, acts = self.block.attention.verify(self.block.input_norm(he), cache, seqlen, depth, tree_mask,
                                              adapters=self._adapters)
        return self._after_attention(a), acts

    def replay(self, cache, acts, seqlen, path, path_len) -> None:
        self.block.attention.replay(cache, acts, seqlen, path, path_len)

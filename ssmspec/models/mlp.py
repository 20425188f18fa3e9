"""Feed-forward sublayer: gated (SwiGLU-style) or plain (e.g. NemotronH's squared ReLU)."""
from __future__ import annotations

import torch
import torch.nn as nn

from ..ops.gemv.naive import ACTIVATIONS
from .config import MLPConfig


class MLP(nn.Module):
    def __init__(self, d_model: int, cfg: MLPConfig):
        super().__init__()
        if cfg.activation not in ACTIVATIONS:
            raise ValueError(f"unsupported MLP activation {cfg.activation!r}; one of {sorted(ACTIVATIONS)}")
        self.cfg = cfg
        self.act = ACTIVATIONS[cfg.activation]
        if cfg.gated:
            self.gate_proj = nn.Linear(d_model, cfg.d_intermediate, bias=cfg.bias)
        self.up_proj = nn.Linear(d_model, cfg.d_intermediate, bias=cfg.bias)
        self.down_proj = nn.Linear(cfg.d_intermediate, d_model, bias=cfg.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.cfg.gated:
            return self.down_proj(self.act(self.gate_proj(h)) * self.up_proj(h))
        return self.down_proj(self.act(self.up_proj(h)))

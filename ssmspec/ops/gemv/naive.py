"""Plain-torch reference of the one-row linear layer."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K), weight (N, K), bias (N,) or None -> (..., N), as nn.Linear."""
    return F.linear(x, weight, bias)

"""Plain-torch reference of the embedding lookup with its rows' sums of squares."""
from __future__ import annotations

import torch


def naive_embed(weight: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of `weight` for `tokens`, and each row's sum of squares for the RMSNorm after it.

    Args:
        weight: (V, D) embedding table.
        tokens: (...) int token ids.
    Returns:
        h (..., D) in weight's dtype, exactly weight[tokens]; and sq (rows, 1, parts) fp32
        partial sums of squares of h (one group, any number of parts: their sum is what counts),
        in the form ops/gemv `norm_linear` takes as x_sq. Here parts = 1.
    """
    h = weight[tokens]
    sq = h.float().pow(2).sum(-1).reshape(-1, 1, 1)
    return h, sq

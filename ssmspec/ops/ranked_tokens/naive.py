"""Plain-torch reference of `ranked_tokens` (the spec of the kernel in triton.py)."""
from __future__ import annotations

import torch


def naive_ranked_tokens(logits: torch.Tensor, rows: torch.Tensor, ranks: torch.Tensor,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """out[i] = the token of rank ranks[i] in logits[rows[i]]: 0 is the argmax, 1 the runner-up...

    Tokens are ranked by value, largest first, equal values by the lower vocabulary index first
    (so rank 0 is torch.argmax's choice). This is how a drafter picks each tree node's token:
    node i is child number ranks[i] of the node whose logits are row rows[i].

    Args:
        logits: (R, V) fp32, bf16 or fp16, NaN-free.
        rows: (W,) int64 row of each output, ranks: (W,) int64 rank of each output, < V.
        out: an optional (W,) int64 tensor to write into (returned).
    Returns:
        (W,) int64 token ids.
    """
    k = int(ranks.max()) + 1 if ranks.numel() else 1
    # A stable descending sort keeps equal values in index order: the lower index ranks first.
    order = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :k]
    picked = order[rows, ranks]
    if out is None:
        return picked
    out.copy_(picked)
    return out


def naive_race_tokens(probs: torch.Tensor, rows: torch.Tensor, noise: torch.Tensor,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """out[i] = argmax_v probs[rows[i], v] / noise[i, v] (the first index among equals).

    With noise i.i.d. Exp(1) this is a draw from row rows[i] (decoding/sampling.race_scores): how
    a drafter samples its children i.i.d. from their parent's distribution on the device.

    Args:
        probs: (R, V) fp32 distributions. rows: (W,) int64. noise: (W, V) fp32, positive.
        out: an optional (W,) int64 tensor to write into (returned).
    """
    picked = (probs.float()[rows] / noise).argmax(-1)
    if out is None:
        return picked
    out.copy_(picked)
    return out

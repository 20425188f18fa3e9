"""Plain-torch reference of the path-aware causal conv1d over a packed tree."""
from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from ..causal_conv.naive import with_conv_history


def conv_window_indices(parents: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """Where each node's conv window reads from, in the sequence [conv_state (K-1), tree (N)].

    Entry k of a row is the input k - (K-1) steps back along the node's path: the node itself
    at k = K-1, its parent at K-2, and so on; once the path passes the root it continues into
    the cached prefix inputs (conv_state slot K-2 is the most recent prefix token).

    Args:
        parents: (N,) int, -1 for the root.
    Returns:
        (N, K) int64 indices into the extended sequence of length K-1+N.
    """
    # The cache holds plain tuples: a cached tensor made under torch.inference_mode would be an
    # inference tensor, which autograd then refuses as an index.
    rows = _conv_window_indices(tuple(parents.tolist()), kernel_size)
    return torch.tensor(rows, dtype=torch.long).reshape(-1, kernel_size).to(parents.device)


@lru_cache(maxsize=256)
def _conv_window_indices(parents: tuple[int, ...], kernel_size: int) -> tuple[tuple[int, ...], ...]:
    history = kernel_size - 1
    rows = []
    for i in range(len(parents)):
        window = []
        node, prefix_back = i, 0
        for _ in range(kernel_size):
            if node >= 0:
                window.append(history + node)
                node = int(parents[node])
            else:
                prefix_back += 1
                window.append(history - prefix_back)
        rows.append(tuple(window[::-1]))
    return tuple(rows)


def naive_tree_conv(
    xBC: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    parents: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Depthwise causal conv where each node convolves over its own path, then the activation.

    Args:
        xBC: (B, N, C) pre-conv inputs of the tree nodes.
        conv_state: (B, C, K-1) the prefix's last K-1 pre-conv inputs, oldest first.
        weight: (C, K) depthwise kernel (weight[:, -1] multiplies the current token).
        bias: (C,) or None.
        parents: (N,) int, -1 for the root.
    Returns:
        (B, N, C) in xBC's dtype.
    """
    kernel_size = weight.shape[-1]
    idx = conv_window_indices(parents.cpu(), kernel_size).to(xBC.device)  # (N, K)
    extended = with_conv_history(xBC, conv_state, kernel_size)  # (B, K-1+N, C)
    windows = extended[:, idx]  # (B, N, K, C)
    out = torch.einsum("bnkc,ck->bnc", windows.float(), weight.float())
    if bias is not None:
        out = out + bias.float()
    if activation == "silu":
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"unsupported conv activation {activation!r}")
    return out.to(xBC.dtype)

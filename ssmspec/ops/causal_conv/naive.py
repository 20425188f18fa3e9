"""Plain-torch reference of the causal depthwise conv1d + SiLU over a whole sequence."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def with_conv_history(xBC: torch.Tensor, conv_state: torch.Tensor | None, K: int) -> torch.Tensor:
    """(B, K-1+T, C): the K-1 inputs before xBC (B, T, C), from conv_state (B, C, K-1, oldest first,
    rounded to xBC's dtype) or zeros when None, then xBC."""
    if conv_state is None:
        return F.pad(xBC, (0, 0, K - 1, 0))
    return torch.cat([conv_state.transpose(1, 2).to(xBC.dtype), xBC], dim=1)


def naive_causal_conv(
    xBC: torch.Tensor, conv_state: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """silu(causal depthwise conv1d of xBC), in fp32, rounded once to xBC's dtype.

    Args:
        xBC: (B, T, C) pre-conv inputs.
        conv_state: (B, C, K-1) the K-1 inputs before xBC's first (oldest first), rounded to xBC's
            dtype first; None: zeros (a sequence that starts here).
        weight: (C, K) depthwise taps (weight[:, -1] multiplies the current token); bias: (C,) or None.
    Returns:
        (B, T, C) in xBC's dtype.
    """
    T, K = xBC.shape[1], weight.shape[-1]
    extended = with_conv_history(xBC, conv_state, K)
    out = sum(extended[:, k : k + T].float() * weight[:, k].float() for k in range(K))
    if bias is not None:
        out = out + bias.float()
    return F.silu(out).to(xBC.dtype)


def naive_causal_conv_train(xBC: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The training form (zeros before t = 0, differentiable through torch's autograd)."""
    return naive_causal_conv(xBC, None, weight, bias)

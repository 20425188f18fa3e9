"""Plain-torch references of the decode projections: the linear layer, and the linear layer
with an RMSNorm (weight folded into the projection) before it and a residual add after it."""
from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "relu": F.relu,
    "relu2": lambda x: torch.square(F.relu(x)),
}
"""Activations by name (the MLP's); `norm_linear` can apply one to its output."""


def naive_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K), weight (N, K), bias (N,) or None -> (..., N), as nn.Linear."""
    return F.linear(x, weight, bias)


def naive_norm_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, norm_groups: int = 1,
                      eps: float = 1e-5, residual: torch.Tensor | None = None, x_sq: torch.Tensor | None = None,
                      return_sq: bool = False, reuse_residual: bool = False, activation: str | None = None):
    """[residual +] linear(RMSNorm(x), weight, bias), the norm without a weight of its own.

    A pre-norm sublayer's RMSNorm weight (and the Mamba mixer's gated-norm weight) can be folded
    into the projection that follows it (W diag(w)); what remains is this. The norm is taken in
    fp32 over `norm_groups` contiguous groups of K and rounded to x's dtype, as
    `ssmspec.models.lm.RMSNorm` does; the output is added to `residual` in its dtype, as the
    residual stream's `h + out` is. norm_groups 0: no norm.

    x_sq is what a kernel producer may hand over: x's partial sums of squares, (rows,
    norm_groups, parts) fp32, summing over parts to each group's sum. It only spares a kernel
    the reduction; the result is defined by x, so the reference ignores it. return_sq: also
    return the output's sums of squares over the whole row, (rows, 1, 1) fp32, of the values as
    returned (kernels return them split in parts, or None on routes that do not produce them).
    reuse_residual: the caller gives up `residual`; a kernel may write the output into it (the
    reference does not). activation: a name of ACTIVATIONS applied to the (rounded) output, as
    the MLP applies it to its up projection; only without a residual.

    Args:
        x: (..., K); weight: (N, K); bias: (N,) or None; residual: (..., N) or None.
    Returns:
        (..., N), in residual's dtype when given; with return_sq, (that, sums of squares).
    """
    if norm_groups:
        xf = x.float().unflatten(-1, (norm_groups, -1))  # (..., groups, K / groups)
        x = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2).to(x.dtype)
    out = F.linear(x, weight, bias)
    if activation is not None:
        if residual is not None:
            raise ValueError("norm_linear: an activation applies to an output without a residual")
        out = ACTIVATIONS[activation](out)
    out = out if residual is None else residual + out.to(residual.dtype)
    if return_sq:
        return out, out.float().pow(2).sum(-1).reshape(-1, 1, 1)
    return out

"""Triton kernel of the path-aware causal depthwise conv1d over a packed tree; `naive.py` is the spec.

One program per (batch row, block of nodes, block of channels). Each node's window is found by
walking its parent chain K-1 steps in the kernel (K is tiny and a compile-time constant), so the
window indices of `conv_window_indices` are never built on the host: `parents` stays on the
device and nothing syncs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_common import gdc_launch_dependents, gdc_wait, pdl_args


CONV_TILE: tuple[int, int, int] | None = None
"""(nodes, channels, warps) per program; None: the best of an H100 sweep at the 2.7b shape:
(1, 256, 1) up to 32 nodes (16 nodes: 1.17 against 1.86 us for (2, 128, 1)), else (2, 256, 2)
(64 nodes: 1.71 against 1.93 us). An override for tuning sweeps."""


@triton.jit
def _tree_conv_kernel(
    x_ptr, state_ptr, w_ptr, bias_ptr, par_ptr, out_ptr,
    N, CH,
    sxb, sxn, sxc,
    ssb, ssc, ssk,
    swc, swk,
    sob, son, soc,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    if USE_PDL:  # ops/pdl.py: the next kernel may launch now
        gdc_launch_dependents()
    b = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_j = tl.arange(0, BLOCK_K)  # tap j reads the input j tokens back along the node's path
    mask_n = offs_n < N
    mask_c = offs_c < CH
    mask_j = offs_j < K

    # The window of every node: src[n, j] is the tree node j steps back on n's path, or -1 once
    # the walk has passed the root, where slot[n, j] is the cached prefix input it reads instead
    # (slot K-2 the most recent). The walk reads only `parents`, so it runs before the PDL wait,
    # with the taps, the bias and the cached inputs: the conv state was last written by a replay
    # or step before this verify's embedding lookup, a plain launch that waits for all earlier
    # work. After the wait, one gather of the tree inputs instead of K dependent steps.
    cur = tl.where(mask_n, offs_n, -1)
    back = tl.zeros([BLOCK_N], dtype=tl.int32)
    src = tl.full([BLOCK_N, BLOCK_K], -1, tl.int32)
    slot = tl.full([BLOCK_N, BLOCK_K], -1, tl.int32)
    for j in tl.static_range(K):
        in_tree = cur >= 0
        tap = (offs_j == j)[None, :]
        src = tl.where(tap & in_tree[:, None], cur[:, None], src)
        slot = tl.where(tap & ~in_tree[:, None], ((K - 2) - back)[:, None], slot)
        back = tl.where(in_tree, back, back + 1)
        cur = tl.where(in_tree, tl.load(par_ptr + cur, mask=in_tree, other=-1).to(tl.int32), -1)
    live = (mask_n[:, None] & mask_j[None, :])[:, :, None] & mask_c[None, None, :]
    w = tl.load(w_ptr + offs_c[None, :] * swc + (K - 1 - offs_j)[:, None] * swk,
                mask=mask_j[:, None] & mask_c[None, :], other=0.0).to(tl.float32)  # (taps, channels)
    from_state = tl.load(state_ptr + b * ssb + offs_c[None, None, :] * ssc + slot[:, :, None] * ssk,
                         mask=live & (slot >= 0)[:, :, None], other=0.0)
    # Round the cached inputs to the tree inputs' dtype first, as the reference does.
    window = from_state.to(x_ptr.dtype.element_ty).to(tl.float32)
    if USE_PDL:  # wait for the previous kernel (in_proj) before reading its output or writing
        gdc_wait()
    window += tl.load(x_ptr + b * sxb + src[:, :, None] * sxn + offs_c[None, None, :] * sxc,
                      mask=live & (src >= 0)[:, :, None], other=0.0).to(tl.float32)
    acc = tl.sum(window * w[None, :, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + b * sob + offs_n[:, None] * son + offs_c[None, :] * soc,
             acc.to(out_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_c[None, :])


def tree_conv(
    xBC: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    parents: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Depthwise causal conv where each node convolves over its own path, then the activation.

    Same contract as `naive_tree_conv`.

    Args:
        xBC: (B, N, C) pre-conv inputs of the tree nodes.
        conv_state: (B, C, K-1) the prefix's last K-1 pre-conv inputs, oldest first.
        weight: (C, K) depthwise kernel (weight[:, -1] multiplies the current token).
        bias: (C,) or None.
        parents: (N,) int, -1 for the root.
    Returns:
        (B, N, C) in xBC's dtype.
    """
    if activation not in ("silu", None):
        raise ValueError(f"unsupported conv activation {activation!r}")
    batch, n, channels = xBC.shape
    kernel_size = weight.shape[-1]
    if tuple(weight.shape) != (channels, kernel_size) or tuple(conv_state.shape) != (batch, channels, kernel_size - 1):
        raise ValueError(
            f"tree_conv: weight {tuple(weight.shape)} / conv_state {tuple(conv_state.shape)} do not match "
            f"xBC {tuple(xBC.shape)} (expected ({channels}, K) and ({batch}, {channels}, K-1))"
        )
    if tuple(parents.shape) != (n,):
        raise ValueError(f"tree_conv: parents has shape {tuple(parents.shape)}, expected ({n},)")
    out = torch.empty_like(xBC, memory_format=torch.contiguous_format)
    if out.numel() == 0:
        return out
    # Small tiles, many programs: a 16-node tree at C = 5376 is only ~86k outputs, so big tiles
    # would leave most SMs idle (measured on an H100: 16 x 256 tiles, 21 programs, 10 us against 3.7 us with small ones).
    block_n, block_c, warps = CONV_TILE or ((1, 256, 1) if n <= 32 else (2, 256, 2))
    grid = (batch, triton.cdiv(n, block_n), triton.cdiv(channels, block_c))
    _tree_conv_kernel[grid](
        xBC, conv_state, weight, bias if bias is not None else weight, parents, out,
        n, channels,
        *xBC.stride(), *conv_state.stride(), *weight.stride(), *out.stride(),
        K=kernel_size, HAS_BIAS=bias is not None, SILU=activation == "silu",
        BLOCK_N=block_n, BLOCK_C=block_c, BLOCK_K=triton.next_power_of_2(kernel_size), num_warps=warps, **pdl_args(out.device),
    )
    return out

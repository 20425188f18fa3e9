"""A fused SSD scan as a pair of torch custom ops, so torch.compile keeps a Mamba-2 model in one graph.

A scan wrapped in `torch.compiler.disable` is a graph break in every layer, and Dynamo splits the
calling frames there too (a two-layer model compiled to five graphs), with the norms, residual
adds and the gradients crossing graph boundaries as separate eager launches. As a custom
op the scan is one opaque node that Inductor calls, and the model is one graph. sft at the
mamba2-130m shape, 16 x 512, H200, 2026-11-28, 200 steps: 233,785 and 232,673 tokens/s against
226,533 and 227,461 through the disabled call (alternating runs, one machine).

The ops take the conv's output whole, xBC = [x | B | C] (batch, T, heads * head_dim + 2 * groups * d_state),
and give its gradient whole: the backward writes dx, dB and dC into one tensor, where three
gradients of the views x, B, C would be assembled by a copy of every row.

`scan_ops(namespace, forward, backward, saved)` registers, once per namespace:
- `namespace::ssd_fwd(xBC, dt, A, D, chunk_size, head_dim, groups) -> (y, final_state, kept)` and
- `namespace::ssd_bwd(dy, dfinal, xBC, dt, A, D, kept, chunk_size, head_dim, groups) -> (dxBC, ddt, dA, dD)`,
with shape functions for compilation and the backward registered as the forward's gradient.
forward and backward are the kernel's own entry points on the views:
`forward(x, dt, A, B, C, D, chunk_size) -> (y, final, *kept)` and
`backward(dy, dfinal, x, dt, A, B, C, D, kept, chunk_size, out) -> (ddt, dA, dD)`, which writes dx, dB and
dC into the views `out = (dx, dB, dC)` of one tensor (dfinal may be None). y is in x's dtype, the final
state (batch, heads, head_dim, d_state) in fp32, each gradient in its input's dtype and shape. kept: what
the forward computed that the backward would otherwise compute again (a list of tensors, saved for the
backward, no gradient); `saved(x, dt, A, B, C, D, chunk_size)` gives their (shape, dtype) for
compilation, and a scan without any leaves it out. Outputs are made contiguous, the layout the shape
functions promise.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from ssmspec.models.mamba2 import split_conv_output

_REGISTERED: dict[str, Callable] = {}


def scan_ops(namespace: str, forward: Callable, backward: Callable, saved: Optional[Callable] = None) -> Callable:
    """The scan `(x, dt, A, B, C, D, chunk_size) -> (y, final fp32)` through `namespace`'s custom ops,
    registered on the first call; later calls return that scan, whatever they pass (torch keeps one
    op per name). Its attribute `packed(xBC, dt, A, D, chunk_size, head_dim, groups)` is the same scan
    on the conv's output whole (no copy in; the gradient whole); the scan itself joins x, B and C first."""
    if namespace in _REGISTERED:
        return _REGISTERED[namespace]

    @torch.library.custom_op(f"{namespace}::ssd_fwd", mutates_args=())
    def ssd_fwd(xBC: Tensor, dt: Tensor, A: Tensor, D: Tensor, chunk_size: int, head_dim: int,
                groups: int) -> tuple[Tensor, Tensor, list[Tensor]]:
        x, B, C = split_conv_output(xBC, dt.shape[-1], head_dim, groups)
        y, final, *kept = forward(x, dt, A, B, C, D, chunk_size)
        return y.to(x.dtype).contiguous(), final.float().contiguous(), [t.contiguous() for t in kept]

    @ssd_fwd.register_fake
    def _(xBC, dt, A, D, chunk_size, head_dim, groups):
        x, B, C = split_conv_output(xBC, dt.shape[-1], head_dim, groups)
        batch, _, heads, _ = x.shape
        kept = [] if saved is None else [x.new_empty(shape, dtype=dtype)
                                         for shape, dtype in saved(x, dt, A, B, C, D, chunk_size)]
        return x.new_empty(x.shape), x.new_empty((batch, heads, head_dim, B.shape[-1]), dtype=torch.float32), kept

    @torch.library.custom_op(f"{namespace}::ssd_bwd", mutates_args=())
    def ssd_bwd(dy: Tensor, dfinal: Optional[Tensor], xBC: Tensor, dt: Tensor, A: Tensor, D: Tensor,
                kept: list[Tensor], chunk_size: int, head_dim: int,
                groups: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        heads = dt.shape[-1]
        x, B, C = split_conv_output(xBC, heads, head_dim, groups)
        dxBC = torch.empty_like(xBC, memory_format=torch.contiguous_format)
        out = split_conv_output(dxBC, heads, head_dim, groups)  # the views dx, dB, dC the backward writes
        ddt, dA, dD = backward(dy, dfinal, x, dt, A, B, C, D, kept, chunk_size, out)
        return dxBC, *(g.to(t.dtype).contiguous() for g, t in zip((ddt, dA, dD), (dt, A, D)))

    @ssd_bwd.register_fake
    def _(dy, dfinal, xBC, dt, A, D, kept, chunk_size, head_dim, groups):
        return tuple(t.new_empty(t.shape) for t in (xBC, dt, A, D))

    def setup_context(ctx, inputs, output):
        xBC, dt, A, D, chunk_size, head_dim, groups = inputs
        _, _, kept = output
        ctx.save_for_backward(xBC, dt, A, D, *kept)
        ctx.mark_non_differentiable(*kept)
        ctx.sizes = chunk_size, head_dim, groups
        ctx.set_materialize_grads(False)  # an unused final state's gradient stays None, not a tensor of zeros

    def gradient(ctx, dy, dfinal, _):
        xBC, dt, A, D, *kept = ctx.saved_tensors
        chunk_size, head_dim, groups = ctx.sizes
        if dy is None:
            dy = xBC.new_zeros((*dt.shape, head_dim))  # y's shape and dtype
        return (*ssd_bwd(dy, dfinal, xBC, dt, A, D, kept, chunk_size, head_dim, groups), None, None, None)

    ssd_fwd.register_autograd(gradient, setup_context=setup_context)

    def packed(xBC, dt, A, D, chunk_size, head_dim, groups):
        y, final, _ = ssd_fwd(xBC, dt, A, D, chunk_size, head_dim, groups)
        return y, final

    def scan(x, dt, A, B, C, D, chunk_size):
        xBC = torch.cat([x.flatten(-2), B.flatten(-2), C.flatten(-2)], dim=-1)
        return packed(xBC, dt, A, D, chunk_size, x.shape[-1], B.shape[-2])

    scan.packed = packed
    _REGISTERED[namespace] = scan
    return scan

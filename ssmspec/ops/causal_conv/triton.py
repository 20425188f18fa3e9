"""Triton kernel of the causal depthwise conv1d + SiLU over whole sequences; `naive.py` is the spec.

Eager inference (the distillation target's forward, evaluation, a prefill through the model's
`forward`) otherwise runs `F.conv1d`, which wants (B, C, T): a transposed copy in, torch's
generic depthwise kernel, a transposed view out, and a SiLU launch (bf16, 32 x 512 tokens of the
mamba2-130m shape, H200: 0.598 ms a layer, against 0.087 for this kernel). Here it is one launch
that reads xBC where in_proj wrote it (channels last, any batch and token strides) and writes
silu(conv) contiguous. One program per (batch row, BLOCK_T tokens, BLOCK_C channels): K shifted
loads of x (from the cached conv state before t = 0) times the taps, plus the bias, in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = (32, 128, 4)
"""(tokens, channels, warps) per program: the best of six tried (H200, bf16, 32 x 512 x 1792 and
8 x 2048 x 5376: (16, 128, 4) 7-10% slower, (64, 128, 8) twice as slow); 256 bytes a token row."""


@triton.jit
def _causal_conv_kernel(
    x_ptr, state_ptr, w_ptr, b_ptr, out_ptr,
    T, C,
    sxb, sxt,
    ssb, ssc, ssk,
    swc, swk,
    K: tl.constexpr, HAS_STATE: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)  # batch offsets can pass 2**31 elements
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = c < C
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + c, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    for k in tl.static_range(K):
        src = t - (K - 1) + k  # the input that tap k reads for token t
        in_x = ((src >= 0) & (src < T))[:, None] & mask_c[None, :]
        xv = tl.load(x_ptr + b * sxb + src[:, None] * sxt + c[None, :], mask=in_x, other=0.0).to(tl.float32)
        if HAS_STATE:  # before t = 0: conv state slot K-1+src (slot K-2 is the most recent input)
            in_state = ((src < 0) & (t < T))[:, None] & mask_c[None, :]
            xv += tl.load(state_ptr + b * ssb + c[None, :] * ssc + (K - 1 + src)[:, None] * ssk, mask=in_state,
                          other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + c * swc + k * swk, mask=mask_c, other=0.0).to(tl.float32)
        acc += xv * wv[None, :]
    y = acc * tl.sigmoid(acc)
    tl.store(out_ptr + b * T * C + t[:, None] * C + c[None, :], y.to(out_ptr.dtype.element_ty),
             mask=(t < T)[:, None] & mask_c[None, :])


def causal_conv(xBC: torch.Tensor, conv_state: torch.Tensor | None, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """As `naive_causal_conv`: silu(causal depthwise conv1d of xBC (B, T, C)) with the K-1 inputs
    before it from conv_state (B, C, K-1) or zeros; taps weight (C, K), bias (C,) or None.
    Returns (B, T, C) contiguous in xBC's dtype. No autograd: inference only."""
    if xBC.stride(-1) != 1:
        xBC = xBC.contiguous()
    B, T, C = xBC.shape
    K = weight.shape[-1]
    out = torch.empty(B, T, C, device=xBC.device, dtype=xBC.dtype)
    if out.numel() == 0:
        return out
    state = conv_state.to(xBC.dtype) if conv_state is not None else None  # rounded as the reference does
    block_t, block_c, warps = TILE
    grid = (B, triton.cdiv(T, block_t), triton.cdiv(C, block_c))
    _causal_conv_kernel[grid](
        xBC, state if state is not None else xBC, weight, bias if bias is not None else weight, out,
        T, C,
        xBC.stride(0), xBC.stride(1),
        *(state.stride() if state is not None else (0, 0, 0)),
        weight.stride(0), weight.stride(1),
        K=K, HAS_STATE=state is not None, HAS_BIAS=bias is not None,
        BLOCK_T=block_t, BLOCK_C=block_c, num_warps=warps,
    )
    return out


# -- training: conv + SiLU with its backward, K = 4 ----------------------------------------------------

FORWARD_WINDOW = (16, 256, 4)
BACKWARD_WINDOW = (64, 256, 4)
"""(tokens, channels, warps) per program of the training kernels: each program walks its tokens in order
(the backward in reverse), keeping the K-1 inputs before (or the K-1 gradients after) in registers, so
each row of x, dy, y and dx moves once. The forward takes shorter walks (more programs in flight; it
has less to keep per token), the backward longer ones (fewer tap-gradient partials to sum). Best of 8
walks per direction on an H200 (2026-11-29, bench/train_conv_gpu.py, CUDA-graph replays,
bf16): at the mamba2-130m layer (16 x 512 x 1792 of rows of 3352) forward 0.0280 ms at 16
tokens against 0.0432 at 64, backward 0.0678 at 64 against 0.0997 at 16; at the 1.3b layer forward
0.0617 against 0.0841, backward 0.151 either way. Inductor's shifted products: 0.335 ms at 130m."""


@triton.jit
def _taps(w_ptr, b_ptr, c, mask_c, swc, swk, HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr):
    """The four taps and the bias (0 without one) of channels c, in fp32."""
    w0 = tl.load(w_ptr + c * swc, mask=mask_c, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + c * swc + swk, mask=mask_c, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + c * swc + 2 * swk, mask=mask_c, other=0.0).to(tl.float32)
    w3 = tl.load(w_ptr + c * swc + 3 * swk, mask=mask_c, other=0.0).to(tl.float32)
    bias = tl.zeros((BLOCK_C,), tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + c, mask=mask_c, other=0.0).to(tl.float32)
    return w0, w1, w2, w3, bias


@triton.jit
def _train_fwd_kernel(x_ptr, w_ptr, b_ptr, y_ptr, T, C, sxb, sxt, swc, swk,
                      HAS_BIAS: tl.constexpr, SPAN: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    t0 = tl.program_id(1) * SPAN
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = c < C
    x_row = x_ptr + b * sxb + c
    zero = tl.zeros((BLOCK_C,), tl.int32)  # token positions as vectors: masks are built from them
    w0, w1, w2, w3, bias = _taps(w_ptr, b_ptr, c, mask_c, swc, swk, HAS_BIAS, BLOCK_C)
    x1 = tl.load(x_row + (t0 - 1) * sxt, mask=mask_c & (zero + t0 >= 1), other=0.0).to(tl.float32)  # x[t-1]
    x2 = tl.load(x_row + (t0 - 2) * sxt, mask=mask_c & (zero + t0 >= 2), other=0.0).to(tl.float32)
    x3 = tl.load(x_row + (t0 - 3) * sxt, mask=mask_c & (zero + t0 >= 3), other=0.0).to(tl.float32)
    for i in range(SPAN):
        t = t0 + i
        live = mask_c & (zero + t < T)
        x0 = tl.load(x_row + t * sxt, mask=live, other=0.0).to(tl.float32)
        pre = bias + w0 * x3 + w1 * x2 + w2 * x1 + w3 * x0
        tl.store(y_ptr + b * T * C + t * C + c, (pre * tl.sigmoid(pre)).to(y_ptr.dtype.element_ty), mask=live)
        x3 = x2
        x2 = x1
        x1 = x0


@triton.jit
def _silu_grad_at(x_row, gy_row, t, T, sxt, sgt, mask_c, w0, w1, w2, w3, bias):
    """g = dy * silu'(pre) at token t, 0 outside [0, T)."""
    tv = tl.zeros_like(mask_c.to(tl.int32)) + t
    live = mask_c & (tv >= 0) & (tv < T)
    xa = tl.load(x_row + t * sxt, mask=live, other=0.0).to(tl.float32)
    xb = tl.load(x_row + (t - 1) * sxt, mask=live & (tv >= 1), other=0.0).to(tl.float32)
    xc = tl.load(x_row + (t - 2) * sxt, mask=live & (tv >= 2), other=0.0).to(tl.float32)
    xd = tl.load(x_row + (t - 3) * sxt, mask=live & (tv >= 3), other=0.0).to(tl.float32)
    pre = bias + w0 * xd + w1 * xc + w2 * xb + w3 * xa
    sig = tl.sigmoid(pre)
    gy = tl.load(gy_row + t * sgt, mask=live, other=0.0).to(tl.float32)
    return gy * sig * (1.0 + pre * (1.0 - sig))


@triton.jit
def _train_bwd_kernel(x_ptr, w_ptr, b_ptr, gy_ptr, gx_ptr, gwb_ptr, T, C, sxb, sxt, swc, swk, sgb, sgt,
                      HAS_BIAS: tl.constexpr, SPAN: tl.constexpr, BLOCK_C: tl.constexpr):
    """dx[t] = sum_j w[3-j] g[t+j] walking t down the span; the taps' and bias's gradients as this
    program's partial sums (fp32, one row per (batch row, span)): no atomics, deterministic."""
    b = tl.program_id(0).to(tl.int64)
    t0 = tl.program_id(1) * SPAN
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = c < C
    x_row = x_ptr + b * sxb + c
    gy_row = gy_ptr + b * sgb + c
    zero = tl.zeros((BLOCK_C,), tl.int32)
    w0, w1, w2, w3, bias = _taps(w_ptr, b_ptr, c, mask_c, swc, swk, HAS_BIAS, BLOCK_C)
    t_end = t0 + SPAN
    g1 = _silu_grad_at(x_row, gy_row, t_end, T, sxt, sgt, mask_c, w0, w1, w2, w3, bias)  # g[t+1] .. g[t+3]
    g2 = _silu_grad_at(x_row, gy_row, t_end + 1, T, sxt, sgt, mask_c, w0, w1, w2, w3, bias)
    g3 = _silu_grad_at(x_row, gy_row, t_end + 2, T, sxt, sgt, mask_c, w0, w1, w2, w3, bias)
    xa = tl.load(x_row + (t_end - 1) * sxt, mask=mask_c & (zero + t_end - 1 < T), other=0.0).to(tl.float32)  # x[t]
    xb = tl.load(x_row + (t_end - 2) * sxt, mask=mask_c & (zero + t_end - 2 < T), other=0.0).to(tl.float32)
    xc = tl.load(x_row + (t_end - 3) * sxt, mask=mask_c & (zero + t_end - 3 < T) & (zero + t_end >= 3),
                 other=0.0).to(tl.float32)
    dw0 = tl.zeros((BLOCK_C,), tl.float32)
    dw1 = tl.zeros((BLOCK_C,), tl.float32)
    dw2 = tl.zeros((BLOCK_C,), tl.float32)
    dw3 = tl.zeros((BLOCK_C,), tl.float32)
    db = tl.zeros((BLOCK_C,), tl.float32)
    for i in range(SPAN):
        t = t_end - 1 - i
        live = mask_c & (zero + t < T)
        xd = tl.load(x_row + (t - 3) * sxt, mask=mask_c & (zero + t >= 3) & (zero + t - 3 < T), other=0.0).to(tl.float32)
        pre = bias + w0 * xd + w1 * xc + w2 * xb + w3 * xa
        sig = tl.sigmoid(pre)
        gy = tl.load(gy_row + t * sgt, mask=live, other=0.0).to(tl.float32)
        g0 = gy * sig * (1.0 + pre * (1.0 - sig))  # silu'(p) = sig(p) (1 + p (1 - sig(p)))
        dw0 += g0 * xd
        dw1 += g0 * xc
        dw2 += g0 * xb
        dw3 += g0 * xa
        db += g0
        gx = w3 * g0 + w2 * g1 + w1 * g2 + w0 * g3
        tl.store(gx_ptr + b * T * C + t * C + c, gx.to(gx_ptr.dtype.element_ty), mask=live)
        g3 = g2
        g2 = g1
        g1 = g0
        xa = xb
        xb = xc
        xc = xd
    part = (b * tl.num_programs(1) + tl.program_id(1)) * C + c
    tl.store(gwb_ptr + part * 5, dw0, mask=mask_c)  # this program's partial sums: the four taps', the bias's
    tl.store(gwb_ptr + part * 5 + 1, dw1, mask=mask_c)
    tl.store(gwb_ptr + part * 5 + 2, dw2, mask=mask_c)
    tl.store(gwb_ptr + part * 5 + 3, dw3, mask=mask_c)
    tl.store(gwb_ptr + part * 5 + 4, db, mask=mask_c)


def _window_grid(window: tuple[int, int, int], B: int, T: int, C: int) -> tuple[int, int, int]:
    return B, triton.cdiv(T, window[0]), triton.cdiv(C, window[1])


@torch.library.custom_op("ssmspec::causal_conv_silu", mutates_args=())
def _train_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    x = x if x.stride(-1) == 1 else x.contiguous()
    B, T, C = x.shape
    y = torch.empty(B, T, C, device=x.device, dtype=x.dtype)
    if y.numel():
        _train_fwd_kernel[_window_grid(FORWARD_WINDOW, B, T, C)](
            x, weight, bias if bias is not None else weight, y, T, C, x.stride(0), x.stride(1), weight.stride(0),
            weight.stride(1), HAS_BIAS=bias is not None, SPAN=FORWARD_WINDOW[0], BLOCK_C=FORWARD_WINDOW[1],
            num_warps=FORWARD_WINDOW[2])
    return y


@_train_forward.register_fake
def _(x, weight, bias):
    return x.new_empty(x.shape)


@torch.library.custom_op("ssmspec::causal_conv_silu_backward", mutates_args=())
def _train_backward(gy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias); dbias in the weight's dtype without a bias (a custom op cannot return None)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    gy = gy if gy.stride(-1) == 1 else gy.contiguous()
    B, T, C = x.shape
    grid = _window_grid(BACKWARD_WINDOW, B, T, C)
    gx = torch.empty(B, T, C, device=x.device, dtype=x.dtype)
    partials = torch.empty(B * grid[1], C, 5, device=x.device, dtype=torch.float32)  # summed in one launch below
    if gx.numel():
        _train_bwd_kernel[grid](
            x, weight, bias if bias is not None else weight, gy, gx, partials, T, C, x.stride(0), x.stride(1),
            weight.stride(0), weight.stride(1), gy.stride(0), gy.stride(1), HAS_BIAS=bias is not None,
            SPAN=BACKWARD_WINDOW[0], BLOCK_C=BACKWARD_WINDOW[1], num_warps=BACKWARD_WINDOW[2])
    sums = partials.sum(0)  # copies below: a custom op's outputs may not be views of one tensor
    bias_dtype = weight.dtype if bias is None else bias.dtype
    return gx, sums[:, :4].to(weight.dtype, copy=True), sums[:, 4].to(bias_dtype, copy=True)


@_train_backward.register_fake
def _(gy, x, weight, bias):
    return (x.new_empty(x.shape), weight.new_empty(weight.shape),
            (weight if bias is None else bias).new_empty(weight.shape[:1]))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _autograd_backward(ctx, gy):
    x, weight, bias = ctx.saved_tensors
    gx, gw, gb = _train_backward(gy, x, weight, bias)
    return gx, gw, None if bias is None else gb


_train_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def causal_conv_train(xBC: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """silu(causal depthwise conv1d of xBC (B, T, C)) from zeros before t = 0, differentiable in
    xBC, the taps (C, 4) and the bias, as `naive_causal_conv(xBC, None, weight, bias)`: fp32 inside,
    one rounding to xBC's dtype. One opaque call each way to torch.compile and autocast."""
    if weight.shape[-1] != 4:
        raise ValueError(f"causal_conv_train has kernels for 4 taps, not {weight.shape[-1]}")
    return _train_forward(xBC, weight, bias)

"""Triton kernel of the fused token losses; `naive.py` is the spec.

The plain-torch losses (training/losses.py, a chunk of 4096 rows at a time at a vocabulary of 8192)
make fp32 copies of the logits, their log-softmaxes, exponents and several scaled copies before
rounding the gradient back: for sft's cross-entropy about 1.6 GB moved per chunk, ~1 ms of an sft
130m step's 33 on an H200 (11-29 profile: softmax, binary and unary ATen kernels); distillation's
KL reads a target's logits too and moves roughly three times as much. Here one program per row
reads its logits (and the target's) twice, the second time mostly from L2 (a row is 16 KB at that
vocabulary), and writes the gradient once. Logits must be finite where the mask is set (a row of
-inf has no distribution). Measured on a whole `ssmspec sft` run (H200, 2026-11-29, bench/train_ab.py):
the step's peak memory 7.07 GB against 7.70 (no fp32 chunks), tokens/s within the runs' noise.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 4096
"""Vocabulary tile of one program's loops (8 warps: 16 values a thread per load)."""


@triton.jit
def _online(top, total, x):
    """The running max and sum of exp(x - max) of a row, after one more tile x."""
    new_top = tl.maximum(top, tl.max(x, axis=0))
    shift = tl.where(new_top == -float("inf"), 0.0, new_top)  # no -inf - -inf while a row starts at -inf
    return new_top, total * tl.exp(top - shift) + tl.sum(tl.exp(x - shift), axis=0)


@triton.jit
def _token_loss_kernel(
    s_ptr, t_ptr, labels_ptr, mask_ptr, scale_ptr, kl_ptr, ce_ptr, grad_ptr,
    V, ssr, str_, sgr, kl_weight, ce_weight, temperature,
    HAS_KL: tl.constexpr, HAS_CE: tl.constexpr, CE_OWN: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # CE_OWN: the cross-entropy needs the student's softmax at temperature 1 of its own (there is a
    # KL term at another temperature); else it reads the KL's (T == 1) or is the only term.
    row = tl.program_id(0).to(tl.int64)
    s_row, t_row, g_row = s_ptr + row * ssr, t_ptr + row * str_, grad_ptr + row * sgr
    keep = tl.load(mask_ptr + row).to(tl.int1)
    offs = tl.arange(0, BLOCK_V)
    if keep:
        # pass 1: each softmax's max and log-sum-exp, carried tile by tile (q: the student's at T,
        # p: the target's at T, u: the student's at 1)
        top_q = tl.full((), -float("inf"), dtype=tl.float32)
        top_p, top_u = top_q, top_q
        sum_q = tl.zeros((), dtype=tl.float32)
        sum_p, sum_u = sum_q, sum_q
        for start in range(0, V, BLOCK_V):
            valid = start + offs < V
            s = tl.load(s_row + start + offs, mask=valid, other=-float("inf")).to(tl.float32)
            if HAS_KL:
                top_q, sum_q = _online(top_q, sum_q, s / temperature)
                y = tl.load(t_row + start + offs, mask=valid, other=-float("inf")).to(tl.float32) / temperature
                top_p, sum_p = _online(top_p, sum_p, y)
            if CE_OWN:
                top_u, sum_u = _online(top_u, sum_u, s)
        # log softmax = (x - top) - log(sum): x - top first, as torch's log_softmax (top + log(sum)
        # would round away the small differences of large logits)
        log_sum_q, log_sum_p, log_sum_u = tl.log(sum_q), tl.log(sum_p), tl.log(sum_u)
        if not CE_OWN:
            top_u, log_sum_u = top_q, log_sum_q
        label = tl.load(labels_ptr + row)
        scale = tl.load(scale_ptr).to(tl.float32)
        kl_sum = tl.zeros((), dtype=tl.float32)
        # pass 2: the KL's sum and the gradient, rounded once to the gradient's dtype
        for start in range(0, V, BLOCK_V):
            cols = start + offs
            valid = cols < V
            s = tl.load(s_row + cols, mask=valid, other=0.0).to(tl.float32)
            g = tl.zeros((BLOCK_V,), dtype=tl.float32)
            if HAS_KL:
                log_q = (s / temperature - top_q) - log_sum_q
                y = tl.load(t_row + cols, mask=valid, other=0.0).to(tl.float32) / temperature
                log_p = (y - top_p) - log_sum_p
                p, q = tl.exp(log_p), tl.exp(log_q)
                kl_sum += tl.sum(tl.where(valid, p * (log_p - log_q), 0.0), axis=0)
                g += (q - p) * (kl_weight * temperature)
            if HAS_CE:
                # not CE_OWN: there is a KL term at T == 1, whose q is this softmax
                u = tl.exp((s - top_u) - log_sum_u) if CE_OWN else q
                g += tl.where(cols == label, u - 1.0, u) * ce_weight
            tl.store(g_row + cols, (g * scale).to(grad_ptr.dtype.element_ty), mask=valid)
        tl.store(kl_ptr + row, kl_sum * temperature * temperature)
        if HAS_CE:
            picked = tl.load(s_row + label).to(tl.float32)
            tl.store(ce_ptr + row, (top_u - picked) + log_sum_u)
        else:
            tl.store(ce_ptr + row, 0.0)
    else:
        tl.store(kl_ptr + row, 0.0)
        tl.store(ce_ptr + row, 0.0)
        for start in range(0, V, BLOCK_V):
            cols = start + offs
            tl.store(g_row + cols, tl.zeros((BLOCK_V,), dtype=grad_ptr.dtype.element_ty), mask=cols < V)


def token_losses(student: torch.Tensor, target: torch.Tensor | None, labels: torch.Tensor | None,
                 mask: torch.Tensor, scale: torch.Tensor, kl: float, ce: float,
                 temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`naive_token_losses` in one launch (same arguments and results)."""
    if not (kl or ce):
        raise ValueError("token_losses needs a nonzero kl or ce weight")
    if kl and target is None:
        raise ValueError("the kl term needs the target's logits")
    if ce and labels is None:
        raise ValueError("the ce term needs labels")
    student = student if student.stride(-1) == 1 else student.contiguous()
    target = student if not kl else (target if target.stride(-1) == 1 else target.contiguous())
    n, vocab = student.shape
    kl_rows = torch.empty(n, device=student.device, dtype=torch.float32)
    ce_rows = torch.empty(n, device=student.device, dtype=torch.float32)
    grad = torch.empty((n, vocab), device=student.device, dtype=student.dtype)
    if n == 0:
        return kl_rows, ce_rows, grad
    labels = torch.zeros(n, device=student.device, dtype=torch.long) if labels is None else labels.contiguous()
    block = min(BLOCK_V, triton.next_power_of_2(vocab))
    _token_loss_kernel[(n,)](
        student, target, labels, mask.contiguous(), scale.float().reshape(1), kl_rows, ce_rows, grad,
        vocab, student.stride(0), target.stride(0), grad.stride(0), float(kl), float(ce), float(temperature),
        HAS_KL=bool(kl), HAS_CE=bool(ce), CE_OWN=bool(ce) and not (bool(kl) and temperature == 1.0),
        BLOCK_V=block, num_warps=8 if block >= 2048 else 4,
    )
    return kl_rows, ce_rows, grad

"""Plain-torch reference of the fused token losses (the spec of the kernel in triton.py)."""
from __future__ import annotations

import torch


def naive_token_losses(student: torch.Tensor, target: torch.Tensor | None, labels: torch.Tensor | None,
                       mask: torch.Tensor, scale: torch.Tensor, kl: float, ce: float,
                       temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's forward KL and cross-entropy, and the gradient of scale * (kl * their KL sum +
    ce * their CE sum) w.r.t. the student's logits, in fp32 inside.

    Per row r, with q = softmax(student[r] / T), p = softmax(target[r] / T), u = softmax(student[r]):
        kl_rows[r] = T^2 * sum_v p (log p - log q)     where mask[r] and kl, else 0
        ce_rows[r] = -log u[labels[r]]                   where mask[r] and ce, else 0
        grad[r]    = scale * (kl * T * (q - p) + ce * (u - onehot(labels[r])))   where mask[r], else 0
    (the T^2 and T of the usual distillation loss: training/losses.py's `forward_kl`), the gradient
    rounded once to the student's dtype.

    Args:
        student: (N, V) fp32, bf16 or fp16 logits; the last dimension contiguous.
        target: (N, V) the target's logits (any float dtype), needed when kl.
        labels: (N,) int64 in [0, V) (read only where mask), needed when ce.
        mask: (N,) bool.
        scale: () fp32 tensor (one over the count of positions: a tensor, so no host sync).
        kl, ce: the terms' weights (at least one nonzero); temperature: T of the KL term.
    Returns:
        (kl_rows (N,) fp32, ce_rows (N,) fp32, grad (N, V) in the student's dtype).
    """
    m = mask.float()
    s = student.float()
    kl_rows, ce_rows = torch.zeros_like(m), torch.zeros_like(m)
    grad = torch.zeros_like(s)
    if kl:
        log_q = torch.log_softmax(s / temperature, dim=-1)
        log_p = torch.log_softmax(target.float() / temperature, dim=-1)
        p = log_p.exp()
        kl_rows = (p * (log_p - log_q)).sum(-1) * temperature**2 * m
        grad += (log_q.exp() - p) * (kl * temperature)
    if ce:
        log_u = torch.log_softmax(s, dim=-1)
        safe = labels.masked_fill(~mask, 0)
        ce_rows = -log_u.gather(-1, safe[:, None])[:, 0] * m
        g = log_u.exp()
        g[torch.arange(g.shape[0], device=g.device), safe] -= 1.0
        grad += g * ce
    return kl_rows, ce_rows, (grad * (scale.float() * m)[:, None]).to(student.dtype)

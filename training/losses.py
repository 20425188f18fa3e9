"""Distillation and next-token losses over masked positions: forward KL at a temperature, TVD, cross-entropy.

`forward_kl`, `total_variation` and `cross_entropy` are the definitions (the references, whole
(B, T, V) fp32 tensors at once). Training and evaluation use `chunked_loss`, which computes the
same values and gradients a chunk of positions at a time, so the fp32 copies of the logits exist
for one chunk only, and autograd keeps one gradient tensor in the logits' own dtype. Cross-entropy
and forward KL (distillation's loss, alone or with CE) with a gradient go through
`dispatch.token_losses` instead where its Triton kernel runs (ops/token_loss: one pass over the
logits, no chunks, no fp32 copies).

`chunked_loss` also takes the target as its top-K logits (values and token ids per position, as
`--cache-target-logits` stores them) instead of its full logits: the sparse distillation loss,
defined by `topk_forward_kl` (the reference for it).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ssmspec.ops import dispatch

from .data import IGNORE_INDEX


def _masked_mean(per_pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of (B, T) values over the True positions of mask (B, T); 0 when none are set."""
    mask = mask.to(per_pos.dtype)
    return (per_pos * mask).sum() / mask.sum().clamp_min(1.0)


def forward_kl(student_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(p_T || q_T) per position, averaged over the mask, times T^2.

    p_T and q_T are the target's and student's softmax at temperature T. Forward KL is
    mass-covering: the student is pushed to put probability wherever the target does, which is
    what a drafter needs for high acceptance under sampling. The T^2 factor keeps gradient
    magnitudes comparable across temperatures (Hinton et al.).

    Args:
        student_logits, target_logits: (B, T, V).
        mask: (B, T) bool, positions that count.
    Returns:
        a scalar.
    """
    log_q = F.log_softmax(student_logits.float() / temperature, dim=-1)
    log_p = F.log_softmax(target_logits.float() / temperature, dim=-1)
    per_pos = (log_p.exp() * (log_p - log_q)).sum(-1)  # (B, T)
    return _masked_mean(per_pos, mask) * temperature**2


def topk_forward_kl(student_logits: torch.Tensor, topk_values: torch.Tensor, topk_ids: torch.Tensor, mask: torch.Tensor,
                    temperature: float = 1.0) -> torch.Tensor:
    """Sparse forward KL to the target's top-K: sum over the K ids of p_k (log p_k - log q_k), times T^2.

    p = softmax(topk_values / T) over the K values only (the target's distribution renormalised
    on its top K tokens); log q_k = log_softmax(student_logits / T) over the whole vocabulary,
    gathered at the K ids. It is the full forward KL when K is the vocabulary size, and an
    approximation of it otherwise, whose error shrinks as the top K hold more of the target's mass.
    It is never negative (sum_k q_k <= 1). The values may be shifted per position (they are
    stored as logits minus the position's largest one): p does not change.

    Args:
        student_logits: (B, T, V). topk_values: (B, T, K) float. topk_ids: (B, T, K) int, distinct per position.
        mask: (B, T) bool.
    Returns:
        a scalar.
    """
    log_q = F.log_softmax(student_logits.float() / temperature, dim=-1).gather(-1, topk_ids.long())
    log_p = F.log_softmax(topk_values.float() / temperature, dim=-1)
    per_pos = (log_p.exp() * (log_p - log_q)).sum(-1)
    return _masked_mean(per_pos, mask) * temperature**2


def total_variation(student_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """TVD(p_T, q_T) = 0.5 * sum_v |p_v - q_v| per position, averaged over the mask.

    For speculative sampling the acceptance probability of one drafted token is exactly
    1 - TVD(p, q), so minimising it optimises acceptance directly (DistillSpec).

    Args / Returns: as `forward_kl`.
    """
    q = F.softmax(student_logits.float() / temperature, dim=-1)
    p = F.softmax(target_logits.float() / temperature, dim=-1)
    per_pos = 0.5 * (p - q).abs().sum(-1)
    return _masked_mean(per_pos, mask)


def cross_entropy(student_logits: torch.Tensor, next_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on the data: student_logits (B, T, V), next_ids (B, T), mask (B, T) -> scalar."""
    labels = next_ids.masked_fill(~mask, IGNORE_INDEX)
    loss = F.cross_entropy(student_logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return loss / mask.sum().clamp_min(1)


CHUNK_ELEMENTS = 1 << 25
"""Default fp32 elements per chunk of `chunked_loss` (32M: 128 MB per fp32 tensor of the chunk)."""


def chunk_rows(vocab_size: int, chunk_positions: int = 0) -> int:
    """Positions per chunk: chunk_positions when given, else as many as fit CHUNK_ELEMENTS."""
    return chunk_positions if chunk_positions > 0 else max(1, CHUNK_ELEMENTS // max(1, vocab_size))


def _target_terms(t, topk, log_q):
    """(p, KL per row) for one chunk: p the target's distribution as a dense (n, V) tensor.

    t: (n, V) fp32 target logits, or None and topk = (values (n, K) fp32, ids (n, K) int64): then
    p = softmax(values / T) at the K ids and 0 elsewhere, and the KL sums over the K ids only
    (log p is -inf off them, where p is 0). log_q: (n, V) student log-probs at temperature T.
    """
    if topk is None:
        log_p = torch.log_softmax(t, dim=-1)
        p = log_p.exp()
        return p, (p * (log_p - log_q)).sum(-1)
    values, ids = topk
    log_pk = torch.log_softmax(values, dim=-1)
    pk = log_pk.exp()
    kl = (pk * (log_pk - log_q.gather(-1, ids))).sum(-1)
    return torch.zeros_like(log_q).scatter_(-1, ids, pk), kl


def _chunk_terms(s, t, labels, m, weights: dict, temperature: float, want_grad: bool, topk=None):
    """Sums over one chunk of rows of each weighted term, and the weighted gradient w.r.t. s.

    s, t: (n, V) fp32 student / target logits (t None when topk = (values (n, K), ids (n, K)) gives
    the target: see _target_terms); labels: (n,) with masked rows set to 0; m: (n,)
    fp32 mask. Per row, with q = softmax(s / T), p = softmax(t / T):
      KL  = sum_v p (log p - log q),   d/ds = (q - p) / T, times T^2 as in forward_kl
      TVD = 1/2 sum_v |p - q|,          d/ds_u = q_u (g_u - sum_v g_v q_v) / T, g = sign(q - p) / 2
      CE  = -log softmax(s)[label],     d/ds = softmax(s) - onehot(label)
    With topk, p is 0 off the K ids, so the same gradients hold with that p (KL's sum runs over
    the K ids; TVD counts all of the student's mass off them).
    """
    sums, grad = {}, None
    temp = temperature

    def add(g):
        nonlocal grad
        grad = g if grad is None else grad + g

    if weights.get("kl") or weights.get("tvd"):
        log_q = torch.log_softmax(s / temp, dim=-1)
        scaled_topk = None if topk is None else (topk[0] / temp, topk[1])
        p, kl_rows = _target_terms(None if t is None else t / temp, scaled_topk, log_q)
        q = log_q.exp()
        if weights.get("kl"):
            sums["kl"] = (kl_rows * m).sum() * temp**2
            if want_grad:
                add((q - p) * (weights["kl"] * temp))
        if weights.get("tvd"):
            sums["tvd"] = (0.5 * (p - q).abs().sum(-1) * m).sum()
            if want_grad:
                g = 0.5 * torch.sign(q - p)
                add(q * (g - (g * q).sum(-1, keepdim=True)) * (weights["tvd"] / temp))
        del log_q, q, p, kl_rows
    if weights.get("ce"):
        log_r = torch.log_softmax(s, dim=-1)
        sums["ce"] = (-log_r.gather(-1, labels[:, None])[:, 0] * m).sum()
        if want_grad:
            g = log_r.exp()
            g[torch.arange(g.shape[0], device=g.device), labels] -= 1.0
            add(g * weights["ce"])
    if grad is not None:
        grad = grad * m[:, None]
    return sums, grad


def _finish(ctx, sums: torch.Tensor, count: torch.Tensor, weights: dict, names: list, grad: torch.Tensor | None):
    """_ChunkedLoss.forward's results from each term's masked sum (in names' order) and the gradient."""
    parts = sums / count
    total = sum(weights[k] * parts[i] for i, k in enumerate(names))
    ctx.mark_non_differentiable(parts)
    ctx.save_for_backward(grad)
    ctx.names = names
    return total, parts


class _ChunkedLoss(torch.autograd.Function):
    """sum_k weight_k * term_k over masked positions / their count, a chunk of rows at a time.

    The gradient w.r.t. the student logits is computed in the forward pass (it is closed-form)
    and kept in the logits' dtype; backward only scales it.
    """

    @staticmethod
    def forward(ctx, student, target, topk_values, topk_ids, labels, mask, weights: dict, temperature: float, rows: int):
        n = student.shape[0]
        want_grad = ctx.needs_input_grad[0]
        count = mask.sum().clamp_min(1).float()
        names = sorted(k for k, w in weights.items() if w)
        if want_grad and not weights["tvd"] and topk_values is None and \
                dispatch.uses_kernel("token_losses", student.device):
            # sft's CE, distillation's KL (+ CE): one pass over the logits, no fp32 copies (ops/token_loss)
            kl_rows, ce_rows, grad = dispatch.token_losses(student, target, labels, mask, 1.0 / count, weights["kl"],
                                                           weights["ce"], temperature)
            per_term = {"kl": kl_rows, "ce": ce_rows}
            return _finish(ctx, torch.stack([per_term[k].sum() for k in names]), count, weights, names, grad)
        grad = torch.empty_like(student) if want_grad else None
        sums = torch.zeros(len(names), device=student.device, dtype=torch.float32)
        for start in range(0, n, rows):
            end = min(n, start + rows)
            m = mask[start:end].float()
            t = None if target is None else target[start:end].float()
            topk = None if topk_values is None else (topk_values[start:end].float(), topk_ids[start:end])
            chunk_sums, g = _chunk_terms(student[start:end].float(), t, labels[start:end], m, weights, temperature,
                                         want_grad, topk)
            sums += torch.stack([chunk_sums[k] for k in names])
            if want_grad:
                grad[start:end] = (g / count).to(grad.dtype)
        return _finish(ctx, sums, count, weights, names, grad)

    @staticmethod
    def backward(ctx, grad_total, grad_parts):
        (grad,) = ctx.saved_tensors
        return grad * grad_total.to(grad.dtype), None, None, None, None, None, None, None, None


def chunked_loss(student_logits: torch.Tensor, mask: torch.Tensor, *, target_logits: torch.Tensor | None = None,
                 target_topk: tuple[torch.Tensor, torch.Tensor] | None = None,
                 next_ids: torch.Tensor | None = None, kl: float = 0.0, tvd: float = 0.0, ce: float = 0.0,
                 temperature: float = 1.0, chunk_positions: int = 0) -> tuple[torch.Tensor, dict]:
    """kl * forward_kl + tvd * total_variation + ce * cross_entropy, a chunk of positions at a time.

    Terms with weight 0 are not computed. Values and gradients equal the references'.

    Args:
        student_logits: (B, T, V), any float dtype (bf16 under autocast); differentiable.
        mask: (B, T) bool.
        target_logits: (B, T, V), needed for kl and tvd (any float dtype; no gradient).
        target_topk: or instead, the target's top-K as (values (B, T, K) float, ids (B, T, K) int):
            kl is then `topk_forward_kl`, and tvd the total variation between the renormalised
            top-K distribution (0 off the K ids) and the student's full one.
        next_ids: (B, T), needed for ce.
        chunk_positions: positions per chunk; 0 picks by CHUNK_ELEMENTS.
    Returns:
        (loss scalar, dict of detached term values by name: kl, tvd, ce).
    """
    weights = {"kl": float(kl), "tvd": float(tvd), "ce": float(ce)}
    if not any(weights.values()):
        raise ValueError("chunked_loss needs at least one nonzero weight")
    if target_logits is not None and target_topk is not None:
        raise ValueError("give target_logits or target_topk, not both")
    if (kl or tvd) and target_logits is None and target_topk is None:
        raise ValueError("kl and tvd need target_logits or target_topk")
    if ce and next_ids is None:
        raise ValueError("ce needs next_ids")
    vocab = student_logits.shape[-1]
    s = student_logits.reshape(-1, vocab)  # (B*T, V)
    t = None if target_logits is None else target_logits.reshape(-1, vocab).detach()
    topk_values = topk_ids = None
    if target_topk is not None:
        k = target_topk[0].shape[-1]
        topk_values, topk_ids = target_topk[0].reshape(-1, k).detach(), target_topk[1].reshape(-1, k).long()
    flat_mask = mask.reshape(-1)
    labels = torch.zeros_like(flat_mask, dtype=torch.long) if next_ids is None else next_ids.reshape(-1).masked_fill(~flat_mask, 0)
    total, parts = _ChunkedLoss.apply(s, t, topk_values, topk_ids, labels, flat_mask, weights, temperature,
                                      chunk_rows(vocab, chunk_positions))
    names = sorted(k for k, w in weights.items() if w)
    return total, {k: parts[i].detach() for i, k in enumerate(names)}


def top1_agreement(student_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Share of masked positions where student and target argmax agree (greedy acceptance of one token)."""
    same = (student_logits.argmax(-1) == target_logits.argmax(-1)).float()
    return _masked_mean(same, mask)


def distill_loss(kind: str, student_logits, target_logits, next_ids, mask, temperature: float = 1.0, ce_weight: float = 0.5,
                 chunk_positions: int = 0, target_topk=None):
    """The training loss of `ssmspec distill` and the parts it is made of (for logging), by `chunked_loss`.

    Args:
        kind: kl, tvd or kl+ce (kl + ce_weight * cross-entropy on the data).
        student_logits, target_logits: (B, T, V); next_ids: (B, T); mask: (B, T) bool.
        target_topk: (values, ids), each (B, T, K), in place of target_logits (None) for the
            sparse loss of `--cache-target-logits` (see chunked_loss).
    Returns:
        (loss scalar with grad, dict of detached values: kl or tvd, and ce).
    """
    weights = {"tvd": {"tvd": 1.0}, "kl": {"kl": 1.0}, "kl+ce": {"kl": 1.0, "ce": ce_weight}}[kind]
    return chunked_loss(student_logits, mask, target_logits=target_logits, target_topk=target_topk, next_ids=next_ids,
                        temperature=temperature, chunk_positions=chunk_positions, **weights)


def sft_loss(student_logits, next_ids, mask, chunk_positions: int = 0):
    """The training loss of `ssmspec sft`: next-token cross-entropy, by `chunked_loss`. Returns (loss, {"ce": ...})."""
    return chunked_loss(student_logits, mask, next_ids=next_ids, ce=1.0, chunk_positions=chunk_positions)

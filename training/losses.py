"""Distillation and next-token losses over masked positions: forward KL at a temperature, TVD, cross-entropy."""
from __future__ import annotations

import torch
import torch.nn.functional as F

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


def top1_agreement(student_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Share of masked positions where student and target argmax agree (greedy acceptance of one token)."""
    same = (student_logits.argmax(-1) == target_logits.argmax(-1)).float()
    return _masked_mean(same, mask)


def distill_loss(kind: str, student_logits, target_logits, next_ids, mask, temperature: float = 1.0, ce_weight: float = 0.5):
    """The training loss of `ssmspec distill` and the parts it is made of (for logging).

    Args:
        kind: kl, tvd or kl+ce (kl + ce_weight * cross-entropy on the data).
        student_logits, target_logits: (B, T, V); next_ids: (B, T); mask: (B, T) bool.
    Returns:
        (loss scalar with grad, dict of detached floats: kl or tvd, and ce).
    """
    parts = {}
    if kind == "tvd":
        loss = total_variation(student_logits, target_logits, mask, temperature)
        parts["tvd"] = loss.detach()
    else:
        loss = forward_kl(student_logits, target_logits, mask, temperature)
        parts["kl"] = loss.detach()
        if kind == "kl+ce":
            ce = cross_entropy(student_logits, next_ids, mask)
            parts["ce"] = ce.detach()
            loss = loss + ce_weight * ce
    return loss, parts

"""Evaluation during training: held-out loss, and acceptance measured by real chain speculative decoding."""
from __future__ import annotations

import torch
import torch.nn as nn

from .losses import cross_entropy, distill_loss, forward_kl, top1_agreement


@torch.no_grad()
def held_out_metrics(student: nn.Module, target: nn.Module | None, held_out, cfg, device, mode: str) -> dict:
    """Loss (the training loss), cross-entropy, and with a target the KL and top-1 agreement, on held-out blocks.

    Args:
        held_out: (ids (N, L+1), loss_mask (N, L)).
    """
    ids_all, mask_all = held_out
    n = ids_all.shape[0]
    if n == 0:
        return {}
    sums: dict[str, float] = {}
    weight = 0.0
    bs = cfg.optim.batch_size
    for start in range(0, min(n, bs * cfg.eval.max_batches), bs):
        ids = ids_all[start : start + bs].to(device)
        mask = mask_all[start : start + bs].to(device)
        inputs, next_ids = ids[:, :-1], ids[:, 1:]
        logits = student(inputs)
        w = float(mask.sum())
        vals = {"held_out_ce": cross_entropy(logits, next_ids, mask)}
        if target is not None:
            t_logits = target(inputs).float()
            vals["held_out_kl"] = forward_kl(logits, t_logits, mask, cfg.loss.temperature)
            vals["agreement"] = top1_agreement(logits, t_logits, mask)
            if mode == "distill":
                vals["held_out_loss"], _ = distill_loss(cfg.loss.loss, logits, t_logits, next_ids, mask,
                                                        cfg.loss.temperature, cfg.loss.ce_weight)
        if mode == "sft":
            vals["held_out_loss"] = vals["held_out_ce"]
        for k, v in vals.items():
            sums[k] = sums.get(k, 0.0) + float(v) * w
        weight += w
    return {k: v / max(weight, 1.0) for k, v in sums.items()}


@torch.no_grad()
def measure_acceptance(student: nn.Module, target: nn.Module, prompts: list[list[int]], draft_len: int,
                       max_new_tokens: int, eos_token_id=None) -> dict:
    """Mean tokens produced per target call when `student` drafts a chain of draft_len for `target` (greedy).

    Each call yields the accepted drafted tokens plus the target's bonus token, so the value is
    between 1 (nothing accepted) and draft_len + 1. Aggregated over prompts as total tokens over
    total calls, which weights each prompt by its number of calls.
    """
    from ssmspec.decoding.drafters import ModelDrafter
    from ssmspec.decoding.generate import GenerationConfig, generate
    from ssmspec.trees import Tree

    tokens, calls = 0.0, 0
    for prompt in prompts:
        config = GenerationConfig(method="chain", tree=Tree.chain(draft_len), max_new_tokens=max_new_tokens,
                                  temperature=0.0, eos_token_id=eos_token_id)
        result = generate(target, torch.tensor([prompt], dtype=torch.long), drafter=ModelDrafter(student), config=config)
        n = result.stats["target_calls"]
        tokens += result.stats["mean_accepted"] * n
        calls += n
    return {"mean_accepted": tokens / calls if calls else float("nan"), "acceptance_calls": calls}


def _can_decode(target) -> bool:
    from ssmspec.models.lm import LanguageModel

    return isinstance(target, LanguageModel)


def evaluate(student: nn.Module, target: nn.Module | None, held_out, prompts, cfg, device, mode: str) -> dict:
    """All evaluation metrics at one point of training; the student is left in eval mode."""
    student.eval()
    metrics = held_out_metrics(student, target, held_out, cfg, device, mode)
    if target is not None and prompts and _can_decode(target):
        try:
            import ssmspec.decoding.generate  # noqa: F401
        except ImportError:
            metrics["acceptance_note"] = "ssmspec.decoding is unavailable; acceptance not measured"
        else:
            metrics.update(measure_acceptance(student, target, prompts, cfg.eval.draft_len, cfg.eval.max_new_tokens))
    elif target is not None and prompts:
        metrics["acceptance_note"] = "speculative decoding does not support this target kind yet; see agreement"
    return metrics

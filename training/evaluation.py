"""Evaluation during training: held-out loss, and acceptance measured by real chain speculative decoding."""
from __future__ import annotations

import torch
import torch.nn as nn

from .losses import chunked_loss, distill_loss, top1_agreement


def _noop_progress(done: int, total: int) -> None:
    pass


def held_out_batches(held_out, cfg) -> int:
    """How many micro-batches `held_out_metrics` evaluates."""
    n, bs = held_out[0].shape[0], cfg.optim.batch_size
    return len(range(0, min(n, bs * cfg.eval.max_batches), bs))


@torch.no_grad()
def held_out_metrics(student: nn.Module, target: nn.Module | None, held_out, cfg, device, mode: str,
                     progress=_noop_progress, total: int | None = None) -> dict:
    """Loss (the training loss), cross-entropy, and with a target the KL and top-1 agreement, on held-out blocks.

    Args:
        held_out: (ids (N, L+1), loss_mask (N, L)).
        progress: called as progress(batches done, total) after each batch; total defaults to the batch count.
    """
    ids_all, mask_all = held_out
    n = ids_all.shape[0]
    if n == 0:
        return {}
    sums: dict[str, float] = {}
    weight = 0.0
    bs = cfg.optim.batch_size
    total = held_out_batches(held_out, cfg) if total is None else total
    for done, start in enumerate(range(0, min(n, bs * cfg.eval.max_batches), bs), 1):
        ids = ids_all[start : start + bs].to(device)
        mask = mask_all[start : start + bs].to(device)
        inputs, next_ids = ids[:, :-1], ids[:, 1:]
        logits = student(inputs)
        w = float(mask.sum())
        chunk = cfg.loss.chunk_positions
        _, parts = chunked_loss(logits, mask, next_ids=next_ids, ce=1.0, chunk_positions=chunk)
        vals = {"held_out_ce": parts["ce"]}
        if target is not None:
            t_logits = target(inputs)
            _, parts = chunked_loss(logits, mask, target_logits=t_logits, kl=1.0, temperature=cfg.loss.temperature,
                                    chunk_positions=chunk)
            vals["held_out_kl"] = parts["kl"]
            vals["agreement"] = top1_agreement(logits, t_logits, mask)
            if mode == "distill":
                vals["held_out_loss"], _ = distill_loss(cfg.loss.loss, logits, t_logits, next_ids, mask,
                                                        cfg.loss.temperature, cfg.loss.ce_weight, chunk)
        if mode == "sft":
            vals["held_out_loss"] = vals["held_out_ce"]
        for k, v in vals.items():
            sums[k] = sums.get(k, 0.0) + float(v) * w
        weight += w
        progress(done, total)
    return {k: v / max(weight, 1.0) for k, v in sums.items()}


@torch.no_grad()
def measure_acceptance(student: nn.Module, target: nn.Module, prompts: list[list[int]], draft_len: int,
                       max_new_tokens: int, eos_token_id=None, progress=_noop_progress) -> dict:
    """Mean tokens produced per target call when `student` drafts a chain of draft_len for `target` (greedy).

    Each call yields the accepted drafted tokens plus the target's bonus token, so the value is
    between 1 (nothing accepted) and draft_len + 1. Aggregated over prompts as total tokens over
    total calls, which weights each prompt by its number of calls.
    """
    from ssmspec.decoding import Engine
    from ssmspec.decoding.drafters import ModelDrafter
    from ssmspec.decoding.generate import GenerationConfig
    from ssmspec.trees import Tree

    # One engine for all prompts: its graphs are captured once (a free `generate` re-captures per call).
    engine = Engine(target, ModelDrafter(student))
    tokens, calls = 0.0, 0
    for done, prompt in enumerate(prompts, 1):
        config = GenerationConfig(method="chain", tree=Tree.chain(draft_len), max_new_tokens=max_new_tokens,
                                  temperature=0.0, eos_token_id=eos_token_id)
        result = engine.generate(torch.tensor([prompt], dtype=torch.long), config)
        n = result.stats["target_calls"]
        tokens += result.stats["mean_accepted"] * n
        calls += n
        progress(done, len(prompts))
    return {"mean_accepted": tokens / calls if calls else float("nan"), "acceptance_calls": calls}


def _can_decode(target) -> bool:
    from ssmspec.models.lm import LanguageModel

    return isinstance(target, LanguageModel)


def evaluate(student: nn.Module, target: nn.Module | None, held_out, prompts, cfg, device, mode: str,
             progress=_noop_progress) -> dict:
    """All evaluation metrics at one point of training; the student is left in eval mode.

    progress(done, total) counts held-out batches, then acceptance prompts (when measured).
    """
    student.eval()
    decodes = target is not None and bool(prompts) and _can_decode(target)
    batches = held_out_batches(held_out, cfg)
    total = batches + (len(prompts) if decodes else 0)
    progress(0, total)
    metrics = held_out_metrics(student, target, held_out, cfg, device, mode, progress, total)
    if decodes:
        try:
            import ssmspec.decoding.generate  # noqa: F401
        except ImportError:
            metrics["acceptance_note"] = "ssmspec.decoding is unavailable; acceptance not measured"
        else:
            metrics.update(measure_acceptance(student, target, prompts, cfg.eval.draft_len, cfg.eval.max_new_tokens,
                                              progress=lambda done, _: progress(batches + done, total)))
    elif target is not None and prompts:
        metrics["acceptance_note"] = "speculative decoding does not support this target kind yet; see agreement"
    if not metrics:  # else each evaluation printed its step and nothing else
        metrics["acceptance_note"] = "nothing to evaluate: no held-out sequences (--held-out or --max-held-out 0, or too little data)"
    return metrics

"""The losslessness check: a speculative method's ids against `ar`'s, with numerical ties told apart.

At temperature 0 a speculative method must reproduce the target's greedy output exactly. In
fp32 any difference is a failure. In bf16/fp16 the verify (a packed tree) and the step round
differently, so where the target's two best tokens are within rounding of each other the two
paths may pick different ones. At the first differing position t we run the target's full
forward on the shared prefix (prompt + ar[:t]), take its fp32 logits l, and call the divergence
a tie when |l[ar[t]] - l[spec[t]]| <= tolerance, else a failure.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

TIE_ULPS = 4
"""Default tie tolerance, in units in the last place of the model dtype at the logits' magnitude
(bf16 at |logit| ~ 10: 4 * 2^-7 * 8 = 0.25)."""


@dataclass
class Verdict:
    """Outcome of one prompt's check. status: match, tie, failure, or n/a (temperature > 0)."""

    status: str
    position: int | None = None
    """First differing index into the generated ids."""
    ar_token: int | None = None
    token: int | None = None
    logit_gap: float | None = None
    """|l[ar_token] - l[token]| of the target's fp32 logits on the shared prefix."""
    tolerance: float | None = None
    reason: str | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def first_difference(reference: list[int], ids: list[int]) -> int | None:
    """Index of the first differing id, the shorter length if one is a prefix of the other, or None."""
    for i, (a, b) in enumerate(zip(reference, ids)):
        if a != b:
            return i
    return None if len(reference) == len(ids) else min(len(reference), len(ids))


def default_tie_tolerance(dtype: torch.dtype, magnitude: float) -> float:
    """TIE_ULPS units in the last place of `dtype` at `magnitude` (at least 1)."""
    exponent = math.floor(math.log2(max(abs(magnitude), 1.0)))
    return TIE_ULPS * torch.finfo(dtype).eps * 2.0 ** exponent


@torch.no_grad()
def reference_logits(model, prefix: list[int]) -> torch.Tensor:
    """The target's fp32 logits (V,) after `prefix`: one full forward on a fresh cache."""
    ids = torch.tensor([prefix], dtype=torch.long, device=model.device)
    return model(ids, model.new_cache(1, len(prefix)), last_only=True)[0, -1].float()


def classify_gap(gap: float, dtype: torch.dtype, magnitude: float, tolerance: float | None) -> tuple[str, float]:
    """(tie or failure, tolerance used) for a logit gap at a divergence in a model of `dtype`."""
    if dtype == torch.float32:
        return "failure", 0.0  # fp32: both paths must agree exactly
    tol = tolerance if tolerance is not None else default_tie_tolerance(dtype, magnitude)
    return ("tie" if gap <= tol else "failure"), tol


def check_lossless(model, prompt_ids: list[int], reference: list[int], ids: list[int],
                   tolerance: float | None = None) -> Verdict:
    """Compare a speculative method's generated `ids` with `ar`'s `reference` for one prompt.

    Args:
        model: the target LanguageModel (its dtype decides whether ties are possible).
        prompt_ids: the prompt's ids, shared by both generations.
        tolerance: the largest logit gap called a tie (None: `default_tie_tolerance`).
    """
    t = first_difference(reference, ids)
    if t is None:
        return Verdict("match")
    if t >= len(reference) or t >= len(ids):
        return Verdict("failure", position=t, reason=f"lengths differ ({len(ids)} ids, ar {len(reference)}) with a common prefix")
    a, b = reference[t], ids[t]
    logits = reference_logits(model, prompt_ids + reference[:t])
    la, lb = float(logits[a]), float(logits[b])
    gap = abs(la - lb)
    status, tol = classify_gap(gap, model.dtype, max(abs(la), abs(lb)), tolerance)
    reason = None
    if status == "failure":
        reason = "fp32 outputs must be identical" if model.dtype == torch.float32 else "logit gap above the tie tolerance"
    return Verdict(status, position=t, ar_token=a, token=b, logit_gap=gap, tolerance=tol, reason=reason)

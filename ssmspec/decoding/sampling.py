"""Turning logits into the distribution actually sampled from: temperature, top-k, top-p.

The same function processes the target's and the drafter's logits, so that speculative
sampling stays exact for the processed target distribution.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from ..errors import InputError


def is_real(value) -> bool:
    """A number (numpy's too), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_integer(value) -> bool:
    """An integer (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


SHIFT_BELOW_TEMPERATURE = 1e-2
"""`probabilities` shifts the logits to a maximum of 0 below this temperature only. logits / T
overflows to +inf only where |logit| > 3.4e38 * T, which no working model reaches at T >= 0.01;
there the shift's reduction and extra pass (a launch each, per drafted level and per verify on
the decode path) are skipped."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    """0 means greedy (argmax)."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = all)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p (1 = all)."""

    def __post_init__(self):
        # Type checks first: a string failed in a comparison, a float top-k in torch.topk mid-generation,
        # and a NaN temperature passed `< 0` and sampled from NaN probabilities.
        if not is_real(self.temperature) or not self.temperature >= 0:
            raise InputError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not is_integer(self.top_k) or self.top_k < 0:
            raise InputError(f"top-k must be an integer >= 0, got {self.top_k!r}")
        if not is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise InputError(f"top-p must be in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Processed next-token distribution over the last dim, in fp32.

    For greedy decoding this is the one-hot of the argmax, so every rule below treats greedy as
    sampling from a point mass.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    if params.temperature < SHIFT_BELOW_TEMPERATURE:
        # Shifted to a maximum of 0 first (softmax is shift-invariant): a tiny temperature then sends
        # the others to -inf, not the best to +inf, which made the softmax NaN (inf - inf).
        logits = logits - logits.amax(-1, keepdim=True)
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # Drop a token when the mass strictly before it already reaches top_p.
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id from a 1-D distribution (argmax of a one-hot is exact for greedy)."""
    if generator is None:
        return int(probs.argmax())
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def race_noise_(noise: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Refill `noise` in place with i.i.d. Exp(1) draws for `race_scores`; returns it.

    Run eagerly before a graph replay: the captured work only reads the buffer, so no RNG state
    lives inside a CUDA graph and a seeded generator reproduces the draws. A draw of exactly 0
    is lifted to the smallest normal float so that a zero probability never scores 0 / 0.
    """
    return noise.exponential_(generator=generator).clamp_min_(torch.finfo(noise.dtype).tiny)


def race_scores(logits: torch.Tensor, params: SamplingParams, noise: torch.Tensor) -> torch.Tensor:
    """Scores whose argmax over the last dim is a draw from the processed distribution.

    The exponential race: with E_v i.i.d. Exp(1), E_v / p_v is Exp(p_v), and the smallest of
    independent exponentials is index v with probability p_v / sum(p). So argmax_v p_v / E_v is
    distributed exactly as p (ties have probability 0; a token with p_v = 0 scores 0 and never
    wins). It turns every argmax on the device (greedy acceptance, the step's next token) into
    sampling, with no host round trip and no RNG in the captured work.

    Args:
        logits: (..., V) raw logits. noise: (..., V) fp32 Exp(1) draws (`race_noise_`), fresh per use.
    Returns:
        (..., V) fp32 scores.
    """
    return probabilities(logits, params) / noise

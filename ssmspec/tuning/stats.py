"""Acceptance statistics: per depth and sibling rank, how often the target accepts the drafted token.

Measured along the target's own continuation of each prompt (from the public decode loop,
`generate` with method ar) with one forward pass of each model over prompt + continuation:

- greedy: the child of rank r below a node is accepted iff the target's next token is the
  drafter's r-th best there. A start position s (any produced token, as the root of a step)
  reaches depth d when the tokens at depths 1..d-1 all had ranks below the measured width, so
  the counts are exactly those a full tree of that width and depth would give from every start.
- temperature T: children are drawn i.i.d. from the drafter's q and verified by multi-step
  speculative sampling (decoding/acceptance.py). The r-th draw is accepted with probability
  beta_r = sum_x min(res_r(x), q(x)), res_0 = p, res_{r+1} = normalise((res_r - q)+), so
  P(rank r accepted) = beta_r * prod_{i<r} (1 - beta_i), in closed form from p and q. Depth
  weights multiply the probabilities that some child was accepted at the depths above, along
  the target's sampled continuation (whose tokens are distributed as the accepted ones are).

`acceptance()[d][r]` is then P(the rank-r child at depth d + 1 is accepted | its parent was).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ssmspec.errors import InputError

ProgressFn = Callable[[str, int, int], None]


@dataclass
class AcceptanceStats:
    """Weighted counts behind the acceptance vector of one temperature."""

    temperature: float
    depth: int
    width: int
    reached: list[float]
    """reached[d]: (weighted) steps whose node at depth d was accepted (d = 0: every step)."""
    accepted: list[list[float]]
    """accepted[d][r]: of those, the steps whose rank-r child at depth d + 1 was accepted."""
    prompts: int = 0
    tokens: int = 0
    """Continuation tokens measured over all prompts."""

    @classmethod
    def empty(cls, temperature: float, depth: int, width: int) -> "AcceptanceStats":
        return cls(temperature, depth, width, [0.0] * depth, [[0.0] * width for _ in range(depth)])

    def acceptance(self) -> list[list[float]]:
        """a[d][r] = accepted[d][r] / reached[d] (0 where depth d was never reached)."""
        return [[c / n if n > 0 else 0.0 for c in row] for row, n in zip(self.accepted, self.reached)]

    def add(self, per_position: torch.Tensor) -> None:
        """Add one continuation: per_position (L, R) P(rank r accepted) at each root position."""
        a = per_position.double()
        length = a.shape[0]
        any_accepted = a.sum(-1)  # (L,)
        weight = torch.ones(length, dtype=torch.float64)  # P(reach depth d-1) from each start
        for d in range(min(self.depth, length)):
            starts = length - d  # starts s whose depth-(d+1) position s + d exists
            self.reached[d] += float(weight[:starts].sum())
            row = (weight[:starts, None] * a[d:d + starts]).sum(0)
            for r in range(self.width):
                self.accepted[d][r] += float(row[r])
            weight = weight[:starts - 1] * any_accepted[d:d + starts - 1]  # accepted at depth d + 1 too
        self.tokens += length

    def to_json(self) -> dict:
        return {"temperature": self.temperature, "depth": self.depth, "width": self.width,
                "prompts": self.prompts, "tokens": self.tokens, "reached": self.reached,
                "accepted": self.accepted, "acceptance": self.acceptance()}

    @classmethod
    def from_json(cls, d: dict) -> "AcceptanceStats":
        return cls(float(d["temperature"]), int(d["depth"]), int(d["width"]), [float(x) for x in d["reached"]],
                   [[float(x) for x in row] for row in d["accepted"]], int(d.get("prompts", 0)), int(d.get("tokens", 0)))


def rank_acceptance(draft_logits: torch.Tensor, next_ids: torch.Tensor, width: int) -> torch.Tensor:
    """Greedy: (L, R) one-hot at the rank of next_ids among the drafter's logits (zeros past R).

    Args:
        draft_logits: (L, V) the drafter's logits at each root position; next_ids: (L,) the
            target's (greedy) token after it.
    """
    chosen = draft_logits.gather(-1, next_ids[:, None])  # (L, 1)
    rank = (draft_logits > chosen).sum(-1)  # (L,) tokens the drafter prefers to the target's
    out = torch.zeros(next_ids.shape[0], width, dtype=torch.float64)
    hit = rank < width
    out[hit.nonzero()[:, 0], rank[hit]] = 1.0
    return out


def sampled_acceptance(p: torch.Tensor, q: torch.Tensor, width: int) -> torch.Tensor:
    """(L, R) P(the r-th of i.i.d. draws from q is the one accepted), multi-step speculative sampling.

    Args:
        p: (L, V) target distributions; q: (L, V) drafter distributions, at the same positions.
    """
    p, q = p.double(), q.double()
    out = torch.zeros(p.shape[0], width, dtype=torch.float64)
    survive = torch.ones(p.shape[0], dtype=torch.float64)
    residual = p
    for r in range(width):
        beta = torch.minimum(residual, q).sum(-1).clamp(0.0, 1.0)
        out[:, r] = survive * beta
        survive = survive * (1.0 - beta)
        nxt = (residual - q).clamp(min=0.0)
        total = nxt.sum(-1, keepdim=True)
        # total == 0 only where residual == q: no rejection can happen there (acceptance.py keeps r).
        residual = torch.where(total > 1e-12, nxt / total.clamp(min=1e-30), residual)
    return out


@torch.no_grad()
def collect_acceptance(
    target,
    drafter,
    prompts: Sequence[Sequence[int]],
    *,
    temperatures: Sequence[float] = (0.0,),
    max_new_tokens: int = 64,
    depth: int = 8,
    width: int = 8,
    seed: int = 0,
    progress: ProgressFn | None = None,
) -> dict[float, AcceptanceStats]:
    """Acceptance statistics of `drafter` (a LanguageModel) against `target` per temperature.

    Args:
        prompts: token-id lists (each non-empty).
        depth, width: the deepest level and the most sibling ranks measured.
    Returns: {temperature: AcceptanceStats}.
    """
    from ssmspec.decoding.engine import Engine
    from ssmspec.decoding.generate import GenerationConfig
    from ssmspec.decoding.sampling import SamplingParams, probabilities

    if not prompts:
        raise InputError("no prompts to measure acceptance on")
    engine = Engine(target)  # the target's decoding, its graphs kept across the prompts
    out = {}
    total, done = len(prompts) * len(temperatures), 0
    for temp in temperatures:
        stats = AcceptanceStats.empty(float(temp), depth, width)
        params = SamplingParams(float(temp))
        for i, ids in enumerate(prompts):
            if progress:
                progress(f"acceptance T={temp:g} prompt {i + 1}", done, total)
            cfg = GenerationConfig(method="ar", max_new_tokens=max_new_tokens, temperature=float(temp), seed=seed + i)
            produced = engine.generate(list(ids), cfg).token_ids
            full = torch.tensor([list(ids) + produced], dtype=torch.long)
            start = len(ids)  # the first produced token is the first step's root
            if len(produced) < 2:
                continue
            # logits at the root positions start .. end-1 predict the tokens after them
            d_logits = drafter(full.to(drafter.device))[0, start:-1].float().cpu()  # (L, V)
            next_ids = full[0, start + 1:]
            if params.greedy:
                per_position = rank_acceptance(d_logits, next_ids, width)
            else:
                t_logits = target(full.to(target.device))[0, start:-1].float().cpu()  # (L, V)
                per_position = sampled_acceptance(probabilities(t_logits, params), probabilities(d_logits, params), width)
            stats.add(per_position)
            stats.prompts += 1
            done += 1
        out[float(temp)] = stats
    if progress:
        progress("acceptance measured", total, total)
    return out

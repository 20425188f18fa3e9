"""Static tree choice: enumerate configurations, predict tokens/s from acceptance and profile.json.

One decoding step is predicted as what the greedy decode loop runs (decoding/generate.py, one
captured iteration per step):

    step_ms(tree) = target_ms(N)                      the profile's stree fit: verify N nodes + replay
                  + root_ms + sum_d level_ms(W_d)     the fused draft (drafters.FusedGreedyDraft):
                                                      commit + root step, then every level d = 1..g
                                                      (the deepest too) at its width W_d
                  + overhead_ms                       the loop's host work per iteration (read-back,
                                                      Python), measured on a real decode loop

with level_ms interpolated between the widths the profile timed (profiling.fits.by_width).
Predicted tokens/s = expected tokens per step / step time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Sequence

from ssmspec.errors import InputError
from ssmspec.profiling.fits import by_width
from ssmspec.trees import Tree

from .expected import Acceptance, best_trees, expected_tree_length


@dataclass(frozen=True)
class CostModel:
    """Milliseconds of a decoding step's parts, read from profile.json (see the module docstring)."""

    target_fit: object
    """n -> ms of one target verify+replay call on n packed nodes (a profiling.Fit)."""
    root_ms: float
    """The fused draft's fixed part: commit the accepted row, step the root."""
    level_widths: tuple[int, ...]
    level_ms: tuple[float, ...]
    """One fused draft level's median at each measured width (ascending widths)."""
    overhead_ms: float = 0.0
    """The decode loop's per-iteration work outside the iteration's device time."""
    ar_step_ms: float | None = None
    max_size: int | None = None
    """Largest target call measured: the fit is extrapolated past it."""

    @classmethod
    def from_profile(cls, profile) -> "CostModel":
        """From a loaded `ssmspec.profiling.Profile`; refuses one without drafter timings."""
        data = profile.to_dict()
        d = data.get("drafter_timings")
        if not d or not d.get("levels"):
            raise InputError("the profile has no drafter timings; re-run `ssmspec profile --target DIR --drafter DIR`")
        levels = sorted((int(r["width"]), float(r["median"])) for r in d["levels"])
        method = "stree" if "stree" in data["fits"] else next(iter(data["fits"]))
        return cls(profile.fit(method), float(d["root"]["median"]), tuple(w for w, _ in levels),
                   tuple(m for _, m in levels), float(d["iteration_overhead_ms"]),
                   profile.ar_step_ms or d.get("target_step_ms"),
                   max(data["settings"]["sizes"], default=None))

    def target_ms(self, nodes: int) -> float:
        return float(self.target_fit(nodes))

    def draft_level_ms(self, width: int) -> float:
        """One fused draft level of `width` nodes (see profiling.fits.by_width)."""
        return by_width(self.level_widths, self.level_ms, width)

    def draft_ms_of(self, tree: Tree) -> float:
        """The fused draft of `tree`: root, then one level per depth 1..g."""
        return self.root_ms + sum(self.draft_level_ms(w) for w in tree.level_widths()[1:])

    def step_ms(self, tree: Tree) -> float:
        return self.target_ms(tree.num_nodes) + self.draft_ms_of(tree) + self.overhead_ms

    @property
    def lambda_gamma(self) -> float | None:
        """The bandit's T_draft / T_target: one draft level at width 1 over the AR step (None without it)."""
        if not self.ar_step_ms or not math.isfinite(self.ar_step_ms):
            return None
        return self.draft_level_ms(1) / self.ar_step_ms


@dataclass
class Prediction:
    """One candidate tree's predicted tokens per step and speed, and its step time's parts."""

    tree: Tree
    expected_tokens: float
    target_ms: float
    draft_ms: float
    overhead_ms: float = 0.0
    extrapolated: bool = False
    """The tree is larger than any target call the profile measured."""

    @property
    def step_ms(self) -> float:
        return self.target_ms + self.draft_ms + self.overhead_ms

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 * self.expected_tokens / self.step_ms if self.step_ms > 0 else 0.0

    def to_json(self) -> dict:
        return {"tree": self.tree.spec(), **self.tree.to_json(), "nodes": self.tree.num_nodes,
                "depth": self.tree.max_depth, "expected_tokens": self.expected_tokens,
                "target_ms": self.target_ms, "draft_ms": self.draft_ms, "overhead_ms": self.overhead_ms,
                "step_ms": self.step_ms, "tokens_per_s": self.tokens_per_s, "extrapolated": self.extrapolated}


def enumerate_configs(budget: int, max_depth: int, max_width: int | None = None) -> Iterator[tuple[int, ...]]:
    """Every configuration (N1, ..., Ng), 1 <= g <= max_depth, whose tree has <= budget nodes (root included)."""
    if budget < 2:
        raise InputError(f"--budget must allow at least one drafted node (>= 2 nodes), got {budget}")
    if max_depth < 1:
        raise InputError(f"--max-depth must be >= 1, got {max_depth}")
    cap = max_width or budget

    def extend(prefix: tuple[int, ...], nodes: int, level: int):
        if prefix:
            yield prefix
        if len(prefix) == max_depth:
            return
        for n in range(1, cap + 1):
            if nodes + level * n > budget:
                break
            yield from extend(prefix + (n,), nodes + level * n, level * n)

    yield from extend((), 1, 1)


def predict(tree: Tree, acceptance: Acceptance, cost: CostModel) -> Prediction:
    return Prediction(tree, expected_tree_length(tree, acceptance), cost.target_ms(tree.num_nodes), cost.draft_ms_of(tree),
                      cost.overhead_ms, cost.max_size is not None and tree.num_nodes > cost.max_size)


def rank_trees(acceptance: Acceptance, cost: CostModel, *, budget: int, max_depth: int,
               candidates: Sequence[Tree] = (), max_width: int | None = None, with_dp: bool = True) -> list[Prediction]:
    """Predictions for every configuration under the budget (or just `candidates` when given),
    plus the dynamic program's best arbitrary tree at each size, best predicted tokens/s first."""
    trees: dict[tuple, Tree] = {}
    if candidates:
        trees.update((t.parents, t) for t in candidates)
    else:
        for cfg in enumerate_configs(budget, max_depth, max_width):
            t = Tree.from_config(cfg)
            trees[t.parents] = t
    if with_dp:
        # The DP maximises tokens per step at a node count; speed needs each size's time, so one per size.
        width = max_width or max((len(r) for r in acceptance), default=1)
        for t, _ in best_trees(acceptance, budget, max_depth, width)[1:]:
            trees.setdefault(t.parents, t)
    # A root alone drafts nothing: that is plain decoding, reported beside the ranking instead.
    preds = [predict(t, acceptance, cost) for t in trees.values() if t.num_drafted > 0]
    preds.sort(key=lambda p: (-p.tokens_per_s, p.tree.num_nodes, p.tree.spec()))
    return preds


def ar_tokens_per_s(cost: CostModel) -> float | None:
    """Plain decoding's speed from the profile's autoregressive step, for reference."""
    return None if not cost.ar_step_ms or not math.isfinite(cost.ar_step_ms) else 1000.0 / cost.ar_step_ms

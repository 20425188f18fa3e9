"""`tune-tree`'s library side: measure acceptance, rank trees, verify by decoding, run the bandit."""
from __future__ import annotations

import datetime as _dt
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

from ssmspec.errors import InputError
from ssmspec.trees import Tree, TreeArms

from .bandit import UCBTreePolicy, step_overhead_s
from .static import CostModel, Prediction, ar_tokens_per_s, rank_trees
from .stats import AcceptanceStats, collect_acceptance
from .treefile import MODES, TREE_FILE_SCHEMA, TREE_FILE_VERSION

ProgressFn = Callable[[str, int, int], None]


@dataclass
class TuneSettings:
    """What `tune` measures and chooses; each default lives here."""

    mode: str = "both"
    """static (rank trees, verify the best), bandit (run the UCB bandit over arms) or both (keep the faster)."""
    budget: int = 64
    """Most nodes of a tree, root included (the target call's size)."""
    max_depth: int = 8
    width: int = 8
    """Sibling ranks measured: the most children a node may get."""
    temperature: float = 0.0
    max_new_tokens: int = 64
    """Tokens generated per prompt, for the statistics and for each measured decode."""
    verify_top: int = 3
    """Best predicted trees verified by decoding (0: trust the prediction)."""
    arms: int = 3
    """Bandit arms when no candidates are given: the best predicted tree of each depth, best first."""
    lambda_ucb: float = TreeArms.__dataclass_fields__["lambda_ucb"].default
    lambda_gamma: float | None = None
    """None: the profile's T_draft / T_target."""
    state: str = "keep"
    """The written bandit's state policy: keep (learn across requests) or request (reset per request)."""
    seed: int = 0
    candidates: tuple[Tree, ...] = field(default=())
    """Trees to rank (and bandit arms) instead of every configuration under the budget."""

    def validate(self) -> None:
        if self.mode not in MODES:
            raise InputError(f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        for name in ("budget", "max_depth", "width", "max_new_tokens", "arms"):
            if getattr(self, name) < 1:
                raise InputError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.budget < 2:
            raise InputError(f"--budget must allow one drafted node (>= 2), got {self.budget}")
        if self.verify_top < 0:
            raise InputError(f"--verify-top must be >= 0, got {self.verify_top}")
        if self.temperature < 0:
            raise InputError(f"--temperature must be >= 0, got {self.temperature}")
        for t in self.candidates:
            if t.num_nodes > self.budget or t.max_depth > self.max_depth:
                raise InputError(f"candidate {t.spec()} has {t.num_nodes} nodes and depth {t.max_depth}: "
                                 f"beyond --budget {self.budget} / --max-depth {self.max_depth}")
            # Ranks past --width are not measured, and the prediction counts them as never accepted.
            widest = max(len(children) for children in t.child_lists())
            if widest > self.width:
                raise InputError(f"candidate {t.spec()} has up to {widest} children per node: beyond --width "
                                 f"{self.width} (the sibling ranks measured); raise --width")

    def to_json(self) -> dict:
        d = asdict(self)
        d["candidates"] = [t.spec() for t in self.candidates]
        return d


@dataclass
class Measured:
    tree: Tree
    predicted: Prediction | None
    tokens_per_s: float
    tokens_per_step: float
    steps: int

    @property
    def step_ms(self) -> float | None:
        """Measured wall time per decoding step (tokens per step over tokens/s)."""
        return 1000.0 * self.tokens_per_step / self.tokens_per_s if self.tokens_per_s > 0 else None

    def to_json(self) -> dict:
        p = self.predicted
        return {"tree": self.tree.spec(), "predicted_tokens_per_s": None if p is None else p.tokens_per_s,
                "measured_tokens_per_s": self.tokens_per_s,
                "predicted_tokens": None if p is None else p.expected_tokens,
                "measured_tokens": self.tokens_per_step, "steps": self.steps,
                "predicted_step_ms": None if p is None else p.step_ms,
                "predicted_parts_ms": None if p is None else {"target": p.target_ms, "draft": p.draft_ms,
                                                             "overhead": p.overhead_ms},
                "measured_step_ms": self.step_ms,
                "error": None if p is None or self.tokens_per_s <= 0 else p.tokens_per_s / self.tokens_per_s - 1.0}


@dataclass
class TuneResult:
    choice: Tree | TreeArms
    stats: dict[float, AcceptanceStats]
    predictions: list[Prediction]
    measured: list[Measured]
    policy: UCBTreePolicy | None
    bandit_tokens_per_s: float | None
    bandit_overhead: float | None
    """The policy's choose() + observe() time over a decoding step's time (bandit mode)."""
    ar_tokens_per_s: float | None
    lambda_gamma: float

    def to_json(self, settings: TuneSettings, meta: dict) -> dict:
        d = {"schema": TREE_FILE_SCHEMA, "version": TREE_FILE_VERSION,
             "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "mode": settings.mode}
        if isinstance(self.choice, TreeArms):
            d["bandit"] = self.choice.to_json()
        else:
            d["tree"] = self.choice.to_json()
        d.update(meta)
        d["settings"] = {**settings.to_json(), "lambda_gamma": self.lambda_gamma}
        d["statistics"] = [s.to_json() for s in self.stats.values()]
        d["predictions"] = [p.to_json() for p in self.predictions[:50]]
        d["measured"] = [m.to_json() for m in self.measured]
        d["bandit_run"] = None if self.policy is None else {
            **self.policy.summary(), "history": [list(h) for h in self.policy.history],
            "measured_tokens_per_s": self.bandit_tokens_per_s, "overhead_fraction": self.bandit_overhead}
        return d


def measure_decoding(engine, prompts: Sequence[Sequence[int]], tree: Tree | None, settings: TuneSettings,
                     policy: UCBTreePolicy | None = None) -> tuple[float, float, int]:
    """Decode every prompt with `tree` (or `policy`) on `engine` (decoding.Engine, with a
    drafter); returns (decode tokens/s, tokens per step, steps).

    Speed counts decoding only (tokens after the first over the time after the prefill), after
    one untimed warm-up generation that builds the tree's buffers and graphs.
    """
    from ssmspec.decoding.generate import GenerationConfig

    def config(n: int, policy) -> GenerationConfig:
        return GenerationConfig(method="stree", tree=tree, max_new_tokens=n, temperature=settings.temperature,
                                seed=settings.seed, tree_policy=policy)

    # Warm-up on the same buffers; a throwaway copy of the policy tries every arm once (unpulled first).
    warm = None if policy is None else UCBTreePolicy(policy.arms, policy.lambda_ucb, policy.lambda_gamma, "keep")
    warm_tokens = 8 if policy is None else len(policy.arms) * (policy.largest.max_depth + 1) + 1
    engine.generate(list(prompts[0]), config(warm_tokens, warm))
    tokens, seconds, steps = 0, 0.0, 0
    for ids in prompts:
        s = engine.generate(list(ids), config(settings.max_new_tokens, policy)).stats
        tokens += s["new_tokens"] - 1
        seconds += s["elapsed_s"] - s["prefill_s"]
        steps += s["target_calls"]
    return (tokens / seconds if seconds > 0 else 0.0), (tokens / steps if steps else 0.0), steps


def tune(target, drafter_model, prompts: Sequence[Sequence[int]], cost: CostModel, settings: TuneSettings,
         progress: ProgressFn | None = None) -> TuneResult:
    """Measure acceptance, rank trees, verify the best by decoding and/or run the bandit.

    Args:
        target, drafter_model: LanguageModels sharing a vocabulary, on one device.
        prompts: token-id lists. cost: the profile's cost model.
    """
    from ssmspec.decoding.drafters import ModelDrafter
    from ssmspec.decoding.engine import Engine

    settings.validate()
    if not prompts:
        raise InputError("no prompts: the prompts file must hold at least one prompt")
    temps = sorted({0.0, float(settings.temperature)})
    stats = collect_acceptance(target, drafter_model, prompts, temperatures=temps, max_new_tokens=settings.max_new_tokens,
                               depth=settings.max_depth, width=settings.width, seed=settings.seed, progress=progress)
    acceptance = stats[float(settings.temperature)].acceptance()
    if progress:
        progress("ranking trees", 0, 1)
    preds = rank_trees(acceptance, cost, budget=settings.budget, max_depth=settings.max_depth,
                       candidates=settings.candidates, max_width=settings.width, with_dp=not settings.candidates)
    lambda_gamma = settings.lambda_gamma if settings.lambda_gamma is not None else (cost.lambda_gamma or 0.0)
    engine = Engine(target, ModelDrafter(drafter_model))  # prepares both models for the kernels (in place)

    measured: list[Measured] = []
    if settings.mode in ("static", "both"):
        top = preds[:settings.verify_top]
        for i, p in enumerate(top):
            if progress:
                progress(f"decoding with {p.tree.spec()}", i, len(top))
            tps, tok, steps = measure_decoding(engine, prompts, p.tree, settings)
            measured.append(Measured(p.tree, p, tps, tok, steps))
    static_choice = max(measured, key=lambda m: m.tokens_per_s).tree if measured else preds[0].tree

    policy, bandit_tps, overhead = None, None, None
    if settings.mode in ("bandit", "both"):
        arms = list(settings.candidates) or best_per_depth(preds)[:settings.arms]
        policy = UCBTreePolicy(tuple(arms), settings.lambda_ucb, lambda_gamma, "keep")
        if progress:
            progress("running the bandit", 0, 1)
        bandit_tps, per_step, _ = measure_decoding(engine, prompts, None, settings, policy=policy)
        if bandit_tps > 0:
            overhead = step_overhead_s(policy) / (per_step / bandit_tps)
    arm_set = None if policy is None else TreeArms(policy.arms, settings.lambda_ucb, lambda_gamma, settings.state)
    if settings.mode == "static":
        choice = static_choice
    elif settings.mode == "bandit" or not measured:
        choice = arm_set
    else:  # both: whichever decoded faster
        best_static = max(m.tokens_per_s for m in measured)
        choice = arm_set if bandit_tps is not None and bandit_tps > best_static else static_choice
    if progress:
        progress("done", 1, 1)
    return TuneResult(choice, stats, preds, measured, policy, bandit_tps, overhead, ar_tokens_per_s(cost), lambda_gamma)


def best_per_depth(preds: Sequence[Prediction]) -> list[Tree]:
    """The best predicted tree of each depth, best first: arms that differ where the reward does
    (-(1 + lambda_gamma * depth) / tokens), rather than near-copies of the top tree."""
    by_depth: dict[int, Tree] = {}
    for p in preds:  # best first
        by_depth.setdefault(p.tree.max_depth, p.tree)
    return list(by_depth.values())


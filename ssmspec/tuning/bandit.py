"""The UCB bandit over tree shapes (mamba-drafters paper, section 4.2, eq. 1-2 and A.4).

Each decoding step is a round: the policy picks arm k (a tree), the target accepts some of its
drafted tokens, and the arm earns

    r = -(1 + lambda_gamma * g_k) / N_accept,

the step's time in target-call units (one target call plus g_k draft levels at lambda_gamma =
T_draft / T_target each) over the tokens it produced, negated: the inverse speedup (A.4), to
be maximised. N_accept counts the bonus token, so it is >= 1 and the reward is finite. The arm
chosen maximises mean reward + lambda_ucb * sqrt(2 ln t / n_k) (eq. 1; t = rounds so far).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from ssmspec.trees import Tree, TreeArms


def reward(tokens: int, depth: int, lambda_gamma: float) -> float:
    """-(1 + lambda_gamma * depth) / tokens, with tokens = accepted drafts + the bonus (>= 1)."""
    return -(1.0 + lambda_gamma * depth) / max(int(tokens), 1)


@dataclass
class UCBTreePolicy:
    """Chooses a tree per decoding step (`choose`), learns from what it produced (`observe`).

    This is the object `GenerationConfig.tree_policy` carries. Ties go to the arm pulled least,
    then to the earlier arm; arms never pulled are tried first, in order. `history` keeps
    (round, arm, tokens, reward) for plots; `begin_request` resets the statistics when `state`
    is "request". The decode loop queues each iteration before reading the last, so a step's
    `observe` comes after the next step's `choose` (the feedback is one step late).
    """

    arms: tuple[Tree, ...]
    lambda_ucb: float = TreeArms.__dataclass_fields__["lambda_ucb"].default
    lambda_gamma: float = TreeArms.__dataclass_fields__["lambda_gamma"].default
    state: str = TreeArms.__dataclass_fields__["state"].default
    pulls: list[int] = field(default_factory=list)
    reward_sums: list[float] = field(default_factory=list)
    token_sums: list[int] = field(default_factory=list)
    history: list[tuple[int, int, int, float]] = field(default_factory=list)
    _index: dict = field(default_factory=dict, repr=False)
    _in_flight: list[int] = field(default_factory=list, repr=False)  # chosen, not yet observed

    def __post_init__(self):
        # Validates the arms and options the same way a spec does.
        TreeArms(tuple(self.arms), self.lambda_ucb, self.lambda_gamma, self.state)
        self.arms = tuple(self.arms)
        self._index = {a.parents: k for k, a in enumerate(self.arms)}
        self.reset()

    @classmethod
    def from_arms(cls, spec: TreeArms, lambda_gamma: float | None = None) -> "UCBTreePolicy":
        return cls(spec.arms, spec.lambda_ucb, spec.lambda_gamma if lambda_gamma is None else lambda_gamma, spec.state)

    def to_arms(self) -> TreeArms:
        return TreeArms(self.arms, self.lambda_ucb, self.lambda_gamma, self.state)

    @property
    def largest(self) -> Tree:
        return self.to_arms().largest

    def reset(self) -> None:
        k = len(self.arms)
        self.pulls, self.reward_sums, self.token_sums = [0] * k, [0.0] * k, [0] * k
        self._in_flight = [0] * k
        self.history = []

    def begin_request(self) -> None:
        """Called by `generate` at the start of each generation. A step the last generation chose
        but never read (it ended first) will not be observed: nothing is in flight any more."""
        if self.state == "request":
            self.reset()
        self._in_flight = [0] * len(self.arms)

    @property
    def rounds(self) -> int:
        return sum(self.pulls)

    def means(self) -> list[float | None]:
        return [s / n if n else None for s, n in zip(self.reward_sums, self.pulls)]

    def scores(self) -> list[float]:
        """UCB index of every arm (inf for arms never pulled)."""
        t = max(self.rounds, 1)
        return [math.inf if n == 0 else s / n + self.lambda_ucb * math.sqrt(2.0 * math.log(t) / n)
                for s, n in zip(self.reward_sums, self.pulls)]

    def choose_index(self) -> int:
        # Ties (every unpulled arm's inf among them) go to the arm least pulled or in flight, so
        # that a step chosen before the last one is observed does not try the same new arm twice.
        scores = self.scores()
        return max(range(len(self.arms)), key=lambda k: (scores[k], -(self.pulls[k] + self._in_flight[k]), -k))

    def choose(self) -> Tree:
        k = self.choose_index()
        self._in_flight[k] += 1
        return self.arms[k]

    def observe(self, tree: Tree, produced_tokens: int) -> None:
        """The step drafted `tree` and produced `produced_tokens` (accepted drafts + the bonus)."""
        k = self._index.get(tree.parents)
        if k is None:
            raise ValueError(f"tree {tree.spec()} is not one of the bandit's arms")
        self._in_flight[k] = max(0, self._in_flight[k] - 1)
        self.update(k, produced_tokens)

    def update(self, k: int, produced_tokens: int) -> float:
        r = reward(produced_tokens, self.arms[k].max_depth, self.lambda_gamma)
        self.pulls[k] += 1
        self.reward_sums[k] += r
        self.token_sums[k] += int(produced_tokens)
        self.history.append((self.rounds, k, int(produced_tokens), r))
        return r

    def best_index(self) -> int:
        """The arm with the best mean reward so far (most pulled on ties; arm 0 before any pull)."""
        means = self.means()
        return max(range(len(self.arms)), key=lambda k: (-math.inf if means[k] is None else means[k], self.pulls[k], -k))

    def summary(self) -> dict:
        return {"spec": self.to_arms().spec(), "rounds": self.rounds, "pulls": list(self.pulls),
                "mean_reward": self.means(),
                "mean_tokens": [s / n if n else None for s, n in zip(self.token_sums, self.pulls)],
                "best": self.arms[self.best_index()].spec()}


def step_overhead_s(policy: UCBTreePolicy, rounds: int = 2000) -> float:
    """Seconds one choose() + observe() costs, timed on a fresh copy of `policy` (its arms, options)."""
    import time

    probe = UCBTreePolicy(policy.arms, policy.lambda_ucb, policy.lambda_gamma, policy.state)
    start = time.perf_counter()
    for i in range(rounds):
        probe.observe(probe.choose(), 1 + i % 3)
    return (time.perf_counter() - start) / rounds


def regret(policy_arms: Sequence[int], expected_rewards: Sequence[float]) -> list[float]:
    """Cumulative pseudo-regret after each round: sum over rounds of (best mean - chosen arm's mean)."""
    best = max(expected_rewards)
    out, total = [], 0.0
    for k in policy_arms:
        total += best - expected_rewards[k]
        out.append(total)
    return out

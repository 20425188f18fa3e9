"""The tree tuner's math on the CPU: UCB bandit, expected lengths, the DP tree, statistics, specs."""
from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

from ssmspec.decoding.acceptance import accept_sampled
from ssmspec.trees import Tree, TreeArms, TreeSpecError, parse_tree_spec
from ssmspec.tuning.bandit import UCBTreePolicy, regret, reward
from ssmspec.tuning.expected import best_tree, best_trees, expected_config_length, expected_tree_length
from ssmspec.tuning.stats import AcceptanceStats, sampled_acceptance

ARMS = (Tree.from_config((3, 2, 1)), Tree.from_config((2, 2, 2, 1)), Tree.from_config((1, 1, 1, 1, 1)))
# Tokens per step of each arm (uniform over the list) and the exact expected reward at lambda_gamma.
TOKENS = ([1, 2, 3], [2, 3, 4, 4], [1, 1, 2])
LAMBDA_GAMMA = 0.1


def _expected_rewards():
    return [float(np.mean([reward(n, arm.max_depth, LAMBDA_GAMMA) for n in toks])) for arm, toks in zip(ARMS, TOKENS)]


def _run(choose, update, rounds, rng):
    chosen = []
    for _ in range(rounds):
        k = choose()
        chosen.append(k)
        update(k, rng.choice(TOKENS[k]))
    return chosen


# -- bandit --------------------------------------------------------------------------------------------
def test_reward_is_the_inverse_speedup_and_never_divides_by_zero():
    assert reward(1, 3, 0.2) == pytest.approx(-(1 + 0.6))
    assert reward(4, 3, 0.2) == pytest.approx(-(1 + 0.6) / 4)
    # zero accepted drafts still produce the bonus token; a 0 passed in is treated as that one token
    assert reward(0, 3, 0.2) == reward(1, 3, 0.2)
    policy = UCBTreePolicy(ARMS, lambda_gamma=0.5)
    for arm in ARMS:
        policy.observe(arm, 0)
    assert all(math.isfinite(m) for m in policy.means())
    assert all(math.isfinite(s) for s in policy.scores())


def test_unpulled_arms_first_then_ties_go_to_the_least_pulled():
    policy = UCBTreePolicy(ARMS, lambda_ucb=0.0)
    assert policy.means() == [None, None, None] and policy.best_index() == 0
    order = []
    for _ in range(3):
        k = policy.choose_index()
        order.append(k)
        policy.update(k, 2 if k != 2 else 1)
    assert order == [0, 1, 2]  # every arm tried once, in order
    # Equal rewards with no exploration bonus: ties rotate through the least pulled arms.
    tied = UCBTreePolicy(ARMS[:2] + (Tree.from_config((2, 1, 1, 1)),), lambda_ucb=0.0, lambda_gamma=0.0)
    for _ in range(30):
        k = tied.choose_index()
        tied.update(k, 3)
    assert max(tied.pulls) - min(tied.pulls) <= 1
    with pytest.raises(ValueError, match="not one of the bandit's arms"):
        tied.observe(Tree.from_config((5,)), 1)


def test_a_choice_before_the_last_is_observed_tries_another_new_arm():
    """The decode loop chooses step k + 1's tree before it observes step k: the arms chosen and
    not yet observed count as tried, so the unpulled arms are still tried once each, in order;
    a new request forgets a choice the last one never observed."""
    policy = UCBTreePolicy(ARMS, lambda_ucb=0.0, state="keep")
    first, second = policy.choose(), policy.choose()
    assert (first, second) == (ARMS[0], ARMS[1])
    policy.observe(first, 2)
    assert policy.choose() == ARMS[2]
    policy.observe(second, 2)
    policy.begin_request()  # the third choice was never observed (its generation ended first)
    assert policy._in_flight == [0, 0, 0] and policy.pulls == [1, 1, 0]
    assert policy.choose() == ARMS[2]


def test_ucb_regret_grows_logarithmically_while_uniform_grows_linearly():
    means = _expected_rewards()
    best = int(np.argmax(means))
    gaps = sorted(max(means) - m for m in means)
    assert gaps[1] > 0.05  # the synthetic arms are distinguishable
    checkpoints = (1000, 4000, 16000)
    ucb_ratio, uniform = [], []
    for seed in range(3):
        rng = random.Random(seed)
        policy = UCBTreePolicy(ARMS, lambda_ucb=0.5, lambda_gamma=LAMBDA_GAMMA)
        chosen = _run(policy.choose_index, policy.update, checkpoints[-1], rng)
        reg = regret(chosen, means)
        ucb_ratio.append([reg[t - 1] / math.log(t) for t in checkpoints])
        assert policy.best_index() == best
        assert policy.pulls[best] > 0.9 * checkpoints[-1]
        urng = random.Random(100 + seed)
        uni = regret(_run(lambda: urng.randrange(len(ARMS)), lambda k, n: None, checkpoints[-1], rng), means)
        uniform.append([uni[t - 1] / t for t in checkpoints])
    ucb_ratio, uniform = np.mean(ucb_ratio, 0), np.mean(uniform, 0)
    # regret / log T stays bounded (does not grow with T) ...
    assert ucb_ratio[-1] < 1.5 * ucb_ratio[0]
    # ... while the uniform policy pays the mean gap every round: regret / T is constant.
    mean_gap = float(np.mean([max(means) - m for m in means]))
    assert np.allclose(uniform, mean_gap, rtol=0.15)
    assert ucb_ratio[-1] * math.log(checkpoints[-1]) < 0.2 * uniform[-1] * checkpoints[-1]


def test_request_state_resets_and_keep_state_learns_across_requests():
    for state, kept in (("request", False), ("keep", True)):
        policy = UCBTreePolicy(ARMS, state=state)
        policy.begin_request()
        policy.update(0, 3)
        policy.begin_request()
        assert (policy.rounds == 1) is kept


# -- expected length and the DP ---------------------------------------------------------------------
def _random_acceptance(rng: np.random.Generator, depth: int, width: int) -> list[list[float]]:
    rows = []
    for _ in range(depth):
        raw = rng.random(width + 1) ** 2  # the last entry: no child accepted
        raw[:width][rng.random(width) < 0.2] = 0.0  # some ranks never accepted (non-monotone vectors)
        rows.append(list(raw[:width] / raw.sum()))
    return rows


def _forests(n: int, height: int):
    """Every ordered forest of exactly n nodes whose trees have height <= height, as nested tuples."""
    if n == 0:
        yield ()
        return
    if height == 0:
        return
    for first in range(1, n + 1):
        for below in _forests(first - 1, height - 1):
            for rest in _forests(n - first, height):
                yield (below,) + rest


def _tree_of(forest) -> Tree:
    parents, queue = [-1], [(0, forest)]
    while queue:
        nxt = []
        for node, kids in queue:
            for sub in kids:
                parents.append(node)
                nxt.append((len(parents) - 1, sub))
        queue = nxt
    return Tree.from_parents(parents)


@pytest.mark.parametrize("seed", range(4))
def test_dp_tree_maximises_expected_length_against_brute_force(seed):
    rng = np.random.default_rng(seed)
    depth, width = 3, 3
    acc = _random_acceptance(rng, depth, width)
    best_values = {}
    for n in range(1, 8):
        values = [expected_tree_length(_tree_of(f), acc) for m in range(1, n + 1) for f in _forests(m - 1, depth)]
        best_values[n] = max(values)
    dp = best_trees(acc, 7, depth, width)
    for n in range(1, 8):
        tree, value = dp[n - 1]
        assert tree.num_nodes <= n and (tree.max_depth if tree.num_nodes > 1 else 0) <= depth
        assert value == pytest.approx(expected_tree_length(tree, acc), abs=1e-12)
        assert value == pytest.approx(best_values[n], abs=1e-12)
    assert best_tree(acc, 7, depth, width)[1] == pytest.approx(best_values[7])


def test_config_expected_length_matches_the_tree_formula_and_monte_carlo():
    rng = np.random.default_rng(0)
    acc = _random_acceptance(rng, 5, 4)
    for config in ((3, 2, 2, 1), (4, 1, 1), (1, 1, 1, 1, 1), (2, 3)):
        e = expected_config_length(config, acc)
        assert e == pytest.approx(expected_tree_length(Tree.from_config(config), acc))
        # Simulate steps: at each depth one rank (or none) is the accepted child.
        steps = 200_000
        tokens = np.ones(steps)
        alive = np.ones(steps, dtype=bool)
        for d, width in enumerate(config):
            probs = np.array(acc[d] + [max(0.0, 1 - sum(acc[d]))])
            rank = rng.choice(len(probs), size=steps, p=probs / probs.sum())
            alive &= rank < width
            tokens += alive
        se = tokens.std() / math.sqrt(steps)
        assert abs(tokens.mean() - e) < 5 * se + 1e-9


def test_ranks_and_depths_past_the_vector_count_as_rejected():
    acc = [[0.5, 0.3]]
    assert expected_config_length((3, 2), acc) == pytest.approx(1 + 0.8)
    assert expected_config_length((1,), []) == 1.0


# -- statistics -------------------------------------------------------------------------------------
def test_greedy_counts_equal_a_full_tree_walk_from_every_start():
    rng = np.random.default_rng(1)
    depth, width, length = 4, 3, 60
    ranks = rng.integers(0, 5, size=length)  # ranks >= width are never drafted
    per_position = torch.zeros(length, width, dtype=torch.float64)
    hit = ranks < width
    per_position[np.nonzero(hit)[0], ranks[hit]] = 1.0
    stats = AcceptanceStats.empty(0.0, depth, width)
    stats.add(per_position)
    reached = np.zeros(depth)
    accepted = np.zeros((depth, width))
    for s in range(length):
        for d in range(depth):
            if s + d >= length:
                break
            reached[d] += 1
            if ranks[s + d] >= width:
                break
            accepted[d, ranks[s + d]] += 1
    assert np.allclose(stats.reached, reached) and np.allclose(stats.accepted, accepted)


def test_sampled_acceptance_matches_multi_step_speculative_sampling():
    gen = torch.Generator().manual_seed(0)
    vocab, width = 6, 3
    p = torch.softmax(torch.randn(vocab, generator=gen) * 2, -1)
    q = torch.softmax(torch.randn(vocab, generator=gen) * 2, -1)
    closed = sampled_acceptance(p[None], q[None], width)[0]
    tree = Tree.from_config((width,))
    counts = torch.zeros(width + 1)
    trials = 8_000
    for _ in range(trials):
        children = torch.multinomial(q, width, replacement=True, generator=gen)
        tokens = [0] + children.tolist()
        path, _ = accept_sampled(tree, tokens, p[None].expand(width + 1, vocab), q[None].expand(width + 1, vocab), gen)
        counts[path[1] - 1 if len(path) > 1 else width] += 1
    empirical = counts[:width] / trials
    assert torch.allclose(empirical.double(), closed, atol=0.02), (empirical, closed)


# -- specs and files --------------------------------------------------------------------------------
def test_bandit_spec_and_arm_set_files(tmp_path):
    arms = parse_tree_spec("bandit:4,2,1;3,2,2,1,1;2,2,2,1,1,1")
    assert isinstance(arms, TreeArms) and [a.config for a in arms.arms] == [(4, 2, 1), (3, 2, 2, 1, 1), (2, 2, 2, 1, 1, 1)]
    assert arms.largest.config == (3, 2, 2, 1, 1) and arms.state == "request"
    opts = parse_tree_spec("bandit[lambda_ucb=0.5,lambda_gamma=0.02,state=keep]:3,1;parents:-1,0,0")
    assert (opts.lambda_ucb, opts.lambda_gamma, opts.state) == (0.5, 0.02, "keep")
    assert parse_tree_spec(opts.spec()) == opts
    path = tmp_path / "tree.json"
    path.write_text(json.dumps({"bandit": opts.to_json()}))
    assert parse_tree_spec(str(path)) == opts


@pytest.mark.parametrize("spec, message", [
    ("bandit:", "malformed bandit spec"),
    ("bandit:3,2;;1", "empty"),
    ("bandit[x=1]:3", "unknown bandit option"),
    ("bandit[lambda_ucb=-1]:3", ">= 0"),
    ("bandit[state=sometimes]:3", "state"),
    ("bandit:3;3", "repeat"),
    ("bandit:3,0", ">= 1"),
    ("bandit:a,b", "malformed tree spec"),
    ("banditry:3", "brackets"),
])
def test_malformed_bandit_specs_are_one_line_errors(spec, message):
    with pytest.raises(TreeSpecError, match=message) as e:
        parse_tree_spec(spec)
    assert "\n" not in str(e.value)


def test_tree_file_schema_is_checked(tmp_path):
    path = tmp_path / "tree.json"
    for data, message in [({"schema": "other", "version": 1, "tree": {"config": [2]}}, "schema"),
                          ({"schema": "ssmspec.tree", "version": 9, "tree": {"config": [2]}}, "version"),
                          ({"schema": "ssmspec.tree", "version": 1}, "exactly one"),
                          ({"bandit": {"arms": [{"config": [2]}], "colour": 1}}, "unknown bandit field")]:
        path.write_text(json.dumps(data))
        with pytest.raises(TreeSpecError, match=message):
            parse_tree_spec(str(path))


def test_collect_acceptance_on_models():
    from helpers import tiny_model

    from ssmspec.tuning.stats import collect_acceptance

    target, other = tiny_model(seed=0).eval(), tiny_model(seed=1).eval()
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    same = collect_acceptance(target, target, prompts, temperatures=(0.0, 1.0), max_new_tokens=10, depth=3, width=2)
    for stats in same.values():  # the drafter is the target: its first child is always accepted
        assert stats.prompts == 2 and stats.tokens == 2 * 9
        for row in stats.acceptance():
            assert row[0] == pytest.approx(1.0, abs=1e-6) and row[1] == pytest.approx(0.0, abs=1e-6)
    diff = collect_acceptance(target, other, prompts, temperatures=(0.7,), max_new_tokens=10, depth=3, width=2)[0.7]
    for row in diff.acceptance():
        assert all(0.0 <= x <= 1.0 for x in row) and sum(row) <= 1.0 + 1e-9
    assert 0.0 < diff.acceptance()[0][0] < 1.0


def test_generation_config_sizes_everything_for_the_largest_arm():
    from ssmspec.decoding.generate import GenerationConfig

    arms = parse_tree_spec("bandit:4,2,1;3,2,2,1,1;2,2,2,1,1,1")
    cfg = GenerationConfig(tree=arms)
    assert isinstance(cfg.tree_policy, UCBTreePolicy) and cfg.tree.config == (3, 2, 2, 1, 1)
    given = UCBTreePolicy(ARMS)
    cfg = GenerationConfig(tree_policy=given)  # no tree given: not the default (3, 2, 1, 1) either
    assert cfg.tree_policy is given and cfg.tree == max(ARMS, key=lambda t: t.num_nodes)


def test_default_bandit_arms_are_the_best_tree_of_each_depth():
    from ssmspec.tuning.static import Prediction
    from ssmspec.tuning.tune import best_per_depth

    trees = [Tree.from_config(c) for c in ((2, 1, 1), (3, 1, 1), (2, 1), (1, 1, 1, 1), (4,))]
    preds = [Prediction(t, 2.0, 1.0, 0.0) for t in trees]  # already best first
    assert [t.config for t in best_per_depth(preds)] == [(2, 1, 1), (2, 1), (1, 1, 1, 1), (4,)]


# -- the cost model: a step is target fit(N) + fused draft (root + one level per depth) + loop overhead --
def _synthetic_profile(overhead=0.07):
    from ssmspec.profiling import Profile

    def level(w, ms):
        return {"width": w, "parent_width": w, "children": 1, "median": ms}

    return Profile({
        "settings": {"sizes": [1, 2, 4, 8, 16]},
        "timings": {"stree": [{"size": 1, "median": 0.25}, {"size": 2, "median": 0.31}]},
        "fits": {"stree": {"primary": "linear", "linear": {"coef": {"k": 0.01, "C": 0.3}, "r2": 1.0, "residuals": []},
                           "quadratic": {"coef": {"a": 0.0, "b": 0.01, "c": 0.3}, "r2": 1.0, "residuals": []}}},
        "drafter_timings": {"root": {"median": 0.05}, "iteration_overhead_ms": overhead, "target_step_ms": 0.25,
                            "levels": [level(4, 0.08), level(1, 0.06), level(2, 0.07)], "lambda_gamma": 0.24},
    })


def test_cost_model_composes_target_fused_draft_and_overhead():
    from ssmspec.tuning.static import CostModel, predict

    cost = CostModel.from_profile(_synthetic_profile())
    assert cost.level_widths == (1, 2, 4) and cost.overhead_ms == 0.07 and cost.max_size == 16
    chain = Tree.from_config((1, 1, 1, 1, 1))  # 6 nodes, five levels of width 1, the deepest included
    assert cost.draft_ms_of(chain) == pytest.approx(0.05 + 5 * 0.06)
    assert cost.step_ms(chain) == pytest.approx((0.01 * 6 + 0.3) + 0.05 + 5 * 0.06 + 0.07)
    tree = Tree.from_config((3, 2))  # levels of 3 (between measured 2 and 4) and 6 (past them, extended)
    assert cost.draft_ms_of(tree) == pytest.approx(0.05 + 0.075 + 0.09)  # 0.08 + 2 widths x 0.005
    p = predict(tree, [[0.5, 0.2, 0.1], [0.5, 0.2]], cost)
    assert (p.target_ms, p.draft_ms, p.overhead_ms) == pytest.approx((0.01 * 10 + 0.3, 0.215, 0.07))
    assert p.step_ms == pytest.approx(cost.step_ms(tree))
    assert p.tokens_per_s == pytest.approx(1000 * p.expected_tokens / p.step_ms)
    assert p.to_json()["overhead_ms"] == 0.07 and p.to_json()["step_ms"] == pytest.approx(p.step_ms)
    # the bandit's default lambda_gamma uses the same draft cost: one level at width 1 over the AR step
    assert cost.lambda_gamma == pytest.approx(0.06 / 0.25)
    # the overhead moves every prediction: a slower loop favours deeper trees (fewer iterations per token)
    fast = CostModel.from_profile(_synthetic_profile(overhead=0.0))
    assert fast.step_ms(chain) == pytest.approx(cost.step_ms(chain) - 0.07)


def test_cost_model_refuses_a_profile_without_drafter_timings():
    from ssmspec.errors import InputError
    from ssmspec.tuning.static import CostModel

    prof = _synthetic_profile()
    prof.data["drafter_timings"] = None
    with pytest.raises(InputError, match="--drafter"):
        CostModel.from_profile(prof)

"""Verification rules on fixed distributions: accept-all, accept-none, partial, and exactness."""
import itertools

import pytest
import torch

from ssmspec.decoding.acceptance import accept_deterministic, accept_sampled
from ssmspec.decoding.sampling import SamplingParams, probabilities
from ssmspec.trees import Tree

V = 5


def one_hot_rows(ids):
    return torch.nn.functional.one_hot(torch.tensor(ids), V).float()


def test_greedy_accepts_the_whole_matching_path():
    tree = Tree.from_config((2, 1))  # 0 -> {1, 2}; 1 -> 3; 2 -> 4
    tokens = [0, 3, 1, 4, 2]
    # target argmax at each node: root -> 1 (node 2), node 2 -> 2 (node 4), node 4 -> 0 (bonus)
    p = one_hot_rows([1, 0, 2, 0, 0])
    path, bonus = accept_deterministic(tree, tokens, p, None)
    assert path == [0, 2, 4] and bonus == 0


def test_greedy_accepts_nothing_when_no_child_matches():
    tree = Tree.from_config((2,))
    path, bonus = accept_deterministic(tree, [0, 3, 4], one_hot_rows([1, 0, 0]), None)
    assert path == [0] and bonus == 1


def test_partial_acceptance_stops_at_first_mismatch():
    tree = Tree.chain(3)
    tokens = [0, 1, 2, 3]
    p = one_hot_rows([1, 2, 4, 0])  # accepts 1, 2, then wants 4 instead of 3
    path, bonus = accept_deterministic(tree, tokens, p, None)
    assert path == [0, 1, 2] and bonus == 4


def test_sampled_rule_accepts_all_when_drafter_equals_target():
    tree = Tree.chain(3)
    p = torch.softmax(torch.randn(4, V), -1)
    q = torch.zeros(4, V)
    q[1:] = p[:-1]  # node c was drawn from its parent's distribution, identical to the target's
    gen = torch.Generator().manual_seed(1)
    for _ in range(50):
        tokens = [0] + [int(torch.multinomial(q[c], 1, generator=gen)) for c in range(1, 4)]
        path, _ = accept_sampled(tree, tokens, p, q, gen)
        assert path == [0, 1, 2, 3]


def test_sampled_rule_rejects_tokens_the_target_never_produces():
    tree = Tree.from_config((3,))
    p = torch.tensor([[0.0, 0.0, 0.0, 0.5, 0.5]] * 4)
    q = torch.tensor([[1 / 3, 1 / 3, 1 / 3, 0.0, 0.0]] * 4)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        path, bonus = accept_sampled(tree, [4, 0, 1, 2], p, q, gen)
        assert path == [0] and bonus in (3, 4)


def _exact_first_token_distribution(rule, tree, p, q_dist, draws):
    """P(first emitted token) under a rule, by enumerating every draw of the children."""
    n_children = len(tree.children(0))
    out = torch.zeros(V)
    for children in itertools.product(range(V), repeat=n_children):
        weight = float(torch.prod(torch.tensor([q_dist[c] for c in children])))
        if weight == 0:
            continue
        tokens = [0, *children]
        q = torch.stack([q_dist] * (1 + n_children))
        counts = torch.zeros(V)
        gen = torch.Generator().manual_seed(0)
        for _ in range(draws):
            path, bonus = rule(tree, tokens, torch.stack([p] * tree.num_nodes), q, gen)
            counts[tokens[path[1]] if len(path) > 1 else bonus] += 1
        out += weight * counts / draws
    return out


@pytest.mark.parametrize("siblings", [1, 2, 3])
def test_multi_step_speculative_sampling_is_exact(siblings):
    # With i.i.d. children from q, the first emitted token must be distributed as p.
    torch.manual_seed(siblings)
    p = torch.softmax(torch.randn(V) * 1.5, -1)
    q = torch.softmax(torch.randn(V) * 1.5, -1)
    dist = _exact_first_token_distribution(accept_sampled, Tree.from_config((siblings,)), p, q, draws=400)
    tv = 0.5 * (dist - p).abs().sum().item()
    assert tv < 0.04, f"total variation {tv:.3f} between emitted and target distributions"


def test_exactness_check_has_power():
    # Accepting drafts without correction must fail the same bound: the test above can fail.
    torch.manual_seed(1)
    p = torch.softmax(torch.randn(V) * 1.5, -1)
    q = torch.softmax(torch.randn(V) * 1.5, -1)

    def accept_always(tree, tokens, p_, q_, gen):
        return [0, 1], 0

    dist = _exact_first_token_distribution(accept_always, Tree.from_config((1,)), p, q, draws=1)
    assert 0.5 * (dist - p).abs().sum().item() > 0.04


def test_top_p_and_top_k_processing():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    probs = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (probs[0, 2:] == 0).all() and abs(probs.sum().item() - 1) < 1e-6
    probs = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.7))
    full = torch.softmax(logits, -1)[0]
    kept = (probs[0] > 0).sum().item()
    assert kept == 2 and full[0] < 0.7 <= full[:2].sum()
    greedy = probabilities(logits, SamplingParams())
    assert greedy[0].tolist() == [1, 0, 0, 0, 0]

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


# -- sampled_accept: SpecInfer on the device (the dispatched op) --------------------------------------

from scipy.stats import chi2_contingency, chisquare  # noqa: E402

from ssmspec.ops.sampled_accept import naive as sampled_accept_naive  # noqa: E402
from ssmspec.decoding.acceptance import children_table  # noqa: E402
from ssmspec.ops.dispatch import sampled_accept  # noqa: E402

SV = 4  # vocabulary of the exactness checks: every sequence of D + 1 tokens is a cell


def _prefix_tables(seed, depth, zeros, scale=1.5):
    """tables[k]: (SV**k, SV) a next-token distribution for every prefix of k tokens; with `zeros`,
    one token per row gets probability 0 (as top-k/top-p leave them), so residuals hit zeros."""
    g = torch.Generator().manual_seed(seed)
    tables = []
    for k in range(depth + 1):
        t = torch.softmax(torch.randn(SV ** k, SV, generator=g) * scale, -1)
        if zeros:
            t[torch.arange(SV ** k), torch.randint(0, SV, (SV ** k,), generator=g)] = 0
            t = t / t.sum(-1, keepdim=True)
        tables.append(t)
    return tables


def _device_iteration(tree, p_tables, q_tables, rows, seed, shared_uniform=False):
    """`rows` independent iterations: children drawn i.i.d. from q given their prefix, then the
    device rule with the target's p given each node's prefix. Returns (out, path_len)."""
    g = torch.Generator().manual_seed(seed)
    n = tree.num_nodes
    depth = tree.depth_tensor()
    tokens = torch.zeros(rows, n, dtype=torch.long)
    code = torch.zeros(rows, n, dtype=torch.long)  # node's prefix (its drafted tokens) in base SV
    for u in range(1, n):
        parent = tree.parents[u]
        q_parent = q_tables[tree.depths[parent]][code[:, parent]]
        tokens[:, u] = torch.multinomial(q_parent, 1, generator=g)[:, 0]
        code[:, u] = code[:, parent] * SV + tokens[:, u]
    p = torch.stack([p_tables[tree.depths[u]][code[:, u]] for u in range(n)], 1)  # (R, N, V)
    q = torch.stack([q_tables[tree.depths[u]][code[:, u]] for u in range(n)], 1)  # (R, N, V): u's children's law
    children = children_table(tree)
    uniforms = torch.rand(rows, n, children.shape[1], generator=g)
    if shared_uniform:  # a wrong variant: one uniform for all siblings of a node
        uniforms = uniforms[:, :, :1].expand_as(uniforms).contiguous()
    noise = torch.empty(rows, n, SV).exponential_(generator=g)
    paths = torch.zeros(n, tree.max_depth + 1, dtype=torch.long)
    for i in range(n):
        paths[i, :len(tree.path(i))] = torch.tensor(tree.path(i))
    path, path_len, out, last = sampled_accept(p, q, tokens, children, uniforms, noise, paths, depth)
    # the outputs are consistent with the walk: path = root-to-last, out = its tokens then the bonus
    for r in range(0, rows, max(1, rows // 50)):
        nodes = tree.path(int(last[r]))
        assert path[r, :len(nodes)].tolist() == nodes and int(path_len[r]) == len(nodes)
        assert out[r, :len(nodes) - 1].tolist() == tokens[r, nodes[1:]].tolist()
    return out, path_len


def _completed_counts(out, path_len, p_tables, seed):
    """Each row's produced tokens completed to D + 1 tokens by the target's own sampling:
    {sequence: count}. Exact acceptance makes these sequences the target's samples."""
    g = torch.Generator().manual_seed(seed)
    seq = out.clone()
    for k in range(seq.shape[1]):
        code = torch.zeros(seq.shape[0], dtype=torch.long)
        for i in range(k):
            code = code * SV + seq[:, i]
        drawn = torch.multinomial(p_tables[k][code], 1, generator=g)[:, 0]
        seq[:, k] = torch.where(path_len <= k, drawn, seq[:, k])
    counts = {}
    for row in map(tuple, seq.tolist()):
        counts[row] = counts.get(row, 0) + 1
    return counts


def _joint_pvalue(counts, p_tables, length, rows):
    observed, expected = [], []
    for seq in itertools.product(range(SV), repeat=length):
        prob, code = 1.0, 0
        for k, tok in enumerate(seq):
            prob *= float(p_tables[k][code, tok])
            code = code * SV + tok
        observed.append(counts.get(seq, 0))
        expected.append(prob * rows)
    keep = [i for i, e in enumerate(expected) if e >= 5]  # pool the rare cells
    obs = [observed[i] for i in keep] + [sum(observed) - sum(observed[i] for i in keep)]
    exp = [expected[i] for i in keep] + [rows - sum(expected[i] for i in keep)]
    return chisquare(obs, exp).pvalue


DEVICE_ROWS = 20000
POWER = dict(tree=Tree.from_config((2, 2)), scale=4.0, rows=50000)
"""Sharp tables (larger ratios p / q between 0 and 1) and more rows: a shared uniform biases
little elsewhere; the power checks below and one exactness case run here."""


@pytest.mark.parametrize("tree, zeros, scale, rows", [
    (Tree.from_config((2, 2)), False, 1.5, DEVICE_ROWS), (Tree.from_config((3, 1)), False, 1.5, DEVICE_ROWS),
    (Tree.chain(2), False, 1.5, DEVICE_ROWS), (Tree.from_config((2, 2)), True, 1.5, DEVICE_ROWS),
    (Tree.from_config((3, 1)), True, 1.5, DEVICE_ROWS), (POWER["tree"], False, POWER["scale"], POWER["rows"]),
], ids=["2,2", "3,1", "chain2", "2,2-zeros", "3,1-zeros", "power-setting"])
def test_sampled_accept_is_exact(tree, zeros, scale, rows):
    # Many independent rows: draft from q, accept on the device, complete with the target:
    # the sequences of D + 1 tokens must follow the target's exact joint (chi-square, 64 cells).
    p_tables = _prefix_tables(1, tree.max_depth, zeros, scale)
    q_tables = _prefix_tables(2, tree.max_depth, zeros, scale)
    out, path_len = _device_iteration(tree, p_tables, q_tables, rows, seed=3)
    assert len(set(path_len.tolist())) == tree.max_depth + 1  # every acceptance depth occurs
    counts = _completed_counts(out, path_len, p_tables, seed=4)
    assert _joint_pvalue(counts, p_tables, tree.max_depth + 1, rows) > 1e-3


@pytest.mark.parametrize("wrong", ["no-residual", "shared-uniform", "drafter-as-target"])
def test_sampled_accept_check_has_power(monkeypatch, wrong):
    # Accepting later siblings against p instead of the residual, one uniform for all siblings,
    # or completing with the drafter: the same check must reject each.
    tree, rows = POWER["tree"], POWER["rows"]
    p_tables = _prefix_tables(1, tree.max_depth, False, POWER["scale"])
    q_tables = _prefix_tables(2, tree.max_depth, False, POWER["scale"])
    if wrong == "no-residual":
        monkeypatch.setattr(sampled_accept_naive, "rejection_residual", lambda r, q: r)
    out, path_len = _device_iteration(tree, p_tables, q_tables, rows, seed=3, shared_uniform=wrong == "shared-uniform")
    reference = q_tables if wrong == "drafter-as-target" else p_tables
    counts = _completed_counts(out, path_len, reference, seed=4)
    assert _joint_pvalue(counts, p_tables, tree.max_depth + 1, rows) < 1e-3


def test_sampled_accept_matches_accept_sampled():
    # The host reference and the vectorised rule on the same fixed p, q and drafts (one per
    # children draw): the laws of (accepted path, bonus) must agree (two-sample chi-square).
    tree = Tree.from_config((2, 1))
    g = torch.Generator().manual_seed(5)
    n = tree.num_nodes
    p = torch.softmax(torch.randn(n, SV, generator=g) * 1.5, -1)
    q_by_parent = torch.softmax(torch.randn(n, SV, generator=g) * 1.5, -1)
    q_by_child = q_by_parent[torch.tensor([0] + list(tree.parents[1:]))]  # accept_sampled's q[c]
    draws = 3000
    tokens = torch.zeros(draws, n, dtype=torch.long)
    for u in range(1, n):
        tokens[:, u] = torch.multinomial(q_by_parent[tree.parents[u]], draws, replacement=True, generator=g)
    host = {}
    for row in tokens.tolist():
        path, bonus = accept_sampled(tree, row, p, q_by_child, g)
        host[(path[-1], bonus)] = host.get((path[-1], bonus), 0) + 1
    children = children_table(tree)
    paths = torch.zeros(n, tree.max_depth + 1, dtype=torch.long)
    for i in range(n):
        paths[i, :len(tree.path(i))] = torch.tensor(tree.path(i))
    _, path_len, out, last = sampled_accept(
        p.expand(draws, -1, -1), q_by_parent.expand(draws, -1, -1), tokens, children,
        torch.rand(draws, n, children.shape[1], generator=g), torch.empty(draws, n, SV).exponential_(generator=g),
        paths, tree.depth_tensor())
    bonus = out.gather(1, (path_len - 1)[:, None])[:, 0]
    device = {}
    for key in zip(last.tolist(), bonus.tolist()):
        device[key] = device.get(key, 0) + 1
    keys = sorted(set(host) | set(device))
    table = [[host.get(k, 0) for k in keys], [device.get(k, 0) for k in keys]]
    assert len(keys) > 8  # partial acceptance at every depth, several bonus tokens
    assert chi2_contingency(table).pvalue > 1e-3

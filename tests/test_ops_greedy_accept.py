"""Greedy tree acceptance (ops/greedy_accept): the reference against the host-side rule, the kernels
against the reference.

Same arrangement as tests/test_ops_triton.py: the default run checks the reference and spawns this
file in a child process with TRITON_INTERPRET=1, where the kernel tests below are defined and run
(mamba2-2.7b sizes and bf16 are in tests/gpu/test_greedy_accept_gpu.py).
"""
from __future__ import annotations

import os

import pytest
import torch

from ssmspec.ops.greedy_accept.naive import naive_greedy_accept
from ssmspec.trees import Tree

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

TREES = {  # N = 1, 4, 16, 31 and 70 nodes (more than one 64-node block of the accept kernel)
    "one node": Tree.from_parents([-1]),
    "chain of 3": Tree.chain(3),
    "3,4": Tree.from_config((3, 4)),
    "binary 2,2,2,2": Tree.from_config((2, 2, 2, 2)),
    "uneven 70": Tree.from_parents([-1] + [max(0, i - 1 - (i % 3) * (i % 5)) for i in range(1, 70)]),
}
PATTERNS = ("all", "none", "partial", "one path")


def tree_tensors(tree: Tree):
    """(parents, depth, mask, paths) as GreedyTreeGraph passes them; paths (N, D+1) padded with 0."""
    paths = torch.zeros(tree.num_nodes, tree.max_depth + 1, dtype=torch.long)
    for i in range(tree.num_nodes):
        p = tree.path(i)
        paths[i, : len(p)] = torch.tensor(p)
    return tree.parents_tensor(), tree.depth_tensor(), tree.mask_tensor(), paths


def plant(tree: Tree, batch: int, vocab: int, patterns, dtype=torch.float32, ties: bool = True):
    """Random logits (B, N, V) and tokens (B, N) with the given accept pattern per batch row.

    ties: every row's maximum is copied to a second, random position (before or after the first),
    so the argmax must take the lower one."""
    n = tree.num_nodes
    logits = torch.randn(batch, n, vocab).to(dtype)
    if ties and vocab > 1:
        top = logits.max(-1).values  # (B, N)
        other = torch.randint(0, vocab, (batch, n))
        logits.scatter_(-1, other[..., None], top[..., None])
    best = logits.float().argmax(-1)  # (B, N)
    tokens = torch.empty(batch, n, dtype=torch.long)
    for b in range(batch):
        pattern = patterns[b % len(patterns)]
        on_path = set(tree.path(int(torch.randint(0, n, ()))))
        for i in range(n):
            parent = max(tree.parents[i], 0)
            accept = {"all": True, "none": False, "partial": bool(torch.rand(()) < 0.6), "one path": i in on_path}[pattern]
            tokens[b, i] = best[b, parent] if accept else (best[b, parent] + 1 + int(torch.randint(0, vocab - 1, ()))) % vocab
    tokens[:, 0] = torch.randint(0, vocab, (batch,))  # the root's token is never checked
    return logits, tokens


def test_reference_agrees_with_the_host_rule():
    """With distinct tokens among siblings (as drafters make them), the deepest survivor is the
    end of accept_greedy's descent, and the produced tokens are its path's tokens then the bonus."""
    from ssmspec.decoding.acceptance import accept_greedy

    for name, tree in TREES.items():
        args = tree_tensors(tree)
        for pattern in PATTERNS:
            logits, tokens = plant(tree, 1, 50, [pattern])
            best = logits.argmax(-1)[0]
            for kids in tree.child_lists():  # a repeated sibling token becomes one past the vocabulary
                seen = set()
                for c in kids:
                    if int(tokens[0, c]) in seen:
                        tokens[0, c] = 50 + c
                    seen.add(int(tokens[0, c]))
            path, path_len, out, last = naive_greedy_accept(logits, tokens, *args)
            want_path, bonus = accept_greedy(tree, tokens[0].tolist(), best.tolist())
            n = len(want_path)
            assert path[0, :n].tolist() == want_path and int(path_len[0]) == n and int(last[0]) == want_path[-1], name
            assert out[0].tolist() == tokens[0, want_path[1:]].tolist() + [bonus] + [0] * (tree.max_depth + 1 - n)
            if pattern == "none":
                assert n == 1


def test_reference_tie_rules():
    """Argmax ties -> lowest vocabulary index; equally deep survivors -> lowest packed index."""
    tree = Tree.from_config((3,))
    logits = torch.randn(1, 4, 10) - 10
    logits[0, 0, [7, 2, 5]] = 3.0  # root: 2 wins
    logits[0, 1:, [9, 4]] = 1.0  # after each child: 4 wins
    tokens = torch.tensor([[0, 2, 2, 2]])  # all three children accepted, depth 1
    path, path_len, out, last = naive_greedy_accept(logits, tokens, *tree_tensors(tree))
    assert path.tolist() == [[0, 1]] and path_len.tolist() == [2] and last.tolist() == [1]
    assert out.tolist() == [[2, 4]]


if not INTERPRETED:

    def test_greedy_accept_kernels_in_interpreter():
        pytest.importorskip("triton")
        from helpers import run_interpreted

        run_interpreted(__file__)

else:
    from ssmspec.ops.greedy_accept import triton as GA

    @pytest.fixture
    def poisoned_outputs(monkeypatch):
        """torch.empty starts float tensors as NaN and integer ones as -777, so an unwritten output
        lane (or scratch entry) shows up in the comparison."""
        empty = torch.empty

        def poisoned(*a, **k):
            t = empty(*a, **k)
            return t.fill_(float("nan") if t.is_floating_point() else -777)

        monkeypatch.setattr(torch, "empty", poisoned)

    def assert_same(got, want, label):
        for name, g, w in zip(("path", "path_len", "out", "last"), got, want):
            assert g.dtype == torch.long and g.shape == w.shape, f"{label}: {name} {g.dtype} {tuple(g.shape)}"
            assert torch.equal(g, w), f"{label}: {name}\n{g.tolist()}\nwant\n{w.tolist()}"

    # (vocab, block_v, max_split): one chunk; 5 chunks of one tile (the last one short); 2 chunks of
    # 10 tiles. The interpreter runs the B * N * chunks argmax programs one by one (~3 ms each), so
    # the 70-node tree only takes the one-chunk case.
    VOCABS = {"V37": (37, None, 64), "V300-split5": (300, 64, 64), "V300-tiles10": (300, 16, 2)}
    CASES = [(t, v) for t in TREES for v in VOCABS if t != "uneven 70" or v == "V37"]

    @pytest.mark.parametrize("tree_name, vocab_case", CASES, ids=[f"{t}-{v}" for t, v in CASES])
    def test_greedy_accept_matches_reference(tree_name, vocab_case, poisoned_outputs):
        vocab, block_v, max_split = VOCABS[vocab_case]
        tree = TREES[tree_name]
        args = tree_tensors(tree)
        logits, tokens = plant(tree, 4, vocab, PATTERNS)  # one batch row per pattern
        want = naive_greedy_accept(logits, tokens, *args)
        assert_same(GA.greedy_accept(logits, tokens, *args, block_v=block_v, max_split=max_split), want, tree_name)

    def test_greedy_accept_ties_across_chunks(poisoned_outputs):
        """The maximum at both ends of chunks and tiles: the lowest index wins across the split."""
        tree = TREES["3,4"]
        args = tree_tensors(tree)
        logits, tokens = plant(tree, 2, 300, ["all", "partial"], ties=False)
        for node, spots in ((0, [255, 64, 299]), (1, [63, 64]), (2, [299, 17]), (5, [0, 299])):
            logits[:, node, spots] = logits.max() + 1
        logits[1, 3] = float("-inf")  # a whole row of -inf: index 0, as torch.argmax
        logits[1, 4, :200] = float("-inf")
        want = naive_greedy_accept(logits, tokens, *args)
        for block_v, max_split in ((32, 64), (16, 3), (64, 64), (None, 64)):
            assert_same(GA.greedy_accept(logits, tokens, *args, block_v=block_v, max_split=max_split), want,
                        f"block_v {block_v}, max_split {max_split}")

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
    def test_greedy_accept_half_logits(dtype, poisoned_outputs):
        """Half-precision logits (many exact ties after rounding) and strided rows: a slice of a
        wider head output."""
        tree = TREES["binary 2,2,2,2"]
        args = tree_tensors(tree)
        wide, tokens = plant(tree, 3, 230, ["all", "partial", "one path"], dtype=dtype)
        logits = wide[..., :200]
        want = naive_greedy_accept(logits, tokens, *args)
        assert_same(GA.greedy_accept(logits, tokens, *args, block_v=64), want, str(dtype))

    def test_greedy_tree_iteration_through_the_kernel(monkeypatch):
        """GreedyTreeGraph (eager) with the acceptance kernel equals the reference iteration."""
        from helpers import assert_close, tiny_model
        from ssmspec.decoding.graphs import GreedyTreeGraph
        from ssmspec.ops import dispatch

        model = tiny_model()
        prompt = torch.randint(0, 64, (2, 6))
        tree = Tree.from_config((2, 2, 1))

        def run():
            cache = model.new_cache(2, 64)
            with torch.no_grad():
                model(prompt, cache)
            graph = GreedyTreeGraph(model, cache, tree, capture=False)
            outs = []
            for _ in range(3):
                tokens = torch.randint(0, 64, (2, tree.num_nodes))
                tokens[:, 1:] = tokens[:, 1:] % 4  # peaked tiny model: some acceptance
                out, n = graph(tokens)
                outs.append((out.clone(), n.clone(), graph.out_last.clone()))
            return outs, cache

        torch.manual_seed(1)
        want, ref_cache = run()
        monkeypatch.setattr(dispatch, "resolve", lambda op, device: GA.greedy_accept if op == "greedy_accept"
                            else dispatch._REFERENCE[op])
        torch.manual_seed(1)
        got, cache = run()
        for g, w in zip(got, want):
            for a, b in zip(g, w):
                assert torch.equal(a, b)
        for mine, theirs in zip(cache.layers, ref_cache.layers):
            assert_close(mine.ssm_state, theirs.ssm_state, atol=0, rtol=0)

"""Greedy tree acceptance kernels against their reference on a real GPU, at mamba2-2.7b's vocabulary (opt in: --run-gpu)."""
from __future__ import annotations

import pytest
import torch

from ssmspec.trees import Tree

pytestmark = pytest.mark.requires_cuda
DEV = "cuda"
VOCAB = 50280  # mamba2-2.7b: 13 chunks of 4096, the last one short
TREES = {"one": Tree.from_parents([-1]), "chain3": Tree.chain(3), "16: 3,4": Tree.from_config((3, 4)),
         "31: 2,2,2,2": Tree.from_config((2, 2, 2, 2)), "64: 3,4,2,1": Tree.from_config((3, 4, 2, 1))}
PATTERNS = ("all", "none", "partial", "one path")


def _tree_tensors(tree):
    """(parents, depth, mask, paths) on the GPU as GreedyTreeGraph passes them."""
    paths = torch.zeros(tree.num_nodes, tree.max_depth + 1, dtype=torch.long)
    for i in range(tree.num_nodes):
        p = tree.path(i)
        paths[i, : len(p)] = torch.tensor(p)
    return tree.parents_tensor(DEV), tree.depth_tensor(DEV), tree.mask_tensor(DEV), paths.to(DEV)


def _plant(tree, batch, dtype, gen):
    """Logits (B, N, V) with each row's maximum repeated at a second place, and tokens that accept
    all, none, a random part, or one path of the tree (batch row b takes PATTERNS[b % 4])."""
    n = tree.num_nodes
    logits = torch.randn(batch, n, VOCAB, generator=gen).to(dtype)
    top = logits.max(-1).values
    logits.scatter_(-1, torch.randint(0, VOCAB, (batch, n, 1), generator=gen), top[..., None])
    logits[:, 0, [4095, 4096]] = logits.max() + 1  # a tie across a chunk boundary
    best = logits.float().argmax(-1)
    parent = tree.parents_tensor().clamp_min(0)
    tokens = (best[:, parent] + torch.randint(1, VOCAB, (batch, n), generator=gen)) % VOCAB  # all rejected
    for b in range(batch):
        pattern = PATTERNS[b % len(PATTERNS)]
        if pattern == "all":
            keep = torch.ones(n, dtype=torch.bool)
        elif pattern == "partial":
            keep = torch.rand(n, generator=gen) < 0.6
        elif pattern == "one path":
            keep = torch.zeros(n, dtype=torch.bool)
            keep[tree.path(n - 1)] = True
        else:
            continue
        tokens[b, keep] = best[b, parent][keep]
    return logits.to(DEV), tokens.to(DEV)


def _assert_same(got, want, label):
    for name, g, w in zip(("path", "path_len", "out", "last"), got, want):
        assert g.dtype == torch.long and torch.equal(g, w), f"{label}: {name} {g.tolist()} != {w.tolist()}"


@pytest.mark.parametrize("tree_name", list(TREES))
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_greedy_accept_gpu(tree_name, batch, dtype):
    from ssmspec.ops.greedy_accept.naive import naive_greedy_accept
    from ssmspec.ops.greedy_accept.triton import greedy_accept

    tree = TREES[tree_name]
    args = _tree_tensors(tree)
    logits, tokens = _plant(tree, batch, dtype, torch.Generator().manual_seed(0))
    want = naive_greedy_accept(logits, tokens, *args)
    _assert_same(greedy_accept(logits, tokens, *args), want, f"{tree_name} batch {batch} {dtype}")


def test_greedy_accept_in_a_cuda_graph():
    """Captured (with PDL on Hopper) and replayed on new logits and tokens written into the static
    inputs: the outputs follow the inputs, as GreedyTreeGraph uses them."""
    from ssmspec.ops.greedy_accept.naive import naive_greedy_accept
    from ssmspec.ops.greedy_accept.triton import greedy_accept

    tree = TREES["16: 3,4"]
    args = _tree_tensors(tree)
    gen = torch.Generator().manual_seed(1)
    logits, tokens = _plant(tree, 4, torch.float32, gen)
    greedy_accept(logits, tokens, *args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = greedy_accept(logits, tokens, *args)
    for _ in range(3):
        new_logits, new_tokens = _plant(tree, 4, torch.float32, gen)
        logits.copy_(new_logits)
        tokens.copy_(new_tokens)
        graph.replay()
        torch.cuda.synchronize()
        _assert_same(outs, naive_greedy_accept(logits, tokens, *args), "graph replay")

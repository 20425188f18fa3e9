"""Multi-step speculative sampling on the device (ops/sampled_accept) and the drafter's raced
children (ops/ranked_tokens race_tokens): the kernels against their references.

The reference's exactness (its samples follow the target's joint law) is tested in
tests/test_acceptance.py; here the kernel must pick the same path and bonus as the reference
from the same uniforms and noise. Same arrangement as tests/test_ops_ranked_tokens.py: the
default run spawns this file with TRITON_INTERPRET=1, where the kernel tests run (GPU sizes in
tests/gpu/test_ops_gpu.py).
"""
from __future__ import annotations

import os

import pytest
import torch

from ssmspec.decoding.acceptance import children_table
from ssmspec.ops.ranked_tokens.naive import naive_race_tokens
from ssmspec.ops.sampled_accept.naive import naive_sampled_accept
from ssmspec.trees import Tree

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def accept_inputs(tree: Tree, batch: int, vocab: int, seed: int, sharp: float = 3.0, zeros: bool = False):
    """Random p and q over a small vocabulary, children drawn from q (so rejections and residual
    chains happen), uniforms and noise: the arguments of naive_sampled_accept."""
    g = torch.Generator().manual_seed(seed)
    n = tree.num_nodes
    p = torch.softmax(torch.randn(batch, n, vocab, generator=g) * sharp, -1)
    q = torch.softmax(torch.randn(batch, n, vocab, generator=g) * sharp, -1)
    if zeros:  # top-k / top-p leave zeros: a residual may hit them
        p[..., 0] = 0
        p = p / p.sum(-1, keepdim=True)
    tokens = torch.zeros(batch, n, dtype=torch.long)
    for u in range(1, n):
        tokens[:, u] = torch.multinomial(q[:, tree.parents[u]], 1, generator=g)[:, 0]
    children = children_table(tree)
    uniforms = torch.rand(batch, n, children.shape[1], generator=g)
    noise = torch.empty(batch, n, vocab).exponential_(generator=g)
    paths = torch.zeros(n, tree.max_depth + 1, dtype=torch.long)
    for i in range(n):
        paths[i, :len(tree.path(i))] = torch.tensor(tree.path(i))
    return p, q, tokens, children, uniforms, noise, paths, tree.depth_tensor()


def test_race_reference_is_the_argmax_of_p_over_noise():
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(3, 50, generator=g), -1)
    rows = torch.tensor([0, 2, 2, 1])
    noise = torch.empty(4, 50).exponential_(generator=g)
    out = torch.full((6,), -1, dtype=torch.long)
    naive_race_tokens(probs, rows, noise, out=out[1:5])
    assert out[1:5].tolist() == [int((probs[r] / noise[i]).argmax()) for i, r in enumerate(rows.tolist())]
    assert out[0] == -1 and out[5] == -1


if not INTERPRETED:

    def test_sampled_accept_kernels_in_interpreter():
        pytest.importorskip("triton")
        from helpers import run_interpreted

        run_interpreted(__file__)

else:
    from ssmspec.ops.ranked_tokens import triton as RT
    from ssmspec.ops.sampled_accept import triton as SA

    # trees: a chain (one child per node), siblings (residual chains), deeper siblings
    @pytest.mark.parametrize("spec", [(1, 1, 1), (3, 1), (2, 2, 1)])
    @pytest.mark.parametrize("vocab, block_v, zeros", [(5, None, False), (37, 16, True)])
    def test_sampled_accept_kernel_equals_reference(spec, vocab, block_v, zeros):
        tree = Tree.from_config(spec)
        args = accept_inputs(tree, batch=12, vocab=vocab, seed=vocab + len(spec), zeros=zeros)
        want = naive_sampled_accept(*args)
        got = SA.sampled_accept(*args, block_v=block_v)
        for name, a, b in zip(("path", "path_len", "out", "last"), got, want):
            assert torch.equal(a, b), name
        assert len(set(want[1].tolist())) > 1  # the rows do not all stop at one depth

    def test_sampled_accept_kernel_takes_a_broadcast_q():
        # The fused iteration passes the draft's (N, V) q expanded over the batch (stride 0).
        tree = Tree.from_config((2, 1))
        p, q, *rest = accept_inputs(tree, batch=3, vocab=9, seed=5)
        q = q[:1].expand(3, -1, -1)
        want = naive_sampled_accept(p, q, *rest)
        got = SA.sampled_accept(p, q, *rest)
        assert all(torch.equal(a, b) for a, b in zip(got, want))

    @pytest.mark.parametrize("vocab, block_v", [(37, None), (300, 64)])
    def test_race_tokens_kernel_equals_reference(vocab, block_v):
        g = torch.Generator().manual_seed(vocab)
        probs = torch.softmax(torch.randn(4, vocab, generator=g) * 2, -1)
        probs[1, : vocab // 2] = 0  # zero-probability tokens never win
        rows = torch.tensor([0, 0, 1, 3, 3, 2])
        noise = torch.empty(6, vocab).exponential_(generator=g)
        out = torch.full((8,), -5, dtype=torch.long)
        RT.race_tokens(probs, rows, noise, out=out[1:7], block_v=block_v)
        assert out[1:7].tolist() == naive_race_tokens(probs, rows, noise).tolist()
        assert out[0] == -5 and out[7] == -5
        assert all(int(t) >= vocab // 2 for t in out[3:4])

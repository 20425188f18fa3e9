"""The drafter's child picks (ops/ranked_tokens): the reference against torch.topk's ranking, the
kernel against the reference.

Same arrangement as tests/test_ops_greedy_accept.py: the default run checks the reference and
spawns this file in a child process with TRITON_INTERPRET=1, where the kernel tests run (GPU sizes
in tests/gpu/test_ops_gpu.py).
"""
from __future__ import annotations

import os

import pytest
import torch

from ssmspec.ops.ranked_tokens.naive import naive_ranked_tokens

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def logits_with_ties(rows: int, vocab: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    """Random logits whose top values repeat: each row's maximum and runner-up are copied to two
    other random positions, so the ranking must order equal values by index."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g).to(dtype)
    top2 = torch.topk(x.float(), 2, dim=-1).values
    for r in range(rows):
        for value in top2[r]:
            x[r, int(torch.randint(0, vocab, (), generator=g))] = value
    return x


def brute_force(logits: torch.Tensor, rows, ranks) -> list[int]:
    """The rank rule spelled out: sort (value descending, index ascending) with Python."""
    out = []
    for row, rank in zip(rows, ranks):
        values = logits[row].float().tolist()
        order = sorted(range(len(values)), key=lambda v: (-values[v], v))
        out.append(order[rank])
    return out


def test_reference_is_the_rank_rule():
    x = logits_with_ties(5, 40)
    rows, ranks = [0, 0, 0, 3, 4, 4, 2], [0, 1, 2, 0, 5, 1, 7]
    got = naive_ranked_tokens(x, torch.tensor(rows), torch.tensor(ranks))
    assert got.tolist() == brute_force(x, rows, ranks)
    assert got[0] == x[0].argmax()  # rank 0 is argmax's pick, ties included


def test_reference_matches_topk_values_and_writes_out():
    x = torch.randn(3, 100)
    rows = torch.tensor([0, 1, 1, 2])
    ranks = torch.tensor([2, 0, 3, 1])
    out = torch.full((6,), -1, dtype=torch.long)
    naive_ranked_tokens(x, rows, ranks, out=out[1:5])
    values = torch.topk(x, 4, dim=-1).values
    assert torch.equal(x[rows, out[1:5]], values[rows, ranks])
    assert out[0] == -1 and out[5] == -1


if not INTERPRETED:

    def test_ranked_tokens_kernel_in_interpreter():
        pytest.importorskip("triton")
        from helpers import run_interpreted

        run_interpreted(__file__)

else:
    from ssmspec.ops.ranked_tokens import triton as RT

    # (vocab, block_v): one tile; several tiles with a short last one
    @pytest.mark.parametrize("vocab, block_v", [(37, None), (300, 64)])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_ranked_tokens_matches_reference(vocab, block_v, dtype):
        x = logits_with_ties(4, vocab, dtype, seed=vocab)
        rows = torch.tensor([0, 0, 0, 1, 2, 2, 3])
        ranks = torch.tensor([0, 1, 2, 0, 0, 3, 1])
        got = RT.ranked_tokens(x, rows, ranks, block_v=block_v)
        assert got.tolist() == naive_ranked_tokens(x, rows, ranks).tolist() == brute_force(x, rows.tolist(), ranks.tolist())

    def test_ranked_tokens_into_a_slice_and_infinite_logits():
        x = torch.full((2, 20), float("-inf"))
        x[0, 7] = x[0, 3] = 1.0  # a tie, then -inf everywhere else: ranks continue in index order
        x[1, 5] = float("inf")
        rows, ranks = torch.tensor([0, 0, 0, 1, 1]), torch.tensor([0, 1, 2, 0, 1])
        out = torch.full((7,), -777, dtype=torch.long)
        RT.ranked_tokens(x, rows, ranks, out=out[1:6])
        assert out.tolist() == [-777, 3, 7, 0, 5, 0, -777]
        assert out[1:6].tolist() == naive_ranked_tokens(x, rows, ranks).tolist()

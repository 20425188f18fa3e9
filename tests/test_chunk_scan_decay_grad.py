"""The SSD backward's last step (ops/chunk_scan/decay_grad.py): its reference against autograd.

The four decay-gradient pieces are the gradients of a loss that is linear in each token's decay
dt * A, in the cumulative decays within each chunk and in each chunk's total; autograd through
that loss gives dt's and A's gradients, which `decay_grad_reference` must reproduce. The Triton
kernel is checked against the reference in tests/test_ops_triton.py (interpreter) and on the GPU
through the whole scan (tests/gpu/test_training_scan_gpu.py).
"""
from __future__ import annotations

import pytest
import torch

from helpers import assert_close
from ssmspec.ops.chunk_scan.decay_grad import decay_grad_reference


def decay_grad_pieces(batch, T, heads, size, seed=0):
    """Random (within, from_outputs, from_states, chunk_ends, ddt_chunks, dt, A) of matching shapes."""
    g = torch.Generator().manual_seed(seed)
    chunks = -(-T // size)
    rows = (batch, heads, chunks, size)
    within, from_outputs, from_states, ddt_chunks = (torch.randn(*rows, generator=g) for _ in range(4))
    chunk_ends = torch.randn(batch, heads, chunks, generator=g)
    dt = torch.rand(batch, T, heads, generator=g) * 0.5 + 0.01
    A = -(0.5 + torch.rand(heads, generator=g))
    return within, from_outputs, from_states, chunk_ends, ddt_chunks, dt, A


@pytest.mark.parametrize("T,size", [(1, 8), (24, 8), (29, 8), (40, 16)])
def test_the_reference_is_autograd_through_the_decays(T, size):
    within, from_outputs, from_states, chunk_ends, ddt_chunks, dt, A = decay_grad_pieces(2, T, 3, size, seed=T)
    batch, _, heads = dt.shape
    chunks = within.shape[2]
    dt_leaf, A_leaf = dt.clone().requires_grad_(), A.clone().requires_grad_()
    padded = torch.nn.functional.pad(dt_leaf, (0, 0, 0, chunks * size - T))  # no decay past T
    dA = (padded * A_leaf).unflatten(1, (chunks, size)).permute(0, 3, 1, 2)  # (batch, heads, chunks, size)
    cumulative = dA.cumsum(-1)
    dt_chunked = padded.unflatten(1, (chunks, size)).permute(0, 3, 1, 2)
    loss = ((within + from_states) * dA).sum() + (from_outputs * cumulative).sum() \
        + (chunk_ends * cumulative[..., -1]).sum() + (ddt_chunks * dt_chunked).sum()
    want_ddt, want_dA = torch.autograd.grad(loss, (dt_leaf, A_leaf))
    got_ddt, got_dA = decay_grad_reference(within, from_outputs, from_states, chunk_ends, ddt_chunks, dt, A)
    assert got_ddt.shape == (batch, T, heads) and got_dA.shape == (heads,)
    assert_close(got_ddt, want_ddt, atol=1e-5, rtol=1e-5, name="ddt")
    assert_close(got_dA, want_dA, atol=1e-4, rtol=1e-5, name="dA")

"""The step and replay kernels on row-packed states (models/cache.py packed_mamba_rows), through Triton's interpreter.

A packed cache's conv_state / ssm_state are strided views whose batch stride is the whole row
(every layer's states and seqlen), not the tensor's own row size. The kernels must take those
strides: run on the packed views they must give exactly what they give on contiguous copies,
and leave the bytes of the row outside their tensor alone. The default run has one test that
runs this file in a child process with TRITON_INTERPRET=1 (see tests/test_ops_triton.py why).
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _packed_states(batch, channels, kernel_size, heads, head_dim, d_state, layers=2, seed=0):
    """Random states of `layers` Mamba layers in one packed buffer, and contiguous copies of them."""
    from ssmspec.models.cache import MambaLayerCache, packed_mamba_rows

    template = MambaLayerCache(torch.empty(1, channels, kernel_size - 1, device="meta"),
                               torch.empty(1, heads, head_dim, d_state, device="meta"))
    rows, caches, seqlen = packed_mamba_rows(batch, [template] * layers, "cpu")
    g = torch.Generator().manual_seed(seed)
    for c in caches:
        c.conv_state.copy_(torch.randn(c.conv_state.shape, generator=g))
        c.ssm_state.copy_(torch.randn(c.ssm_state.shape, generator=g))
    seqlen.copy_(torch.arange(batch) + 7)
    assert not caches[0].ssm_state.is_contiguous() or batch == 1
    return rows, caches, [MambaLayerCache(c.conv_state.clone(), c.ssm_state.clone()) for c in caches]


if not INTERPRETED:
    def test_packed_state_kernels_interpreted():
        from helpers import run_interpreted

        run_interpreted(__file__)


if INTERPRETED:
    from ssmspec.ops.state_replay import triton as SR
    from ssmspec.ops.step_update import triton as SU

    def _other_bytes(rows, *keep):
        """A copy of the row buffer with the bytes of the `keep` views zeroed: what a kernel on
        them must not change."""
        out = rows.clone()
        flat = out.view(torch.uint8).view(-1)
        for t in keep:
            start = t.data_ptr() - rows.data_ptr()
            for r in range(rows.shape[0]):
                at = start + r * rows.stride(0) * rows.element_size()
                flat[at:at + t[0].numel() * t.element_size()] = 0
        return out

    @pytest.mark.parametrize("batch", [1, 3])
    @pytest.mark.parametrize("fused_out", [False, True], ids=["step", "step_out"])
    def test_step_kernels_on_packed_states_equal_contiguous(batch, fused_out):
        heads, head_dim, d_state, groups, norm_groups, kernel_size, d_model = 4, 16, 16, 2, 2, 4, 40
        channels, d_inner = heads * head_dim + 2 * groups * d_state, heads * head_dim
        rows, packed, plain = _packed_states(batch, channels, kernel_size, heads, head_dim, d_state)
        xbc, dt_raw, z = torch.randn(batch, channels), torch.randn(batch, heads), torch.randn(batch, d_inner)
        args = (torch.randn(channels, kernel_size), torch.randn(channels), torch.randn(heads), torch.randn(heads),
                torch.randn(heads), None if fused_out else torch.randn(d_inner), groups, norm_groups, 0.01, 5.0, 1e-5)
        layer = packed[1]  # the second layer: its span starts inside the row
        untouched = _other_bytes(rows, layer.ssm_state, layer.conv_state)
        if fused_out:
            out_args = (torch.randn(d_model, d_inner) / 8, torch.randn(d_model))
            res = torch.randn(batch, d_model)
            got = SU.mamba_step_out(xbc, dt_raw, z, layer.conv_state, layer.ssm_state, *args, *out_args, residual=res)
            want = SU.mamba_step_out(xbc, dt_raw, z, plain[1].conv_state, plain[1].ssm_state, *args, *out_args,
                                     residual=res)
        else:
            got = SU.mamba_step(xbc, dt_raw, z, layer.conv_state, layer.ssm_state, *args)
            want = SU.mamba_step(xbc, dt_raw, z, plain[1].conv_state, plain[1].ssm_state, *args)
        assert torch.equal(got, want)
        assert torch.equal(layer.ssm_state, plain[1].ssm_state) and torch.equal(layer.conv_state, plain[1].conv_state)
        after = _other_bytes(rows, layer.ssm_state, layer.conv_state)
        assert torch.equal(after, untouched), "a kernel wrote outside its tensor's span of the row"

    def test_replay_states_layers_on_packed_states_equal_contiguous():
        batch, n, steps = 3, 6, 4
        heads, head_dim, d_state, groups, kernel_size = 4, 8, 16, 2, 4
        channels = heads * head_dim + 2 * groups * d_state
        rows, packed, plain = _packed_states(batch, channels, kernel_size, heads, head_dim, d_state)
        acts = [(torch.randn(batch, n, channels), torch.randn(batch, n, heads, head_dim), torch.rand(batch, n, heads),
                 -torch.rand(heads), torch.randn(batch, n, groups, d_state)) for _ in packed]
        path = torch.randint(0, n, (batch, steps))
        path_len = torch.tensor([steps, 0, 2])
        for caches in (packed, plain):
            SR.replay_states_layers([c.conv_state for c in caches], [c.ssm_state for c in caches],
                                    *[list(a) for a in zip(*acts)], path, path_len)
        for p, c in zip(packed, plain):
            assert torch.equal(p.ssm_state, c.ssm_state) and torch.equal(p.conv_state, c.conv_state)

"""parallel_chunk_scan against naive_chunk_scan on a GPU, at real sizes (opt in: --run-gpu).

Tolerances as in test_training_scan_gpu.py, relative to each tensor's RMS: fp32 5e-3 (allows TF32
products), bf16 3e-2 under autocast (every product's inputs rounded to bf16), against the fp32 reference.
"""
from __future__ import annotations

import pytest
import torch

from helpers import assert_close
from test_training_scan import GRAD_NAMES, scan_grads, scan_inputs

pytestmark = pytest.mark.requires_cuda
DEV = "cuda"
TOL = {torch.float32: 5e-3, torch.bfloat16: 3e-2}


def _close(got, want, tol, name):
    scale = want.float().pow(2).mean().sqrt().item()
    _, rel_rms = assert_close(got, want, atol=(tol if tol < 1e-2 else 1e-1) * scale, rtol=tol, name=name)
    assert rel_rms < tol, f"{name}: rel RMS err {rel_rms:.3e}"


def _compare(inputs, chunk, precision):
    from ssmspec.ops.chunk_scan import naive_chunk_scan, parallel_chunk_scan

    y_ref, f_ref, g_ref = scan_grads(naive_chunk_scan, inputs, chunk)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
        y, f, g = scan_grads(parallel_chunk_scan, inputs, chunk)
    tol = TOL[torch.float32 if precision == "fp32" else torch.bfloat16]
    _close(y, y_ref, tol, "y")
    _close(f, f_ref, tol, "final_state")
    for name, got, want in zip(GRAD_NAMES, g, g_ref):
        _close(got, want, tol, f"d{name}")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("steps", [1, 63, 64, 2048])
@pytest.mark.parametrize("chunk", [64, 100])  # divides 64 and 2048, or nothing
@pytest.mark.parametrize("groups", [1, 8])
@pytest.mark.parametrize("headdim", [32, 64])
@pytest.mark.parametrize("dstate", [64, 128])
def test_parallel_scan_equals_naive(dstate, headdim, groups, chunk, steps, precision):
    _compare(scan_inputs(2, steps, 16, headdim, groups, dstate, device=DEV), chunk, precision)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_mamba2_130m_sized_scan_equals_naive(precision):
    """mamba2-130m's Mamba layer: 24 heads of 64, d_state 128, one group, chunk 256, 2 x 2048 tokens."""
    _compare(scan_inputs(2, 2048, 24, 64, 1, 128, device=DEV), 256, precision)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_training_step_through_parallel_equals_the_plain_torch_one(precision):
    """The whole model under the run's autocast: loss and every parameter's gradient, parallel vs the naive scan."""
    from helpers import scan_training_step_grads

    name, loss, grads, loss_ref, grads_ref = scan_training_step_grads("parallel", "ssmspec", precision)
    assert "parallel_chunk_scan" in name
    tol = TOL[torch.float32 if precision == "fp32" else torch.bfloat16]
    _close(loss, loss_ref, tol, "loss")
    for n in grads_ref:
        _close(grads[n], grads_ref[n], tol, f"grad {n}")


def test_auto_picks_parallel_without_fla_or_mamba_ssm():
    from ssmspec.ops.chunk_scan.fla import fla_available, fla_refusal
    from ssmspec.training.scan import _mamba_ssm_scan, pick_training_scan

    if (fla_available() and fla_refusal(torch.device(DEV)) is None) or _mamba_ssm_scan() is not None:
        pytest.skip("a kernel scan is usable here: auto picks it")
    picked = pick_training_scan("auto", torch.device(DEV))
    assert picked.name == "ssmspec:ssmspec.ops.chunk_scan.parallel.parallel_chunk_scan"

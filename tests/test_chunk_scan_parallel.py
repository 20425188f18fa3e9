"""parallel_chunk_scan (every chunk at once) against naive_chunk_scan on the CPU: outputs and gradients.

Tolerances, with atol relative to each compared tensor's RMS (gradients of A and D sum over B*T*P
terms): fp32 rtol 1e-4, atol 1e-4 x RMS (the two compute the same sums in another order); bf16
(every product's inputs rounded to bf16, against the fp32 reference) rtol 3e-2, atol 1e-1 x RMS
(an element's error scales with the terms summed into it, not with its value) and a relative RMS
error below 1e-2. Real sizes on a GPU: tests/gpu/test_chunk_scan_parallel_gpu.py.
"""
from __future__ import annotations

import pytest
import torch

from helpers import assert_close
from test_training_scan import GRAD_NAMES, scan_grads, scan_inputs

FP32_TOL, BF16_TOL = 1e-4, 3e-2
BF16_ATOL, BF16_RMS = 1e-1, 1e-2


def _close(got, want, tol, name):
    scale = want.float().pow(2).mean().sqrt().item()
    if tol == BF16_TOL:
        _, rel_rms = assert_close(got, want, atol=BF16_ATOL * scale, rtol=tol, name=name)
        assert rel_rms < BF16_RMS, f"{name}: rel RMS err {rel_rms:.3e} >= {BF16_RMS}"
        return
    assert_close(got, want, atol=tol * scale, rtol=tol, name=name)


def _compare(inputs, chunk, tol, autocast_bf16=False):
    from ssmspec.ops.chunk_scan import naive_chunk_scan, parallel_chunk_scan

    y_ref, f_ref, g_ref = scan_grads(naive_chunk_scan, inputs, chunk)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_bf16):
        y, f, g = scan_grads(parallel_chunk_scan, inputs, chunk)
    if autocast_bf16:  # the products did run in bf16: off the fp32 result by more than fp32 noise
        assert (y - y_ref).abs().max() > 1e-3 * y_ref.abs().max()
    assert y.dtype == torch.float32 and f.dtype == torch.float32
    _close(y, y_ref, tol, "y")
    _close(f, f_ref, tol, "final_state")
    for name, got, want in zip(GRAD_NAMES, g, g_ref):
        _close(got, want, tol, f"d{name}")


# chunk 64 divides 64 but not 300; chunk 50 divides 300 but not 63 or 64 (shorter sequences are one chunk).
@pytest.mark.parametrize("steps", [1, 63, 64, 300])
@pytest.mark.parametrize("chunk", [64, 50])
@pytest.mark.parametrize("groups", [1, 8])
@pytest.mark.parametrize("headdim", [32, 64])
@pytest.mark.parametrize("dstate", [64, 128])
def test_parallel_scan_equals_naive_fp32(dstate, headdim, groups, chunk, steps):
    _compare(scan_inputs(2, steps, 8, headdim, groups, dstate), chunk, FP32_TOL)


@pytest.mark.slow
@pytest.mark.parametrize("groups", [1, 8])
@pytest.mark.parametrize("chunk", [256, 100])
def test_parallel_scan_equals_naive_fp32_long(groups, chunk):
    _compare(scan_inputs(1, 2048, 8, 64, groups, 128), chunk, FP32_TOL)


@pytest.mark.parametrize("steps,chunk,groups", [(63, 16, 2), (300, 64, 1), (300, 50, 8)])
def test_parallel_scan_under_bf16_autocast(steps, chunk, groups):
    _compare(scan_inputs(2, steps, 8, 32, groups, 64), chunk, BF16_TOL, autocast_bf16=True)


def test_bf16_inputs_run_bf16_products():
    """x, B and C in bf16 (no autocast): the products take bf16, so the result differs from the fp32 run
    by bf16 rounding, not fp32 noise, and still equals the reference within the bf16 tolerance."""
    from ssmspec.ops.chunk_scan import naive_chunk_scan, parallel_chunk_scan

    inputs = scan_inputs(2, 130, 8, 32, 2, 64, dtype=torch.bfloat16)
    y_ref, f_ref = naive_chunk_scan(*inputs[:6], 32, inputs[6])
    y, f = parallel_chunk_scan(*inputs[:6], 32, inputs[6])
    _close(y, y_ref, BF16_TOL, "y")
    _close(f, f_ref, BF16_TOL, "final_state")
    y32, _ = parallel_chunk_scan(inputs[0].float(), *inputs[1:3], inputs[3].float(), inputs[4].float(), inputs[5], 32,
                                 inputs[6])
    assert (y - y32).abs().max() > 1e-3 * y32.abs().max()


def test_without_initial_state_or_D():
    from ssmspec.ops.chunk_scan import naive_chunk_scan, parallel_chunk_scan

    x, dt, A, B, C, _, _ = scan_inputs(2, 90, 4, 16, 2, 16, initial=False)
    y_ref, f_ref = naive_chunk_scan(x, dt, A, B, C, None, 32)
    y, f = parallel_chunk_scan(x, dt, A, B, C, None, 32)
    _close(y, y_ref, FP32_TOL, "y")
    _close(f, f_ref, FP32_TOL, "final_state")


def test_equals_the_token_by_token_recurrence():
    """Against the recurrence itself, not only the other chunked form."""
    from ssmspec.ops.chunk_scan import naive_sequential_scan, parallel_chunk_scan

    inputs = scan_inputs(1, 77, 4, 8, 2, 16)
    y_ref, f_ref = naive_sequential_scan(*inputs)
    y, f = parallel_chunk_scan(*inputs[:6], 16, inputs[6])
    _close(y, y_ref, FP32_TOL, "y")
    _close(f, f_ref, FP32_TOL, "final_state")


def test_long_strong_decay_stays_finite():
    """Decays summing to thousands across the sequence: the state passing must not form exp(large)."""
    from ssmspec.ops.chunk_scan import naive_chunk_scan, parallel_chunk_scan

    x, dt, A, B, C, D, h0 = scan_inputs(1, 600, 4, 8, 1, 16)
    A = (A.detach() * 20).requires_grad_()
    y_ref, f_ref, g_ref = scan_grads(naive_chunk_scan, [x, dt, A, B, C, D, h0], 32)
    y, f, g = scan_grads(parallel_chunk_scan, [x, dt, A, B, C, D, h0], 32)
    _close(y, y_ref, FP32_TOL, "y")
    for name, got, want in zip(GRAD_NAMES, g, g_ref):
        _close(got, want, FP32_TOL, f"d{name}")


def test_parallel_is_picked_and_routed():
    from ssmspec.ops import dispatch
    from ssmspec.training.scan import pick_training_scan, training_scan

    picked = pick_training_scan("parallel", torch.device("cpu"))
    assert picked.name == "ssmspec:ssmspec.ops.chunk_scan.parallel.parallel_chunk_scan"
    assert picked.reason == "asked for"
    before = dispatch.chunk_scan
    with training_scan("parallel", torch.device("cpu")):
        assert dispatch.chunk_scan.__wrapped__ is picked.fn  # behind torch.compiler.disable
    assert dispatch.chunk_scan is before


def test_a_training_step_through_parallel_equals_the_naive_one():
    """A tiny model's loss and every parameter's gradient, through --scan parallel and --scan ssmspec."""
    from helpers import tiny_model
    from ssmspec.training.losses import cross_entropy
    from ssmspec.training.scan import training_scan

    model = tiny_model(("mamba", "mamba")).train()  # chunk_size 8: 21 tokens are 3 chunks, the last padded
    ids = torch.randint(0, 64, (2, 22), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 21, dtype=torch.bool)

    def loss_and_grads(choice):
        model.zero_grad(set_to_none=True)
        with training_scan(choice, torch.device("cpu")):
            loss = cross_entropy(model(ids[:, :-1]), ids[:, 1:], mask)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss, grads = loss_and_grads("parallel")
    loss_ref, grads_ref = loss_and_grads("ssmspec")
    _close(loss, loss_ref, FP32_TOL, "loss")
    for n in grads_ref:
        _close(grads[n], grads_ref[n], FP32_TOL, f"grad {n}")

"""training/scan_op.py: a scan's forward and backward as torch custom ops (how mamba_ssm's SSD trains
under torch.compile without a graph break per layer). The kernel pair here is naive_chunk_scan and
its autograd gradient, so these check the wrapping itself: values, gradients, None for an unused
final state, and one graph for a whole model. mamba_ssm's own pair runs in the GPU whole-step tests."""
from __future__ import annotations

import pytest
import torch

from helpers import assert_close, tiny_config
from ssmspec.ops.chunk_scan import naive_chunk_scan
from ssmspec.training.scan_op import scan_ops
from test_training_scan import GRAD_NAMES, scan_grads, scan_inputs


def _naive_forward(x, dt, A, B, C, D, chunk_size):
    return naive_chunk_scan(x, dt, A, B, C, D, chunk_size)


def _naive_backward(dy, dfinal, x, dt, A, B, C, D, kept, chunk_size, out):
    # torch.func, not autograd: a custom op's body runs with autograd's dispatch keys switched off
    (_, final), pullback = torch.func.vjp(lambda *inputs: naive_chunk_scan(*inputs, chunk_size), x, dt, A, B, C, D)
    dx, ddt, dA, dB, dC, dD = pullback((dy, torch.zeros_like(final) if dfinal is None else dfinal))
    for view, grad in zip(out, (dx, dB, dC)):  # the views of one [dx | dB | dC] tensor
        view.copy_(grad)
    return ddt, dA, dD


def _op_scan():
    through_ops = scan_ops("ssmspec_test_naive", _naive_forward, _naive_backward)

    def scan(x, dt, A, B, C, D, chunk_size=64, initial_state=None):
        assert initial_state is None
        return through_ops(x, dt, A, B, C, D, chunk_size)

    scan.packed = through_ops.packed
    return scan


def test_registering_twice_gives_the_same_scan():
    assert scan_ops("ssmspec_test_naive", _naive_forward, _naive_backward) is \
        scan_ops("ssmspec_test_naive", _naive_forward, _naive_backward)


@pytest.mark.parametrize("steps", [1, 40, 64])
def test_the_ops_give_the_kernel_pairs_values_and_gradients(steps):
    inputs = scan_inputs(2, steps, 3, 8, 1, 16, initial=False)
    y_ref, f_ref, g_ref = scan_grads(naive_chunk_scan, inputs, 16)
    y, f, g = scan_grads(_op_scan(), inputs, 16)
    assert_close(y, y_ref, atol=1e-6, rtol=1e-6, name="y")
    assert_close(f, f_ref, atol=1e-6, rtol=1e-6, name="final_state")
    for name, got, want in zip(GRAD_NAMES, g, g_ref):
        assert_close(got, want, atol=1e-6, rtol=1e-6, name=f"d{name}")


def _keeping_forward(x, dt, A, B, C, D, chunk_size):
    y, final = naive_chunk_scan(x, dt, A, B, C, D, chunk_size)
    return y, final, dt.cumsum(1), final * 2  # anything the backward could recompute


_KEPT = []  # what the backward below was given as kept, call by call


def _keeping_backward(dy, dfinal, x, dt, A, B, C, D, kept, chunk_size, out):
    _KEPT.append(kept)
    return _naive_backward(dy, dfinal, x, dt, A, B, C, D, kept, chunk_size, out)


def _kept_shapes(x, dt, A, B, C, D, chunk_size):
    return [(dt.shape, dt.dtype), ((x.shape[0], x.shape[2], x.shape[3], B.shape[-1]), torch.float32)]


def test_what_the_forward_keeps_reaches_the_backward_without_a_gradient_and_compiles():
    scan = scan_ops("ssmspec_test_keeping", _keeping_forward, _keeping_backward, _kept_shapes)
    inputs = scan_inputs(2, 40, 3, 8, 1, 16, initial=False)
    y_ref, f_ref, g_ref = scan_grads(naive_chunk_scan, inputs, 16)
    for run in (scan, torch.compile(scan, backend="aot_eager", fullgraph=True)):
        _KEPT.clear()
        y, f, g = scan_grads(lambda x, dt, A, B, C, D, chunk_size, initial_state: run(x, dt, A, B, C, D, chunk_size),
                             inputs, 16)
        (dt_sums, final_twice), = _KEPT
        assert torch.equal(dt_sums, inputs[1].detach().cumsum(1)) and torch.equal(final_twice, f_ref * 2)
        assert_close(y, y_ref, atol=1e-6, rtol=1e-6, name="y")
        for name, got, want in zip(GRAD_NAMES, g, g_ref):
            assert_close(got, want, atol=1e-6, rtol=1e-6, name=f"d{name}")


_UPSTREAM_FINAL = []  # what the backward below was given for the final state, call by call


def _recording_backward(dy, dfinal, *rest):
    _UPSTREAM_FINAL.append(dfinal)
    return _naive_backward(dy, dfinal, *rest)


def test_an_unused_final_state_reaches_the_backward_as_none():
    scan = scan_ops("ssmspec_test_recording", _naive_forward, _recording_backward)
    x, dt, A, B, C, D, _ = scan_inputs(1, 20, 2, 8, 1, 16, initial=False)
    _UPSTREAM_FINAL.clear()
    y, _ = scan(x, dt, A, B, C, D, 16)
    y.sum().backward()
    assert _UPSTREAM_FINAL == [None] and x.grad is not None


def _tiny_model():
    from ssmspec.models import LanguageModel
    from ssmspec.models.init import init_weights

    return init_weights(LanguageModel(tiny_config(("mamba", "mamba"))), seed=0, std=0.05)


def _loss_and_grads(model, forward, ids):
    model.zero_grad(set_to_none=True)
    logits = forward(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("packed", [False, True], ids=["views", "conv output whole"])
def test_a_model_through_the_ops_compiles_to_one_graph_with_the_same_gradients(monkeypatch, packed):
    """The layers' scan through the ops, given x, B and C (joined first) or the conv's output whole
    (as `training_scan` routes mamba_ssm's: its gradient written whole)."""
    from ssmspec.ops import dispatch

    model = _tiny_model()
    ids = torch.randint(0, 64, (2, 41), generator=torch.Generator().manual_seed(0))
    loss_ref, grads_ref = _loss_and_grads(model, model, ids)
    scan = _op_scan()
    monkeypatch.setattr(dispatch, "chunk_scan", scan)
    monkeypatch.setattr(dispatch, "packed_chunk_scan", scan.packed if packed else None)

    def traced_ops():
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model)(ids[:, :-1])
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
        return [str(node.target) for graph in explained.graphs for node in graph.graph.nodes]

    ops = traced_ops()
    assert ops.count("ssmspec_test_naive.ssd_fwd.default") == 2, ops
    if packed:  # x, B and C are not joined before each layer's scan
        monkeypatch.setattr(dispatch, "packed_chunk_scan", None)
        joined = sum("method cat" in op for op in traced_ops())
        monkeypatch.setattr(dispatch, "packed_chunk_scan", scan.packed)
        assert sum("method cat" in op for op in ops) == joined - 2, ops
    loss, grads = _loss_and_grads(model, torch.compile(model, backend="aot_eager", fullgraph=True), ids)
    assert_close(loss, loss_ref, atol=1e-5, rtol=1e-5, name="loss")
    for name in grads_ref:
        assert_close(grads[name], grads_ref[name], atol=1e-5, rtol=1e-4, name=f"grad {name}")


def test_the_conv_output_whole_through_the_ops_under_recompute_gives_the_same_gradients(monkeypatch):
    """--recompute runs each layer's forward again in the backward (activation checkpointing): the
    packed route's op is called again there, eager and compiled, with the reference's gradients."""
    from ssmspec.ops import dispatch

    model = _tiny_model()
    ids = torch.randint(0, 64, (2, 41), generator=torch.Generator().manual_seed(1))
    loss_ref, grads_ref = _loss_and_grads(model, model, ids)
    scan = _op_scan()
    monkeypatch.setattr(dispatch, "chunk_scan", scan)
    model.recompute_activations = True
    calls = []  # eager only: a side effect inside the checkpoint is not traceable
    monkeypatch.setattr(dispatch, "packed_chunk_scan", lambda *args: calls.append(1) or scan.packed(*args))
    results = [_loss_and_grads(model, model, ids)]
    assert len(calls) == 4, calls  # two layers, each run again in the backward
    monkeypatch.setattr(dispatch, "packed_chunk_scan", scan.packed)
    torch._dynamo.reset()
    results.append(_loss_and_grads(model, torch.compile(model, backend="aot_eager", fullgraph=True), ids))
    for loss, grads in results:
        assert_close(loss, loss_ref, atol=1e-5, rtol=1e-5, name="loss")
        for name in grads_ref:
            assert_close(grads[name], grads_ref[name], atol=1e-5, rtol=1e-4, name=f"grad {name}")

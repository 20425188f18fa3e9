"""training/micro_step.py: which micro-step a run uses, the compiled conv's math, and automatic choices that fail."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers import assert_close, tiny_model
from ssmspec.errors import InputError
from ssmspec.training.micro_step import MicroStep, StepPlan, plan_step

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_plan_is_eager_on_the_cpu_and_compiled_and_graphed_on_one_gpu():
    cpu = plan_step(None, None, CPU, 1, False)
    assert (cpu.compile, cpu.cuda_graphs, cpu.name) == (False, False, "eager")
    assert "not CUDA" in cpu.reason
    gpu = plan_step(None, None, CUDA, 1, False)
    assert (gpu.compile, gpu.cuda_graphs, gpu.name) == (True, True, "torch.compile + CUDA graph")
    assert plan_step(False, False, CUDA, 1, False).name == "eager"
    asked = plan_step(True, None, CPU, 1, False)
    assert asked.name == "torch.compile"  # compile works on the CPU too
    assert asked.compile_asked and not asked.graphs_asked and not gpu.compile_asked and not gpu.graphs_asked


@pytest.mark.parametrize("device, processes, cache, why", [
    (CPU, 1, False, "not CUDA"), (CUDA, 2, False, "2 processes"), (CUDA, 1, True, "cache-target-logits")])
def test_graphs_are_left_out_automatically_and_refused_when_asked_for(device, processes, cache, why):
    auto = plan_step(None, None, device, processes, cache)
    assert not auto.cuda_graphs and why in auto.reason
    with pytest.raises(InputError, match=f"--cuda-graphs asked for, but .*{why}"):
        plan_step(None, True, device, processes, cache)


@pytest.mark.parametrize("bias", [True, False])
def test_the_compiled_conv_sums_shifted_products_as_conv1d_does(monkeypatch, bias):
    """Mamba2Mixer._causal_conv's torch.compile branch (K shifted products) against F.conv1d, at fp32 and bf16."""
    from helpers import tiny_config
    from ssmspec.models import LanguageModel

    cfg = tiny_config()
    cfg.mamba = replace(cfg.mamba, conv_bias=bias)
    model = LanguageModel(cfg)
    mixer = next(layer.mixer for layer in model.layers if layer.kind == "mamba")
    K, C, T = mixer.cfg.conv_kernel, mixer.cfg.conv_dim, 37
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        extended = torch.randn(3, K - 1 + T, C, generator=torch.Generator().manual_seed(0)).to(dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            reference = mixer._causal_conv(extended, T)
            monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
            shifted = mixer._causal_conv(extended, T)
            monkeypatch.undo()
        assert shifted.shape == reference.shape == (3, T, C) and shifted.dtype == reference.dtype
        assert_close(shifted.float(), reference.float(), atol=tol, rtol=tol)


def _micro(model, plan, messages=None, divisor=2):
    def loss_fn(forward, ids, mask, rows):
        logits = forward(ids)
        return logits.float().logsumexp(-1).mean(), {}

    return MicroStep(plan, model, loss_fn, lambda loss: loss.backward(), divisor,
                     lambda: torch.autocast("cpu", enabled=False), on_message=(messages if messages is not None else []).append)


def test_a_failing_automatic_compile_is_reported_and_dropped_and_an_asked_one_raises(monkeypatch):
    from torch._dynamo.exc import Unsupported

    def broken_compile(model, **kw):
        def forward(*a, **k):
            raise Unsupported("no")
        return forward

    monkeypatch.setattr(torch, "compile", broken_compile)
    ids = torch.randint(0, 64, (2, 9))
    model = tiny_model()
    messages = []
    step = _micro(model, StepPlan(True, False, "auto"), messages=messages)
    loss, _ = step(ids, torch.ones(2, 9, dtype=torch.bool))
    eager_model = tiny_model()
    expected = eager_model(ids).float().logsumexp(-1).mean()
    assert_close(loss, expected)
    assert step.plan.name == "eager" and "torch.compile failed (Unsupported" in messages[0]
    assert all(p.grad is not None for p in model.parameters())  # the step still ran its backward, once
    (expected / 2).backward()
    for p, q in zip(model.parameters(), eager_model.parameters()):
        assert_close(p.grad, q.grad)
    cached = _micro(tiny_model(), StepPlan(True, False, "auto"))  # a --cache-target-logits batch: the same fallback
    assert_close(cached(ids, torch.ones(2, 9, dtype=torch.bool), rows=[0, 1])[0], expected)
    assert cached.plan.name == "eager"
    asked = _micro(tiny_model(), StepPlan(True, False, "asked for", compile_asked=True))
    with pytest.raises(Unsupported):
        asked(ids, torch.ones(2, 9, dtype=torch.bool))


@pytest.mark.slow
@pytest.mark.parametrize("preset, recompute", [("hybrid", False), ("hybrid", True), ("tiny-parallel-hybrid", False),
                                               ("tiny-shared-hybrid", False), ("tiny-moe-hybrid", False)])
def test_the_compiled_forward_gives_eager_losses_and_gradients(preset, recompute):
    """torch.compile on the CPU (the scan opaque, as training_scan installs it) for every sublayer kind
    (Mamba-2, attention, parallel blocks, a Zamba2 shared block, MoE), also under --recompute's
    checkpointing: the same loss and gradients as eager."""
    from ssmspec.models.presets import build_model
    from ssmspec.training.scan import training_scan

    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 40, dtype=torch.bool)
    results = []
    with training_scan("ssmspec", CPU):
        for plan in (StepPlan(False, False, "eager"), StepPlan(True, False, "compiled")):
            if preset == "hybrid":
                model = tiny_model(layers=("mamba", "attention", "mamba"), seed=4, std=0.05).train()
            else:
                model = build_model(preset, vocab_size=64, seed=4, std=0.05).train()
            model.recompute_activations = recompute
            step = _micro(model, replace(plan, compile_asked=True))
            for _ in range(3):  # a recompile would show as a different loss or an error
                loss, _ = step(ids, mask)
            results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss_e, grads_e), (loss_c, grads_c) = results
    assert_close(loss_c, loss_e, atol=1e-5, rtol=1e-5)
    assert grads_c.keys() == grads_e.keys()
    for name in grads_e:
        assert_close(grads_c[name], grads_e[name], atol=1e-5, rtol=1e-4, name=name)


def _refused_capture(monkeypatch, model):
    """torch.cuda's graph API on the CPU, with a capture the runtime refuses when it ends. A real
    capture records kernels without running them; here the body runs, so its effect on the
    gradients is undone (the tensors themselves are kept, as on a GPU)."""
    import contextlib

    @contextlib.contextmanager
    def graph(g):
        params = list(model.parameters())
        grads = [p.grad for p in params]
        values = [None if g is None else g.clone() for g in grads]
        yield
        for p, tensor, value in zip(params, grads, values):
            p.grad = tensor
            if tensor is not None:
                tensor.copy_(value)
        raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)


def test_a_refused_automatic_capture_is_reported_and_the_step_still_runs_once(monkeypatch):
    """A micro-step whose capture is refused runs eagerly instead: reported, graphs dropped, its gradient counted once."""
    ids, mask = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(2)), torch.ones(2, 9, dtype=torch.bool)
    messages = []
    model = tiny_model()
    _refused_capture(monkeypatch, model)
    step = _micro(model, StepPlan(False, True, "auto"), messages=messages)
    for _ in range(3):  # two ordinary runs, then the capture
        step(ids, mask)
    assert len(messages) == 1 and "CUDA graph capture failed (RuntimeError: CUDA error" in messages[0]
    assert "trying again" in messages[0] and step.plan.cuda_graphs  # a failure may be transient: one more attempt
    step(ids, mask)
    assert "this run goes on without graphs" in messages[1]
    assert step.plan.name == "eager" and not step.keeps_grads and step.captured == 0
    eager = tiny_model()
    for _ in range(4):
        (eager(ids).float().logsumexp(-1).mean() / 2).backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert_close(p.grad, q.grad, name=name)


def test_a_refused_capture_of_a_graph_that_would_own_the_gradients_falls_back_cleanly(monkeypatch):
    """One micro-batch an optimizer step (the graph would write the gradients, from None): a refused
    capture is reported, and the step's gradients are one eager backward's, none left from the pool."""
    ids, mask = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3)), torch.ones(2, 9, dtype=torch.bool)
    messages = []
    model = tiny_model()
    _refused_capture(monkeypatch, model)
    step = _micro(model, StepPlan(False, True, "auto"), messages=messages, divisor=1)
    assert step.owns_grads
    for _ in range(4):  # two ordinary runs, then two captures; the optimizer sets the gradients to None between steps
        model.zero_grad(set_to_none=True)
        step(ids, mask)
    assert "trying again" in messages[0] and "this run goes on without graphs" in messages[1]
    assert step.plan.name == "eager" and not step.keeps_grads and step.captured == 0
    eager = tiny_model()
    eager(ids).float().logsumexp(-1).mean().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert_close(p.grad, q.grad, name=name)


def test_an_asked_for_capture_that_is_refused_raises(monkeypatch):
    model = tiny_model()
    _refused_capture(monkeypatch, model)
    ids, mask = torch.randint(0, 64, (2, 9)), torch.ones(2, 9, dtype=torch.bool)
    step = _micro(model, StepPlan(False, True, "asked for", graphs_asked=True))
    step(ids, mask)
    step(ids, mask)
    with pytest.raises(RuntimeError, match="during capture"):
        step(ids, mask)


def test_a_refused_capture_that_replaced_accumulated_gradients_stops_the_run(monkeypatch):
    """Earlier micro-batches' gradients swapped for graph-pool tensors cannot be recovered: an error, not a wrong step."""
    import contextlib

    model = tiny_model()

    @contextlib.contextmanager
    def graph(g):
        yield
        first = next(model.parameters())
        first.grad = torch.zeros_like(first)  # as an out-of-place AccumulateGrad would leave it
        raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    ids, mask = torch.randint(0, 64, (2, 9)), torch.ones(2, 9, dtype=torch.bool)
    step = _micro(model, StepPlan(False, True, "auto"))
    step(ids, mask)
    step(ids, mask)  # gradients of two micro-batches, not yet stepped
    with pytest.raises(RuntimeError, match="replacing gradients of earlier micro-batches; run again with --no-cuda-graphs"):
        step(ids, mask)


def test_the_returned_loss_holds_no_autograd_graph():
    """A caller keeping the loss must not keep the run's graph (and the parameters' AccumulateGrad
    nodes) alive into the next micro-step: on a GPU, a capture there fails (the GPU test's case)."""
    ids, mask = torch.randint(0, 64, (2, 9)), torch.ones(2, 9, dtype=torch.bool)
    model = tiny_model()
    loss, _ = _micro(model, StepPlan(False, False, "eager"))(ids, mask)
    assert loss.grad_fn is None and not loss.requires_grad
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)  # the backward ran


def test_a_capture_starts_after_cycles_holding_an_earlier_graph_are_collected(monkeypatch):
    """An earlier autograd graph that only a reference cycle holds keeps the parameters' AccumulateGrad
    nodes (made on the default stream) alive until the collector runs; a capture then fails on a GPU
    (every sft run after a machine's first, with Inductor's caches warm: H200, 2026-11-28). The
    collector runs before each capture: here it is off, and the graph must be gone when capture begins."""
    import contextlib
    import gc
    import types
    import weakref

    model = tiny_model()
    ids, mask = torch.randint(0, 64, (2, 9)), torch.ones(2, 9, dtype=torch.bool)
    alive_at_capture = []

    @contextlib.contextmanager
    def graph(g):
        alive_at_capture.append(earlier() is not None)
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: types.SimpleNamespace(replay=lambda: None))
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    step = _micro(model, StepPlan(False, True, "auto"))
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        held = model(ids).float().sum()  # a graph through every parameter
        cycle = [held]
        cycle.append(cycle)
        earlier = weakref.ref(held)
        del held, cycle
        for _ in range(3):  # two ordinary runs, then the capture
            step(ids, mask)
    finally:
        if was_enabled:
            gc.enable()
    assert alive_at_capture == [False] and step.captured == 1

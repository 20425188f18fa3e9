"""training/micro_step.py on a GPU (opt in: --run-gpu): the compiled, CUDA-graphed micro-step trains as the eager one.

A tiny hybrid (Mamba-2 + attention) model through the chunk-parallel scan or mamba_ssm's, bf16 autocast, fused
AdamW, two micro-batches per optimizer step and one: the same losses and the same weights after six
optimizer steps, within bf16 rounding (Inductor sums in another order), with the graph captured
once and replayed for every later micro-batch.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import assert_close, tiny_config
from ssmspec.models import MambaConfig
from ssmspec.training.micro_step import WARMUP_RUNS, MicroStep, StepPlan
from ssmspec.training.scan import training_scan

pytestmark = pytest.mark.requires_cuda


def _model(mamba: MambaConfig | None = None):
    from ssmspec.models import LanguageModel
    from ssmspec.models.init import init_weights

    config = tiny_config(("mamba", "attention", "mamba"))
    return init_weights(LanguageModel(dataclasses.replace(config, mamba=mamba or config.mamba)), seed=5, std=0.05)


def _train(plan: StepPlan, batches, accum: int = 2, **overrides):
    model = _model(**overrides).cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)

    def loss_fn(forward, ids, mask, rows):
        logits = forward(ids[:, :-1])
        ce = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        return ce, {"ce": ce.detach()}

    step = MicroStep(plan, model, loss_fn, lambda loss: loss.backward(), accum,
                     lambda: torch.autocast("cuda", dtype=torch.bfloat16))
    losses = []
    for i in range(0, len(batches), accum):
        for ids in batches[i:i + accum]:
            loss, parts = step(ids, torch.ones_like(ids[:, 1:], dtype=torch.bool))
            losses.append(loss.detach().clone())
        optimizer.step()
        optimizer.zero_grad(set_to_none=not step.keeps_grads)
    torch.cuda.synchronize()
    return torch.stack(losses).cpu(), model, step


# mamba_ssm's kernels want head dims and states of at least 16
SCANS = {"parallel": {}, "mamba_ssm": {"mamba": MambaConfig(n_heads=4, head_dim=16, d_state=16, n_groups=1, chunk_size=16)}}


@pytest.mark.parametrize("accum", [2, 1])
@pytest.mark.parametrize("scan", SCANS)
def test_compiled_graphed_micro_steps_train_as_eager_ones(scan, accum):
    """Through the chunk-parallel scan (a disabled call under compile) and through mamba_ssm's SSD
    as torch custom ops (training/scan_op.py), where its sources import. accum 2: the graph adds
    into the .grad tensors it saw; 1: it writes its own, put back at every replay."""
    if scan == "mamba_ssm":
        from ssmspec.training.scan import _import_mamba_ssd

        if _import_mamba_ssd() is None:
            pytest.skip("mamba_ssm's sources are not importable here (an optional GPU package)")
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 64, (4, 65), generator=gen).cuda() for _ in range(2)] * 6  # learnable: seen 6 times
    graphed = StepPlan(True, True, "compile + graphs", compile_asked=True, graphs_asked=True)
    with training_scan(scan, torch.device("cuda")):
        eager_losses, eager, _ = _train(StepPlan(False, False, "eager"), batches, accum, **SCANS[scan])
        fast_losses, fast, step = _train(graphed, batches, accum, **SCANS[scan])
    assert step.keeps_grads == (accum > 1) and step.owns_grads == (accum == 1)
    assert len(step._graphs) == 1  # captured once, at micro-batch WARMUP_RUNS + 1
    assert step._runs[next(iter(step._graphs))] == WARMUP_RUNS + 1
    assert_close(fast_losses, eager_losses, atol=2e-2, rtol=2e-2)
    assert fast_losses[-1] < fast_losses[0] - 0.1  # it learns: 6 or 12 optimizer steps at lr 3e-3
    # The weights' updates agree in direction and size (Adam moves near-zero gradients of either sign by lr).
    start = _model(**SCANS[scan])
    d_fast = torch.cat([(p.detach().cpu() - p0).flatten() for p, p0 in zip(fast.parameters(), start.parameters())])
    d_eager = torch.cat([(p.detach().cpu() - p0).flatten() for p, p0 in zip(eager.parameters(), start.parameters())])
    assert d_eager.norm() > 0
    assert (d_fast - d_eager).norm() < 0.25 * d_eager.norm(), ((d_fast - d_eager).norm(), d_eager.norm())

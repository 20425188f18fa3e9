"""The fused token losses (ops/token_loss): the reference against the loss definitions and autograd,
the kernel against the reference, and training's losses through the kernel against their chunked
plain-torch path.

Same arrangement as tests/test_ops_triton.py: the default run checks the reference and spawns this
file in a child process with TRITON_INTERPRET=1, where the kernel tests below are defined and run
(bf16 at real sizes: tests/gpu/test_ops_gpu.py).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from ssmspec.ops.token_loss.naive import naive_token_losses

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TERMS = [(0.0, 1.0, 1.0), (1.0, 0.0, 1.0), (1.0, 0.0, 2.0), (0.7, 0.3, 1.0), (0.5, 0.5, 1.5)]  # (kl, ce, temperature)


def rows(n: int, vocab: int, seed: int, dtype=torch.float32, pad: int = 0):
    """Student and target logits (n, vocab) (slices of wider buffers when pad), labels, a mask with
    some rows off, and a scale."""
    g = torch.Generator().manual_seed(seed)
    student = (3 * torch.randn(n, vocab + pad, generator=g)).to(dtype)[:, :vocab]
    target = (3 * torch.randn(n, vocab + pad, generator=g)).to(dtype)[:, :vocab]
    labels = torch.randint(0, vocab, (n,), generator=g)
    mask = torch.rand(n, generator=g) > 0.3
    mask[0] = True
    return student, target, labels, mask, torch.tensor(0.37)


@pytest.mark.parametrize("kl, ce, temperature", TERMS)
@pytest.mark.parametrize("vocab", [1, 7, 300])
def test_the_reference_is_the_losses_and_their_gradient(vocab, kl, ce, temperature):
    student, target, labels, mask, scale = rows(9, vocab, vocab)
    kl_rows, ce_rows, grad = naive_token_losses(student, target, labels, mask, scale, kl, ce, temperature)
    leaf = student.clone().requires_grad_()
    log_q, log_p = F.log_softmax(leaf / temperature, -1), F.log_softmax(target / temperature, -1)
    want_kl = (log_p.exp() * (log_p - log_q)).sum(-1) * temperature**2 * mask
    want_ce = F.cross_entropy(leaf, labels, reduction="none") * mask
    torch.testing.assert_close(kl_rows, want_kl.detach() if kl else torch.zeros_like(want_kl))
    torch.testing.assert_close(ce_rows, want_ce.detach() if ce else torch.zeros_like(want_ce))
    ((kl * want_kl + ce * want_ce).sum() * scale).backward()
    torch.testing.assert_close(grad, leaf.grad)
    assert torch.all(grad[~mask] == 0)


if not INTERPRETED:

    def test_token_loss_kernel_in_interpreter():
        from helpers import run_interpreted

        run_interpreted(__file__)

if INTERPRETED:
    from helpers import assert_close

    from ssmspec.ops.token_loss import triton as TL

    def _close(got, want, atol=1e-5):
        for name, a, b in zip(("kl rows", "ce rows", "grad"), got, want):
            assert_close(a, b, atol=atol, rtol=1e-5, name=name)

    @pytest.mark.parametrize("kl, ce, temperature", TERMS)
    @pytest.mark.parametrize("n, vocab, block, pad", [(5, 1, 16, 0), (6, 37, 16, 3), (4, 300, 64, 0), (7, 100, 128, 0)])
    def test_the_kernel_matches_the_reference(nan_outputs, monkeypatch, n, vocab, block, pad, kl, ce, temperature):
        """Each term alone and together, temperatures 1 and not; one tile and several (the tile
        shrunk), a partial last tile, rows that are slices of wider ones, masked rows written as zeros
        (outputs start as NaN)."""
        monkeypatch.setattr(TL, "BLOCK_V", block)
        student, target, labels, mask, scale = rows(n, vocab, n + vocab, pad=pad)
        args = (student, target, labels, mask, scale, kl, ce, temperature)
        _close(TL.token_losses(*args), naive_token_losses(*args))

    @pytest.mark.parametrize("kl, ce", [(0.0, 1.0), (1.0, 0.0)])
    def test_rows_far_from_zero_and_very_peaked_stay_exact(monkeypatch, kl, ce):
        """The online softmax carries its maximum and subtracts it first: logits of +-1e4 (exp would
        overflow without it, and top + log(sum) would round the loss off)."""
        monkeypatch.setattr(TL, "BLOCK_V", 16)
        student, target, labels, mask, scale = rows(4, 50, 1)
        student[0] += 1e4
        student[1] -= 1e4
        target[1] += 1e4
        student[2, labels[2]] = 80.0
        mask[:] = True
        args = (student, target, labels, mask, scale, kl, ce, 1.0)
        got = TL.token_losses(*args)
        assert all(torch.isfinite(t).all() for t in got)
        _close(got, naive_token_losses(*args))

    @pytest.mark.parametrize("loss", ["sft", "kl", "kl+ce"])
    def test_training_losses_through_the_kernel_match_their_chunked_path(monkeypatch, loss):
        """training.losses' sft and distillation losses: value, parts and the logits' gradient, the
        kernel (one call) against the plain-torch chunks (3 positions a chunk), some positions
        masked, a temperature of 2 for the KL."""
        from ssmspec.ops import dispatch
        from ssmspec.training.losses import distill_loss, sft_loss

        g = torch.Generator().manual_seed(0)
        logits, target = torch.randn(2, 7, 40, generator=g), torch.randn(2, 7, 40, generator=g)
        next_ids = torch.randint(0, 40, (2, 7), generator=g)
        mask = torch.rand(2, 7, generator=g) > 0.25

        def run():
            leaf = logits.clone().requires_grad_()
            if loss == "sft":
                total, parts = sft_loss(leaf, next_ids, mask, chunk_positions=3)
            else:
                total, parts = distill_loss(loss, leaf, target, next_ids, mask, temperature=2.0, ce_weight=0.3,
                                            chunk_positions=3)
            (2.5 * total).backward()
            return total, *[parts[k] for k in sorted(parts)], leaf.grad

        reference = run()
        calls = []
        monkeypatch.setattr(dispatch, "uses_kernel", lambda op, device: op == "token_losses")
        monkeypatch.setattr(dispatch, "resolve", lambda op, device: (lambda *a: calls.append(op) or TL.token_losses(*a))
                            if op == "token_losses" else dispatch._REFERENCE[op])
        fused = run()
        assert calls == ["token_losses"] and len(fused) == len(reference)
        for i, (a, b) in enumerate(zip(fused, reference)):
            assert_close(a, b, atol=1e-6, rtol=1e-5, name=f"result {i}")

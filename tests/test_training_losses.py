"""chunked_loss against the whole-tensor reference losses: values and gradients, and what autograd keeps."""
from __future__ import annotations

import pytest
import torch

from helpers import assert_close
from ssmspec.training.losses import chunked_loss, cross_entropy, forward_kl, total_variation

TERMS = {
    "kl": lambda s, t, ids, m, T: forward_kl(s, t, m, T),
    "tvd": lambda s, t, ids, m, T: total_variation(s, t, m, T),
    "ce": lambda s, t, ids, m, T: cross_entropy(s, ids, m),
}
MIXES = [{"kl": 1.0}, {"tvd": 1.0}, {"ce": 1.0}, {"kl": 1.0, "ce": 0.5}, {"kl": 0.3, "tvd": 2.0, "ce": 1.5}]


def _inputs(dtype, batch=3, steps=7, vocab=50):
    s = (torch.randn(batch, steps, vocab) * 3).to(dtype).requires_grad_()
    t = (torch.randn(batch, steps, vocab) * 3).to(dtype)
    ids = torch.randint(0, vocab, (batch, steps))
    mask = torch.rand(batch, steps) > 0.3
    mask[0, 0] = True
    ids[~mask] = -100  # what masked labels hold in data; must not be gathered
    return s, t, ids, mask


def _reference(s, t, ids, mask, weights, temperature):
    return sum(w * TERMS[k](s, t, ids, mask, temperature) for k, w in weights.items())


@pytest.mark.parametrize("chunk", [0, 1, 4, 21, 100])  # auto, one row, not dividing 21 rows, all rows, more
@pytest.mark.parametrize("mix", range(len(MIXES)))
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_chunked_loss_equals_the_references_fp32(chunk, mix, temperature):
    weights = MIXES[mix]
    s, t, ids, mask = _inputs(torch.float32)
    loss, parts = chunked_loss(s, mask, target_logits=t, next_ids=ids, temperature=temperature, chunk_positions=chunk,
                               **weights)
    (grad,) = torch.autograd.grad(loss * 1.7, s)  # a non-unit upstream gradient
    ids_ref = ids.clamp_min(0)
    ref = _reference(s, t, ids_ref, mask, weights, temperature)
    (grad_ref,) = torch.autograd.grad(ref * 1.7, s)
    assert_close(loss, ref, atol=1e-5, rtol=1e-5, name="loss")
    assert_close(grad, grad_ref, atol=1e-6, rtol=1e-4, name="grad")
    for k in weights:
        assert_close(parts[k], TERMS[k](s, t, ids_ref, mask, temperature), atol=1e-5, rtol=1e-5, name=k)


@pytest.mark.parametrize("mix", range(len(MIXES)))
def test_chunked_loss_bf16_logits(mix):
    """bf16 logits (autocast): values in fp32 like the reference's; the gradient comes back in bf16."""
    weights = MIXES[mix]
    s, t, ids, mask = _inputs(torch.bfloat16)
    loss, _ = chunked_loss(s, mask, target_logits=t, next_ids=ids, temperature=1.5, chunk_positions=5, **weights)
    (grad,) = torch.autograd.grad(loss, s)
    ref = _reference(s, t, ids.clamp_min(0), mask, weights, 1.5)
    (grad_ref,) = torch.autograd.grad(ref, s)
    assert grad.dtype == torch.bfloat16
    assert_close(loss, ref, atol=1e-4, rtol=1e-4, name="loss")
    assert_close(grad, grad_ref, atol=1e-4, rtol=1e-2, name="grad")


def test_masked_positions_get_no_gradient():
    s, t, ids, mask = _inputs(torch.float32)
    loss, _ = chunked_loss(s, mask, target_logits=t, next_ids=ids, kl=1.0, tvd=1.0, ce=1.0, chunk_positions=3)
    (grad,) = torch.autograd.grad(loss, s)
    assert grad[~mask].abs().max() == 0
    assert grad[mask].abs().max() > 0


def _saved_bytes(fn) -> int:
    """Bytes of the tensors autograd keeps for backward while fn builds its graph."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return total, out


def test_autograd_keeps_one_logits_sized_tensor_in_the_logits_dtype():
    """The point of chunking: the reference keeps several fp32 (B, T, V) tensors for backward
    (casts, log-softmaxes); chunked_loss keeps one gradient in the logits' dtype."""
    s, t, ids, mask = _inputs(torch.bfloat16, vocab=400)
    logits_bytes = s.numel() * s.element_size()
    chunked, _ = _saved_bytes(lambda: chunked_loss(s, mask, target_logits=t, next_ids=ids, kl=1.0, ce=0.5,
                                                   chunk_positions=4))
    reference, _ = _saved_bytes(lambda: _reference(s, t, ids.clamp_min(0), mask, {"kl": 1.0, "ce": 0.5}, 1.0))
    assert chunked <= logits_bytes
    assert reference >= 4 * logits_bytes


def test_no_gradient_no_saved_tensor():
    s, t, ids, mask = _inputs(torch.float32)
    with torch.no_grad():
        loss, parts = chunked_loss(s, mask, target_logits=t, kl=1.0)
    assert not loss.requires_grad
    assert_close(parts["kl"], forward_kl(s, t, mask), atol=1e-5, rtol=1e-5, name="kl")

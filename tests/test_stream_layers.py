"""ops/stream_layers: which models and machines the one-launch layer stack refuses, and why (the
kernel itself runs only on a Hopper GPU: tests/gpu/test_stream_layers_gpu.py)."""
from __future__ import annotations

import torch
from helpers import kernel_shaped_model, tiny_model

from ssmspec.ops.stream_layers import unsupported_reason

CPU = torch.device("cpu")


def test_a_kernel_shaped_model_is_refused_only_for_the_device():
    assert unsupported_reason(kernel_shaped_model(), 1, CPU) == "needs CUDA"


def test_refusals_name_the_reason():
    model = kernel_shaped_model()
    assert unsupported_reason(model, 2, CPU) == "batch 1 only"
    assert "norms folded" in unsupported_reason(kernel_shaped_model(("mamba", "mlp")), 1, CPU)
    small = tiny_model().to(torch.bfloat16)
    small.fold_norm_weights_()
    assert "d_model 32" in unsupported_reason(small, 1, CPU)
    unfolded = kernel_shaped_model()
    with torch.no_grad():  # a norm weight changed since folding
        unfolded.layers[0].norm.weight.fill_(2.0)
    assert "norms folded" in unsupported_reason(unfolded, 1, CPU)
    model.layers[1].mixer.A_log.data = model.layers[1].mixer.A_log.data.float()
    assert "share one dtype" in unsupported_reason(model, 1, CPU)
    head = kernel_shaped_model()
    head.norm_f.weight.data = head.norm_f.weight.data.float()
    assert "LM head" in unsupported_reason(head, 1, CPU)
    fp32 = kernel_shaped_model()
    fp32.layers[0].mixer.in_proj.weight.data = fp32.layers[0].mixer.in_proj.weight.data.float()
    assert unsupported_reason(fp32, 1, CPU) == "bf16 weights only"

"""Random initialisation for fresh models (presets, tests, drafters trained from scratch)."""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from .lm import LanguageModel
from .moe import Experts, MoE


@torch.no_grad()
def init_weights(model: LanguageModel, seed: int = 0, std: float = 0.02) -> LanguageModel:
    """Mamba-2's usual init: A in [1, 16], dt in [1e-3, 1e-1] through the inverse softplus, D = 1.

    Linear and embedding weights are normal(0, std); output projections are scaled down by
    sqrt(2 * n_layers), as in GPT-2 and mamba_ssm, so deep random models stay well behaved.
    Random numbers are drawn on the model's device (CPU draws for 8B parameters take minutes),
    so the same seed gives different weights on CPU and GPU.
    """
    device = model.embeddings.weight.device
    gen = torch.Generator(device=device).manual_seed(seed)
    n_layers = max(1, len(model.layers))

    def normal_(t: torch.Tensor, s: float):
        t.copy_(torch.randn(t.shape, generator=gen, device=device) * s)

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            scale = std / math.sqrt(2 * n_layers) if name.endswith(("out_proj", "o_proj", "down_proj")) else std
            normal_(module.weight, scale)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            normal_(module.weight, std)
        elif isinstance(module, Experts):
            normal_(module.w_in, std)
            normal_(module.down_proj, std / math.sqrt(2 * n_layers))
        elif isinstance(module, MoE) and hasattr(module, "score_bias"):
            module.score_bias.zero_()
        elif isinstance(module, nn.Conv1d):
            bound = 1.0 / math.sqrt(module.kernel_size[0])
            module.weight.copy_((torch.rand(module.weight.shape, generator=gen, device=device) * 2 - 1) * bound)
            if module.bias is not None:
                module.bias.copy_((torch.rand(module.bias.shape, generator=gen, device=device) * 2 - 1) * bound)
    for layer in model.layers:
        if layer.kind != "mamba":
            continue
        mixer = layer.mixer
        heads = mixer.A_log.shape[0]
        A = 1 + torch.rand(heads, generator=gen, device=device) * 15
        mixer.A_log.copy_(torch.log(A))
        dt = torch.exp(torch.rand(heads, generator=gen, device=device) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        mixer.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        mixer.D.fill_(1.0)
    return model

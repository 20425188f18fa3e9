"""Model FLOPs per trained token and the device's peak, for tokens/s and MFU (formula in docs/TRAINING.md)."""
from __future__ import annotations

import torch
import torch.nn as nn

# Dense bf16 tensor-core peak, FLOP/s, by a substring of torch.cuda.get_device_name (first match wins).
PEAK_BF16_FLOPS = (
    ("H200", 989e12),
    ("GH200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM
    ("A100", 312e12),
    ("L40S", 362e12),
)


def device_peak_flops(device) -> tuple[float | None, str]:
    """(dense bf16 peak FLOP/s or None, device name). None on the CPU or an unknown GPU: MFU is then not reported."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, "cpu"
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_BF16_FLOPS:
        if key in name:
            return peak, name
    return None, name


def matmul_params(model: nn.Module) -> int:
    """Weights that multiply activations: every nn.Linear (projections, MLPs, the LM head; a tied head counts once).

    Embedding lookups, norms, biases, the depthwise conv and the SSM's A, D, dt_bias are not matmuls.
    """
    seen, total = set(), 0
    for m in model.modules():
        if isinstance(m, nn.Linear) and id(m.weight) not in seen:
            seen.add(id(m.weight))
            total += m.weight.numel()
    return total


def mixer_forward_flops(model: nn.Module, seq_len: int) -> float:
    """Forward FLOPs per token of the sequence mixing that no Linear covers: SSD scans and attention scores.

    Per Mamba-2 layer (H heads, head dim P, state S, chunk l), as the chunked kernels compute it:
      intra-chunk C B^T scores 2lS, scores x (dt x) 2lP, chunk states B^T (dt x) 2SP, output C h 2SP
      -> H (2l(S + P) + 4SP);  the causal conv adds 2 K per channel.
    Per attention layer (H heads, head dim d) over a context of seq_len: Q K^T and A V -> 4 H d seq_len.
    """
    flops = 0.0
    for module in model.modules():
        cfg = getattr(module, "cfg", None)
        kind = type(module).__name__
        if kind == "Mamba2Mixer" and cfg is not None:  # ssmspec's mixer (a transformers one has no cfg)
            H, P, S, l = cfg.n_heads, cfg.head_dim, cfg.d_state, min(cfg.chunk_size, seq_len)
            flops += H * (2 * l * (S + P) + 4 * S * P) + 2 * cfg.conv_kernel * cfg.conv_dim
        elif kind == "Attention" and cfg is not None:
            flops += 4 * cfg.n_heads * cfg.head_dim * seq_len
    return flops


def train_flops_per_token(student: nn.Module, seq_len: int, target: nn.Module | None = None) -> float:
    """FLOPs per trained token: 3 x the student's forward (forward + backward), plus the target's forward.

    forward = 2 * matmul_params + mixer_forward_flops; so the student alone is 6 N + 3 mixer.
    """
    total = 3 * (2 * matmul_params(student) + mixer_forward_flops(student, seq_len))
    if target is not None:
        total += 2 * matmul_params(target) + mixer_forward_flops(target, seq_len)
    return float(total)


def steady_throughput(history: list[dict]) -> dict:
    """Median tokens/s and MFU over a run's logged windows, the first left out (kernel compilation,
    autotuning, allocator warm-up), unless it is the only one.

    Args:
        history: TrainResult.history (dicts with tokens_per_s and mfu).
    Returns:
        {"tokens_per_s", "mfu" (None without a peak), "windows": how many windows the medians cover}.
    """
    import statistics

    windows = history[1:] or history
    if not windows:
        return {"tokens_per_s": None, "mfu": None, "windows": 0}
    mfus = [h["mfu"] for h in windows if h.get("mfu") is not None]
    return {"tokens_per_s": statistics.median(h["tokens_per_s"] for h in windows),
            "mfu": statistics.median(mfus) if mfus else None, "windows": len(windows)}

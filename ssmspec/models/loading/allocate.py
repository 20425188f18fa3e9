"""Allocating a model before its weights are read: the memory check and storage without initialisation."""
from __future__ import annotations

import torch

from ...errors import ModelLoadError
from ..config import ModelConfig
from ..lm import LanguageModel


def check_fits(cfg: ModelConfig, device, dtype: torch.dtype) -> None:
    """Refuse, before allocating, a model whose weights alone exceed the device's free memory.

    On the CPU too: there the allocation itself succeeds (Linux overcommits) and the process is
    killed without a word once the weights are written, as `new-model --preset hybrid-8b` was on a
    24 GB machine.
    """
    from ...limits import available_bytes  # limits imports the models package

    device = torch.device(device)
    gib = 2**30
    if device.type == "cuda" and torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info(device)
        has, more = f"{device} has {free / gib:.1f} GiB free of {total / gib:.1f} GiB", "a GPU with more memory"
    elif device.type == "cpu":
        free, where = available_bytes(device)
        if free is None:
            return
        has, more = f"{where} {free / gib:.1f} GiB available", "a machine with more memory"
    else:
        return
    needed = cfg.num_parameters() * torch.empty((), dtype=dtype).element_size()
    if needed > free:
        raise ModelLoadError(
            f"the model needs {needed / gib:.1f} GiB for its weights in {str(dtype).removeprefix('torch.')} but "
            f"{has}; use --dtype bf16, a smaller model, or {more}"
        )


def empty_model(cfg: ModelConfig, device="cpu", dtype: torch.dtype = torch.float32) -> LanguageModel:
    """A LanguageModel with uninitialised storage on `device` (no wasted init, no CPU detour).

    Built on the meta device, then given real (empty) storage; the caller must overwrite every
    parameter (loading or init_weights). Non-persistent buffers (RoPE frequencies) are rebuilt
    here, in fp32, because `to_empty` leaves them as garbage.
    """
    with torch.device("meta"):
        model = LanguageModel(cfg)
    model = model.to(dtype=dtype).to_empty(device=device)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embeddings.weight  # to_empty makes new tensors, so tie again
    _rebuild_nonpersistent_buffers(model, device)
    return model


def _rebuild_nonpersistent_buffers(model: LanguageModel, device) -> None:
    from ..attention import Attention

    reference = None
    for module in model.modules():
        names = getattr(module, "_non_persistent_buffers_set", set())
        if not names:
            continue
        if not isinstance(module, Attention):
            raise RuntimeError(f"don't know how to rebuild buffers {sorted(names)} of {type(module).__name__}")
        if reference is None:
            # A throwaway attention layer on the CPU computes the buffers exactly as the module does.
            with torch.device("cpu"):
                reference = Attention(model.config.d_model, model.config.attention)
        for name in names:
            module._buffers[name] = getattr(reference, name).to(device)

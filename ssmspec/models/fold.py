"""Fold RMSNorm weights into the projections after them, so the kernels can fuse the norms.

A pre-norm sublayer computes W (w * n(h)) with n the weightless RMSNorm; that is (W diag(w)) n(h).
Folding moves w into W once and leaves the norm with weight ones: the model computes the same
function (up to rounding the products to the weights' dtype) and saves and loads as before, and
the norm becomes a per-row (per-group) scale that a projection kernel applies to its own input
(ops/gemv `norm_linear`), one launch and one dependent hop fewer per norm on the decode path.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..ops import dispatch


def fold_norm_weights_(model: nn.Module) -> nn.Module:
    """Fold, in place, each Mamba sublayer's pre-norm into in_proj and its gated norm into
    out_proj, and each MLP sublayer's pre-norm into its up (and gate) projection. Idempotent.
    Attention sublayers and the final norm keep their weights. Returns the model.

    Whether the one-launch kernels run a model depends on its norms being folded (ops/paths.py),
    and the model decides that once (`one_launch`): folding anything drops those decisions while
    no runner is built (a graph captured with a runner keeps reading it), so that a model run
    unfolded before (by `generate`) takes those kernels once an Engine folds it."""
    folded = False
    with torch.no_grad():
        for norm, linears in _fold_pairs(model):
            folded |= _fold(norm, linears)
    runners = getattr(model, "one_launch", None)
    if folded and runners is not None and all(runners.kept(k, model.device) is None for k in ("step", "verify")):
        model.one_launch = type(runners)()
    return model


def _fold_pairs(model: nn.Module) -> list[tuple[nn.Module, list[nn.Linear]]]:
    """Each foldable norm with the projections it folds into, listed once per model: an Engine
    checks them before every generation, and walking the layers' submodules each time cost
    more host time than the checks (255 against 76 us per check of the 130m shape on a CPU)."""
    pairs = model.__dict__.get("_fold_pairs")  # a plain attribute: not a submodule, not in state_dict
    if pairs is None:
        pairs = []
        for layer in model.layers:
            if layer.kind == "mamba":
                pairs.append((layer.norm, [layer.mixer.in_proj]))
                if layer.mixer.norm is not None:  # no gated norm (MambaConfig.gate_norm): nothing to fold
                    pairs.append((layer.mixer.norm, [layer.mixer.out_proj]))
            elif layer.kind == "mlp":
                mlp = layer.mixer
                pairs.append((layer.norm, [mlp.up_proj] + ([mlp.gate_proj] if mlp.cfg.gated else [])))
        model.__dict__["_fold_pairs"] = pairs
    return pairs


def fold_for_kernels(*models) -> None:
    """Fold, in place, each model (None and drafters that are not language models, without
    `fold_norm_weights_`, are skipped) whose device runs the fused-norm kernels under the current
    backend; the reference path is left as it is. Only code that takes charge of the caller's
    models calls it: decoding's `Engine` (decoding/engine.py) and `run_profile`, so that they
    run, and time, the same path; `generate` does not."""
    for model in models:
        if hasattr(model, "fold_norm_weights_") and dispatch.uses_kernel("norm_linear", model.device):
            fold_norm_weights_(model)


def is_folded(norm: nn.Module) -> bool:
    """Whether `norm`'s weight is the ones that folding left (not modified since, e.g. by training
    or a state-dict load, which bump the tensor's version). Costs no device work: folding records
    the weight's address and version on the norm module (`_folded_version`), the only mark it
    leaves besides the weights themselves."""
    return getattr(norm, "_folded_version", None) == (norm.weight.data_ptr(), norm.weight._version)


def _fold(norm: nn.Module, linears: list[nn.Linear]) -> bool:
    """Fold `norm` into `linears` unless it is folded already; whether it folded."""
    if is_folded(norm):
        return False
    w = norm.weight.float()
    for linear in linears:
        linear.weight.copy_((linear.weight.float() * w[None, :]).to(linear.weight.dtype))
    norm.weight.fill_(1.0)
    norm._folded_version = (norm.weight.data_ptr(), norm.weight._version)
    return True

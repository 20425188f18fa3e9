"""The ops as models call them: each runs the plain-torch reference or its Triton kernel, as
ops/paths.py decides (`use_backend`, `set_backend`, `explain` are its, re-exported here).
"""
from __future__ import annotations

import torch

from . import paths
from .causal_conv.naive import naive_causal_conv, naive_causal_conv_train
from .chunk_scan.naive import naive_chunk_scan
from .gemv.naive import naive_linear, naive_norm_linear
from .greedy_accept.naive import naive_greedy_accept
from .ranked_tokens.naive import naive_race_tokens, naive_ranked_tokens
from .sampled_accept.naive import naive_sampled_accept
from .state_replay.naive import (
    naive_advance_positions,
    naive_replay_states,
    naive_replay_states_layers,
    naive_settle_pending_layers,
)
from .step_update.naive import (
    naive_add_rms_norm,
    naive_gated_rms_norm,
    naive_mamba_step,
    naive_mamba_step_out,
    naive_rms_norm,
    naive_time_step,
)
from .token_loss.naive import naive_token_losses
from .tree_conv.naive import naive_tree_conv
from .tree_scan.naive import naive_tree_scan, naive_tree_scan_gated

BACKENDS = paths.BACKENDS
explain, get_backend, set_backend, use_backend = paths.explain, paths.get_backend, paths.set_backend, paths.use_backend

_REFERENCE = {
    "tree_scan": naive_tree_scan,
    "tree_scan_gated": naive_tree_scan_gated,
    "tree_conv": naive_tree_conv,
    "replay_states": naive_replay_states,
    "replay_states_layers": naive_replay_states_layers,
    "settle_pending_layers": naive_settle_pending_layers,
    "advance_positions": naive_advance_positions,
    "chunk_scan": naive_chunk_scan,
    "chunk_scan_forward": naive_chunk_scan,
    "causal_conv": naive_causal_conv,
    "causal_conv_train": naive_causal_conv_train,
    "mamba_step": naive_mamba_step,
    "mamba_step_out": naive_mamba_step_out,
    "rms_norm": naive_rms_norm,
    "add_rms_norm": naive_add_rms_norm,
    "gated_rms_norm": naive_gated_rms_norm,
    "time_step": naive_time_step,
    "linear": naive_linear,
    "norm_linear": naive_norm_linear,
    "greedy_accept": naive_greedy_accept,
    "ranked_tokens": naive_ranked_tokens,
    "race_tokens": naive_race_tokens,
    "sampled_accept": naive_sampled_accept,
    "token_losses": naive_token_losses,
}


def resolve(op: str, device: torch.device):
    """The implementation of `op` for tensors on `device` under the current settings (ops/paths.py)."""
    return paths.kernel(op, device) or _REFERENCE[op]


def uses_kernel(op: str, device: torch.device) -> bool:
    """Whether `op` on `device` runs a Triton kernel under the current settings.

    Models use it to branch into a fused path for one op (e.g. the single-token step) while the
    reference path stays the plain code it was."""
    return paths.kernel(op, device) is not None


def tree_scan(x, dt, A, B, C, D, parents, initial_state, pending=None):
    """pending: the cache's pending inputs between initial_state and the root, or None."""
    if pending is None:
        return resolve("tree_scan", x.device)(x, dt, A, B, C, D, parents, initial_state)
    return resolve("tree_scan", x.device)(x, dt, A, B, C, D, parents, initial_state, pending=pending)


def tree_scan_gated(x, dt_raw, dt_bias, dt_min, dt_max, A, B, C, D, z, parents, initial_state, return_sq=False,
                    pending=None, gate_flags=None):
    """Time step, tree scan and silu(z) gate of the verify path: returns (g, dt), and with
    return_sq g's sums of squares per group for out_proj's norm (see `naive_tree_scan_gated`).
    gate_flags: ready counters of a z still being written on another stream (kernels only,
    ops/overlap.py)."""
    extra = {} if gate_flags is None else {"gate_flags": gate_flags}
    return resolve("tree_scan_gated", x.device)(x, dt_raw, dt_bias, dt_min, dt_max, A, B, C, D, z, parents,
                                                initial_state, return_sq=return_sq, pending=pending, **extra)


def tree_conv(xBC, conv_state, weight, bias, parents, activation="silu"):
    return resolve("tree_conv", xBC.device)(xBC, conv_state, weight, bias, parents, activation)


def replay_states(conv_state, ssm_state, xBC, x, dt, A, B, path, path_len, pending=None):
    """replay_conv_state and replay_ssm_state of one layer (one launch with kernels); with
    pending inputs the SSM replay appends to them or flushes (state_replay/naive.py)."""
    return resolve("replay_states", x.device)(conv_state, ssm_state, xBC, x, dt, A, B, path, path_len, pending)


def replay_states_layers(conv_states, ssm_states, xBCs, xs, dts, As, Bs, path, path_len, pending=None):
    """replay_states of every Mamba layer (lists, one entry per layer; one launch with kernels)."""
    return resolve("replay_states_layers", path.device)(conv_states, ssm_states, xBCs, xs, dts, As, Bs, path, path_len,
                                                        pending)


def settle_pending_layers(ssm_states, As, pending):
    """Flush every layer's pending inputs into its SSM state (one launch with kernels)."""
    return resolve("settle_pending_layers", pending[3].device)(ssm_states, As, pending)


def advance_positions(seqlen, count, path_len, width, capacity):
    """seqlen += path_len; the pending count grows by it, or drops to 0 where the replay flushed."""
    return resolve("advance_positions", seqlen.device)(seqlen, count, path_len, width, capacity)


packed_chunk_scan = None
"""While a run trains through a scan that takes the conv's output whole (training/scan.py `training_scan`):
(xBC, dt, A, D, chunk_size, head_dim, groups) -> (y, final); else None."""


def chunk_scan(x, dt, A, B, C, D, chunk_size=64, initial_state=None):
    return resolve("chunk_scan", x.device)(x, dt, A, B, C, D, chunk_size, initial_state)


def chunk_scan_forward(x, dt, A, B, C, D, chunk_size, initial_state=None):
    """The chunked SSD scan without autograd (inference): (y, final state fp32)."""
    return resolve("chunk_scan_forward", x.device)(x, dt, A, B, C, D, chunk_size, initial_state)


def causal_conv(xBC, conv_state, weight, bias):
    """silu(causal depthwise conv1d) of a whole sequence xBC (B, T, C); conv_state (B, C, K-1) or None (zeros)."""
    return resolve("causal_conv", xBC.device)(xBC, conv_state, weight, bias)


def causal_conv_train(xBC, weight, bias):
    """silu(causal depthwise conv1d) of xBC (B, T, C) from zeros before t = 0, differentiable (training)."""
    return resolve("causal_conv_train", xBC.device)(xBC, weight, bias)


def mamba_step(xBC, dt_raw, z, conv_state, ssm_state, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight,
               n_groups, norm_groups, dt_min, dt_max, eps):
    return resolve("mamba_step", xBC.device)(
        xBC, dt_raw, z, conv_state, ssm_state, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight,
        n_groups, norm_groups, dt_min, dt_max, eps,
    )


def mamba_step_out(xBC, dt_raw, z, conv_state, ssm_state, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight,
                   n_groups, norm_groups, dt_min, dt_max, eps, out_weight, out_bias, residual=None):
    """`mamba_step`, out_proj and the residual add (at batch 1 with the norm weight folded into
    out_proj, the gated norm and the add run inside the out_proj GEMV)."""
    return resolve("mamba_step_out", xBC.device)(
        xBC, dt_raw, z, conv_state, ssm_state, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight,
        n_groups, norm_groups, dt_min, dt_max, eps, out_weight, out_bias, residual,
    )


def rms_norm(h, weight, eps):
    return resolve("rms_norm", h.device)(h, weight, eps)


def add_rms_norm(delta, h, weight, eps):
    """(h + delta, rms_norm(h + delta)): a residual add fused into the next sublayer's norm."""
    return resolve("add_rms_norm", h.device)(delta, h, weight, eps)


def gated_rms_norm(y, z, weight, group_size, eps):
    return resolve("gated_rms_norm", y.device)(y, z, weight, group_size, eps)


def time_step(dt_raw, dt_bias, dt_min, dt_max):
    return resolve("time_step", dt_raw.device)(dt_raw, dt_bias, dt_min, dt_max)


def linear(x, weight, bias=None):
    return resolve("linear", x.device)(x, weight, bias)


def norm_linear(x, weight, bias=None, norm_groups=1, eps=1e-5, residual=None, x_sq=None, return_sq=False,
                reuse_residual=False, activation=None, ready_flags=None):
    """[residual +] linear(RMSNorm(x), weight, bias), the norm's weight folded into `weight`;
    x_sq / return_sq: partial sums of squares handed between kernels; reuse_residual: the output
    may overwrite residual; activation: applied to the output (see `naive_norm_linear`);
    ready_flags: counters the kernel raises as it stores its output (kernels only, ops/overlap.py)."""
    extra = {} if ready_flags is None else {"ready_flags": ready_flags}
    return resolve("norm_linear", x.device)(x, weight, bias, norm_groups, eps, residual, x_sq=x_sq,
                                            return_sq=return_sq, reuse_residual=reuse_residual, activation=activation,
                                            **extra)


def ranked_tokens(logits, rows, ranks, out=None):
    """The drafter's children: out[i] = the ranks[i]-th best token of logits[rows[i]] (ties: lower id)."""
    return resolve("ranked_tokens", logits.device)(logits, rows, ranks, out)


def race_tokens(probs, rows, noise, out=None):
    """The drafter's sampled children: out[i] = argmax_v probs[rows[i], v] / noise[i, v], a draw
    from row rows[i] (the exponential race; ties: lower id)."""
    return resolve("race_tokens", probs.device)(probs, rows, noise, out)


def sampled_accept(p, q, tokens, children, uniforms, noise, paths, depth):
    """Multi-step speculative sampling on the device: (path, path_len, produced tokens, last node)."""
    return resolve("sampled_accept", p.device)(p, q, tokens, children, uniforms, noise, paths, depth)


def greedy_accept(logits, tokens, parents, depth, mask, paths):
    """Greedy tree acceptance on the device: (path, path_len, produced tokens, last node)."""
    return resolve("greedy_accept", logits.device)(logits, tokens, parents, depth, mask, paths)


def token_losses(student, target, labels, mask, scale, kl, ce, temperature):
    """Each row's forward KL (at temperature) and next-token cross-entropy, and the gradient of
    scale * (kl * their KL sum + ce * their CE sum), in one pass over the logits: (kl_rows (N,) fp32,
    ce_rows (N,) fp32, grad (N, V) in the student's dtype); see `naive_token_losses`."""
    return resolve("token_losses", student.device)(student, target, labels, mask, scale, kl, ce, temperature)

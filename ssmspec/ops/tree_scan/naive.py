"""Plain-torch reference of the packed-tree SSM scan (STree): the spec the Triton kernel meets."""
from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from ..state_replay.naive import naive_pending_state
from ..step_update.naive import naive_time_step


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """The tree mask L[i, j] = True when j is on the path from the root to i (i included).

    Args:
        parents: (N,) int, parent of each node in packed topological order, -1 for a root.
    Returns:
        (N, N) bool.
    """
    return _ancestor_mask(tuple(parents.tolist())).to(parents.device)


@lru_cache(maxsize=256)
def _ancestor_mask(parents_list: tuple[int, ...]) -> torch.Tensor:
    n = len(parents_list)
    with torch.inference_mode(False):  # cached: must not be an inference tensor (autograd refuses those)
        mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents_list):
        if p >= i:
            raise ValueError(f"node {i} has parent {p}: packed order must put parents first")
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return mask


def naive_tree_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    parents: torch.Tensor,
    initial_state: torch.Tensor,
    pending=None,
) -> torch.Tensor:
    """Output of every tree node as if its root-to-node path had been scanned alone.

    With a_k = dt_k * A the per-node log-decay and Acum = L @ a the decay accumulated along each
    node's own path, node i's state is exp(Acum_i) h0 + sum_{j in path(i)} exp(Acum_i - Acum_j)
    dt_j B_j x_j^T, and its output y_i = C_i . h_i + D x_i. This is the quadratic (attention-like)
    form restricted by the tree mask; it never writes the state.

    Args:
        x: (B, N, H, P) SSM inputs after the conv.
        dt: (B, N, H) time steps after softplus and clamp.
        A: (H,) negative decay rates (-exp(A_log)).
        B, C: (B, N, G, S) input and output projections, G groups shared by H // G heads.
        D: (H,) skip term, or None.
        parents: (N,) int, -1 for the root.
        initial_state: (B, H, P, S) the state before the root (before the pending inputs).
        pending: None, or the pending inputs (x, dt, B, count) that come between
            initial_state and the root (ReplaySSM, models/cache.py); never written.
    Returns:
        y: (B, N, H, P) in fp32.
    """
    if pending is not None:
        initial_state = naive_pending_state(initial_state, A, pending)
    batch, n, heads, _ = x.shape
    groups = B.shape[2]
    L = ancestor_mask(parents.cpu()).to(x.device)  # (N, N)
    xf, dtf = x.float(), dt.float()
    Bh = B.float().repeat_interleave(heads // groups, dim=2)  # (B, N, H, S)
    Ch = C.float().repeat_interleave(heads // groups, dim=2)
    log_decay = dtf * A.float()  # (B, N, H)
    acum = torch.einsum("ij,bjh->bih", L.float(), log_decay)  # decay summed along each path
    seg = acum[:, :, None, :] - acum[:, None, :, :]  # (B, N_i, N_j, H)
    seg = seg.masked_fill(~L[None, :, :, None], float("-inf"))
    scores = torch.einsum("bihs,bjhs->bijh", Ch, Bh) * torch.exp(seg)
    y = torch.einsum("bijh,bjh,bjhp->bihp", scores, dtf, xf)
    y = y + torch.einsum("bihs,bhps->bihp", Ch, initial_state.float()) * torch.exp(acum)[..., None]
    if D is not None:
        y = y + xf * D.float()[:, None]
    return y


def naive_tree_scan_gated(
    x: torch.Tensor,
    dt_raw: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_min: float,
    dt_max: float,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor,
    parents: torch.Tensor,
    initial_state: torch.Tensor,
    return_sq: bool = False,
    pending=None,
):
    """The verify path's time step, tree scan and gate y * silu(z) in one op.

    dt = clamp(softplus(dt_raw + dt_bias), dt_min, dt_max) in fp32 (as `naive_time_step`),
    y = `naive_tree_scan` with that dt, and the gate rounds y to z's dtype first, as
    `Mamba2Mixer._output` does before its norm.

    Args:
        x: (B, N, H, P) SSM inputs after the conv.
        dt_raw: (B, N, H) time steps before dt_bias and softplus; dt_bias: (H,).
        dt_min, dt_max: the clamp of the time step.
        A: (H,) negative decay rates.
        B, C: (B, N, G, S).
        D: (H,) or None.
        z: (B, N, H*P) gate.
        parents: (N,) int, -1 for the root.
        initial_state: (B, H, P, S) the state before the root (before the pending inputs).
        return_sq: also return g's sums of squares per group of heads (the G groups of B),
            (B*N, G, 1) fp32, for out_proj's gated norm (kernels return them split in parts).
        pending: as in `naive_tree_scan`.
    Returns:
        g: (B, N, H*P) in z's dtype, y * silu(z); dt: (B, N, H) fp32, kept for replay; with
        return_sq, the sums of squares.
    """
    dt = naive_time_step(dt_raw, dt_bias, dt_min, dt_max)  # (B, N, H) fp32
    y = naive_tree_scan(x, dt, A, B, C, D, parents, initial_state, pending)
    y = y.flatten(-2).to(z.dtype)  # (B, N, H*P)
    g = (y.float() * F.silu(z.float())).to(z.dtype)
    if return_sq:
        groups = B.shape[2]
        return g, dt, g.float().unflatten(-1, (groups, -1)).pow(2).sum(-1).reshape(-1, groups, 1)
    return g, dt

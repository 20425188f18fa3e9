"""Plain-torch reference of `sampled_accept` (the spec of the kernel in triton.py)."""
from __future__ import annotations

import torch


def rejection_residual(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The residual after a drafted token from q is rejected: normalise(max(r - q, 0)) over the
    last dim. Its sum is 0 only where r == q, where no rejection can happen: r is kept there.

    Args:
        r, q: (..., V) distributions.
    """
    lifted = (r - q).clamp_min(0.0)
    total = lifted.sum(-1, keepdim=True)
    return torch.where(total > 1e-12, lifted / total.clamp_min(1e-12), r)


def naive_sampled_accept(
    p: torch.Tensor,
    q: torch.Tensor,
    tokens: torch.Tensor,
    children: torch.Tensor,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
    paths: torch.Tensor,
    depth: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Multi-step speculative sampling (decoding/acceptance.py `accept_sampled`) for every node
    at once.

    Every node u decides as if the walk had reached it, with its own randomness: r_0 = p_u; for
    its children c_j in packed order, accept c_j iff U[u, j] < r_j(x_c) / q_u(x_c), else
    r_{j+1} = normalise(max(r_j - q_u, 0)); next[u] = the first accepted child (or -1), and the
    bonus at u is a draw from the last residual (the exponential race: argmax r / noise). Then
    the walk follows `next` from the root. Deciding all nodes up front is distributionally the
    sequential walk: the draws of distinct nodes are independent and the walk reads only the
    decisions of the nodes it visits, each exactly once, so the walked path and bonus have the
    law of `accept_sampled`'s. Given the same uniforms and noise, the kernel (which walks) picks
    the same path and bonus. No host sync and a fixed launch count: capturable in a CUDA graph.

    Args:
        p: (B, N, V) fp32 processed target distributions after each node.
        q: (B, N, V) fp32, q[b, u] = the drafter distribution u's children were drawn from
            (i.i.d.); rows of leaves are not read.
        tokens: (B, N) int64 tree tokens, node 0 the root.
        children: (N, K) int64 children of each node in packed order, padded with -1.
        uniforms: (B, N, K) fp32 U[0, 1) draws, one per node and sibling slot.
        noise: (B, N, V) fp32 Exp(1) draws (decoding/sampling.race_noise_) for the bonus races.
        paths: (N, D+1) int64, paths[i] = the root-to-i node list padded with 0.
        depth: (N,) int64 node depths, 0 at the root.

    Returns:
        as ops/greedy_accept: path (B, D+1), path_len (B,), out (B, D+1) (accepted drafted
        tokens, the bonus, then 0s) and last (B,), all int64.
    """
    batch, n_nodes = tokens.shape
    device = tokens.device
    child_tokens = tokens[:, children.clamp_min(0)]  # (B, N, K): x_c of each sibling slot
    residual = p
    nxt = torch.full((batch, n_nodes), -1, dtype=torch.long, device=device)
    decided = torch.zeros(batch, n_nodes, dtype=torch.bool, device=device)
    for j in range(children.shape[1]):
        valid = children[:, j] >= 0  # (N,)
        x = child_tokens[:, :, j:j + 1]  # (B, N, 1)
        r_x = residual.gather(-1, x)[..., 0]
        q_x = q.gather(-1, x)[..., 0]
        # U < r / q without dividing; q_x > 0 as x was drawn from q_u (accept_sampled's guard otherwise)
        take = valid & ~decided & ((q_x <= 0) | (uniforms[:, :, j] * q_x < r_x))
        nxt = torch.where(take, children[:, j], nxt)
        decided |= take
        rejected = (valid & ~decided)[..., None]
        residual = torch.where(rejected, rejection_residual(residual, q), residual)
    # The walk: at most D steps down `nxt`; a node with no accepted child stays put.
    last = torch.zeros(batch, dtype=torch.long, device=device)
    for _ in range(paths.shape[1] - 1):
        step = nxt.gather(1, last[:, None])[:, 0]
        last = torch.where(step >= 0, step, last)
    rows = torch.arange(batch, device=device)
    bonus = (residual[rows, last] / noise[rows, last]).argmax(-1)  # (B,): race over the final residual
    path = paths[last]  # (B, D+1)
    path_len = depth[last] + 1
    # out[k] = tokens[path[k + 1]] for k < path_len - 1, then the bonus, then 0s
    steps = torch.arange(paths.shape[1], device=device)[None, :]
    next_node = torch.cat([path[:, 1:], torch.zeros_like(path[:, :1])], dim=1)  # (B, D+1)
    out = torch.where(steps < path_len[:, None] - 1, tokens[rows[:, None], next_node],
                      torch.where(steps == path_len[:, None] - 1, bonus[:, None], 0))
    return path, path_len, out, last

"""Verification rules: which drafted nodes the target accepts, and the token it adds after them.

The host rules walk the tree from the root and return the accepted path (root first) and the
bonus token; `speculative_accept_on_device` is `accept_sampled` for every node at once, on the
device (the fast path's rule for sampled children). All keep the output exactly the target's:
greedy output for temperature 0, and samples distributed exactly as the target's (processed)
distribution otherwise.
"""
from __future__ import annotations

import torch

from ssmspec.trees import Tree

from .sampling import sample


def accept_greedy(tree: Tree, tokens: list[int], target_ids: list[int]) -> tuple[list[int], int]:
    """Greedy verification: descend while a child carries the target's argmax at its parent.

    Args:
        tokens: the N draft tokens (node 0 the root). target_ids: (N,) target argmax at each node.
    """
    return _walk(tree, tokens, target_ids.__getitem__)


def accept_deterministic(tree: Tree, tokens: list[int], p: torch.Tensor, generator) -> tuple[list[int], int]:
    """The 'naive' rule, exact for drafts chosen deterministically (top-k children, n-grams).

    At node u draw x ~ p_u; if a child of u carries x, descend to it; else x is the bonus token.
    Every emitted token is a draw from the target at its position, so the output is distributed
    exactly as the target's. With greedy p (one-hot argmax) this is greedy verification.

    Args:
        tree: the draft tree (N nodes). tokens: its N tokens, node 0 the root.
        p: (N, V) processed target distributions at every node.
    """
    return _walk(tree, tokens, lambda node: sample(p[node], generator))


def _walk(tree: Tree, tokens: list[int], draw) -> tuple[list[int], int]:
    children = tree.child_lists()
    node, path = 0, [0]
    while True:
        x = draw(node)
        nxt = next((c for c in children[node] if tokens[c] == x), None)
        if nxt is None:
            return path, x
        node = nxt
        path.append(node)


def accept_sampled(tree: Tree, tokens: list[int], p: torch.Tensor, q: torch.Tensor, generator) -> tuple[list[int], int]:
    """Multi-step speculative sampling (SpecInfer), exact for children drawn i.i.d. from q.

    At node u with residual r = p_u, try its children c in order: accept c with probability
    min(1, r(x_c) / q_c(x_c)); on rejection set r <- normalise(max(r - q_c, 0)) and try the next
    sibling. If all are rejected, the bonus token is drawn from r. For a chain (one child per
    node) this is the standard rejection rule with the residual (p - q)+.

    Args:
        p: (N, V) processed target distributions at every node.
        q: (N, V) q[c] is the drafter distribution node c was drawn from (its parent's).
    """
    children = tree.child_lists()
    node, path = 0, [0]
    while True:
        residual = p[node]
        for c in children[node]:
            x = tokens[c]
            qc = q[c]
            accept_prob = 1.0 if qc[x] <= 0 else min(1.0, float(residual[x] / qc[x]))
            if float(torch.rand((), generator=generator)) < accept_prob:
                node = c
                path.append(c)
                break
            residual = rejection_residual(residual, qc)
        else:
            return path, sample(residual, generator)


def rejection_residual(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The residual after a drafted token from q is rejected: normalise(max(r - q, 0)) over the
    last dim. Its sum is 0 only where r == q, where no rejection can happen: r is kept there.

    Args:
        r, q: (..., V) distributions.
    """
    lifted = (r - q).clamp_min(0.0)
    total = lifted.sum(-1, keepdim=True)
    return torch.where(total > 1e-12, lifted / total.clamp_min(1e-12), r)


def speculative_accept_on_device(
    p: torch.Tensor,
    q: torch.Tensor,
    tokens: torch.Tensor,
    children: torch.Tensor,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
    paths: torch.Tensor,
    depth: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`accept_sampled` (multi-step speculative sampling) for every node at once, on the device.

    Every node u decides as if the walk had reached it, with its own randomness: r_0 = p_u; for
    its children c_j in packed order, accept c_j iff U[u, j] < r_j(x_c) / q_u(x_c), else
    r_{j+1} = normalise(max(r_j - q_u, 0)); next[u] = the first accepted child (or -1), and the
    bonus at u is a draw from the last residual (the exponential race of sampling.race_scores).
    Then the walk follows `next` from the root. Deciding all nodes up front is distributionally
    the sequential walk: the draws of distinct nodes are independent and the walk reads only the
    decisions of the nodes it visits, each exactly once, so the walked path and bonus have the
    law of `accept_sampled`'s (the same argument the race acceptance of the naive rule rests on).
    No host sync and a fixed launch count: capturable in a CUDA graph.

    Args:
        p: (B, N, V) fp32 processed target distributions after each node.
        q: (B, N, V) fp32, q[b, u] = the drafter distribution u's children were drawn from
            (i.i.d.); rows of leaves are not read.
        tokens: (B, N) int64 tree tokens, node 0 the root.
        children: (N, K) int64 children of each node in packed order, padded with -1.
        uniforms: (B, N, K) fp32 U[0, 1) draws, one per node and sibling slot.
        noise: (B, N, V) fp32 Exp(1) draws (sampling.race_noise_) for the bonus races.
        paths: (N, D+1) int64, paths[i] = the root-to-i node list padded with 0.
        depth: (N,) int64 node depths, 0 at the root.

    Returns:
        as ops/greedy_accept (naive_greedy_accept): path (B, D+1), path_len (B,), out (B, D+1)
        (accepted drafted tokens, the bonus, then 0s) and last (B,), all int64.
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


def children_table(tree: Tree, device=None) -> torch.Tensor:
    """(N, K) children of every node in packed order, padded with -1 (K = the widest fan-out)."""
    lists = tree.child_lists()
    width = max(1, max(len(c) for c in lists))
    return torch.tensor([c + [-1] * (width - len(c)) for c in lists], dtype=torch.long, device=device)

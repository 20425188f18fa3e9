"""Verification rules: which drafted nodes the target accepts, and the token it adds after them.

The host rules walk the tree from the root and return the accepted path (root first) and the
bonus token; ops/sampled_accept is `accept_sampled` on the device (the fast path's rule for
sampled children). All keep the output exactly the target's:
greedy output for temperature 0, and samples distributed exactly as the target's (processed)
distribution otherwise.
"""
from __future__ import annotations

import torch

from ssmspec.trees import Tree

from ..ops.sampled_accept.naive import rejection_residual
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


def children_table(tree: Tree, device=None) -> torch.Tensor:
    """(N, K) children of every node in packed order, padded with -1 (K = the widest fan-out)."""
    lists = tree.child_lists()
    width = max(1, max(len(c) for c in lists))
    return torch.tensor([c + [-1] * (width - len(c)) for c in lists], dtype=torch.long, device=device)

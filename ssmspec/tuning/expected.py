"""Expected accepted length of a draft tree from per-depth, per-rank acceptance, and the best tree.

The model (Sequoia's positional acceptance, made depth-dependent): below a node that the target
accepted, the child of sibling rank r (0 = the drafter's best token, or its first draw) at
depth d is the accepted one with probability ``a[d-1][r]``, whatever the other siblings are;
the events of one node's children are disjoint, so ``sum_r a[d-1][r] <= 1``. A node is accepted
with the product of its path's probabilities, hence

    E[tokens per target call] = 1 + sum over drafted nodes v of prod_{u on root..v, u != root} a[depth(u)-1][rank(u)]

(the 1 is the bonus token the target adds after the accepted path). For a configuration
(N1, ..., Ng) every node at depth d-1 has N_d children, so with S_d = sum_{r < N_d} a[d-1][r]:

    E = 1 + sum_{d=1..g} prod_{j=1..d} S_j.

Depths past the vector's last row and ranks past its width count as never accepted.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Sequence

from ssmspec.trees import Tree

Acceptance = Sequence[Sequence[float]]
"""a[d][r]: probability that the rank-r child at depth d + 1 is accepted, given its parent was."""


def _rate(acceptance: Acceptance, depth: int, rank: int) -> float:
    """a for a node at `depth` (>= 1) and sibling `rank`; 0 outside the measured range."""
    if depth - 1 >= len(acceptance) or rank >= len(acceptance[depth - 1]):
        return 0.0
    return float(acceptance[depth - 1][rank])


def expected_config_length(config: Sequence[int], acceptance: Acceptance) -> float:
    """Expected tokens per target call (accepted drafts + the bonus) of configuration (N1, ..., Ng)."""
    total, reach = 1.0, 1.0
    for d, width in enumerate(config, start=1):
        reach *= sum(_rate(acceptance, d, r) for r in range(width))
        total += reach
    return total


def sibling_ranks(tree: Tree) -> list[int]:
    """Each node's rank among its siblings, in packed order (the drafter's rank; root 0)."""
    ranks = [0] * tree.num_nodes
    for children in tree.child_lists():
        for r, c in enumerate(children):
            ranks[c] = r
    return ranks


def expected_tree_length(tree: Tree, acceptance: Acceptance) -> float:
    """Expected tokens per target call of any tree (children ranked in packed order)."""
    ranks, depths = sibling_ranks(tree), tree.depths
    reach = [1.0] * tree.num_nodes
    for i in range(1, tree.num_nodes):
        reach[i] = reach[tree.parents[i]] * _rate(acceptance, depths[i], ranks[i])
    return 1.0 + sum(reach[1:])


def best_tree(acceptance: Acceptance, nodes: int, max_depth: int, max_width: int | None = None) -> tuple[Tree, float]:
    """The tree of at most `nodes` nodes (root included) and depth <= max_depth that maximises
    the expected tokens per call under `acceptance` (Sequoia's dynamic program, per depth).
    Returns (tree, expected tokens per call)."""
    return best_trees(acceptance, nodes, max_depth, max_width)[-1]


def best_trees(acceptance: Acceptance, max_nodes: int, max_depth: int, max_width: int | None = None) -> list[tuple[Tree, float]]:
    """`best_tree` for every size 1 .. max_nodes at once (one table serves them all); index n - 1.

    subtree value of a node at depth d with m - 1 nodes below it = its acceptance times
    (1 + children(d, 0, m - 1)); children(d, r, j): best value of spending j nodes on the
    children of ranks r, r+1, ... of a node at depth d (a rank is used only after the ranks
    before it, as the drafter ranks its children).
    """
    if max_nodes < 1:
        raise ValueError("a tree needs at least its root: nodes >= 1")
    width = max_width if max_width is not None else max((len(row) for row in acceptance), default=0)

    @lru_cache(maxsize=None)
    def children(d: int, r: int, j: int) -> tuple[float, tuple]:
        """(value, plan): plan = (m_r, m_r+1, ...) sizes of the subtrees of ranks r, r+1, ..."""
        if j == 0 or d >= max_depth or r >= width:
            return 0.0, ()
        a = _rate(acceptance, d + 1, r)
        best_v, best_plan = 0.0, ()
        # A never-accepted rank is still worth one node when a later rank is accepted.
        for m in range(1, j + 1 if a > 0.0 else 2):
            below_v, _ = children(d + 1, 0, m - 1)
            rest_v, rest_plan = children(d, r + 1, j - m)
            v = a * (1.0 + below_v) + rest_v
            if v > best_v + 1e-15:
                best_v, best_plan = v, ((m,) + rest_plan)
        return best_v, best_plan

    out = []
    for nodes in range(1, max_nodes + 1):
        value, _ = children(0, 0, nodes - 1)
        # Rebuild breadth-first so that parents come first and siblings stay in rank order.
        parents = [-1]
        queue = [(0, 0, nodes - 1)]  # (packed index, depth, nodes below it)
        while queue:
            nxt = []
            for node, d, below in queue:
                for m in children(d, 0, below)[1]:
                    parents.append(node)
                    nxt.append((len(parents) - 1, d + 1, m - 1))
            queue = nxt
        out.append((Tree.from_parents(parents), 1.0 + value))
    return out

"""Plain-torch reference of greedy tree acceptance (the spec of the two kernels in triton.py)."""
from __future__ import annotations

import torch


def naive_greedy_accept(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    depth: torch.Tensor,
    mask: torch.Tensor,
    paths: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy acceptance of one verified tree per batch row, all on the device (no host sync).

    With best[i] = argmax_v logits[b, i, v] (the target's token after node i):
        accepted[i] = i == 0  or  tokens[b, i] == best[parent(i)]
        survives[i] = accepted[j] for every j on the root-to-i path (mask[i, j])
        last        = the deepest survivor, the lowest packed index among survivors of equal depth
    The accepted path is paths[last]; best[last] is the bonus token. Argmax ties go to the lowest
    vocabulary index, as torch.argmax. Logits must be NaN-free (torch.argmax takes a NaN as the
    maximum; the kernels do not).

    Args:
        logits: (B, N, V) fp32, bf16 or fp16 target logits after each node.
        tokens: (B, N) int64 tree tokens, node 0 the root.
        parents: (N,) int64, -1 at the root, parents[i] < i.
        depth: (N,) int64 node depths, 0 at the root.
        mask: (N, N) bool, mask[i, j] when j is on the root-to-i path (i included).
        paths: (N, D+1) int64, paths[i] = the root-to-i node list padded with 0.

    Returns:
        path: (B, D+1) int64, paths[last]: the accepted nodes root first, then 0s.
        path_len: (B,) int64, nodes on the accepted path (accepted drafted tokens + 1).
        out: (B, D+1) int64, the produced tokens: the accepted drafted tokens, the bonus, then 0s.
        last: (B,) int64, the last node of the accepted path.
    """
    batch, n_nodes = tokens.shape
    device = tokens.device
    best = logits.argmax(-1)  # (B, N)
    accepted = tokens == best[:, parents.clamp_min(0)]
    accepted[:, 0] = True
    survives = (~accepted).float() @ mask.float().T == 0  # (B, N): no rejected node on the path
    # unique score, strictly decreasing in the index at equal depth
    order = torch.arange(n_nodes, device=device)
    score = torch.where(survives, depth * (n_nodes + 1) + (n_nodes - order), -1)
    last = score.argmax(-1)  # (B,)
    path = paths[last]  # (B, D+1)
    path_len = depth[last] + 1
    rows = torch.arange(batch, device=device)[:, None]
    bonus = best[rows, last[:, None]]  # (B, 1)
    # out[k] = tokens[path[k + 1]] for k < path_len - 1, then the bonus, then 0s
    steps = torch.arange(paths.shape[1], device=device)[None, :]
    next_node = torch.cat([path[:, 1:], torch.zeros_like(path[:, :1])], dim=1)  # (B, D+1)
    out = torch.where(steps < path_len[:, None] - 1, tokens[rows, next_node],
                      torch.where(steps == path_len[:, None] - 1, bonus, 0))
    return path, path_len, out, last

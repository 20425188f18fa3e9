"""Plain-torch reference of activation replay (verification never writes the state)."""
from __future__ import annotations

import torch


def naive_replay_ssm_state(
    ssm_state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    path: torch.Tensor,
    path_len: torch.Tensor,
) -> None:
    """Advance the SSM state in place over the first path_len[b] nodes of path[b].

    h <- exp(dt A) h + dt B x^T for each accepted node, in order. Rows past path_len get dt = 0,
    which leaves the state untouched, so lengths stay device tensors (no host sync).

    Args:
        ssm_state: (B, H, P, S) fp32, updated in place.
        x: (B, N, H, P); dt: (B, N, H); B: (B, N, G, S) cached activations of the verified tree.
        A: (H,).
        path: (B, M) int64 node indices, root first.
        path_len: (B,) int, valid entries of each row of path.
    """
    batch, steps = path.shape
    heads = x.shape[2]
    groups = B.shape[2]
    rows = torch.arange(batch, device=path.device)[:, None]
    xp = x[rows, path].float()  # (B, M, H, P)
    dtp = dt[rows, path].float()  # (B, M, H)
    Bp = B[rows, path].float().repeat_interleave(heads // groups, dim=2)  # (B, M, H, S)
    valid = torch.arange(steps, device=path.device)[None, :] < path_len[:, None]
    dtp = dtp * valid[..., None]
    h = ssm_state.float()
    for m in range(steps):
        decay = torch.exp(dtp[:, m] * A.float())  # (B, H)
        h = h * decay[..., None, None] + torch.einsum("bh,bhp,bhs->bhps", dtp[:, m], xp[:, m], Bp[:, m])
    ssm_state.copy_(h)


def naive_replay_conv_state(
    conv_state: torch.Tensor, xBC: torch.Tensor, path: torch.Tensor, path_len: torch.Tensor
) -> None:
    """Shift the accepted path's pre-conv inputs into the conv state, in place.

    Args:
        conv_state: (B, C, K-1) oldest first, updated in place.
        xBC: (B, N, C) pre-conv inputs of the verified tree.
        path: (B, M) int64 node indices, root first.
        path_len: (B,) int.
    """
    batch = path.shape[0]
    history = conv_state.shape[-1]
    rows = torch.arange(batch, device=path.device)[:, None]
    extended = torch.cat([conv_state.transpose(1, 2), xBC[rows, path].to(conv_state.dtype)], dim=1)
    take = path_len[:, None].long() + torch.arange(history, device=path.device)[None, :]  # (B, K-1)
    conv_state.copy_(extended[rows, take].transpose(1, 2))


def naive_replay_states(
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    xBC: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    path: torch.Tensor,
    path_len: torch.Tensor,
) -> None:
    """Both replays of one Mamba layer: `naive_replay_conv_state`, then `naive_replay_ssm_state`.

    Args:
        conv_state: (B, C, K-1) oldest first, updated in place.
        ssm_state: (B, H, P, S) fp32, updated in place.
        xBC: (B, N, C) pre-conv inputs; x: (B, N, H, P); dt: (B, N, H); B: (B, N, G, S)
            cached activations of the verified tree.
        A: (H,).
        path: (B, M) int64 node indices, root first.
        path_len: (B,) int.
    """
    naive_replay_conv_state(conv_state, xBC, path, path_len)
    naive_replay_ssm_state(ssm_state, x, dt, A, B, path, path_len)


def naive_replay_states_layers(
    conv_states: list[torch.Tensor],
    ssm_states: list[torch.Tensor],
    xBCs: list[torch.Tensor],
    xs: list[torch.Tensor],
    dts: list[torch.Tensor],
    As: list[torch.Tensor],
    Bs: list[torch.Tensor],
    path: torch.Tensor,
    path_len: torch.Tensor,
) -> None:
    """`naive_replay_states` of each of L Mamba layers along one accepted path.

    Args:
        conv_states: L tensors (B, C, K-1) oldest first, updated in place.
        ssm_states: L tensors (B, H, P, S) fp32, updated in place.
        xBCs: L tensors (B, N, C) pre-conv inputs; xs: L (B, N, H, P); dts: L (B, N, H);
            Bs: L (B, N, G, S) cached activations of the verified tree.
        As: L tensors (H,).
        path: (B, M) int64 node indices, root first, shared by all layers.
        path_len: (B,) int.
    """
    for conv_state, ssm_state, xBC, x, dt, A, B in layer_arguments(conv_states, ssm_states, xBCs, xs, dts, As, Bs):
        naive_replay_states(conv_state, ssm_state, xBC, x, dt, A, B, path, path_len)


def layer_arguments(*per_layer: list[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
    """The per-layer lists of `naive_replay_states_layers` as one (conv state, SSM state, xBC,
    x, dt, A, B) tuple per layer; the lists must be equally long."""
    if len({len(items) for items in per_layer}) != 1:
        raise ValueError("replay_states_layers: pass one conv state, SSM state, xBC, x, dt, A and B per layer")
    return list(zip(*per_layer))

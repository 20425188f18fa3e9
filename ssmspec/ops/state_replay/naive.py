"""Plain-torch reference of activation replay (verification never writes the state).

With pending inputs (ReplaySSM; models/cache.py) the replay of the SSM state is deferred: the
accepted path's (x, dt, B) are appended to the pending slots, and the state absorbs the slots
and the path only when the next path might not fit (a flush). `pending` arguments are
(x (B, L, H, P), dt (B, L, H), B (B, L, G, S), count (B,)): slots [0, count) of each row hold the committed inputs that the state has not absorbed, oldest first.
"""
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


def flush_rows(count: torch.Tensor, path_len: torch.Tensor, width: int, capacity: int,
               force: bool = False) -> torch.Tensor:
    """(B,) bool: rows whose replay of path_len tokens (of a path `width` wide) flushes the pending
    inputs into the state, because the next path of that width might not fit in the slots."""
    steps = path_len.long().clamp(max=width)
    flush = count.long() + steps + width > capacity
    return flush | force


def naive_pending_state(ssm_state: torch.Tensor, A: torch.Tensor, pending) -> torch.Tensor:
    """The state after the pending inputs: ssm_state advanced over slots [0, count) of
    `pending` (x, dt, B, count); a new fp32 tensor, ssm_state is not written."""
    x, dt, B, count = pending
    batch, capacity = x.shape[:2]
    slots = torch.arange(capacity, device=x.device).expand(batch, capacity)
    state = ssm_state.float().clone()
    naive_replay_ssm_state(state, x, dt, A, B, slots, count.long().clamp(0, capacity))
    return state


def naive_replay_ssm_deferred(
    ssm_state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    path: torch.Tensor,
    path_len: torch.Tensor,
    pending,
    force: bool = False,
) -> None:
    """The SSM half of a replay with pending inputs: per row, either append the path's inputs to
    the pending slots, or (a flush, see `flush_rows`) advance the state over the pending slots
    and then the path. The positions (seqlen, count) are advanced afterwards by
    `naive_advance_positions`, with the same flush rule."""
    px, pdt, pB, count = pending
    width, capacity = path.shape[1], px.shape[1]
    flush = flush_rows(count, path_len, width, capacity, force)
    for b in range(path.shape[0]):
        rows = slice(b, b + 1)
        if bool(flush[b]):
            state = naive_pending_state(ssm_state[rows], A, (px[rows], pdt[rows], pB[rows], count[rows]))
            naive_replay_ssm_state(state, x[rows], dt[rows], A, B[rows], path[rows], path_len[rows])
            ssm_state[rows] = state
            continue
        n, start = min(int(path_len[b]), width), int(count[b])
        nodes = path[b, :n]
        px[b, start:start + n] = x[b, nodes].to(px.dtype)
        pdt[b, start:start + n] = dt[b, nodes].to(pdt.dtype)
        pB[b, start:start + n] = B[b, nodes].to(pB.dtype)


def naive_advance_positions(seqlen: torch.Tensor, count: torch.Tensor, path_len: torch.Tensor, width: int,
                            capacity: int) -> None:
    """After a replay with pending inputs: rows that flushed have no pending inputs left, the
    others n more (their path's); every row's seqlen advances by its path length n. In place."""
    flush = flush_rows(count, path_len, width, capacity)
    steps = path_len.long().clamp(max=width)
    count.copy_(torch.where(flush, torch.zeros_like(count), count + steps.to(count.dtype)))
    seqlen += steps.to(seqlen.dtype)


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
    pending=None,
) -> None:
    """Both replays of one Mamba layer: `naive_replay_conv_state`, then `naive_replay_ssm_state`
    (or, with `pending`, `naive_replay_ssm_deferred`; positions are not advanced here).

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
    if pending is None:
        naive_replay_ssm_state(ssm_state, x, dt, A, B, path, path_len)
    else:
        naive_replay_ssm_deferred(ssm_state, x, dt, A, B, path, path_len, pending)


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
    pending=None,
) -> None:
    """`naive_replay_states` of each of L Mamba layers along one accepted path.

    pending: None, or (xs, dts, Bs, count) with one pending tensor per layer in each list.

    Args:
        conv_states: L tensors (B, C, K-1) oldest first, updated in place.
        ssm_states: L tensors (B, H, P, S) fp32, updated in place.
        xBCs: L tensors (B, N, C) pre-conv inputs; xs: L (B, N, H, P); dts: L (B, N, H);
            Bs: L (B, N, G, S) cached activations of the verified tree.
        As: L tensors (H,).
        path: (B, M) int64 node indices, root first, shared by all layers.
        path_len: (B,) int.
    """
    per_layer = pending_per_layer(pending, len(ssm_states))
    layers = layer_arguments(conv_states, ssm_states, xBCs, xs, dts, As, Bs)
    for (conv_state, ssm_state, xBC, x, dt, A, B), layer_pending in zip(layers, per_layer):
        naive_replay_states(conv_state, ssm_state, xBC, x, dt, A, B, path, path_len, layer_pending)


def naive_settle_pending_layers(ssm_states: list[torch.Tensor], As: list[torch.Tensor], pending) -> None:
    """Flush every layer's pending inputs into its state (a replay of an empty path that always
    flushes); the caller then sets the count to 0."""
    count = pending[3]
    empty = torch.zeros(count.shape[0], 1, dtype=torch.long, device=count.device)
    no_steps = torch.zeros(count.shape[0], dtype=torch.long, device=count.device)
    for ssm_state, A, layer_pending in zip(ssm_states, As, pending_per_layer(pending, len(ssm_states))):
        px, pdt, pB, _ = layer_pending
        naive_replay_ssm_deferred(ssm_state, px, pdt, A, pB, empty, no_steps, layer_pending, force=True)


def pending_per_layer(pending, layers: int) -> list:
    """(xs, dts, Bs, count) as one (x, dt, B, count) per layer (None: Nones)."""
    if pending is None:
        return [None] * layers
    xs, dts, Bs, count = pending
    if not len(xs) == len(dts) == len(Bs) == layers:
        raise ValueError(f"replay: pending inputs for {len(xs)}/{len(dts)}/{len(Bs)} layers, expected {layers}")
    return [(x, dt, B, count) for x, dt, B in zip(xs, dts, Bs)]


def layer_arguments(*per_layer: list[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
    """The per-layer lists of `naive_replay_states_layers` as one (conv state, SSM state, xBC,
    x, dt, A, B) tuple per layer; the lists must be equally long."""
    if len({len(items) for items in per_layer}) != 1:
        raise ValueError("replay_states_layers: pass one conv state, SSM state, xBC, x, dt, A and B per layer")
    return list(zip(*per_layer))

"""The chunked SSD scan through flash-linear-attention's chunked simple-GLA (Triton, forward and backward).

Mamba-2's SSD recurrence, per head,

    h_t = exp(dt_t A) h_{t-1} + (dt_t x_t) B_t^T        h: (P, S)
    y_t = h_t C_t + D x_t

is simple GLA's S_t = exp(g_t) S_{t-1} + v_t k_t^T, o_t = scale * S_t q_t with q = C, k = B,
v = dt x, g = dt A (log-space decay per token and head), scale = 1 (fla defaults to 1/sqrt(S))
and the state kept V-first, (P, S), as ours. B and C are shared by the heads of a group: they are
repeated to heads here (the repeat's backward sums their gradients back). D is added outside.
fla's kernels use their own chunk length (64); the result does not depend on it.
"""
from __future__ import annotations

FLA_CHUNK = 64


def fla_available() -> str | None:
    """fla-core's version when its simple-GLA op imports, else None (fla is an optional GPU extra)."""
    try:
        import fla
        from fla.ops.simple_gla import chunk_simple_gla  # noqa: F401
    except Exception:
        return None
    return getattr(fla, "__version__", "unknown")


def fla_refusal(device) -> str | None:
    """Why fla's kernels cannot train on `device`, or None. fla-core 0.6.0 refuses the backward of
    its gated chunked kernels on Hopper with Triton >= 3.4 and < 3.7.1 (wrong results in those
    Triton versions, fla issue #640): seen on the H100 with Triton 3.6.0."""
    import torch
    import triton

    if torch.cuda.get_device_capability(device)[0] != 9:
        return None
    parts = []
    for piece in triton.__version__.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    version = tuple(parts + [0] * (3 - len(parts)))
    if (3, 4, 0) <= version < (3, 7, 1):
        return f"fla's backward refuses Triton {triton.__version__} on Hopper (needs >= 3.7.1 or tilelang)"
    return None


def fla_chunk_scan(x, dt, A, B, C, D, chunk_size: int = 64, initial_state=None):
    """Same contract as `naive_chunk_scan`, run by fla's Triton kernels.

    Args:
        x: (B, T, H, P); dt: (B, T, H) after softplus and clamp; A: (H,) negative.
        B, C: (B, T, G, S); D: (H,) or None.
        chunk_size: Mamba's chunk length; unused (fla's own is FLA_CHUNK, the result is the same).
        initial_state: (B, H, P, S) or None.
    Returns:
        y: (B, T, H, P) fp32 and final_state: (B, H, P, S) fp32.
    """
    from fla.ops.simple_gla import chunk_simple_gla

    heads, groups = x.shape[2], B.shape[2]
    dtype = x.dtype
    dtf = dt.float()
    q = C.to(dtype).repeat_interleave(heads // groups, dim=2)  # (B, T, G, S) -> (B, T, H, S)
    k = B.to(dtype).repeat_interleave(heads // groups, dim=2)
    v = (x.float() * dtf[..., None]).to(dtype)  # dt x, rounded once to the input dtype
    g = dtf * A.float()  # (B, T, H), fp32 log decay
    o, final = chunk_simple_gla(
        q, k, v, g=g, scale=1.0, initial_state=None if initial_state is None else initial_state.float(),
        output_final_state=True, state_v_first=True, chunk_size=FLA_CHUNK,
    )
    y = o.float()
    if D is not None:
        y = y + x.float() * D.float()[:, None]
    return y, final.float()

"""Plain-torch chunked SSD scan (Mamba-2's matmul form) and the token-by-token recurrence it equals."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_sequential_scan(x, dt, A, B, C, D, initial_state=None):
    """The recurrence itself, one token at a time: the slowest and plainest reference.

    Args:
        x: (B, T, H, P); dt: (B, T, H); A: (H,); B, C: (B, T, G, S); D: (H,) or None.
        initial_state: (B, H, P, S) or None (zeros).
    Returns:
        y: (B, T, H, P) fp32, final_state: (B, H, P, S) fp32.
    """
    batch, steps, heads, headdim = x.shape
    groups, dstate = B.shape[2], B.shape[3]
    h = x.new_zeros(batch, heads, headdim, dstate, dtype=torch.float32) if initial_state is None else initial_state.float()
    Bh = B.float().repeat_interleave(heads // groups, dim=2)
    Ch = C.float().repeat_interleave(heads // groups, dim=2)
    ys = []
    for t in range(steps):
        dtt = dt[:, t].float()  # (B, H)
        h = h * torch.exp(dtt * A.float())[..., None, None] + torch.einsum(
            "bh,bhp,bhs->bhps", dtt, x[:, t].float(), Bh[:, t]
        )
        y = torch.einsum("bhps,bhs->bhp", h, Ch[:, t])
        if D is not None:
            y = y + x[:, t].float() * D.float()[:, None]
        ys.append(y)
    return torch.stack(ys, dim=1), h


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """(..., l) -> (..., l, l) with out[i, j] = sum_{j < k <= i} a_k, -inf above the diagonal."""
    length = a.shape[-1]
    cs = torch.cumsum(a, dim=-1)
    seg = cs[..., :, None] - cs[..., None, :]
    mask = torch.tril(torch.ones(length, length, dtype=torch.bool, device=a.device))
    return seg.masked_fill(~mask, float("-inf"))


def naive_chunk_scan(x, dt, A, B, C, D, chunk_size: int = 64, initial_state=None):
    """Mamba-2's chunked scan: quadratic attention-like form inside chunks, recurrence across them.

    Args:
        x: (B, T, H, P); dt: (B, T, H) after softplus and clamp; A: (H,) negative.
        B, C: (B, T, G, S); D: (H,) or None.
        chunk_size: chunk length l.
        initial_state: (B, H, P, S) or None.
    Returns:
        y: (B, T, H, P) fp32 and final_state: (B, H, P, S) fp32.
    """
    batch, steps, heads, headdim = x.shape
    groups, dstate = B.shape[2], B.shape[3]
    pad = (-steps) % chunk_size
    xf = F.pad(x.float(), (0, 0, 0, 0, 0, pad))
    dtf = F.pad(dt.float(), (0, 0, 0, pad))  # dt = 0 on padding: no decay, no input
    Bh = F.pad(B.float(), (0, 0, 0, 0, 0, pad)).repeat_interleave(heads // groups, dim=2)
    Ch = F.pad(C.float(), (0, 0, 0, 0, 0, pad)).repeat_interleave(heads // groups, dim=2)
    nc = (steps + pad) // chunk_size
    # (B, T, ...) -> (B, nc, l, ...)
    xf, dtf, Bh, Ch = (t.reshape(batch, nc, chunk_size, *t.shape[2:]) for t in (xf, dtf, Bh, Ch))
    a = (dtf * A.float()).permute(0, 3, 1, 2)  # (B, H, nc, l)
    a_cum = torch.cumsum(a, dim=-1)
    xdt = xf * dtf[..., None]  # (B, nc, l, H, P)

    # Inside each chunk: y_i = sum_{j <= i} C_i.B_j exp(a_{j+1..i}) dt_j x_j.
    decay_in = torch.exp(_segsum(a))  # (B, H, nc, l, l)
    scores = torch.einsum("bclhs,bcmhs->bhclm", Ch, Bh) * decay_in
    y_diag = torch.einsum("bhclm,bcmhp->bclhp", scores, xdt)

    # Each chunk's own contribution to the state at its end.
    decay_to_end = torch.exp(a_cum[..., -1:] - a_cum)  # (B, H, nc, l)
    chunk_states = torch.einsum("bclhs,bhcl,bclhp->bchps", Bh, decay_to_end, xdt)

    # Recurrence across chunks (nc is small, a loop is clearest).
    h = x.new_zeros(batch, heads, headdim, dstate, dtype=torch.float32) if initial_state is None else initial_state.float()
    chunk_decay = torch.exp(a_cum[..., -1])  # (B, H, nc)
    starts = []
    for c in range(nc):
        starts.append(h)
        h = h * chunk_decay[:, :, c, None, None] + chunk_states[:, c]
    start_states = torch.stack(starts, dim=1)  # (B, nc, H, P, S)

    y_off = torch.einsum("bclhs,bchps,bhcl->bclhp", Ch, start_states, torch.exp(a_cum))
    y = (y_diag + y_off).reshape(batch, nc * chunk_size, heads, headdim)[:, :steps]
    if D is not None:
        y = y + x.float() * D.float()[:, None]
    return y, h

"""Chunk-parallel SSD scan in plain torch: Mamba-2's four SSD stages batched over every chunk and head, no loop.

Per head, with a_t = dt_t A (log decay) and h the (P, S) state,

    h_t = exp(a_t) h_{t-1} + (dt_t x_t) B_t^T,        y_t = h_t C_t + D x_t.

Cut the sequence into chunks of l tokens and let L[i, j] = exp(a_{j+1} + ... + a_i) for j <= i, else 0
(the segment-sum decay mask). The Mamba-2 paper's block decomposition of the SSD matrix gives four
stages, each one batched product over all chunks at once:

1. diagonal blocks (inside a chunk):   Y_diag = ((C B^T) o L) (dt x)
2. chunk states (each chunk alone):     s_c = sum_j exp(a_{j+1..end}) (dt_j x_j) B_j^T
3. state passing (between chunks):      h_c = sum_{c' <= c} exp(A_{c'+1..c}) s_c', the initial state as
                                        chunk -1: a (nchunks+1)^2 segment-sum decay matrix, no recurrence
4. off-diagonal blocks (from the past): Y_off_i = exp(a_{1..i}) C_i h_{c-1}

The products run in the matmul dtype (the autocast dtype under autocast, else x's dtype: bf16 on the
tensor cores in training); cumsums, exps, the state passing and the outputs are fp32. B and C stay
per group (G), never repeated to heads: heads are split as H = G x R and contract with their group.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _segsum_diff(a: torch.Tensor) -> torch.Tensor:
    """(..., l) -> (..., l, l): out[i, j] = sum_{j < k <= i} a_k, -inf above the diagonal (from one cumsum:
    cheap, exact enough inside a chunk where the sums stay small)."""
    length = a.shape[-1]
    cs = torch.cumsum(a, dim=-1)
    seg = cs[..., :, None] - cs[..., None, :]
    keep = torch.tril(torch.ones(length, length, dtype=torch.bool, device=a.device))
    return seg.masked_fill(~keep, float("-inf"))


def _segsum_exact(a: torch.Tensor) -> torch.Tensor:
    """(..., n) -> (..., n, n) as `_segsum_diff`, but each segment summed on its own: no difference of two
    large prefix sums (across a whole sequence they reach thousands). n is the chunk count, small."""
    n = a.shape[-1]
    rows = a[..., :, None].expand(*a.shape, n)  # rows[i, j] = a_i
    strict = torch.tril(torch.ones(n, n, dtype=torch.bool, device=a.device), diagonal=-1)
    seg = torch.cumsum(rows.masked_fill(~strict, 0.0), dim=-2)  # sum of a_k over j < k <= i
    keep = torch.tril(torch.ones(n, n, dtype=torch.bool, device=a.device))
    return seg.masked_fill(~keep, float("-inf"))


def _matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the products run in: autocast's where it is on for x's device, else x's own."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype if x.dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.float32


def _ssd(x, dt, A, B, C, D, chunk_size: int, initial_state, dtype: torch.dtype):
    """The four stages (module docstring), autocast off: every dtype here is explicit."""
    batch, steps, heads, headdim = x.shape
    groups, dstate = B.shape[2], B.shape[3]
    rep = heads // groups
    length = max(1, min(chunk_size, steps))  # one short chunk when the sequence is shorter than a chunk
    pad = (-steps) % length
    nc = (steps + pad) // length
    # dt = 0 on the padding: no decay, no input, so the final state is the last real token's.
    dtf = F.pad(dt.float(), (0, 0, 0, pad)).reshape(batch, nc, length, heads)
    xf = F.pad(x, (0, 0, 0, 0, 0, pad)).reshape(batch, nc, length, groups, rep, headdim)
    Bc = F.pad(B, (0, 0, 0, 0, 0, pad)).to(dtype).reshape(batch, nc, length, groups, dstate)
    Cc = F.pad(C, (0, 0, 0, 0, 0, pad)).to(dtype).reshape(batch, nc, length, groups, dstate)

    a = (dtf * A.float()).permute(0, 1, 3, 2)  # (B, nc, H, l) log decay per token
    a_cum = torch.cumsum(a, dim=-1)
    xdt = xf.float() * dtf.reshape(batch, nc, length, groups, rep, 1)  # (B, nc, l, G, R, P) fp32

    # 1. Diagonal blocks: C B^T once per group, the decay mask per head.
    cb = torch.einsum("bclgs,bcmgs->bcglm", Cc, Bc)  # (B, nc, G, l, l)
    decay_in = torch.exp(_segsum_diff(a)).reshape(batch, nc, groups, rep, length, length)
    scores = (decay_in * cb[:, :, :, None]).to(dtype)  # (B, nc, G, R, l, l), the product in fp32
    y_diag = torch.einsum("bcgrlm,bcmgrp->bclgrp", scores, xdt.to(dtype))

    # 2. Each chunk's own contribution to the state at its end.
    decay_to_end = torch.exp(a_cum[..., -1:] - a_cum)  # (B, nc, H, l)
    xdt_end = xdt * decay_to_end.transpose(2, 3).reshape(batch, nc, length, groups, rep, 1)
    states = torch.einsum("bclgs,bclgrp->bcgrps", Bc, xdt_end.to(dtype)).float()
    states = states.reshape(batch, nc, heads, headdim, dstate)

    # 3. State passing: the initial state enters as chunk -1 with no decay of its own; row c of the
    # (nc+1)^2 decay matrix weighs every earlier chunk's state into the state where chunk c starts.
    h0 = (torch.zeros_like(states[:, :1]) if initial_state is None
          else initial_state.float().reshape(batch, 1, heads, headdim, dstate))
    states = torch.cat([h0, states], dim=1)  # (B, nc+1, H, P, S)
    chunk_decay = F.pad(a_cum[..., -1].transpose(1, 2), (1, 0))  # (B, H, nc+1)
    passing = torch.exp(_segsum_exact(chunk_decay))  # (B, H, nc+1, nc+1)
    states = torch.einsum("bhzc,bchps->bzhps", passing, states)  # fp32, (B, nc+1, H, P, S)
    starts, final = states[:, :-1], states[:, -1]

    # 4. Off-diagonal blocks: each chunk reads the state it starts from, decayed to each position.
    starts = starts.to(dtype).reshape(batch, nc, groups, rep, headdim, dstate)
    y_off = torch.einsum("bclgs,bcgrps->bclgrp", Cc, starts).float()
    y_off = y_off * torch.exp(a_cum).transpose(2, 3).reshape(batch, nc, length, groups, rep, 1)

    y = (y_diag.float() + y_off).reshape(batch, nc * length, heads, headdim)[:, :steps]
    if D is not None:
        y = y + x.float() * D.float()[:, None]
    return y, final


def parallel_chunk_scan(x, dt, A, B, C, D, chunk_size: int = 64, initial_state=None):
    """`naive_chunk_scan`'s contract, every chunk at once (module docstring); differentiable through autograd.

    Args:
        x: (B, T, H, P); dt: (B, T, H) after softplus and clamp; A: (H,) negative.
        B, C: (B, T, G, S) with G dividing H; D: (H,) or None.
        chunk_size: chunk length l (a shorter sequence is one chunk of its own length).
        initial_state: (B, H, P, S) or None.
    Returns:
        y: (B, T, H, P) fp32 and final_state: (B, H, P, S) fp32.
    """
    dtype = _matmul_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        return _ssd(x, dt, A, B, C, D, chunk_size, initial_state, dtype)


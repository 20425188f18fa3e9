"""Triton kernel of `sampled_accept`; `naive.py` is the spec.

The reference decides every node of the tree up front (a residual over the vocabulary for every
node and sibling slot, then a walk): some 40 small launches per iteration, a fifth of a small
pair's speculative iteration at T > 0. Here one program per batch row walks from the root and
touches the vocabulary only where the walk needs it: accepting a child reads two scalars, a
rejection writes the next residual max(r - q, 0) into a scratch row (kept unnormalised, with its
sum), and the bonus is one race over the final residual. The walk visits exactly the nodes whose
decisions the reference's walk reads, with the same uniforms and noise, so both pick the same
path and bonus (up to the rounding of the residual's sum, which only the order of a reduction
changes).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_common import NO_INDEX, argmax_pick, argmax_step, gdc_launch_dependents, gdc_wait, pdl_args

BLOCK_V = 2048


@triton.jit
def _residual_at(p_row, scratch_row, src, buf, total, idx, V, mask):
    """r[idx] of the current residual: p's row (src 0), or scratch row `buf` over `total`."""
    if src == 0:
        r = tl.load(p_row + idx, mask=mask, other=0.0)
    else:
        r = tl.load(scratch_row + buf * V + idx, mask=mask, other=0.0) / total
    return r


@triton.jit
def _sampled_accept_kernel(
    p_ptr, q_ptr, tok_ptr, child_ptr, uni_ptr, noise_ptr, paths_ptr, depth_ptr, scratch_ptr,
    path_ptr, len_ptr, out_ptr, last_ptr,
    V, K, D,
    spb, spn, sqb, sqn, stb, sub, sun, snb, snn, s_path, s_out,
    BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    if USE_PDL:  # ops/pdl.py: the next kernel may launch now; wait for the previous before any access
        gdc_launch_dependents()
        gdc_wait()
    b = tl.program_id(0).to(tl.int64)
    scratch_row = scratch_ptr + b * 2 * V
    u = tl.full([], 0, tl.int64)
    done = tl.full([], 0, tl.int32)
    src = tl.full([], 0, tl.int32)  # 0: the residual is p[b, u]; 1: scratch row `buf` / total
    buf = tl.full([], 0, tl.int32)
    total = tl.full([], 1.0, tl.float32)
    for _ in range(0, D):
        if done == 0:
            src = tl.full([], 0, tl.int32)
            total = tl.full([], 1.0, tl.float32)
            p_row = p_ptr + b * spb + u * spn
            q_row = q_ptr + b * sqb + u * sqn
            taken = tl.full([], -1, tl.int64)
            for j in range(0, K):
                c = tl.load(child_ptr + u * K + j)
                if (c >= 0) & (taken < 0):
                    x = tl.load(tok_ptr + b * stb + c)
                    r_x = _residual_at(p_row, scratch_row, src, buf, total, x, V, True)
                    q_x = tl.load(q_row + x)
                    if (q_x <= 0) | (tl.load(uni_ptr + b * sub + u * sun + j) * q_x < r_x):
                        taken = c
                    else:  # rejected: the next residual max(r - q, 0), unnormalised, into the other row
                        other = 1 - buf
                        acc = tl.zeros([BLOCK_V], tl.float32)
                        for start in range(0, V, BLOCK_V):
                            offs = start + tl.arange(0, BLOCK_V)
                            mask = offs < V
                            r = _residual_at(p_row, scratch_row, src, buf, total, offs, V, mask)
                            lifted = tl.maximum(r - tl.load(q_row + offs, mask=mask, other=0.0), 0.0)
                            tl.store(scratch_row + other * V + offs, lifted, mask=mask)
                            acc += lifted
                        new_total = tl.sum(acc, axis=0)
                        # the next sibling's r(x) is one thread's load of a row all threads wrote
                        tl.debug_barrier()
                        if new_total > 1e-12:  # else r == q: the reference keeps r
                            src = tl.full([], 1, tl.int32)
                            buf = other
                            total = new_total
            if taken >= 0:
                u = taken
            else:
                done = tl.full([], 1, tl.int32)
    if done == 0:  # walked to depth D: the bonus is drawn from p at that leaf
        src = tl.full([], 0, tl.int32)
        total = tl.full([], 1.0, tl.float32)
    # The bonus: the exponential race over the final residual at u.
    p_row = p_ptr + b * spb + u * spn
    noise_row = noise_ptr + b * snb + u * snn
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    arg = tl.full([BLOCK_V], NO_INDEX, tl.int32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < V
        r = _residual_at(p_row, scratch_row, src, buf, total, offs, V, mask)
        best, arg = argmax_step(r / tl.load(noise_row + offs, mask=mask, other=1.0), offs, mask, best, arg)
    _, bonus = argmax_pick(best, arg)
    bonus = bonus.to(tl.int64)
    # Outputs, as the reference builds them: path = paths[u], out = its drafted tokens, the bonus, 0s.
    ks = tl.arange(0, BLOCK_D)
    in_row = ks <= D
    path = tl.load(paths_ptr + u * (D + 1) + ks, mask=in_row, other=0)
    n = tl.load(depth_ptr + u) + 1
    nxt = tl.load(paths_ptr + u * (D + 1) + ks + 1, mask=ks + 1 <= D, other=0)
    drafted = tl.load(tok_ptr + b * stb + nxt, mask=in_row, other=0)
    out = tl.where(ks < n - 1, drafted, tl.where(ks == n - 1, bonus, 0))
    tl.store(path_ptr + b * s_path + ks, path, mask=in_row)
    tl.store(out_ptr + b * s_out + ks, out, mask=in_row)
    tl.store(len_ptr + b, n)
    tl.store(last_ptr + b, u)


def sampled_accept(p, q, tokens, children, uniforms, noise, paths, depth, *, block_v: int | None = None):
    """One launch of `naive_sampled_accept` (same contract; `block_v`: a smaller tile for tests)."""
    batch, n_nodes, vocab = p.shape
    for name, t in (("p", p), ("q", q), ("noise", noise)):
        if t.dtype != torch.float32 or t.shape[1:] != (n_nodes, vocab) or t.stride(2) != 1:
            raise ValueError(f"sampled_accept: {name} must be (B, N, V) fp32 with unit vocabulary stride, "
                             f"got {tuple(t.shape)} {t.dtype}")
    if uniforms.stride(2) != 1 or tokens.stride(1) != 1:
        raise ValueError("sampled_accept: uniforms and tokens need a unit last stride")
    children, paths, depth = children.contiguous(), paths.contiguous(), depth.contiguous()
    n_depth = paths.shape[1] - 1
    device = p.device
    path = torch.empty(batch, n_depth + 1, dtype=torch.long, device=device)
    out = torch.empty_like(path)
    path_len = torch.empty(batch, dtype=torch.long, device=device)
    last = torch.empty(batch, dtype=torch.long, device=device)
    scratch = torch.empty(batch, 2, vocab, dtype=torch.float32, device=device)
    block_v = block_v or min(BLOCK_V, max(16, triton.next_power_of_2(vocab)))
    _sampled_accept_kernel[(batch,)](
        p, q, tokens, children, uniforms, noise, paths, depth, scratch,
        path, path_len, out, last,
        vocab, children.shape[1], n_depth,
        p.stride(0), p.stride(1), q.stride(0), q.stride(1), tokens.stride(0), uniforms.stride(0), uniforms.stride(1),
        noise.stride(0), noise.stride(1), path.stride(0), out.stride(0),
        BLOCK_V=block_v, BLOCK_D=triton.next_power_of_2(n_depth + 1), num_warps=8 if block_v >= 2048 else 4,
        **pdl_args(device),
    )
    return path, path_len, out, last

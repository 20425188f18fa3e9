"""Triton kernels of greedy tree acceptance; `naive.py` is the spec.

The reference is ~25 small torch launches between the LM head and the replay (the argmax over
the vocabulary alone is a 13 us torch reduce for 16 rows x 50k). Here it is two launches:

1. `_argmax_partials_kernel`, grid (B*N, SPLIT): the max and its lowest index over one chunk
   of one node's logits (one 4096-wide tile per program at a 50k vocabulary, so 16 nodes make
   ~200 programs that each issue all their loads at once), written to fp32/int32 scratch.
2. `_accept_kernel`, one program per batch row: finishes each needed argmax from the SPLIT
   partials, accepts, finds the survivors through the ancestor mask, picks the last node and
   writes path, path_len, the produced tokens and last.

Both launch with programmatic dependent launch on Hopper (ops/pdl.py): nothing is read or
written before `gdc_wait`. Logits must be NaN-free (a NaN never wins a comparison here, while
torch.argmax takes it as the maximum).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_common import gdc_launch_dependents, gdc_wait, pdl_args

_NO_INDEX = tl.constexpr(2**31 - 1)  # "no index yet": larger than every vocabulary index
BLOCK_V = 4096
"""Vocabulary tile of one argmax program (8 warps: 16 values per thread, loaded at once)."""
MAX_SPLIT = 64
"""Most vocabulary chunks per node; past MAX_SPLIT * BLOCK_V a program loops over several tiles."""


@triton.jit
def _argmax_partials_kernel(
    logits_ptr, pmax_ptr, pidx_ptr,
    N, V, CHUNK, SPLIT,
    slb, sln, slv,
    BLOCK_V: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    if USE_PDL:  # ops/pdl.py: the next kernel may launch now; wait for the previous before any access
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0)  # b * N + node
    part = tl.program_id(1)
    base = logits_ptr + (row // N).to(tl.int64) * slb + (row % N).to(tl.int64) * sln
    lo = part * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    arg = tl.full([BLOCK_V], _NO_INDEX, tl.int32)
    for start in range(lo, hi, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        live = offs < hi
        v = tl.load(base + offs * slv, mask=live, other=float("-inf")).to(tl.float32)
        # Per lane, strictly greater keeps the earlier index; a lane's first live value always
        # lands, so a chunk of -inf still names its lowest index (as torch.argmax does).
        take = live & ((v > best) | (arg == _NO_INDEX))
        best = tl.where(take, v, best)
        arg = tl.where(take, offs, arg)
    top = tl.max(best, axis=0)
    tl.store(pmax_ptr + row * SPLIT + part, top)
    tl.store(pidx_ptr + row * SPLIT + part, tl.min(tl.where(best == top, arg, _NO_INDEX), axis=0))


@triton.jit
def _argmax_of_rows(pmax_ptr, pidx_ptr, rows, live, SPLIT, BLOCK_S: tl.constexpr):
    """(R,) int32 argmax over the vocabulary of the (R,) logits rows `rows` (b * N + node), from
    their SPLIT partials: the largest partial max, the lowest index among equal ones."""
    offs_s = tl.arange(0, BLOCK_S)
    m = live[:, None] & (offs_s[None, :] < SPLIT)
    ptrs = rows[:, None] * SPLIT + offs_s[None, :]  # (R, BLOCK_S)
    pm = tl.load(pmax_ptr + ptrs, mask=m, other=float("-inf"))
    pi = tl.load(pidx_ptr + ptrs, mask=m, other=_NO_INDEX)
    top = tl.max(pm, axis=1)
    return tl.min(tl.where(pm == top[:, None], pi, _NO_INDEX), axis=1)


@triton.jit
def _accept_kernel(
    pmax_ptr, pidx_ptr, tok_ptr, par_ptr, depth_ptr, mask_ptr, paths_ptr,
    path_ptr, len_ptr, out_ptr, last_ptr,
    N, SPLIT, DP1,
    stb, stn, spar, sdep, smi, smj, spn, spd,
    BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    if USE_PDL:  # ops/pdl.py: the next kernel may launch now; wait for the previous before any access
        gdc_launch_dependents()
        gdc_wait()
    b = tl.program_id(0)
    tok_row = tok_ptr + b.to(tl.int64) * stb
    # score = depth * (N + 1) + (N - i) for survivors: unique, largest at the deepest survivor
    # and, at equal depth, at the lowest index. The root always survives, so top >= N.
    top = tl.full([], -1, tl.int32)
    for i0 in range(0, N, BLOCK_I):
        offs_i = i0 + tl.arange(0, BLOCK_I)
        live_i = offs_i < N
        hits = tl.zeros([BLOCK_I], tl.int32)  # rejected nodes on each i's path
        for j0 in range(0, N, BLOCK_J):
            offs_j = j0 + tl.arange(0, BLOCK_J)
            live_j = offs_j < N
            par = tl.maximum(tl.load(par_ptr + offs_j * spar, mask=live_j, other=0), 0)
            best = _argmax_of_rows(pmax_ptr, pidx_ptr, b * N + par, live_j, SPLIT, BLOCK_S)
            tok = tl.load(tok_row + offs_j * stn, mask=live_j, other=0)
            rejected = live_j & (offs_j > 0) & (tok != best.to(tok.dtype))
            anc = tl.load(mask_ptr + offs_i[:, None] * smi + offs_j[None, :] * smj,
                          mask=live_i[:, None] & live_j[None, :], other=0)
            hits += tl.sum(tl.where((anc != 0) & rejected[None, :], 1, 0), axis=1)
        d = tl.load(depth_ptr + offs_i * sdep, mask=live_i, other=0).to(tl.int32)
        score = tl.where(live_i & (hits == 0), d * (N + 1) + (N - offs_i), -1)
        top = tl.maximum(top, tl.max(score, axis=0))
    last = N - top % (N + 1)
    plen = tl.load(depth_ptr + last * sdep).to(tl.int32) + 1

    # The bonus: the target's argmax after `last`.
    offs_s = tl.arange(0, BLOCK_S)
    pm = tl.load(pmax_ptr + (b * N + last) * SPLIT + offs_s, mask=offs_s < SPLIT, other=float("-inf"))
    pi = tl.load(pidx_ptr + (b * N + last) * SPLIT + offs_s, mask=offs_s < SPLIT, other=_NO_INDEX)
    bonus = tl.min(tl.where(pm == tl.max(pm, axis=0), pi, _NO_INDEX), axis=0)

    offs_d = tl.arange(0, BLOCK_D)
    live_d = offs_d < DP1
    path_row = paths_ptr + last * spn
    path = tl.load(path_row + offs_d * spd, mask=live_d, other=0)
    # out[k] = tokens[path[k + 1]] for k < plen - 1, then the bonus, then 0s
    drafted = offs_d + 1 < plen
    nxt = tl.load(path_row + (offs_d + 1) * spd, mask=drafted, other=0)
    tok = tl.load(tok_row + nxt * stn, mask=drafted, other=0)
    out = tl.where(drafted, tok, tl.where(offs_d + 1 == plen, bonus, 0))
    tl.store(path_ptr + b * DP1 + offs_d, path.to(tl.int64), mask=live_d)
    tl.store(out_ptr + b * DP1 + offs_d, out.to(tl.int64), mask=live_d)
    tl.store(len_ptr + b, plen.to(tl.int64))
    tl.store(last_ptr + b, last.to(tl.int64))


def _check(logits, tokens, parents, depth, mask, paths):
    if logits.dim() != 3 or logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"greedy_accept: logits must be (B, N, V) fp32/bf16/fp16, got {tuple(logits.shape)} {logits.dtype}")
    batch, n, vocab = logits.shape
    if vocab == 0 or n == 0:
        raise ValueError(f"greedy_accept: logits {tuple(logits.shape)} need at least one node and one vocabulary entry")
    if tuple(tokens.shape) != (batch, n) or tuple(parents.shape) != (n,) or tuple(depth.shape) != (n,):
        raise ValueError(f"greedy_accept: tokens {tuple(tokens.shape)}, parents {tuple(parents.shape)} and depth "
                         f"{tuple(depth.shape)} must be ({batch}, {n}), ({n},), ({n},) for logits {tuple(logits.shape)}")
    if tuple(mask.shape) != (n, n) or paths.dim() != 2 or paths.shape[0] != n or paths.shape[1] == 0:
        raise ValueError(f"greedy_accept: mask {tuple(mask.shape)} and paths {tuple(paths.shape)} must be ({n}, {n}) "
                         f"and ({n}, D+1)")


def greedy_accept(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    depth: torch.Tensor,
    mask: torch.Tensor,
    paths: torch.Tensor,
    *,
    block_v: int | None = None,
    max_split: int = MAX_SPLIT,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy acceptance of one verified tree per batch row in two launches.

    Same contract as `naive_greedy_accept` (NaN-free logits).

    Args:
        logits: (B, N, V) fp32, bf16 or fp16 target logits after each node.
        tokens: (B, N) int64 tree tokens, node 0 the root.
        parents: (N,) int64, -1 at the root, parents[i] < i.
        depth: (N,) int64 node depths, 0 at the root.
        mask: (N, N) bool, mask[i, j] when j is on the root-to-i path (i included).
        paths: (N, D+1) int64, paths[i] = the root-to-i node list padded with 0.
        block_v, max_split: the vocabulary tile and the most chunks per node (tests use small
            ones to reach the multi-chunk and multi-tile code on small vocabularies).

    Returns:
        path (B, D+1), path_len (B,), out (B, D+1), last (B,), all int64: see `naive_greedy_accept`.
    """
    _check(logits, tokens, parents, depth, mask, paths)
    batch, n, vocab = logits.shape
    dp1 = paths.shape[1]
    device = logits.device
    block_v = block_v or min(BLOCK_V, max(16, triton.next_power_of_2(vocab)))
    chunk = block_v * triton.cdiv(triton.cdiv(vocab, block_v), max_split)  # whole tiles per program
    split = triton.cdiv(vocab, chunk)
    pmax = torch.empty(batch * n, split, dtype=torch.float32, device=device)
    pidx = torch.empty(batch * n, split, dtype=torch.int32, device=device)
    pdl = pdl_args(device)
    _argmax_partials_kernel[(batch * n, split)](
        logits, pmax, pidx,
        n, vocab, chunk, split,
        *logits.stride(),
        BLOCK_V=block_v, num_warps=8 if block_v >= 4096 else 4, **pdl,
    )
    path = torch.empty(batch, dp1, dtype=torch.long, device=device)
    path_len = torch.empty(batch, dtype=torch.long, device=device)
    out = torch.empty(batch, dp1, dtype=torch.long, device=device)
    last = torch.empty(batch, dtype=torch.long, device=device)
    mask_u8 = mask.view(torch.uint8) if mask.dtype == torch.bool else mask  # a byte per entry, read as 0 / 1
    block_n = min(64, max(2, triton.next_power_of_2(n)))
    _accept_kernel[(batch,)](
        pmax, pidx, tokens, parents, depth, mask_u8, paths,
        path, path_len, out, last,
        n, split, dp1,
        *tokens.stride(), parents.stride(0), depth.stride(0), *mask_u8.stride(), *paths.stride(),
        BLOCK_I=block_n, BLOCK_J=block_n, BLOCK_S=max(2, triton.next_power_of_2(split)),
        BLOCK_D=max(2, triton.next_power_of_2(dp1)), num_warps=4, **pdl,
    )
    return path, path_len, out, last

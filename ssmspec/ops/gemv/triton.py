"""Triton GEMV and skinny GEMM for decode and tree verification; `naive.py` (F.linear) is the spec.

At one row a linear layer is a pure weight stream: the time is N*K*2 bytes over bandwidth. The
GEMV gives each program a few output rows and streams their K in wide, coalesced chunks, with
enough programs (several per SM) to keep many loads in flight. Knobs (swept on the device by
`bench/bench_kernels.py --gemv-sweep`): rows per program, columns per load, warps, a fully
unrolled K loop (all of a program's loads issued before the first add), a persistent grid
(programs loop over row tiles), and split-K (partial sums over column ranges, fp32).

Inputs of 2..SKINNY_MAX_ROWS rows (the nodes of a verified tree) go to a skinny GEMM: each
program owns BLOCK_N output columns and streams their weight tile once for all rows, with the
rows padded to a tensor-core tile, by pointer loads or through a TMA descriptor (per-shape
configs). Up to SKINNY_WIDE_MAX_ROWS rows the shapes listed in SKINNY_WIDE take it too; other
inputs go to F.linear (cuBLAS).
"""
from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import pdl
from ..settings import interpreting
from ..triton_common import gdc_launch_dependents, gdc_wait, rms_norm

SKINNY_MAX_ROWS = 16
"""Row counts 2..SKINNY_MAX_ROWS run the skinny GEMM; above it cuBLAS, which the sweep on the
H100 found equal or faster from 32 rows on (out_proj at 64 rows: 12.9 us against 15.7)."""


@triton.jit
def _add_pairs(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _norm_scale(xf, offs_k, group_size, eps, NORM_GROUPS: tl.constexpr):
    """Per-element 1/rms of the element's group, for an fp32 K-vector held whole in xf (masked
    lanes 0): the RMSNorm folded into a projection (see `norm_linear`)."""
    kg = offs_k // group_size
    r = tl.zeros_like(xf)
    for gi in tl.static_range(NORM_GROUPS):
        ss = tl.sum(tl.where(kg == gi, xf * xf, 0.0), axis=0)
        r = tl.where(kg == gi, tl.rsqrt(ss / group_size + eps), r)
    return r


@triton.jit
def _group_rstd(x_ptr, K, group_size, eps, NORM_GROUPS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr):
    """1/rms of each of the NORM_GROUPS contiguous groups of the K-vector at x_ptr, as a
    (BLOCK_G,) vector: a first pass over x for the tiles that do not hold all of K at once."""
    offs_g = tl.arange(0, BLOCK_G)
    ss = tl.zeros([BLOCK_G], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        kg = offs_k // group_size
        for gi in tl.static_range(NORM_GROUPS):
            ss += tl.where(offs_g == gi, tl.sum(tl.where(kg == gi, v * v, 0.0), axis=0), 0.0)
    return tl.rsqrt(ss / group_size + eps)


@triton.jit
def _scale_from_groups(rvec, offs_k, group_size, NORM_GROUPS: tl.constexpr, BLOCK_G: tl.constexpr):
    """Per-element 1/rms for the columns offs_k, from `_group_rstd`'s per-group vector."""
    offs_g = tl.arange(0, BLOCK_G)
    kg = offs_k // group_size
    r = tl.zeros([offs_k.shape[0]], dtype=tl.float32)
    for gi in tl.static_range(NORM_GROUPS):
        r = tl.where(kg == gi, tl.sum(tl.where(offs_g == gi, rvec, 0.0), axis=0), r)
    return r


@triton.jit
def gemv_tile(x_ptr, w_ptr, b_ptr, y_ptr, tile, split, N, K, swn, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_SPLIT: tl.constexpr, UNROLL: tl.constexpr,
               PRELOAD: tl.constexpr, USE_PDL: tl.constexpr,
               res_ptr=None, group_size=1, eps=0.0, NORM_GROUPS: tl.constexpr = 0, HAS_RES: tl.constexpr = False,
               BLOCK_G: tl.constexpr = 1, GROUPED: tl.constexpr = False, BLOCK_K2: tl.constexpr = 0):
    """One tile of BLOCK_N output rows. NORM_GROUPS > 0: the input is RMS-normalised over that
    many groups (no norm weight: it is folded into w). A preloaded row with one group, or with
    power-of-two groups over a power-of-two K (GROUPED), scales its dot products by 1/rms at the
    end; otherwise x is normalised first and rounded to its dtype, as RMSNorm's output is.
    HAS_RES: the output, rounded to y's dtype, is added to the residual at res_ptr. BLOCK_K2:
    a second preloaded piece of K (see `preload_blocks`)."""
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    k_lo = split * K_SPLIT
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if PRELOAD:
        # the tile's whole K range in one load (K_SPLIT == BLOCK_K), issued before waiting on the
        # previous kernel: the weights are never written, so their stream overlaps its tail
        offs_k = k_lo + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        w = tl.load(w_ptr + offs_n[:, None] * swn + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :],
                    other=0.0, eviction_policy="evict_first")
        if BLOCK_K2 > 0:
            # K not a power of two: a second, smaller piece (5120 = 4096 + 1024) instead of one
            # padded block (8192), so the preloaded tile wastes no registers and more programs
            # fit on an SM while the kernel before runs
            offs_k2 = k_lo + BLOCK_K + tl.arange(0, BLOCK_K2)
            mask_k2 = offs_k2 < K
            w2 = tl.load(w_ptr + offs_n[:, None] * swn + offs_k2[None, :], mask=mask_n[:, None] & mask_k2[None, :],
                         other=0.0, eviction_policy="evict_first")
        if USE_PDL:
            gdc_wait()
        xv = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0)
        xf = xv.to(tl.float32)
        if BLOCK_K2 > 0:
            xf2 = tl.load(x_ptr + offs_k2, mask=mask_k2, other=0.0).to(tl.float32)
            tail = tl.sum(w2.to(tl.float32) * xf2[None, :], axis=1)
        if NORM_GROUPS == 1:
            # The row's 1/rms scales the dot product at the end, and its sum of squares rides in
            # the dot's own reduction: normalising x first put two reductions and three K-wide
            # passes before the dot, on every program's critical path (measured: +4 us per layer).
            prod = w.to(tl.float32) * xf[None, :]
            dot, ss = tl.reduce((prod, tl.broadcast_to((xf * xf)[None, :], [BLOCK_N, BLOCK_K])), 1, _add_pairs)
            if BLOCK_K2 > 0:
                dot += tail
                ss += tl.sum(xf2 * xf2, axis=0)
            scaled = dot * tl.rsqrt(ss / K + eps)
        elif GROUPED:  # K = BLOCK_K in NORM_GROUPS power-of-two groups: per-group dots, scaled at the end
            gs: tl.constexpr = BLOCK_K // NORM_GROUPS
            part = tl.sum(tl.reshape(w.to(tl.float32) * xf[None, :], [BLOCK_N, NORM_GROUPS, gs]), axis=2)
            ssg = tl.sum(tl.reshape(xf * xf, [NORM_GROUPS, gs]), axis=1)
            scaled = tl.sum(part * tl.rsqrt(ssg / gs + eps)[None, :], axis=1)
        else:
            if NORM_GROUPS > 0:  # the whole row is here: normalise it in registers
                xf = (xf * _norm_scale(xf, offs_k, group_size, eps, NORM_GROUPS)).to(xv.dtype).to(tl.float32)
            acc += w.to(tl.float32) * xf[None, :]
    else:
        if USE_PDL:
            gdc_wait()
        rvec = tl.zeros([BLOCK_G], dtype=tl.float32)
        if NORM_GROUPS > 0:
            rvec = _group_rstd(x_ptr, K, group_size, eps, NORM_GROUPS, BLOCK_K, BLOCK_G)
        if UNROLL:
            # static loop: the compiler can issue every chunk's load before the first multiply-add
            for k0 in tl.static_range(0, K_SPLIT, BLOCK_K):
                offs_k = k_lo + k0 + tl.arange(0, BLOCK_K)
                mask_k = offs_k < K
                w = tl.load(w_ptr + offs_n[:, None] * swn + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :],
                            other=0.0, eviction_policy="evict_first")  # read once per step: keep L2 for activations
                xv = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0)
                xf = xv.to(tl.float32)
                if NORM_GROUPS > 0:
                    xf = (xf * _scale_from_groups(rvec, offs_k, group_size, NORM_GROUPS, BLOCK_G)).to(xv.dtype).to(tl.float32)
                acc += w.to(tl.float32) * xf[None, :]
        else:
            for k0 in range(0, K_SPLIT, BLOCK_K):
                offs_k = k_lo + k0 + tl.arange(0, BLOCK_K)
                mask_k = offs_k < K
                w = tl.load(w_ptr + offs_n[:, None] * swn + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :],
                            other=0.0, eviction_policy="evict_first")
                xv = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0)
                xf = xv.to(tl.float32)
                if NORM_GROUPS > 0:
                    xf = (xf * _scale_from_groups(rvec, offs_k, group_size, NORM_GROUPS, BLOCK_G)).to(xv.dtype).to(tl.float32)
                acc += w.to(tl.float32) * xf[None, :]
    if PRELOAD and (NORM_GROUPS == 1 or GROUPED):
        y = scaled
    else:
        y = tl.sum(acc, axis=1)
        if PRELOAD and BLOCK_K2 > 0:
            y += tail
    if HAS_BIAS:
        # the bias goes into partial 0 only
        y += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32) * tl.where(split == 0, 1.0, 0.0)
    if PARTIAL:
        tl.store(y_ptr + split * N + offs_n, y, mask=mask_n)  # fp32 partial sums, reduced by the consumer
    else:
        if HAS_RES:  # h + out in h's dtype, as torch adds the rounded output to the residual
            out_dtype = y_ptr.dtype.element_ty
            y = tl.load(res_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32) + y.to(out_dtype).to(tl.float32)
        tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, swn, tiles, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_SPLIT: tl.constexpr, UNROLL: tl.constexpr,
                 PERSISTENT: tl.constexpr, PRELOAD: tl.constexpr, USE_PDL: tl.constexpr,
                 res_ptr=None, group_size=1, eps=0.0, NORM_GROUPS: tl.constexpr = 0, HAS_RES: tl.constexpr = False,
                 BLOCK_G: tl.constexpr = 1, GROUPED: tl.constexpr = False, BLOCK_K2: tl.constexpr = 0):
    if USE_PDL:
        gdc_launch_dependents()  # see ops/pdl.py: nothing is written before gdc_wait
    split = tl.program_id(1)
    if PERSISTENT:
        for tile in range(tl.program_id(0), tiles, tl.num_programs(0)):
            gemv_tile(x_ptr, w_ptr, b_ptr, y_ptr, tile, split, N, K, swn, HAS_BIAS, PARTIAL, BLOCK_N, BLOCK_K,
                       K_SPLIT, UNROLL, PRELOAD, USE_PDL, res_ptr, group_size, eps, NORM_GROUPS, HAS_RES, BLOCK_G,
                       GROUPED, BLOCK_K2)
    else:
        gemv_tile(x_ptr, w_ptr, b_ptr, y_ptr, tl.program_id(0), split, N, K, swn, HAS_BIAS, PARTIAL, BLOCK_N,
                   BLOCK_K, K_SPLIT, UNROLL, PRELOAD, USE_PDL, res_ptr, group_size, eps, NORM_GROUPS, HAS_RES, BLOCK_G,
                   GROUPED, BLOCK_K2)


def grouped_epilogue(k: int, block_k: int, norm_groups: int) -> bool:
    """Whether a preloaded GEMV row (BLOCK_K = block_k) can apply a norm of several groups as
    per-group dots scaled at the end: all of K in the block, in power-of-two groups."""
    return norm_groups > 1 and k == block_k and norm_groups & (norm_groups - 1) == 0


class GemvConfig(tuple):
    """(block_n, block_k, num_warps, split, persistent, unroll, preload); see the module
    docstring. preload: one load of the tile's whole K range (block_k is raised to it), issued
    before the PDL wait (ops/pdl.py)."""

    def __new__(cls, block_n=2, block_k=1024, num_warps=4, split=1, persistent=0, unroll=False, preload=False):
        return super().__new__(cls, (block_n, block_k, num_warps, split, persistent, unroll, preload))


# (N, K) -> config. In the H100 sweeps (`bench/bench_kernels.py --gemv-sweep`) no per-shape tile
# beat the defaults by more than ~3%: under PDL one row per program with its whole K range
# preloaded (when next_pow2(K) <= PRELOAD_MAX_K), else DEFAULT (2 rows x 1024). Inside the AR step
# graph the 2.7b out_proj was 1.2-1.5% faster on 4 warps than on the default 8.
TUNED = types.MappingProxyType({(2560, 5120): GemvConfig(2, 0, 4, preload=True)})
"""Read-only: a benchmark times other configs through `linear(..., config=)`."""
DEFAULT = GemvConfig()
PRELOAD_MAX_K = 8192


def gemv_config(n: int, k: int, device: torch.device) -> GemvConfig:
    """The GEMV's config for an (N, K) weight on `device`: TUNED's, else the default."""
    if (n, k) in TUNED:
        return GemvConfig(*TUNED[(n, k)])
    if pdl.enabled(device) and triton.next_power_of_2(k) <= PRELOAD_MAX_K:
        return GemvConfig(1, triton.next_power_of_2(k), 4 if k <= 4096 else 8, preload=True)
    return DEFAULT


def _launch_gemv(xv, weight, bias, y, cfg: GemvConfig, partial: bool, residual=None, norm_groups: int = 0,
                 eps: float = 0.0):
    n, k = weight.shape
    block_n, block_k, warps, split, persistent, unroll, preload = cfg
    block_k2 = 0
    if preload:
        block_k, block_k2 = preload_blocks(k, split, norm_groups)
        k_split = block_k + block_k2
    else:
        block_k = min(block_k, triton.next_power_of_2(k))
        k_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    tiles = triton.cdiv(n, block_n)
    grid0 = min(tiles, persistent) if persistent else tiles
    use_pdl = pdl.enabled(xv.device)
    _gemv_kernel[(grid0, split)](
        xv, weight, bias if bias is not None else weight, y, n, k, weight.stride(0), tiles,
        HAS_BIAS=bias is not None, PARTIAL=partial, BLOCK_N=block_n, BLOCK_K=block_k, K_SPLIT=k_split,
        UNROLL=bool(unroll), PERSISTENT=bool(persistent), PRELOAD=bool(preload), USE_PDL=use_pdl, num_warps=warps,
        res_ptr=residual, group_size=k // max(norm_groups, 1), eps=float(eps), NORM_GROUPS=norm_groups,
        HAS_RES=residual is not None, BLOCK_G=triton.next_power_of_2(max(norm_groups, 1)),
        GROUPED=bool(preload) and grouped_epilogue(k, block_k, norm_groups), BLOCK_K2=block_k2,
        **({"launch_pdl": True} if use_pdl else {}),
    )


def preload_blocks(k: int, split: int = 1, norm_groups: int = 0) -> tuple[int, int]:
    """(BLOCK_K, BLOCK_K2) of a preloaded GEMV tile covering k / split columns: one padded
    power-of-two block, or the largest power of two below and a second piece for the rest
    (norms of several groups need the one block)."""
    span = triton.cdiv(k, split)
    whole = triton.next_power_of_2(span)
    if whole == span or split > 1 or norm_groups > 1:
        return whole, 0
    first = whole // 2
    return first, triton.next_power_of_2(span - first)


def _as_vector(x: torch.Tensor, k: int) -> torch.Tensor:
    xv = x.reshape(k)
    return xv if xv.stride(0) == 1 else xv.contiguous()


def gemv_partials(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, split: int,
                  config: GemvConfig | None = None) -> torch.Tensor:
    """Split-K GEMV of one row: x (..., K) with one row, weight (N, K) -> (split, ..., N) fp32
    partial sums over `split` column ranges (the bias in partial 0); their sum is x W^T + b. For a
    consumer that reduces them anyway (ops.step_update.add_rms_norm)."""
    n, k = weight.shape
    cfg = list(GemvConfig(*(config or gemv_config(n, k, x.device))))
    cfg[3] = split
    cfg = GemvConfig(*cfg)
    y = torch.empty((split,) + tuple(x.shape[:-1]) + (n,), device=x.device, dtype=torch.float32)
    _launch_gemv(_as_vector(x, k), weight, bias, y, cfg, partial=True)
    return y


@triton.jit
def _skinny_dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:  # fp32 weights: full fp32 products, as cuBLAS (no TF32) computes them
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _skinny_k_loop(x_ptr, w_ptr, acc, offs_m, offs_n, mask_m, mask_n, k_lo, k_hi, sxm, swn, IEEE: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_hi
        xt = tl.load(x_ptr + offs_m[:, None] * sxm + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        wt = tl.load(w_ptr + offs_n[:, None] * swn + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0,
                     eviction_policy="evict_first")
        acc = _skinny_dot(xt, tl.trans(wt), acc, IEEE)
    return acc


@triton.jit
def _skinny_span(x_ptr, w_ptr, w_desc, offs_m, offs_n, mask_m, mask_n, n0, k_lo, k_hi, sxm, swn, IEEE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr):
    """x[:, k_lo:k_hi] @ w[offs_n, k_lo:k_hi]^T as a (BLOCK_M, BLOCK_N) fp32 tile. TMA 0: weight
    tiles by pointer loads; 1: through the tensor descriptor w_desc (the copy engine); 2: the same,
    with the weight tile as the tensor cores' A operand (W x^T, transposed at the end), which
    Hopper's warpgroup MMA takes in 64-row tiles while x's few rows are its N."""
    if TMA == 0:
        acc = _skinny_k_loop(x_ptr, w_ptr, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), offs_m, offs_n, mask_m,
                             mask_n, k_lo, k_hi, sxm, swn, IEEE, BLOCK_K)
    elif TMA == 1:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            acc = _skinny_dot(_skinny_x_tile(x_ptr, offs_m, mask_m, k0, k_hi, sxm, BLOCK_K),
                              tl.trans(w_desc.load([n0, k0])), acc, IEEE)
    else:
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            acc_t = _skinny_dot(w_desc.load([n0, k0]),
                                tl.trans(_skinny_x_tile(x_ptr, offs_m, mask_m, k0, k_hi, sxm, BLOCK_K)), acc_t, IEEE)
        acc = tl.trans(acc_t)
    return acc


@triton.jit
def _skinny_x_tile(x_ptr, offs_m, mask_m, k0, k_hi, sxm, BLOCK_K: tl.constexpr):
    # x's columns past k_hi (the next norm group) load as 0, so a weight box may overhang k_hi
    offs_k = k0 + tl.arange(0, BLOCK_K)
    return tl.load(x_ptr + offs_m[:, None] * sxm + offs_k[None, :], mask=mask_m[:, None] & (offs_k < k_hi)[None, :],
                   other=0.0)


@triton.jit
def _rstd_from_parts(sq_ptr, offs_m, mask_m, group, n_parts, group_size, eps, NORM_GROUPS: tl.constexpr,
                     BLOCK_Q: tl.constexpr):
    """1 / rms of norm group `group` of every row, from the (rows, NORM_GROUPS, n_parts) partial
    sums of squares its producer wrote."""
    offs_q = tl.arange(0, BLOCK_Q)
    parts = tl.load(sq_ptr + (offs_m[:, None] * NORM_GROUPS + group) * n_parts + offs_q[None, :],
                    mask=mask_m[:, None] & (offs_q < n_parts)[None, :], other=0.0)
    return tl.rsqrt(tl.sum(parts, axis=1) / group_size + eps)


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, sxm, swn, sym, HAS_BIAS: tl.constexpr,
                   IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   USE_PDL: tl.constexpr, res_ptr=None, srm=0, HAS_RES: tl.constexpr = False,
                   xsq_ptr=None, n_xparts=1, group_size=1, eps=0.0, NORM_GROUPS: tl.constexpr = 0,
                   BLOCK_Q: tl.constexpr = 16, ysq_ptr=None, WRITE_SQ: tl.constexpr = False,
                   BALANCED: tl.constexpr = False, ACT: tl.constexpr = 0, w_desc=None, TMA: tl.constexpr = 0,
                   PRE: tl.constexpr = 0, flag_ptr=None, flag_unit=1, flag_count=1, FLAGS: tl.constexpr = 0):
    # USE_PDL (a config's seventh entry): launched early, waiting at the start. Timed back to back,
    # early-launched pointer-load instances ran 1.4x slower (13.7 -> 20.5 us at 8 rows: they held
    # their pipelines' shared memory while waiting); inside the tree iteration the 2.7b in_proj
    # with TMA loads gains from it (SKINNY_TUNED).
    # HAS_RES: the output, rounded to y's dtype, is added to the residual (as in gemv_tile).
    # NORM_GROUPS > 0: x is normalised over that many groups of K (no weight: folded into w) from
    # the partial sums of squares at xsq_ptr, which x's producer wrote (no norm launch, no second
    # pass over x): each group's dot products are scaled by its 1/rms.
    # WRITE_SQ: this program's share of the output rows' sums of squares, for the next norm.
    # BALANCED: the grid is a multiple of the SM count and program p owns output columns
    # [p N / P, (p + 1) N / P) (at most BLOCK_N of them), so every SM streams the same number of
    # weight rows; with fixed BLOCK_N-wide tiles, 160 tiles on 132 SMs leave 28 SMs twice the work.
    # PRE (TMA 1 or 2, one norm group at most): the first PRE weight boxes are loaded before the
    # PDL wait, while the kernel before still runs (weights are never written).
    # FLAGS > 0 (tiled grid): once this program's output tile is stored, it adds flag_count to
    # the FLAGS ready counters of the flag_unit-wide column blocks the tile covers (ops/overlap.py:
    # a kernel on another stream waits for them instead of for this whole launch).
    if USE_PDL:
        gdc_launch_dependents()
        if PRE == 0:
            gdc_wait()
    if BALANCED:
        pid = tl.program_id(0)
        n_hi = ((pid + 1) * N) // tl.num_programs(0)
        offs_n = (pid * N) // tl.num_programs(0) + tl.arange(0, BLOCK_N)
        mask_n = offs_n < n_hi
    else:
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    n0 = tl.program_id(0) * BLOCK_N  # the weight box's first row (TMA: tiled grids only)
    if PRE > 0:
        w_first = w_desc.load([n0, 0])
        if PRE > 1:
            w_second = w_desc.load([n0, BLOCK_K])
        if USE_PDL:
            gdc_wait()
        if TMA == 2:  # the weight boxes as the tensor cores' A operand, as in _skinny_span
            acc_t = _skinny_dot(w_first, tl.trans(_skinny_x_tile(x_ptr, offs_m, mask_m, 0, K, sxm, BLOCK_K)),
                                tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), IEEE)
            if PRE > 1:
                acc_t = _skinny_dot(w_second, tl.trans(_skinny_x_tile(x_ptr, offs_m, mask_m, BLOCK_K, K, sxm, BLOCK_K)),
                                    acc_t, IEEE)
            acc = tl.trans(acc_t)
        else:
            acc = _skinny_dot(_skinny_x_tile(x_ptr, offs_m, mask_m, 0, K, sxm, BLOCK_K), tl.trans(w_first),
                              tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), IEEE)
            if PRE > 1:
                acc = _skinny_dot(_skinny_x_tile(x_ptr, offs_m, mask_m, BLOCK_K, K, sxm, BLOCK_K), tl.trans(w_second),
                                  acc, IEEE)
        acc += _skinny_span(x_ptr, w_ptr, w_desc, offs_m, offs_n, mask_m, mask_n, n0, PRE * BLOCK_K, K, sxm, swn,
                            IEEE, BLOCK_M, BLOCK_N, BLOCK_K, TMA)
        if NORM_GROUPS == 1:
            acc *= _rstd_from_parts(xsq_ptr, offs_m, mask_m, 0, n_xparts, group_size, eps, 1, BLOCK_Q)[:, None]
    elif NORM_GROUPS <= 1:
        acc = _skinny_span(x_ptr, w_ptr, w_desc, offs_m, offs_n, mask_m, mask_n, n0, 0, K, sxm, swn, IEEE,
                           BLOCK_M, BLOCK_N, BLOCK_K, TMA)
        if NORM_GROUPS == 1:
            acc *= _rstd_from_parts(xsq_ptr, offs_m, mask_m, 0, n_xparts, group_size, eps, 1, BLOCK_Q)[:, None]
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for grp in range(NORM_GROUPS):
            part = _skinny_span(x_ptr, w_ptr, w_desc, offs_m, offs_n, mask_m, mask_n, n0, grp * group_size,
                                (grp + 1) * group_size, sxm, swn, IEEE, BLOCK_M, BLOCK_N, BLOCK_K, TMA)
            r = _rstd_from_parts(xsq_ptr, offs_m, mask_m, grp, n_xparts, group_size, eps, NORM_GROUPS, BLOCK_Q)
            acc += part * r[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if HAS_RES:  # h + out in h's dtype, as torch adds the rounded output to the residual
        acc = (tl.load(res_ptr + offs_m[:, None] * srm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
               + acc.to(y_ptr.dtype.element_ty).to(tl.float32))
    out = acc.to(y_ptr.dtype.element_ty)
    if ACT != 0:  # on the rounded output, as torch applies it to the projection's result
        of = out.to(tl.float32)
        if ACT == 1:  # relu
            of = tl.maximum(of, 0.0)
        elif ACT == 2:  # relu2
            of = tl.maximum(of, 0.0)
            of = of * of
        else:  # silu
            of = of * tl.sigmoid(of)
        out = of.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs_m[:, None] * sym + offs_n[None, :], out, mask=mask)
    if WRITE_SQ:  # of the stored (rounded) values, as the next norm reads them
        of = tl.where(mask, out.to(tl.float32), 0.0)
        tl.store(ysq_ptr + offs_m * tl.num_programs(0) + tl.program_id(0), tl.sum(of * of, axis=1), mask=mask_m)
    if FLAGS > 0:
        # Every thread's stores before one release per counter (the pattern of a cooperative
        # grid sync: a CTA barrier, then a release at GPU scope).
        tl.debug_barrier()
        offs_f = n0 // flag_unit + tl.arange(0, FLAGS)
        tl.atomic_add(flag_ptr + offs_f, flag_count, mask=offs_f < N // flag_unit, sem="release")


SKINNY_DEFAULT = (32, 128, 4, 4)
"""(BLOCK_N, BLOCK_K, num_warps, num_stages) of the skinny GEMM; a fifth entry k > 0 makes the
grid balanced (k programs per SM, each owning N / (k * SMs) columns; BLOCK_N is then derived);
a sixth entry 1 or 2 reads the weight through a TMA descriptor (see `_skinny_span`); a seventh
entry 1 launches it with PDL: its programs start while the kernel before ends and wait at their
start, before any load (they hold their shared memory meanwhile); 2 or 3 also load their first
1 or 2 weight boxes before waiting (TMA 1 or 2, one norm group at most)."""
# (N, K) -> config: the best at 16 rows of the H100 sweeps (`bench/bench_kernels.py
# --skinny-sweep`): mamba2-2.7b out_proj, hybrid-8b Mamba in/out_proj, MLP up/down, attention q/o
# and k/v, LM head. Unlisted shapes use SKINNY_DEFAULT (the best pointer-load tile at the 2.7b
# in_proj). The mamba2-2.7b in_proj and out_proj read their weights by TMA, ranked by the whole
# 16-node tree iteration rather than per kernel (3.02-3.05 ms against 3.155 with pointer-load
# tiles); the in_proj is launched with PDL (2.888 against 3.036 ms), the out_proj too with its
# first weight box loaded before the wait (2.833 against 2.893 ms); then the in_proj with its
# first two boxes loaded before the wait (TMA 2 preloads) 2.701 against 2.740 ms, and the LM head
# launched with PDL and one box preloaded 2.689 ms (its variants, with or without PDL, all within
# 2.687-2.691 ms). Each pair was measured when that change was made.
SKINNY_TUNED = types.MappingProxyType({
    (10576, 2560): (64, 128, 4, 4, 0, 2, 3),
    (2560, 5120): (32, 256, 2, 4, 0, 1, 2),  # pointer loads: (0, 128, 2, 5, 2) 13.12 us vs 13.90 tiled
    (50288, 2560): (64, 128, 4, 4, 0, 2, 2),  # 2.7b LM head: 87.7 us vs 90.2 default
    (18560, 4096): (0, 128, 4, 4, 3, 0, 1),  # 53.77 vs 55.20 default; PDL: 16-node 6.430 vs 6.509 ms
    (4096, 8192): (0, 128, 2, 5, 2),  # 26.53 vs 28.21
    (21504, 4096): (0, 128, 4, 4, 3),  # 61.96 vs 65.50
    (4096, 21504): (0, 128, 2, 5, 2),  # 63.75 vs 69.56
    (4096, 4096): (0, 128, 2, 5, 2),  # 14.38 vs 15.24
    (1024, 4096): (0, 128, 2, 5, 1),  # 8.67 vs 10.78
    (131072, 4096): (16, 128, 2, 5),  # 359.2 vs 360.8
})


SKINNY_WIDE_MAX_ROWS = 64
"""Row counts SKINNY_MAX_ROWS+1..SKINNY_WIDE_MAX_ROWS (64-node trees) run the skinny GEMM only
for the shapes of SKINNY_WIDE, where it matched cuBLAS; there it also takes its norm from the
producer's partial sums and adds the residual in its epilogue, which the cuBLAS route pays for
with a norm launch and an addmm copy."""
# (N, K) -> config at 17..64 rows (entries as in SKINNY_DEFAULT's docstring): the best of an H100
# sweep at 64 rows, the in_proj launched with PDL (64-node iteration 3.559 against 3.669 ms), the
# out_proj too (0.1-0.5% faster in each of three measurements):
SKINNY_WIDE = types.MappingProxyType({
    (10576, 2560): (128, 128, 4, 4, 0, 2, 1),  # mamba2-2.7b in_proj: 22.05 us vs cuBLAS 22.19
    (2560, 5120): (32, 256, 4, 4, 0, 1, 1),  # mamba2-2.7b out_proj: 12.57 us vs cuBLAS 12.97
    (50288, 2560): (64, 128, 4, 6, 0, 2),  # mamba2-2.7b LM head: 92.5 us vs cuBLAS 97.8
    # mamba2-2.7b in_proj split in two (ops/overlap.py): [x B C dt], then z (tiles of two whole
    # heads, 40 programs beside the scan's 80). The 64-node iteration took 3.357 ms with these
    # against 3.439 with in_proj's 128-wide tiles for both halves and 3.72-3.76 with 64-wide ones for z.
    (5456, 2560): (64, 128, 4, 4, 0, 2, 1),
    (5120, 2560): (128, 128, 4, 4, 0, 2, 1),
})


def skinny_rows(rows: int, n: int, k: int, element_size: int = 2) -> bool:
    """Whether `rows` rows of an (N, K) projection run the skinny GEMM (else the GEMV or cuBLAS).
    SKINNY_WIDE's tiles are sized for 2-byte weights (fp32 boxes would not fit in shared memory);
    the CPU interpreter, which has no such limit, takes them at any width for the tests."""
    if 1 < rows <= SKINNY_MAX_ROWS:
        return True
    return (SKINNY_MAX_ROWS < rows <= SKINNY_WIDE_MAX_ROWS and (n, k) in SKINNY_WIDE
            and (element_size == 2 or interpreting()))


def _skinny_config(n: int, k: int, rows: int) -> tuple[int, ...]:
    if rows > SKINNY_MAX_ROWS and (n, k) in SKINNY_WIDE:
        return SKINNY_WIDE[(n, k)]
    return SKINNY_TUNED.get((n, k), SKINNY_DEFAULT)


def skinny_tile_width(n: int, k: int, rows: int) -> int:
    """Output columns per program of the skinny GEMM for `rows` rows of an (N, K) weight; 0 for
    a balanced grid, whose tiles have no fixed width."""
    block_n, _, _, _, *extra = _skinny_config(n, k, rows)
    return 0 if (list(extra) + [0])[0] else block_n


def _weight_descriptor(weight: torch.Tensor, block_n: int, block_k: int):
    """A TMA descriptor of weight's (block_n, block_k) tiles, or None where TMA cannot read it
    (alignment, box size, no descriptor support in this Triton)."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    esize = weight.element_size()
    if (weight.stride(1) != 1 or (weight.stride(0) * esize) % 16 or weight.data_ptr() % 16
            or max(block_n, block_k) > 256 or block_k * esize < 16):
        return None
    return TensorDescriptor(weight, list(weight.shape), [weight.stride(0), 1], [block_n, block_k])


SKINNY_ACTIVATIONS = {"relu": 1, "relu2": 2, "silu": 3}
"""Activations the skinny GEMM applies in its epilogue (ops/gemv/naive ACTIVATIONS' formulas)."""


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config=None,
                  residual: torch.Tensor | None = None, norm_groups: int = 0, eps: float = 0.0,
                  x_sq: torch.Tensor | None = None, return_sq: bool = False, activation: str | None = None,
                  ready_flags=None):
    """x (..., K) with M rows in all, weight (N, K) -> (..., N) for small M (any M works; the
    tile pads M up to a power of two >= 16, so it pays only for few rows). norm_groups, residual,
    x_sq, return_sq and activation (one of SKINNY_ACTIVATIONS, in the epilogue) as in
    `norm_linear`: with x_sq the norm scales each group's dot products inside the GEMM, without
    it the norm kernel runs first.

    ready_flags: None, or (counters, unit, count): int32 counters, one per `unit` output columns;
    each program adds `count` to the counters of the column blocks it has stored (ops/overlap.py).
    Needs a tiled config whose tile width is a multiple of `unit`."""
    if activation is not None and (activation not in SKINNY_ACTIVATIONS or residual is not None or return_sq):
        raise ValueError(f"skinny_linear: activation {activation!r} needs no residual, no return_sq and one of "
                         f"{sorted(SKINNY_ACTIVATIONS)}")
    n, k = weight.shape
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    y = torch.empty((m, n), device=x.device, dtype=torch.result_type(x, weight) if residual is None else residual.dtype)
    res = None
    if residual is not None:
        res = residual.reshape(m, n)
        if res.stride(-1) != 1:
            res = res.contiguous()
    block_n, block_k, warps, stages, *extra = config or _skinny_config(n, k, m)
    per_sm, tma, early = (list(extra) + [0, 0, 0])[:3]
    if per_sm and tma:
        raise ValueError(f"skinny_linear: config {config}: a balanced grid has no fixed weight box for TMA")
    flag_args = {}
    if ready_flags is not None:
        counters, unit, count = ready_flags
        if per_sm or not block_n or block_n % unit or n % unit or counters.numel() < n // unit:
            raise ValueError(f"skinny_linear: ready flags per {unit} columns need a tiled config whose tile is a "
                             f"multiple of them (config {(block_n, block_k, warps, stages, *extra)}, N {n}) and "
                             f"{n // max(unit, 1)} counters (got {counters.numel()})")
        flag_args = dict(flag_ptr=counters, flag_unit=unit, flag_count=count, FLAGS=block_n // unit)
    grid = triton.cdiv(n, block_n) if block_n else 0
    if per_sm:  # balanced: a multiple of the SM count, N split evenly
        grid = min(_sm_count(x.device) * per_sm, n)
        block_n = max(16, triton.next_power_of_2(triton.cdiv(n, grid)))
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    group_size = k // norm_groups if norm_groups else 1
    if norm_groups and x_sq is not None:
        while block_k > 16 and group_size % block_k:  # a K block must not straddle two groups
            block_k //= 2
    use_parts = bool(norm_groups) and x_sq is not None and group_size % block_k == 0
    if use_parts:
        x_sq = _check_parts(x_sq, m, norm_groups, "x_sq")
    elif norm_groups:
        # Without the producer's sums of squares, the norm kernel first, once, rather than inside
        # every program: on the H100 the norm inside (each program's tiles squared, or their Gram
        # matrix X X^T on the tensor cores) cost 3-16 us per call at 16 rows, more than the extra
        # launch.
        rows = rms_norm(rows.reshape(-1, group_size), None, eps).reshape(m, k)
    y_sq = torch.empty(m, 1, grid, device=x.device, dtype=torch.float32) if return_sq else None
    w_desc = _weight_descriptor(weight, block_n, block_k) if tma else None
    use_pdl = bool(early) and pdl.enabled(x.device)
    # early 2 or 3: also the first 1 or 2 weight boxes before the wait (TMA 1 or 2, at most one
    # norm group, K covering them); else none
    pre = early - 1 if (early > 1 and w_desc is not None and tma in (1, 2) and norm_groups <= 1
                        and k >= (early - 1) * block_k) else 0
    _skinny_kernel[(grid,)](
        rows, weight, bias if bias is not None else weight, y, m, n, k, rows.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, IEEE=weight.dtype == torch.float32,
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
        num_stages=stages, USE_PDL=use_pdl, res_ptr=res, srm=res.stride(0) if res is not None else 0,
        HAS_RES=res is not None,
        xsq_ptr=x_sq if use_parts else None, n_xparts=x_sq.shape[-1] if use_parts else 1, group_size=group_size,
        eps=float(eps), NORM_GROUPS=norm_groups if use_parts else 0,
        BLOCK_Q=max(16, triton.next_power_of_2(x_sq.shape[-1])) if use_parts else 16,
        ysq_ptr=y_sq, WRITE_SQ=return_sq, BALANCED=bool(per_sm),
        ACT=SKINNY_ACTIVATIONS[activation] if activation else 0,
        w_desc=w_desc, TMA=tma if w_desc is not None else 0, PRE=pre, **({"launch_pdl": True} if use_pdl else {}),
        **flag_args,
    )
    y = y.reshape(tuple(x.shape[:-1]) + (n,))
    return (y, y_sq) if return_sq else y


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the CPU interpreter: any small count exercises the balanced split
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _check_parts(sq: torch.Tensor, rows: int, groups: int, name: str) -> torch.Tensor:
    """Partial sums of squares as (rows, groups, parts) fp32, contiguous."""
    if sq.dim() != 3 or tuple(sq.shape[:2]) != (rows, groups) or sq.dtype != torch.float32:
        raise ValueError(f"{name}: expected (rows {rows}, groups {groups}, parts) fp32, got {tuple(sq.shape)} {sq.dtype}")
    return sq.contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config=None) -> torch.Tensor:
    """x (..., K), weight (N, K), bias (N,) or None -> (..., N), as nn.Linear. One row runs the
    GEMV, 2..SKINNY_MAX_ROWS rows the skinny GEMM, more rows F.linear. `config` (a GemvConfig
    or tuple) overrides the GEMV's tuned config (benchmarks)."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    n = weight.shape[0]
    if (rows == 0 or not (rows == 1 or skinny_rows(rows, n, k, weight.element_size()))
            or weight.stride(-1) != 1 or (x.device.type != "cuda" and not interpreting())):
        return F.linear(x, weight, bias)
    if rows > 1:
        return skinny_linear(x, weight, bias)
    cfg = GemvConfig(*(config or gemv_config(n, k, x.device)))
    if cfg[3] > 1:
        # split-K for a plain linear needs a reduction; kept for the sweep, tuned tables avoid it here
        return gemv_partials(x, weight, bias, cfg[3], cfg).sum(0).to(torch.result_type(x, weight))
    y = torch.empty(x.shape[:-1] + (n,), device=x.device, dtype=torch.result_type(x, weight))
    _launch_gemv(_as_vector(x, k), weight, bias, y, cfg, partial=False)
    return y


def norm_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, norm_groups: int = 1,
                eps: float = 1e-5, residual: torch.Tensor | None = None, config=None,
                x_sq: torch.Tensor | None = None, return_sq: bool = False, reuse_residual: bool = False,
                activation: str | None = None, ready_flags=None):
    """[residual +] linear(RMSNorm(x) over norm_groups groups, weight, bias) on the kernels; same
    contract as `naive_norm_linear` (the norm has no weight of its own: it is folded into
    `weight`, see `ssmspec.models.fold`). One row runs the GEMV with the norm and the residual
    add inside its one launch (the 1/rms scaling the dot products), 2..SKINNY_MAX_ROWS rows the
    skinny GEMM with the residual add in its epilogue, more rows the norm kernel and cuBLAS.
    `config`: the GEMV's, as in `linear`.

    x_sq / return_sq: partial sums of squares of the rows, (rows, groups, parts) fp32, that a
    producer hands to the next norm so that it need not reduce its input again. The skinny GEMM
    uses x_sq to scale each group's dot products (no norm launch) and, with return_sq, writes
    its output's partials; other routes ignore x_sq and return None for them. Returns y, or
    (y, y_sq or None) with return_sq.

    reuse_residual: the caller no longer needs `residual`, so the output may be written into its
    storage (the cuBLAS route adds in place, sparing addmm's copy of it). activation: applied to
    the output (no residual), inside the skinny GEMM's epilogue when it is one of
    SKINNY_ACTIVATIONS, else after. ready_flags: as in `skinny_linear`, for the skinny route
    only (`skinny_rows`; an error elsewhere)."""
    from .naive import ACTIVATIONS, naive_norm_linear

    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if ready_flags is not None:
        if activation is not None or not (1 < rows and skinny_rows(rows, *weight.shape, weight.element_size())
                                          and weight.stride(-1) == 1 and (x.device.type == "cuda" or interpreting())):
            raise ValueError("norm_linear: ready flags need the skinny GEMM's route (2..SKINNY_WIDE_MAX_ROWS rows "
                             "of a shape it takes, no activation)")
        return skinny_linear(x, weight, bias, residual=residual, norm_groups=norm_groups, eps=eps, x_sq=x_sq,
                             return_sq=return_sq, ready_flags=ready_flags)
    if rows == 0 or (x.device.type != "cuda" and not interpreting()) or (norm_groups and k % norm_groups):
        return naive_norm_linear(x, weight, bias, norm_groups, eps, residual, x_sq, return_sq, activation=activation)
    if activation is not None:
        if residual is not None:
            raise ValueError("norm_linear: an activation applies to an output without a residual")
        if not (skinny_rows(rows, *weight.shape, weight.element_size())
                and activation in SKINNY_ACTIVATIONS and weight.stride(-1) == 1 and not return_sq):
            return ACTIVATIONS[activation](norm_linear(x, weight, bias, norm_groups, eps, config=config, x_sq=x_sq))
        return skinny_linear(x, weight, bias, norm_groups=norm_groups, eps=eps, x_sq=x_sq, activation=activation)
    if (not (rows == 1 or skinny_rows(rows, *weight.shape, weight.element_size()))
            or weight.stride(-1) != 1):
        y = _norm_then_cublas(x, weight, bias, norm_groups, eps, residual, reuse_residual)
        return (y, None) if return_sq else y
    if residual is not None and tuple(residual.shape) != tuple(x.shape[:-1]) + (weight.shape[0],):
        raise ValueError(f"norm_linear: residual {tuple(residual.shape)} does not match the output")
    if rows > 1:
        return skinny_linear(x, weight, bias, residual=residual, norm_groups=norm_groups, eps=eps, x_sq=x_sq,
                             return_sq=return_sq)
    n = weight.shape[0]
    cfg = GemvConfig(*(config or gemv_config(n, k, x.device)))
    if cfg[3] > 1:
        y = _norm_then_cublas(x, weight, bias, norm_groups, eps, residual)
        return (y, None) if return_sq else y
    y = torch.empty(x.shape[:-1] + (n,), device=x.device,
                    dtype=torch.result_type(x, weight) if residual is None else residual.dtype)
    _launch_gemv(_as_vector(x, k), weight, bias, y, cfg, partial=False,
                 residual=None if residual is None else _as_vector(residual, n), norm_groups=norm_groups, eps=eps)
    return (y, None) if return_sq else y


def _norm_then_cublas(x, weight, bias, norm_groups, eps, residual, reuse_residual=False):
    """`norm_linear` for many rows: the norm kernel (ops/step_update rms_norm over each group),
    then cuBLAS with the residual add in its epilogue (addmm: one rounding instead of two; in
    place into the residual when the caller allows, else on a copy of it)."""
    k, n = x.shape[-1], weight.shape[0]
    if norm_groups:
        x = rms_norm(x.reshape(-1, k // norm_groups), None, eps).reshape(x.shape)
    if residual is None:
        return F.linear(x, weight, bias)
    if bias is None and residual.dtype == x.dtype == weight.dtype:
        if reuse_residual and residual.is_contiguous():
            residual.view(-1, n).addmm_(x.reshape(-1, k), weight.t())
            return residual
        return torch.addmm(residual.reshape(-1, n), x.reshape(-1, k), weight.t()).reshape(residual.shape)
    return residual + F.linear(x, weight, bias).to(residual.dtype)

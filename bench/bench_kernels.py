"""Check the Triton kernels against their references at mamba2-2.7b layer sizes, then time them.

Run on a CUDA machine from the repository root:

    PYTHONPATH=. python bench/bench_kernels.py --out bench_kernels.json

Checks (fresh random bf16 inputs, fp32 states, NaN-poisoned outputs): tree_scan, tree_conv,
replay_ssm_state, replay_conv_state, mamba_step, rms_norm, each against its naive.py reference
on several trees (one node, a chain of 63, full binary trees, a wide tree, an uneven tree).
Timings (CUDA-graph replays, median): tree_scan on full binary trees of 15/31/63 nodes, packed
versus unrolled (each root-to-leaf path as its own batch row), against the single-token update.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import torch
import triton
from triton.testing import do_bench_cudagraph

from ssmspec.ops import pdl
from ssmspec.ops.gemv.triton import GemvConfig, gemv_partials, linear, skinny_linear
from ssmspec.ops.state_replay.naive import naive_replay_conv_state, naive_replay_ssm_state
from ssmspec.ops.state_replay.triton import replay_conv_state, replay_ssm_state
from ssmspec.ops.step_update.naive import naive_mamba_step, naive_rms_norm
from ssmspec.ops.step_update.triton import mamba_step, rms_norm
from ssmspec.ops.tree_conv.naive import naive_tree_conv
from ssmspec.ops.tree_conv.triton import tree_conv
from ssmspec.ops.tree_scan.naive import naive_tree_scan
from ssmspec.ops.tree_scan.triton import tree_scan
from ssmspec.trees.tree import Tree

DEV = "cuda"
H, P, S, G, K = 80, 64, 128, 1, 4  # mamba2-2.7b mixer
D_INNER = H * P
CONV_DIM = D_INNER + 2 * G * S
BF16 = torch.bfloat16
RESULTS: dict = {"checks": [], "timings": []}


def poison_allocator(nbytes: int) -> None:
    """Free a NaN-filled block so that the kernels' next torch.empty likely reuses it: an
    unwritten output lane then shows up as NaN instead of stale numbers."""
    block = torch.full((nbytes // 4 + 1024,), float("nan"), device=DEV)
    del block


def check(name: str, got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    got, ref = got.double(), ref.double()
    finite = bool(torch.isfinite(got).all())
    err = (got - ref).norm().item() / max(ref.norm().item(), 1e-30)
    max_abs = (got - ref).abs().max().item() if finite else float("nan")
    ok = finite and err <= tol
    RESULTS["checks"].append({"name": name, "rel_err": err, "max_abs": max_abs, "tol": tol, "ok": ok})
    print(f"{'ok ' if ok else 'BAD'} {name:<58} rel {err:.2e} max_abs {max_abs:.2e} (tol {tol:.0e})", flush=True)


def tree_inputs(batch: int, n: int, dtype=BF16):
    x = torch.randn(batch, n, H, P, device=DEV, dtype=dtype)
    dt = torch.rand(batch, n, H, device=DEV) * 0.1 + 1e-3
    A = -(1 + torch.rand(H, device=DEV) * 15)
    B = torch.randn(batch, n, G, S, device=DEV, dtype=dtype) * 0.3
    C = torch.randn(batch, n, G, S, device=DEV, dtype=dtype) * 0.3
    D = torch.randn(H, device=DEV)
    h0 = torch.randn(batch, H, P, S, device=DEV)
    return x, dt, A, B, C, D, h0


TREES = {
    "one node": Tree.from_parents([-1]),
    "chain of 63 (64 nodes)": Tree.chain(63),
    "binary depth 4 (31 nodes)": Tree.from_config((2, 2, 2, 2)),
    "wide 1x40 (41 nodes)": Tree.from_config((40,)),
    "uneven 3,4,2,1 (64 nodes)": Tree.from_config((3, 4, 2, 1)),
}


def run_checks() -> None:
    for tname, tree in TREES.items():
        parents = tree.parents_tensor(DEV)
        n = tree.num_nodes
        for batch in (1, 3):
            x, dt, A, B, C, D, h0 = tree_inputs(batch, n)
            ref = naive_tree_scan(x, dt, A, B, C, D, parents, h0)
            for precision, tol in (("ieee", 1e-5), ("tf32", 3e-3)):
                poison_allocator(ref.numel() * 4)
                check(f"tree_scan {precision} B={batch} {tname}", tree_scan(x, dt, A, B, C, D, parents, h0, precision=precision), ref, tol)
            xbc = torch.randn(batch, n, CONV_DIM, device=DEV, dtype=BF16)
            cs = torch.randn(batch, CONV_DIM, K - 1, device=DEV, dtype=BF16)
            w = torch.randn(CONV_DIM, K, device=DEV, dtype=BF16) * 0.5
            bias = torch.randn(CONV_DIM, device=DEV, dtype=BF16)
            ref = naive_tree_conv(xbc, cs, w, bias, parents)
            poison_allocator(ref.numel() * 2)
            # bf16 output: one rounding step of difference is allowed (1 ulp ~ 4e-3 relative)
            check(f"tree_conv B={batch} {tname}", tree_conv(xbc, cs, w, bias, parents), ref, 4e-3)
            # replay along the deepest path, truncated differently per row
            deepest = max(range(n), key=lambda i: len(tree.path(i)))
            p = torch.tensor(tree.path(deepest), device=DEV)
            path = p[None].expand(batch, -1).contiguous()
            path_len = torch.randint(1, p.numel() + 1, (batch,), device=DEV)
            path_len[0] = p.numel()
            ssm_ref, ssm_got = h0.clone(), h0.clone()
            naive_replay_ssm_state(ssm_ref, x, dt, A, B, path, path_len)
            replay_ssm_state(ssm_got, x, dt, A, B, path, path_len)
            check(f"replay_ssm_state B={batch} {tname}", ssm_got, ssm_ref, 1e-5)
            cs_ref, cs_got = cs.clone(), cs.clone()
            naive_replay_conv_state(cs_ref, xbc, path, path_len)
            replay_conv_state(cs_got, xbc, path, path_len)
            check(f"replay_conv_state B={batch} {tname}", cs_got, cs_ref, 0.0)
    for batch in (1, 4):
        xBC = torch.randn(batch, CONV_DIM, device=DEV, dtype=BF16)
        dt_raw = torch.randn(batch, H, device=DEV, dtype=BF16)
        z = torch.randn(batch, D_INNER, device=DEV, dtype=BF16)
        cs = torch.randn(batch, CONV_DIM, K - 1, device=DEV, dtype=BF16)
        ss = torch.randn(batch, H, P, S, device=DEV)
        w = torch.randn(CONV_DIM, K, device=DEV, dtype=BF16) * 0.5
        bias = torch.randn(CONV_DIM, device=DEV, dtype=BF16)
        dt_bias, A_log, D = torch.randn(H, device=DEV), torch.randn(H, device=DEV), torch.randn(H, device=DEV)
        nw = torch.randn(D_INNER, device=DEV, dtype=BF16)
        args = (w, bias, dt_bias, A_log, D, nw, G, 1, 0.0, math.inf, 1e-5)
        cs2, ss2 = cs.clone(), ss.clone()
        ref = naive_mamba_step(xBC, dt_raw, z, cs, ss, *args)
        poison_allocator(ref.numel() * 8)
        got = mamba_step(xBC, dt_raw, z, cs2, ss2, *args)
        check(f"mamba_step out B={batch}", got, ref, 1e-2)
        check(f"mamba_step ssm_state B={batch}", ss2, ss, 1e-5)
        check(f"mamba_step conv_state B={batch}", cs2, cs, 0.0)
        hid = torch.randn(batch, 1, 2560, device=DEV, dtype=BF16)
        nw2 = torch.randn(2560, device=DEV, dtype=BF16)
        check(f"rms_norm B={batch}", rms_norm(hid, nw2, 1e-5), naive_rms_norm(hid, nw2, 1e-5), 4e-3)


def time_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return 1000 * do_bench_cudagraph(fn, rep=50, return_mode="median")


def unrolled_inputs(tree: Tree, x, dt, B, C):
    """Each root-to-leaf path as its own batch row (leaves, depth+1): the 'unrolled' alternative."""
    paths = torch.tensor([tree.path(leaf) for leaf in tree.leaves()], device=DEV)  # (L, D+1)
    return x[0, paths], dt[0, paths], B[0, paths], C[0, paths], paths


def run_timings() -> None:
    x1, dt1, A, B1, C1, D, h0 = tree_inputs(1, 1)
    par1 = Tree.from_parents([-1]).parents_tensor(DEV)
    t_single = time_us(lambda: tree_scan(x1, dt1, A, B1, C1, D, par1, h0, precision="tf32"))
    # the fused single-token step (conv + state update + gated norm): what a decode step runs
    xBC = torch.randn(1, CONV_DIM, device=DEV, dtype=BF16)
    dt_raw = torch.randn(1, H, device=DEV, dtype=BF16)
    z = torch.randn(1, D_INNER, device=DEV, dtype=BF16)
    cs = torch.randn(1, CONV_DIM, K - 1, device=DEV, dtype=BF16)
    ss = torch.randn(1, H, P, S, device=DEV)
    w = torch.randn(CONV_DIM, K, device=DEV, dtype=BF16)
    args = (w, None, torch.zeros(H, device=DEV), torch.zeros(H, device=DEV), D, torch.ones(D_INNER, device=DEV, dtype=BF16), G, 1, 0.0, math.inf, 1e-5)
    t_step = time_us(lambda: mamba_step(xBC, dt_raw, z, cs, ss, *args))
    RESULTS["timings"].append({"what": "single-token tree_scan (N=1)", "us": t_single})
    RESULTS["timings"].append({"what": "fused mamba_step (conv+state+norm)", "us": t_step})
    rows = []
    for config in ((2, 2, 2), (2, 2, 2, 2), (2, 2, 2, 2, 2)):
        tree = Tree.from_config(config)
        n = tree.num_nodes
        parents = tree.parents_tensor(DEV)
        x, dt, _, B, C, _, _ = tree_inputs(1, n)
        t_ieee = time_us(lambda: tree_scan(x, dt, A, B, C, D, parents, h0, precision="ieee"))
        t_tf32 = time_us(lambda: tree_scan(x, dt, A, B, C, D, parents, h0, precision="tf32"))
        xu, dtu, Bu, Cu, paths = unrolled_inputs(tree, x, dt, B, C)
        chain = Tree.chain(paths.shape[1] - 1).parents_tensor(DEV)
        h0u = h0.expand(paths.shape[0], -1, -1, -1)  # the state broadcast, not copied (best case)

        def unrolled():
            return tree_scan(x[0, paths], dt[0, paths], A, B[0, paths], C[0, paths], D, chain, h0u, precision="tf32")

        t_unrolled = time_us(unrolled)
        # memory: peak extra bytes of one call (inputs already resident)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        tree_scan(x, dt, A, B, C, D, parents, h0, precision="tf32")
        torch.cuda.synchronize()
        mem_packed = torch.cuda.max_memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        unrolled()
        torch.cuda.synchronize()
        mem_unrolled = torch.cuda.max_memory_allocated() - base
        t_naive = 1000 * triton.testing.do_bench(lambda: naive_tree_scan(x, dt, A, B, C, D, parents, h0), rep=50, return_mode="median")
        row = {
            "tree": ",".join(map(str, config)), "nodes": n, "paths": paths.shape[0], "path_len": paths.shape[1],
            "packed_ieee_us": t_ieee, "packed_tf32_us": t_tf32, "unrolled_tf32_us": t_unrolled,
            "naive_torch_us": t_naive, "single_token_us": t_single, "fused_step_us": t_step,
            "packed_extra_bytes": mem_packed, "unrolled_extra_bytes": mem_unrolled,
        }
        rows.append(row)
        RESULTS["timings"].append(row)
    # the other verify/replay kernels at the 64-node tree
    tree = Tree.from_config((3, 4, 2, 1))
    parents = tree.parents_tensor(DEV)
    n = tree.num_nodes
    xbc = torch.randn(1, n, CONV_DIM, device=DEV, dtype=BF16)
    csb = torch.randn(1, CONV_DIM, K - 1, device=DEV, dtype=BF16)
    t_conv = time_us(lambda: tree_conv(xbc, csb, w, None, parents))
    x, dt, _, B, C, _, _ = tree_inputs(1, n)
    path = torch.tensor([tree.path(n - 1)], device=DEV)
    plen = torch.tensor([path.shape[1]], device=DEV)
    t_rssm = time_us(lambda: replay_ssm_state(ss, x, dt, A, B, path, plen))
    t_rconv = time_us(lambda: replay_conv_state(csb, xbc, path, plen))
    RESULTS["timings"].append({"what": "64-node tree_conv", "us": t_conv})
    RESULTS["timings"].append({"what": "replay_ssm_state (path of 5)", "us": t_rssm})
    RESULTS["timings"].append({"what": "replay_conv_state (path of 5)", "us": t_rconv})

    # one-row projections: cuBLAS (F.linear) against the Triton GEMV at a few tile shapes
    gemv_rows = []
    for label, n_out, k_in in (("in_proj", 2 * D_INNER + 2 * G * S + H, 2560), ("out_proj", 2560, D_INNER), ("lm_head", 50288, 2560)):
        wts = [torch.randn(n_out, k_in, device=DEV, dtype=BF16) for _ in range(3)]  # rotate: > L2
        xin = torch.randn(1, k_in, device=DEV, dtype=BF16)
        nbytes = n_out * k_in * 2
        ref = torch.nn.functional.linear(xin, wts[0])
        got = linear(xin, wts[0])
        check(f"gemv {label}", got, ref, 4e-3)
        res = {"what": f"gemv {label} {n_out}x{k_in}", "bytes": nbytes}
        res["cublas_us"] = time_us(lambda: [torch.nn.functional.linear(xin, w_) for w_ in wts]) / 3
        res["triton_us"] = time_us(lambda: [linear(xin, w_) for w_ in wts]) / 3
        for cfg in ((4, 512, 4), (8, 512, 4), (8, 1024, 4), (16, 512, 4), (16, 256, 4), (4, 1024, 4), (8, 256, 2), (2, 1024, 4)):
            res[f"triton_{cfg[0]}x{cfg[1]}w{cfg[2]}_us"] = time_us(lambda: [linear(xin, w_, config=cfg) for w_ in wts]) / 3
        gemv_rows.append(res)
        RESULTS["timings"].append(res)

    print("\none-row projections (bf16), per call, rotating 3 weight copies; TB/s = weight bytes / time")
    for res in gemv_rows:
        parts = [f"{k[:-3]} {v:.1f}us ({res['bytes'] / v / 1e6:.2f} TB/s)" for k, v in res.items() if k.endswith("_us")]
        print(f"  {res['what']}: " + "; ".join(parts))

    print("\nmamba2-2.7b layer (H=80, P=64, S=128, G=1), batch 1, CUDA-graph replay medians")
    print(f"single-token tree_scan N=1: {t_single:.1f} us; fused mamba_step: {t_step:.1f} us; "
          f"64-node tree_conv {t_conv:.1f} us; replay ssm {t_rssm:.1f} us, conv {t_rconv:.1f} us")
    print(f"{'tree':<10} {'N':>3} {'packed ieee':>11} {'packed tf32':>11} {'unrolled':>9} {'naive':>8} "
          f"{'x 1-token':>9} {'mem packed':>10} {'mem unrolled':>12}")
    for r in rows:
        print(f"{r['tree']:<10} {r['nodes']:>3} {r['packed_ieee_us']:>9.1f}us {r['packed_tf32_us']:>9.1f}us "
              f"{r['unrolled_tf32_us']:>7.1f}us {r['naive_torch_us']:>6.0f}us {r['packed_tf32_us'] / t_single:>8.2f}x "
              f"{r['packed_extra_bytes'] / 2**20:>8.2f}MiB {r['unrolled_extra_bytes'] / 2**20:>10.2f}MiB")


def copy_tbps() -> float:
    """Device-to-device copy bandwidth (bytes read + written), TB/s: the reference for 'x% of copy'."""
    src = torch.randn(1 << 28, device=DEV)
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / us / 1e6


SKINNY_CFGS = [(16, 128, 4, 4), (32, 128, 4, 4), (32, 64, 4, 6), (64, 64, 4, 4), (16, 256, 4, 3), (32, 256, 4, 3),
               (64, 128, 4, 3), (16, 128, 2, 5), (16, 64, 4, 8)]
# balanced grids: (0, block_k, warps, stages, programs per SM), BLOCK_N derived (ops/gemv skinny_linear)
BALANCED_CFGS = [(0, bk, w, st, k) for k in (1, 2, 3, 4, 5, 6) for bk, w, st in ((128, 2, 5), (128, 4, 4), (256, 4, 3))]


def skinny_sweep(shapes, ms=(8, 16, 32, 64), cfgs=SKINNY_CFGS) -> None:
    """Skinny GEMM configs against cuBLAS at M rows, rotating >= 200 MB of weight copies."""
    print("\nskinny GEMM (M rows at once) against cuBLAS; config = (block_n, block_k, warps, stages[, per SM])")
    for label, n_out, k_in in shapes:
        nbytes = n_out * k_in * 2
        copies = max(2, math.ceil(200e6 / nbytes))
        wts = [torch.randn(n_out, k_in, device=DEV, dtype=BF16) for _ in range(copies)]
        for m in ms:
            xin = torch.randn(m, k_in, device=DEV, dtype=BF16)
            ref = torch.nn.functional.linear(xin, wts[0])
            cub = time_us(lambda: [torch.nn.functional.linear(xin, w_) for w_ in wts]) / copies
            res = []
            for cfg in cfgs:
                try:
                    check(f"skinny {label} M={m} {cfg}", skinny_linear(xin, wts[0], None, config=cfg), ref, 4e-3)
                    res.append((cfg, time_us(lambda cfg=cfg: [skinny_linear(xin, w_, None, config=cfg) for w_ in wts]) / copies))
                except Exception as e:
                    print(f"  skinny {label} M={m} {cfg} failed: {e!r}"[:200], flush=True)
            res.sort(key=lambda r: r[1])
            top = "; ".join(f"{c} {us:.2f}us" for c, us in res[:5])
            print(f"  {label} M={m:>2}: cuBLAS {cub:7.2f} us ({nbytes / cub / 1e6:.2f} TB/s) | best skinny {top} "
                  f"({nbytes / res[0][1] / 1e6:.2f} TB/s)", flush=True)
            RESULTS["timings"].append({"what": f"skinny {label} M={m}", "cublas_us": cub, "rows": [(str(c), u) for c, u in res]})
        del wts


def gemv_sweep(only: str | None = None) -> None:
    """One-row GEMV and few-row skinny GEMM configs at the mamba2-2.7b projection shapes, against
    cuBLAS; rotating enough weight copies (>= 200 MB) that L2 cannot hold them. Prints tables
    and the best config per shape."""
    bw = copy_tbps()
    print(f"copy bandwidth {bw:.3f} TB/s (read + written); PDL {'on' if pdl.enabled(torch.device(DEV)) else 'off'}", flush=True)
    RESULTS["copy_TBps"] = bw
    shapes = [("in_proj", 2 * D_INNER + 2 * G * S + H, 2560), ("out_proj", 2560, D_INNER), ("lm_head", 50288, 2560)]
    gemv_cfgs = [GemvConfig(bn, bk, 4) for bn in (1, 2, 4) for bk in (512, 1024, 2048)]
    gemv_cfgs += [GemvConfig(bn, bk, 8) for bn, bk in ((2, 1024), (4, 1024), (2, 2048))]
    gemv_cfgs += [GemvConfig(bn, bk, w, unroll=True) for bn, bk, w in ((1, 1024, 4), (2, 512, 4), (2, 1024, 4), (2, 2048, 8),
                                                                      (4, 512, 4), (4, 1024, 8), (1, 2048, 8), (2, 1024, 8))]
    gemv_cfgs += [GemvConfig(bn, bk, 4, persistent=132 * k, unroll=u) for bn, bk in ((1, 1024), (2, 1024), (2, 512))
                  for k in (4, 16) for u in (False, True)]
    gemv_cfgs += [GemvConfig(bn, 0, w, preload=True) for bn, w in ((1, 4), (1, 8), (2, 4), (2, 8))]
    split_cfgs = [GemvConfig(bn, bk, w, split=sp, unroll=True) for bn, bk, w, sp in
                  ((2, 1024, 4, 2), (4, 1024, 4, 2), (4, 512, 4, 4), (8, 512, 4, 4), (8, 1024, 8, 2), (2, 512, 4, 2),
                   (1, 1024, 4, 2))]
    best = {}
    for label, n_out, k_in in shapes:
        if only and label != only:
            continue
        nbytes = n_out * k_in * 2
        copies = max(2, math.ceil(200e6 / nbytes))
        wts = [torch.randn(n_out, k_in, device=DEV, dtype=BF16) for _ in range(copies)]
        xin = torch.randn(1, k_in, device=DEV, dtype=BF16)
        ref = torch.nn.functional.linear(xin, wts[0])
        rows = [("cuBLAS", time_us(lambda: [torch.nn.functional.linear(xin, w_) for w_ in wts]) / copies)]
        cfgs = gemv_cfgs + (split_cfgs if label != "lm_head" else [])
        if label == "lm_head":
            cfgs = [c for c in cfgs if not c[4] or c[4] == 132 * 4]
        for cfg in cfgs:
            try:
                if cfg[3] > 1:
                    got = gemv_partials(xin, wts[0], None, cfg[3], cfg).sum(0).to(BF16)
                    fn = lambda cfg=cfg: [gemv_partials(xin, w_, None, cfg[3], cfg) for w_ in wts]  # noqa: E731
                else:
                    got = linear(xin, wts[0], config=cfg)
                    fn = lambda cfg=cfg: [linear(xin, w_, config=cfg) for w_ in wts]  # noqa: E731
                check(f"gemv {label} {tuple(cfg)}", got, ref, 4e-3)
                rows.append((str(tuple(cfg)), time_us(fn) / copies))
            except Exception as e:  # a config that fails to compile is reported, not fatal
                print(f"  {label} {tuple(cfg)} failed: {e!r}"[:200], flush=True)
        rows_sorted = sorted(rows[1:], key=lambda r: r[1])
        print(f"\n{label} {n_out}x{k_in} ({nbytes / 1e6:.1f} MB), {copies} rotating copies; cuBLAS {rows[0][1]:.2f} us "
              f"({nbytes / rows[0][1] / 1e6 / bw:.0%} of copy); config = (block_n, block_k, warps, split, persistent, unroll),"
              " split rows exclude the reduction")
        for name, us in rows_sorted[:10] + [r for r in rows_sorted[10:] if "True)" in r[0][-6:]]:
            print(f"  {name:<38} {us:7.2f} us  {nbytes / us / 1e6:5.2f} TB/s  {nbytes / us / 1e6 / bw:5.1%} of copy")
        best[label] = rows_sorted[0]
        RESULTS["timings"].append({"what": f"gemv sweep {label}", "bytes": nbytes, "rows": rows})
        del wts

    skinny_sweep([sh for sh in shapes[:2] if not only or sh[0] == only])
    print("\nbest one-row configs: " + "; ".join(f"{k}: {v[0]} {v[1]:.2f} us" for k, v in best.items()))


def norm_linear_timings() -> None:
    """The projections with the folded norm (and residual add) inside them against the plain
    projection of the same shape: what the fusion costs inside each kernel, isolated."""
    from ssmspec.ops.gemv.naive import naive_norm_linear
    from ssmspec.ops.gemv.triton import linear, norm_linear

    shapes = [("in_proj", 10576, 2560, 1, False), ("out_proj", 2560, 5120, 1, True), ("out_proj-8b", 4096, 8192, 8, True),
              ("mlp_up-8b", 21504, 4096, 1, False), ("mlp_down-8b", 4096, 21504, 0, True)]
    print("\nnorm_linear (norm in the prologue, residual in the epilogue) against linear, rotating weights")
    for label, n_out, k_in, groups, residual in shapes:
        nbytes = n_out * k_in * 2
        copies = max(2, math.ceil(200e6 / nbytes))
        wts = [torch.randn(n_out, k_in, device=DEV, dtype=BF16) / math.sqrt(k_in) for _ in range(copies)]
        for m in (1, 16, 64):
            xin = torch.randn(m, k_in, device=DEV, dtype=BF16)
            res = torch.randn(m, n_out, device=DEV, dtype=BF16) if residual else None
            ref = naive_norm_linear(xin.float(), wts[0].float(), None, groups, 1e-5, None if res is None else res.float())
            check(f"norm_linear {label} M={m}", norm_linear(xin, wts[0], None, groups, 1e-5, res), ref, 2e-2)
            plain = time_us(lambda: [linear(xin, w_) for w_ in wts]) / copies
            fused = time_us(lambda: [norm_linear(xin, w_, None, groups, 1e-5, res) for w_ in wts]) / copies
            print(f"  {label:<12} M={m:>2}: linear {plain:7.2f} us ({nbytes / plain / 1e6:.2f} TB/s)  norm_linear "
                  f"{fused:7.2f} us  ratio {fused / plain:.3f}", flush=True)
            RESULTS["timings"].append({"what": f"norm_linear {label} M={m}", "linear_us": plain, "norm_linear_us": fused})
        del wts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write all figures as JSON here")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--gemv-sweep", action="store_true", help="only sweep the GEMV / skinny GEMM configs")
    ap.add_argument("--only", default=None, help="with --gemv-sweep: one of in_proj, out_proj, lm_head")
    ap.add_argument("--norm-linear", action="store_true", help="only time norm_linear against linear")
    ap.add_argument("--skinny-sweep", action="store_true",
                    help="only the skinny GEMM at 8 and 16 rows, tiled and balanced grids, 2.7b and hybrid-8b shapes")
    ap.add_argument("--shapes", default=None,
                    help="with --skinny-sweep: other shapes, label:N:K comma-separated (e.g. up:21504:4096)")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    if args.norm_linear:
        norm_linear_timings()
    elif args.gemv_sweep:
        gemv_sweep(args.only)
    elif args.skinny_sweep:
        shapes = [("in_proj", 2 * D_INNER + 2 * G * S + H, 2560), ("out_proj", 2560, D_INNER),
                  ("in_proj-8b", 2 * 8192 + 2 * 8 * 128 + 128, 4096), ("out_proj-8b", 4096, 8192)]
        if args.shapes:
            shapes = [(lbl, int(n), int(k)) for lbl, n, k in (item.split(":") for item in args.shapes.split(","))]
        skinny_sweep(shapes, ms=(16, 8), cfgs=SKINNY_CFGS[:2] + SKINNY_CFGS[7:8] + BALANCED_CFGS)
    else:
        if not args.skip_checks:
            run_checks()
        run_timings()
    bad = [c["name"] for c in RESULTS["checks"] if not c["ok"]]
    print(f"\nchecks: {len(RESULTS['checks']) - len(bad)}/{len(RESULTS['checks'])} ok" + (f"; FAILED: {bad}" if bad else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(RESULTS, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

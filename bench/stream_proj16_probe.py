"""Probe: the verify's projections for 16 tree nodes with the streaming design (bench/stream_proj16.cu).

64 layers of distinct random bf16 weights at the mamba2-2.7b shape (step_cost_probe's `make_layer`),
16 nodes. Per layer: in_proj of the nodes' residual stream (norm inside), a grid barrier, out_proj
of a fixed gated input (norm inside) plus the residual add, a grid barrier: what a verify layer
runs around its tree conv and scan. Checks the kernel against torch over 1 and 2 layers, then
times it against the product's two skinny GEMMs (`dispatch.norm_linear`, as
`step_cost_probe.py --tree` times "in_proj + out_proj only"), in one process, us per layer.

Run on the device from the bench directory: python3 stream_proj16_probe.py [--slots "3,3:ACT_SMEM"]
    [--timing-variants "ACT_SMEM,NO_GRID_SYNC;NO_A_RELOAD"]  (switches within a --slots entry joined by '+',
    e.g. "3:ACT_SMEM+ACT_MCAST")
"""
from __future__ import annotations

import argparse
import os

import numpy as np
import torch
from bench_decode import copy_bandwidth
from step_cost_probe import D_INNER, D_MODEL, LAYERS, graph_us, make_layer
from stream_layers_probe import CubinKernel, rel, timed_rows

NODES, EPS = 16, 1e-5
N_IN = 2 * D_INNER + 2 * 128 + 80
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stream_proj16.cu")


class Proj16Kernel(CubinKernel):
    def __init__(self, slots: int, defines: tuple[str, ...] = ()):
        self.slots, self.defines = slots, defines
        row = D_MODEL * 2 + (64 if "ACT_REG" in defines else 16)  # a padded slot row (ROW_STRIDE)
        smem = (slots * (9 if "IN9" in defines else 8) * row + 8 * NODES * 4 + (8 * NODES * 8 + NODES * 48 + 8 * NODES + NODES) * 4 + 2 * slots * 8
                + 4 * 8 + NODES * 4 + (NODES * row if "ACT_SMEM" in defines else 0))  # + the barriers and rows
        super().__init__(SOURCE, "stream_proj16", (f"N_SLOTS={slots}", *defines), smem)
        self.zx = torch.full((NODES, N_IN), float("nan"), device="cuda", dtype=torch.bfloat16)
        self.hbuf = torch.full((2, NODES, D_MODEL), float("nan"), device="cuda", dtype=torch.bfloat16)
        self.counter = torch.zeros(1, device="cuda", dtype=torch.int32)
        # TRACE builds: TRACE_N globaltimer stamps per layer and CTA (see stream_proj16.cu)
        self.trace = torch.zeros((LAYERS, self.ctas, TRACE_N), device="cuda", dtype=torch.int64)

    def __call__(self, table, n_layers, h, g, out):
        self.counter.zero_()
        self.launch(288, (np.uint64(table.data_ptr()), np.int32(n_layers), np.uint64(h.data_ptr()),
                          np.uint64(out.data_ptr()), np.uint64(g.data_ptr()), np.uint64(self.zx.data_ptr()),
                          np.uint64(self.hbuf.data_ptr()), np.uint64(self.counter.data_ptr()), np.float32(EPS),
                          np.uint64(self.trace.data_ptr())))


TRACE_N = 10


def report_trace(kernel: Proj16Kernel) -> None:
    """Where a layer's time goes, from a TRACE build's stamps (us, layers 1..62, over CTAs):
    per phase the mean and the max over CTAs, each barrier's arrival spread, and which CTAs
    arrive last (with their in_proj row counts: 80 or 81 of 10576 over 132 CTAs)."""
    tr = kernel.trace.cpu().double().numpy()[1:-1] / 1000.0  # (layers, ctas, TRACE_N) in us
    ctas = tr.shape[1]
    stamps = tr[:, :, :8]
    flat = np.sort(np.unique(stamps[:, 0, :].ravel()))
    print(f"  trace: {kernel.defines}; globaltimer step (smallest gap between distinct stamps of CTA 0) "
          f"{np.diff(flat)[np.diff(flat) > 0].min() * 1000:.0f} ns", flush=True)
    rows = np.array([(N_IN * (c + 1)) // ctas - (N_IN * c) // ctas for c in range(ctas)])
    spans = [("fetch h (act landed - layer start)", 0, 1), ("in_proj slots", 1, 2), ("barrier 1 wait", 2, 3),
             ("fetch g0", 3, 4), ("out_proj half 0 + fetch g1", 4, 5), ("out_proj half 1 + residual", 5, 6),
             ("barrier 2 wait", 6, 7)]
    for what, a, b in spans:
        d = stamps[:, :, b] - stamps[:, :, a]
        print(f"    {what:<40} mean {d.mean():6.2f}  max over CTAs (mean over layers) {d.max(1).mean():6.2f}")
    layer = np.diff(stamps[:, :, 0], axis=0)
    print(f"    {'layer (start to next start)':<40} mean {layer.mean():6.2f}")
    for name, idx in (("barrier 1", 2), ("barrier 2", 6)):
        arr = stamps[:, :, idx]
        spread = arr.max(1) - np.median(arr, 1)
        exit_ = stamps[:, :, idx + 1].min(1) - arr.max(1)
        last = arr.argmax(1)
        late81 = (rows[last] == rows.max()).mean()
        print(f"    {name}: last arrival - median {spread.mean():5.2f} us (max {spread.max():5.2f}); first exit - last "
              f"arrival {exit_.mean():5.2f} us; last CTA has {rows.max()} in_proj rows in {late81:.0%} of layers "
              f"({(rows == rows.max()).sum()} of {ctas} CTAs do); most often last: CTAs "
              f"{np.bincount(last, minlength=ctas).argsort()[::-1][:6].tolist()}")
    print(f"    producer per layer: ring full {tr[:, :, 8].mean():6.2f} us, waiting on the copy in flight "
          f"{tr[:, :, 9].mean():6.2f} us (means over CTAs)", flush=True)


def reference(layers, h, g):
    """torch, fp32 math with the kernel's roundings: (the last layer's zx, the output)."""
    gf = g.float()
    rg = torch.rsqrt(gf.pow(2).mean(-1, keepdim=True) + EPS)
    for L in layers:
        hf = h.float()
        zx = ((hf @ L["in_w"].float().T) * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)).bfloat16()
        o = ((gf @ L["out_w"].float().T) * rg).bfloat16()
        h = (hf + o.float()).bfloat16()
    return zx, h


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", default="3,3:ACT_SMEM,2:ACT_SMEM",
                    help="ring depths to build, check and time, each with optional build switches after a colon")
    ap.add_argument("--timing-variants", default="",
                    help="';'-separated sets of build switches timed but not checked, e.g. 'NO_GRID_SYNC;NO_MMA;"
                         "NO_REDUCE;IN_FLIGHT=2', built with the first --slots")
    ap.add_argument("--trace", default="",
                    help="';'-separated --slots entries to build with TRACE, run once after a warm-up, and report "
                         "where each layer's time goes (e.g. '3:ACT_SMEM+ACT_MCAST')")
    args = ap.parse_args()
    torch.manual_seed(0)
    from ssmspec.ops import dispatch

    dispatch.set_backend("triton")
    bw = copy_bandwidth()
    layers = [make_layer("cuda", torch.bfloat16) for _ in range(LAYERS)]
    h = torch.randn(NODES, D_MODEL, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(NODES, D_INNER, device="cuda", dtype=torch.bfloat16)
    floor_us = (layers[0]["in_w"].numel() + layers[0]["out_w"].numel()) * 2 / bw * 1e6
    print(f"{torch.cuda.get_device_name()}; copy {bw / 1e12:.2f} TB/s; in_proj + out_proj weights per layer at that "
          f"rate {floor_us:.1f} us", flush=True)
    table = torch.tensor([[L["in_w"].data_ptr(), L["out_w"].data_ptr()] for L in layers], dtype=torch.int64,
                         device="cuda")
    kernels = []
    for spec in args.slots.split(","):  # "3" or "3:ACT_SMEM"
        slots, _, defines = spec.partition(":")
        kernels.append(Proj16Kernel(int(slots), tuple(filter(None, defines.split("+")))))
    for kernel in kernels:
        for n in (1, 2):
            out = torch.empty_like(h)
            torch.cuda.synchronize()
            kernel(table, n, h, g, out)
            torch.cuda.synchronize()
            zx_ref, h_ref = reference(layers[:n], h, g)
            errs = rel(kernel.zx, zx_ref), rel(out, h_ref)
            print(f"  {n} layer(s), {kernel.slots} slots {kernel.defines}: rel err zx {errs[0]:.2e}, output {errs[1]:.2e}", flush=True)
            if not (errs[0] < 1e-2 and errs[1] < 1e-2):
                raise SystemExit("the 16-node streaming projections do not match torch")

    for variant in filter(None, args.timing_variants.split(";")):
        kernels.append(Proj16Kernel(kernels[0].slots, tuple(variant.split(","))))

    for spec in filter(None, args.trace.split(";")):
        slots, _, defines = spec.partition(":")
        kernel = Proj16Kernel(int(slots), (*filter(None, defines.split("+")), "TRACE"))
        out = torch.empty_like(h)
        for _ in range(3):
            kernel(table, LAYERS, h, g, out)
        torch.cuda.synchronize()
        report_trace(kernel)

    def projections(x, L):  # the product's verify projections (step_cost_probe --tree's "in_proj + out_proj only")
        dispatch.norm_linear(x, L["in_w"], None, 1, EPS)
        return dispatch.norm_linear(g[None], L["out_w"], None, 1, EPS, residual=x)

    outs = {k: torch.empty_like(h) for k in kernels}
    timed_rows("product: skinny in_proj + out_proj, 16 nodes (CUDA graph)",
               lambda: graph_us(projections, layers, h[None]), kernels,
               lambda k: f"streaming, tensor cores, {k.slots} slots", lambda k: k(table, LAYERS, h, g, outs[k]))
    print(f"in_proj + out_proj weights at the copy rate: {floor_us:.2f} us per layer")
    return 0


if __name__ == "__main__":
    with torch.cuda.stream(torch.cuda.Stream()):  # a real stream handle for CuPy (not the legacy 0)
        raise SystemExit(main())

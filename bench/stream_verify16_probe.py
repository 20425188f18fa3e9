"""Probe: a 16-node tree's verify layers as one persistent streaming kernel (bench/stream_verify16.cu)
against the product's verify kernels, at the mamba2-2.7b mixer shape.

64 layers of distinct random bf16 weights (step_cost_probe's `make_layer`: in_proj with the pre-norm
folded in, conv taps and bias, dt_bias, A, D, the cached conv inputs and SSM state), the tree
"3,2,1" (16 nodes). The product's verify layer is Mamba2Mixer.folded_residual_verify's four
launches: skinny in_proj (`norm_linear`), `tree_conv`, `tree_scan_gated`, skinny out_proj with the
residual add. The kernel is checked against them over 1 and 2 layers (in_proj's output, the conv's x
and B, dt, the gated g and the layer output), then both are timed over 64 layers in one process,
us per layer: the product as one CUDA graph, the kernel as one launch.

Run on the device from the bench directory:
    python3 stream_verify16_probe.py [--variants "PROJ_ONLY;NO_GRID_SYNC;N_SLOTS=3;Z_BESIDE"] [--trace ";PROJ_ONLY"]

Z_BESIDE (round 14) streams the gate's z rows on the CTAs without a head while the heads run M.
"""
from __future__ import annotations

import argparse
import math
import os

import numpy as np
import torch
from bench_decode import copy_bandwidth
from ssmspec.trees.tree import Tree
from step_cost_probe import D_INNER, D_MODEL, LAYERS, H, S, graph_us, make_layer
from stream_layers_probe import CubinKernel, rel, timed_rows

TREE, EPS, SLOTS = (3, 2, 1), 1e-5, 4
CONV = D_INNER + 2 * S
N_IN = D_INNER + CONV + H
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stream_verify16.cu")
FIELDS = ("in_w", "out_w", "conv_w", "conv_b", "dt_bias", "A", "D", "cs", "ss")  # the kernel's `VerifyLayer`
TRACE_N = 14
SPANS = (("fetch h (act landed - layer start)", 0, 1), ("in_proj slots", 1, 2), ("barrier 1 wait (+ M prefetch)", 2, 3),
         ("M phase (conv, scan, gate)", 3, 4), ("barrier 2 wait", 4, 5), ("out_proj + pair sums + residual", 5, 6),
         ("barrier 3 wait", 6, 7))


class VerifyKernel(CubinKernel):
    def __init__(self, nodes: int, defines: tuple[str, ...] = ()):
        # a variant may set the ring depth ("N_SLOTS=3"); the default is SLOTS
        self.slots = next((int(d.split("=")[1]) for d in defines if d.startswith("N_SLOTS=")), SLOTS)
        self.defines = defines
        row = D_MODEL * 2 + 64
        m_phase = (16 * 72 + 16 * 144 + 16 * 20 + 16 * 3 + 4 + 16 + 16 * 4) * 4 + (19 * 320 + 16 * 64 + 2 * 16 * 160 + 320 * 8) * 2
        smem = self.slots * 8 * row + (8 * 16 * 8 + 16 * 48 + 8 * 16 + 2 * 16) * 4 + m_phase + (2 * self.slots + 1) * 8
        super().__init__(SOURCE, "stream_verify16", (f"N_SLOTS={self.slots}",
                                                     *(d for d in defines if not d.startswith("N_SLOTS="))), smem)
        dev, bf = "cuda", torch.bfloat16
        # NaN-filled: a read before the write it should follow shows in the checks
        self.zx = torch.full((LAYERS, nodes, N_IN), float("nan"), device=dev, dtype=bf)
        self.x_conv = torch.full((LAYERS, nodes, D_INNER), float("nan"), device=dev, dtype=bf)
        self.b_conv = torch.full((LAYERS, nodes, S), float("nan"), device=dev, dtype=bf)
        self.dt = torch.full((LAYERS, nodes, H), float("nan"), device=dev)
        self.g = torch.full((nodes, D_INNER), float("nan"), device=dev, dtype=bf)
        self.hbuf = torch.full((2, nodes, D_MODEL), float("nan"), device=dev, dtype=bf)
        self.counter = torch.zeros(2, device=dev, dtype=torch.int32)  # grid barriers; Z_BESIDE's z rows
        self.trace = torch.zeros((LAYERS, self.ctas, TRACE_N), device=dev, dtype=torch.int64)

    @staticmethod
    def table(layers) -> torch.Tensor:
        return torch.tensor([[L[f].data_ptr() for f in FIELDS] for L in layers], dtype=torch.int64, device="cuda")

    def __call__(self, table, n_layers, parents, h, out):
        self.counter.zero_()
        self.launch(288, tuple(np.uint64(x.data_ptr()) if isinstance(x, torch.Tensor) else x for x in (
            table, np.int32(n_layers), parents, h, out, self.zx, self.x_conv, self.b_conv, self.dt, self.g, self.hbuf,
            self.counter, np.float32(EPS), np.float32(0.0), np.float32(np.inf), self.trace)))


def product_layer(parents, conv_launch: bool = True):
    """The product's folded verify of one layer (Mamba2Mixer.folded_residual_verify's launches) on a
    make_layer dict: h (1, N, D) -> (output, zx, conv, g, dt). conv_launch False: the scan reads the
    conv's inputs instead (timing only: what the tree conv's launch costs in the chain)."""
    from ssmspec.ops import dispatch

    def run(h, L):
        zx = dispatch.norm_linear(h, L["in_w"], None, 1, EPS)
        z, xBC, dt_raw = zx.split([D_INNER, CONV, H], dim=-1)
        conv = dispatch.tree_conv(xBC, L["cs"], L["conv_w"], L["conv_b"], parents) if conv_launch else xBC
        x, B, C = conv.split([D_INNER, S, S], dim=-1)
        g, dt = dispatch.tree_scan_gated(x.unflatten(-1, (H, D_INNER // H)), dt_raw, L["dt_bias"], 0.0, math.inf,
                                         L["A"], B.unflatten(-1, (1, S)), C.unflatten(-1, (1, S)), L["D"], z, parents,
                                         L["ss"])
        return dispatch.norm_linear(g, L["out_w"], None, 1, EPS, residual=h), zx, conv, g, dt

    return run


def report_trace(kernel: VerifyKernel) -> None:
    """Where a layer's time goes, from a TRACE build's stamps (us, layers 1..62, over CTAs)."""
    tr = kernel.trace.cpu().double().numpy()[1:-1] / 1000.0
    st = tr[:, :, :8]
    print(f"  trace {kernel.defines}:")
    for what, a, b in SPANS:
        d = st[:, :, b] - st[:, :, a]
        heads, rest = d[:, :H], d[:, H:]
        print(f"    {what:<38} mean {d.mean():6.2f}  max {d.max(1).mean():6.2f}  (CTAs with a head {heads.mean():6.2f}, "
              f"without {rest.mean():6.2f})")
    print(f"    {'layer (start to next start)':<38} mean {np.diff(st[:, :, 0], axis=0).mean():6.2f}")
    m = np.concatenate([st[:, :H, 3:4], tr[:, :H, 10:14], st[:, :H, 4:5]], axis=2)  # the head CTAs' M steps
    for k, what in enumerate(("fetch x, B, C, z, dt_raw", "conv + dt", "acum", "C.B, C.h0 (tensor cores)",
                              "W.x, gate, store g")):
        print(f"      M: {what:<30} mean {(m[:, :, k + 1] - m[:, :, k]).mean():6.2f}")
    for name, idx in (("barrier 1", 2), ("barrier 2", 4), ("barrier 3", 6)):
        arr = st[:, :, idx]
        print(f"    {name}: last arrival - median {(arr.max(1) - np.median(arr, 1)).mean():5.2f} us, first exit - last "
              f"arrival {(st[:, :, idx + 1].min(1) - arr.max(1)).mean():5.2f} us, last CTAs most often "
              f"{np.bincount(arr.argmax(1), minlength=tr.shape[1]).argsort()[::-1][:6].tolist()}")
    print(f"    producer per layer: ring full {tr[:, :, 8].mean():6.2f} us (heads {tr[:, :H, 8].mean():6.2f}), waiting "
          f"on the copy in flight {tr[:, :, 9].mean():6.2f} us", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="PROJ_ONLY",
                    help="';'-separated sets of build switches (joined by ',') timed beside the kernel, e.g. "
                         "'PROJ_ONLY;NO_GRID_SYNC' (PROJ_ONLY: no M phase, against the product's two projections)")
    ap.add_argument("--trace", default="", help="';'-separated switch sets to build with TRACE and report (e.g. ';PROJ_ONLY')")
    ap.add_argument("--base", default="", help="','-separated switches of the kernel that is checked (e.g. 'Z_BESIDE')")
    args = ap.parse_args()
    torch.manual_seed(0)
    from ssmspec.ops import dispatch

    dispatch.set_backend("triton")
    bw = copy_bandwidth()
    layers = [make_layer("cuda", torch.bfloat16) for _ in range(LAYERS)]
    for L in layers:
        L["A"] = -torch.exp(L["A_log"])
    tree = Tree.from_config(TREE)
    n = tree.num_nodes
    parents = tree.parents_tensor("cuda").to(torch.int32)
    h = torch.randn(1, n, D_MODEL, device="cuda", dtype=torch.bfloat16)
    table = VerifyKernel.table(layers)
    layer_ref = product_layer(parents.long())
    kernel = VerifyKernel(n, tuple(filter(None, args.base.split(","))))
    print(f"{torch.cuda.get_device_name()}; copy {bw / 1e12:.2f} TB/s; tree {TREE}, {n} nodes", flush=True)

    for n_layers in (1, 2):
        out = torch.empty_like(h[0])
        torch.cuda.synchronize()
        kernel(table, n_layers, parents, h[0], out)
        torch.cuda.synchronize()
        x = h
        for L in layers[:n_layers]:
            x, zx, conv, g, dt = layer_ref(x, L)
        last = n_layers - 1
        errs = {"zx": rel(kernel.zx[last], zx[0]), "x_conv": rel(kernel.x_conv[last], conv[0, :, :D_INNER]),
                "b_conv": rel(kernel.b_conv[last], conv[0, :, D_INNER:D_INNER + S]), "dt": rel(kernel.dt[last], dt[0]),
                "g": rel(kernel.g, g[0]), "output": rel(out, x[0])}
        print(f"  {n_layers} layer(s): rel err " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()), flush=True)
        if not all(v < 2e-2 for v in errs.values()):
            raise SystemExit("the streaming verify does not match the product's verify kernels")

    for spec in args.trace.split(";") if args.trace else ():
        traced = VerifyKernel(n, (*filter(None, spec.split(",")), "TRACE"))
        traced.g.normal_()
        out = torch.empty_like(h[0])
        for _ in range(3):
            traced(table, LAYERS, parents, h[0], out)
        torch.cuda.synchronize()
        report_trace(traced)

    kernels = [kernel] + [VerifyKernel(n, tuple(v.split(","))) for v in filter(None, args.variants.split(";"))]
    gated = torch.randn(1, n, D_INNER, device="cuda", dtype=torch.bfloat16)

    def projections(x, L):  # the product's two projections alone (PROJ_ONLY's counterpart)
        dispatch.norm_linear(x, L["in_w"], None, 1, EPS)
        return dispatch.norm_linear(gated, L["out_w"], None, 1, EPS, residual=x)

    for k in kernels:  # PROJ_ONLY reads a fixed g (the full kernel writes its own)
        k.g.copy_(gated[0])
    outs = {k: torch.empty_like(h[0]) for k in kernels}
    timed_rows("product: verify layer (in_proj, tree conv, gated scan, out_proj)",
               lambda: graph_us(lambda x, L: layer_ref(x, L)[0], layers, h), kernels,
               lambda k: f"streaming verify, {k.slots} slots", lambda k: k(table, LAYERS, parents, h[0], outs[k]))
    no_conv = product_layer(parents.long(), conv_launch=False)
    for rep in range(2):
        print(f"product without the tree conv's launch (timing only) [{rep}]: "
              f"{graph_us(lambda x, L: no_conv(x, L)[0], layers, h):.2f} us per layer; with it: "
              f"{graph_us(lambda x, L: layer_ref(x, L)[0], layers, h):.2f}", flush=True)
    print(f"product's two projections alone: {graph_us(projections, layers, h):.2f} us per layer; in_proj + out_proj "
          f"weights at the copy rate: {(N_IN * D_MODEL + D_MODEL * D_INNER) * 2 / bw * 1e6:.2f} us")
    return 0


if __name__ == "__main__":
    with torch.cuda.stream(torch.cuda.Stream()):  # a real stream handle for CuPy (not the legacy 0)
        raise SystemExit(main())

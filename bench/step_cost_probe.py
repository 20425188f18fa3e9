"""Where the batch-1 Mamba-2 sublayer's time goes beyond its weight stream (mamba2-2.7b shapes).

64 layers of distinct random bf16 weights (d_model 2560, H 80, P 64, S 128, G 1) in one CUDA graph
per variant, PDL on as in the decode step; each graph timed as bench_decode.py times a step
(median of CUDA-event intervals, a GPU spin before each) and divided by 64. Variants:

- layer: in_proj GEMV (norm_linear), the step kernel, out_proj with the gated norm and residual
  (ops/step_update mamba_step_out), as the folded model runs them;
- layer without the step's SSM state store (STORE_STATE False: wrong results, timing only);
- in_proj + out_proj only (out_proj reads a fixed gated vector: no step kernel);
- each launch alone in a chain of 64: in_proj GEMV, out_proj GEMV, step kernel + out_proj.

--tree 3,2,1: the same breakdown for the folded verify of a packed tree (Mamba2Mixer
`folded_residual_verify`: skinny in_proj, tree conv, gated tree scan, skinny out_proj), from real
mixer modules with random weights.

--inproj-configs: the layer with in_proj on persistent GEMV grids of a few programs per SM (its
last wave otherwise fills every warp slot, so the step and out_proj programs launched early
cannot sit beside it), and on 2 warps.

Run on the device from the bench directory: python3 step_cost_probe.py [--tree 3,2,1 | --inproj-configs]
"""
from __future__ import annotations

import argparse
import math

import torch

from bench_decode import copy_bandwidth, median_ms
from ssmspec.ops.gemv.triton import norm_linear
from ssmspec.ops.step_update import triton as SU

D_MODEL, H, P, S, G, K, LAYERS = 2560, 80, 64, 128, 1, 4, 64
D_INNER = H * P
CONV_DIM = D_INNER + 2 * G * S


def make_layer(dev, bf):
    n_in = 2 * D_INNER + 2 * G * S + H
    return {
        "in_w": (torch.randn(n_in, D_MODEL, device=dev) / math.sqrt(D_MODEL)).to(bf),
        "out_w": (torch.randn(D_MODEL, D_INNER, device=dev) / math.sqrt(D_INNER)).to(bf),
        "conv_w": (torch.randn(CONV_DIM, K, device=dev) / 2).to(bf), "conv_b": torch.randn(CONV_DIM, device=dev).to(bf),
        "dt_bias": torch.randn(H, device=dev), "A_log": torch.randn(H, device=dev), "D": torch.randn(H, device=dev),
        "cs": torch.randn(1, CONV_DIM, K - 1, device=dev).to(bf), "ss": torch.randn(1, H, P, S, device=dev) * 0.1,
        "proj": torch.randn(1, n_in, device=dev).to(bf), "gated": torch.randn(1, D_INNER, device=dev).to(bf),
    }


def step_out(L, proj, h):
    z, xBC, dt_raw = proj.split([D_INNER, CONV_DIM, H], dim=-1)
    return SU.mamba_step_out(xBC, dt_raw, z, L["cs"], L["ss"], L["conv_w"], L["conv_b"], L["dt_bias"], L["A_log"],
                             L["D"], None, G, 1, 0.0, math.inf, 1e-5, L["out_w"], None, residual=h)


def layer(h, L):
    return step_out(L, norm_linear(h, L["in_w"], None, 1, 1e-5), h)


def in_and_out_proj(h, L):
    norm_linear(h, L["in_w"], None, 1, 1e-5)
    return SU._launch_out_proj(L["gated"], L["proj"][:, D_INNER:D_INNER + CONV_DIM], L["cs"], L["out_w"], None, h, 1,
                               1e-5, G, S, K)


def in_proj_alone(h, L):
    return norm_linear(h, L["in_w"], None, 1, 1e-5)


def out_proj_alone(h, L):
    return SU._launch_out_proj(L["gated"], L["proj"][:, D_INNER:D_INNER + CONV_DIM], L["cs"], L["out_w"], None, h, 1,
                               1e-5, G, S, K)


def step_and_out_proj(h, L):
    return step_out(L, L["proj"], h)


@torch.no_grad()
def graph_us(layer_fn, layers, h) -> float:
    """us per layer of one CUDA graph of layer_fn(x, layer) over every layer (each output of the
    residual's shape is the next layer's input); layers may be layer dicts or indices."""
    def chain():
        x = h
        for L in layers:
            out = layer_fn(x, L)
            x = out if out.shape == h.shape else x
        return x

    chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    for _ in range(20):
        graph.replay()
    return median_ms(graph.replay, iters=100) * 1000 / len(layers)


def tree_rows(spec: str, bw: float) -> None:
    """The per-layer breakdown of the folded verify of one packed tree."""
    from ssmspec.models.config import MambaConfig
    from ssmspec.models.mamba2 import Mamba2Mixer
    from ssmspec.ops import dispatch
    from ssmspec.trees import Tree

    dispatch.set_backend("triton")
    tree = Tree.from_config(tuple(int(v) for v in spec.split(",")))
    n = tree.num_nodes
    cfg = MambaConfig(n_heads=H, head_dim=P, d_state=S, n_groups=G, conv_kernel=K)
    mixers, caches = [], []
    with torch.no_grad():
        for _ in range(LAYERS):
            m = Mamba2Mixer(D_MODEL, cfg).to("cuda", torch.bfloat16)
            m.A_log.data.uniform_(0, 2)
            mixers.append(m)
            caches.append(m.new_cache(1, "cuda", torch.bfloat16))
    parents = tree.parents_tensor("cuda")
    h = torch.randn(1, n, D_MODEL, device="cuda", dtype=torch.bfloat16)
    gated = torch.randn(1, n, D_INNER, device="cuda", dtype=torch.bfloat16)
    proj = torch.randn(1, n, 2 * D_INNER + 2 * G * S + H, device="cuda", dtype=torch.bfloat16)

    def layer(x, i):
        out, _, _ = mixers[i].folded_residual_verify(x, caches[i], parents, 1e-5)
        return out

    def projections(x, i):
        m = mixers[i]
        dispatch.norm_linear(x, m.in_proj.weight, None, 1, 1e-5)
        return dispatch.norm_linear(gated, m.out_proj.weight, None, 1, 1e-5, residual=x)

    def in_proj_alone(x, i):
        return dispatch.norm_linear(x, mixers[i].in_proj.weight, None, 1, 1e-5)

    def out_proj_alone(x, i):
        return dispatch.norm_linear(gated, mixers[i].out_proj.weight, None, 1, 1e-5, residual=x)

    def conv_and_scan(x, i):
        m, c = mixers[i], caches[i]
        z, xBC, dt_raw = proj.split([D_INNER, CONV_DIM, H], dim=-1)
        conv = dispatch.tree_conv(xBC, c.conv_state, m.conv_weight, m.conv1d.bias, parents)
        xs, Bs, Cs = m._split_conv_out(conv)
        return dispatch.tree_scan_gated(xs, dt_raw, m.dt_bias, 0.0, math.inf, m.A, Bs, Cs, m.D, z, parents,
                                        c.ssm_state)[0]

    rows = []
    for rep in range(2):
        for what, fn in (("verify layer (in_proj, conv, scan, out_proj)", layer), ("in_proj + out_proj only", projections),
                         ("in_proj alone", in_proj_alone), ("out_proj alone", out_proj_alone),
                         ("tree conv + gated scan alone", conv_and_scan)):
            rows.append((f"{what} [{rep}]", graph_us(fn, range(LAYERS), h)))
            print(f"  {rows[-1][0]:<52} {rows[-1][1]:7.2f} us", flush=True)
    print(f"\n{n}-node tree {spec}: per layer (64 layers per graph)")
    for what, us in rows:
        print(f"{what:<56} {us:7.2f}")


def print_rows(rows) -> None:
    """The (what, us per layer) rows as a table, after the timings."""
    width = max(56, *(len(what) for what, _ in rows))
    print(f"\n{'per layer (64 layers per graph)':<{width}} {'us':>7}")
    for what, us in rows:
        print(f"{what:<{width}} {us:7.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inproj-configs", action="store_true",
                    help="the layer with in_proj GEMV grids that leave warp slots for the step and out_proj")
    ap.add_argument("--tree", default=None, help="breakdown of a packed tree's verify instead (e.g. 3,2,1)")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.tree:
        tree_rows(args.tree, copy_bandwidth())
        return 0
    dev, bf = "cuda", torch.bfloat16
    bw = copy_bandwidth()
    layers = [make_layer(dev, bf) for _ in range(LAYERS)]
    h = torch.randn(1, D_MODEL, device=dev, dtype=bf)
    in_us = layers[0]["in_w"].numel() * 2 / bw * 1e6
    out_us = layers[0]["out_w"].numel() * 2 / bw * 1e6
    state_us = layers[0]["ss"].numel() * 4 * 2 / bw * 1e6
    print(f"{torch.cuda.get_device_name()}; copy {bw / 1e12:.2f} TB/s; at that rate per layer: in_proj {in_us:.1f} us, "
          f"out_proj {out_us:.1f} us, SSM state read + write {state_us:.1f} us", flush=True)
    rows = []

    def row(what, fn):
        rows.append((what, graph_us(fn, layers, h)))
        print(f"  {what:<52} {rows[-1][1]:7.2f} us", flush=True)

    if args.inproj_configs:  # in_proj GEMV configs that leave warp slots for the step and out_proj
        from ssmspec.ops.gemv import triton as GV

        n_in = layers[0]["in_w"].shape[0]
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        configs = [("default (1 row, 4 warps, all rows' programs)", None)]
        for warps, per_sm in ((4, 8), (4, 10), (4, 12), (2, 16), (2, 24), (2, 32)):
            configs.append((f"persistent, {per_sm} programs per SM x {warps} warps",
                            GV.GemvConfig(1, 0, warps, 1, per_sm * sms, False, True)))
        configs.append(("1 row, 2 warps, all rows' programs", GV.GemvConfig(1, 0, 2, preload=True)))
        for rep in range(2):
            for what, cfg in configs:
                GV.TUNED.pop((n_in, D_MODEL), None)
                if cfg is not None:
                    GV.TUNED[(n_in, D_MODEL)] = cfg
                row(f"layer, in_proj {what} [{rep}]", layer)
            GV.TUNED.pop((n_in, D_MODEL), None)
        print_rows(rows)
        return 0
    for rep in range(2):
        row(f"layer (in_proj, step, out_proj) [{rep}]", layer)
        SU.STORE_STATE = False
        row(f"layer, step without its state store (wrong values) [{rep}]", layer)
        SU.STORE_STATE = True
        row(f"in_proj + out_proj, no step kernel [{rep}]", in_and_out_proj)
        row(f"in_proj GEMV alone [{rep}]", in_proj_alone)
        row(f"out_proj GEMV alone [{rep}]", out_proj_alone)
        row(f"step kernel + out_proj [{rep}]", step_and_out_proj)
    print_rows(rows)
    print(f"floors at the copy rate: in_proj {in_us:.2f}, out_proj {out_us:.2f}, state {state_us:.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

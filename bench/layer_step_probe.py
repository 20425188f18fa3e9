"""Per-layer GPU time of the folded Mamba-2 sublayer's launches at batch 1, fused against unfused.

64 layers of distinct random bf16 weights at the mamba2-2.7b mixer shape (d_model 2560, H 80,
P 64, S 128, G 1) go into one CUDA graph per variant (PDL on, as the decode step runs them);
each graph is timed as bench_decode.py times a step (median of CUDA-event intervals with a GPU
spin before each) and divided by 64. Variants:

- unfused layer: in_proj GEMV (norm_linear), the step kernel, out_proj (ops/step_update);
- fused layer, per (BLOCK_P, warps, programs per SM): in_proj with the step inside, out_proj (ops/layer_step);
- the first launches alone: the in_proj GEMV, and the fused in_proj + step kernel, also with
  its head programs not waiting for the B/C/dt programs (WAIT False: wrong values, timing only).

Run on the device from the repository root: python3 bench/layer_step_probe.py
"""
from __future__ import annotations

import argparse
import math

import torch

from bench_decode import copy_bandwidth, median_ms
from ssmspec.ops.gemv.triton import norm_linear
from ssmspec.ops.layer_step import triton as LS
from ssmspec.ops.step_update.triton import mamba_step_out

D_MODEL, H, P, S, G, K, LAYERS = 2560, 80, 64, 128, 1, 4, 64


def make_layer(dev, bf):
    d_inner = H * P
    channels, n_in = d_inner + 2 * G * S, 2 * d_inner + 2 * G * S + H
    return {
        "in_w": (torch.randn(n_in, D_MODEL, device=dev) / math.sqrt(D_MODEL)).to(bf),
        "out_w": (torch.randn(D_MODEL, d_inner, device=dev) / math.sqrt(d_inner)).to(bf),
        "conv_w": (torch.randn(channels, K, device=dev) / 2).to(bf), "conv_b": torch.randn(channels, device=dev).to(bf),
        "dt_bias": torch.randn(H, device=dev), "A_log": torch.randn(H, device=dev), "D": torch.randn(H, device=dev),
        "cs": torch.randn(1, channels, K - 1, device=dev).to(bf), "ss": torch.randn(1, H, P, S, device=dev) * 0.1,
    }


def fused(h, L):
    return LS.mamba_layer_step(h, L["in_w"], None, 1e-5, L["cs"], L["ss"], L["conv_w"], L["conv_b"], L["dt_bias"],
                               L["A_log"], L["D"], G, 1, 0.0, math.inf, 1e-5, L["out_w"], None)


def unfused(h, L):
    z, xBC, dt_raw = norm_linear(h, L["in_w"], None, 1, 1e-5).split([H * P, H * P + 2 * G * S, H], dim=-1)
    return mamba_step_out(xBC, dt_raw, z, L["cs"], L["ss"], L["conv_w"], L["conv_b"], L["dt_bias"], L["A_log"], L["D"],
                          None, G, 1, 0.0, math.inf, 1e-5, L["out_w"], None, residual=h)


def in_proj_only(h, L):
    return norm_linear(h, L["in_w"], None, 1, 1e-5)


def in_proj_step_only(h, L):
    return LS.in_proj_step(h, L["in_w"], None, 1e-5, L["cs"], L["ss"], L["conv_w"], L["conv_b"], L["dt_bias"],
                           L["A_log"], L["D"], G, 0.0, math.inf)


def graph_us(layer_fn, layers, h) -> float:
    """us per layer of a CUDA graph running layer_fn over every layer, each layer's output the next one's input
    where it is the residual stream (whole layers), the same h otherwise."""
    def chain():
        x = h
        for L in layers:
            out = layer_fn(x, L)
            x = out if out.shape == h.shape else h
        return x

    chain()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    for _ in range(20):
        graph.replay()
    return median_ms(graph.replay, iters=100) * 1000 / len(layers)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="2,2,20;1,2,40;1,4,40",
                    help="fused kernel configs BLOCK_P,warps,programs per SM separated by ';'")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    bw = copy_bandwidth()
    layers = [make_layer(dev, bf) for _ in range(LAYERS)]
    h = torch.randn(1, D_MODEL, device=dev, dtype=bf)
    in_bytes = layers[0]["in_w"].numel() * 2
    out_bytes = layers[0]["out_w"].numel() * 2
    state_bytes = layers[0]["ss"].numel() * 4 * 2
    print(f"{torch.cuda.get_device_name()}; copy {bw / 1e12:.2f} TB/s; per layer at that rate: in_proj "
          f"{in_bytes / bw * 1e6:.1f} us, out_proj {out_bytes / bw * 1e6:.1f} us, state read+write {state_bytes / bw * 1e6:.1f} us",
          flush=True)
    rows = [("unfused layer (GEMV, step, out_proj)", graph_us(unfused, layers, h)),
            ("in_proj GEMV alone", graph_us(in_proj_only, layers, h))]
    for r in rows:
        print(f"  {r[0]:<48} {r[1]:7.2f} us", flush=True)
    saved = LS.BLOCK_P, LS.NUM_WARPS, LS.PROGRAMS_PER_SM
    for spec in args.configs.split(";"):
        LS.BLOCK_P, LS.NUM_WARPS, LS.PROGRAMS_PER_SM = (int(v) for v in spec.split(","))
        for what, fn in (("fused layer", fused), ("fused in_proj+step alone", in_proj_step_only)):
            rows.append((f"{what} P{LS.BLOCK_P} w{LS.NUM_WARPS} x{LS.PROGRAMS_PER_SM}", graph_us(fn, layers, h)))
            print(f"  {rows[-1][0]:<48} {rows[-1][1]:7.2f} us", flush=True)
        if spec == args.configs.split(";")[0]:
            LS.WAIT = False
            rows.append((f"  same, not waiting (wrong values) P{LS.BLOCK_P} w{LS.NUM_WARPS}",
                         graph_us(in_proj_step_only, layers, h)))
            print(f"  {rows[-1][0]:<48} {rows[-1][1]:7.2f} us", flush=True)
            LS.WAIT = True
            LS.TICKET = False
            rows.append((f"  same, roles by program id P{LS.BLOCK_P} w{LS.NUM_WARPS}", graph_us(fused, layers, h)))
            print(f"  {rows[-1][0]:<48} {rows[-1][1]:7.2f} us", flush=True)
            LS.TICKET = True
            LS.TAIL = False
            rows.append((f"  same, dot products only (wrong values) P{LS.BLOCK_P} w{LS.NUM_WARPS}",
                         graph_us(in_proj_step_only, layers, h)))
            print(f"  {rows[-1][0]:<48} {rows[-1][1]:7.2f} us", flush=True)
            LS.TICKET = False
            rows.append((f"  same, dot products only, no ticket P{LS.BLOCK_P} w{LS.NUM_WARPS}",
                         graph_us(in_proj_step_only, layers, h)))
            print(f"  {rows[-1][0]:<48} {rows[-1][1]:7.2f} us", flush=True)
            LS.TICKET, LS.TAIL = True, True
    LS.BLOCK_P, LS.NUM_WARPS, LS.PROGRAMS_PER_SM = saved
    rows.append(("unfused layer, again", graph_us(unfused, layers, h)))
    print(f"\n{'per layer (64 layers per graph)':<50} {'us':>7} {'x unfused':>9}")
    for what, us in rows:
        print(f"{what:<50} {us:7.2f} {us / rows[0][1]:9.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

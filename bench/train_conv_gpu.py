"""The training conv + SiLU on a GPU: forward and backward of one layer, walks side by side, the best each way printed last.

`ops/causal_conv/triton.py`'s training kernels at each walk below (`FORWARD_WINDOW` and
`BACKWARD_WINDOW`: tokens and channels a program walks, its warps; a row sets both), at the layers
the training benchmarks run: xBC a slice of the in_proj output, as in the model (mamba2-130m: 16 x
512 x 1792 in rows of 3352; 1.3b: 16 x 512 x 4352 in rows of 8512), bf16. Each row: medians of CUDA-graph replays (triton.testing) of the
forward and of the backward, the bytes they must move over the time (GB/s; a copy's for scale), and
the largest difference of y, dx, dw, db to the plain-torch reference (fp32 autograd through
`naive_causal_conv`). From the repository root, with ssmspec installed:

    python bench/train_conv_gpu.py --out train_conv_gpu.json
"""
from __future__ import annotations

import torch

from _one_layer import parse_args, replayed, write_rows  # bench/ is the script's directory: on sys.path

LAYERS = {"130m": (16, 512, 1792, 3352, 24), "1.3b": (16, 512, 4352, 8512, 64)}  # batch, tokens, channels, row, heads
WALKS = [(64, 256, 4), (32, 256, 4), (16, 256, 4), (8, 256, 4), (32, 128, 4), (16, 128, 4), (64, 256, 8),
         (16, 512, 8)]  # (tokens, channels, warps)


def layer_inputs(batch, steps, channels, width, heads):
    g = torch.Generator(device="cuda").manual_seed(0)
    proj = torch.randn(batch, steps, width, device="cuda", generator=g).bfloat16()
    x = proj[..., width - channels - heads: width - heads]  # [z | xBC | dt]: dt is the last `heads` columns
    w = (0.5 * torch.randn(channels, 4, device="cuda", generator=g)).bfloat16()
    b = (0.3 * torch.randn(channels, device="cuda", generator=g)).bfloat16()
    gy = torch.randn(batch, steps, channels, device="cuda", generator=g).bfloat16()
    return x, w, b, gy


def main() -> None:
    args = parse_args(__doc__, "train_conv_gpu.py")

    import ssmspec.ops.causal_conv.triton as CC
    from ssmspec.ops.causal_conv.naive import naive_causal_conv

    def copy_gbps(x):  # a strided read and a contiguous write of x's size, for scale
        out = torch.empty(x.shape, device="cuda", dtype=x.dtype)
        return 2 * x.numel() * x.element_size() / replayed(lambda: out.copy_(x), args.rep_ms) / 1e6

    defaults = CC.FORWARD_WINDOW, CC.BACKWARD_WINDOW
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| layer | kernels | fwd ms | bwd ms | fwd GB/s | bwd GB/s | copy GB/s | max diff y, dx, dw, db |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    rows = []
    for layer, shape in LAYERS.items():
        x, w, b, gy = layer_inputs(*shape)
        xr, wr, br = (t.float().requires_grad_() for t in (x, w, b))
        want_y = naive_causal_conv(xr, None, wr, br)
        want = [want_y, *torch.autograd.grad(want_y, (xr, wr, br), gy.float())]
        nbytes = x.numel() * x.element_size()
        copy = copy_gbps(x)
        for walk in WALKS:
            CC.FORWARD_WINDOW = CC.BACKWARD_WINDOW = walk
            name = f"walk {walk}"
            try:
                fwd = replayed(lambda: CC._train_forward(x, w, b), args.rep_ms)
                bwd = replayed(lambda: CC._train_backward(gy, x, w, b), args.rep_ms)
            except Exception as err:  # a tiling this GPU cannot run (registers, shared memory): say so, go on
                print(f"| {layer} | {name} | failed: {type(err).__name__}: {str(err)[:120]} |", flush=True)
                continue
            got = [CC._train_forward(x, w, b), *CC._train_backward(gy, x, w, b)]
            diff = ", ".join(f"{(g.float() - r.float()).abs().max().item():.2e}" for g, r in zip(got, want))
            row = {"layer": layer, "kernels": name, "fwd_ms": fwd, "bwd_ms": bwd, "fwd_gbps": 2 * nbytes / fwd / 1e6,
                   "bwd_gbps": 3 * nbytes / bwd / 1e6, "copy_gbps": copy, "max_diff": diff}
            rows.append(row)
            print(f"| {layer} | {name} | {fwd:.4f} | {bwd:.4f} | {row['fwd_gbps']:.0f} | {row['bwd_gbps']:.0f} | "
                  f"{copy:.0f} | {diff} |", flush=True)
    CC.FORWARD_WINDOW, CC.BACKWARD_WINDOW = defaults
    for layer in LAYERS:  # the best walk each way, the pair the module's windows should be
        mine = [r for r in rows if r["layer"] == layer]
        if mine:
            fwd, bwd = min(mine, key=lambda r: r["fwd_ms"]), min(mine, key=lambda r: r["bwd_ms"])
            print(f"{layer}: forward best at {fwd['kernels']} ({fwd['fwd_ms']:.4f} ms), backward at {bwd['kernels']} "
                  f"({bwd['bwd_ms']:.4f} ms); the module has {defaults[0]} / {defaults[1]}")
    write_rows(args.out, rows)


if __name__ == "__main__":
    main()

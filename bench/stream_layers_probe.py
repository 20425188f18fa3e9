"""Probe: the persistent weight-streaming layer kernel (ssmspec/ops/stream_layers/kernel.cu) against
the product's three launches per layer.

64 layers of distinct random bf16 weights at the mamba2-2.7b mixer shape (step_cost_probe's
`make_layer`). The kernel is built alone with nvcc for sm_90a, once per set of its -D switches
(seconds each, against the model path's torch extension build), and launched through CuPy (on
the GPU machine; not a dependency of ssmspec). It first checks the kernel against the
product's kernels (`step_cost_probe.layer`: in_proj GEMV, step, out_proj) over 1 and 4 layers
from the same states, then times 64 layers: the product's chain in one CUDA graph, and one
launch of the streaming kernel (plus the memset of its barrier counter), us per layer, in one
process. The ring depth (shared-memory slots of 40 KB) is a build option.

Run on the device from the bench directory: python3 stream_layers_probe.py [--slots "5;5:IN_FLIGHT=0"]
    [--timing-variants "NO_STEP;NO_GRID_SYNC;NO_STEP,NO_GRID_SYNC"]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

import numpy as np
import torch
from bench_decode import copy_bandwidth, median_ms
from step_cost_probe import (
    D_INNER,
    D_MODEL,
    LAYERS,
    H,
    S,
    graph_us,
    layer,
    make_layer,
    print_rows,
)

KERNEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ssmspec", "ops", "stream_layers", "kernel.cu")
SLOT_BYTES = 8 * D_MODEL * 2
FIELDS = ("in_w", "out_w", "conv_w", "conv_b", "dt_bias", "A_log", "D", "cs", "ss")  # the kernel's `Layer`


class CubinKernel:
    """A kernel built alone with nvcc for sm_90a (each -D switch set its own cubin, in seconds) and
    launched through CuPy on torch's current stream."""

    def __init__(self, source: str, name: str, defines: tuple[str, ...], smem: int):
        import cupy as cp

        self.cp, self.smem = cp, smem
        cubin = os.path.join(tempfile.mkdtemp(), f"{name}.cubin")
        subprocess.run(["nvcc", "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-diag-suppress", "177,550",
                        f"-I{os.path.dirname(KERNEL)}", *(f"-D{d}" for d in defines), "-o", cubin, source], check=True)
        self.module = cp.RawModule(path=cubin)  # held: a freed module is unloaded under its function
        self.fn = self.module.get_function(name)
        self.fn.max_dynamic_shared_size_bytes = smem
        self.ctas = torch.cuda.get_device_properties(0).multi_processor_count

    def launch(self, threads: int, args: tuple) -> None:
        assert torch.cuda.current_stream().cuda_stream != 0
        with self.cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            self.fn((self.ctas,), (threads,), args, shared_mem=self.smem)


class StreamKernel(CubinKernel):
    """kernel.cu built with `slots` ring slots."""

    def __init__(self, slots: int, defines: tuple[str, ...] = ()):
        self.slots, self.defines = slots, defines
        # make_layer's dt_bias, A_log and D are fp32
        super().__init__(KERNEL, "stream_layers", (f"N_SLOTS={slots}", "PARAM_T=float", *defines),
                         slots * SLOT_BYTES + (2 * S + 64 + 4 * 64) * 4 + 3 * slots * 8)
        if -(-D_MODEL // self.ctas) > 32 or -(-D_INNER // self.ctas) * S * 4 > SLOT_BYTES:
            raise ValueError("the kernel holds at most 32 out_proj rows and one slot of state rows per CTA")
        dev = "cuda"
        # NaN-filled: a read before the write it should follow shows in the checks
        self.zx = torch.full((2 * D_INNER + 2 * S + H,), float("nan"), device=dev, dtype=torch.bfloat16)
        self.g = torch.full((D_INNER,), float("nan"), device=dev, dtype=torch.bfloat16)
        self.hbuf = torch.full((2, D_MODEL), float("nan"), device=dev, dtype=torch.bfloat16)
        self.counter = torch.zeros(1, device=dev, dtype=torch.int32)

    def table(self, layers) -> torch.Tensor:
        """The device array of `Layer` structs (nine pointers each)."""
        ptrs = [[L[f].data_ptr() for f in FIELDS] for L in layers]
        return torch.tensor(ptrs, dtype=torch.int64, device="cuda")

    def __call__(self, table: torch.Tensor, n_layers: int, h: torch.Tensor, out: torch.Tensor) -> None:
        self.counter.zero_()
        args = (np.uint64(table.data_ptr()), np.int32(n_layers), np.uint64(h.data_ptr()), np.uint64(out.data_ptr()),
                np.uint64(self.zx.data_ptr()), np.uint64(self.g.data_ptr()), np.uint64(self.hbuf.data_ptr()),
                np.uint64(self.counter.data_ptr()), np.float32(1e-5), np.float32(1e-5), np.float32(0.0),
                np.float32(np.inf), np.uint64(0), np.uint64(0), np.int32(0), np.float32(0.0), np.uint64(0))  # no LM head
        self.launch(288, args)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def timed_rows(product_label: str, product_us, kernels, label, run) -> None:
    """Two rounds in one process, each timing the product (product_us() -> us per layer), then
    run(kernel) for every kernel (one launch of LAYERS layers, median of 50); prints the table."""
    rows = []

    def add(what: str, us: float) -> None:
        rows.append((what, us))
        print(f"  {what:<60} {us:7.2f} us", flush=True)

    for rep in range(2):
        add(f"{product_label} [{rep}]", product_us())
        for kernel in kernels:
            us = median_ms(lambda k=kernel: run(k), iters=50) * 1000 / LAYERS
            add(label(kernel) + "".join(f", {d}" for d in kernel.defines) + f" [{rep}]", us)
    print_rows(rows)


def check(kernel: StreamKernel, layers, h, n: int) -> None:
    """n layers through the product's kernels and through the streaming kernel, from copies of
    the same states; prints the relative errors of the output and the last layer's states."""
    def copies():
        return [{**L, "cs": L["cs"].clone(), "ss": L["ss"].clone()} for L in layers[:n]]

    ref_layers, ours = copies(), copies()
    x = h
    for L in ref_layers:
        x = layer(x, L)
    out = torch.empty_like(h)
    table = kernel.table(ours)
    torch.cuda.synchronize()
    kernel(table, n, h, out)
    torch.cuda.synchronize()
    errs = (rel(out, x), rel(ours[-1]["ss"], ref_layers[-1]["ss"]), rel(ours[-1]["cs"], ref_layers[-1]["cs"]))
    print(f"  {n} layer(s), {kernel.slots} slots {kernel.defines}: rel err output {errs[0]:.2e}, SSM state {errs[1]:.2e}, "
          f"conv state {errs[2]:.2e}", flush=True)
    if not (errs[0] < 2e-2 and errs[1] < 1e-2 and errs[2] < 1e-2):
        for name, a, b in (("out", out, x), ("ss", ours[-1]["ss"], ref_layers[-1]["ss"]),
                           ("cs", ours[-1]["cs"], ref_layers[-1]["cs"])):
            print(f"    {name}: finite ours {a.float().isfinite().float().mean().item():.5f} "
                  f"ref {b.float().isfinite().float().mean().item():.5f}; bad at "
                  f"{(~a.float().isfinite()).flatten().nonzero().flatten()[:8].tolist()}", flush=True)
        raise SystemExit("the streaming kernel does not match the product's kernels")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", default="5;4;5:IN_FLIGHT=0",
                    help="';'-separated ring depths to build, check and time, each with optional build switches "
                         "after a colon (e.g. 5:IN_FLIGHT=0)")
    ap.add_argument("--timing-variants", default="",
                    help="';'-separated sets of the kernel's timing-only switches (wrong results), e.g. "
                         "'NO_DOT;NO_STEP;NO_GRID_SYNC;NO_DOT,NO_STEP,NO_GRID_SYNC', built with the first --slots")
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth()
    layers = [make_layer("cuda", torch.bfloat16) for _ in range(LAYERS)]
    h = torch.randn(1, D_MODEL, device="cuda", dtype=torch.bfloat16)
    floor_us = (layers[0]["in_w"].numel() * 2 + layers[0]["out_w"].numel() * 2 + layers[0]["ss"].numel() * 8) / bw * 1e6
    print(f"{torch.cuda.get_device_name()}; copy {bw / 1e12:.2f} TB/s; weights + state read and write per layer at "
          f"that rate {floor_us:.1f} us", flush=True)
    kernels = []
    for spec in args.slots.split(";"):  # "5" or "5:IN_FLIGHT=1"
        slots, _, defines = spec.partition(":")
        kernels.append(StreamKernel(int(slots), tuple(filter(None, defines.split(",")))))
    for kernel in kernels:
        for n in (1, 4):
            check(kernel, layers, h, n)
    for variant in filter(None, args.timing_variants.split(";")):
        kernels.append(StreamKernel(kernels[0].slots, tuple(variant.split(","))))
    args_of = {k: (k.table(layers), torch.empty_like(h)) for k in kernels}
    timed_rows("product: in_proj GEMV, step, out_proj (CUDA graph)", lambda: graph_us(layer, layers, h), kernels,
               lambda k: f"streaming, {k.slots} slots of 40 KB", lambda k: k(args_of[k][0], LAYERS, h, args_of[k][1]))
    print(f"at the copy rate (weights + state): {floor_us:.2f} us per layer")
    return 0


if __name__ == "__main__":
    with torch.cuda.stream(torch.cuda.Stream()):  # a real stream handle for CuPy (not the legacy 0)
        raise SystemExit(main())

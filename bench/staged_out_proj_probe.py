"""Probe (not product code): the AR out_proj with its weights staged in shared memory before its PDL wait.

Round 10 measured that, in the batch-1 Mamba-2 layer, the step kernel's ~5 us between in_proj and
out_proj leaves the memory bus mostly idle: out_proj's programs may preload weights before their
PDL wait, but only into registers, and the registers of an SM hold little beside the kernels still
running (docs/BENCHMARKS.md, "Round 10"). Shared memory (228 KB per SM, ~30 MB on an H100) is
unused by every AR kernel. This probe writes out_proj in Gluon (Triton's explicit-layout dialect):
each program issues asynchronous copies (cp.async) of its whole weight slab into shared memory,
then waits on the step kernel, then computes from shared memory. It is timed against the
product's Triton GEMV inside the same 64-layer chains as bench/step_cost_probe.py.

The staged kernel does what `ops/step_update._launch_out_proj`'s GEMV does (the gated norm's
1/rms from the gated values' sum of squares, the residual add in its epilogue), except the step's
deferred B/C conv-state shift (timing only; the outputs are checked against the product's).

Run on the device from the bench directory: python3 staged_out_proj_probe.py
"""
from __future__ import annotations

import torch
import triton
from bench_decode import copy_bandwidth
from step_cost_probe import (
    D_MODEL,
    LAYERS,
    graph_us,
    in_proj_alone,
    layer,
    make_layer,
    out_proj_alone,
    print_rows,
    step_and_out_proj,
)
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from ssmspec.ops.step_update import triton as SU

# Gluon's names moved between Triton 3.6 (the device) and 3.9
_COPY = async_copy.async_load if hasattr(async_copy, "async_load") else async_copy.async_copy_global_to_shared
_CTA_BARRIER = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier


@gluon.jit
def _ptx(asm: gl.constexpr, dummy):
    """One PTX instruction with side effects (griddepcontrol), emitted through inline asm."""
    gl.inline_asm_elementwise(asm, "=r,r", [dummy], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _slot(a, b, c, s: gl.constexpr, NA: gl.constexpr, NB: gl.constexpr):
    """Slot s of a slab split over three shared buffers of power-of-two lengths NA, NB, NC (shared
    memory shapes must be powers of two; 25 or 50 slots are not)."""
    if s < NA:
        return a.index(s)
    elif s < NA + NB:
        return b.index(s - NA)
    else:
        return c.index(s - NA - NB)


@gluon.jit
def _staged_out_proj_kernel(g_ptr, w_ptr, res_ptr, y_ptr, K, swn, eps,
                            RB: gl.constexpr, NRB: gl.constexpr, KC: gl.constexpr, NKC: gl.constexpr,
                            NA: gl.constexpr, NB: gl.constexpr, NC: gl.constexpr, USE_PDL: gl.constexpr,
                            WARPS: gl.constexpr):
    # tile [RB, KC]: 8 bf16 (16 bytes, one cp.async) per thread and step
    L: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [RB, WARPS // RB], [1, 0])
    S: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])  # of one [RB, KC] slot
    pid = gl.program_id(0)
    if USE_PDL:
        _ptx("griddepcontrol.launch_dependents; mov.u32 $0, 0;", pid)
    row0 = pid * (RB * NRB)
    offs_r = gl.arange(0, RB, layout=gl.SliceLayout(1, L))
    offs_k = gl.arange(0, KC, layout=gl.SliceLayout(0, L))
    buf_a = gl.allocate_shared_memory(gl.bfloat16, [NA, RB, KC], S)
    buf_b = gl.allocate_shared_memory(gl.bfloat16, [NB, RB, KC], S)
    buf_c = gl.allocate_shared_memory(gl.bfloat16, [NC, RB, KC], S)
    # the whole slab (RB * NRB rows x K) in flight before the wait: weights are never written
    for rb in gl.static_range(NRB):
        for kc in gl.static_range(NKC):
            ptrs = w_ptr + (row0 + rb * RB + offs_r)[:, None] * swn + (kc * KC + offs_k)[None, :]
            _COPY(_slot(buf_a, buf_b, buf_c, rb * NKC + kc, NA, NB), ptrs)
    async_copy.commit_group()
    if USE_PDL:
        _ptx("griddepcontrol.wait; mov.u32 $0, 0;", pid)
    ss = gl.zeros([KC], gl.float32, gl.SliceLayout(0, L))
    for kc in gl.static_range(NKC):
        xk = gl.load(g_ptr + kc * KC + offs_k).to(gl.float32)
        ss += xk * xk
    rstd = gl.rsqrt(gl.sum(ss, axis=0) / K + eps)
    async_copy.wait_group(0)
    _CTA_BARRIER()  # every thread's copies, not only this thread's, are in shared memory
    for rb in gl.static_range(NRB):
        acc = gl.zeros([RB, KC], gl.float32, L)
        for kc in gl.static_range(NKC):
            xk = gl.load(g_ptr + kc * KC + offs_k).to(gl.float32)
            w = _slot(buf_a, buf_b, buf_c, rb * NKC + kc, NA, NB).load(L)
            acc += w.to(gl.float32) * xk[None, :]
        rows = row0 + rb * RB + offs_r
        y = (gl.sum(acc, axis=1) * rstd).to(gl.bfloat16).to(gl.float32)
        out = gl.load(res_ptr + rows).to(gl.float32) + y
        gl.store(y_ptr + rows, out.to(gl.bfloat16))


def _three_powers(n: int) -> tuple[int, int, int]:
    """n as a + b + c, powers of two, largest first (c may repeat b's bit when n has more bits)."""
    bits = [1 << i for i in range(n.bit_length() - 1, -1, -1) if n >> i & 1]
    if len(bits) > 3:
        raise ValueError(f"{n} slots need more than three power-of-two buffers")
    bits += [1] * (3 - len(bits))  # unused buffers still need a (small) allocation
    return tuple(bits)


CONFIG = {"rows": 10, "warps": 4}
VARIANTS = [(10, 4), (10, 8), (5, 4), (20, 8)]
"""(rows per program, warps): 256 programs of 100 KB (two per SM), 512 of 50 KB, 128 of 200 KB."""


def staged_out_proj(gated, w, residual, eps=1e-5, rows=None, warps=None):
    """y = residual + out_proj(gated normalised); gated (1, K) bf16, w (N, K) bf16 (norm weight folded)."""
    n, k = w.shape
    rows, warps = rows or CONFIG["rows"], warps or CONFIG["warps"]
    rb = 2 if rows % 2 == 0 else 1
    kc = 1024  # one [rb, kc] slot; the layout spans 8 * 32 * warps // rb columns (512-1024 in VARIANTS)
    if k % kc or n % rows:
        raise ValueError(f"staged_out_proj: shape {(n, k)} / {rows} rows per program not supported")
    y = torch.empty(1, n, device=w.device, dtype=torch.bfloat16)
    na, nb, nc = _three_powers(rows // rb * (k // kc))
    _staged_out_proj_kernel[(n // rows,)](
        gated, w, residual.reshape(n), y, k, w.stride(0), float(eps),
        RB=rb, NRB=rows // rb, KC=kc, NKC=k // kc, NA=na, NB=nb, NC=nc, USE_PDL=True, WARPS=warps,
        num_warps=warps, launch_pdl=True,
    )
    return y


def _launch_staged(gated, xBC, conv_state, out_weight, out_bias, residual, norm_groups, eps, n_groups, d_state,
                   kernel_size):
    return staged_out_proj(gated, out_weight, residual, eps)


def out_proj_alone_staged(h, L):
    return staged_out_proj(L["gated"], L["out_w"], h)


def main() -> int:
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    bw = copy_bandwidth()
    layers = [make_layer(dev, bf) for _ in range(LAYERS)]
    h = torch.randn(1, D_MODEL, device=dev, dtype=bf)
    out_us = layers[0]["out_w"].numel() * 2 / bw * 1e6
    print(f"{torch.cuda.get_device_name()}, triton {triton.__version__}; copy {bw / 1e12:.2f} TB/s; out_proj at that "
          f"rate {out_us:.2f} us", flush=True)
    # correctness against the product's out_proj (same gated input, same residual)
    for rows, warps in VARIANTS:
        got = staged_out_proj(layers[0]["gated"], layers[0]["out_w"], h, rows=rows, warps=warps).float()
        want = out_proj_alone(h, layers[0]).float()
        rel = ((got - want).norm() / (want - h.float()).norm()).item()
        print(f"staged ({rows} rows per program, {warps} warps) vs product out_proj: rel err of the projection "
              f"{rel:.2e}", flush=True)
        assert rel < 1e-2, rel
    product_launch = SU._launch_out_proj
    rows_out = []

    def row(what, fn):
        rows_out.append((what, graph_us(fn, layers, h)))
        print(f"  {what:<60} {rows_out[-1][1]:7.2f} us", flush=True)

    for rep in range(2):
        row(f"layer, product out_proj [{rep}]", layer)
        for rows, warps in VARIANTS:
            CONFIG.update(rows=rows, warps=warps)
            SU._launch_out_proj = _launch_staged
            try:
                row(f"layer, staged out_proj ({rows} rows per program, {warps} warps) [{rep}]", layer)
                row(f"step + staged out_proj ({rows} rows, {warps} warps) [{rep}]", step_and_out_proj)
            finally:
                SU._launch_out_proj = product_launch
            row(f"staged out_proj alone, chained ({rows} rows, {warps} warps) [{rep}]", out_proj_alone_staged)
        row(f"step + product out_proj [{rep}]", step_and_out_proj)
        row(f"product out_proj alone, chained [{rep}]", out_proj_alone)
        row(f"in_proj alone, chained [{rep}]", in_proj_alone)
    print_rows(rows_out)
    print(f"out_proj at the copy rate {out_us:.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

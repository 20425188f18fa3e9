"""Probe: what a cross-head reduction of out_proj partial sums would cost on the H100, for a verify
layer that starts out_proj per head as each head's scan finishes instead of behind a grid barrier
(round 12's "not yet tried"; docs/BENCHMARKS.md).

Each of `ctas` CTAs (one per head) adds a (16 nodes x 2560) fp32 partial into one shared buffer,
64 times over 64 buffers (one per layer) in one launch, with `red.global.add.v4.f32` (sm_90 vector
reductions). Against: the same bytes stored once per CTA into CTA-private buffers (st.global.v4),
which is what the traffic would cost without the reduction. Prints us per layer.

Timed as bench_decode.py times a call (`median_ms`). Run on the device from the bench directory:
python3 atomic_reduce_probe.py
"""
from __future__ import annotations

import cupy as cp
import numpy as np
import torch
from bench_decode import median_ms

NT, D, LAYERS = 16, 2560, 64
SOURCE = r"""
extern "C" __global__ void partials(float* out, int layers, int reduce) {
  // this CTA's partial: NT x D floats as float4, 256 threads
  const int n4 = NT * DM / 4;
  for (int l = 0; l < layers; ++l) {
    float4* dst = reinterpret_cast<float4*>(out + (size_t)l * NT * DM * (reduce ? 1 : gridDim.x))
                  + (reduce ? 0 : (size_t)blockIdx.x * n4);
    for (int i = threadIdx.x; i < n4; i += blockDim.x) {
      const float4 v = make_float4(1.0f, 2.0f, 3.0f, (float)blockIdx.x);
      if (reduce)
        asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};"
                     ::"l"(dst + i), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w) : "memory");
      else
        dst[i] = v;
    }
  }
}
"""


def main() -> int:
    kernel = cp.RawKernel(SOURCE, "partials", options=("-arch=sm_90a", f"-DNT={NT}", f"-DDM={D}"))
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}; {NT} x {D} fp32 partial per CTA, {LAYERS} layers")
    for ctas in (40, 80, 132):
        reduced = cp.zeros(LAYERS * NT * D, dtype=cp.float32)
        private = cp.zeros(LAYERS * NT * D * ctas, dtype=cp.float32)
        def run(out, reduce, ctas=ctas):  # on torch's stream, which median_ms times
            with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                kernel((ctas,), (256,), (out, np.int32(LAYERS), np.int32(reduce)))

        red_us = median_ms(lambda out=reduced: run(out, 1), iters=20) * 1000 / LAYERS
        st_us = median_ms(lambda out=private: run(out, 0), iters=20) * 1000 / LAYERS
        reduced[:] = 0
        cp.cuda.Device().synchronize()
        kernel((ctas,), (256,), (reduced, np.int32(1), np.int32(1)))
        want = np.array([1.0, 2.0, 3.0, sum(range(ctas))], dtype=np.float32) * np.array([ctas, ctas, ctas, 1])
        got = cp.asnumpy(reduced[:4])
        print(f"  {ctas:4d} CTAs: vector reductions into one buffer {red_us:6.2f} us per layer; the same bytes stored "
              f"privately {st_us:6.2f} us; sums {'correct' if np.allclose(got, want) else f'WRONG {got} vs {want}'}")
    return 0


if __name__ == "__main__":
    with torch.cuda.stream(torch.cuda.Stream()):  # a real stream handle for CuPy (not the legacy 0)
        raise SystemExit(main())

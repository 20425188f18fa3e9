// Device helpers of the weight-stream kernels that read a few rows of activations straight into the
// tensor cores' A fragments (ops/stream_proj/kernel.cu): loads past L1, bf16 pieces, and the
// A-fragment layout.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "pipeline.cuh"

namespace {

template <int THREADS>
__device__ __forceinline__ void named_sync() {  // barrier 1 over the first THREADS threads (the consumers)
  asm volatile("bar.sync 1, %0;" ::"n"(THREADS) : "memory");
}
// Loads of what other CTAs or launches wrote (L2, not L1, not hoisted).
__device__ __forceinline__ uint32_t ld_l2_b32(const void* p) {
  uint32_t v;
  asm volatile("ld.global.cg.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint4 ld_l2_v4(const void* p) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ float lo_bf(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float hi_bf(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }
__device__ __forceinline__ float sq2(uint32_t u) { return lo_bf(u) * lo_bf(u) + hi_bf(u) * hi_bf(u); }
__device__ __forceinline__ float round_bf(float v) { return __bfloat162float(__float2bfloat16(v)); }
__device__ __forceinline__ int split_lo(int n, int part, int parts) { return (int)(((long long)n * part) / parts); }
__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Up to 16 rows (tree nodes) of a warp's STEPS x 16 columns as A fragments, straight from L2. The
// contraction index is permuted within each block of 32 columns, the same way for A and B, so that
// both come in 16-byte pieces: thread (m = lane / 4, c = lane % 4) holds columns 32 b + 8 c .. + 7 as
// its k pairs of k-steps 2 b (columns +0..3) and 2 b + 1 (+4..7), for rows m and m + 8.
template <int STEPS>
struct AFrags {
  uint4 lo[STEPS / 2], hi[STEPS / 2];
};
template <int STEPS>  // rows past `rows` load as zeros
__device__ __forceinline__ void load_a(const __nv_bfloat16* x, int stride, int col0, int rows, int lane,
                                       AFrags<STEPS>& a) {
  const int m = lane >> 2, c = lane & 3;
  const uint4 zero = make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int b = 0; b < STEPS / 2; ++b) {  // all issued before any is used
    a.lo[b] = m < rows ? ld_l2_v4(x + m * stride + col0 + 32 * b + 8 * c) : zero;
    a.hi[b] = m + 8 < rows ? ld_l2_v4(x + (m + 8) * stride + col0 + 32 * b + 8 * c) : zero;
  }
}
template <int STEPS>  // each row's sum of squares over this thread's pieces
__device__ __forceinline__ void add_sq(const AFrags<STEPS>& a, float& sq_lo, float& sq_hi) {
#pragma unroll
  for (int b = 0; b < STEPS / 2; ++b) {
    sq_lo += sq2(a.lo[b].x) + sq2(a.lo[b].y) + sq2(a.lo[b].z) + sq2(a.lo[b].w);
    sq_hi += sq2(a.hi[b].x) + sq2(a.hi[b].y) + sq2(a.hi[b].z) + sq2(a.hi[b].w);
  }
}
// C (16 rows x 8 weight rows) += A (the warp's columns) x B (a ring slot's 8 weight rows over the same
// columns, ROW_STRIDE bytes apart), in ACC independent accumulators summed at the end (ACC 1: one
// chain of dependent mma.sync).
template <int STEPS, int ROW_STRIDE, int ACC>
__device__ __forceinline__ void slot_mma(const unsigned char* slot, int col0, int lane, const AFrags<STEPS>& a,
                                         float (&c)[4]) {
  static_assert(STEPS % ACC == 0, "k-steps split evenly over the accumulators");
  const unsigned char* row = slot + (lane >> 2) * ROW_STRIDE + (col0 + 8 * (lane & 3)) * 2;
  if constexpr (ACC == 1) {
#pragma unroll
    for (int b = 0; b < STEPS / 2; ++b) {
      const uint4 w = *reinterpret_cast<const uint4*>(row + 64 * b);
      mma16816(c, a.lo[b].x, a.hi[b].x, a.lo[b].y, a.hi[b].y, w.x, w.y);  // k-step 2 b
      mma16816(c, a.lo[b].z, a.hi[b].z, a.lo[b].w, a.hi[b].w, w.z, w.w);  // k-step 2 b + 1
    }
    return;
  }
  float part[ACC][4] = {};
#pragma unroll
  for (int b = 0; b < STEPS / 2; ++b) {
    const uint4 w = *reinterpret_cast<const uint4*>(row + 64 * b);
    mma16816(part[(2 * b) % ACC], a.lo[b].x, a.hi[b].x, a.lo[b].y, a.hi[b].y, w.x, w.y);      // k-step 2 b
    mma16816(part[(2 * b + 1) % ACC], a.lo[b].z, a.hi[b].z, a.lo[b].w, a.hi[b].w, w.z, w.w);  // k-step 2 b + 1
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    float v = 0.0f;
#pragma unroll
    for (int i = 0; i < ACC; ++i) v += part[i][e];
    c[e] += v;
  }
}

// The 16 x 8 sums of one ring slot over WARPS warps' partial C (each warp one share of the columns),
// through red ([WARPS][16][8] floats): thread t < 128 gets row t / 8, weight row t % 8.
template <int WARPS>
__device__ __forceinline__ float slot_sums(const float (&c)[4], float* red, int warp, int lane, int t) {
  const int m = lane >> 2, n = 2 * (lane & 3);
  float* mine = red + warp * 16 * 8;
  mine[m * 8 + n] = c[0];
  mine[m * 8 + n + 1] = c[1];
  mine[(m + 8) * 8 + n] = c[2];
  mine[(m + 8) * 8 + n + 1] = c[3];
  named_sync<WARPS * 32>();
  float s = 0.0f;
  if (t < 16 * 8) {
#pragma unroll
    for (int w = 0; w < WARPS; ++w) s += red[w * 16 * 8 + t];
  }
  named_sync<WARPS * 32>();
  return s;
}
// Each row's sum of squares over WARPS warps' fragments (add_sq's per-thread sums), through sq
// ([WARPS][16] floats): dst[row] = finish(sum), e.g. the sum itself or the row's 1 / rms.
template <int WARPS, typename Finish>
__device__ __forceinline__ void rows_sq(float sq_lo, float sq_hi, float* sq, float* dst, int warp, int lane, int t,
                                        Finish finish) {
  sq_lo += __shfl_xor_sync(0xffffffffu, sq_lo, 1);
  sq_lo += __shfl_xor_sync(0xffffffffu, sq_lo, 2);
  sq_hi += __shfl_xor_sync(0xffffffffu, sq_hi, 1);
  sq_hi += __shfl_xor_sync(0xffffffffu, sq_hi, 2);
  if ((lane & 3) == 0) {
    sq[warp * 16 + (lane >> 2)] = sq_lo;
    sq[warp * 16 + (lane >> 2) + 8] = sq_hi;
  }
  named_sync<WARPS * 32>();
  if (t < 16) {
    float s = 0.0f;
    for (int w = 0; w < WARPS; ++w) s += sq[w * 16 + t];
    dst[t] = finish(s);
  }
  named_sync<WARPS * 32>();
}

// The two sides of a ring of kSlots shared-memory slots of weight rows (ROW_BYTES of each row at
// ROW_STRIDE apart), filled by one producer thread and read by WARPS consumer warps. The producer
// copies slot k's rows once the consumers have released it, with at most kInFlight slots' copies in
// flight (ops/stream_layers/kernel.cu: one).
template <int kSlots, int kInFlight, int SLOT_BYTES, int ROW_STRIDE, int ROW_BYTES>
struct RingProducer {
  unsigned char* ring;
  uint64_t* full;
  uint64_t* empty;
  uint64_t policy;
  unsigned k = 0;

  __device__ __forceinline__ void issue(const __nv_bfloat16* first_row, int row_elems, int rows) {
    const int slot = k % kSlots;
    mbar_wait(empty + slot, ((k / kSlots) & 1) ^ 1);
    if (k >= kInFlight) {
      const unsigned back = k - kInFlight;
      mbar_wait(full + back % kSlots, (back / kSlots) & 1);
    }
    mbar_expect_tx(full + slot, rows * ROW_BYTES);
    for (int r = 0; r < rows; ++r)
      bulk_load(ring + slot * SLOT_BYTES + r * ROW_STRIDE, first_row + (size_t)r * row_elems, ROW_BYTES, full + slot,
                policy);
    ++k;
  }
};
template <int kSlots, int SLOT_BYTES>
struct RingConsumer {
  const unsigned char* ring;
  uint64_t* full;
  uint64_t* empty;
  unsigned k = 0;

  __device__ __forceinline__ const unsigned char* acquire() {  // the next slot, once its rows have landed
    mbar_wait(full + k % kSlots, (k / kSlots) & 1);
    return ring + (k % kSlots) * SLOT_BYTES;
  }
  __device__ __forceinline__ void release(int lane) {  // this warp is done with it
    __syncwarp();
    if (lane == 0) mbar_arrive(empty + k % kSlots);
    ++k;
  }
};

}  // namespace

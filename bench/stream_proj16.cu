// Probe: the verify's two projections for a 16-node tree (batch 1) with ops/stream_layers' weight
// stream, on tensor cores. bench/stream_proj16_probe.py builds it, checks it against torch and
// times it against the product's skinny GEMMs. Only the projections: per layer
//   A  in_proj:  zx[n] = bf16(rms(h[n]) * (W_in h[n]))                  n = 0..15, rows split across CTAs
//   C  out_proj: h'[n] = bf16(h[n] + bf16(rms(g[n]) * (W_out g[n])))     g fixed (no tree conv / scan)
// with a grid barrier after each phase, as a verify layer would have around its tree scan.
//
// The weights stream as in kernel.cu: one producer thread, a ring of shared-memory slots of 8
// weight rows, at most one slot's copies in flight. Each row is its own bulk copy into a row of
// 2560 + 8 elements, so that ldmatrix reads 8 rows without bank conflicts. The dot products are
// mma.sync m16n8k16: A = 16 nodes x 16 columns of the activations (held in registers for the whole
// phase: warp w owns columns [320 w, 320 w + 320) of every slot), B = 16 columns x 8 weight rows
// from the slot, C = 16 x 8 partial sums per warp, summed across the 8 warps through shared memory.
// out_proj streams the first halves (columns 0..2559) of the CTA's rows, then the second halves.
// ACT_SMEM: the activations come into shared memory by bulk copies after each barrier and the A
// fragments from there by ldmatrix (run 146: 40.2 against 52.5 us per layer with register A);
// ACT_MCAST: clusters of 2 CTAs, each fetching half the nodes and multicasting them (run 147: 39.0-39.8).
// ACT_LSU: the activations by 16-byte loads from every consumer thread (not the TMA), then st.shared.
// ACT_REG: the activations straight into the A fragments by 16-byte L2 loads, the contraction index
// permuted within blocks of 32 columns to allow it (see load_a); no shared memory for them, so the ring
// can be 5 slots deep.
// G1_PREFETCH (with ACT_REG): out_proj's second-half activations are loaded with the first half's, into a
// second set of registers, so that they arrive while the first half streams.
// OUT_SPLITK (with ACT_REG): clusters of 2 CTAs; out_proj's rows split across pairs, and each CTA of a pair
// streams one half of the columns of the pair's rows, so it needs one half of g (one fetch, not two); the
// pair adds its partial sums through distributed shared memory.
// IN9 (with ACT_REG): in_proj slots of 9 rows, so that every CTA streams 9 slots (80 or 81 rows) instead
// of 16 CTAs an eleventh for their 81st row.
// NO_FETCH_G1 (timing only): out_proj's second half without its own activation fetch.
// TAIL_NO_WAIT: a CTA's partial last slot of a phase is copied without waiting for the copy in flight.
// TRACE: globaltimer stamps per layer and CTA into `trace` (TRACE_N per layer and CTA, see STAMP below),
// and the producer's waits: where the barriers' cost goes.
#include <cuda_bf16.h>
#include <stdint.h>

#include "pipeline.cuh"  // ssmspec/ops/stream_layers

#ifndef N_SLOTS
#define N_SLOTS 4
#endif
#ifndef IN_FLIGHT
#define IN_FLIGHT 1
#endif

namespace {

constexpr int D = 2560, DI = 5120, NIN = 10576, NT = 16;
constexpr int ROWS = 8;                      // weight rows per slot (mma N)
constexpr int ROW_BYTES = D * 2;             // one in_proj row, half an out_proj row
#if defined(WHOLE_SLOT_COPY)  // timing: in_proj slots as one copy of contiguous rows (bank conflicts in ldmatrix)
constexpr int ROW_STRIDE = ROW_BYTES;
#elif defined(ACT_REG)
constexpr int ROW_STRIDE = ROW_BYTES + 64;   // B by lds.128: rows 2p and 2p + 1 fall in opposite halves of the banks
#else
constexpr int ROW_STRIDE = ROW_BYTES + 16;   // padded: consecutive rows start 16 bytes apart in the banks
#endif
#ifdef IN9  // in_proj slots of 9 rows: 80 or 81 rows per CTA are 9 slots either way
constexpr int IN_ROWS = 9;
#else
constexpr int IN_ROWS = ROWS;
#endif
constexpr int SLOT_BYTES = IN_ROWS * ROW_STRIDE;
constexpr int WARPS = 8, CONSUMERS = WARPS * 32, THREADS = CONSUMERS + 32;
constexpr int KW = D / WARPS;                // columns per warp (320)
constexpr int STEPS = KW / 16;               // mma k-steps per warp per slot (20)
#ifdef OUT_SPLITK
constexpr int MAX_OUT_ROWS = 48;  // a pair's out_proj rows (2560 / 66 -> 38-39)
#else
constexpr int MAX_OUT_ROWS = 32;
#endif
constexpr int TRACE_N = 10;  // TRACE stamps per layer and CTA
static_assert(KW % 32 == 0, "k-steps in pairs (ldmatrix.x4)");

__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS) : "memory"); }
__device__ __forceinline__ void grid_sync(unsigned* counter, unsigned round) {
  consumers_sync();
#ifdef NO_GRID_SYNC  // timing only (wrong results)
  return;
#endif
  if (threadIdx.x == 0) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
    unsigned seen;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
    } while (seen < round * gridDim.x);
  }
  consumers_sync();
}
// Two bf16 of what another CTA wrote before the last grid barrier (L2, not hoistable).
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
__device__ __forceinline__ float sq2(uint32_t u) {
  const float lo = __uint_as_float(u << 16), hi = __uint_as_float(u & 0xffff0000u);
  return lo * lo + hi * hi;
}
__device__ __forceinline__ float round_bf(float v) { return __bfloat162float(__float2bfloat16(v)); }
// Waits for an mbarrier phase with cluster-scope acquire: the peer's remote arrive released its writes.
__device__ __forceinline__ void mbar_wait_cluster(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
  }
}
// One arrive (releasing this CTA's writes at cluster scope) on the same mbarrier of CTA `peer` of the cluster.
__device__ __forceinline__ void pair_arrive(uint64_t* bar, uint32_t peer) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(bar)), "r"(peer));
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}
__device__ __forceinline__ float ld_cluster_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long v;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(v));
  return v;
}
__device__ __forceinline__ int split_lo(int n, int part, int parts) { return (int)(((long long)n * part) / parts); }

#ifdef ACT_REG
// The contraction index is permuted within each block of 32 columns, the same way for A and B, so
// that both come in 16-byte pieces: thread (m = lane / 4, c = lane % 4) holds columns 32 b + 8 c ..
// 32 b + 8 c + 7 as its k pairs of k-steps 2 b (columns +0..3) and 2 b + 1 (+4..7). A: one 16-byte
// L2 load per node (m and m + 8) and block, straight into the fragments, no shared memory;
// B: one lds.128 of weight row m per block.
struct AFrags {
  uint4 lo[STEPS / 2], hi[STEPS / 2];  // nodes m and m + 8, block b
};
__device__ __forceinline__ void issue_a(const __nv_bfloat16* x, int stride, int col0, int lane, AFrags& a) {
  const int m = lane >> 2, c = lane & 3;
#pragma unroll
  for (int b = 0; b < STEPS / 2; ++b) {  // all issued before any is used
    a.lo[b] = ld_l2_v4(x + m * stride + col0 + 32 * b + 8 * c);
    a.hi[b] = ld_l2_v4(x + (m + 8) * stride + col0 + 32 * b + 8 * c);
  }
}
__device__ __forceinline__ void add_sq(const AFrags& a, float& sq_lo, float& sq_hi) {
#pragma unroll
  for (int b = 0; b < STEPS / 2; ++b) {
    sq_lo += sq2(a.lo[b].x) + sq2(a.lo[b].y) + sq2(a.lo[b].z) + sq2(a.lo[b].w);
    sq_hi += sq2(a.hi[b].x) + sq2(a.hi[b].y) + sq2(a.hi[b].z) + sq2(a.hi[b].w);
  }
}
__device__ __forceinline__ void load_a(const __nv_bfloat16* x, int stride, int col0, int lane, AFrags& a,
                                       float& sq_lo, float& sq_hi) {
  issue_a(x, stride, col0, lane, a);
  add_sq(a, sq_lo, sq_hi);
}

__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// (row: the slot row that lane's n reads, its own lane / 4 unless given, as IN9's row 8 is)
__device__ __forceinline__ void slot_mma(const unsigned char* slot, int col0, int lane, const AFrags& a, float (&c)[4],
                                         int row_of_lane = -1) {
  const unsigned char* row = slot + (row_of_lane < 0 ? lane >> 2 : row_of_lane) * ROW_STRIDE + (col0 + 8 * (lane & 3)) * 2;
#pragma unroll
  for (int b = 0; b < STEPS / 2; ++b) {
    const uint4 w = *reinterpret_cast<const uint4*>(row + 64 * b);
    mma16816(c, a.lo[b].x, a.hi[b].x, a.lo[b].y, a.hi[b].y, w.x, w.y);  // k-step 2 b: columns +0..3
    mma16816(c, a.lo[b].z, a.hi[b].z, a.lo[b].w, a.hi[b].w, w.z, w.w);  // k-step 2 b + 1: columns +4..7
  }
}
#else
// The warp's A fragments (16 nodes x its 320 columns of one 2560-wide half) of x (NT rows of
// `stride` elements), and the partial sums of squares of nodes lane/4 and lane/4 + 8.
__device__ __forceinline__ void load_a(const __nv_bfloat16* x, int stride, int col0, int lane, uint32_t (&a)[STEPS][4],
                                       float& sq_lo, float& sq_hi) {
  const int m = lane >> 2, c = 2 * (lane & 3);
#pragma unroll
  for (int s = 0; s < STEPS; ++s) {
    const int k = col0 + s * 16 + c;
    a[s][0] = ld_l2_b32(x + m * stride + k);
    a[s][1] = ld_l2_b32(x + (m + 8) * stride + k);
    a[s][2] = ld_l2_b32(x + m * stride + k + 8);
    a[s][3] = ld_l2_b32(x + (m + 8) * stride + k + 8);
    sq_lo += sq2(a[s][0]) + sq2(a[s][2]);
    sq_hi += sq2(a[s][1]) + sq2(a[s][3]);
  }
}

// C (16 nodes x 8 rows) += A (the warp's columns) x B (the slot's 8 rows over the same columns).
__device__ __forceinline__ void slot_mma(const unsigned char* slot, int col0, int lane, const uint32_t (&a)[STEPS][4],
                                         float (&c)[4]) {
  // ldmatrix.x4: threads 0-7 / 8-15 / 16-23 / 24-31 address rows 0-7 of the k-blocks +0 / +8 / +16 / +24
  const uint32_t base = smem_addr(slot) + (lane & 7) * ROW_STRIDE + (col0 + (lane >> 3) * 8) * 2;
#pragma unroll
  for (int s = 0; s < STEPS; s += 2) {
    uint32_t b0, b1, b2, b3;
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3) : "r"(base + s * 32));
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[s][0]), "r"(a[s][1]), "r"(a[s][2]), "r"(a[s][3]), "r"(b0), "r"(b1));
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[s + 1][0]), "r"(a[s + 1][1]), "r"(a[s + 1][2]), "r"(a[s + 1][3]), "r"(b2), "r"(b3));
  }
}

#endif  // ACT_REG

// The same with the A fragments read from the nodes' activations in shared memory (ACT_SMEM): act
// holds NT rows of 2560 columns at ROW_STRIDE bytes; ldmatrix.x4 lanes 0-7 / 8-15 / 16-23 / 24-31
// address nodes 0-7 / 8-15 / 0-7 / 8-15 at columns +0 / +0 / +8 / +8 (a0..a3 of the m16n8k16 A).
__device__ __forceinline__ void slot_mma_smem_a(const unsigned char* slot, const unsigned char* act, int col0, int lane,
                                                float (&c)[4]) {
  const uint32_t base = smem_addr(slot) + (lane & 7) * ROW_STRIDE + (col0 + (lane >> 3) * 8) * 2;
  const int node = (lane & 7) + ((lane >> 3) & 1) * 8;
  const uint32_t abase = smem_addr(act) + node * ROW_STRIDE + (col0 + ((lane >> 4) & 1) * 8) * 2;
#pragma unroll
  for (int s = 0; s < STEPS; s += 2) {
    uint32_t b0, b1, b2, b3, a0, a1, a2, a3, e0, e1, e2, e3;
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3) : "r"(base + s * 32));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a0), "=r"(a1), "=r"(a2), "=r"(a3) : "r"(abase + s * 32));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(e0), "=r"(e1), "=r"(e2), "=r"(e3) : "r"(abase + s * 32 + 32));
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(e0), "r"(e1), "r"(e2), "r"(e3), "r"(b2), "r"(b3));
  }
}

}  // namespace

struct Layer16 {
  const __nv_bfloat16* in_w;   // (NIN, D)
  const __nv_bfloat16* out_w;  // (D, DI)
};

#if defined(ACT_MCAST) || defined(OUT_SPLITK)  // clusters of 2 CTAs (see the switches above)
#define CLUSTER_DIMS __cluster_dims__(2, 1, 1)
#else
#define CLUSTER_DIMS
#endif
extern "C" __global__ void __launch_bounds__(THREADS, 1) CLUSTER_DIMS
stream_proj16(const Layer16* __restrict__ layers, int n_layers, const __nv_bfloat16* h_in, __nv_bfloat16* h_out,
              const __nv_bfloat16* g, __nv_bfloat16* zx, __nv_bfloat16* hbuf, unsigned* counter, float eps,
              unsigned long long* trace) {
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* ring = smem;
  float* red = reinterpret_cast<float*>(smem + N_SLOTS * SLOT_BYTES);  // [WARPS][NT][ROWS] partial C
  float* acc = red + WARPS * NT * ROWS;                                 // [NT][MAX_OUT_ROWS] out_proj sums
  float* sq = acc + NT * MAX_OUT_ROWS;                                  // [WARPS][NT] sums of squares
  float* rms = sq + WARPS * NT;                                         // [NT]
  uint64_t* full = reinterpret_cast<uint64_t*>(rms + NT);
  uint64_t* empty = full + N_SLOTS;
  uint64_t* act_bar = empty + N_SLOTS;                                   // ACT_SMEM: the activations landed
  uint64_t* pair_bar = act_bar + 2;                                      // OUT_SPLITK: the peer's sums are ready
  float* pair_sq = reinterpret_cast<float*>(pair_bar + 2);              // OUT_SPLITK: [NT] this CTA's sums of squares (16-byte aligned act)
  float* red9 = pair_sq + NT;                                          // IN9: [WARPS][NT] row 8's partial sums
  unsigned char* act = reinterpret_cast<unsigned char*>(red9 + WARPS * NT);  // ACT_SMEM: [NT] rows at ROW_STRIDE

  const int cta = blockIdx.x, ctas = gridDim.x;
  const int in_lo = split_lo(NIN, cta, ctas), in_hi = split_lo(NIN, cta + 1, ctas);
#ifdef OUT_SPLITK  // the pair's rows; this CTA streams their columns [rank * 2560, rank * 2560 + 2560)
  const int rank = cta & 1;
  const int out_lo = split_lo(D, cta / 2, ctas / 2), out_hi = split_lo(D, cta / 2 + 1, ctas / 2);
#else
  const int out_lo = split_lo(D, cta, ctas), out_hi = split_lo(D, cta + 1, ctas);
#endif
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = threadIdx.x;
  if (t == 0) {
    for (int i = 0; i < N_SLOTS; ++i) {
      mbar_init(full + i, 1);
      mbar_init(empty + i, WARPS);
    }
    mbar_init(act_bar, 1);
    mbar_init(act_bar + 1, 2);  // ACT_MCAST: both CTAs of the cluster are done reading act
    mbar_init(pair_bar, 1);     // OUT_SPLITK: one arrive, from the peer
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
#if defined(ACT_MCAST) || defined(OUT_SPLITK)  // both CTAs' barriers initialised before any remote arrive
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
  __syncthreads();
#endif

  if (warp == WARPS) {  // producer
    if (lane == 0) {
      uint64_t policy;
      asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
      unsigned k = 0;
      unsigned long long ring_full_ns = 0, in_flight_ns = 0;  // TRACE: the producer's waits in this layer
      auto issue = [&](const __nv_bfloat16* first_row, int row_elems, int rows) {
        const int slot = k % N_SLOTS;
#ifdef TRACE
        const unsigned long long t0 = now_ns();
#endif
        mbar_wait(empty + slot, ((k / N_SLOTS) & 1) ^ 1);
#ifdef TRACE
        const unsigned long long t1 = now_ns();
        ring_full_ns += t1 - t0;
#endif
#ifdef TAIL_NO_WAIT  // a partial slot (a CTA's last rows of a phase) goes without waiting for the copy in flight
        if (k >= IN_FLIGHT && rows == ROWS) {
#else
        if (k >= IN_FLIGHT) {  // at most IN_FLIGHT slots in flight (see ops/stream_layers/kernel.cu)
#endif
          const unsigned back = k - IN_FLIGHT;
          mbar_wait(full + back % N_SLOTS, (back / N_SLOTS) & 1);
        }
#ifdef TRACE
        in_flight_ns += now_ns() - t1;
#endif
        mbar_expect_tx(full + slot, rows * ROW_BYTES);
#ifdef WHOLE_SLOT_COPY
        if (row_elems == D) {
          bulk_load(ring + slot * SLOT_BYTES, first_row, rows * ROW_BYTES, full + slot, policy);
          ++k;
          return;
        }
#endif
        for (int r = 0; r < rows; ++r)
          bulk_load(ring + slot * SLOT_BYTES + r * ROW_STRIDE, first_row + (size_t)r * row_elems, ROW_BYTES,
                    full + slot, policy);
        ++k;
      };
      for (int l = 0; l < n_layers; ++l) {
        const Layer16 L = layers[l];
        for (int r = in_lo; r < in_hi; r += IN_ROWS) issue(L.in_w + (size_t)r * D, D, min(IN_ROWS, in_hi - r));
#ifdef OUT_SPLITK
        for (int r = out_lo; r < out_hi; r += ROWS) issue(L.out_w + (size_t)r * DI + rank * D, DI, min(ROWS, out_hi - r));
#else
        for (int half = 0; half < 2; ++half)
          for (int r = out_lo; r < out_hi; r += ROWS)
            issue(L.out_w + (size_t)r * DI + half * D, DI, min(ROWS, out_hi - r));
#endif
#ifdef TRACE
        trace[((size_t)l * ctas + cta) * TRACE_N + 8] = ring_full_ns;
        trace[((size_t)l * ctas + cta) * TRACE_N + 9] = in_flight_ns;
        ring_full_ns = in_flight_ns = 0;
#endif
      }
    }
    return;
  }

  unsigned k = 0, rounds = 0;
  auto acquire = [&]() -> const unsigned char* {
    mbar_wait(full + k % N_SLOTS, (k / N_SLOTS) & 1);
    return ring + (k % N_SLOTS) * SLOT_BYTES;
  };
  auto release = [&]() {
    __syncwarp();
    if (lane == 0) mbar_arrive(empty + k % N_SLOTS);
    ++k;
  };
  // The 16 x 8 sums of one slot: every warp's partial C through shared memory, then thread t < 128
  // holds node t / 8, row t % 8. Returns that sum.
  auto reduce_slot = [&](const float (&c)[4]) -> float {
    const int m = lane >> 2, n = 2 * (lane & 3);
    float* mine = red + warp * NT * ROWS;
    mine[m * ROWS + n] = c[0];
    mine[m * ROWS + n + 1] = c[1];
    mine[(m + 8) * ROWS + n] = c[2];
    mine[(m + 8) * ROWS + n + 1] = c[3];
    consumers_sync();
    float s = 0.0f;
    if (t < NT * ROWS) {
#pragma unroll
      for (int w = 0; w < WARPS; ++w) s += red[w * NT * ROWS + t];
    }
    consumers_sync();
    return s;
  };
  // IN9: the same for a slot of 9 rows, c9 holding row 8 in its column 0 (lanes 0, 4, ..., 28): threads
  // t < 128 return node t / 8, row t % 8; threads 128..143 node t - 128, row 8.
  auto reduce_slot9 = [&](const float (&c)[4], const float (&c9)[4]) -> float {
    const int m = lane >> 2, n = 2 * (lane & 3);
    float* mine = red + warp * NT * ROWS;
    mine[m * ROWS + n] = c[0];
    mine[m * ROWS + n + 1] = c[1];
    mine[(m + 8) * ROWS + n] = c[2];
    mine[(m + 8) * ROWS + n + 1] = c[3];
    if ((lane & 3) == 0) {
      red9[warp * NT + m] = c9[0];
      red9[warp * NT + m + 8] = c9[2];
    }
    consumers_sync();
    float s = 0.0f;
    if (t < NT * ROWS) {
#pragma unroll
      for (int w = 0; w < WARPS; ++w) s += red[w * NT * ROWS + t];
    } else if (t < NT * ROWS + NT) {
#pragma unroll
      for (int w = 0; w < WARPS; ++w) s += red9[w * NT + t - NT * ROWS];
    }
    consumers_sync();
    return s;
  };
  // 1/rms of each node from the warps' partial sums of squares (over `width` columns).
  auto node_rms = [&](float sq_lo, float sq_hi, int width) {
    sq_lo += __shfl_xor_sync(0xffffffffu, sq_lo, 1);
    sq_lo += __shfl_xor_sync(0xffffffffu, sq_lo, 2);
    sq_hi += __shfl_xor_sync(0xffffffffu, sq_hi, 1);
    sq_hi += __shfl_xor_sync(0xffffffffu, sq_hi, 2);
    if ((lane & 3) == 0) {
      sq[warp * NT + (lane >> 2)] = sq_lo;
      sq[warp * NT + (lane >> 2) + 8] = sq_hi;
    }
    consumers_sync();
    if (t < NT) {
      float s = 0.0f;
      for (int w = 0; w < WARPS; ++w) s += sq[w * NT + t];
      rms[t] = rsqrtf(s / width + eps);
    }
    consumers_sync();
  };

  // OUT_SPLITK: this CTA's sums of squares per node into dst[NT] (then a consumers_sync).
  auto node_sq = [&](float sq_lo, float sq_hi, float* dst) {
    sq_lo += __shfl_xor_sync(0xffffffffu, sq_lo, 1);
    sq_lo += __shfl_xor_sync(0xffffffffu, sq_lo, 2);
    sq_hi += __shfl_xor_sync(0xffffffffu, sq_hi, 1);
    sq_hi += __shfl_xor_sync(0xffffffffu, sq_hi, 2);
    if ((lane & 3) == 0) {
      sq[warp * NT + (lane >> 2)] = sq_lo;
      sq[warp * NT + (lane >> 2) + 8] = sq_hi;
    }
    consumers_sync();
    if (t < NT) {
      float s = 0.0f;
      for (int w = 0; w < WARPS; ++w) s += sq[w * NT + t];
      dst[t] = s;
    }
    consumers_sync();
  };

  // ACT_SMEM: the nodes' activations (NT rows of 2560 columns from src, `stride` apart) into act by
  // 16 bulk copies from thread 0, then every consumer thread waits for them and adds its share of
  // the sums of squares (thread t: node t / 16, columns (t % 16) * 160 ...) to sq[node].
  unsigned act_phase = 0;
  auto load_act = [&](const __nv_bfloat16* src, int stride, bool reset_sq) {
    consumers_sync();  // every warp is done reading the previous activations (and sq)
#if defined(ACT_LSU)
    {  // every consumer thread loads 20 of the 5120 16-byte pieces, all issued before any is stored
      constexpr int PIECES = ROW_BYTES / 16, PER_THREAD = NT * PIECES / CONSUMERS;
      static_assert(NT * PIECES % CONSUMERS == 0, "whole pieces per thread");
      uint4 v[PER_THREAD];
#pragma unroll
      for (int j = 0; j < PER_THREAD; ++j) {
        const int e = j * CONSUMERS + t;  // piece e: node e / PIECES, bytes 16 (e % PIECES) of its row
        v[j] = ld_l2_v4(src + (size_t)(e / PIECES) * stride + (e % PIECES) * 8);
      }
#pragma unroll
      for (int j = 0; j < PER_THREAD; ++j) {
        const int e = j * CONSUMERS + t;
        *reinterpret_cast<uint4*>(act + (e / PIECES) * ROW_STRIDE + (e % PIECES) * 16) = v[j];
      }
    }
    consumers_sync();
#elif defined(ACT_MCAST)
    if (t == 0) {  // each CTA fetches half the nodes and multicasts them to both CTAs of its cluster
      uint32_t rank, peer_free;
      asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(peer_free) : "r"(smem_addr(act_bar + 1)), "r"(rank ^ 1));
      mbar_arrive(act_bar + 1);  // this CTA no longer reads act ...
      asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(peer_free) : "memory");  // ... tell the peer
      mbar_wait(act_bar + 1, act_phase);  // and the peer no longer reads its act either
      uint64_t keep;
      asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(keep));
      asm volatile("fence.proxy.async.global;" ::: "memory");
      mbar_expect_tx(act_bar, NT * ROW_BYTES);  // all 16 rows land here, half of them from the peer
      const uint16_t both = 3;
      for (int n = rank * (NT / 2); n < (rank + 1) * (NT / 2); ++n)
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster.L2::cache_hint"
                     " [%0], [%1], %2, [%3], %4, %5;"
                     ::"r"(smem_addr(act + n * ROW_STRIDE)), "l"(src + (size_t)n * stride), "r"(ROW_BYTES),
                       "r"(smem_addr(act_bar)), "h"(both), "l"(keep) : "memory");
    }
#else
    if (t == 0) {
      uint64_t keep;  // every CTA reads the same activations: keep them in L2
      asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(keep));
      asm volatile("fence.proxy.async.global;" ::: "memory");  // other CTAs' generic stores -> the bulk copies
      mbar_expect_tx(act_bar, NT * ROW_BYTES);
      for (int n = 0; n < NT; ++n) bulk_load(act + n * ROW_STRIDE, src + (size_t)n * stride, ROW_BYTES, act_bar, keep);
    }
#endif
    if (reset_sq && t < NT) sq[t] = 0.0f;
#ifndef ACT_LSU
    mbar_wait(act_bar, act_phase);
    act_phase ^= 1;
#endif
    const uint4* row = reinterpret_cast<const uint4*>(act + (t >> 4) * ROW_STRIDE) + (t & 15) * 20;
    float part = 0.0f;
#pragma unroll
    for (int j = 0; j < 20; ++j) {
      const uint4 u = row[j];
      part += sq2(u.x) + sq2(u.y) + sq2(u.z) + sq2(u.w);
    }
#pragma unroll
    for (int o = 8; o; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
    consumers_sync();  // sq reset before the adds
    if ((t & 15) == 0) atomicAdd(sq + (t >> 4), part);
    consumers_sync();
  };
  auto act_rms = [&](int width) {
    if (t < NT) rms[t] = rsqrtf(sq[t] / width + eps);
    consumers_sync();
  };

#ifdef TRACE  // consumer thread 0's clock at point i of layer l (0-7; 8-9 are the producer's waits)
#define STAMP(i) \
  if (t == 0) trace[((size_t)l * ctas + cta) * TRACE_N + (i)] = now_ns()
#else
#define STAMP(i)
#endif
#ifdef NO_REDUCE  // timing only (wrong results): no cross-warp sum per slot
#define TIMED_REDUCE(c) (c[0])
#else
#define TIMED_REDUCE(c) reduce_slot(c)
#endif
#ifdef ACT_REG
  AFrags a, a_next;  // a_next: G1_PREFETCH's second half of g, in flight during the first half
#else
  uint32_t a[STEPS][4];
#endif
  const int col0 = warp * KW;
  for (int l = 0; l < n_layers; ++l) {
    const __nv_bfloat16* h = l == 0 ? h_in : hbuf + ((l - 1) & 1) * NT * D;
    __nv_bfloat16* h_next = l == n_layers - 1 ? h_out : hbuf + (l & 1) * NT * D;

    // A: in_proj
    float sq_lo = 0.0f, sq_hi = 0.0f;
    STAMP(0);
#ifdef ACT_SMEM
    load_act(h, D, true);
    act_rms(D);
#else
#ifdef NO_A_RELOAD  // timing only (wrong results): the activations loaded in the first layer only
    if (l == 0)
#endif
      load_a(h, D, col0, lane, a, sq_lo, sq_hi);
    node_rms(sq_lo, sq_hi, D);
#endif
    STAMP(1);
    for (int r = in_lo; r < in_hi; r += IN_ROWS) {
      const unsigned char* slot = acquire();
      float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#if defined(ACT_SMEM)
      slot_mma_smem_a(slot, act, col0, lane, c);
#elif !defined(NO_MMA)  // timing only (wrong results)
      slot_mma(slot, col0, lane, a, c);
#endif
#ifdef IN9  // row 8 as a second n-tile whose lanes all read it (only its column 0 is kept)
      float c9[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      slot_mma(slot + 8 * ROW_STRIDE, col0, lane, a, c9, 0);
      release();
      const float s = reduce_slot9(c, c9);
      if (t < NT * ROWS && r + t % ROWS < in_hi) zx[(t / ROWS) * NIN + r + t % ROWS] = __float2bfloat16(s * rms[t / ROWS]);
      if (t >= NT * ROWS && t < NT * ROWS + NT && r + 8 < in_hi)
        zx[(t - NT * ROWS) * NIN + r + 8] = __float2bfloat16(s * rms[t - NT * ROWS]);
#else
      release();
      const float s = TIMED_REDUCE(c);
      if (t < NT * ROWS && r + t % ROWS < in_hi) zx[(t / ROWS) * NIN + r + t % ROWS] = __float2bfloat16(s * rms[t / ROWS]);
#endif
    }
    STAMP(2);
    grid_sync(counter, ++rounds);
    STAMP(3);

    // C: out_proj of the fixed g, both halves of the CTA's rows (OUT_SPLITK: this CTA's half of the
    // pair's rows), then the residual add
#ifdef OUT_SPLITK
    for (int half = rank; half == rank; ++half) {
#else
    for (int half = 0; half < 2; ++half) {
#endif
      if (half == 0) sq_lo = sq_hi = 0.0f;
#if defined(OUT_SPLITK)
      sq_lo = sq_hi = 0.0f;
      load_a(g, DI, half * D + col0, lane, a, sq_lo, sq_hi);
#elif defined(ACT_REG) && defined(G1_PREFETCH)
      if (half == 0) {
        load_a(g, DI, col0, lane, a, sq_lo, sq_hi);
        issue_a(g, DI, D + col0, lane, a_next);
      } else {
        a = a_next;
        add_sq(a, sq_lo, sq_hi);
      }
#else
#ifdef NO_FETCH_G1  // timing only (wrong results): out_proj's second half reuses the first half's activations
      if (half == 0)
#endif
#ifdef ACT_SMEM
        load_act(g + half * D, DI, half == 0);
#else
#ifdef NO_A_RELOAD
      if (l == 0)
#endif
        load_a(g, DI, half * D + col0, lane, a, sq_lo, sq_hi);
#endif
#endif  // G1_PREFETCH
#ifdef OUT_SPLITK
      STAMP(4);
      STAMP(5);
#else
      STAMP(4 + half);
#endif
      for (int r = out_lo, i = 0; r < out_hi; r += ROWS, i += ROWS) {
        const unsigned char* slot = acquire();
        float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#if defined(ACT_SMEM)
        slot_mma_smem_a(slot, act, col0, lane, c);
#elif !defined(NO_MMA)
        slot_mma(slot, col0, lane, a, c);
#endif
        release();
        const float s = TIMED_REDUCE(c);
        if (t < NT * ROWS && r + t % ROWS < out_hi) {
          float& dst = acc[(t / ROWS) * MAX_OUT_ROWS + i + t % ROWS];
#ifdef OUT_SPLITK
          dst = s;
#else
          dst = half == 0 ? s : dst + s;
#endif
        }
      }
    }
#if defined(OUT_SPLITK)
    // Each CTA holds half of every sum (its 2560 columns): its sums of squares and partial rows go to
    // the peer through distributed shared memory, after one handshake; each CTA then finishes half
    // of the pair's rows. The peer next writes them after the grid barrier, which follows these reads.
    node_sq(sq_lo, sq_hi, pair_sq);
    if (t == 0) pair_arrive(pair_bar, rank ^ 1);
    mbar_wait_cluster(pair_bar, l & 1);
    uint32_t peer_sq, peer_acc;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(peer_sq) : "r"(smem_addr(pair_sq)), "r"(rank ^ 1));
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(peer_acc) : "r"(smem_addr(acc)), "r"(rank ^ 1));
    if (t < NT) rms[t] = rsqrtf((pair_sq[t] + ld_cluster_f32(peer_sq + 4 * t)) / DI + eps);
    consumers_sync();
    const int mid = out_lo + (out_hi - out_lo) / 2, fin_lo = rank ? mid : out_lo, fin_hi = rank ? out_hi : mid;
    for (int e = t; e < NT * (fin_hi - fin_lo); e += CONSUMERS) {
      const int n = e / (fin_hi - fin_lo), row = fin_lo + e % (fin_hi - fin_lo), j = row - out_lo;
      const float o =
          round_bf((acc[n * MAX_OUT_ROWS + j] + ld_cluster_f32(peer_acc + 4 * (n * MAX_OUT_ROWS + j))) * rms[n]);
#else
#ifdef ACT_SMEM
    act_rms(DI);
#else
    node_rms(sq_lo, sq_hi, DI);
#endif
    for (int e = t; e < NT * (out_hi - out_lo); e += CONSUMERS) {
      const int n = e / (out_hi - out_lo), j = e % (out_hi - out_lo), row = out_lo + j;
      const float o = round_bf(acc[n * MAX_OUT_ROWS + j] * rms[n]);
#endif
      const uint32_t hv = ld_l2_b32(h + n * D + (row & ~1));  // the pair holding h[n][row]
      const float hr = __uint_as_float((row & 1) ? (hv & 0xffff0000u) : (hv << 16));
      h_next[n * D + row] = __float2bfloat16(hr + o);
    }
#ifdef ACT_SMEM
    asm volatile("fence.proxy.async.global;" ::: "memory");  // these stores are the next layer's bulk-copy source
#endif
    STAMP(6);
    if (l + 1 < n_layers) grid_sync(counter, ++rounds);
    STAMP(7);
  }
#ifdef OUT_SPLITK  // neither CTA of a pair exits while the other may still read its shared memory
  consumers_sync();
  if (t == 0) pair_arrive(pair_bar, rank ^ 1);
  mbar_wait_cluster(pair_bar, n_layers & 1);
#endif
}

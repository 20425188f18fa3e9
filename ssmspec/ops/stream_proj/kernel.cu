// The tree verify's two projections for up to 16 nodes (batch 1) on the weight stream of
// ops/stream_layers: one CTA per SM streams its share of the weight rows through a ring of
// shared-memory slots (bulk copies from one producer thread), and the nodes' activations sit in the
// tensor cores' A fragments in registers. ops/stream_proj/cuda.py builds it and launches it; the
// shape is fixed at build time (-D D_MODEL, D_INNER, N_IN).
//
// One launch runs layer l's out_proj and then layer l + 1's in_proj, with a grid barrier between
// them (every CTA's in_proj needs all of h'):
//   out_proj: h' = bf16(h + bf16(rsqrt(mean(g^2) + eps_out) * (W_out g)))   rows split across CTAs
//   in_proj:  zx = bf16(rsqrt(mean(h'^2) + eps_in) * (W_in h'))             rows split across CTAs
// (either alone too: the first layer's in_proj, the last layer's out_proj). The tree conv and the gated scan run
// between launches as the Triton kernels they are.
//
// Why: the Triton skinny GEMMs stream at ~2.0 (out_proj) and ~2.4 TB/s (in_proj) at 16 rows on
// an H100, whatever their tiles or K splits (measured). Here every SM streams the
// same bytes, and the producer starts at launch, before the PDL wait: weights depend on no earlier
// kernel, so this launch's ring fills while the conv and the scan before it still run (the scan lets
// it launch at its start). For that its CTAs must fit on an SM beside a scan program (32 KB of shared
// memory, 168 registers x 128 threads): hence 4 slots (5 measured 2.626 against 2.608 ms) and
// out_proj's A fragments one half of g's columns at a time (144 registers instead of 168). The
// residual of a CTA's out_proj rows is loaded right after the PDL wait (2.545 against 2.613 ms).
// Measured slower and removed (docs/BENCHMARKS.md, "Tried and dropped"): the tree conv in in_proj's
// epilogue, out_proj split over CTA pairs with the partial sums through distributed shared memory,
// two copies in flight, partial slots first with their copy beside the next one's.
//
// Deadlock freedom: the grid barrier needs every CTA resident. A launch lets the next kernel launch
// (griddepcontrol.launch_dependents) only after its barrier, so no later kernel's CTAs can hold
// the SMs that its own CTAs still need; earlier kernels never wait for it.
#include <cuda_bf16.h>
#include <stdint.h>

#include "fragments.cuh"  // ops/stream_layers: A fragments from L2, bf16 pieces
#include "pipeline.cuh"   // ops/stream_layers: mbarriers and bulk copies

#ifndef D_MODEL  // the mamba2-2.7b shape unless the build names another
#define D_MODEL 2560
#define D_INNER 5120
#define N_IN 10576
#endif
#ifndef N_SLOTS
#define N_SLOTS 4
#endif
#ifndef IN_FLIGHT  // slots whose copies may be in flight at once (ops/stream_layers/kernel.cu: 1)
#define IN_FLIGHT 1
#endif

namespace {

constexpr int D = D_MODEL, DI = D_INNER, NIN = N_IN, NT = 16;
constexpr int OUT_SEGS = DI / D;  // an out_proj row is OUT_SEGS slot rows of D columns
constexpr int ROWS = 8, ROW_BYTES = D * 2;
constexpr int ROW_STRIDE = ROW_BYTES + 64;  // B fragments by lds.128: rows 2i and 2i + 1 in opposite bank halves
constexpr int SLOT_BYTES = ROWS * ROW_STRIDE;
constexpr int WARPS = 8, CONSUMERS = WARPS * 32, THREADS = CONSUMERS + 32;
constexpr int KW = D / WARPS, STEPS = KW / 16;  // a warp's columns of a slot row; mma k-steps per slot
constexpr int MAX_OUT_ROWS = 64;                // out_proj rows per CTA (D / SMs: 20 at 2560 on 132)
static_assert(KW % 32 == 0 && DI % D == 0 && CONSUMERS >= NT * ROWS, "the fragment and reduction mappings");

__device__ __forceinline__ void consumers_sync() { named_sync<CONSUMERS>(); }
// ACC independent accumulators in slot_mma: one chain of dependent mma.sync would make the
// consumers barely faster than the stream, and then the ring is still full when a wait (the PDL
// wait, the grid barrier, an activation fetch) begins, which stalls the stream.
// The most that divide the k-steps evenly, up to 4 (d_model 768: 6 k-steps, 3 accumulators).
constexpr int ACC = STEPS % 4 == 0 ? 4 : STEPS % 3 == 0 ? 3 : STEPS % 2 == 0 ? 2 : 1;
using Frags = AFrags<STEPS>;

// The grid barrier of one launch. Tickets count up across launches and graph replays (never reset):
// a CTA's ticket names its launch's generation, whose end is the next multiple of the grid size.
__device__ __forceinline__ void grid_barrier(unsigned* counter) {
  consumers_sync();  // every consumer's stores before the release
  if (threadIdx.x == 0) {
    unsigned ticket, seen;
    asm volatile("atom.add.release.gpu.global.u32 %0, [%1], 1;" : "=r"(ticket) : "l"(counter) : "memory");
    const unsigned target = (ticket / gridDim.x + 1) * gridDim.x;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
    } while ((int)(seen - target) < 0);
  }
  consumers_sync();
}

}  // namespace

// out_w (D, DI) and in_w (NIN, D) bf16, either null to skip that projection. g (nodes, DI): the
// gated scan's output; h (nodes, D): the residual stream (in_proj's input when out_w is null);
// h_next (nodes, D): out_proj's result; zx (nodes, NIN): in_proj's result. h_next may be h (each element is read before it is written, by one thread).
extern "C" __global__ void __launch_bounds__(THREADS, 1)
stream_proj16(const __nv_bfloat16* __restrict__ out_w, const __nv_bfloat16* g, const __nv_bfloat16* h,
              __nv_bfloat16* h_next, const __nv_bfloat16* __restrict__ in_w, __nv_bfloat16* zx,
              int nodes, float eps_out, float eps_in, unsigned* counter) {
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* ring = smem;
  float* red = reinterpret_cast<float*>(smem + N_SLOTS * SLOT_BYTES);  // [WARPS][NT][ROWS] partial C
  float* acc = red + WARPS * NT * ROWS;                                 // [NT][MAX_OUT_ROWS] out_proj sums
  float* sq = acc + NT * MAX_OUT_ROWS;                                  // [WARPS][NT] sums of squares
  float* rms = sq + WARPS * NT;                                         // [NT]
  uint64_t* full = reinterpret_cast<uint64_t*>(rms + NT);
  uint64_t* empty = full + N_SLOTS;

  const int cta = blockIdx.x, ctas = gridDim.x;
  const int out_lo = split_lo(D, cta, ctas), out_hi = split_lo(D, cta + 1, ctas);
  const int in_lo = split_lo(NIN, cta, ctas), in_hi = split_lo(NIN, cta + 1, ctas);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = threadIdx.x;
  if (t == 0) {
    for (int i = 0; i < N_SLOTS; ++i) {
      mbar_init(full + i, 1);
      mbar_init(empty + i, WARPS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == WARPS) {  // producer: the weights, before and regardless of the PDL wait
    if (lane == 0) {
      uint64_t policy;
      asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
      RingProducer<N_SLOTS, IN_FLIGHT, SLOT_BYTES, ROW_STRIDE, ROW_BYTES> producer{ring, full, empty, policy};
      if (out_w != nullptr)  // segment-major: the consumers hold one segment's A fragments at a time
        for (int s = 0; s < OUT_SEGS; ++s)
          for (int r = out_lo; r < out_hi; r += ROWS) producer.issue(out_w + (size_t)r * DI + s * D, DI, min(ROWS, out_hi - r));
      if (in_w != nullptr)
        for (int r = in_lo; r < in_hi; r += ROWS) producer.issue(in_w + (size_t)r * D, D, min(ROWS, in_hi - r));
    }
    return;
  }

  RingConsumer<N_SLOTS, SLOT_BYTES> slots{ring, full, empty};
  auto reduce_slot = [&](const float (&c)[4]) -> float { return slot_sums<WARPS>(c, red, warp, lane, t); };
  // rms[n] = rsqrt(each node's sum of squares over every warp's fragments / k + eps)
  auto set_rms = [&](float sq_lo, float sq_hi, int k_total, float eps) {
    rows_sq<WARPS>(sq_lo, sq_hi, sq, rms, warp, lane, t, [=](float s) { return rsqrtf(s / k_total + eps); });
  };

  asm volatile("griddepcontrol.wait;" ::: "memory");  // g, h: the kernels before this one
  const int col0 = warp * KW;
  const __nv_bfloat16* x_in = h;
  if (out_w != nullptr) {
    // The residual h of the rows this CTA finishes, fetched now: its L2 round trip then overlaps
    // g's fetch instead of delaying the epilogue, and with it the grid barrier (as timestamps showed).
    const int rows = out_hi - out_lo;
    constexpr int H_PER_THREAD = (NT * MAX_OUT_ROWS + CONSUMERS - 1) / CONSUMERS;
    uint32_t hv[H_PER_THREAD];
#pragma unroll
    for (int q = 0; q < H_PER_THREAD; ++q) {
      const int e = t + q * CONSUMERS, n = e / max(rows, 1), row = out_lo + e % max(rows, 1);
      hv[q] = e < nodes * rows ? ld_l2_b32(h + n * D + (row & ~1)) : 0u;  // the pair of bf16 holding h[n][row]
    }
    // One segment of g's columns at a time in the A fragments (as many registers as in_proj's), the
    // rows' sums accumulated in shared memory: fewer registers leave room on the SM for the gated
    // scan's programs, so that this launch's CTAs sit beside them and fill the ring during the scan.
    float sq_lo = 0.0f, sq_hi = 0.0f;
#pragma unroll 1
    for (int s = 0; s < OUT_SEGS; ++s) {
      Frags a;
      load_a(g, DI, s * D + col0, nodes, lane, a);
      add_sq(a, sq_lo, sq_hi);
      for (int r = out_lo, i = 0; r < out_hi; r += ROWS, i += ROWS) {
        const unsigned char* slot = slots.acquire();
        float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        slot_mma<STEPS, ROW_STRIDE, ACC>(slot, col0, lane, a, c);
        slots.release(lane);
        const float v = reduce_slot(c);
        float* dst = acc + (t / ROWS) * MAX_OUT_ROWS + i + t % ROWS;
        if (t < NT * ROWS && r + t % ROWS < out_hi) *dst = s == 0 ? v : *dst + v;
      }
    }
    set_rms(sq_lo, sq_hi, DI, eps_out);  // its barriers also order the sums above before their reads
    // h' = h + bf16(rms * sum) in bf16
#pragma unroll
    for (int q = 0; q < H_PER_THREAD; ++q) {
      const int e = t + q * CONSUMERS;
      if (e >= nodes * rows) break;
      const int n = e / rows, j = e % rows, row = out_lo + j;
      const float o = round_bf(acc[n * MAX_OUT_ROWS + j] * rms[n]);
      const float hn = round_bf(((row & 1) ? hi_bf(hv[q]) : lo_bf(hv[q])) + o);
      h_next[n * D + row] = __float2bfloat16(hn);
    }
    if (in_w == nullptr) {
      asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
      return;
    }
    grid_barrier(counter);
    x_in = h_next;
  }
  // every CTA is resident (past the barrier, or there is none): the next kernel may launch
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  Frags a;
  float sq_lo = 0.0f, sq_hi = 0.0f;
  load_a(x_in, D, col0, nodes, lane, a);
  add_sq(a, sq_lo, sq_hi);
  set_rms(sq_lo, sq_hi, D, eps_in);
  for (int r = in_lo; r < in_hi; r += ROWS) {
    const unsigned char* slot = slots.acquire();
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    slot_mma<STEPS, ROW_STRIDE, ACC>(slot, col0, lane, a, c);
    slots.release(lane);
    const float v = reduce_slot(c);
    const int n = t / ROWS, row = r + t % ROWS;
    if (t < NT * ROWS && n < nodes && row < in_hi) zx[n * NIN + row] = __float2bfloat16(v * rms[n]);
  }
}

// A persistent kernel that runs a stack of batch-1 Mamba-2 mixer layers (folded norms) with the
// weight stream never stopping at a phase boundary. Device code only: ops/stream_layers/cuda.py
// builds it with a host launcher for the model. The shape is fixed at build time (-D D_MODEL ...).
//
// Why: the product runs three launches per layer (in_proj GEMV, step, out_proj GEMV) and loses
// ~6.6 us per layer to their boundaries (measured on an H100): while one phase waits for
// the previous phase's results, only what the waiting programs preloaded into registers streams.
// Here one CTA per SM streams its own share of every layer's weights (and SSM state) into a ring
// of shared-memory slots through the bulk-copy engine, from one producer thread, in the order the
// consumers will need them. Weights depend on no activation, so the producer runs ahead of the
// consumers by up to the ring's size across the grid-wide barriers between phases; the bus stays
// busy while the consumers wait for the other CTAs.
//
// What made it work (measured on an H100): at most one 40 KB copy per CTA in
// flight (IN_FLIGHT), the rest of the ring filling only with landed data. With every free slot
// in flight, the barrier's atomics and polls and the step's loads queue behind ~20 MB of copies
// and a deeper ring only lengthened that queue (45 us per layer, any depth); with one copy in
// flight the stream still runs at the copy rate and a deeper ring hides more (33-34.5 us at 5 slots).
// Also: the step's inputs that no phase writes are read before the barriers, and the barrier is
// CUTLASS's release/acquire pattern without fence.sc (the two fence.sc per barrier of the first
// version cost 1.5-3.3 us per layer). One 40 KB copy in flight is also about the least that keeps
// the stream at the copy rate (one 20 KB copy in flight lost bandwidth). Storing the state after
// the barrier's arrive was no faster; both variants are in the history.
//
// Layer (mamba2-2.7b shape, batch 1, bf16 weights, fp32 SSM state):
//   A  in_proj:  zx = bf16(rsqrt(mean(h^2) + eps) * (W_in h))          rows split across CTAs
//   B  step:     conv update, SSM state update, y, gate -> g (bf16)     state rows split across CTAs
//   C  out_proj: h' = bf16(h + bf16(rsqrt(mean(g^2) + eps) * (W_out g)))  rows split across CTAs
// with a grid barrier after each phase (every CTA needs all of zx's B/C rows, all of g, all of h'),
// then, when the launch is given an LM head, the final norm and the logits (rows split too).
#include <cuda_bf16.h>
#include <stdint.h>

#include "pipeline.cuh"

#ifndef N_SLOTS
#define N_SLOTS 5
#endif
#ifndef IN_FLIGHT  // copies of one CTA in flight at once; 0: no cap (every free slot filled at once)
#define IN_FLIGHT 1
#endif

namespace {

#ifndef D_MODEL  // the mamba2-2.7b shape unless the build names another
#define D_MODEL 2560
#define N_HEADS 80
#define HEAD_DIM 64
#define D_STATE 128
#define CONV_K 4
#endif
#ifndef PARAM_T  // dt_bias, A_log, D: the model's dtype (bf16) or fp32
#define PARAM_T __nv_bfloat16
#endif
constexpr int D = D_MODEL;
constexpr int H = N_HEADS, P = HEAD_DIM, S = D_STATE;
constexpr int DI = H * P;             // d_inner
constexpr int CONV = DI + 2 * S;      // conv channels (x, B, C), one group
constexpr int NIN = DI + CONV + H;    // in_proj rows: z, xBC, dt
constexpr int KC = CONV_K;            // conv width
constexpr int SEG = D;                // one in_proj row, half an out_proj row (bf16 elements)
constexpr int SEG_BYTES = SEG * 2;
constexpr int SLOT_SEGS = 8;
constexpr int SLOT_BYTES = SLOT_SEGS * SEG_BYTES;  // 40 KB
constexpr int CONSUMER_WARPS = 8;
constexpr int CONSUMERS = CONSUMER_WARPS * 32;
constexpr int THREADS = CONSUMERS + 32;  // + one producer warp
constexpr int CHUNKS = SEG / 8 / 32;     // 16-byte chunks of a segment per lane (10)
constexpr int MAX_STATE_ROWS = 64;       // state rows (x channels) per CTA: the step's shared arrays
constexpr int ROWS_PER_WARP = MAX_STATE_ROWS / CONSUMER_WARPS;
static_assert(SEG % 256 == 0, "a segment is whole 16-byte chunks for every lane");
static_assert(S == 128, "a state row is one float4 per lane, and B and C one channel per consumer thread");
static_assert(DI == 2 * D, "an out_proj row is two segments (expand 2)");

struct Layer {
  const __nv_bfloat16* in_w;   // (NIN, D)
  const __nv_bfloat16* out_w;  // (D, DI)
  const __nv_bfloat16* conv_w; // (CONV, KC)
  const __nv_bfloat16* conv_b; // (CONV)
  const PARAM_T* dt_bias;      // (H)
  const PARAM_T* A_log;        // (H)
  const PARAM_T* Dskip;        // (H)
  __nv_bfloat16* conv_state;   // (CONV, KC - 1)
  float* ssm_state;            // (H, P, S)
};

__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS) : "memory"); }

// Every CTA's consumers arrive; returns once all gridDim.x CTAs have arrived `round` times. The
// counter only grows within a launch and the kernel's end resets it. The bar.sync orders the
// CTA's writes before thread 0's release add, and the acquire poll plus the second bar.sync
// orders the other CTAs' writes before this CTA's reads (as CUTLASS's grid barrier does). No
// fence.sc (__threadfence): the release and acquire order what the barrier needs.
__device__ __forceinline__ void grid_sync(unsigned* counter, unsigned round) {
  consumers_sync();
  if (threadIdx.x == 0) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
    const unsigned target = round * gridDim.x;
    unsigned seen;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
    } while (seen < target);
  }
  consumers_sync();
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float bf_lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf_hi(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }
__device__ __forceinline__ float round_bf(float v) { return __bfloat162float(__float2bfloat16(v)); }
__device__ __forceinline__ float bf(const __nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float silu(float v) { return v / (1.0f + __expf(-v)); }

// Loads of what other CTAs wrote before the last grid barrier: from L2 (.cg, past the
// incoherent L1) and volatile with a memory clobber, so the compiler cannot hoist them above the
// barrier (the header's __ldcg is neither: a first version read stale values through it).
__device__ __forceinline__ uint4 ld_l2_u4(const void* p) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned short ld_l2_u16(const void* p) {
  unsigned short v;
  asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ float ld_l2_bf(const __nv_bfloat16* p) {
  return __uint_as_float(static_cast<uint32_t>(ld_l2_u16(p)) << 16);
}

// The eight bf16 values of a 16-byte chunk, as fp32 (the lower address in the lower half).
__device__ __forceinline__ void unpack8(const uint4 u, float (&out)[8]) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    out[2 * q] = bf_lo(w[q]);
    out[2 * q + 1] = bf_hi(w[q]);
  }
}

// The lane's CHUNKS 16-byte chunks of one segment of an L2-resident bf16 vector, as fp32.
__device__ __forceinline__ void load_segment(const __nv_bfloat16* v, int lane, float (&out)[CHUNKS * 8]) {
  const uint4* p = reinterpret_cast<const uint4*>(v);
#pragma unroll
  for (int j = 0; j < CHUNKS; ++j) {
    float c[8];
    unpack8(ld_l2_u4(p + lane + 32 * j), c);
#pragma unroll
    for (int i = 0; i < 8; ++i) out[8 * j + i] = c[i];
  }
}

// Dot product of one weight segment in shared memory with the lane's chunks of the input.
__device__ __forceinline__ float segment_dot(const unsigned char* seg, int lane, const float (&x)[CHUNKS * 8]) {
  const uint4* p = reinterpret_cast<const uint4*>(seg);
  float acc = 0.0f;
#pragma unroll
  for (int j = 0; j < CHUNKS; ++j) {
    float w[8];
    unpack8(p[lane + 32 * j], w);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc = fmaf(w[i], x[8 * j + i], acc);
  }
  return warp_sum(acc);
}

__device__ __forceinline__ float sum_squares(const float (&x)[CHUNKS * 8]) {
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < CHUNKS * 8; ++i) s = fmaf(x[i], x[i], s);
  return warp_sum(s);
}

__device__ __forceinline__ int split_lo(int n, int part, int parts) { return (int)(((long long)n * part) / parts); }

}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS, 1)
stream_layers(const Layer* __restrict__ layers, int n_layers, const __nv_bfloat16* h_in, __nv_bfloat16* h_out,
              __nv_bfloat16* zx, __nv_bfloat16* gbuf, __nv_bfloat16* hbuf, unsigned* counter, float eps_in, float eps_out,
              float dt_min, float dt_max, const __nv_bfloat16* lm_w, const __nv_bfloat16* norm_w, int vocab,
              float eps_f, float* logits) {
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* ring = smem;                                           // N_SLOTS x SLOT_BYTES
  float* bc = reinterpret_cast<float*>(smem + N_SLOTS * SLOT_BYTES);    // conv'd B and C (2S)
  float* partial = bc + 2 * S;                                          // out_proj half-row dots (2 x 32)
  float* step_dx = partial + 64;        // per state row of this CTA (at most 64): dt * x,
  float* step_decay = step_dx + 64;     // exp(dt * A),
  float* step_xd = step_decay + 64;     // x * D,
  float* step_gate = step_xd + 64;      // silu(z)
  uint64_t* full = reinterpret_cast<uint64_t*>(step_gate + 64);  // one per part of a slot
  uint64_t* empty = full + N_SLOTS;

  const int cta = blockIdx.x, ctas = gridDim.x;
  const int in_lo = split_lo(NIN, cta, ctas), in_hi = split_lo(NIN, cta + 1, ctas);
  const int st_lo = split_lo(DI, cta, ctas), st_hi = split_lo(DI, cta + 1, ctas);
  const int out_lo = split_lo(D, cta, ctas), out_hi = split_lo(D, cta + 1, ctas);
  const int lm_lo = split_lo(vocab, cta, ctas), lm_hi = split_lo(vocab, cta + 1, ctas);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  // Programmatic dependent launch (when the launcher asks for it): the next kernel (the final
  // norm) may launch now, and the weights and states stream before this kernel waits for the one
  // before it (the embedding lookup, which writes h_in: the consumers wait below).
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (threadIdx.x == 0) {
    for (int i = 0; i < N_SLOTS; ++i) {
      mbar_init(full + i, 1);
      mbar_init(empty + i, CONSUMER_WARPS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == CONSUMER_WARPS) {  // producer: every slot this CTA will consume, in order
    if (lane == 0) {
      uint64_t policy;
      asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
      unsigned k = 0;  // slots issued so far
      auto issue = [&](const void* src, uint32_t bytes) {
        const int slot = k % N_SLOTS;
        mbar_wait(empty + slot, ((k / N_SLOTS) & 1) ^ 1);
#if IN_FLIGHT > 0
        // At most IN_FLIGHT copies of this CTA in the memory system at once: the grid barrier's
        // atomics and polls, and the step's loads, queue behind every byte in flight, so the
        // rest of the ring fills only with landed data (wait for the copy IN_FLIGHT back).
        if (k >= IN_FLIGHT) {
          const unsigned back = k - IN_FLIGHT;
          mbar_wait(full + back % N_SLOTS, (back / N_SLOTS) & 1);
        }
#endif
        mbar_expect_tx(full + slot, bytes);
        bulk_load(ring + slot * SLOT_BYTES, src, bytes, full + slot, policy);
        ++k;
      };
      for (int l = 0; l < n_layers; ++l) {
        const Layer L = layers[l];
        for (int r = in_lo; r < in_hi; r += SLOT_SEGS)
          issue(L.in_w + (size_t)r * D, min(SLOT_SEGS, in_hi - r) * SEG_BYTES);
        issue(L.ssm_state + (size_t)st_lo * S, (st_hi - st_lo) * S * 4);
        for (int r = out_lo; r < out_hi; r += SLOT_SEGS / 2)
          issue(L.out_w + (size_t)r * DI, min(SLOT_SEGS / 2, out_hi - r) * 2 * SEG_BYTES);
      }
      for (int r = lm_lo; r < lm_hi; r += SLOT_SEGS)  // the LM head, when there is one (vocab > 0)
        issue(lm_w + (size_t)r * D, min(SLOT_SEGS, lm_hi - r) * SEG_BYTES);
    }
    return;
  }

  unsigned k = 0, rounds = 0;  // slots consumed, grid barriers passed
  auto acquire = [&]() -> const unsigned char* {
    const int slot = k % N_SLOTS;
    mbar_wait(full + slot, (k / N_SLOTS) & 1);
    return ring + slot * SLOT_BYTES;
  };
  auto release = [&]() {
    __syncwarp();
    if (lane == 0) mbar_arrive(empty + (k % N_SLOTS));
    ++k;
  };

  float x[CHUNKS * 8];
  asm volatile("griddepcontrol.wait;" ::: "memory");  // h_in is the previous kernel's output
  for (int l = 0; l < n_layers; ++l) {
    const Layer L = layers[l];
    const __nv_bfloat16* h = l == 0 ? h_in : hbuf + ((l - 1) & 1) * D;
    __nv_bfloat16* h_next = l == n_layers - 1 ? h_out : hbuf + (l & 1) * D;

    // Everything the step and out_proj's epilogue read that no phase of this layer writes, read
    // now so that its latency is not paid after the barriers: thread t holds B/C channel t's
    // conv taps and window, and state row st_lo + t's x-channel taps, window and head constants,
    // and out_proj row out_lo + t's residual.
    const int t = threadIdx.x;
    const int bc_ch = DI + t;
    float bc_w[KC], bc_old[KC - 1], bc_bias;
#pragma unroll
    for (int i = 0; i < KC; ++i) bc_w[i] = bf(L.conv_w[bc_ch * KC + i]);
#pragma unroll
    for (int i = 0; i < KC - 1; ++i) bc_old[i] = bf(L.conv_state[bc_ch * (KC - 1) + i]);
    bc_bias = bf(L.conv_b[bc_ch]);
    const bool owns_row = t < st_hi - st_lo;
    const int x_ch = st_lo + t, head = x_ch / P;
    float x_w[KC] = {}, x_old[KC - 1] = {}, x_bias = 0.0f, dt_bias = 0.0f, A = 0.0f, Dh = 0.0f;
    if (owns_row) {
#pragma unroll
      for (int i = 0; i < KC; ++i) x_w[i] = bf(L.conv_w[x_ch * KC + i]);
#pragma unroll
      for (int i = 0; i < KC - 1; ++i) x_old[i] = bf(L.conv_state[x_ch * (KC - 1) + i]);
      x_bias = bf(L.conv_b[x_ch]);
      dt_bias = to_f(L.dt_bias[head]);
      A = -__expf(to_f(L.A_log[head]));
      Dh = to_f(L.Dskip[head]);
    }
    const float residual = t < out_hi - out_lo ? ld_l2_bf(h + out_lo + t) : 0.0f;

    // A: in_proj. Every warp holds the lane's chunks of h and the whole row's 1/rms.
    load_segment(h, lane, x);
    const float r_in = rsqrtf(sum_squares(x) / D + eps_in);
    for (int r = in_lo; r < in_hi; r += SLOT_SEGS) {
      const unsigned char* slot = acquire();
      if (warp < in_hi - r) {
        const float dot = segment_dot(slot + warp * SEG_BYTES, lane, x);
        if (lane == 0) zx[r + warp] = __float2bfloat16(dot * r_in);
      }
      release();
    }
    grid_sync(counter, ++rounds);

    // B: the step for this CTA's state rows (h, p), one channel of x each. First one round of
    // loads per thread (its B/C channel, its row's x, z and dt) and the per-row scalars into
    // shared memory; then each warp updates its rows' states from the ring slot.
    const __nv_bfloat16* xbc = zx + DI;
    {
      const float bc_new = ld_l2_bf(xbc + bc_ch);
      float acc = bc_bias + bc_w[KC - 1] * bc_new;
#pragma unroll
      for (int i = 0; i < KC - 1; ++i) acc += bc_w[i] * bc_old[i];
      bc[t] = round_bf(silu(acc));
      if (owns_row) {
        const float x_new = ld_l2_bf(xbc + x_ch), z = ld_l2_bf(zx + x_ch);
        float dt = ld_l2_bf(zx + DI + CONV + head) + dt_bias;
        float xacc = x_bias + x_w[KC - 1] * x_new;
#pragma unroll
        for (int i = 0; i < KC - 1; ++i) xacc += x_w[i] * x_old[i];
        const float xv = round_bf(silu(xacc));
        dt = dt > 20.0f ? dt : log1pf(__expf(dt));
        dt = fminf(fmaxf(dt, dt_min), dt_max);
        step_dx[t] = dt * xv;
        step_decay[t] = __expf(dt * A);
        step_xd[t] = xv * Dh;
        step_gate[t] = silu(z);
        __nv_bfloat16* cs = L.conv_state + x_ch * (KC - 1);  // only this thread reads or writes it
        cs[0] = __float2bfloat16(x_old[1]);
        cs[1] = __float2bfloat16(x_old[2]);
        cs[2] = __float2bfloat16(x_new);
      }
    }
    consumers_sync();
    {
      const unsigned char* slot = acquire();
      const float4 Bv = reinterpret_cast<const float4*>(bc)[lane];
      const float4 Cv = reinterpret_cast<const float4*>(bc + S)[lane];
#pragma unroll
      for (int j = 0; j < ROWS_PER_WARP; ++j) {
        const int i = warp + j * CONSUMER_WARPS;
        if (i < st_hi - st_lo) {
          const float decay = step_decay[i], dx = step_dx[i];
          float4 st = reinterpret_cast<const float4*>(slot + i * S * 4)[lane];
          st.x = st.x * decay + dx * Bv.x;
          st.y = st.y * decay + dx * Bv.y;
          st.z = st.z * decay + dx * Bv.z;
          st.w = st.w * decay + dx * Bv.w;
          const float y = warp_sum(st.x * Cv.x + st.y * Cv.y + st.z * Cv.z + st.w * Cv.w) + step_xd[i];
          if (lane == 0) gbuf[st_lo + i] = __float2bfloat16(round_bf(y) * step_gate[i]);
          __stcs(reinterpret_cast<float4*>(L.ssm_state + (size_t)(st_lo + i) * S) + lane, st);
        }
      }
      release();
    }
    grid_sync(counter, ++rounds);

    // C: out_proj. Warp w takes half (w & 1) of row (w >> 1) of each slot; the lane holds its
    // chunks of that half of g and the whole g's 1/rms.
    const int half = warp & 1;
    load_segment(gbuf + (1 - half) * SEG, lane, x);
    float ss = sum_squares(x);
    load_segment(gbuf + half * SEG, lane, x);
    ss += sum_squares(x);
    const float r_out = rsqrtf(ss / DI + eps_out);
    for (int r = out_lo, i = 0; r < out_hi; r += SLOT_SEGS / 2, i += SLOT_SEGS / 2) {
      const unsigned char* slot = acquire();
      if ((warp >> 1) < out_hi - r) {
        const float dot = segment_dot(slot + warp * SEG_BYTES, lane, x);
        if (lane == 0) partial[2 * (i + (warp >> 1)) + half] = dot;
      }
      release();
    }
    consumers_sync();
    if (threadIdx.x < out_hi - out_lo) {
      const int row = out_lo + threadIdx.x;
      const float o = round_bf((partial[2 * threadIdx.x] + partial[2 * threadIdx.x + 1]) * r_out);
      h_next[row] = __float2bfloat16(residual + o);
    }
    if (cta == 0) {  // the B and C channels' conv-state shift: every CTA has read the old window
      const int ch = DI + threadIdx.x;
      __nv_bfloat16* cs = L.conv_state + ch * (KC - 1);
      const __nv_bfloat16 a = cs[1], b = cs[2];
      cs[0] = a;
      cs[1] = b;
      cs[2] = __ushort_as_bfloat16(ld_l2_u16(xbc + ch));
    }
    if (l + 1 < n_layers || vocab > 0) grid_sync(counter, ++rounds);
  }

  // D: the final RMSNorm and the LM head (vocab > 0): its rows stream on from the last out_proj's
  // with no launch between. logits = float(bf16(W_lm bf16(h * rms * w_norm))), as the model's
  // rms_norm and LM head GEMV round.
  if (vocab > 0) {
    load_segment(h_out, lane, x);
    const float r_f = rsqrtf(sum_squares(x) / D + eps_f);
    const uint4* wn = reinterpret_cast<const uint4*>(norm_w);
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j) {
      float w[8];
      unpack8(wn[lane + 32 * j], w);
#pragma unroll
      for (int i = 0; i < 8; ++i) x[8 * j + i] = round_bf(x[8 * j + i] * r_f * w[i]);
    }
    for (int r = lm_lo; r < lm_hi; r += SLOT_SEGS) {
      const unsigned char* slot = acquire();
      if (warp < lm_hi - r) {
        const float dot = segment_dot(slot + warp * SEG_BYTES, lane, x);
        if (lane == 0) logits[r + warp] = round_bf(dot);
      }
      release();
    }
  }
  // One more arrival per CTA; the last one resets the counter for the next launch (no CTA reads
  // it after its own final arrival), so the launcher needs no memset before each launch.
  consumers_sync();
  if (threadIdx.x == 0 && atomicAdd(counter, 1u) == (rounds + 1) * gridDim.x - 1) atomicExch(counter, 0u);
}

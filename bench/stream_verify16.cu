// Probe: the verify of a 16-node packed tree (batch 1, mamba2-2.7b mixer shape) as one persistent
// kernel on the weight stream of ops/stream_layers. bench/stream_verify16_probe.py builds it, checks
// it against the product's verify kernels (skinny in_proj, tree conv, gated tree scan, skinny
// out_proj with the residual add) and times it against them. Per layer, three phases between grid
// barriers, as Mamba2Mixer.folded_residual_verify runs them:
//   A  in_proj:  zx[n] = bf16(rms(h[n]) * (W_in h[n]))                 rows split across CTAs
//   M  per head (CTAs 0..79, one head each): the tree conv of the head's x channels and of B and C,
//      the time step, the tree scan from the cached state, the gate: g[n] (bf16, 64 channels)
//   C  out_proj: h'[n] = bf16(h[n] + bf16(rms(g[n]) * (W_out g[n])))   pairs of CTAs, split-K
// It also writes what the replay reads afterwards: zx (the pre-conv inputs), the conv's x and B, dt.
//
// What the projections' design rests on (runs 142-154, with bench/stream_proj16.cu, removed after
// commit 903bc29; PROJ_ONLY below measures the design it arrived at):
// - the weights stream as in kernel.cu: one producer thread, a ring of shared-memory slots of 8 rows
//   copied one bulk copy per row into padded rows, at most one slot's copies in flight;
// - the nodes' activations go straight from L2 into the tensor cores' A fragments, 16-byte loads,
//   because the contraction index is permuted within each block of 32 columns (the same way for A
//   and B; see load_a in fragments.cuh): no shared memory for them, so the ring is 4 slots deep (ACT_REG);
// - out_proj's rows are split across pairs of CTAs (clusters of 2), each CTA streaming one half of
//   the columns, so it needs one half of g; the pair adds its partial sums through distributed
//   shared memory (OUT_SPLITK).
// Switches: PROJ_ONLY (no M phase, g fixed: the projections alone, run 154's 31.2-31.8 us per
// layer); TRACE (globaltimer stamps per layer and CTA: where the time goes); NO_GRID_SYNC and
// M_NO_CONV (timing only, wrong results: no grid barriers; M without the conv's arithmetic);
// Z_BESIDE (round 14): phase A streams only in_proj's x, B, C and dt rows (over every CTA); the
// gate's z rows stream on the CTAs without a head while the heads run M, which waits for them
// (a second counter, one release per such CTA and layer) just before its gate.
#include <cuda_bf16.h>
#include <stdint.h>

#include "fragments.cuh"  // ssmspec/ops/stream_layers: A fragments from L2, bf16 pieces
#include "pipeline.cuh"   // ssmspec/ops/stream_layers

#ifndef N_SLOTS
#define N_SLOTS 4
#endif
#ifndef IN_FLIGHT  // slots whose copies the producer lets run at once
#define IN_FLIGHT 1
#endif
#ifndef Z_HEAD_ROWS  // Z_BESIDE: z rows each head CTA streams too (its ring holds them during M)
#define Z_HEAD_ROWS 0
#endif

namespace {

#ifdef TRACE
constexpr bool STAMPS = true;
#else
constexpr bool STAMPS = false;
#endif
constexpr int D = 2560, H = 80, P = 64, S = 128, K = 4, NT = 16;
constexpr int DI = H * P, CONV = DI + 2 * S, NIN = DI + CONV + H;       // 5120, 5376, 10576
constexpr int X_COL = DI, B_COL = 2 * DI, DT_COL = 2 * DI + 2 * S;      // zx columns: z | x | B | C | dt
constexpr int MC = P + 2 * S;                                            // one head's conv channels: x, B, C
constexpr int ROWS = 8, ROW_BYTES = D * 2;
constexpr int ROW_STRIDE = ROW_BYTES + 64;  // B fragments by lds.128: rows 2i and 2i + 1 in opposite bank halves
constexpr int SLOT_BYTES = ROWS * ROW_STRIDE;
constexpr int WARPS = 8, CONSUMERS = WARPS * 32, THREADS = CONSUMERS + 32;
constexpr int KW = D / WARPS, STEPS = KW / 16;  // columns per warp (320), mma k-steps per slot
constexpr int MAX_OUT_ROWS = 48;                // a pair's out_proj rows (2560 / 66: 38-39)
constexpr int TRACE_N = 14;                     // TRACE stamps per layer and CTA (8, 9: the producer's)
// M's tensor-core operands in shared memory, rows padded for conflict-free fragment loads
constexpr int XC_STRIDE = P + 8;    // fp32 x: the tf32 B operand of W.x (lanes read rows c, c + 4)
constexpr int CF_STRIDE = S + 16;   // fp32 C: tf32 A operand of C.h0 by lds.128 (rows 2i, 2i + 1 in opposite halves)
constexpr int W_STRIDE = NT + 4;    // fp32 W: tf32 A operand of W.x
constexpr int BH_STRIDE = S + 32;   // bf16 B and C: the operands of C.B by lds.128, as the weight slots
static_assert(KW % 32 == 0 && CONSUMERS == 4 * P && CONSUMERS == NT * NT && K == 4, "the thread mappings below");

__device__ __forceinline__ void consumers_sync() { named_sync<CONSUMERS>(); }
// The grid barrier in two halves: grid_arrive (after the CTA's writes), then grid_wait; loads issued
// between them overlap the wait without delaying the release (which would wait for them).
__device__ __forceinline__ void grid_arrive(unsigned* counter) {
  consumers_sync();
#ifndef NO_GRID_SYNC  // timing only (wrong results)
  if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
#endif
}
__device__ __forceinline__ void grid_wait(unsigned* counter, unsigned round) {
#ifndef NO_GRID_SYNC
  if (threadIdx.x == 0) {
    unsigned seen;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
    } while (seen < round * gridDim.x);
  }
#endif
  consumers_sync();
}
__device__ __forceinline__ void grid_sync(unsigned* counter, unsigned round) {
  grid_arrive(counter);
  grid_wait(counter, round);
}
__device__ __forceinline__ float silu(float v) { return __fdividef(v, 1.0f + __expf(-v)); }
__device__ __forceinline__ float softplus(float v) { return v > 20.0f ? v : log1pf(__expf(v)); }  // torch's threshold

// The pair handshake (clusters of 2): one arrive on the peer's mbarrier, releasing this CTA's
// shared-memory writes at cluster scope, and the matching wait with acquire.
__device__ __forceinline__ void pair_arrive(uint64_t* bar, uint32_t peer) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(bar)), "r"(peer));
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}
__device__ __forceinline__ void pair_wait(uint64_t* bar, uint32_t parity) { mbar_wait<true>(bar, parity); }
__device__ __forceinline__ uint32_t peer_addr(const void* p, uint32_t peer) {
  uint32_t a;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(smem_addr(p)), "r"(peer));
  return a;
}
__device__ __forceinline__ float ld_peer_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ uint32_t tf32(float v) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
  return r;
}
// m16n8k8 with tf32 operands (fp32 bit patterns rounded by tf32()), fp32 accumulators
__device__ __forceinline__ void mma1688(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                        uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
using Frags = AFrags<STEPS>;

}  // namespace

struct VerifyLayer {
  const __nv_bfloat16* in_w;    // (NIN, D), the pre-norm's weight folded in
  const __nv_bfloat16* out_w;   // (D, DI), the gated norm's weight folded in
  const __nv_bfloat16* conv_w;  // (CONV, K)
  const __nv_bfloat16* conv_b;  // (CONV,)
  const float* dt_bias;         // (H,)
  const float* A;               // (H,) -exp(A_log)
  const float* Dskip;           // (H,)
  const __nv_bfloat16* conv_state;  // (CONV, K - 1), oldest first
  const float* ssm_state;           // (H, P, S)
};

struct VerifyOut {  // per layer, for the replay (and zx also the in_proj output)
  __nv_bfloat16* zx;      // (n_layers, NT, NIN)
  __nv_bfloat16* x_conv;  // (n_layers, NT, DI)
  __nv_bfloat16* b_conv;  // (n_layers, NT, S)
  float* dt;              // (n_layers, NT, H)
};

extern "C" __global__ void __launch_bounds__(THREADS, 1) __cluster_dims__(2, 1, 1)
stream_verify16(const VerifyLayer* __restrict__ layers, int n_layers, const int* parents, const __nv_bfloat16* h_in,
                __nv_bfloat16* h_out, __nv_bfloat16* zx_all, __nv_bfloat16* x_conv_all, __nv_bfloat16* b_conv_all,
                float* dt_all, __nv_bfloat16* g, __nv_bfloat16* hbuf, unsigned* counter, float eps, float dt_min,
                float dt_max, unsigned long long* trace) {
  const VerifyOut out{zx_all, x_conv_all, b_conv_all, dt_all};
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* ring = smem;
  float* red = reinterpret_cast<float*>(smem + N_SLOTS * SLOT_BYTES);  // [WARPS][NT][ROWS] partial C
  float* acc = red + WARPS * NT * ROWS;                                 // [NT][MAX_OUT_ROWS] out_proj half sums
  float* sq = acc + NT * MAX_OUT_ROWS;                                  // [WARPS][NT] sums of squares
  float* rms = sq + WARPS * NT;                                         // [NT]
  float* pair_sq = rms + NT;                                            // [NT] this CTA's half of g's squares
  // M phase (one head)
  float* xc = pair_sq + NT;               // [NT][XC_STRIDE] the head's x after the conv
  float* Cf = xc + NT * XC_STRIDE;        // [NT][CF_STRIDE] C after the conv (tf32 A fragments of C.h0)
  float* wsc = Cf + NT * CF_STRIDE;       // [NT][W_STRIDE] weight of node j's input in node i's output
  float* dts = wsc + NT * W_STRIDE;       // [NT] time steps
  float* acum = dts + NT;                 // [NT] log-decay along each node's path
  float* dtraw = acum + NT;               // [NT]
  float* hp = dtraw + NT;                 // [4] the head's dt_bias, A, D (copied early, cp.async)
  unsigned* anc = reinterpret_cast<unsigned*>(hp + 4);    // [NT] bit j: node j on node i's root path
  int* win = reinterpret_cast<int*>(anc + NT);  // [NT][K] tap j's input: its row in xext, times MC
  // [K - 1 + NT][MC] the conv's inputs: the K - 1 cached ones (oldest first), then the tree nodes'
  __nv_bfloat16* xext = reinterpret_cast<__nv_bfloat16*>(win + NT * K);
  __nv_bfloat16* xin = xext + (K - 1) * MC;                         // [NT][MC] the tree nodes' rows of xext
  __nv_bfloat16* zin = xin + NT * MC;                               // [NT][P] the gate's z
  __nv_bfloat16* Bh = zin + NT * P;     // [NT][BH_STRIDE] B after the conv (bf16 fragments of C.B)
  __nv_bfloat16* Ch = Bh + NT * BH_STRIDE;  // [NT][BH_STRIDE] C after the conv
  // the head's conv parameters as stored (copied early, cp.async): its x channels, then B and C
  __nv_bfloat16* cw = Ch + NT * BH_STRIDE;  // [MC][K] taps
  __nv_bfloat16* cst = cw + MC * K;     // [MC][K - 1] cached inputs, oldest first
  __nv_bfloat16* cb = cst + MC * (K - 1);  // [MC] bias
  uint64_t* full = reinterpret_cast<uint64_t*>(cb + MC);
  uint64_t* empty = full + N_SLOTS;
  uint64_t* pair_bar = empty + N_SLOTS;  // the peer's out_proj sums are ready / it is done reading ours
  {  // the probe sizes the dynamic shared memory from this layout: stop at once if the two disagree
    uint32_t size;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(size));
    if (reinterpret_cast<unsigned char*>(pair_bar + 1) - smem > size) __trap();
  }

  const int cta = blockIdx.x, ctas = gridDim.x, rank = cta & 1;
#ifdef Z_BESIDE
  // A: the rows from x on, over every CTA; z's rows over the CTAs without a head, during M
  const int in_lo = X_COL + split_lo(NIN - X_COL, cta, ctas), in_hi = X_COL + split_lo(NIN - X_COL, cta + 1, ctas);
  // z's rows: Z_HEAD_ROWS for each head CTA, the rest over the CTAs without a head
  const bool z_cta = cta >= H;
  constexpr int ZH = Z_HEAD_ROWS * H;
  const int z_lo = z_cta ? ZH + split_lo(DI - ZH, cta - H, ctas - H) : cta * Z_HEAD_ROWS;
  const int z_hi = z_cta ? ZH + split_lo(DI - ZH, cta - H + 1, ctas - H) : (cta + 1) * Z_HEAD_ROWS;
  const unsigned z_releases = Z_HEAD_ROWS ? ctas : ctas - H;  // per layer
  unsigned* z_counter = counter + 1;
#else
  const int in_lo = split_lo(NIN, cta, ctas), in_hi = split_lo(NIN, cta + 1, ctas);
#endif
  // out_proj: the pair's rows; this CTA streams their columns [rank * 2560, rank * 2560 + 2560)
  const int out_lo = split_lo(D, cta / 2, ctas / 2), out_hi = split_lo(D, cta / 2 + 1, ctas / 2);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = threadIdx.x;
  const int head = cta;  // the M phase's head, for CTAs below H
  if (t == 0) {
    for (int i = 0; i < N_SLOTS; ++i) {
      mbar_init(full + i, 1);
      mbar_init(empty + i, WARPS);
    }
    mbar_init(pair_bar, 1);  // one arrive, from the peer
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (t < NT) {  // the tree's ancestor masks and conv windows (the same for every layer)
    unsigned mask = 0;
    for (int cur = t, steps = 0; cur >= 0 && steps < NT; cur = parents[cur], ++steps) mask |= 1u << cur;
    anc[t] = mask;
    // Tap j reads the input j tokens back along the node's path: a tree node, or once the walk has
    // passed the root, cached input K - 2 - back, as ops/tree_conv walks it.
    int cur = t, back = 0;
    for (int j = 0; j < K; ++j) {
      if (cur >= 0) {
        win[t * K + j] = (K - 1 + cur) * MC;
        cur = parents[cur];
      } else {
        win[t * K + j] = ((K - 2) - back) * MC;
        ++back;
      }
    }
  }
  // both CTAs of the pair initialised before any remote arrive; the masks before any use
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");

  if (warp == WARPS) {  // producer
    if (lane == 0) {
      uint64_t policy;
      asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
      // TRACE: the producer's waits in each layer
      RingProducer<N_SLOTS, IN_FLIGHT, SLOT_BYTES, ROW_STRIDE, ROW_BYTES, STAMPS> producer{ring, full, empty, policy};
      for (int l = 0; l < n_layers; ++l) {
        const VerifyLayer L = layers[l];
        for (int r = in_lo; r < in_hi; r += ROWS) producer.issue(L.in_w + (size_t)r * D, D, min(ROWS, in_hi - r));
#ifdef Z_BESIDE
        for (int r = z_lo; r < z_hi; r += ROWS) producer.issue(L.in_w + (size_t)r * D, D, min(ROWS, z_hi - r));
#endif
        for (int r = out_lo; r < out_hi; r += ROWS) producer.issue(L.out_w + (size_t)r * DI + rank * D, DI, min(ROWS, out_hi - r));
#ifdef TRACE
        trace[((size_t)l * ctas + cta) * TRACE_N + 8] = producer.ring_full_ns;
        trace[((size_t)l * ctas + cta) * TRACE_N + 9] = producer.in_flight_ns;
        producer.ring_full_ns = producer.in_flight_ns = 0;
#endif
      }
    }
    return;
  }

  unsigned rounds = 0;
  RingConsumer<N_SLOTS, SLOT_BYTES> slots{ring, full, empty};
  auto reduce_slot = [&](const float (&c)[4]) -> float { return slot_sums<WARPS>(c, red, warp, lane, t); };
  // Each node's sum of squares over this CTA's columns (from every warp's fragments) into dst[NT].
  auto node_sq = [&](float sq_lo, float sq_hi, float* dst) {
    rows_sq<WARPS>(sq_lo, sq_hi, sq, dst, warp, lane, t, [](float s) { return s; });
  };

#ifdef TRACE
#define STAMP(i) \
  if (t == 0) trace[((size_t)l * ctas + cta) * TRACE_N + (i)] = now_ns()
#else
#define STAMP(i)
#endif

  Frags a;
  const int col0 = warp * KW;
  for (int l = 0; l < n_layers; ++l) {
    const VerifyLayer L = layers[l];
    const __nv_bfloat16* h = l == 0 ? h_in : hbuf + ((l - 1) & 1) * NT * D;
    __nv_bfloat16* h_next = l == n_layers - 1 ? h_out : hbuf + (l & 1) * NT * D;
    __nv_bfloat16* zx = out.zx + (size_t)l * NT * NIN;

    // A: in_proj
    STAMP(0);
#ifndef PROJ_ONLY
    const bool has_head = head < H;
    if (has_head) {  // the head's conv parameters, early and asynchronously (waited for in M)
      // 16-byte pieces: taps (x: 32, B and C: 128), cached inputs (24, 96), bias (8, 32)
      for (int e = t; e < 320; e += CONSUMERS) {
        const unsigned char* src;
        unsigned char* dst;
        if (e < 160) {
          const int j = e < 32 ? e : e - 32;
          src = reinterpret_cast<const unsigned char*>(L.conv_w + (e < 32 ? head * P : DI) * K) + 16 * j;
          dst = reinterpret_cast<unsigned char*>(cw + (e < 32 ? 0 : P) * K) + 16 * j;
        } else if (e < 280) {
          const int j = e < 184 ? e - 160 : e - 184;
          src = reinterpret_cast<const unsigned char*>(L.conv_state + (e < 184 ? head * P : DI) * (K - 1)) + 16 * j;
          dst = reinterpret_cast<unsigned char*>(cst + (e < 184 ? 0 : P) * (K - 1)) + 16 * j;
        } else {
          const int j = e < 288 ? e - 280 : e - 288;
          src = reinterpret_cast<const unsigned char*>(L.conv_b + (e < 288 ? head * P : DI)) + 16 * j;
          dst = reinterpret_cast<unsigned char*>(cb + (e < 288 ? 0 : P)) + 16 * j;
        }
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
      }
      if (t < 3) {
        const float* src = t == 0 ? L.dt_bias + head : t == 1 ? L.A + head : L.Dskip + head;
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_addr(hp + t)), "l"(src) : "memory");
      }
      asm volatile("cp.async.commit_group;" ::: "memory");
    }
#endif
    float sq_lo = 0.0f, sq_hi = 0.0f;
    load_a(h, D, col0, NT, lane, a);
    add_sq(a, sq_lo, sq_hi);
    node_sq(sq_lo, sq_hi, rms);
    if (t < NT) rms[t] = rsqrtf(rms[t] / D + eps);
    consumers_sync();
    STAMP(1);
    auto in_proj_rows = [&](int lo, int hi) {  // in_proj's rows [lo, hi) of every node, from the ring
      for (int r = lo; r < hi; r += ROWS) {
        const unsigned char* slot = slots.acquire();
        float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        slot_mma<STEPS, ROW_STRIDE, 1>(slot, col0, lane, a, c);
        slots.release(lane);
        const float s = reduce_slot(c);
        if (t < NT * ROWS && r + t % ROWS < hi) zx[(t / ROWS) * NIN + r + t % ROWS] = __float2bfloat16(s * rms[t / ROWS]);
      }
    };
    in_proj_rows(in_lo, in_hi);
    STAMP(2);

    grid_arrive(counter);
#ifdef Z_BESIDE
    // z's rows, then one release for the heads' gates (the head CTAs do theirs after M3)
    auto z_rows = [&]() {
      in_proj_rows(z_lo, z_hi);
      consumers_sync();
      if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(z_counter) : "memory");
    };
    if (z_cta) z_rows();
#endif
#ifndef PROJ_ONLY
    // M, during the barrier: the head's cached state (it does not depend on this layer's in_proj),
    // as the tf32 B fragments of C.h0^T: warp w's 8 channels p = 8 w + lane / 4, the contraction
    // over S permuted within blocks of 16 columns as the projections' (lane % 4 = c holds columns
    // 16 b + 4 c .. + 3 as k-steps 2 b (k = c, c + 4) and 2 b + 1).
    float4 h0[S / 16];
    if (has_head) {
      const float4* src = reinterpret_cast<const float4*>(L.ssm_state + ((size_t)head * P + 8 * warp + (lane >> 2)) * S) +
                          (lane & 3);
#pragma unroll
      for (int b = 0; b < S / 16; ++b) h0[b] = __ldg(src + 4 * b);
    }
#endif
    grid_wait(counter, ++rounds);
    STAMP(3);

#ifndef PROJ_ONLY
    if (has_head) {
      // M1: the head's conv inputs (x channels, B, C), z and dt_raw of every node, 16-byte pieces
      constexpr int X_PIECES = P / 8, BC_PIECES = 2 * S / 8;
#ifdef Z_BESIDE
      constexpr int Z_PIECES = 0;  // z is read before the gate, once its rows are stored
#else
      constexpr int Z_PIECES = P / 8;
#endif
      constexpr int PIECES = X_PIECES + BC_PIECES + Z_PIECES;  // 48 per node (40 with Z_BESIDE)
      for (int e = t; e < NT * PIECES; e += CONSUMERS) {
        const int n = e / PIECES, j = e % PIECES;
        const __nv_bfloat16* row = zx + n * NIN;
        uint4* dst;
        const __nv_bfloat16* src;
        if (j < X_PIECES) {
          src = row + X_COL + head * P + 8 * j, dst = reinterpret_cast<uint4*>(xin + n * MC + 8 * j);
        } else if (j < X_PIECES + BC_PIECES) {
          src = row + B_COL + 8 * (j - X_PIECES), dst = reinterpret_cast<uint4*>(xin + n * MC + P + 8 * (j - X_PIECES));
        } else {
          src = row + head * P + 8 * (j - X_PIECES - BC_PIECES),
          dst = reinterpret_cast<uint4*>(zin + n * P + 8 * (j - X_PIECES - BC_PIECES));
        }
        *dst = ld_l2_v4(src);
      }
      if (t < NT) {
        const int col = DT_COL + head;
        const uint32_t pair = ld_l2_b32(zx + t * NIN + (col & ~1));
        dtraw[t] = (col & 1) ? hi_bf(pair) : lo_bf(pair);
      }
      asm volatile("cp.async.wait_all;" ::: "memory");  // the conv parameters
      for (int e = t; e < MC * (K - 1); e += CONSUMERS) xext[(e % (K - 1)) * MC + e / (K - 1)] = cst[e];  // slot-major
      consumers_sync();
      STAMP(10);

      // M2: the tree conv, rounded to bf16 as the product stores it. Work item e: channel e % MC, nodes
      // 4 (e / MC) .. + 3, five per thread; every input loaded before any product.
#ifdef M_NO_CONV  // timing only (wrong results)
      for (int e = t; e < 0; e += CONSUMERS) {
#else
      for (int e = t; e < MC * (NT / 4); e += CONSUMERS) {
#endif
        const int m = e % MC, i0 = 4 * (e / MC);
        float w[K], in[4][K];
#pragma unroll
        for (int j = 0; j < K; ++j) w[j] = __bfloat162float(cw[m * K + K - 1 - j]);  // tap j: the input j tokens back
        const __nv_bfloat16* column = xext + m;
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int4 rows = *reinterpret_cast<const int4*>(win + (i0 + u) * K);
          in[u][0] = __bfloat162float(column[rows.x]), in[u][1] = __bfloat162float(column[rows.y]);
          in[u][2] = __bfloat162float(column[rows.z]), in[u][3] = __bfloat162float(column[rows.w]);
        }
        const float bias = __bfloat162float(cb[m]);
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          float v = bias;
#pragma unroll
          for (int j = 0; j < K; ++j) v += w[j] * in[u][j];
          const int i = i0 + u;
          const __nv_bfloat16 o = __float2bfloat16(silu(v));
          if (m < P) {
            xc[i * XC_STRIDE + m] = __bfloat162float(o);
          } else if (m < P + S) {
            Bh[i * BH_STRIDE + m - P] = o;
          } else {
            Ch[i * BH_STRIDE + m - P - S] = o;
            Cf[i * CF_STRIDE + m - P - S] = __bfloat162float(o);
          }
        }
      }
      const float A = hp[1];
      if (t < NT) {
        const float dt = fminf(fmaxf(softplus(dtraw[t] + hp[0]), dt_min), dt_max);
        dts[t] = dt;
        out.dt[((size_t)l * NT + t) * H + head] = dt;
      }
      consumers_sync();
      STAMP(11);
      if (t < NT) {
        float s = 0.0f;
        for (int j = 0; j < NT; ++j)
          if (anc[t] >> j & 1) s += dts[j] * A;
        acum[t] = s;
      }
      consumers_sync();
      STAMP(12);

      // M3, tensor cores. Fragment rows: i = lane / 4 and i + 8; columns: 2 (lane % 4) + {0, 1}.
      const int fi = lane >> 2, fc = lane & 3;
      if (warp == 0) {  // W[i][j] = C_i.B_j exp(acum_i - acum_j) dt_j on i's path (bf16 products, exact)
        float sc[2][4] = {};
        for (int b = 0; b < S / 32; ++b) {
          const uint4 c_lo = *reinterpret_cast<const uint4*>(Ch + fi * BH_STRIDE + 32 * b + 8 * fc);
          const uint4 c_hi = *reinterpret_cast<const uint4*>(Ch + (fi + 8) * BH_STRIDE + 32 * b + 8 * fc);
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            const uint4 w = *reinterpret_cast<const uint4*>(Bh + (8 * nt + fi) * BH_STRIDE + 32 * b + 8 * fc);
            mma16816(sc[nt], c_lo.x, c_hi.x, c_lo.y, c_hi.y, w.x, w.y);
            mma16816(sc[nt], c_lo.z, c_hi.z, c_lo.w, c_hi.w, w.z, w.w);
          }
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int i = fi + 8 * (e >> 1), j = 8 * nt + 2 * fc + (e & 1);
            wsc[i * W_STRIDE + j] = (anc[i] >> j & 1) ? sc[nt][e] * __expf(acum[i] - acum[j]) * dts[j] : 0.0f;
          }
      }
      // every warp: C.h0^T for its 8 channels (tf32, as the product's scan)
      float fh[4] = {};
#pragma unroll
      for (int b = 0; b < S / 16; ++b) {
        const float4 c_lo = *reinterpret_cast<const float4*>(Cf + fi * CF_STRIDE + 16 * b + 4 * fc);
        const float4 c_hi = *reinterpret_cast<const float4*>(Cf + (fi + 8) * CF_STRIDE + 16 * b + 4 * fc);
        mma1688(fh, tf32(c_lo.x), tf32(c_hi.x), tf32(c_lo.y), tf32(c_hi.y), tf32(h0[b].x), tf32(h0[b].y));
        mma1688(fh, tf32(c_lo.z), tf32(c_hi.z), tf32(c_lo.w), tf32(c_hi.w), tf32(h0[b].z), tf32(h0[b].w));
      }
      consumers_sync();
      STAMP(13);

#ifdef Z_BESIDE
      if (Z_HEAD_ROWS) z_rows();
      if (threadIdx.x == 0) {  // every z row of this layer stored (one release per CTA with z rows)
        unsigned seen;
        do {
          asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(z_counter) : "memory");
        } while (seen < (unsigned)(l + 1) * z_releases);
      }
      consumers_sync();
      for (int e = t; e < NT * P / 8; e += CONSUMERS) {
        const int n = e / (P / 8), j = e % (P / 8);
        *reinterpret_cast<uint4*>(zin + n * P + 8 * j) = ld_l2_v4(zx + n * NIN + head * P + 8 * j);
      }
      consumers_sync();
#endif
      // M4: y = W.x + exp(acum_i) C_i.h0 + D x_i (tf32 W.x), g = bf16(bf16(y) silu(z)), for warp w's 8 channels
      float y[4] = {};
#pragma unroll
      for (int ks = 0; ks < NT / 8; ++ks) {
        const int j = 8 * ks + fc;
        mma1688(y, tf32(wsc[fi * W_STRIDE + j]), tf32(wsc[(fi + 8) * W_STRIDE + j]), tf32(wsc[fi * W_STRIDE + j + 4]),
                tf32(wsc[(fi + 8) * W_STRIDE + j + 4]), tf32(xc[j * XC_STRIDE + 8 * warp + fi]),
                tf32(xc[(j + 4) * XC_STRIDE + 8 * warp + fi]));
      }
      const float Dh = hp[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int i = fi + 8 * half, pc = 8 * warp + 2 * fc;
        const float e = __expf(acum[i]);
        float o[2];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const float yv = y[2 * half + u] + e * fh[2 * half + u] + Dh * xc[i * XC_STRIDE + pc + u];
          o[u] = round_bf(yv) * silu(__bfloat162float(zin[i * P + pc + u]));
        }
        *reinterpret_cast<__nv_bfloat162*>(g + i * DI + head * P + pc) = __floats2bfloat162_rn(o[0], o[1]);
      }
      // the replay's conv outputs: the head's x, and B from head 0's CTA
      for (int e = t; e < NT * P / 2; e += CONSUMERS) {
        const int i = e / (P / 2), c = 2 * (e % (P / 2));
        *reinterpret_cast<__nv_bfloat162*>(out.x_conv + ((size_t)l * NT + i) * DI + head * P + c) =
            __floats2bfloat162_rn(xc[i * XC_STRIDE + c], xc[i * XC_STRIDE + c + 1]);
      }
      if (head == 0)
        for (int e = t; e < NT * S / 8; e += CONSUMERS) {
          const int i = e / (S / 8), c = 8 * (e % (S / 8));
          *reinterpret_cast<uint4*>(out.b_conv + ((size_t)l * NT + i) * S + c) =
              *reinterpret_cast<const uint4*>(Bh + i * BH_STRIDE + c);
        }
    }
    STAMP(4);
    grid_sync(counter, ++rounds);
#endif
    STAMP(5);

    // C: out_proj, this CTA's half of the columns of the pair's rows, then the pair's sums and the residual
    sq_lo = sq_hi = 0.0f;
    load_a(g, DI, rank * D + col0, NT, lane, a);
    add_sq(a, sq_lo, sq_hi);
    for (int r = out_lo, i = 0; r < out_hi; r += ROWS, i += ROWS) {
      const unsigned char* slot = slots.acquire();
      float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      slot_mma<STEPS, ROW_STRIDE, 1>(slot, col0, lane, a, c);
      slots.release(lane);
      const float s = reduce_slot(c);
      if (t < NT * ROWS && r + t % ROWS < out_hi) acc[(t / ROWS) * MAX_OUT_ROWS + i + t % ROWS] = s;
    }
    // Each CTA holds half of every sum: its sums of squares and partial rows go to the peer through
    // distributed shared memory after one handshake, and each CTA finishes half of the pair's rows.
    // The peer writes them again only after the next grid barrier, which follows these reads.
    node_sq(sq_lo, sq_hi, pair_sq);
    if (t == 0) pair_arrive(pair_bar, rank ^ 1);
    pair_wait(pair_bar, l & 1);
    const uint32_t peer_sq = peer_addr(pair_sq, rank ^ 1), peer_acc = peer_addr(acc, rank ^ 1);
    if (t < NT) rms[t] = rsqrtf((pair_sq[t] + ld_peer_f32(peer_sq + 4 * t)) / DI + eps);
    consumers_sync();
    const int mid = out_lo + (out_hi - out_lo) / 2, fin_lo = rank ? mid : out_lo, fin_hi = rank ? out_hi : mid;
    for (int e = t; e < NT * (fin_hi - fin_lo); e += CONSUMERS) {
      const int n = e / (fin_hi - fin_lo), row = fin_lo + e % (fin_hi - fin_lo), j = row - out_lo;
      const float o = round_bf((acc[n * MAX_OUT_ROWS + j] + ld_peer_f32(peer_acc + 4 * (n * MAX_OUT_ROWS + j))) * rms[n]);
      const uint32_t hv = ld_l2_b32(h + n * D + (row & ~1));  // the pair of bf16 holding h[n][row]
      h_next[n * D + row] = __float2bfloat16(((row & 1) ? hi_bf(hv) : lo_bf(hv)) + o);
    }
    STAMP(6);
    if (l + 1 < n_layers) grid_sync(counter, ++rounds);
    STAMP(7);
  }
  // neither CTA of a pair exits while the other may still read its shared memory
  consumers_sync();
  if (t == 0) pair_arrive(pair_bar, rank ^ 1);
  pair_wait(pair_bar, n_layers & 1);
}

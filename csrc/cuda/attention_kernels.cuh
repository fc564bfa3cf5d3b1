// Device code of the fused deterministic attention (the definition: csrc/attention.h; the host
// side: csrc/cuda/attention_cuda.cu). Plain CUDA C++ with no torch types, so
// tests/csrc/attention_emu.cpp can also run these kernels under a CPU emulation of the CUDA
// execution model (tests/test_attention_cuda_emulated.py).
//
// Flash-style: a CTA owns a tile of query rows (the forward, dq) or of keys (dk, dv) and walks
// the other side tile by tile, with scores and weights in shared memory only. Every product is
// one micro-GEMM, C[m][n] += sum_x A[m][x] * B[n][x] over x ascending, each thread owning a
// TM x 4 block of C and running each of its outputs' chains itself, one fma per x: no output's
// sum is ever split across threads or tiles, so the tile sizes below change no byte. Tiles of
// the other side are taken in ascending order; a key (query) outside the allowed set is marked
// in the weight tile with a NaN pattern no arithmetic produces (kSkip) and adds no term.
//
// Kernels: fwd (two passes over the keys: the row max, then weights, l and the output),
// delta (d_i = chain dO_i . o_i), bwd_kv (dk, dv: chains over the query heads of the group, then
// the queries), bwd_q (dq: chains over the keys), probs (the weights, for need_weights). Grids
// are one-dimensional (tile_of): the tiles with the most work, of every slice, start first.
#pragma once

#include <cstdint>

#include "attention.h"

namespace ldet {
namespace attn_kernels {

using attn::fma32;

constexpr int kThreads = 256;
constexpr uint32_t kSkip = 0x7fbadbadu;      // a NaN pattern GPU arithmetic never produces
constexpr uint32_t kCanonicalNaN = 0x7fc00000u;

__host__ __device__ __forceinline__ int64_t imin(int64_t x, int64_t y) { return x < y ? x : y; }

__device__ __forceinline__ bool skipped(float w) { return __float_as_uint(w) == kSkip; }
__device__ __forceinline__ float skip_mark() { return __uint_as_float(kSkip); }
__device__ __forceinline__ float canonical(float x) { return x != x ? __uint_as_float(kCanonicalNaN) : x; }

// Tile geometry of one head-dimension class (EP: E and Ev padded with zeros).
template <int EP>
struct Tiles;
template <>
struct Tiles<64> {
  static constexpr int FQ = 64, FK = 64;    // forward and dq: query rows x keys per step
  static constexpr int KQ = 32, KK = 64;    // dk, dv: queries per step x keys owned
};
template <>
struct Tiles<128> {
  static constexpr int FQ = 64, FK = 32;
  static constexpr int KQ = 32, KK = 32;
};
template <>
struct Tiles<256> {
  static constexpr int FQ = 32, FK = 32;
  static constexpr int KQ = 32, KK = 32;
};

// Leading dimension of a shared tile whose rows hold X floats: X + 4 keeps float4 alignment and
// puts consecutive rows in different bank quads.
__host__ __device__ constexpr int ld_of(int x) { return x + 4; }

// Thread layout of a micro-GEMM with an M x N tile of C: TM x 4 outputs per thread, thread
// (ty, tx) owns rows ty * TM + r and columns tx + TX * c.
template <int M, int N>
struct Layout {
  static constexpr int TN = 4;
  static constexpr int TM = (M * N) / (kThreads * TN);
  static constexpr int TX = N / TN;
  static_assert(TM >= 1 && TM * TN * kThreads == M * N && TX * (M / TM) == kThreads, "tile does not fit 256 threads");
};

// C[m][n] += sum_x A[m * lda + x] * B[n * ldb + x] for x = 0 .. X-1 ascending (X % 4 == 0).
// kPred: a term whose A element is kSkip is left out (A holds the weights).
template <int TM, int TX, bool kPred>
__device__ __forceinline__ void mm(float (&acc)[TM][4], const float* __restrict__ A, int lda,
                                   const float* __restrict__ B, int ldb, int X, int ty, int tx) {
  const float* a0 = A + ty * TM * lda;
  const float* b0 = B + tx * ldb;
#pragma unroll 2
  for (int x = 0; x < X; x += 4) {
    float4 a[TM], b[4];
#pragma unroll
    for (int r = 0; r < TM; ++r) a[r] = *reinterpret_cast<const float4*>(a0 + r * lda + x);
#pragma unroll
    for (int c = 0; c < 4; ++c) b[c] = *reinterpret_cast<const float4*>(b0 + c * TX * ldb + x);
#define LDET_MM_STEP(F)                                                                 \
  _Pragma("unroll") for (int r = 0; r < TM; ++r) {                                      \
    if (!kPred || !skipped(a[r].F)) {                                                   \
      _Pragma("unroll") for (int c = 0; c < 4; ++c) acc[r][c] = fma32(a[r].F, b[c].F, acc[r][c]); \
    }                                                                                   \
  }
    LDET_MM_STEP(x)
    LDET_MM_STEP(y)
    LDET_MM_STEP(z)
    LDET_MM_STEP(w)
#undef LDET_MM_STEP
  }
}

template <int TM>
__device__ __forceinline__ void zero_acc(float (&acc)[TM][4]) {
#pragma unroll
  for (int r = 0; r < TM; ++r)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[r][c] = 0.0f;
}

// rows x width elements (row r at src + r * row_stride, unit stride along the row) into a
// row-major shared tile dst[r * ld + c], zero beyond (n_rows, width).
__device__ __forceinline__ void load_rows(float* dst, int ld, int rows, int cols, const void* src, int64_t base,
                                          int64_t row_stride, int n_rows, int width, int dt) {
  for (int idx = threadIdx.x; idx < rows * cols; idx += kThreads) {
    const int r = idx / cols, c = idx % cols;
    dst[r * ld + c] = (r < n_rows && c < width) ? attn::load(src, base + r * row_stride + c, dt) : 0.0f;
  }
}

// The same rows stored transposed: dst[c * ld + r]. Consecutive threads take consecutive elements
// of a row, so a warp's global reads coalesce; its shared stores, ld apart (ld = rows + 4, a
// multiple of 4 words), meet four to a bank. Taking consecutive rows instead had each warp read
// 32 rows: 32 cache lines a load, as many L1 wavefronts as the tile's arithmetic took cycles.
__device__ __forceinline__ void load_rows_t(float* dst, int ld, int rows, int cols, const void* src, int64_t base,
                                            int64_t row_stride, int n_rows, int width, int dt) {
  for (int idx = threadIdx.x; idx < rows * cols; idx += kThreads) {
    const int r = idx / cols, c = idx % cols;
    dst[c * ld + r] = (r < n_rows && c < width) ? attn::load(src, base + r * row_stride + c, dt) : 0.0f;
  }
}

// One 4-byte copy from global to shared memory that completes in the background (cp.async; a
// plain copy where that does not exist, as in the CPU emulation); zeros when !valid (src is then
// not read). copies_wait_all: this thread's copies have landed (a barrier then shows them to all).
__device__ __forceinline__ void copy4_async(uint32_t* dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 4 : 0) : "memory");
#else
  *dst = valid ? *static_cast<const uint32_t*>(src) : 0u;
#endif
}
__device__ __forceinline__ void copies_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// Whether a 16-bit tensor's rows can be staged as 4-byte pairs: every row start and the width even,
// the base 4-byte aligned.
__device__ __forceinline__ bool pairs_ok(const void* p, int64_t sb, int64_t sh, int64_t sl, int64_t width, int dt) {
  return dt != attn::kF32 && ((sb | sh | sl | width) & 1) == 0 && (reinterpret_cast<uintptr_t>(p) & 3) == 0;
}

// Two 16-bit elements (element c in the low half, c + 1 in the high), widened exactly to fp32.
__device__ __forceinline__ float2 widen_pair(uint32_t w, int dt) {
  if (dt == attn::kBF16) return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  return make_float2(attn::half_bits_to_float(uint16_t(w)), attn::half_bits_to_float(uint16_t(w >> 16)));
}

// A ROWS x COLS tile of 16-bit elements (rows at src + base + r * row_stride, zeros beyond
// (n_rows, width)), copied asynchronously into shared words while the kernel works on the tile
// before it, then widened into the fp32 tiles: the loads' latency passes under that work instead
// of stalling every thread at the barrier (the kernels' largest stall when they loaded in place),
// and takes no registers across it. Rows are COLS / 2 + 1 words apart, so the copies, the row
// widening (a warp along a row) and the transposed widening (a warp down a column) meet no bank
// twice.
template <int ROWS, int COLS>
struct Stage {
  static constexpr int W = COLS / 2, LDW = W + 1, kWords = ROWS * LDW;
  uint32_t* w;
  __device__ __forceinline__ void issue(const void* src, int64_t base, int64_t row_stride, int n_rows,
                                        int width) const {
    const uint16_t* p = static_cast<const uint16_t*>(src);
#pragma unroll 1
    for (int idx = threadIdx.x; idx < ROWS * W; idx += kThreads) {
      const int r = idx / W, cw = idx % W, c = 2 * cw;
      const bool in = r < n_rows && c < width;
      copy4_async(w + r * LDW + cw, in ? p + base + r * row_stride + c : p, in);
    }
  }
  __device__ __forceinline__ void to_rows(float* dst, int ld, int dt) const {  // dst[r * ld + c]
#pragma unroll 1
    for (int idx = threadIdx.x; idx < ROWS * W; idx += kThreads) {
      const int r = idx / W, cw = idx % W;
      *reinterpret_cast<float2*>(dst + r * ld + 2 * cw) = widen_pair(w[r * LDW + cw], dt);
    }
  }
  __device__ __forceinline__ void to_cols(float* dst, int ld, int dt) const {  // dst[c * ld + r]
#pragma unroll 1
    for (int idx = threadIdx.x; idx < ROWS * W; idx += kThreads) {
      const int r = idx % ROWS, cw = idx / ROWS;
      const float2 f = widen_pair(w[r * LDW + cw], dt);
      dst[2 * cw * ld + r] = f.x;
      dst[(2 * cw + 1) * ld + r] = f.y;
    }
  }
};

// A ROWS x COLS tile into dst[r * ld + c] and, from the same loads, transposed into
// dst_t[c * ld_t + r]: the layouts load_rows and load_rows_t give, from one read of the tile.
// Eight loads are in flight at a time (all of a thread's share would take registers that the
// callers' accumulators need).
template <int ROWS, int COLS>
__device__ __forceinline__ void load_tile2(float* dst, int ld, float* dst_t, int ld_t, const void* src, int64_t base,
                                           int64_t row_stride, int n_rows, int width, int dt) {
  constexpr int N = ROWS * COLS / kThreads, G = N < 8 ? N : 8;
  static_assert(N * kThreads == ROWS * COLS && N % G == 0, "tile does not split over the threads");
#pragma unroll 1
  for (int e0 = 0; e0 < N; e0 += G) {
    float v[G];
#pragma unroll
    for (int e = 0; e < G; ++e) {
      const int idx = int(threadIdx.x) + (e0 + e) * kThreads, r = idx / COLS, c = idx % COLS;
      v[e] = (r < n_rows && c < width) ? attn::load(src, base + r * row_stride + c, dt) : 0.0f;
    }
#pragma unroll
    for (int e = 0; e < G; ++e) {
      const int idx = int(threadIdx.x) + (e0 + e) * kThreads, r = idx / COLS, c = idx % COLS;
      dst[r * ld + c] = v[e];
      dst_t[c * ld_t + r] = v[e];
    }
  }
}

__device__ __forceinline__ int64_t q_base(const attn::Shape& s, int64_t b, int64_t h) { return b * s.q_sb + h * s.q_sh; }
__device__ __forceinline__ int64_t k_base(const attn::Shape& s, int64_t b, int64_t hk) { return b * s.k_sb + hk * s.k_sh; }
__device__ __forceinline__ int64_t v_base(const attn::Shape& s, int64_t b, int64_t hk) { return b * s.v_sb + hk * s.v_sh; }

// Block u of a one-dimensional grid over n_tiles tiles of each of B * heads slices: the slowest
// index is the tile, the longest first (descending query tiles for the forward and dq, whose
// causal rows grow with the tile; ascending key tiles for dk, dv).
struct TileOf {
  int64_t tile, b, h;
};
__device__ __forceinline__ TileOf tile_of(int64_t u, int64_t n_tiles, int64_t B, int64_t heads, bool descending) {
  const int64_t slices = B * heads, t = u / slices, bh = u % slices;
  return {descending ? n_tiles - 1 - t : t, bh / heads, bh % heads};
}

// Whether every (query, key) pair of the tile is allowed: in range, no boolean mask, and (when
// causal) every key at or before every query.
__device__ __forceinline__ bool tile_full(const AttnLaunch& a, int64_t i0, int bq, int64_t j0, int bk) {
  if (a.mask.kind == attn::Mask::kBool || j0 + bk > a.shape.Lk) return false;
  return !a.mask.causal || j0 + bk - 1 <= i0;
}

// Number of key tiles a query tile starting at i0 (bq rows) may reach.
__device__ __forceinline__ int key_tiles(const AttnLaunch& a, int64_t i0, int bq, int bk) {
  int64_t lk = a.shape.Lk;
  if (a.mask.causal) lk = imin(lk, i0 + bq);
  return int((lk + bk - 1) / bk);
}

// The allowed test and the masked score of element (i, j), i < Lq, j < Lk.
__device__ __forceinline__ bool allowed(const AttnLaunch& a, int64_t b, int64_t h, int64_t i, int64_t j) {
  return i < a.shape.Lq && j < a.shape.Lk && a.mask.allowed(b, h, i, j);
}

// Which kernels stage their 16-bit tiles (Stage), by head dimension class: where the stages fit
// beside the tiles without costing a block a multiprocessor. Two blocks stay: the forward at 64
// and 128, dk/dv at 64, dq at 64 with k staged and v loaded in place. dq at 128 holds one block
// with or without its stages; dk/dv at 128 would drop to one. At 256 the tiles alone take most
// of the shared memory.
template <int EP>
constexpr bool kFwdStaged = EP <= 128;
template <int EP>
constexpr bool kKvStaged = EP == 64;
template <int EP>
constexpr bool kQStagedK = EP <= 128;
template <int EP>
constexpr bool kQStagedV = EP == 128;

// ------------------------------------------------------------------------------------------------
// Forward. Shared: q_r [FQ][EP+4], k_r [FK][EP+4], v_t [EP][FK+4], w_r [FQ][FK+4], e_r [FQ][FK+4]
// (dropout only), m_s, r_s [FQ], then the stages of k and v (kFwdStaged).
template <int EP>
__global__ void __launch_bounds__(kThreads) attn_fwd_kernel(AttnLaunch a, const void* __restrict__ q,
                                                             const void* __restrict__ k, const void* __restrict__ v,
                                                             float* __restrict__ o, float* __restrict__ stats) {
  constexpr int BQ = Tiles<EP>::FQ, BK = Tiles<EP>::FK;
  constexpr int LDE = ld_of(EP), LDK = ld_of(BK);
  using SL = Layout<BQ, BK>;
  using OL = Layout<BQ, EP>;
  extern __shared__ float4 smem4[];  // tests/csrc/attention_emu.cpp defines it for the emulation
  float* q_r = reinterpret_cast<float*>(smem4);
  float* k_r = q_r + BQ * LDE;
  float* v_t = k_r + BK * LDE;
  float* w_r = v_t + EP * LDK;
  float* e_r = a.dropout.on ? w_r + BQ * LDK : w_r;
  float* m_s = w_r + 2 * BQ * LDK;
  float* r_s = m_s + BQ;
  const auto& s = a.shape;
  const int tid = threadIdx.x;
  const TileOf t = tile_of(blockIdx.x, (s.Lq + BQ - 1) / BQ, s.B, s.H, true);
  const int64_t b = t.b, h = t.h, hk = h / (s.H / s.Hkv), i0 = t.tile * BQ;
  load_rows(q_r, LDE, BQ, EP, q, q_base(s, b, h) + i0 * s.q_sl, s.q_sl, int(imin(BQ, s.Lq - i0)), int(s.E),
            s.dtype);
  const int n_kt = key_tiles(a, i0, BQ, BK);
  const int sty = tid / SL::TX, stx = tid % SL::TX;
  // 16-bit k and v go through the stages (kFwdStaged); fp32 or odd layouts load in place
  using KStage = Stage<BK, EP>;
  const KStage sk{reinterpret_cast<uint32_t*>(r_s + BQ)}, sv{sk.w + KStage::kWords};
  const bool staged = kFwdStaged<EP> && pairs_ok(k, s.k_sb, s.k_sh, s.k_sl, s.E, s.dtype) &&
                      pairs_ok(v, s.v_sb, s.v_sh, s.v_sl, s.Ev, s.dtype);
  auto issue = [&](int kt, bool with_v) {
    const int64_t j0 = int64_t(kt) * BK;
    const int nk = int(imin(BK, s.Lk - j0));
    sk.issue(k, k_base(s, b, hk) + j0 * s.k_sl, s.k_sl, nk, int(s.E));
    if (with_v) sv.issue(v, v_base(s, b, hk) + j0 * s.v_sl, s.v_sl, nk, int(s.Ev));
  };

  // pass 1: m_i, over allowed keys (NaN ignored); the max has no order
  float mrow[SL::TM];
#pragma unroll
  for (int r = 0; r < SL::TM; ++r) mrow[r] = -INFINITY;
  if (staged && n_kt > 0) issue(0, false);
  for (int kt = 0; kt < n_kt; ++kt) {
    const int64_t j0 = int64_t(kt) * BK;
    copies_wait_all();
    __syncthreads();
    if (staged)
      sk.to_rows(k_r, LDE, s.dtype);
    else
      load_rows(k_r, LDE, BK, EP, k, k_base(s, b, hk) + j0 * s.k_sl, s.k_sl, int(imin(BK, s.Lk - j0)), int(s.E),
                s.dtype);
    __syncthreads();
    if (staged && kt + 1 < n_kt) issue(kt + 1, false);
    float acc[SL::TM][4];
    zero_acc(acc);
    mm<SL::TM, SL::TX, false>(acc, q_r, LDE, k_r, LDE, EP, sty, stx);
#pragma unroll
    for (int r = 0; r < SL::TM; ++r)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int64_t i = i0 + sty * SL::TM + r, j = j0 + stx + SL::TX * c;
        if (allowed(a, b, h, i, j))
          mrow[r] = attn::row_max_step(mrow[r], a.mask.apply(attn::score(acc[r][c], a.scale), b, h, i, j));
      }
  }
#pragma unroll
  for (int r = 0; r < SL::TM; ++r) {
    for (int off = SL::TX / 2; off >= 1; off /= 2)
      mrow[r] = attn::row_max_step(mrow[r], __shfl_xor_sync(0xffffffffu, mrow[r], off));
    if (stx == 0) m_s[sty * SL::TM + r] = attn::row_max_final(mrow[r]);
  }

  // pass 2: e, l (thread tid < BQ owns row tid's chain) and u
  float l = 0.0f;
  float out[OL::TM][4];
  zero_acc(out);
  const int oty = tid / OL::TX, otx = tid % OL::TX;
  if (staged && n_kt > 0) issue(0, true);
  for (int kt = 0; kt < n_kt; ++kt) {
    const int64_t j0 = int64_t(kt) * BK;
    const int nk = int(imin(BK, s.Lk - j0));
    copies_wait_all();
    __syncthreads();
    if (staged) {
      sk.to_rows(k_r, LDE, s.dtype);
      sv.to_cols(v_t, LDK, s.dtype);
    } else {
      load_rows(k_r, LDE, BK, EP, k, k_base(s, b, hk) + j0 * s.k_sl, s.k_sl, nk, int(s.E), s.dtype);
      load_rows_t(v_t, LDK, BK, EP, v, v_base(s, b, hk) + j0 * s.v_sl, s.v_sl, nk, int(s.Ev), s.dtype);
    }
    __syncthreads();
    if (staged && kt + 1 < n_kt) issue(kt + 1, true);
    float acc[SL::TM][4];
    zero_acc(acc);
    mm<SL::TM, SL::TX, false>(acc, q_r, LDE, k_r, LDE, EP, sty, stx);
#pragma unroll
    for (int r = 0; r < SL::TM; ++r)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int il = sty * SL::TM + r, jl = stx + SL::TX * c;
        const int64_t i = i0 + il, j = j0 + jl;
        float e = skip_mark(), w = skip_mark();
        if (allowed(a, b, h, i, j)) {
          e = canonical(attn::weight(a.mask.apply(attn::score(acc[r][c], a.scale), b, h, i, j), m_s[il]));
          w = a.dropout.on ? canonical(e * a.dropout.multiplier(b, h, i, j, s.Lq, s.Lk)) : e;
        }
        w_r[il * LDK + jl] = w;
        if (a.dropout.on) e_r[il * LDK + jl] = e;
      }
    __syncthreads();
    if (tid < BQ) {
      for (int x = 0; x < BK; ++x) {
        const float e = e_r[tid * LDK + x];
        if (!skipped(e)) l = l + e;
      }
    }
    if (tile_full(a, i0, BQ, j0, BK))
      mm<OL::TM, OL::TX, false>(out, w_r, LDK, v_t, LDK, BK, oty, otx);
    else
      mm<OL::TM, OL::TX, true>(out, w_r, LDK, v_t, LDK, BK, oty, otx);
  }
  if (tid < BQ) r_s[tid] = attn::reciprocal(l);
  __syncthreads();
  const int64_t row0 = (b * s.H + h) * s.Lq;
#pragma unroll
  for (int r = 0; r < OL::TM; ++r) {
    const int il = oty * OL::TM + r;
    const int64_t i = i0 + il;
    if (i >= s.Lq) continue;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int col = otx + OL::TX * c;
      if (col < s.Ev) o[(row0 + i) * s.Ev + col] = canonical(out[r][c] * r_s[il]);
    }
  }
  if (tid < BQ && i0 + tid < s.Lq) {
    stats[(row0 + i0 + tid) * 2] = m_s[tid];
    stats[(row0 + i0 + tid) * 2 + 1] = canonical(r_s[tid]);
  }
}

template <int EP>
constexpr size_t fwd_smem() {
  constexpr int BQ = Tiles<EP>::FQ, BK = Tiles<EP>::FK;
  return sizeof(float) * (size_t(BQ) * ld_of(EP) + size_t(BK) * ld_of(EP) + size_t(EP) * ld_of(BK) +
                          2 * size_t(BQ) * ld_of(BK) + 2 * BQ + (kFwdStaged<EP> ? 2 * Stage<BK, EP>::kWords : 0));
}

// ------------------------------------------------------------------------------------------------
// d_i = chain_c dO_ic o_ic, one thread a row.
__global__ void attn_delta_kernel(const void* __restrict__ dout, const float* __restrict__ o, float* __restrict__ d,
                                  int64_t rows, int64_t ev, int dt) {
  const int64_t row = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= rows) return;
  float acc = 0.0f;
  for (int64_t c = 0; c < ev; ++c) acc = fma32(attn::load(dout, row * ev + c, dt), o[row * ev + c], acc);
  d[row] = acc;
}

// The backward's per-element step for S/dP accumulators of one thread: writes pk (or kSkip) and
// ds for element (i, j) and returns whether it is allowed.
__device__ __forceinline__ void grad_element(const AttnLaunch& a, int64_t b, int64_t h, int64_t i, int64_t j,
                                             float s_chain, float dp_chain, float m, float r, float d, float* pk,
                                             float* ds) {
  if (!allowed(a, b, h, i, j)) {
    *pk = skip_mark();
    *ds = skip_mark();
    return;
  }
  const float p = attn::weight(a.mask.apply(attn::score(s_chain, a.scale), b, h, i, j), m) * r;
  float dp = attn::chain_end(dp_chain), pkv = p;
  if (a.dropout.on) {
    const float mult = a.dropout.multiplier(b, h, i, j, a.shape.Lq, a.shape.Lk);
    pkv = p * mult;
    dp = dp * mult;
  }
  *pk = canonical(pkv);
  *ds = canonical(attn::grad_score(p, dp, d, a.scale));
}

// The backward's shared step on one (query tile, key tile): S = q k^T and dP = dO v^T as
// micro-GEMMs over the head dimension, then grad_element for each of the thread's elements,
// handed to store(il, jl, pk, ds). Rows: the BQ queries from i0, columns: the BK keys from j0.
template <int EP, int BQ, int BK, class Store>
__device__ __forceinline__ void grad_tile(const AttnLaunch& a, int64_t b, int64_t h, int64_t i0, int64_t j0,
                                          const float* q_r, const float* do_r, const float* k_r, const float* v_r,
                                          const float* m_s, const float* r_s, const float* d_s, Store store) {
  using SL = Layout<BQ, BK>;
  constexpr int LDE = ld_of(EP);
  const int sty = int(threadIdx.x) / SL::TX, stx = int(threadIdx.x) % SL::TX;
  float acc_s[SL::TM][4], acc_p[SL::TM][4];
  zero_acc(acc_s);
  zero_acc(acc_p);
  mm<SL::TM, SL::TX, false>(acc_s, q_r, LDE, k_r, LDE, EP, sty, stx);
  mm<SL::TM, SL::TX, false>(acc_p, do_r, LDE, v_r, LDE, EP, sty, stx);
#pragma unroll
  for (int r = 0; r < SL::TM; ++r)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int il = sty * SL::TM + r, jl = stx + SL::TX * c;
      float pk, ds;
      grad_element(a, b, h, i0 + il, j0 + jl, acc_s[r][c], acc_p[r][c], m_s[il], r_s[il], d_s[il], &pk, &ds);
      store(il, jl, pk, ds);
    }
}

// m, r and d of the BQ query rows from row0 (global row index) into shared memory; 0 past nq.
__device__ __forceinline__ void load_row_stats(float* m_s, float* r_s, float* d_s, int bq, int nq,
                                               const float* stats, const float* delta, int64_t row0) {
  const int tid = int(threadIdx.x);
  if (tid < bq) {
    m_s[tid] = tid < nq ? stats[(row0 + tid) * 2] : 0.0f;
    r_s[tid] = tid < nq ? stats[(row0 + tid) * 2 + 1] : 0.0f;
    d_s[tid] = tid < nq ? delta[row0 + tid] : 0.0f;
  }
}

// Blocks of dq a multiprocessor holds at once: two at head dimension 64, where two fit the shared
// memory and the 128-register cap spills nothing (ptxas; uncapped it takes 168 registers, so one
// block, whose loads and barriers then have no other block's work to hide behind).
template <int EP>
constexpr int kBwdQMinBlocks = EP == 64 ? 2 : 1;

// ------------------------------------------------------------------------------------------------
// dq. Shared: q_r, do_r [BQ][EP+4], k_r, v_r [BK][EP+4], k_t [EP][BK+4], ds_r [BQ][BK+4],
// m_s, r_s, d_s [BQ], then the stages of k and v (kQStagedK, kQStagedV).
template <int EP>
__global__ void __launch_bounds__(kThreads, kBwdQMinBlocks<EP>)
    attn_bwd_q_kernel(AttnLaunch a, const void* __restrict__ q, const void* __restrict__ k, const void* __restrict__ v,
                      const void* __restrict__ dout, const float* __restrict__ stats, const float* __restrict__ delta,
                      float* __restrict__ dq) {
  constexpr int BQ = Tiles<EP>::FQ, BK = Tiles<EP>::FK;
  constexpr int LDE = ld_of(EP), LDK = ld_of(BK);
  using QL = Layout<BQ, EP>;
  extern __shared__ float4 smem4[];  // tests/csrc/attention_emu.cpp defines it for the emulation
  float* q_r = reinterpret_cast<float*>(smem4);
  float* do_r = q_r + BQ * LDE;
  float* k_r = do_r + BQ * LDE;
  float* v_r = k_r + BK * LDE;
  float* k_t = v_r + BK * LDE;
  float* ds_r = k_t + EP * LDK;
  float* m_s = ds_r + BQ * LDK;
  float* r_s = m_s + BQ;
  float* d_s = r_s + BQ;
  const auto& s = a.shape;
  const int tid = threadIdx.x;
  const TileOf t = tile_of(blockIdx.x, (s.Lq + BQ - 1) / BQ, s.B, s.H, true);
  const int64_t b = t.b, h = t.h, hk = h / (s.H / s.Hkv), i0 = t.tile * BQ;
  const int nq = int(imin(BQ, s.Lq - i0));
  const int64_t row0 = (b * s.H + h) * s.Lq + i0;
  load_rows(q_r, LDE, BQ, EP, q, q_base(s, b, h) + i0 * s.q_sl, s.q_sl, nq, int(s.E), s.dtype);
  load_rows(do_r, LDE, BQ, EP, dout, row0 * s.Ev, s.Ev, nq, int(s.Ev), s.dtype);
  load_row_stats(m_s, r_s, d_s, BQ, nq, stats, delta, row0);
  const int n_kt = key_tiles(a, i0, BQ, BK);
  const int qty = tid / QL::TX, qtx = tid % QL::TX;
  float acc_q[QL::TM][4];
  zero_acc(acc_q);
  // 16-bit k (and at 128 v) through the stages (kQStagedK, kQStagedV)
  using KStage = Stage<BK, EP>;
  const KStage sk{reinterpret_cast<uint32_t*>(d_s + BQ)}, sv{sk.w + KStage::kWords};
  const bool stage_k = kQStagedK<EP> && pairs_ok(k, s.k_sb, s.k_sh, s.k_sl, s.E, s.dtype);
  const bool stage_v = kQStagedV<EP> && pairs_ok(v, s.v_sb, s.v_sh, s.v_sl, s.Ev, s.dtype);
  auto issue = [&](int kt) {
    const int64_t j0 = int64_t(kt) * BK;
    const int nk = int(imin(BK, s.Lk - j0));
    if (stage_k) sk.issue(k, k_base(s, b, hk) + j0 * s.k_sl, s.k_sl, nk, int(s.E));
    if (stage_v) sv.issue(v, v_base(s, b, hk) + j0 * s.v_sl, s.v_sl, nk, int(s.Ev));
  };
  if (n_kt > 0) issue(0);
  for (int kt = 0; kt < n_kt; ++kt) {
    const int64_t j0 = int64_t(kt) * BK;
    const int nk = int(imin(BK, s.Lk - j0));
    copies_wait_all();
    __syncthreads();
    if (stage_k) {
      sk.to_rows(k_r, LDE, s.dtype);
      sk.to_cols(k_t, LDK, s.dtype);
    } else {
      load_tile2<BK, EP>(k_r, LDE, k_t, LDK, k, k_base(s, b, hk) + j0 * s.k_sl, s.k_sl, nk, int(s.E), s.dtype);
    }
    if (stage_v)
      sv.to_rows(v_r, LDE, s.dtype);
    else
      load_rows(v_r, LDE, BK, EP, v, v_base(s, b, hk) + j0 * s.v_sl, s.v_sl, nk, int(s.Ev), s.dtype);
    __syncthreads();
    if (kt + 1 < n_kt) issue(kt + 1);
    grad_tile<EP, BQ, BK>(a, b, h, i0, j0, q_r, do_r, k_r, v_r, m_s, r_s, d_s,
                          [&](int il, int jl, float, float ds) { ds_r[il * LDK + jl] = ds; });
    __syncthreads();
    if (tile_full(a, i0, BQ, j0, BK))
      mm<QL::TM, QL::TX, false>(acc_q, ds_r, LDK, k_t, LDK, BK, qty, qtx);
    else
      mm<QL::TM, QL::TX, true>(acc_q, ds_r, LDK, k_t, LDK, BK, qty, qtx);
  }
#pragma unroll
  for (int r = 0; r < QL::TM; ++r) {
    const int il = qty * QL::TM + r;
    if (il >= nq) continue;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int col = qtx + QL::TX * c;
      if (col < s.E) dq[(row0 + il) * s.E + col] = canonical(acc_q[r][c]);
    }
  }
}

template <int EP>
constexpr size_t bwd_q_smem() {
  constexpr int BQ = Tiles<EP>::FQ, BK = Tiles<EP>::FK;
  return sizeof(float) * (2 * size_t(BQ) * ld_of(EP) + 2 * size_t(BK) * ld_of(EP) + size_t(EP) * ld_of(BK) +
                          size_t(BQ) * ld_of(BK) + 3 * BQ +
                          (int(kQStagedK<EP>) + int(kQStagedV<EP>)) * Stage<BK, EP>::kWords);
}

// ------------------------------------------------------------------------------------------------
// dk, dv. Shared: k_r, v_r [BK][EP+4] (the CTA's keys), q_r, do_r [BQ][EP+4], q_t, do_t
// [EP][BQ+4], pk_t, ds_t [BK][BQ+4], m_s, r_s, d_s [BQ], then the stages of q and dO (kKvStaged).
template <int EP>
__global__ void __launch_bounds__(kThreads) attn_bwd_kv_kernel(AttnLaunch a, const void* __restrict__ q,
                                                                const void* __restrict__ k, const void* __restrict__ v,
                                                                const void* __restrict__ dout,
                                                                const float* __restrict__ stats,
                                                                const float* __restrict__ delta,
                                                                float* __restrict__ dk, float* __restrict__ dv) {
  constexpr int BQ = Tiles<EP>::KQ, BK = Tiles<EP>::KK;
  constexpr int LDE = ld_of(EP), LDQ = ld_of(BQ);
  using KL = Layout<BK, EP>;
  extern __shared__ float4 smem4[];  // tests/csrc/attention_emu.cpp defines it for the emulation
  float* k_r = reinterpret_cast<float*>(smem4);
  float* v_r = k_r + BK * LDE;
  float* q_r = v_r + BK * LDE;
  float* do_r = q_r + BQ * LDE;
  float* q_t = do_r + BQ * LDE;
  float* do_t = q_t + EP * LDQ;
  float* pk_t = do_t + EP * LDQ;
  float* ds_t = pk_t + BK * LDQ;
  float* m_s = ds_t + BK * LDQ;
  float* r_s = m_s + BQ;
  float* d_s = r_s + BQ;
  const auto& s = a.shape;
  const int tid = threadIdx.x;
  const TileOf t = tile_of(blockIdx.x, (s.Lk + BK - 1) / BK, s.B, s.Hkv, false);
  const int64_t b = t.b, hk = t.h, group = s.H / s.Hkv, j0 = t.tile * BK;
  const int nk = int(imin(BK, s.Lk - j0));
  load_rows(k_r, LDE, BK, EP, k, k_base(s, b, hk) + j0 * s.k_sl, s.k_sl, nk, int(s.E), s.dtype);
  load_rows(v_r, LDE, BK, EP, v, v_base(s, b, hk) + j0 * s.v_sl, s.v_sl, nk, int(s.Ev), s.dtype);
  const int kty = tid / KL::TX, ktx = tid % KL::TX;
  float acc_k[KL::TM][4], acc_v[KL::TM][4];
  zero_acc(acc_k);
  zero_acc(acc_v);
  const int64_t qt0 = a.mask.causal ? j0 / BQ : 0;  // queries before the first key see none of it
  const int64_t n_qt = (s.Lq + BQ - 1) / BQ;
  // 16-bit q and dO of the next (head, query tile) through the stages (kKvStaged)
  using QStage = Stage<BQ, EP>;
  const QStage sq{reinterpret_cast<uint32_t*>(d_s + BQ)}, sdo{sq.w + QStage::kWords};
  const bool staged = kKvStaged<EP> && pairs_ok(q, s.q_sb, s.q_sh, s.q_sl, s.E, s.dtype) &&
                      pairs_ok(dout, s.H * s.Lq * s.Ev, s.Lq * s.Ev, s.Ev, s.Ev, s.dtype);
  auto issue = [&](int64_t hh, int64_t qt) {
    const int64_t h = hk * group + hh, i0 = qt * BQ;
    const int nq = int(imin(BQ, s.Lq - i0));
    sq.issue(q, q_base(s, b, h) + i0 * s.q_sl, s.q_sl, nq, int(s.E));
    sdo.issue(dout, ((b * s.H + h) * s.Lq + i0) * s.Ev, s.Ev, nq, int(s.Ev));
  };
  if (staged && qt0 < n_qt) issue(0, qt0);
  for (int64_t hh = 0; hh < group; ++hh) {
    const int64_t h = hk * group + hh;
    for (int64_t qt = qt0; qt < n_qt; ++qt) {
      const int64_t i0 = qt * BQ;
      const int nq = int(imin(BQ, s.Lq - i0));
      const int64_t row0 = (b * s.H + h) * s.Lq + i0;
      copies_wait_all();
      __syncthreads();
      if (staged) {
        sq.to_rows(q_r, LDE, s.dtype);
        sq.to_cols(q_t, LDQ, s.dtype);
        sdo.to_rows(do_r, LDE, s.dtype);
        sdo.to_cols(do_t, LDQ, s.dtype);
      } else {
        load_tile2<BQ, EP>(q_r, LDE, q_t, LDQ, q, q_base(s, b, h) + i0 * s.q_sl, s.q_sl, nq, int(s.E), s.dtype);
        load_tile2<BQ, EP>(do_r, LDE, do_t, LDQ, dout, row0 * s.Ev, s.Ev, nq, int(s.Ev), s.dtype);
      }
      load_row_stats(m_s, r_s, d_s, BQ, nq, stats, delta, row0);
      __syncthreads();
      if (staged) {
        if (qt + 1 < n_qt)
          issue(hh, qt + 1);
        else if (hh + 1 < group)
          issue(hh + 1, qt0);
      }
      grad_tile<EP, BQ, BK>(a, b, h, i0, j0, q_r, do_r, k_r, v_r, m_s, r_s, d_s, [&](int il, int jl, float pk, float ds) {
        pk_t[jl * LDQ + il] = pk;
        ds_t[jl * LDQ + il] = ds;
      });
      __syncthreads();
      // dv += pk^T dO and dk += ds^T q, one pass over the queries: both chains skip where pk does
      const bool full = tile_full(a, i0, BQ, j0, BK) && i0 + BQ <= s.Lq;
      const float* a_pk = pk_t + kty * KL::TM * LDQ;
      const float* a_ds = ds_t + kty * KL::TM * LDQ;
      const float* b_do = do_t + ktx * LDQ;
      const float* b_q = q_t + ktx * LDQ;
#pragma unroll 1
      for (int x = 0; x < BQ; x += 4) {
        float4 pa[KL::TM], sa[KL::TM], db[4], qb[4];
#pragma unroll
        for (int r = 0; r < KL::TM; ++r) {
          pa[r] = *reinterpret_cast<const float4*>(a_pk + r * LDQ + x);
          sa[r] = *reinterpret_cast<const float4*>(a_ds + r * LDQ + x);
        }
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          db[c] = *reinterpret_cast<const float4*>(b_do + c * KL::TX * LDQ + x);
          qb[c] = *reinterpret_cast<const float4*>(b_q + c * KL::TX * LDQ + x);
        }
#define LDET_KV_STEP(F)                                                      \
  _Pragma("unroll") for (int r = 0; r < KL::TM; ++r) {                       \
    if (full || !skipped(pa[r].F)) {                                         \
      _Pragma("unroll") for (int c = 0; c < 4; ++c) {                        \
        acc_v[r][c] = fma32(pa[r].F, db[c].F, acc_v[r][c]);                  \
        acc_k[r][c] = fma32(sa[r].F, qb[c].F, acc_k[r][c]);                  \
      }                                                                      \
    }                                                                        \
  }
        LDET_KV_STEP(x)
        LDET_KV_STEP(y)
        LDET_KV_STEP(z)
        LDET_KV_STEP(w)
#undef LDET_KV_STEP
      }
    }
  }
  const int64_t key0 = (b * s.Hkv + hk) * s.Lk + j0;
#pragma unroll
  for (int r = 0; r < KL::TM; ++r) {
    const int jl = kty * KL::TM + r;
    if (jl >= nk) continue;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int col = ktx + KL::TX * c;
      if (col < s.E) dk[(key0 + jl) * s.E + col] = canonical(acc_k[r][c]);
      if (col < s.Ev) dv[(key0 + jl) * s.Ev + col] = canonical(acc_v[r][c]);
    }
  }
}

template <int EP>
constexpr size_t bwd_kv_smem() {
  constexpr int BQ = Tiles<EP>::KQ, BK = Tiles<EP>::KK;
  return sizeof(float) * (2 * size_t(BK) * ld_of(EP) + 2 * size_t(BQ) * ld_of(EP) + 2 * size_t(EP) * ld_of(BQ) +
                          2 * size_t(BK) * ld_of(BQ) + 3 * BQ + (kKvStaged<EP> ? 2 * Stage<BQ, EP>::kWords : 0));
}

// ------------------------------------------------------------------------------------------------
// probs: one thread per (row, key), the score chain read straight from global memory.
__global__ void attn_probs_kernel(AttnLaunch a, const void* __restrict__ q, const void* __restrict__ k,
                                  const float* __restrict__ stats, float* __restrict__ p) {
  const auto& s = a.shape;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= s.B * s.H * s.Lq * s.Lk) return;
  const int64_t j = idx % s.Lk, row = idx / s.Lk, i = row % s.Lq, h = (row / s.Lq) % s.H, b = row / (s.Lq * s.H);
  const int64_t hk = h / (s.H / s.Hkv);
  float out = 0.0f;
  if (a.mask.allowed(b, h, i, j)) {
    float acc = 0.0f;
    const int64_t qb = b * s.q_sb + h * s.q_sh + i * s.q_sl, kb = b * s.k_sb + hk * s.k_sh + j * s.k_sl;
    for (int64_t c = 0; c < s.E; ++c) acc = fma32(attn::load(q, qb + c, s.dtype), attn::load(k, kb + c, s.dtype), acc);
    const float sc = a.mask.apply(attn::score(acc, a.scale), b, h, i, j);
    out = canonical(attn::weight(sc, stats[row * 2]) * stats[row * 2 + 1]);
  }
  p[idx] = out;
}

}  // namespace attn_kernels
}  // namespace ldet

// CUDA exact GEMM (schemas: csrc/schema/gemm.cpp; algorithm: csrc/gemm_common.h).
//
// Structure:
//   1. a statistics kernel: per (32-wide K-block, row) exponent bounds of x and of w, stored
//      K-block-major so the main kernel reads a tile's statistics with coalesced loads;
//   2. the main kernel: 64 x 64 output tile per block of 4 warps, each warp a 32 x 32 sub-tile
//      computed with fp64 tensor-core MMA (mma.sync m16n8k8 on sm_90, m8n8k4 steps on sm_80-89).
//      K is staged through shared memory as fp64, double buffered (one barrier per K-block), the
//      next block's global loads in flight while the tensor cores work on this one. Every output keeps
//        C  an exact chunk sum in the MMA accumulators: K-blocks go straight into it while a
//           per-thread bound (from the statistics and |C|) proves every partial sum exact;
//        S  the running sum (shared memory), into which a chunk enters by one TwoSum when the
//           bound would break, and blocks too wide on their own go output by output (TwoSum of
//           the block sum, or product by product; inf/NaN are recorded as specials);
//        digits  the long accumulator, touched only by non-zero TwoSum errors and exact-path
//           products, zeroed on first touch, so most outputs never pay for them.
//      exact sum = S + C + digits (+ H, the finished segments' sum, for fp32 inputs: see kSegH);
//      the epilogue rounds it once (straight from S, or the exact pair H + S, when the digits
//      were never touched and the output is fp32).
// The canonical digits are unique, so results equal the CPU's bit for bit, whichever path ran.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "check.h"
#include "cuda/kernel_smem.cuh"
#include "gemm_common.h"
#include "op_checks.h"
#include "gemm_execute.h"
#include "split.h"

namespace ldet {
namespace {

constexpr int BM = 64, BN = 64, BK = LDET_KBLOCK;
constexpr int WARPS = 4, THREADS = 32 * WARPS;
constexpr int WM = 32, WN = 32;            // warp sub-tile
constexpr int TM = WM / 8, TN = WN / 8;    // row slots (8 rows apart) and 8-column groups per warp
constexpr int NOUT = TM * TN * 2;          // outputs per thread: 4 rows x 8 columns
constexpr int SK = BK + 4;                 // smem row stride in doubles: conflict-free fragments
constexpr int ADDS = LDET_WORDS;           // local digit slot holding the addition counter
static_assert(NOUT <= 32, "the touched-digits mask is 32 bits");

__device__ __forceinline__ double to_d(float v) { return double(v); }
__device__ __forceinline__ double to_d(__nv_bfloat16 v) { return double(__bfloat162float(v)); }
__device__ __forceinline__ double to_d(__half v) { return double(__half2float(v)); }

// c += a * b over one m16n8k8 tile (fp64 tensor cores). Called only on blocks whose exactness
// bound holds, where the result cannot depend on how the hardware orders or fuses the adds.
// Fragments (g = lane / 4, t = lane % 4): a = A[g][t], A[g+8][t], A[g][t+4], A[g+8][t+4];
// b = B[t][g], B[t+4][g]; c = C[g][2t], C[g][2t+1], C[g+8][2t], C[g+8][2t+1].
// sm_90 has the m16n8k8 shape; sm_80-89 get the same tile from four m8n8k4 steps.
__device__ __forceinline__ void mma_16x8x8(double (&c)[4], const double (&a)[4], const double (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm("mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+d"(c[0]), "+d"(c[1]), "+d"(c[2]), "+d"(c[3])
      : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(b[0]), "d"(b[1]));
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define LDET_MMA884(c0, c1, a, b) \
  asm("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};\n" : "+d"(c0), "+d"(c1) : "d"(a), "d"(b))
  LDET_MMA884(c[0], c[1], a[0], b[0]);
  LDET_MMA884(c[0], c[1], a[2], b[1]);
  LDET_MMA884(c[2], c[3], a[1], b[0]);
  LDET_MMA884(c[2], c[3], a[3], b[1]);
#undef LDET_MMA884
#else
  (void)c, (void)a, (void)b;
#endif
}

// One thread per (row, K-block); output is K-block-major: out[kb * rows + r].
template <typename T>
__global__ void stats_kernel(const T* __restrict__ a, int64_t rows, int64_t K, int64_t nkb, int32_t* __restrict__ out) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= rows * nkb) return;
  const int64_t r = idx / nkb, kb = idx % nkb;
  StatAcc s;
  const int64_t k1 = min(K, (kb + 1) * BK);
  for (int64_t k = kb * BK; k < k1; ++k) s.add(to_d(a[r * K + k]));
  out[kb * rows + r] = s.packed();
}

template <typename T>
void launch_stats(const T* a, int64_t rows, int64_t K, int64_t nkb, int32_t* out, cudaStream_t stream) {
  constexpr int threads = 256;
  if (rows * nkb == 0) return;
  stats_kernel<T><<<unsigned((rows * nkb + threads - 1) / threads), threads, 0, stream>>>(a, rows, K, nkb, out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// A tile's operand (64 rows x BK) moves global -> registers -> shared memory as 16-byte chunks
// of VEC elements; with K a multiple of VEC and aligned bases one vector load each, otherwise
// element by element. Out-of-range elements are zeros (they add nothing and are ignored by the
// statistics, which the statistics kernel computed over the real elements only).
template <typename T>
struct Stager {
  static constexpr int VEC = 16 / sizeof(T);
  static constexpr int PER_ROW = BK / VEC;
  static constexpr int CHUNKS = (64 * PER_ROW) / THREADS;  // per thread
  uint4 reg[CHUNKS];

  __device__ __forceinline__ void load(const T* __restrict__ p, int64_t rows, int64_t K, int64_t r0, int64_t k0,
                                       bool vec_ok) {
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
      const int c = threadIdx.x + i * THREADS;
      const int64_t r = r0 + c / PER_ROW, k = k0 + (c % PER_ROW) * VEC;
      if (vec_ok) {
        reg[i] = (r < rows && k < K) ? *reinterpret_cast<const uint4*>(p + r * K + k) : make_uint4(0, 0, 0, 0);
      } else {
        T tmp[VEC];
        memset(tmp, 0, sizeof(tmp));  // +0.0 in every format (no float -> T conversion in torch's builds)
#pragma unroll
        for (int j = 0; j < VEC; ++j)
          if (r < rows && k + j < K) tmp[j] = p[r * K + k + j];
        memcpy(&reg[i], tmp, 16);
      }
    }
  }

  // Bank-conflict-free: a 16-byte store is served in phases of 8 threads, here 2 rows x 4 chunks
  // (bf16, fp16) or 1 row x 8 chunks (fp32), whose starting addresses (row stride SK = 36) repeat
  // every 4 doubles mod 16, twice over. The chunks in a row's upper half store their double pairs
  // rotated by one, which moves them onto the free banks (each pair is converted once; the
  // rotation only selects registers).
  __device__ __forceinline__ void store(double (*sh)[SK]) const {
    constexpr int P = VEC / 2;  // double pairs per chunk
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
      const int c = threadIdx.x + i * THREADS;
      T tmp[VEC];
      memcpy(tmp, &reg[i], 16);
      double2 v[P];
#pragma unroll
      for (int q = 0; q < P; ++q) v[q] = make_double2(to_d(tmp[2 * q]), to_d(tmp[2 * q + 1]));
      const bool rot = (c % PER_ROW) >= PER_ROW / 2;
      double* dst = &sh[c / PER_ROW][(c % PER_ROW) * VEC];
#pragma unroll
      for (int q = 0; q < P; ++q) {
        const int qr = (q + 1) % P;
        *reinterpret_cast<double2*>(dst + 2 * (rot ? qr : q)) = rot ? v[qr] : v[q];
      }
    }
  }
};

// The rare, heavy steps live out of line so the 32-way unrolled kernel body stays small: a
// rounding error into the digits, a block product by product, and the epilogue.
__device__ __noinline__ void add_error(int64_t* d, double e, int64_t interval) { acc_digits(d, d[ADDS], interval, e); }

__device__ __noinline__ double exact_block(double S, int64_t* d, const double* xr, const double* wr, int64_t interval) {
#pragma unroll 1
  for (int kk = 0; kk < BK; ++kk) acc_any(S, d, d[ADDS], interval, xr[kk] * wr[kk]);  // products exact in fp64
  return S;
}

__device__ __noinline__ void zero_digits(int64_t* d) {
#pragma unroll 1
  for (int q = 0; q <= LDET_WORDS; ++q) d[q] = 0;
}

// The finished segments' sum H, bias, the final TwoSum residue and normalization, then the
// rounded value or the digits.
template <bool kFinalize>
__device__ __noinline__ void finish_output(double S, double H, int64_t* d, bool touched, const double* bias,
                                           int64_t gn, int64_t interval, int64_t off, int out_fmt, void* out_f,
                                           int64_t* out_d) {
  int64_t tmp[LDET_WORDS + 1];
  if (!touched) {
    zero_digits(tmp);
    d = tmp;
  }
  if (H != 0.0) acc_term(S, d, d[ADDS], interval, H);  // finite: a sum of finite products
  if (bias) acc_any(S, d, d[ADDS], interval, bias[gn]);
  acc_finish(S, d);
  if (kFinalize) {
    store_fmt(out_f, off, finalize_fmt(d, out_fmt), out_fmt);
  } else {
    for (int q = 0; q < LDET_WORDS; ++q) out_d[off * LDET_WORDS + q] = d[q];
  }
}

// --- v3: exact chunks on the tensor cores, one TwoSum per output per chunk ---
//
// Besides the running sum S (TwoSum, rounding errors into the digits) every output has a chunk
// accumulator C into which the tensor cores add K-blocks directly, as long as a bound proves every
// partial sum exact. C is a multiple of 2^Lc (the lowest bit any of its terms can have) and
// |C| <= Cb. For the next block, with the statistics of this thread's rows and columns,
//   bL = min lo(x rows) + min lo(w cols)   every product is a multiple of 2^bL,
//   Bb = 2^(max hi(x) + max hi(w) + 2 + log2 BK)   > the sum of the block's |products|,
// every partial sum the MMA can form from C and the block is a multiple of 2^min(Lc, bL) and
// below Cb + Bb in magnitude; when Cb + Bb <= 2^(min(Lc, bL) + 53) (rounded up) each of them is
// representable, so the MMA's result is exact whatever order the hardware adds in. When the
// bound fails, Cb is re-measured on the actual C; if it still fails, the chunk closes (S += C by
// TwoSum, C = 0) and the block starts the next one. Blocks that fail on their own (spread too
// wide, or inf/NaN) go output by output into S, as in v2 (C is left as it is). mma.sync needs the
// whole warp, so the path is chosen per warp (__all_sync); each thread keeps its own bound.
// Per output that is one TwoSum per chunk of many blocks instead of one per block.

#ifndef LDET_GEMM_MIN_BLOCKS
#define LDET_GEMM_MIN_BLOCKS 2
#endif
constexpr int kNoLow = 4000;  // Lc while C holds no term yet (C == 0 is a multiple of anything)

// 2^e as a double, for the exponents the bound meets (clamped to the normal range).
__device__ __forceinline__ double pow2(int e) {
  e = max(-1022, min(1023, e));
  return __longlong_as_double(static_cast<long long>(e + 1023) << 52);
}

// A statistic as two int16 lanes that __vmaxs2 reduces: (hi, -lo). An empty block is neutral in
// both lanes; an inf/NaN block sets hi to kStatSpecial, which survives every max.
__device__ __forceinline__ uint32_t stat_maxable(int32_t s) {
  const int hi = stat_hi(s);
  if (hi == kStatEmpty) return 0x80008000u;
  const int neg_lo = hi == kStatSpecial ? -32768 : -stat_lo(s);
  return (uint32_t(uint16_t(int16_t(hi))) << 16) | uint16_t(int16_t(neg_lo));
}

// An upper bound of max |C[o]| over a thread's outputs, from the high words only.
template <int N>
__device__ __forceinline__ double max_abs_bound(const double (&C)[N]) {
  int m = 0;
#pragma unroll
  for (int o = 0; o < N; ++o) m = max(m, __double2hiint(C[o]) & 0x7fffffff);
  return __hiloint2double(m, -1);  // low word all ones: >= every |C[o]| with that high word
}

// kStages: staged K-blocks in shared memory. 2 (double buffering): block kb + 1 is stored while
// the other warps may still read block kb, one barrier per block; 1: a second barrier instead.
// kSShared: S (and H) in dynamic shared memory (fast); false keeps them in the thread's own
// arrays (registers and local memory). The launch picks the largest variant the GPU's per-block
// shared memory holds. Same operations on the same values: the same bytes.
// kSegH (fp32 inputs, which run as the four segments of csrc/split.h): every output also keeps
// H, the finished segments' sum. At a segment edge S enters H by one TwoSum and S restarts at
// its rounding error, so the smaller segments never meet S at the hi-hi magnitude and the
// digits stay untouched on ordinary data; the epilogue rounds the exact pair H + S directly.
// It costs 32 KiB more, so fp32 runs with one stage (101 KiB).
constexpr int kStageDoubles = (BM + BN) * SK;  // one staged K-block of x and w

// Whether this device pass has fp64 MMA (sm_80+); without it every block goes output by output,
// product by product.
__device__ __forceinline__ constexpr bool fp64_mma_available() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return true;
#else
  return false;
#endif
}

// One thread's part of a CTA's output tile, with the kernel's steps as member functions (all
// inlined into gemm_kernel): stage (prefetch / stage_in: a K-block into shared memory with its
// statistics), plan (block_on_mma: whether the block may go to the tensor cores), multiply
// (mma_block, or block_by_output), combine (close_chunk, segment_edge) and fix-up (epilogue).
//
// Output o = (tm * TN + tn) * 2 + i sits at tile row wm + tm*8 + fr, column wn + tn*8 + 2*fc + i.
// exact sum = S + C + digits. C lives in registers (the tensor cores' accumulators); S, touched
// once per chunk, in dynamic shared memory (Ssh[o][thread]: conflict-free) where the GPU has
// room for it, which keeps the registers below the spill limit.
template <typename T, bool kFinalize, bool kSShared, int kStages, bool kSegH>
struct GemmCta {
  // Per-thread-group reductions of the statistics, (hi, -lo) lanes: a thread's 4 rows are one
  // group (warp row half, fragment row), its 8 columns another (warp column half, fragment col).
  struct Shared {
    int32_t xst[kStages][BM], wst[kStages][BN];
    uint32_t rowgrp[kStages][2][8], colgrp[kStages][2][4];
  };

  const T* __restrict__ x;
  const T* __restrict__ w;
  const int32_t* __restrict__ xs;
  const int32_t* __restrict__ ws;
  int64_t M, N, K, interval;
  int64_t xs_ld, ws_ld;  // a K-block's statistics: every slice's rows (gridDim.z M), then columns
  bool vec_ok;
  double* dyn_smem;  // kStages x (x block, w block) as fp64, then S (and H) when kSShared
  Shared& sh;

  int lane, warp, wm, wn, fr, fc;  // fragment row g / column t of the MMA tiles
  int64_t m0, n0;

  double Sown[kSShared ? 1 : NOUT], Hown[kSShared || !kSegH ? 1 : NOUT];
  double C[NOUT];
  int64_t dig[NOUT][LDET_WORDS + 1];  // local memory: digits + addition counter, zeroed lazily
  uint32_t touched = 0;
  double Cb = 0.0;  // >= max |C[o]| of this thread
  int Lc = kNoLow;  // every C[o] is a multiple of 2^Lc

  Stager<T> sx, sw;
  int32_t st = 0;  // thread t < 64: row t's statistic; 64 <= t < 128: column t - 64's

  static_assert(BM + BN == THREADS && BM == 64 && BN == 64, "one statistic per thread; warps 0-1 rows, 2-3 columns");

  // Slice blockIdx.z of a batched call (gemm_batched): its operands, statistics and outputs lie
  // at z times one slice's extent; a plain call has one slice.
  __device__ __forceinline__ GemmCta(const T* x_, const T* w_, const int32_t* xs_, const int32_t* ws_, int64_t M_,
                                     int64_t N_, int64_t K_, int64_t interval_, bool vec_ok_, double* smem,
                                     Shared& shared)
      : x(x_ + int64_t(blockIdx.z) * M_ * K_), w(w_ + int64_t(blockIdx.z) * N_ * K_),
        xs(xs_ + int64_t(blockIdx.z) * M_), ws(ws_ + int64_t(blockIdx.z) * N_), M(M_), N(N_), K(K_),
        interval(interval_), xs_ld(int64_t(gridDim.z) * M_), ws_ld(int64_t(gridDim.z) * N_), vec_ok(vec_ok_),
        dyn_smem(smem), sh(shared) {
    lane = threadIdx.x % 32;
    warp = threadIdx.x / 32;
    wm = (warp / 2) * WM;
    wn = (warp % 2) * WN;
    m0 = int64_t(blockIdx.y) * BM;
    n0 = int64_t(blockIdx.x) * BN;
    fr = lane / 4;
    fc = lane % 4;
#pragma unroll
    for (int o = 0; o < NOUT; ++o) {
      S(o) = C[o] = 0.0;
      if constexpr (kSegH) H(o) = 0.0;
    }
  }

  __device__ __forceinline__ double (*xbuf(int s))[SK] {
    return reinterpret_cast<double(*)[SK]>(dyn_smem + s * kStageDoubles);
  }
  __device__ __forceinline__ double (*wbuf(int s))[SK] {
    return reinterpret_cast<double(*)[SK]>(dyn_smem + s * kStageDoubles + BM * SK);
  }
  __device__ __forceinline__ double& S(int o) {
    if constexpr (kSShared) {
      return dyn_smem[kStages * kStageDoubles + o * THREADS + threadIdx.x];
    } else {
      return Sown[o];
    }
  }
  __device__ __forceinline__ double& H(int o) {  // only with kSegH
    if constexpr (kSShared) {
      return dyn_smem[kStages * kStageDoubles + (NOUT + o) * THREADS + threadIdx.x];
    } else {
      return Hown[kSegH ? o : 0];
    }
  }

  __device__ __forceinline__ int64_t* digits(int o) {
    if (!(touched & (1u << o))) {
      touched |= 1u << o;
      zero_digits(dig[o]);
    }
    return dig[o];
  }
  __device__ __forceinline__ void add_term(int o, double t) {  // acc_term with lazily zeroed digits
    double e;
    S(o) = two_sum(S(o), t, &e);
    if (e != 0.0) add_error(digits(o), e, interval);
  }
  // Combine: S += C (TwoSum, exact with the digits); the next chunk starts at 0.
  __device__ __forceinline__ void close_chunk() {
#pragma unroll
    for (int o = 0; o < NOUT; ++o) {
      add_term(o, C[o]);
      C[o] = 0.0;
    }
    Cb = 0.0;
    Lc = kNoLow;
  }
  // One m16n8k8 tile (mt, nt) over the staged K-block, added into the accumulators c.
  __device__ __forceinline__ void mma_tile(double (&c)[4], int mt, int nt, double (*xsh)[SK], double (*wsh)[SK]) {
#pragma unroll
    for (int k8 = 0; k8 < BK; k8 += 8) {
      double a[4], b[2];
#pragma unroll
      for (int q = 0; q < 4; ++q) a[q] = xsh[wm + mt * 16 + (q % 2) * 8 + fr][k8 + (q / 2) * 4 + fc];
#pragma unroll
      for (int q = 0; q < 2; ++q) b[q] = wsh[wn + nt * 8 + fr][k8 + q * 4 + fc];
      mma_16x8x8(c, a, b);
    }
  }

  // Stage: block kb's operands into registers (in flight while the previous block computes) and
  // this thread's statistic.
  __device__ __forceinline__ void prefetch(int64_t kb) {
    sx.load(x, M, K, m0, kb * BK, vec_ok);
    sw.load(w, N, K, n0, kb * BK, vec_ok);
    const int t = threadIdx.x;
    if (t < BM) st = (m0 + t < M) ? xs[kb * xs_ld + m0 + t] : pack_stat(kStatEmpty, 0);
    else st = (n0 + t - BM < N) ? ws[kb * ws_ld + n0 + t - BM] : pack_stat(kStatEmpty, 0);
  }

  // Stage: the prefetched block (registers) into stage s, with its statistics and their group maxima.
  __device__ __forceinline__ void stage_in(int s) {
    sx.store(xbuf(s));
    sw.store(wbuf(s));
    // Rows: lane = fr + 8 tm (reduce over lane bits 3, 4). Columns: lane = 8 jj + 2 fc + i
    // (reduce over bits 0, 3, 4). Warps 0-1 hold rows, 2-3 columns: the branch is per warp.
    if (warp < 2) sh.xst[s][threadIdx.x] = st;
    else sh.wst[s][threadIdx.x - BM] = st;
    uint32_t v = stat_maxable(st);
    v = __vmaxs2(v, __shfl_xor_sync(0xffffffffu, v, 8));
    v = __vmaxs2(v, __shfl_xor_sync(0xffffffffu, v, 16));
    if (warp >= 2) v = __vmaxs2(v, __shfl_xor_sync(0xffffffffu, v, 1));
    if (warp < 2 && lane < 8) sh.rowgrp[s][warp][lane] = v;
    if (warp >= 2 && lane < 8 && !(lane & 1)) sh.colgrp[s][warp - 2][lane >> 1] = v;
  }

  // Plan, per K-block: whether the whole warp adds stage s's block straight into C on the tensor
  // cores (warp-uniform; may close this thread's chunk first so the block fits). Sets the block's
  // bound Bb, lowest bit bL and emptiness for mma_block.
  __device__ __forceinline__ bool block_on_mma(int s, double* Bb, int* bL, bool* empty) {
    const uint32_t rg = sh.rowgrp[s][warp / 2][fr], cg = sh.colgrp[s][warp % 2][fc];
    const int rh = int(int16_t(rg >> 16)), ch = int(int16_t(cg >> 16));
    const bool special = rh == kStatSpecial || ch == kStatSpecial;
    *empty = rh == kStatEmpty || ch == kStatEmpty;  // every product of this thread is 0
    *bL = -(int(int16_t(rg & 0xffffu)) + int(int16_t(cg & 0xffffu)));
    static_assert(BK == 32, "Bb's 2^(2+5): |x| < 2^(hi+1), |w| < 2^(hi+1), 32 products");
    *Bb = *empty ? 0.0 : pow2(rh + ch + 2 + 5);
    const double bb = *Bb;
    const int bl = *bL;
    const bool emp = *empty;
    auto fits = [&]() { return emp || __dadd_ru(Cb, bb) <= pow2(min(Lc, bl) + 53); };
    const bool alone = !special && (emp || bb <= pow2(bl + 53));  // the block by itself is exact
    constexpr bool mma_ok = fp64_mma_available();
    bool ok = mma_ok && alone && fits();
    bool all_ok = __all_sync(0xffffffffu, ok);
    if (mma_ok && !all_ok) {  // warp-uniform
      if (alone && !ok) {
        Cb = max_abs_bound(C);  // the running bound only ever grows: measure the real one
        if (!fits()) close_chunk();  // then the block starts a fresh chunk, where it fits alone
        ok = true;
      }
      all_ok = __all_sync(0xffffffffu, ok);
    }
    return all_ok;
  }

  // Multiply: every partial sum is exact, so the tensor cores add the block straight into C.
  // k8 outer, so each fragment is loaded from shared memory once per block.
  __device__ __forceinline__ void mma_block(double (*xsh)[SK], double (*wsh)[SK], double Bb, int bL, bool empty) {
#pragma unroll
    for (int k8 = 0; k8 < BK; k8 += 8) {
      double a[2][4], b[TN][2];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int q = 0; q < 4; ++q) a[mt][q] = xsh[wm + mt * 16 + (q % 2) * 8 + fr][k8 + (q / 2) * 4 + fc];
#pragma unroll
      for (int nt = 0; nt < TN; ++nt)
#pragma unroll
        for (int q = 0; q < 2; ++q) b[nt][q] = wsh[wn + nt * 8 + fr][k8 + q * 4 + fc];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < TN; ++nt) {
          // Tile (mt, nt)'s accumulator i is output (row slot 2 mt + i/2, column slot 2 nt + i%2).
          double c[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) c[i] = C[(mt * 2 + i / 2) * (TN * 2) + nt * 2 + i % 2];
          mma_16x8x8(c, a[mt], b[nt]);
#pragma unroll
          for (int i = 0; i < 4; ++i) C[(mt * 2 + i / 2) * (TN * 2) + nt * 2 + i % 2] = c[i];
        }
    }
    if (!empty) {
      Cb = __dadd_ru(Cb, Bb);
      Lc = min(Lc, bL);
    }
  }

  // Multiply, output by output into S (C is untouched): each MMA tile's block sums from zero, then
  // per output the pair's own statistics choose between a TwoSum of the block sum and product by
  // product.
  __device__ __forceinline__ void block_by_output(int s, double (*xsh)[SK], double (*wsh)[SK]) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < TN; ++nt) {
        double c[4] = {0.0, 0.0, 0.0, 0.0};
        mma_tile(c, mt, nt, xsh, wsh);  // the whole warp, whatever each thread then does with it
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int tm = mt * 2 + i / 2, j = nt * 2 + i % 2, o = tm * (TN * 2) + j;
          const int32_t rs = sh.xst[s][wm + tm * 8 + fr], cs = sh.wst[s][wn + nt * 8 + 2 * fc + i % 2];
          BlockPath path = block_path(rs, cs);
          if (path == kPathSkip) continue;
          if (path == kPathFast && !fp64_mma_available()) path = kPathExact;
          if (path == kPathFast) {
            add_term(o, c[i]);
          } else {
            S(o) = exact_block(S(o), digits(o), xsh[wm + tm * 8 + fr], wsh[wn + nt * 8 + 2 * fc + i % 2], interval);
          }
        }
      }
  }

  // Combine at a segment edge of the fp32 split (x' = [xh|xh|xl|xl]): the products' scales drop
  // by 2^17 (kSplitBits) per piece, so the chunk closes and S leaves: into H (kSegH: H + S by
  // TwoSum, S restarts at the rounding error) or into the digits (exact), and restarts small;
  // otherwise the lo-lo segment's low bits would not fit beside the hi-hi magnitude of S.
  __device__ __forceinline__ void segment_edge() {
    close_chunk();
#pragma unroll
    for (int o = 0; o < NOUT; ++o) {
      if constexpr (kSegH) {
        double e;
        H(o) = two_sum(H(o), S(o), &e);
        S(o) = e;
      } else if (S(o) != 0.0) {
        add_error(digits(o), S(o), interval);
        S(o) = 0.0;
      }
    }
  }

  // Fix-up: each output's rounding (straight from the exact pair H + S + bias when no digit was
  // needed and the output is fp32), else the digits' (finish_output).
  __device__ __forceinline__ void epilogue(const double* __restrict__ bias, int out_fmt, void* __restrict__ out_f,
                                           int64_t* __restrict__ out_d) {
#pragma unroll
    for (int o = 0; o < NOUT; ++o) {
      const int tm = o / (TN * 2), j = o % (TN * 2);
      const int64_t gm = m0 + wm + tm * 8 + fr, gn = n0 + wn + (j / 2) * 8 + 2 * fc + (j % 2);
      if (gm >= M || gn >= N) continue;
      const int64_t idx = (int64_t(blockIdx.z) * M + gm) * N + gn;  // slice blockIdx.z's (gm, gn)
      const bool was_touched = (touched >> o) & 1u;
      const double h = kSegH ? H(o) : 0.0;
      if (kFinalize && out_fmt == kFmtF32 && !was_touched) {
        // No digit was needed: the exact sum is H + S + bias. When the TwoSum chain proves it an
        // exact pair hi + lo, round_pair_to_fp32 rounds it as finalize_fp32 would (as on the CPU).
        const double v[3] = {h, S(o), bias ? bias[gn] : 0.0};
        double hi, lo;
        float f;
        if (is_finite(v[2]) && exact_pair_sum(v, 3, &hi, &lo) && round_pair_to_fp32(hi, lo, &f)) {
          static_cast<float*>(out_f)[idx] = f;
          continue;
        }
      }
      finish_output<kFinalize>(S(o), h, dig[o], was_touched, bias, gn, interval, idx, out_fmt, out_f, out_d);
    }
  }
};

template <typename T, bool kFinalize, bool kSShared, int kStages, bool kSegH = std::is_same<T, float>::value>
__global__ void __launch_bounds__(THREADS, LDET_GEMM_MIN_BLOCKS)
    gemm_kernel(const T* __restrict__ x, const T* __restrict__ w, const int32_t* __restrict__ xs,
                const int32_t* __restrict__ ws, const double* __restrict__ bias, int64_t M, int64_t N, int64_t K,
                int64_t nkb, int64_t interval, int64_t seg, bool vec_ok, int out_fmt, void* __restrict__ out_f,
                int64_t* __restrict__ out_d) {
  extern __shared__ __align__(16) double dyn_smem[];
  using Cta = GemmCta<T, kFinalize, kSShared, kStages, kSegH>;
  __shared__ typename Cta::Shared shared;
  Cta cta(x, w, xs, ws, M, N, K, interval, vec_ok, dyn_smem, shared);

  cta.prefetch(0);
  cta.stage_in(0);
  __syncthreads();
  for (int64_t kb = 0; kb < nkb; ++kb) {
    const int s = kStages == 2 ? int(kb & 1) : 0;
    double(*xsh)[SK] = cta.xbuf(s);
    double(*wsh)[SK] = cta.wbuf(s);
    if (kb + 1 < nkb) cta.prefetch(kb + 1);  // in flight while this block is computed
    double Bb;
    int bL;
    bool empty;
    if (cta.block_on_mma(s, &Bb, &bL, &empty)) {
      cta.mma_block(xsh, wsh, Bb, bL, empty);
    } else {
      cta.block_by_output(s, xsh, wsh);
    }
    if (seg > 0 && ((kb + 1) * BK) / seg != (kb * BK) / seg) cta.segment_edge();
    if (kb + 1 < nkb) {
      if (kStages == 1) __syncthreads();  // every warp is done with the one stage
      cta.stage_in(kStages == 2 ? s ^ 1 : 0);  // with 2 stages, the one read in the previous block
    }
    __syncthreads();
  }
  cta.close_chunk();
  cta.epilogue(bias, out_fmt, out_f, out_d);
}

// x (batch M, K), w (batch N, K): `batch` slices of M and N rows, one launch (grid z).
template <typename T, bool kFinalize>
void launch(const at::Tensor& x, const at::Tensor& w, const at::Tensor& xs, const at::Tensor& ws, const double* bias,
            int64_t nkb, int64_t interval, int64_t seg, int out_fmt, at::Tensor& out, int64_t batch) {
  const int64_t M = x.size(0) / batch, N = w.size(0) / batch, K = x.size(1);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  const T* wp = reinterpret_cast<const T*>(w.data_ptr());
  const int64_t Mb = batch * M, Nb = batch * N;  // every slice's rows: one statistics pass each
  launch_stats(xp, Mb, K, nkb, xs.data_ptr<int32_t>(), stream);
  launch_stats(wp, Nb, K, nkb, ws.data_ptr<int32_t>(), stream);
  LDET_CHECK((M + BM - 1) / BM < 65536, "x: M = ", M, " exceeds this kernel's grid limit of ", 65535 * BM, " rows");
  LDET_CHECK(batch < 65536, "x: ", batch, " slices exceed this kernel's grid limit of 65535");
  constexpr int VEC = 16 / sizeof(T);
  const bool vec_ok = K % VEC == 0 && reinterpret_cast<uintptr_t>(xp) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(wp) % 16 == 0;
  dim3 grid(unsigned((N + BN - 1) / BN), unsigned((M + BM - 1) / BM), unsigned(batch));
  int dev = 0, optin = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  void* out_f = kFinalize ? out.data_ptr() : nullptr;
  int64_t* out_d = kFinalize ? nullptr : out.data_ptr<int64_t>();
  // The largest variant whose shared memory (static + dynamic) fits; false when it does not.
  auto try_launch = [&](auto kernel, size_t dyn_bytes) {
    if (!prepare_smem(dev, kernel, dyn_bytes, &optin)) return false;
    kernel<<<grid, THREADS, dyn_bytes, stream>>>(xp, wp, xs.data_ptr<int32_t>(), ws.data_ptr<int32_t>(), bias, M, N, K,
                                                 nkb, interval, seg, vec_ok, out_fmt, out_f, out_d);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return true;
  };
  constexpr size_t kStageBytes = kStageDoubles * sizeof(double);
  constexpr size_t kSBytes = NOUT * THREADS * sizeof(double);  // the running sums S (or H)
  if constexpr (std::is_same<T, float>::value) {  // S and H: one stage, so 2 CTAs fit per SM
    if (try_launch(gemm_kernel<T, kFinalize, true, 1>, kStageBytes + 2 * kSBytes)) return;
  } else {
    if (try_launch(gemm_kernel<T, kFinalize, true, 2>, 2 * kStageBytes + kSBytes)) return;
    if (try_launch(gemm_kernel<T, kFinalize, true, 1>, kStageBytes + kSBytes)) return;
  }
  LDET_CHECK(try_launch(gemm_kernel<T, kFinalize, false, 1>, kStageBytes),
              "det_gemm: this GPU's per-block shared memory (", optin, " bytes) is below the kernel's ", kStageBytes);
}

// The long-accumulator kernel (csrc/gemm_common.h): the kernel route, and the rows the slices
// cannot hold. batch > 1 (gemm_batched, no bias): x (batch M, K) and w (batch N, K) hold `batch`
// slices, the result (batch M, N) their products, one launch; splitting and statistics are per
// row, so a slice's bytes cannot depend on the others.
template <bool kFinalize>
at::Tensor gemm_kernel_cuda(const at::Tensor& x_in, const at::Tensor& w_in, const c10::optional<at::Tensor>& bias,
                            int64_t norm_interval, at::ScalarType out_dtype, int64_t batch = 1) {
  // Mixed input dtypes: widen both to fp32 (exact), so one kernel type serves.
  at::Tensor x = x_in, w = w_in;
  if (x.scalar_type() != w.scalar_type()) {
    x = x.to(at::kFloat);
    w = w.to(at::kFloat);
  }
  auto [xsplit, wsplit] = split_fp32_for_fast_path(x, w);
  const int64_t seg = xsplit.defined() ? x.size(1) : 0;  // K of one split segment
  if (xsplit.defined()) {
    x = xsplit;
    w = wsplit;
  }
  x = x.contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0) / batch;  // M: every slice's rows
  const int64_t nkb = (K + BK - 1) / BK;
  const int64_t interval = norm_interval > 0 ? norm_interval : LDET_NORM_INTERVAL;
  at::Tensor bd;
  if (bias.has_value()) bd = bias->to(at::kDouble).contiguous();
  at::Tensor xs = at::empty({M * nkb}, x.options().dtype(at::kInt));
  at::Tensor ws = at::empty({batch * N * nkb}, x.options().dtype(at::kInt));
  at::Tensor out = kFinalize ? at::empty({M, N}, x.options().dtype(out_dtype))
                             : at::empty({M, N, LDET_WORDS}, x.options().dtype(at::kLong));
  if (M * N == 0) return out;
  const double* bp = bias.has_value() ? bd.data_ptr<double>() : nullptr;
  const int fmt = out_format(out_dtype);
  switch (x.scalar_type()) {
    case at::kFloat:
      launch<float, kFinalize>(x, w, xs, ws, bp, nkb, interval, seg, fmt, out, batch);
      break;
    case at::kBFloat16:
      launch<__nv_bfloat16, kFinalize>(x, w, xs, ws, bp, nkb, interval, seg, fmt, out, batch);
      break;
    default:
      launch<__half, kFinalize>(x, w, xs, ws, bp, nkb, interval, seg, fmt, out, batch);
      break;
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// The probe of auto's kernel choice (gemm_plan.h, plan_kernel_stage): the share of the kernel's
// (warp tile, K-block) steps that leave the tensor cores on these operands.
//
// A warp's K-block goes to the tensor cores (block_on_mma) only when every pair of its row groups
// (4 rows, 8 apart) and column groups (8 columns: 2 adjacent, 8 apart) spreads over at most
// LDET_FAST_SPREAD bits together and holds no inf or NaN; otherwise it goes output by output
// (block_by_output), product by product where an output's own pair is too wide. A pair's spread
// is the sum of its groups' spreads, so a warp step is slow when the widest row group of its
// 32-row strip of x and the widest column group of its 32-column strip of w exceed the window
// together. Per K-block, each strip's widest group spread (clipped to one bin beyond the window;
// another bin for inf / NaN; all-zero strips are not counted) goes into a histogram, and the
// slow (x strip, w strip) pairs are counted from the two histograms: O((M + N) K) work against
// the GEMM's O(M N K). 16-bit operands of one dtype alone: the kernel splits fp32 operands first
// (csrc/split.h, a synchronization and 4x their size), which the probe would have to repeat, and
// the planner sends fp32 to the kernel only where a call forces it.
constexpr int kSpreadBins = LDET_FAST_SPREAD + 3;  // spreads 0 .. window, beyond it, inf / NaN

// The bin of one 32-row strip of a K-block's statistics (rows from r0), -1 when all zero.
__device__ int strip_bin(const int32_t* __restrict__ st, int64_t rows, int64_t r0, bool columns) {
  const int groups = columns ? 4 : 8, members = columns ? 8 : 4;
  int widest = -1;
  for (int g = 0; g < groups; ++g) {
    int hi = kStatEmpty, lo = 32767;
    for (int m = 0; m < members; ++m) {
      const int64_t r = r0 + (columns ? 2 * g + (m & 1) + 8 * (m >> 1) : g + 8 * m);
      if (r >= rows) continue;
      const int32_t s = st[r];
      const int h = stat_hi(s);
      if (h == kStatSpecial) return kSpreadBins - 1;
      if (h == kStatEmpty) continue;
      hi = max(hi, h);
      lo = min(lo, stat_lo(s));
    }
    if (hi != kStatEmpty) widest = max(widest, min(hi - lo, LDET_FAST_SPREAD + 1));
  }
  return widest;
}

// One block per K-block: both operands' strip histograms, then its slow pairs added to *count
// (integer additions: the count does not depend on their order).
__global__ void slow_steps_kernel(const int32_t* __restrict__ xs, const int32_t* __restrict__ ws, int64_t M,
                                  int64_t N, unsigned long long* __restrict__ count) {
  __shared__ unsigned int hx[kSpreadBins], hw[kSpreadBins];
  const int64_t kb = blockIdx.x;
  for (int i = threadIdx.x; i < kSpreadBins; i += blockDim.x) hx[i] = hw[i] = 0;
  __syncthreads();
  const int64_t sx = (M + WM - 1) / WM, sw = (N + WN - 1) / WN;
  for (int64_t s = threadIdx.x; s < sx + sw; s += blockDim.x) {
    const bool columns = s >= sx;
    const int b = columns ? strip_bin(ws + kb * N, N, (s - sx) * WN, true) : strip_bin(xs + kb * M, M, s * WM, false);
    if (b >= 0) atomicAdd(columns ? &hw[b] : &hx[b], 1u);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long slow = 0;
    for (int a = 0; a < kSpreadBins; ++a)
      for (int b = 0; b < kSpreadBins; ++b)
        if (a == kSpreadBins - 1 || b == kSpreadBins - 1 || a + b > LDET_FAST_SPREAD)
          slow += static_cast<unsigned long long>(hx[a]) * hw[b];
    if (slow != 0) atomicAdd(count, slow);
  }
}

bool probe_applies(const at::Tensor& x, const at::Tensor& w) {
  return x.scalar_type() == w.scalar_type() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf);
}

// The slow steps (a device int64 of one element, on its way) and the number of steps.
std::pair<at::Tensor, double> kernel_slow_steps(const at::Tensor& x_in, const at::Tensor& w_in) {
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1), nkb = (K + BK - 1) / BK;
  at::Tensor count = at::zeros({1}, x.options().dtype(at::kLong));
  const double steps = double(nkb) * double((M + WM - 1) / WM) * double((N + WN - 1) / WN);
  if (steps == 0) return {count, 0.0};
  at::Tensor xs = at::empty({M * nkb}, x.options().dtype(at::kInt));
  at::Tensor ws = at::empty({N * nkb}, x.options().dtype(at::kInt));
  auto stream = c10::cuda::getCurrentCUDAStream();
  if (x.scalar_type() == at::kBFloat16) {
    launch_stats(reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()), M, K, nkb, xs.data_ptr<int32_t>(), stream);
    launch_stats(reinterpret_cast<const __nv_bfloat16*>(w.data_ptr()), N, K, nkb, ws.data_ptr<int32_t>(), stream);
  } else {
    launch_stats(reinterpret_cast<const __half*>(x.data_ptr()), M, K, nkb, xs.data_ptr<int32_t>(), stream);
    launch_stats(reinterpret_cast<const __half*>(w.data_ptr()), N, K, nkb, ws.data_ptr<int32_t>(), stream);
  }
  LDET_CHECK(nkb < (int64_t(1) << 31), "x: K = ", K, " exceeds the probe's grid");
  slow_steps_kernel<<<unsigned(nkb), 256, 0, stream>>>(
      xs.data_ptr<int32_t>(), ws.data_ptr<int32_t>(), M, N,
      reinterpret_cast<unsigned long long*>(count.data_ptr<int64_t>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {count, steps};
}

// The share now (one synchronization): explain_gemm, and a shape's first call. -1: not probed.
double kernel_slow_share_now(const at::Tensor& x, const at::Tensor& w) {
  if (!probe_applies(x, w)) return -1.0;
  const auto [count, steps] = kernel_slow_steps(x, w);
  return steps > 0 ? double(count.item<int64_t>()) / steps : 0.0;
}

// Per shape (M, N, K, dtype, device): the share last read, and the next count on its way to
// the host behind an event (the slices' summary_later). A shape's first call reads its share now;
// later calls take the last share read, and every kReprobeCalls-th call sends a new probe on its
// way (no synchronization: the share changes the route, never the bytes).
constexpr int64_t kReprobeCalls = 16;

struct KernelProbeState {
  double share = -1.0;
  int64_t calls = 0;
  std::shared_ptr<PendingSummary> later;  // the slow steps' count on its way
  double later_steps = 0;                 // the steps it counts among
};

using ProbeKey = std::tuple<int64_t, int64_t, int64_t, int, int>;

struct KernelProbeCache {
  std::mutex mu;
  std::map<ProbeKey, KernelProbeState> states;
};

KernelProbeCache& kernel_probe_cache() {
  // Never destroyed: its pinned memory and events must not be freed after the CUDA runtime has
  // shut down at exit (as the slices' guess cache).
  static KernelProbeCache* cache = new KernelProbeCache;
  return *cache;
}

// The probe of every det_gemm call whose plan is auto's kernel with rounded outputs.
double kernel_slow_share_cached(const at::Tensor& x, const at::Tensor& w) {
  if (!probe_applies(x, w)) return -1.0;
  const ProbeKey key{x.size(0), w.size(0), x.size(1), int(x.scalar_type()), int(x.device().index())};
  KernelProbeCache& cache = kernel_probe_cache();
  {
    std::lock_guard<std::mutex> lock(cache.mu);
    KernelProbeState& st = cache.states[key];  // node-based map: the reference stays valid
    if (st.later && st.later->ready()) {
      st.share = st.later_steps > 0 ? double(st.later->host.data_ptr<int64_t>()[0]) / st.later_steps : 0.0;
      st.later.reset();
    }
    if (st.share >= 0) {
      if (++st.calls % kReprobeCalls == 0 && !st.later) {
        const auto [count, steps] = kernel_slow_steps(x, w);
        st.later = slice_backend_cuda().summary_later(count);
        st.later_steps = steps;
      }
      return st.share;
    }
  }
  // the shape's first call: its share now, the synchronization outside the lock
  const double share = kernel_slow_share_now(x, w);
  std::lock_guard<std::mutex> lock(cache.mu);
  cache.states[key].share = share;
  return share;
}

void check_gemm_devices(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  LDET_CHECK(x.device() == w.device(), "w: expected device ", x.device(), " to match x, got ", w.device());
  if (bias.has_value())
    LDET_CHECK(bias->device() == x.device(), "bias: expected device ", x.device(), ", got ", bias->device());
}

// Plans the call (csrc/gemm_plan.h) and runs the plan (csrc/gemm_execute.h).
template <bool kFinalize>
at::Tensor gemm_common_cuda(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                            int64_t norm_interval, at::ScalarType out_dtype, at::IntArrayRef options) {
  check_gemm_args(x, w, bias);
  check_gemm_devices(x, w, bias);
  const GemmOptions opt = checked_options(options);
  if (kFinalize) out_format(out_dtype);  // a bad dtype fails here, before any route runs
  c10::cuda::CUDAGuard guard(x.device());
  const SliceBackend& slices = slice_backend_cuda();
  GemmPlan plan = plan_for(x, w, slices.device, !kFinalize, out_dtype, opt, norm_interval == 0);
  const LongAccGemm kernel = [&](const at::Tensor& xs, const at::Tensor& ws, const c10::optional<at::Tensor>& bs) {
    return gemm_kernel_cuda<kFinalize>(xs, ws, bs, norm_interval, out_dtype);
  };
  return execute_gemm(&plan, x, w, bias, out_dtype, fp64_backend_cuda(), slices, kernel, kernel_slow_share_cached);
}

at::Tensor gemm_partial_cuda(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                             int64_t norm_interval, at::IntArrayRef options) {
  return gemm_common_cuda<false>(x, w, bias, norm_interval, at::kFloat, options);
}

at::Tensor gemm_cuda(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                     c10::optional<at::ScalarType> out_dtype, at::IntArrayRef options) {
  return gemm_common_cuda<true>(x, w, bias, 0, out_dtype.value_or(at::kFloat), options);
}

// Under route auto or kernel, every slice in one launch of the long-accumulator kernel (a
// per-slice plan would launch each slice's routes in turn: attention's many small slices);
// under a forced other route, slice by slice as gemm runs it.
at::Tensor gemm_batched_cuda(const at::Tensor& x, const at::Tensor& w, c10::optional<at::ScalarType> out_dtype,
                             at::IntArrayRef options) {
  check_gemm_batched_args(x, w);
  const at::ScalarType dt = out_dtype.value_or(at::kFloat);
  out_format(dt);  // a bad dtype fails before any slice runs
  const GemmOptions opt = checked_options(options);
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t B = x.size(0), M = x.size(1), N = w.size(1), K = x.size(2);
  if (opt.route == kPathAuto || opt.route == kPathKernel) {
    if (B == 0 || M == 0 || N == 0) return at::empty({B, M, N}, x.options().dtype(dt));
    const at::Tensor y =
        gemm_kernel_cuda<true>(x.reshape({B * M, K}), w.reshape({B * N, K}), c10::nullopt, 0, dt, B);
    return y.view({B, M, N});
  }
  at::Tensor out = at::empty({B, M, N}, x.options().dtype(dt));
  for (int64_t b = 0; b < B; ++b)
    out.select(0, b).copy_(gemm_common_cuda<true>(x.select(0, b), w.select(0, b), c10::nullopt, 0, dt, options));
  return out;
}

// The plan a gemm (digits false) / gemm_partial (true) call would run, as JSON (explain_gemm).
std::string explain_gemm_cuda(const at::Tensor& x, const at::Tensor& w, bool digits, at::IntArrayRef options,
                             c10::optional<at::ScalarType> out_dtype) {
  check_gemm_args(x, w, c10::nullopt);
  check_gemm_devices(x, w, c10::nullopt);
  c10::cuda::CUDAGuard guard(x.device());
  return plan_json(explain_gemm_plan(x, w, digits, out_dtype.value_or(at::kFloat), checked_options(options),
                                     slice_backend_cuda(), kernel_slow_share_now));
}

}  // namespace

TORCH_LIBRARY_IMPL(ldet, CUDA, m) {
  m.impl("gemm_partial", &gemm_partial_cuda);
  m.impl("gemm", &gemm_cuda);
  m.impl("gemm_batched", &gemm_batched_cuda);
  m.impl("explain_gemm", &explain_gemm_cuda);
}

}  // namespace ldet

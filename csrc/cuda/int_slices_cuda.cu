// CUDA kernels of the integer-slice GEMM (scheme: csrc/int_slices.h; driver: csrc/int_slices_host.h).
// The int8 GEMMs themselves are cuBLASLt's (csrc/cuda/int8_gemm_lt.cu): exact int32 accumulation.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "cuda/event_done.h"
#include "cuda/elements.cuh"
#include "cuda/int8_gemm_lt.h"
#include "int_slices_host.h"
#include "op_checks.h"

namespace ldet {
namespace {

constexpr int kRowThreads = 256;
constexpr int kThreads = 256;

// Rows of `a` (K elements each) load as aligned 4-element vectors.
template <typename T>
bool quads_aligned(const T* a, int64_t K) {
  return K % 4 == 0 && reinterpret_cast<uintptr_t>(a) % (4 * sizeof(T)) == 0;
}

unsigned grid_for(int64_t n) { return unsigned(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535 * 16)); }

// Loads a thread issues before it uses the first (one scalar load in flight per thread left
// row_needs and make_slices latency-bound, far below the memory bandwidth).
constexpr int kQuadsInFlight = 4;

// Four consecutive elements of a row, one vector access when `vec` (aligned base, K % 4 == 0).
template <typename T>
struct alignas(4 * sizeof(T)) Quad {
  T e[4];
};

// row[k..k+3] as stored (widened where used: fewer registers per load in flight); zeros past K
// (a zero is neutral for every statistic below and is never sliced: make_slices skips k >= K).
template <typename T>
__device__ __forceinline__ Quad<T> load_quad(const T* __restrict__ row, int64_t k, int64_t K, bool vec) {
  if (vec && k < K) return *reinterpret_cast<const Quad<T>*>(row + k);  // k, K % 4 == 0: all in the row
  Quad<T> q;
#pragma unroll
  for (int e = 0; e < 4; ++e) q.e[e] = k + e < K ? row[k + e] : T{};
  return q;
}

// U quads of a row, `step` elements apart from k0 (each load coalesced across the threads), all
// issued before any is used.
template <typename T, int U>
__device__ __forceinline__ void load_round(Quad<T> (&v)[U], const T* __restrict__ row, int64_t k0, int64_t step,
                                           int64_t K, bool vec) {
#pragma unroll
  for (int u = 0; u < U; ++u) v[u] = load_quad(row, k0 + u * step, K, vec);
}

// f(u) for each of the round's 4 U elements, as fp32 bit patterns (f32_bits).
template <typename T, int U, typename F>
__device__ __forceinline__ void each_element(const Quad<T> (&v)[U], F&& f) {
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int e = 0; e < 4; ++e) f(f32_bits(v[u].e[e]));
}

// window_integer(v, s) (trunc(v 2^s)) of the finite fp32 pattern u in integer arithmetic, and
// whether v has bits below 2^-s (a residue). The caller's row keeps |v 2^s| < 2^62.
__device__ __forceinline__ int64_t window_integer_bits(uint32_t u, int s, bool* below) {
  const F32Parts p = f32_parts(u);
  const int sh = p.e + s;
  uint64_t mag = 0;
  if (sh >= 0) {
    mag = uint64_t(p.m) << sh;
    *below = false;
  } else if (sh > -32) {
    mag = p.m >> -sh;
    *below = (p.m << (32 + sh)) != 0;
  } else {
    *below = p.m != 0;
  }
  return p.neg ? -int64_t(mag) : int64_t(mag);
}

// The S balanced digits (least significant first) of four window integers, packed one 32-bit
// word per slice (element e in byte e). Y = X + sum_q 2^(bits - 1) 2^(bits q) holds the digits
// plus 2^(bits - 1) as its plain base-2^bits digits (|X| < 2^(bits S - 2): 0 <= Y < 2^(bits S)),
// the same digits next_digit peels off one by one. 8-bit digits are Y's bytes: byte permutes.
__device__ __forceinline__ void digit_planes(const int64_t (&X)[4], int S, int bits, uint32_t* words) {
  uint64_t off = 0;
  for (int q = 0; q < S; ++q) off |= uint64_t(1) << (bits * q + bits - 1);
  uint64_t Y[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) Y[e] = uint64_t(X[e]) + off;
  if (bits == 8) {
#pragma unroll
    for (int q = 0; q < kSliceMax; ++q) {
      if (q >= S) break;
      const int word = q < 4 ? 0 : 32, b = q & 3;  // Y's 32-bit half holding byte q
      const uint32_t sel = uint32_t(b) | uint32_t(b + 4) << 4;
      const uint32_t lo2 = __byte_perm(uint32_t(Y[0] >> word), uint32_t(Y[1] >> word), sel);
      const uint32_t hi2 = __byte_perm(uint32_t(Y[2] >> word), uint32_t(Y[3] >> word), sel);
      words[q] = __byte_perm(lo2, hi2, 0x5410) ^ 0x80808080u;
    }
  } else {
    const uint64_t mask = (uint64_t(1) << bits) - 1;
#pragma unroll
    for (int q = 0; q < kSliceMax; ++q) {
      if (q >= S) break;
      uint32_t w = 0;
#pragma unroll
      for (int e = 0; e < 4; ++e) w |= uint32_t(uint8_t(((Y[e] >> (bits * q)) & mask) - (mask >> 1) - 1)) << (8 * e);
      words[q] = w;
    }
  }
}

__device__ __forceinline__ int warp_max(int v) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ int warp_min(int v) {
  for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ int warp_sum(int v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// A row's plan from its reduced statistics: written to out[3r..3r+2] and added to the summary.
__device__ void finish_row_needs(const int* hist, int hi, int lo, int bad, int bits, int64_t r,
                                 int32_t* __restrict__ out, int32_t* __restrict__ sum) {
  int depth[kSliceMax], count[kSliceMax];
  const int need = bad ? kSliceNeedBad : row_plan(hist, hi, lo, bits, depth, count);
  out[3 * r] = hi;
  out[3 * r + 1] = need;
  out[3 * r + 2] = lo;
  if (need > kSliceMax) {
    atomicAdd(&sum[kSumBad], 1);
  } else if (need > 0) {
    atomicMax(&sum[kSumNeed], need);
    for (int s = need; s <= kSliceMax; ++s) {
      if (count[s - 1] == 0) break;  // fewer residues at every larger S
      atomicMax(&sum[kSumDepth + s - 1], depth[s - 1]);
      atomicAdd(&sum[kSumCount + s - 1], count[s - 1]);
    }
  }
}

// G threads per row (G = 32: a warp per row, eight rows a block, for short rows; G = kRowThreads:
// the block): the row's largest exponent, lowest set bit and any inf/NaN, reduced; then the
// histogram of its elements' needs (int_slices.h, need_bin) and its plan (finish_row_needs). Each
// thread keeps kQuadsInFlight 4-element loads in flight; a row that one such round covers is read
// once (the histogram reuses the registers), a longer one twice (the second read mostly from L1).
// Every reduction is of max / min / or / integer sums: no order can show.
template <typename T, int G>
__global__ void __launch_bounds__(kRowThreads) row_needs_kernel(const T* __restrict__ a, int64_t R, int64_t K,
                                                                int bits, bool vec, int32_t* __restrict__ out,
                                                                int32_t* __restrict__ sum) {
  constexpr int kGroups = kRowThreads / G, kWarps = G / 32, U = kQuadsInFlight;
  __shared__ int s_hi[kWarps], s_lo[kWarps], s_bad[kWarps], s_hist[kNeedBins];  // G > 32 only
  const int t = threadIdx.x % G, lane = threadIdx.x & 31, warp = t / 32;
  const int64_t round = int64_t(G) * 4 * U;  // elements one round of loads covers
  const bool one_round = K <= round;
  for (int64_t r = int64_t(blockIdx.x) * kGroups + threadIdx.x / G; r < R; r += int64_t(gridDim.x) * kGroups) {
    const T* row = a + r * K;
    Quad<T> v[U];
    int hi = -32768, lo = 32767, bad = 0;
    for (int64_t k0 = int64_t(t) * 4; k0 < K; k0 += round) {
      load_round(v, row, k0, G * 4, K, vec);
      each_element(v, [&](uint32_t x) {  // exp_stat's hi and lo, from the fp32 pattern
        const F32Parts p = f32_parts(x);
        if (!f32_finite(x)) {
          bad = 1;
        } else if (p.m != 0) {  // a zero (or padding) changes neither
          hi = max(hi, p.e + 31 - __clz(p.m));
          lo = min(lo, p.e + __ffs(p.m) - 1);
        }
      });
    }
    hi = warp_max(hi);
    lo = warp_min(lo);
    bad = warp_max(bad);
    if constexpr (G > 32) {
      if (lane == 0) {
        s_hi[warp] = hi;
        s_lo[warp] = lo;
        s_bad[warp] = bad;
      }
      if (t < kNeedBins) s_hist[t] = 0;
      __syncthreads();
#pragma unroll
      for (int i = 0; i < kWarps; ++i) {
        hi = max(hi, s_hi[i]);
        lo = min(lo, s_lo[i]);
        bad = max(bad, s_bad[i]);
      }
    }
    // over[s - 1]: elements needing more than s slices (need_bin > s), i.e. whose lowest set bit
    // lies below the s-slice window: lo_el < hi + 3 - bits s. No division per element.
    int over[kSliceMax] = {};
    if (!bad && hi >= lo) {
      for (int64_t k0 = int64_t(t) * 4; k0 < K; k0 += round) {
        if (!one_round) load_round(v, row, k0, G * 4, K, vec);
        each_element(v, [&](uint32_t x) {
          const F32Parts p = f32_parts(x);
          const int lo_el = p.m != 0 ? p.e + __ffs(p.m) - 1 : 32767;  // a zero needs nothing
#pragma unroll
          for (int q = 1; q <= kSliceMax; ++q) over[q - 1] += lo_el < hi + 3 - bits * q;
        });
      }
    }
    int hist[kNeedBins] = {};  // row_plan's histogram from the counts: bin b holds need == b (bin 1 unused)
#pragma unroll
    for (int q = 1; q <= kSliceMax; ++q) over[q - 1] = warp_sum(over[q - 1]);
#pragma unroll
    for (int b = 2; b < kNeedBins; ++b) hist[b] = over[b - 2] - (b - 1 < kSliceMax ? over[b - 1] : 0);
    if constexpr (G > 32) {
      if (lane == 0) {
#pragma unroll
        for (int b = 1; b < kNeedBins; ++b) atomicAdd(&s_hist[b], hist[b]);
      }
      __syncthreads();
      if (t == 0) {
#pragma unroll
        for (int b = 1; b < kNeedBins; ++b) hist[b] = s_hist[b];
        finish_row_needs(hist, hi, lo, bad, bits, r, out, sum);
      }
      __syncthreads();  // s_hist is read above before the next row clears it
    } else if (lane == 0) {
      finish_row_needs(hist, hi, lo, bad, bits, r, out, sum);
    }
  }
}

// Block row blockIdx.y slices operand rows r; each thread groups of 4 consecutive elements of the padded
// (Rp, nch * Kc) operand (Kc % 16 == 0: they share a chunk), written as one 32-bit word per slice.
// Zeros for padding, zero rows and rows left to the kernel, so the slices need no zero-fill first;
// residues go to their row's list in any order (the combine's sum is exact: the order cannot show).
template <typename T, bool kCrt>
__global__ void make_slices_kernel(const T* __restrict__ a, const int32_t* __restrict__ needs, int64_t R, int64_t Rp,
                                   int64_t K, int S, int bits, bool reverse, int64_t Kc, int64_t nch,
                                   int8_t* __restrict__ out, int32_t* __restrict__ sh, int32_t* __restrict__ rcount,
                                   int32_t* __restrict__ ridx, double* __restrict__ rval, int32_t* __restrict__ F,
                                   int32_t* __restrict__ left, bool vec, CrtConsts crt) {
  // Q > 0 (the CRT way, crt.h; nch == 1): Q remainder planes instead of S slices
  constexpr int U = kCrt ? 1 : kQuadsInFlight;  // the CRT form's registers leave no room for more
  const int Q = crt.count;
  const int64_t Kp = nch * Kc, width = Kp * (Q > 0 ? Q : S);
  const int64_t step = reverse ? -Kc : Kc;
  for (int64_t r = blockIdx.y; r < Rp; r += gridDim.y) {
    const int need = r < R ? needs[3 * r + 1] : 0;
    const bool live = need > 0 && need <= S;  // else a zero row, padding or left to the kernel
    const int s = live ? bits * S - 3 - needs[3 * r] : 0;
    if (r < R && blockIdx.x == 0 && threadIdx.x == 0) {
      sh[r] = s;
      if (F != nullptr) F[r] = live ? max(0, needs[3 * r] + 3 - bits * S - needs[3 * r + 2]) : 0;
      if (left != nullptr && need > S) left[1 + atomicAdd(left, 1)] = int32_t(r);  // a guessed S too small
    }
    // each thread: U quads a round, stride elements apart
    const T* row = a + r * K;
    const int64_t stride = int64_t(gridDim.x) * blockDim.x * 4;
    for (int64_t k0 = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 4; k0 < Kp; k0 += stride * U) {
      Quad<T> v[U];
      load_round(v, row, live ? k0 : K, stride, K, vec);  // nothing loaded (zeros) unless live
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t k4 = k0 + u * stride;
        if (k4 >= Kp) break;
        const int64_t c = k4 / Kc, kk = k4 - c * Kc;
        int8_t* dst = Q > 0 ? out + r * width + kk : out + r * width + (c * S + (reverse ? S - 1 : 0)) * Kc + kk;
        // four elements' bytes per slice (or per remainder plane), one 32-bit store each
        uint32_t words[kCrtMax > kSliceMax ? kCrtMax : kSliceMax];
#pragma unroll
        for (int q = 0; q < (kCrtMax > kSliceMax ? kCrtMax : kSliceMax); ++q) words[q] = 0;
        int64_t X[4] = {0, 0, 0, 0};  // zero (all-zero digits) past K, in padding and in rows not live
        if (live) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int64_t k = k4 + e;
            if (k >= K) break;
            bool below;
            X[e] = window_integer_bits(f32_bits(v[u].e[e]), s, &below);
            if (rcount != nullptr && below) {
              // row_plan bounded this row's residues at S by kResidueCap
              const double x = wide(v[u].e, e), x3 = double(X[e]) * pow2(-s);
              const int j = atomicAdd(&rcount[r], 1);
              ridx[r * kResidueCap + j] = int32_t(k);
              rval[r * kResidueCap + j] = x - x3;  // exact: the bits below the window
            }
            if constexpr (kCrt) {  // the digits, then their remainders modulo Q moduli (crt.h)
              uint32_t lo, hi;
              digit_words(X[e], S, bits, &lo, &hi);
#pragma unroll
              for (int t = 0; t < kCrtMax; ++t)
                if (t < Q) words[t] |= uint32_t(uint8_t(crt_remainder(lo, hi, t, crt))) << (8 * e);
            }
          }
        }
        if constexpr (!kCrt) digit_planes(X, S, bits, words);
        if constexpr (kCrt) {
#pragma unroll
          for (int t = 0; t < kCrtMax; ++t)
            if (t < Q) *reinterpret_cast<uint32_t*>(dst + t * Kc) = words[t];
        } else {
#pragma unroll
          for (int q = 0; q < kSliceMax; ++q)
            if (q < S) *reinterpret_cast<uint32_t*>(dst + q * step) = words[q];
        }
      }
    }
  }
}

struct KernelOperand {
  Residues res;
  Elems elems;
  const int32_t* sh;
};

// Block row blockIdx.y handles output rows m (x's row data is uniform across the block), threads
// run along n: no 64-bit division per output, coalesced reads of the diagonals. The 128-bit route
// only (no long accumulator in this kernel, so no stack frame). DC: the diagonal count when it is
// known at compile time with one K-chunk (the common case), else 0. An output it cannot take is
// appended to `list` (its index; past `cap` only counted) and combine_rest_kernel finishes it.
template <int DC>
__global__ void __launch_bounds__(kThreads) combine_fast_kernel(const int32_t* __restrict__ C, int nch, int64_t Mp,
                                                               int64_t Ncp, int64_t M, int64_t Nv, KernelOperand x,
                                                               KernelOperand w, const double* __restrict__ bias, int D,
                                                               int bits, int fmt, void* __restrict__ out, int64_t ldo,
                                                               int64_t* __restrict__ list, int32_t* __restrict__ count,
                                                               int64_t cap, WideCheck check, CrtConsts crt) {
  if (check.sums != nullptr &&
      !slices_wide(check.sums, check.sums + kSumLen, check.Sx, check.Sw, check.nch, check.Kc, bits)) {
    // a guessed plan the 128-bit sum is not proven for: every output to combine_rest_kernel
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *count = int32_t(cap + 1);
    return;
  }
  for (int64_t m = blockIdx.y; m < M; m += gridDim.y) {
    const int shx = x.sh[m];
    const int Fx = x.res.F ? x.res.F[m] : 0;
    for (int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; n < Nv; n += int64_t(gridDim.x) * blockDim.x) {
      const int64_t i = m * Nv + n;
      const ResidueTerms terms{x.res, x.elems, shx, m, w.res, w.elems, n};
      float v;
      // the products' integer: the diagonals' sum, or its reconstruction from Q remainder sums
      const int32_t* cp = C + m * Ncp + n;
      u128 T;
      if constexpr (DC > 0) {  // the diagonals' common case: no CRT code in these instances
        T = diagonal_sum<DC>(cp, Mp * Ncp, nch, D, bits);
      } else {
        T = crt.count > 0 ? u128(crt_value(cp, Mp * Ncp, crt)) : diagonal_sum<0>(cp, Mp * Ncp, nch, D, bits);
      }
      const bool ok = finish_output_fast(T, -(shx + w.sh[n]), Fx + (w.res.F ? w.res.F[n] : 0),
                                         bias ? bias + n : nullptr, fmt, terms, &v);
      if (ok) {
        store_fmt(out, m * ldo + n, v, fmt);
      } else {
        const int j = atomicAdd(count, 1);
        if (j < cap) list[j] = i;
      }
    }
  }
}

// The long-accumulator route for the outputs combine_fast_kernel left (list and count; all of
// them when more than `cap` were left), or for every output (list == null: digits, or a sum the
// host could not bound).
__global__ void combine_rest_kernel(const int32_t* __restrict__ C, int nch, int64_t Mp, int64_t Ncp, int64_t M,
                                    int64_t Nv, KernelOperand x, KernelOperand w, const double* __restrict__ bias,
                                    int D, int bits, bool digits, int fmt, void* __restrict__ out, int64_t ldo,
                                    const int64_t* __restrict__ list, const int32_t* __restrict__ count, int64_t cap,
                                    CrtConsts crt) {
  int64_t items = M * Nv;
  bool listed = false;
  if (list != nullptr) {
    const int64_t c = *count;
    listed = c <= cap;
    if (listed) items = c;
  }
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < items; t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = listed ? list[t] : t;
    const int64_t m = i / Nv, n = i - m * Nv;
    const int shx = x.sh[m];
    const ResidueTerms terms{x.res, x.elems, shx, m, w.res, w.elems, n};
    const int32_t* cp = C + m * Ncp + n;
    const double* bn = bias ? bias + n : nullptr;
    const int64_t o = m * ldo + n;  // where the output lands (i: its index in the chunk)
    int64_t* acc_out = digits ? static_cast<int64_t*>(out) + o * LDET_WORDS : nullptr;
    float v;
    if (crt.count > 0) {  // the CRT way: the reconstructed integer into the digits (wide = false)
      combine_output_value(crt_value(cp, Mp * Ncp, crt), -(shx + w.sh[n]), 0, bn, false, fmt, terms,
                           digits ? nullptr : &v, acc_out);
    } else {
      combine_output_digits(cp, Mp * Ncp, nch, D, bits, -(shx + w.sh[n]), bn, fmt, terms, digits ? nullptr : &v,
                            acc_out);
    }
    if (!digits) store_fmt(out, o, v, fmt);
  }
}

// combine_fast_kernel<DC> for the diagonal count D (one K-chunk), or the generic one.
template <int DC = kMaxDiagonals>
void launch_combine_fast(int D, int nch, dim3 grid, cudaStream_t stream, const int32_t* C, int64_t Mp, int64_t Ncp,
                         int64_t M, int64_t Nv, const KernelOperand& x, const KernelOperand& w, const double* bias,
                         int bits, int fmt, void* out, int64_t ldo, int64_t* list, int32_t* count, int64_t cap,
                         const WideCheck& check, const CrtConsts& crt) {
  if constexpr (DC > 0) {
    if (crt.count == 0 && nch == 1 && D == DC) {
      combine_fast_kernel<DC><<<grid, kThreads, 0, stream>>>(C, nch, Mp, Ncp, M, Nv, x, w, bias, D, bits, fmt, out,
                                                             ldo, list, count, cap, check, crt);
      return;
    }
    launch_combine_fast<DC - 1>(D, nch, grid, stream, C, Mp, Ncp, M, Nv, x, w, bias, bits, fmt, out, ldo, list, count,
                                cap, check, crt);
  } else {
    combine_fast_kernel<0><<<grid, kThreads, 0, stream>>>(C, nch, Mp, Ncp, M, Nv, x, w, bias, D, bits, fmt, out, ldo,
                                                          list, count, cap, check, crt);
  }
}

// The outputs of the rows a guessed plan left (left[0] of them, listed in left[1..]: x's rows, or
// w's rows = output columns), each straight from the operands (int_slices.h, exact_output). A
// fixed grid: with nothing listed, each block reads the count and returns.
__global__ void exact_rows_kernel(Elems x, Elems w, int64_t M, int64_t N, int64_t K, const double* __restrict__ bias,
                                  const int32_t* __restrict__ left, bool x_rows, bool digits, int fmt,
                                  void* __restrict__ out) {
  const int64_t per = x_rows ? N : M, items = int64_t(left[0]) * per;
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < items; t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = left[1 + t / per], other = t % per;
    const int64_t m = x_rows ? row : other, n = x_rows ? other : row;
    const int64_t i = m * N + n;
    const double* bn = bias ? bias + n : nullptr;
    if (digits) {
      exact_output(x, m, w, n, K, bn, fmt, nullptr, static_cast<int64_t*>(out) + i * LDET_WORDS);
    } else {
      float v;
      exact_output(x, m, w, n, K, bn, fmt, &v, nullptr);
      store_fmt(out, i, v, fmt);
    }
  }
}

at::Tensor row_needs_cuda(const at::Tensor& a, int64_t bits, at::Tensor& sum) {
  const int64_t R = a.size(0), K = a.size(1);
  at::Tensor out = uninit({R, 3}, a.options().dtype(at::kInt));  // every row written
  if (R > 0) {
    with_elements(a, [&](auto* p) {
      using T = std::remove_cv_t<std::remove_pointer_t<decltype(p)>>;
      // a warp per row for rows of <= 1024 elements (a block would idle most of its threads)
      const bool warp_rows = K <= 1024;
      const int64_t groups = warp_rows ? (R + kRowThreads / 32 - 1) / (kRowThreads / 32) : R;
      const unsigned grid = unsigned(std::min<int64_t>(groups, 65535 * 4));
      auto kernel = warp_rows ? row_needs_kernel<T, 32> : row_needs_kernel<T, kRowThreads>;
      kernel<<<grid, kRowThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(p, R, K, int(bits), quads_aligned(p, K),
                                                                          out.data_ptr<int32_t>(),
                                                                          sum.data_ptr<int32_t>());
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out;
}

SliceOperand make_slices_cuda(const at::Tensor& a, const at::Tensor& needs, int64_t S, int64_t bits, bool reverse,
                              int64_t Kc, int64_t nch, int64_t Rp, const at::Tensor& rcount, const at::Tensor& left,
                              int64_t moduli) {
  const bool residues = rcount.defined();
  const int64_t R = a.size(0), K = a.size(1), width = moduli > 0 ? moduli * Kc : nch * S * Kc;
  SliceOperand so = new_slice_operand(a, Rp, width, rcount, /*zero_fill=*/false, /*zero_slices=*/false);
  if (S == 0) {  // never a guessed plan (those have S >= 1): `left` needs no rows here
    so.sh.zero_();
    return so;
  }
  with_elements(a, [&](auto* p) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(p)>>;
    const int64_t quads_per_thread = moduli > 0 ? 1 : kQuadsInFlight;  // the kernel's U
    const dim3 grid(unsigned(std::min<int64_t>(
                        (nch * Kc / 4 + kThreads * quads_per_thread - 1) / (kThreads * quads_per_thread), 65535)),
                    unsigned(std::min<int64_t>(Rp, 65535)));
    auto kernel = moduli > 0 ? make_slices_kernel<T, true> : make_slices_kernel<T, false>;
    kernel<<<grid, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        p, needs.data_ptr<int32_t>(), R, Rp, K, int(S), int(bits), reverse, Kc, nch, so.q.data_ptr<int8_t>(),
        so.sh.data_ptr<int32_t>(), residues ? so.rcount.data_ptr<int32_t>() : nullptr,
        residues ? so.ridx.data_ptr<int32_t>() : nullptr, residues ? so.rval.data_ptr<double>() : nullptr,
        residues ? so.F.data_ptr<int32_t>() : nullptr, left.defined() ? left.data_ptr<int32_t>() : nullptr,
        quads_aligned(p, K), moduli > 0 ? crt_consts(int(bits), int(moduli)) : CrtConsts{});
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return so;
}

KernelOperand kernel_operand(const SliceOperand& o, const at::Tensor& sh_c) {
  KernelOperand k;
  k.res = o.rcount.defined() ? Residues{o.rcount.data_ptr<int32_t>(), o.ridx.data_ptr<int32_t>(),
                                        o.rval.data_ptr<double>(), o.F.data_ptr<int32_t>()}
                             : Residues{nullptr, nullptr, nullptr, nullptr};
  k.elems = elems_of(o.a);
  k.sh = sh_c.data_ptr<int32_t>();
  return k;
}

at::Tensor combine_cuda(const at::Tensor& C, int64_t M, int64_t Nv, const SliceOperand& x, const SliceOperand& w,
                        const at::Tensor& bias, int64_t D, int64_t bits, bool wide_ok, const WideCheck& check,
                        bool digits, at::ScalarType out_dtype, int64_t moduli, const at::Tensor& dst,
                        int32_t* count_in) {
  const CrtConsts crt = moduli > 0 ? crt_consts(int(bits), int(moduli)) : CrtConsts{};
  const int fmt = out_format(out_dtype);
  // every output: by the 128-bit kernel, or listed (or all, past the list) for combine_rest_kernel
  at::Tensor out = combine_output(C, M, Nv, digits, out_dtype, dst);
  const int64_t ldo = output_row_stride(out, digits);
  const at::Tensor shx_c = x.sh.contiguous(), shw_c = w.sh.contiguous();
  if (M * Nv > 0) {
    const int nch = moduli > 0 ? 1 : D > 0 ? int(C.size(0) / D) : 0;
    const dim3 grid(unsigned(std::min<int64_t>((Nv + kThreads - 1) / kThreads, 65535)),
                    unsigned(std::min<int64_t>(M, 65535)));
    const auto stream = c10::cuda::getCurrentCUDAStream();
    const KernelOperand xo = kernel_operand(x, shx_c), wo = kernel_operand(w, shw_c);
    const double* bp = bias.defined() ? bias.data_ptr<double>() : nullptr;
    const int32_t* Cp = C.data_ptr<int32_t>();
    if (!digits && (wide_ok || check.sums != nullptr)) {
      // outputs the 128-bit route leaves: their indices (up to cap) and count
      const int64_t cap = std::min<int64_t>(std::max<int64_t>(M * Nv / 8, 4096), int64_t(1) << 20);
      at::Tensor own;  // past the run's counters: one of its own
      if (count_in == nullptr) own = at::zeros({1}, C.options().dtype(at::kInt));
      int32_t* count = count_in != nullptr ? count_in : own.data_ptr<int32_t>();
      at::Tensor list = uninit({cap}, C.options().dtype(at::kLong));  // read below the count only
      launch_combine_fast(int(D), nch, grid, stream, Cp, C.size(1), C.size(2), M, Nv, xo, wo, bp, int(bits), fmt,
                          out.data_ptr(), ldo, list.data_ptr<int64_t>(), count, cap, check, crt);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      // sized for the list: when nothing was left, its blocks read the count and return
      const unsigned rest_grid = unsigned(std::min<int64_t>((cap + kThreads - 1) / kThreads, 1024));
      combine_rest_kernel<<<rest_grid, kThreads, 0, stream>>>(Cp, nch, C.size(1), C.size(2), M, Nv, xo, wo, bp, int(D),
                                                              int(bits), false, fmt, out.data_ptr(), ldo,
                                                              list.data_ptr<int64_t>(), count, cap,
                                                              crt);
    } else {
      combine_rest_kernel<<<grid_for(M * Nv), kThreads, 0, stream>>>(Cp, nch, C.size(1), C.size(2), M, Nv, xo, wo, bp,
                                                                    int(D), int(bits), digits, fmt, out.data_ptr(),
                                                                    ldo, nullptr, nullptr, 0, crt);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out;
}

void exact_rows_cuda(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                     const at::Tensor& left, bool x_rows, bool digits, at::ScalarType out_dtype) {
  exact_rows_kernel<<<512, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      elems_of(x), elems_of(w), x.size(0), w.size(0), x.size(1), bias.defined() ? bias.data_ptr<double>() : nullptr,
      left.data_ptr<int32_t>(), x_rows, digits, out_format(out_dtype), out.data_ptr());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The summaries into pinned host memory behind an event on the current stream.
struct CudaPendingSummary : PendingSummary {
  cudaEvent_t done = nullptr;
  int device = 0;
  bool ready() override { return event_done(done); }
  ~CudaPendingSummary() override {
    if (done != nullptr) {
      c10::cuda::CUDAGuard guard(device);
      (void)cudaEventDestroy(done);
    }
  }
};

std::shared_ptr<PendingSummary> summary_later_cuda(const at::Tensor& sums) {
  auto p = std::make_shared<CudaPendingSummary>();
  p->device = sums.get_device();
  p->host = at::empty(sums.sizes(), sums.options().device(at::kCPU).pinned_memory(true));
  p->host.copy_(sums, /*non_blocking=*/true);
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&p->done, cudaEventDisableTiming));
  C10_CUDA_CHECK(cudaEventRecord(p->done, c10::cuda::getCurrentCUDAStream()));
  return p;
}

}  // namespace

const SliceBackend& slice_backend_cuda() {
  // The route's costs (when the slices pay, residue terms, the CRT way): csrc/gemm_plan.h.
  static const SliceBackend be = [] {
    SliceBackend b;
    b.row_needs = &row_needs_cuda;
    b.make_slices = &make_slices_cuda;
    b.combine = &combine_cuda;
    b.int8_mm = &int8_gemm_lt;
    b.exact_rows = &exact_rows_cuda;
    b.summary_later = &summary_later_cuda;
    b.bits = 8;  // cuBLASLt's int8 GEMM accumulates in int32 with no 16-bit intermediate
    // cuBLASLt's sm90 int8 kernels: chunks 8 (mod 16) wide, <= 2^23 outputs
    b.chunk_max_outputs = int64_t(1) << 23;
    // plans from each call's summaries: cached guesses (no host synchronization per GEMM)
    // measured no faster in the det_ddp step, which is host-bound, and a stale guess costs a slow
    // call; a call's plans argument (-2, -2) turns them on
    b.guess_by_default = false;
    b.crt_route = true;
    b.device = GemmDevice::kCuda;
    return b;
  }();
  return be;
}

}  // namespace ldet

// Exact row sums by one warp: each lane sums its strided share of the terms (window + digits,
// csrc/window_acc.h), then the lanes' digit words are added by shuffles (integers: exact in any
// order) and normalized, so every lane holds the row's canonical digits. The canonical form of an
// exact sum is unique, so the lane split never shows in the bytes. Used by the fused row ops
// (norm_cuda.cu, cross_entropy_cuda.cu).
#pragma once

#include <cstdint>

#include "longacc.h"
#include "window_acc.h"

namespace ldet {

constexpr int kWarpLanes = 32;

// acc := the exact sum over j = lane, lane + 32, ... < W of term(j) (fp64 terms, each exact),
// canonical, the same in every lane. 32 canonical words per digit are far inside the headroom
// (longacc.h).
template <class Term>
__device__ void warp_row_digits(int64_t W, int lane, const Term& term, int64_t* acc) {
  zero(acc);
  WindowAcc win;
  int64_t n = 0;
  for (int64_t j = lane; j < W; j += kWarpLanes, ++n) {
    window_add(win, acc, term(j));
    if (((n + 1) & (LDET_NORM_INTERVAL - 1)) == 0) normalize(acc);
  }
  window_flush(win, acc);
  normalize(acc);
#pragma unroll
  for (int w = 0; w < LDET_WORDS; ++w) {
    long long v = acc[w];
#pragma unroll
    for (int o = kWarpLanes / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    acc[w] = v;
  }
  normalize(acc);
}

constexpr int kNoLsb = 1 << 20;  // lsb_exponent of a zero: above every finite double's

// The exponent of the lowest set bit of t's significand (t = odd * 2^e), kNoLsb for +-0. Every
// finite double is a multiple of 2^lsb_exponent(t), and lsb_exponent >= -1074.
__device__ inline int lsb_exponent(double t) {
  const unsigned long long bits = static_cast<unsigned long long>(__double_as_longlong(t)) & 0x7fffffffffffffffULL;
  if (bits == 0) return kNoLsb;
  const int field = int(bits >> 52);
  unsigned long long m = bits & 0xfffffffffffffULL;
  if (field != 0) m |= 1ULL << 52;  // normal: the implicit bit
  return (field != 0 ? field : 1) - 1075 + (__ffsll(static_cast<long long>(m)) - 1);
}

// round_fp32(the exact sum over j = lane, lane + 32, ... < W of term(j)), the same in every lane:
// finalize_fp32 of warp_row_digits' sum, decided where possible without the digits.
//
// Fast path: each lane sums its terms in fp64 (s) and their magnitudes (a), and the lanes add both
// in an xor butterfly (each addition commutative, so every lane holds the same s and a). Every
// term passes through at most h = ceil(W / 32) + 5 rounded additions, so |s - exact| <=
// gamma_h * sum|t| <= 2 h u a (u = 2^-53; a >= sum|t| (1 - gamma_h)): the terms are fp32 values or
// exact products of two (multiples of 2^-298, far above fp64's subnormals, and below 2^257), so
// no addition underflows or overflows. e = (h + 2) 2^-52 a, rounded up, bounds the error; the exact
// sum lies in [s - e, s + e] (rounded outward), and where both ends round to the same finite,
// nonzero fp32, so does it (rounding is monotonic): that is finalize_fp32's result, an IEEE
// round-to-nearest-even of the exact sum. A row of zero terms sums to +0.
//
// Exact path, for the rows the bound cannot decide: an exact sum that lies on a rounding boundary
// (a tie, or an fp32 value when the bound is wide). Sums of 16-bit values land there often: about
// 4% of bf16 LayerNorm rows of width 768 are ties, and one undecided row made the whole launch wait
// for its digits. Every term is a multiple of 2^q, q the lowest set bit's exponent over the row's
// terms (lsb_exponent), so is every partial sum, in any order; while sum|t| < 2^(53 + q), each of
// them has at most 53 significant bits, so every addition above (of t and of |t|) is exact and s
// is the exact sum. a < 2^(52 + q) certifies it: were sum|t| >= 2^(53 + q), the computed a would
// exceed sum|t| (1 - gamma_h) > 2^(52 + q). Then fp32(s), rounded to nearest even, is the result.
//
// Anything else (a non-finite term, an fp32 overflow) takes the digits. The decisions depend on
// s, a and q alone, the same in every lane, so the whole warp takes the same path.
template <class Term>
__device__ float warp_row_sum_fp32(int64_t W, int lane, const Term& term) {
  double s = 0.0, a = 0.0;
  int q = kNoLsb;
  for (int64_t j = lane; j < W; j += kWarpLanes) {
    const double t = term(j);
    s = __dadd_rn(s, t);
    a = __dadd_rn(a, fabs(t));
    q = min(q, lsb_exponent(t));
  }
#pragma unroll
  for (int o = kWarpLanes / 2; o > 0; o >>= 1) {
    s = __dadd_rn(s, __shfl_xor_sync(0xffffffffu, s, o));
    a = __dadd_rn(a, __shfl_xor_sync(0xffffffffu, a, o));
    q = min(q, __shfl_xor_sync(0xffffffffu, q, o));
  }
  if (a == 0.0) return 0.0f;  // every term +-0: the exact sum is 0, finalized as +0
  if (isfinite(a)) {
    const double h = double((W + kWarpLanes - 1) / kWarpLanes + 5);
    const double e = __dmul_ru(a, (h + 2.0) * 0x1p-52);
    const float lo = __double2float_rn(__dsub_rd(s, e)), hi = __double2float_rn(__dadd_ru(s, e));
    if (__float_as_uint(lo) == __float_as_uint(hi) && lo != 0.0f && isfinite(lo)) return lo;
    // a != 0: some term is nonzero, so q <= 1023 - 52 and the power below is a finite double
    if (a < ldexp(1.0, min(q + 52, 1023))) {
      const float r = __double2float_rn(s);  // s is the exact sum (+0 where it cancels)
      if (isfinite(r)) return r;
    }
  }
  int64_t acc[LDET_WORDS];
  warp_row_digits(W, lane, term, acc);
  return finalize_fp32(acc);
}

}  // namespace ldet

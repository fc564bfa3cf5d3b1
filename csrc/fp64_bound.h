// Rounded GEMM outputs from one fp64 GEMM and a proven error bound ("the fp64 route"): the
// per-output arithmetic shared by the CPU and CUDA builds (csrc/fp64_bound_host.h drives it).
//
// Why: exactness only has to reach the one rounding. For fp32 operands the integer slices need
// 25 int8 GEMMs (int_slices.h), 7.5 of the det_ddp step's 12.6 ms of GPU work, where one fp64
// GEMM of the widened operands costs about what an fp32 GEMM does on a GPU whose fp64 tensor
// cores match its fp32 rate (Hopper's do). What it returns is not exact, but how far it can be
// from exact is known, and most outputs lie far from every rounding boundary.
//
// The proof. Every product of two fp32 / bf16 / fp16 values is exact in fp64 (at most 48
// significand bits, exponents far inside fp64's range). The GEMM then adds the K exact products
// of an output with K - 1 roundings in whatever order (and blocking, split-K, fused multiply-add)
// the library picks; for any such order (Higham, "Accuracy and Stability of Numerical
// Algorithms", 2nd ed., sec. 3.1 and 4.2)
//     |D - P| <= gamma_{K-1} sum_k |x_k w_k| <= gamma_K ||x_m||_2 ||w_n||_2,  gamma_n = n u / (1 - n u)
// with u = 2^-53 when each rounding is to nearest (Cauchy-Schwarz for the second step). The route
// charges every rounding 2u, the error bound of any faithful rounding, so a library or tensor
// core that truncates is covered too (gemm_radius). ||x_m|| and ||w_n|| enter as upper bounds
// from an fp64 sum of squares (norm_upper). So P + b lies in [D - E + b, D + E + b]; rounding is
// monotone, so when both ends round to one value, that is the rounding of P + b: the contract's
// one rounding (round_if_decided). The bias joins with its own roundings' slack.
//
// The rest ("undecided": an interval holding a rounding boundary or a zero; for random data
// ~0.1% of outputs at K = 1024 and ~0.9% at K = 4096) are computed again from the operands:
//   1. an fp64 sum of the exact products in an order of known depth d (every product passes
//      through at most d additions; d ~ K / 128 on the GPU): |S - P| <= gamma_d sum |x_k w_k|
//      (ordered_radius), ~K / d times tighter than the GEMM's bound, so about one output in 200
//      of those stays undecided, mostly exact ties and zeros;
//   2. those (mostly exact ties, e.g. bf16 operands whose sums of 16-bit products land halfway
//      between two fp32 values, and exact zeros) by a certificate that the fp64 sum was exact:
//      every product is a multiple of 2^q (q its lowest set bit, at least), and when their
//      magnitudes sum below 2^(q + 53), every partial sum in any order is a representable
//      multiple of 2^q, so no addition rounded (round_if_exact);
//   3. the rest by the long accumulator (exact), as every other route would.
// Every output is therefore the exact sum rounded once: the same bytes as every other route,
// whichever outputs each step happened to decide (that choice may even vary between runs).
// Preconditions: the GEMM computes in IEEE fp64 (native: fp64_gemm_lt asks for cuBLASLt's
// CUBLAS_COMPUTE_64F, not its emulated fp64), and K u <= 2^-20 (K <= 2^33).
#pragma once

#include <cmath>
#include <cstdint>

#include "longacc.h"

namespace ldet {

// Upper bound of sqrt(sum_k a_k^2) from s, an fp64 sum (any order) of K exact squares: the sum
// of squares is at most s / (1 - gamma_{K-1}) <= s (1 + (K + 2) 2^-52); the multiplication, the
// square root (correctly rounded on both devices) and its scaling each round by at most 2^-53,
// which the 2^-50 covers.
LDET_HD double norm_upper(double s, int64_t K) {
  return sqrt(s * (1.0 + double(K + 2) * 0x1p-52)) * (1.0 + 0x1p-50);
}

// E >= gamma'_K ux uw, gamma' = 2 K u / (1 - 2 K u) <= 2 K u (1 + 2^-17): the GEMM's error bound
// with 2u charged per rounding; (1 + 2^-16) also covers the two roundings of this product.
LDET_HD double gemm_radius(double ux, double uw, int64_t K) {
  return (ux * uw) * (double(K) * 0x1p-52 * (1.0 + 0x1p-16));
}

// The recomputation's error bound (header comment, step 1): an fp64 sum of exact products in
// which each passes through at most `depth` roundings to nearest errs by at most gamma_depth
// sum |p| <= depth u (1 + 2^-20) ux uw; (1 + 2^-16) also covers this product's roundings.
LDET_HD double ordered_radius(double ux, double uw, int64_t depth) {
  return (ux * uw) * (double(depth) * 0x1p-53 * (1.0 + 0x1p-16));
}

// v (finite fp64) rounded once, to nearest-even, into a float with `prec` significand bits whose
// smallest subnormal is 2^emin_ulp and whose values stop below 2^emax_excl: the same ulp choice,
// ties, overflow and signed zero as round_acc (longacc.h) gives the same value held in digits.
LDET_HD float round_double_prec(double v, int prec, int emin_ulp, int emax_excl) {
  const uint64_t u = bits_of(v);
  const bool neg = (u >> 63) != 0;
  const int e = int((u >> 52) & 0x7ff);
  uint64_t m = u & ((uint64_t(1) << 52) - 1);
  int E;  // |v| = m 2^E
  if (e == 0) {
    E = -1074;
  } else {
    m |= uint64_t(1) << 52;
    E = e - 1075;
  }
  if (m == 0) return neg ? -0.0f : 0.0f;
  const int p = 63 - clz64(m) + E;  // |v| in [2^p, 2^(p+1))
  int ulp = p - (prec - 1);
  if (ulp < emin_ulp) ulp = emin_ulp;
  const int s = ulp - E;  // low bits of m dropped
  uint64_t q;
  bool round_bit, sticky;
  if (s <= 0) {
    q = m << (-s);  // exact: then m < 2^prec (v's own ulp is at least the format's)
    round_bit = sticky = false;
  } else if (s >= 64) {
    q = 0;  // m < 2^53 lies wholly below half an ulp
    round_bit = false;
    sticky = true;
  } else {
    q = m >> s;
    round_bit = ((m >> (s - 1)) & 1) != 0;
    sticky = (m & ((uint64_t(1) << (s - 1)) - 1)) != 0;
  }
  return round_finish(neg, q, ulp, round_bit, sticky, emax_excl);
}

// fp32: the IEEE conversion, which rounds the same way (ties to even, +-inf past the largest
// value, subnormals, a negative value rounding to zero gives -0.0); the CPU ops run it under the
// default floating-point environment (cpu/fp_env.h), the CUDA build has no flush-to-zero.
LDET_HD float round_double_prec_fmt(double v, int fmt) {
  if (fmt == kFmtBF16) return round_double_prec(v, 8, -133, 128);
  if (fmt == kFmtF16) return round_double_prec(v, 11, -24, 16);
  return float(v);
}

// When every value v + b with |v - c| <= r rounds to the same value of fmt: true, that value in
// *out. False when the interval holds a rounding boundary, a zero (an exact zero reads +0.0, a
// negative value that rounds to zero -0.0: only the exact sum can tell), or anything is not
// finite. b: the bias as fp64 (exact), or 0. The slack, 2^-50 (|c| + r + |b|), exceeds the
// rounding errors of the three operations forming each end (each below 2^-53 of that sum, fp64
// subnormals never arise: every nonzero term is at least 2^-400), so [lo, hi] holds the interval.
LDET_HD bool round_if_decided(double c, double r, double b, int fmt, float* out) {
  if (!(is_finite(c) && is_finite(r) && is_finite(b))) return false;
  const double slack = ((c < 0 ? -c : c) + r + (b < 0 ? -b : b)) * 0x1p-50;
  const double lo = ((c - r) + b) - slack, hi = ((c + r) + b) + slack;
  if (!(lo > 0.0 || hi < 0.0)) return false;
  const float a = round_double_prec_fmt(lo, fmt), z = round_double_prec_fmt(hi, fmt);
  if (bits_of(a) != bits_of(z)) return false;
  *out = a;
  return true;
}

// The decision after the recomputation: S, the sum of the exact products in an order of the
// given depth (ordered_radius), for the output whose operand rows have norm bounds ux, uw.
LDET_HD bool round_ordered(double S, double ux, double uw, int64_t depth, double b, int fmt, float* out) {
  return round_if_decided(S, ordered_radius(ux, uw, depth), b, fmt, out);
}

// The exponent of the lowest set bit of p, a finite fp64 value that is not fp64-subnormal (every
// product of two fp32 / bf16 / fp16 values, every such bias): p = odd * 2^result. Zero: kNoBits.
constexpr int kNoBits = 32767;
LDET_HD int lowest_bit(double p) { return exp_stat(p).lo; }  // exp_stat: zero -> lo = 32767

// Step 2 of the header comment. S: an fp64 sum, in any order, of the output's K exact products;
// q: the least lowest_bit over them (kNoBits when all are zero); ux uw >= sum |p_k| (norm_upper
// and Cauchy-Schwarz). With b joining q, when ux uw + |b| < 2^(q + 52) (the factor 2 below
// 2^(q + 53) covers this test's two roundings), every partial sum of the products and b is a
// multiple of 2^q below 2^(q + 53) in magnitude: representable, so every addition was exact, and
// S + b is the exact sum. True and its rounding in *out (exact zero: +0.0); false otherwise.
LDET_HD bool round_if_exact(double S, int q, double ux, double uw, double b, int fmt, float* out) {
  if (!(is_finite(S) && is_finite(ux) && is_finite(uw) && is_finite(b))) return false;
  if (b != 0.0) q = q < lowest_bit(b) ? q : lowest_bit(b);
  if (q >= kNoBits) {  // every product and b zero
    *out = 0.0f;
    return true;
  }
  // q >= -298 (products of fp32 subnormals) and at most ~2^9: 2^(q + 52) is a normal double
  if (!((ux * uw) + (b < 0 ? -b : b) < pow2(q + 52))) return false;
  const double t = S + b;  // exact (above)
  *out = t == 0.0 ? 0.0f : round_double_prec_fmt(t, fmt);
  return true;
}

// Whether a stored output is the decision pass's mark for "undecided": a NaN, which no decided
// output is (round_if_decided needs finite ends; their roundings are finite or +-inf).
LDET_HD bool undecided_mark_f32(uint32_t bits) { return (bits & 0x7fffffffu) > 0x7f800000u; }
LDET_HD bool undecided_mark_16(uint16_t bits, int fmt) {
  return fmt == kFmtBF16 ? (bits & 0x7fffu) > 0x7f80u : (bits & 0x7fffu) > 0x7c00u;
}

}  // namespace ldet

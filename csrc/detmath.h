// Elementwise transcendental math written once for the CPU and the CUDA build.
//
// Why: library exp/erf/tanh differ between glibc, SLEEF (PyTorch's vectorized CPU path) and
// CUDA's libdevice, and PyTorch's CPU kernels even compute the same element differently in the
// vectorized body and the scalar tail (position dependence; see docs/det_modules.md). Here every
// function uses only IEEE +, -, *, / and explicit fma in fp64 (each correctly rounded everywhere;
// no FMA contraction chosen by a compiler: the build passes -ffp-contract=off / -fmad=false),
// comparisons, and exact bit manipulation.
// Same inputs -> same fp64 bits on any CPU or GPU, independent of where the element sits.
// The fp64 result (relative error ~1e-15 or better, ~6e-14 deep in the erfc tail; norm_cdf(x)
// for -4.25 < x < 0 forms 1 - erf, an absolute error of ~2^-48, up to ~2^-36 relative to
// Phi(-4.2): found by tests/test_gelu_fast.py) is then rounded once to the output dtype, so
// the output is a fixed function of the input element.
//
// Constants are hex-float literals: exact, no decimal parsing involved.
#pragma once

#include <cmath>
#include <cstdint>

#include "longacc.h"

namespace ldet {
namespace dm {

constexpr double kLn2Hi = 0x1.62e42feep-1;  // low 32 bits zero: k * kLn2Hi is exact for |k| < 2^20
constexpr double kLn2Lo = 0x1.a39ef35793c76p-33;
constexpr double kInvLn2 = 0x1.71547652b82fep+0;
constexpr double kInvSqrtPi = 0x1.20dd750429b6dp-1;
constexpr double kTwoOverSqrtPi = 0x1.20dd750429b6dp+0;
constexpr double kInvSqrt2 = 0x1.6a09e667f3bccp-1;
constexpr double kInvSqrt2Pi = 0x1.9884533d43651p-2;
constexpr double kSqrt2OverPi = 0x1.9884533d43651p-1;
constexpr double kGeluC = 0x1.6e4e26d4801f7p-5;  // 0.044715, as in PyTorch's tanh-GELU

// 1/n! for n = 0..20 (Taylor coefficients of exp, sin and cos), each correctly rounded.
LDET_HD double inv_fact(int n) {
  constexpr double c[21] = {
      0x1.0000000000000p+0,  0x1.0000000000000p+0,  0x1.0000000000000p-1,  0x1.5555555555555p-3,
      0x1.5555555555555p-5,  0x1.1111111111111p-7,  0x1.6c16c16c16c17p-10, 0x1.a01a01a01a01ap-13,
      0x1.a01a01a01a01ap-16, 0x1.71de3a556c734p-19, 0x1.27e4fb7789f5cp-22, 0x1.ae64567f544e4p-26,
      0x1.1eed8eff8d898p-29, 0x1.6124613a86d09p-33, 0x1.93974a8c07c9dp-37, 0x1.ae7f3e733b81fp-41,
      0x1.ae7f3e733b81fp-45, 0x1.952c77030ad4ap-49, 0x1.6827863b97d97p-53, 0x1.2f49b46814157p-57,
      0x1.e542ba4020225p-62};
  return c[n];
}

LDET_HD bool is_nan(double x) { return x != x; }

// pow2 (2^k exactly): longacc.h.

// exp(x). Cody-Waite reduction x = k ln2 + r, |r| <= ln2/2, then a degree-13 Taylor polynomial
// (truncation < 5e-18) and an exact scaling by 2^k in two steps (so subnormal results are
// rounded once, by the last multiply).
LDET_HD double exp(double x) {
  if (is_nan(x)) return x;
  if (x > 709.78) return double_of(0x7ff0000000000000ULL);
  if (x < -745.2) return 0.0;
  const double t = x * kInvLn2;
  const int k = t >= 0 ? int(t + 0.5) : int(t - 0.5);  // truncating conversion: exact
  const double r = (x - double(k) * kLn2Hi) - double(k) * kLn2Lo;
  double p = inv_fact(13);
  for (int n = 12; n >= 0; --n) p = p * r + inv_fact(n);
  const int k1 = k / 2;  // both halves stay inside the normal exponent range
  return (p * pow2(k1)) * pow2(k - k1);
}

// exp(x) - 1 without cancellation near 0 (Taylor to degree 16 for |x| < 0.35).
LDET_HD double expm1(double x) {
  if (x > -0.35 && x < 0.35) {
    double p = inv_fact(16);
    for (int n = 15; n >= 1; --n) p = p * x + inv_fact(n);
    return p * x;
  }
  return exp(x) - 1.0;
}

// exp(-z*z) with z*z split exactly (Dekker) so the rounding of z*z does not get amplified by
// the large exponent in the erfc tail.
LDET_HD double exp_neg_sq(double z) {
  const double c = 134217729.0 * z;  // Veltkamp split, 2^27 + 1
  const double zh = c - (c - z);
  const double zl = z - zh;
  const double hi = z * z;
  const double lo = ((zh * zh - hi) + 2.0 * zh * zl) + zl * zl;  // z*z == hi + lo exactly
  return exp(-hi) * (1.0 - lo);
}

// fma(a, b, c): a * b + c rounded once, an explicit IEEE operation (the build's -ffp-contract=off
// / -fmad=false only stop the compiler from fusing on its own).
LDET_HD double fma_rn(double a, double b, double c) {
#if defined(__CUDA_ARCH__)
  return __fma_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// 1/(2n+1) rounded to nearest, n = 0..59 (Python's correctly rounded int/int division): the atanh
// series of log1p and the quotients of erf_series.
LDET_HD double inv_odd(int n) {
  constexpr double c[60] = {
      0x1.0000000000000p+0,  0x1.5555555555555p-2,  0x1.999999999999ap-3,  0x1.2492492492492p-3,
      0x1.c71c71c71c71cp-4,  0x1.745d1745d1746p-4,  0x1.3b13b13b13b14p-4,  0x1.1111111111111p-4,
      0x1.e1e1e1e1e1e1ep-5,  0x1.af286bca1af28p-5,  0x1.8618618618618p-5,  0x1.642c8590b2164p-5,
      0x1.47ae147ae147bp-5,  0x1.2f684bda12f68p-5,  0x1.1a7b9611a7b96p-5,  0x1.0842108421084p-5,
      0x1.f07c1f07c1f08p-6,  0x1.d41d41d41d41dp-6,  0x1.bacf914c1bad0p-6,  0x1.a41a41a41a41ap-6,
      0x1.8f9c18f9c18fap-6,  0x1.7d05f417d05f4p-6,  0x1.6c16c16c16c17p-6,  0x1.5c9882b931057p-6,
      0x1.4e5e0a72f0539p-6,  0x1.4141414141414p-6,  0x1.3521cfb2b78c1p-6,  0x1.29e4129e4129ep-6,
      0x1.1f7047dc11f70p-6,  0x1.15b1e5f75270dp-6,  0x1.0c9714fbcda3bp-6,  0x1.0410410410410p-6,
      0x1.f81f81f81f820p-7,  0x1.e9131abf0b767p-7,  0x1.dae6076b981dbp-7,  0x1.cd85689039b0bp-7,
      0x1.c0e070381c0e0p-7,  0x1.b4e81b4e81b4fp-7,  0x1.a98ef606a63bep-7,  0x1.9ec8e951033d9p-7,
      0x1.948b0fcd6e9e0p-7,  0x1.8acb90f6bf3aap-7,  0x1.8181818181818p-7,  0x1.78a4c8178a4c8p-7,
      0x1.702e05c0b8170p-7,  0x1.6816816816817p-7,  0x1.6058160581606p-7,  0x1.58ed2308158edp-7,
      0x1.51d07eae2f815p-7,  0x1.4afd6a052bf5bp-7,  0x1.446f86562d9fbp-7,  0x1.3e22cbce4a902p-7,
      0x1.3813813813814p-7,  0x1.323e34a2b10bfp-7,  0x1.2c9fb4d812ca0p-7,  0x1.27350b8812735p-7,
      0x1.21fb78121fb78p-7,  0x1.1cf06ada2811dp-7,  0x1.1811811811812p-7,  0x1.135c81135c811p-7,
  };
  return c[n];
}

// p / (2n+1) rounded to nearest, 1 <= n <= 59: the same bits as the IEEE division, from one multiply
// and two FMA and no divide (an fp64 division is a long software sequence on the GPU).
// Why it is the correctly rounded quotient, for 2^-900 <= |p| <= 2^1000 (else: the division itself).
// Let d = 2n+1, u = ulp(p/d), y = inv_odd(n) = (1/d)(1 + e2) with |e2| <= 2^-53 and q = RN(p y):
// |q - p/d| < 2u. r = RN(p - d q) = (p - d q)(1 + e1), |e1| <= 2^-53 (p - d q is 0 or a multiple of
// ulp(q) >= 2^-959: normal). The last FMA rounds its exact value once, and that value
//   q + r y = p/d + (p/d - q) ((1 + e1)(1 + e2) - 1)   lies within 2u (2^-52 + 2^-106) < 2^-50.9 u of p/d.
// No rounding boundary is that close to p/d: p is a multiple of u (ulp(p) >= u), so for a midpoint
// M = (2m+1) u/2 of p/d's binade |p/d - M| = |2p - d (2m+1) u| / (2d) >= u / (2d) >= u / 238 (an
// even multiple of u minus an odd one), and likewise >= u / 476 for the binade below. So RN of that
// value is RN(p/d). tests/test_detmath_reference.py checks the functions that use it against a
// Python evaluation with true divisions.
LDET_HD double div_odd(double p, int n) {
  const double d = double(2 * n + 1);
  const double a = p < 0 ? -p : p;
  if (!(a >= 0x1p-900 && a <= 0x1p+1000)) return p / d;  // zero, tiny, huge, NaN
  const double y = inv_odd(n);
  const double q = p * y;
  return fma_rn(fma_rn(-q, d, p), y, q);
}

// Fully unrolled loops: a table read with the loop's index then is a constant, not a per-thread
// copy of the table in the GPU's local memory.
#if defined(__CUDA_ARCH__)
#define LDET_UNROLL _Pragma("unroll")
#else
#define LDET_UNROLL _Pragma("GCC unroll 60")
#endif

// erf(z) for 0 <= z < 3: the all-positive series  2/sqrt(pi) e^{-z^2} sum_n (2z^2)^n z / (2n+1)!!
// (no cancellation). Stops once a term is below 2^-56 of the sum: past the peak the terms shrink
// geometrically, so the tail is negligible (43 terms at z = 2.9, 4 at z = 0.01). The stopping
// point is a function of z alone, so the result still is.
LDET_HD double erf_series(double z) {
  const double z2 = 2.0 * z * z;
  double t = z, s = z;
  LDET_UNROLL
  for (int n = 1; n < 60; ++n) {
    t = div_odd(t * z2, n);  // == t * z2 / double(2 * n + 1), bit for bit
    s = s + t;
    if (t < s * 0x1p-56) break;
  }
  return s * exp_neg_sq(z) * kTwoOverSqrtPi;
}

// erfc(z) for z >= 3: Laplace continued fraction evaluated backwards. Terms needed for full
// convergence (measured against 200 terms): 30 at z = 3, 25 at 4, 15 at 6; we take 40/28/20.
LDET_HD double erfc_cf(double z) {
  const int terms = z < 4.0 ? 40 : (z < 6.0 ? 28 : 20);
  double f = z;
  for (int n = terms; n >= 1; --n) f = z + (0.5 * double(n)) / f;
  return exp_neg_sq(z) * kInvSqrtPi / f;
}

// Phi(x) = P(N(0,1) <= x) = erfc(-x / sqrt 2) / 2, accurate in both tails.
LDET_HD double norm_cdf(double x) {
  if (is_nan(x)) return x;
  const double z = x * kInvSqrt2;
  const double a = z < 0 ? -z : z;
  if (a > 40.0) return x > 0 ? 1.0 : 0.0;
  double erf_a, erfc_a;
  if (a < 3.0) {
    erf_a = erf_series(a);
    erfc_a = 1.0 - erf_a;
  } else {
    erfc_a = erfc_cf(a);
    erf_a = 1.0 - erfc_a;
  }
  return x >= 0 ? 0.5 * (1.0 + erf_a) : 0.5 * erfc_a;
}

// sigmoid(t) and sigmoid(-t) = 1 - sigmoid(t), each without cancellation or inf/inf.
LDET_HD void sigmoid_pair(double t, double* s, double* sm) {
  if (t >= 0) {
    const double e = exp(-t);
    *s = 1.0 / (1.0 + e);
    *sm = e / (1.0 + e);
  } else {
    const double e = exp(t);  // NaN lands here too and propagates
    *s = e / (1.0 + e);
    *sm = 1.0 / (1.0 + e);
  }
}

LDET_HD double tanh(double x) {
  const double a = x < 0 ? -x : x;
  double t;
  if (a > 22.0) {
    t = 1.0;  // 1 - tanh(22) < 2^-63
  } else {
    const double em = expm1(2.0 * a);
    t = em / (em + 2.0);
  }
  return x < 0 ? -t : t;  // NaN: a > 22 is false and expm1(NaN) is NaN
}

// sech(x)^2 = 4 e^{-2|x|} / (1 + e^{-2|x|})^2: the tanh derivative without 1 - t*t cancellation.
LDET_HD double sech2(double x) {
  const double a = x < 0 ? -x : x;
  const double e = exp(-2.0 * a);
  const double d = 1.0 + e;
  return 4.0 * e / (d * d);
}

constexpr double kSqrt2M1 = 0x1.a827999fcef32p-2;  // sqrt(2) - 1: only chooses a branch
constexpr double kSqrtHalf = 0x1.6a09e667f3bcdp-1;  // likewise

// log(1 + t) for t >= 0 (or NaN): the operation sequence of the eager reference
// lightning_det/reference/log1p_ref.py, one IEEE operation at a time, so the same fp64 bits.
// 1 + t = 2^k f, f in [sqrt(1/2), sqrt(2)); log f = 2 atanh(u), u = (f - 1) / (f + 1); for
// t < sqrt(2) - 1, k = 0 and u = t / (t + 2) (1 + t is never rounded). frexp is exact.
LDET_HD double log1p_nonneg(double t) {
  const bool small = t < kSqrt2M1;
  int expo = 0;
  const double mant = frexp(small ? 1.0 : t + 1.0, &expo);  // mant in [0.5, 1)
  const bool low = mant < kSqrtHalf;
  const double f = low ? mant + mant : mant;
  const double k = small ? 0.0 : double(expo - (low ? 1 : 0));
  const double u = small ? t / (t + 2.0) : (f - 1.0) / (f + 1.0);
  const double w = u * u;
  double p = inv_odd(11);
  for (int n = 10; n >= 0; --n) p = p * w + inv_odd(n);  // multiply, then add: each rounded once
  return k * kLn2Hi + (k * kLn2Lo + (u + u) * p);
}


// ---------------------------------------------------------------------------------------------
// sin and cos: x = k pi/2 + r, |r| <= ~pi/4, then Taylor polynomials in r (degree 17 / 18:
// truncation below 1e-19), all in IEEE fp64 operations, so every device gives the same bits.
//
// The reduction. |x| < 2^24 (k < 2^24): Cody-Waite with pi/2 = kPio2A + kPio2B + kPio2C, the
// first two with 28 significant bits (k times them is exact), error below 2^-80. 2^24 <= |x| <
// 2^128 (every fp32, bf16, fp16 value up to their largest): Payne-Hanek. x = m 2^e with m a
// 53-bit integer; only the bits of 2/pi from position e - 1 on matter modulo 4, so 192 of them
// (kTwoOverPiBits) times m give the quadrant and 128 bits of the fraction exactly, and the
// fraction times pi/2 is formed as a double-double (Dekker's product, no FMA): |r| keeps ~90 bits
// while fp32 arguments stay above 2^-30 from any multiple of pi/2. |x| >= 2^128 (float64 inputs
// only): NaN.

constexpr double kPio2A = 0x1.921fb54000000p+0;   // 28 bits
constexpr double kPio2B = 0x1.10b4612000000p-30;  // 28 bits
constexpr double kPio2C = -0x1.676733ae8fe48p-60;
constexpr double kPio2Hi = 0x1.921fb54442d18p+0;  // pi/2 = kPio2Hi + kPio2Lo to ~107 bits
constexpr double kPio2Lo = 0x1.1a62633145c07p-54;
constexpr double kTwoOverPi = 0x1.45f306dc9c883p-1;

// Bits 1..352 of 2/pi after the binary point, 32 a word.
LDET_HD uint32_t two_over_pi_word(int i) {
  constexpr uint32_t w[11] = {0xA2F9836E, 0x4E441529, 0xFC2757D1, 0xF534DDC0, 0xDB629599, 0x3C439041,
                              0xFE5163AB, 0xDEBBC561, 0xB7246E3A, 0x424DD2E0, 0x06492EEA};
  return w[i];
}

// The 32 bits of 2/pi at positions pos .. pos + 31 (position 1 is the first after the point;
// positions below 1 are the integer part, 0).
LDET_HD uint32_t two_over_pi_bits(int pos) {
  const int lo = pos - 1;  // bit offset of the first wanted bit from position 1
  uint64_t v = 0;          // 64 bits from word floor(lo / 32) on (zeros before the point)
  const int q = lo >= 0 ? lo / 32 : -((31 - lo) / 32), sh = lo - q * 32;
  for (int j = 0; j < 2; ++j) {
    const int idx = q + j;
    v = (v << 32) | ((idx >= 0 && idx < 11) ? uint64_t(two_over_pi_word(idx)) : 0);
  }
  return uint32_t(v >> (32 - sh));
}

// a * b = *hi + *lo exactly (Veltkamp split; no FMA).
LDET_HD void two_prod(double a, double b, double* hi, double* lo) {
  constexpr double kSplit = 134217729.0;  // 2^27 + 1
  const double p = a * b;
  double t = kSplit * a;
  const double ah = t - (t - a), al = a - ah;
  t = kSplit * b;
  const double bh = t - (t - b), bl = b - bh;
  *hi = p;
  *lo = ((ah * bh - p) + ah * bl + al * bh) + al * bl;
}

// Payne-Hanek for 2^24 <= ax < 2^128: the quadrant (mod 4) and r = ax - k pi/2.
LDET_HD double reduce_large(double ax, int* quadrant) {
  const uint64_t b = bits_of(ax);
  const uint64_t m = (b & ((uint64_t(1) << 52) - 1)) | (uint64_t(1) << 52);
  const int e = int((b >> 52) & 0x7ff) - 1075;  // ax = m 2^e, -28 <= e <= 75
  // W: bits e - 1 .. e + 190 of 2/pi, six 32-bit words, most significant first; y = m W 2^-190.
  uint32_t W[6];
  for (int j = 0; j < 6; ++j) W[j] = two_over_pi_bits(e - 1 + 32 * j);
  // P = m W, eight 32-bit words, least significant first.
  uint32_t P[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const uint32_t mw[2] = {uint32_t(m), uint32_t(m >> 32)};
  for (int i = 0; i < 2; ++i) {
    uint64_t carry = 0;
    for (int j = 5; j >= 0; --j) {  // least significant first: W[j] has weight 2^(32 (5 - j))
      const int at = i + (5 - j);
      const uint64_t t = uint64_t(mw[i]) * W[j] + P[at] + carry;
      P[at] = uint32_t(t);
      carry = t >> 32;
    }
    for (int at = i + 6; carry != 0 && at < 8; ++at) {
      const uint64_t t = uint64_t(P[at]) + carry;
      P[at] = uint32_t(t);
      carry = t >> 32;
    }
  }
  // Bits 190, 191: the quadrant; bits 62 .. 189: the fraction F (hi 64, lo 64).
  auto bits64 = [&](int from) {  // bits from .. from + 63 of P
    const int w = from / 32, s = from % 32;
    uint64_t v = uint64_t(P[w]) | (uint64_t(P[w + 1]) << 32);
    if (s != 0) v = (v >> s) | (uint64_t(w + 2 < 8 ? P[w + 2] : 0) << (64 - s));
    return v;
  };
  int q = int((P[5] >> 30) & 3u);
  uint64_t fh = bits64(126), fl = bits64(62);
  double sign = 1.0;
  if (fh >> 63) {  // fraction >= 1/2: r = (F - 1) pi/2 and the next quadrant
    fl = ~fl + 1;
    fh = ~fh + (fl == 0 ? 1 : 0);
    sign = -1.0;
    q = (q + 1) & 3;
  }
  // F = fr + fx exactly: the top 53 bits and the next 43 (of 2^-128 weight units).
  const double fr = double(fh >> 11) * pow2(-53);
  const double fx = double(((fh & 0x7ffULL) << 32) | (fl >> 32)) * pow2(-96);
  double ph, pl;
  two_prod(fr, kPio2Hi, &ph, &pl);
  *quadrant = q;
  return sign * (ph + (pl + (fx * kPio2Hi + fr * kPio2Lo)));
}

// r and the quadrant k mod 4 of x = k pi/2 + r (x finite, |x| < 2^128).
LDET_HD double reduce_pio2(double x, int* quadrant) {
  const double ax = x < 0 ? -x : x;
  double r;
  int q;
  if (ax < 16777216.0) {  // 2^24
    const double k = floor(ax * kTwoOverPi + 0.5);
    r = ((ax - k * kPio2A) - k * kPio2B) - k * kPio2C;
    q = int(int64_t(k) & 3);
  } else {
    r = reduce_large(ax, &q);
  }
  if (x < 0) {  // sin(-x) = -sin x, cos(-x) = cos x: the quadrant of -x is -q
    r = -r;
    q = (4 - q) & 3;
  }
  *quadrant = q;
  return r;
}

// sin r and cos r for |r| <= ~pi/4 + 2^-20.
LDET_HD void sin_cos_poly(double r, double* s, double* c) {
  const double z = r * r;
  double ps = inv_fact(17);  // sin: the sign of r^n / n! is (-1)^((n - 1) / 2)
  for (int n = 15; n >= 3; n -= 2) ps = ps * z + ((n / 2) % 2 ? -inv_fact(n) : inv_fact(n));
  *s = r + r * (z * ps);
  double pc = -inv_fact(18);  // cos: the sign of r^n / n! is (-1)^(n / 2)
  for (int n = 16; n >= 2; n -= 2) pc = pc * z + ((n / 2) % 2 ? -inv_fact(n) : inv_fact(n));
  *c = 1.0 + z * pc;
}

// sin x (want_cos false) or cos x, for any fp64 x: NaN for inf / NaN and |x| >= 2^128.
LDET_HD double sin_or_cos(double x, bool want_cos) {
  if (!is_finite(x) || x >= 0x1p128 || x <= -0x1p128) return double_of(0x7ff8000000000000ULL);
  if (x == 0.0) return want_cos ? 1.0 : x;  // sin(-0) = -0
  int q;
  const double r = reduce_pio2(x, &q);
  double s, c;
  sin_cos_poly(r, &s, &c);
  if (want_cos) q = (q + 1) & 3;  // cos x = sin(x + pi/2)
  return q == 0 ? s : q == 1 ? c : q == 2 ? -s : -c;
}

}  // namespace dm

// The cross-entropy loss of one row (lightning_det/nn/loss.py): fp32((m - x_t) + log1p(T)) with
// m the row's max, x_t the target's logit (both fp32, subtracted in fp64) and T = round(sum_j
// e_j - 1) >= 0. A NaN loss is the canonical quiet NaN on every device.
LDET_HD float ce_row_loss(float m, float picked, float t_minus) {
  const float v = float((double(m) - double(picked)) + dm::log1p_nonneg(double(t_minus)));
  return v != v ? float_of(0x7fc00000u) : v;
}

// Activation codes shared by the op schema (csrc/schema/detmath.cpp) and Python
// (lightning_det/nn/functional.py).
// kActExp is not an activation module: it is the exp of the det softmax (lightning_det/nn/attention.py).
// kActSin / kActCos: sin and cos (rotary position embeddings: lightning_det/nn/elementwise_routes.py).
enum ActKind {
  kActGeluErf = 0, kActGeluTanh = 1, kActSilu = 2, kActTanh = 3, kActExp = 4, kActSin = 5, kActCos = 6,
  kActSigmoid = 7
};

LDET_HD double act_forward(double x, int kind) {
  if (kind == kActGeluErf) return x * dm::norm_cdf(x);
  if (kind == kActGeluTanh) {
    // 0.5 x (1 + tanh(u)) == x * sigmoid(2u): the sigmoid form has no cancellation for x < 0
    const double u = dm::kSqrt2OverPi * (x + dm::kGeluC * x * x * x);
    double s, sm;
    dm::sigmoid_pair(2.0 * u, &s, &sm);
    return x * s;
  }
  if (kind == kActSilu) {
    double s, sm;
    dm::sigmoid_pair(x, &s, &sm);
    return x * s;
  }
  if (kind == kActExp) return dm::exp(x);
  if (kind == kActSin) return dm::sin_or_cos(x, false);
  if (kind == kActCos) return dm::sin_or_cos(x, true);
  if (kind == kActSigmoid) {
    double s, sm;
    dm::sigmoid_pair(x, &s, &sm);
    return s;
  }
  return dm::tanh(x);
}

// d act / dx at x.
LDET_HD double act_derivative(double x, int kind) {
  if (kind == kActGeluErf) return dm::norm_cdf(x) + x * (dm::exp(-0.5 * x * x) * dm::kInvSqrt2Pi);
  if (kind == kActGeluTanh) {
    const double u = dm::kSqrt2OverPi * (x + dm::kGeluC * x * x * x);
    const double du = dm::kSqrt2OverPi * (1.0 + 3.0 * dm::kGeluC * x * x);
    double s, sm;
    dm::sigmoid_pair(2.0 * u, &s, &sm);
    return s + x * (s * sm) * (2.0 * du);
  }
  if (kind == kActSilu) {
    double s, sm;
    dm::sigmoid_pair(x, &s, &sm);
    return s * (1.0 + x * sm);
  }
  if (kind == kActExp) return dm::exp(x);
  if (kind == kActSin) return dm::sin_or_cos(x, true);
  if (kind == kActCos) return -dm::sin_or_cos(x, false);
  if (kind == kActSigmoid) {  // s (1 - s), as s * sigmoid(-x): no cancellation
    double s, sm;
    dm::sigmoid_pair(x, &s, &sm);
    return s * sm;
  }
  return dm::sech2(x);
}

// Rounds an fp64 value once, to nearest-even, into the format `fmt` (longacc.h OutFormat) and
// returns it as an fp32 value (exact for bf16/fp16). fp32: the IEEE conversion. bf16/fp16: with
// e = floor(log2|v|) (frexp, exact), the format's quantum at |v| is q = 2^(max(e, emin) - m)
// (m fraction bits, emin the smallest normal exponent: below it the subnormals' fixed quantum).
// |v| / q is an exact power-of-two scaling, rint rounds it to an integer once (nearest, ties to
// even: the default rounding mode on the CPU, rint's definition on CUDA), and times q it is the
// rounded value, exactly; above the format's largest finite value it is +-inf (IEEE overflow).
// So there is one rounding and no double rounding, and the same bytes on every CPU and GPU.
LDET_HD float round_double_fmt(double v, int fmt) {
  if (fmt == kFmtF32) return float(v);
  if (v != v) return float_of(0x7fc00000u);
  const double a = v < 0 ? -v : v;
  // Beyond every supported format's range, or below half its smallest subnormal (2^-134 for
  // bf16, 2^-25 for fp16): the rounded value is +-inf or a signed zero.
  if (a >= 0x1p+200) return float_of(v < 0 ? 0xff800000u : 0x7f800000u);
  if (a < 0x1p-160) return float(copysign(0.0, v));  // keeps the sign of -0.0
  const bool bf16 = fmt == kFmtBF16;
  const int frac_bits = bf16 ? 7 : 10, emin = bf16 ? -126 : -14;
  const double largest = bf16 ? 0x1.fep+127 : 65504.0;
  int e;
  frexp(a, &e);  // a = f 2^e, f in [0.5, 1)
  const int qe = (e - 1 > emin ? e - 1 : emin) - frac_bits;  // in [-160 - 10, 200]: normal scalings
#if defined(__CUDA_ARCH__)
  double r = rint(ldexp(a, -qe));
#else
  double r = std::rint(ldexp(a, -qe));
#endif
  r = ldexp(r, qe);
  if (r > largest) r = INFINITY;
  return float(copysign(r, v));  // exact: a bf16/fp16 value (or inf) is an fp32 value
}

// An fp32 value rounded once to `fmt` as PyTorch's .to(dtype) rounds it: round_double_fmt, and a
// zero keeps its sign (round_double_fmt gives -0.0 a plus sign). The fused norm and cross-entropy
// ops store through this, so their bytes are those of the eager ops they replaced.
LDET_HD float round_float_fmt(float v, int fmt) {
  if (v == 0.0f) return v;  // +-0.0: exact in every format
  return round_double_fmt(double(v), fmt);
}

}  // namespace ldet

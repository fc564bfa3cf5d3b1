// The long (Kulisch) accumulator: digit format, exact addition, normalization, rounding.
//
// This one header is compiled into both the CPU and the CUDA build, so the two cannot drift.
// Numerical profile "ldet-v1" (bump the version string when anything here changes meaning).
//
// ---------------------------------------------------------------------------------------
// Digit format (ldet-v1)
//   An accumulator is LDET_WORDS = 19 signed int64 words:
//     words 0..17  digits d_i, radix 2^32, value = sum_i d_i * 2^(32*i - 298)
//     word 18      status word: three 21-bit counters for specials (see below)
//   Bit 0 of digit 0 weighs 2^-298 = (2^-149)^2, the smallest product of two fp32 subnormals,
//   so every product of two fp32/bf16/fp16 inputs is an integer number of digit units.
//   Digit 17 weighs 2^246; the largest fp32 product is below 2^256, so a single product touches
//   at most digits q..q+2 <= 17 and digit 17 has 2^53 of carry room beyond the largest product.
//
// Canonical (normalized) form
//   digits 0..16 in [0, 2^32), digit 17 signed, |d_17| < 2^LDET_TOP_BITS = 2^41, carrying the
//   sign of the whole value. Every value in range has exactly one canonical form, so equal
//   values have equal bytes. Each status counter is clamped to 0 or 1.
//
// Range
//   A value is in range when the top digit of its canonical form lies in (-2^41, 2^41), so
//   every |value| < (2^41 - 1) * 2^246 is (2^31 largest fp32 products; the formats' own
//   range ends at 2^128). normalize() turns a value out of range into an overflow: its digits
//   become zero and the +inf (or -inf) counter is set, as an IEEE sum that overflows gives inf.
//   A later sum then follows the IEEE rules below (inf - inf = NaN), and the result never
//   shows a wrapped sign. normalize() takes any int64 words: no intermediate leaves int64.
//
// Headroom bounds (all here; the Python mirror is lightning_det/profile.py; tests in
// tests/test_longacc_format.py and tests/test_digit_bounds.py check each edge)
//   One "addition" adds a limb of magnitude < 2^32 to a digit. From canonical form (|d| < 2^32)
//   a digit 0..16 absorbs  LDET_HEADROOM_ADDS = 2^31 - 2  additions without leaving int64:
//   (2^31 - 2) * (2^32 - 1) + 2^32 - 1 < 2^63 - 1, while 2^31 - 1 more such limbs can exceed it.
//   Kernels normalize after every LDET_NORM_INTERVAL = 2^30 additions, well inside the bound
//   (the top digit: 2^41 + 2^30 * 2^32 < 2^63), so K has no limit.
//   A word-wise sum (det_combine, the int64 SUM all-reduce, a flush of partial accumulators)
//   holds at most LDET_COMBINE_MAX = 2^21 - 1 canonical accumulators before it is normalized:
//   each status counter then stays below 2^21 (it would carry into the next counter at 2^21),
//   and the top digit below (2^21 - 1) * 2^41 < 2^62. det_combine normalizes after every
//   group of that many; det_all_reduce refuses larger world sizes.
//
// IEEE specials (status word: bits 0..20 NaN count, 21..41 +inf count, 42..62 -inf count)
//   A NaN input, inf x 0, or +inf together with -inf anywhere in the sum -> NaN.
//   Only same-signed infinities -> that infinity. Otherwise the finite exact sum is rounded
//   once, to nearest-even; a result beyond the format's range rounds to +-inf; subnormal
//   results are rounded exactly from the exact value. Exact zero -> +0.0. NaN out is the
//   canonical quiet NaN (0x7fc00000 / 0x7fc0).
// ---------------------------------------------------------------------------------------
#pragma once

#include <cstdint>
#include <cstring>

#include "ldet_hd.h"

namespace ldet {

constexpr const char* kProfile = "ldet-v1";
constexpr int LDET_NDIGITS = 18;
constexpr int LDET_WORDS = 19;
constexpr int LDET_STATUS = 18;
constexpr int LDET_LSB_EXP = -298;
constexpr int LDET_TOP = LDET_NDIGITS - 1;
constexpr int64_t LDET_HEADROOM_ADDS = (int64_t(1) << 31) - 2;
constexpr int64_t LDET_NORM_INTERVAL = int64_t(1) << 30;
constexpr int LDET_STATUS_BITS = 21;
constexpr int64_t LDET_STATUS_MASK = (int64_t(1) << LDET_STATUS_BITS) - 1;
constexpr int64_t LDET_NAN = int64_t(1);
constexpr int64_t LDET_PINF = int64_t(1) << LDET_STATUS_BITS;
constexpr int64_t LDET_NINF = int64_t(1) << (2 * LDET_STATUS_BITS);
constexpr int64_t LDET_MASK32 = 0xffffffffLL;
constexpr int LDET_TOP_BITS = 41;
constexpr int64_t LDET_TOP_LIMIT = int64_t(1) << LDET_TOP_BITS;
constexpr int64_t LDET_COMBINE_MAX = (int64_t(1) << LDET_STATUS_BITS) - 1;

// Exactness window of the fp64 block sums used by the GEMM kernels: a block of products whose
// exponents satisfy (hi_x - lo_x) + (hi_w - lo_w) <= LDET_FAST_SPREAD is summed exactly by fp64
// arithmetic in any order (all partial sums are multiples of 2^(lo_x+lo_w) below
// 2^(hi_x+hi_w+2+log2(LDET_KBLOCK)), i.e. within 53 bits). See csrc/gemm_common.h.
constexpr int LDET_KBLOCK = 32;
constexpr int LDET_FAST_SPREAD = 53 - 2 - 5;

LDET_HD uint64_t bits_of(double v) {
  uint64_t u;
  memcpy(&u, &v, sizeof(u));
  return u;
}
LDET_HD uint32_t bits_of(float v) {
  uint32_t u;
  memcpy(&u, &v, sizeof(u));
  return u;
}
LDET_HD float float_of(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}
LDET_HD double double_of(uint64_t u) {
  double f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

// 2^e exactly, for e in [-1022, 1023].
LDET_HD double pow2(int e) { return double_of(uint64_t(e + 1023) << 52); }

LDET_HD void zero(int64_t* acc) {
  for (int i = 0; i < LDET_WORDS; ++i) acc[i] = 0;
}

// Adds limb (|limb| < 2^32, sign applied) to digit q, folding digits past the top into the top
// digit (a limb at index 18 is worth limb * 2^32 top units; nothing we add reaches index 19).
LDET_HD void add_limb(int64_t* acc, int q, int64_t limb) {
  if (q <= LDET_TOP) {
    acc[q] += limb;
  } else {
    acc[LDET_TOP] += limb * (int64_t(1) << 32);
  }
}

// Adds a finite fp64 value exactly. Precondition: v is an integer multiple of 2^-298 and
// |v| < 2^300 (true of every product, block sum and rounding error the kernels form).
LDET_HD void add_double(int64_t* acc, double v) {
  if (v == 0.0) return;
  const uint64_t u = bits_of(v);
  const bool neg = (u >> 63) != 0;
  const int e = int((u >> 52) & 0x7ff);
  uint64_t m = u & ((uint64_t(1) << 52) - 1);
  int shift;  // v = m * 2^(shift + LDET_LSB_EXP)
  if (e == 0) {
    shift = -1074 - LDET_LSB_EXP;  // fp64 subnormal: never happens for our values (>= 2^-298)
  } else {
    m |= uint64_t(1) << 52;
    shift = e - 1075 - LDET_LSB_EXP;
  }
  if (shift < 0) {  // low bits are zero by the precondition
    m >>= -shift;
    shift = 0;
  }
  const int q = shift >> 5;
  const int r = shift & 31;
  const uint64_t lo = (m << r) & uint64_t(LDET_MASK32);
  const uint64_t upper = m >> (32 - r);  // bits 32.. of m << r
  const uint64_t mid = upper & uint64_t(LDET_MASK32);
  const uint64_t hi = upper >> 32;
  const int64_t s = neg ? -1 : 1;
  add_limb(acc, q, s * int64_t(lo));
  add_limb(acc, q + 1, s * int64_t(mid));
  if (hi) add_limb(acc, q + 2, s * int64_t(hi));
}

// Records a non-finite contribution (NaN, or an infinity with its sign).
LDET_HD void add_special(int64_t* acc, double v) {
  if (v != v) {
    acc[LDET_STATUS] |= LDET_NAN;
  } else if (v > 0) {
    acc[LDET_STATUS] |= LDET_PINF;
  } else {
    acc[LDET_STATUS] |= LDET_NINF;
  }
}

LDET_HD bool is_finite(double v) { return (bits_of(v) & 0x7ff0000000000000ULL) != 0x7ff0000000000000ULL; }

// Adds any fp64 value exactly (finite ones into the digits, specials into the status word).
LDET_HD void add_value(int64_t* acc, double v) {
  if (is_finite(v)) {
    add_double(acc, v);
  } else {
    add_special(acc, v);
  }
}

// Carry propagation into canonical form, for any int64 words. Each digit is split into its low
// 32 bits and the rest before the carry is added, so |carry| <= 2^31 + 1 and nothing wraps;
// for words within the headroom bounds this is plain carry propagation. A top digit that
// leaves (-2^41, 2^41) is an overflow (see "Range" above).
LDET_HD void normalize(int64_t* acc) {
  int64_t carry = 0;
  for (int i = 0; i < LDET_TOP; ++i) {
    const int64_t high = acc[i] >> 32;  // arithmetic shift: floor division
    const int64_t low = (acc[i] & LDET_MASK32) + carry;
    acc[i] = low & LDET_MASK32;
    carry = high + (low >> 32);
  }
  const int64_t top = acc[LDET_TOP];
  const bool wraps = carry > 0 ? top > INT64_MAX - carry : top < INT64_MIN - carry;
  int64_t st = acc[LDET_STATUS];
  int64_t canon = 0;
  if (st & LDET_STATUS_MASK) canon |= LDET_NAN;
  if ((st >> LDET_STATUS_BITS) & LDET_STATUS_MASK) canon |= LDET_PINF;
  if ((st >> (2 * LDET_STATUS_BITS)) & LDET_STATUS_MASK) canon |= LDET_NINF;
  if (wraps || top + carry >= LDET_TOP_LIMIT || top + carry <= -LDET_TOP_LIMIT) {
    canon |= (wraps ? carry > 0 : top + carry > 0) ? LDET_PINF : LDET_NINF;
    for (int i = 0; i <= LDET_TOP; ++i) acc[i] = 0;
  } else {
    acc[LDET_TOP] = top + carry;
  }
  acc[LDET_STATUS] = canon;
}

// Error-free transformation: s + e == a + b exactly (Knuth's TwoSum, no branches).
// Needs round-to-nearest and no FMA contraction (built with -ffp-contract=off / -fmad=false).
LDET_HD double two_sum(double a, double b, double* e) {
  const double s = a + b;
  const double bb = s - a;
  *e = (a - (s - bb)) + (b - bb);
  return s;
}

// Bit i of the magnitude held in canonical, non-negative digits `m`.
LDET_HD uint32_t mag_bit(const int64_t* m, int i) {
  const int q = i >> 5;
  if (q >= LDET_TOP) {
    const int off = i - 32 * LDET_TOP;
    return off >= 63 ? 0u : uint32_t((m[LDET_TOP] >> off) & 1);
  }
  return uint32_t((m[q] >> (i & 31)) & 1);
}

// True when any bit below bit i (exclusive) is set.
LDET_HD bool mag_any_below(const int64_t* m, int i) {
  if (i <= 0) return false;
  const int q = i >> 5;
  for (int j = 0; j < q && j < LDET_TOP; ++j)
    if (m[j]) return true;
  if (q >= LDET_TOP) {
    const int off = i - 32 * LDET_TOP;
    if (off >= 63) return m[LDET_TOP] != 0;
    return (m[LDET_TOP] & ((int64_t(1) << off) - 1)) != 0;
  }
  const int r = i & 31;
  return r && (m[q] & ((int64_t(1) << r) - 1)) != 0;
}

LDET_HD int clz64(uint64_t v) {
#if defined(__CUDA_ARCH__)
  return __clzll((long long)v);
#else
  return __builtin_clzll(v);
#endif
}

// The last step of every rounding: q, the kept significand bits at weight 2^ulp, plus the round
// bit and the sticky bit below it -> the value, rounded to nearest-even, as an fp32 (exact for
// bf16/fp16); +-inf past 2^emax_excl; a negative value that rounds to zero gives -0.0.
LDET_HD float round_finish(bool neg, uint64_t q, int ulp, bool round_bit, bool sticky, int emax_excl) {
  if (round_bit && (sticky || (q & 1))) ++q;
  // q * 2^ulp with q <= 2^prec: decide overflow in exponent arithmetic, build the value exactly.
  const int qbits = q ? 64 - clz64(q) : 0;
  if (qbits + ulp > emax_excl) return float_of(neg ? 0xff800000u : 0x7f800000u);
  double r = double(q);
  // scale by 2^ulp exactly (ulp in [-149, 128]): two steps keep each factor a normal double
  r *= double_of(uint64_t(1023 + ulp / 2) << 52);
  r *= double_of(uint64_t(1023 + (ulp - ulp / 2)) << 52);
  const float f = float(r);  // exact: r is representable in the target and hence in fp32
  return neg ? -f : f;
}

// Rounds a canonical accumulator times 2^scale_exp (scale_exp <= 0: an exact division by a
// power of two, e.g. a mean over 2^k ranks) once, to nearest-even, into a float with `prec`
// significand bits (24: fp32, 8: bf16, 11: fp16) whose smallest subnormal is 2^emin_ulp and
// whose values stop below 2^emax_excl. Returns the value as an fp32 (exact for bf16/fp16,
// whose values are all fp32 values); NaN -> quiet NaN.
LDET_HD float round_acc(const int64_t* acc_in, int prec, int emin_ulp, int emax_excl, int scale_exp = 0) {
  const int64_t st = acc_in[LDET_STATUS];
  const bool nan = (st & LDET_STATUS_MASK) != 0;
  const bool pinf = ((st >> LDET_STATUS_BITS) & LDET_STATUS_MASK) != 0;
  const bool ninf = ((st >> (2 * LDET_STATUS_BITS)) & LDET_STATUS_MASK) != 0;
  if (nan || (pinf && ninf)) return float_of(0x7fc00000u);
  if (pinf) return float_of(0x7f800000u);
  if (ninf) return float_of(0xff800000u);

  int64_t m[LDET_WORDS];
  for (int i = 0; i < LDET_WORDS; ++i) m[i] = acc_in[i];
  const bool neg = m[LDET_TOP] < 0;
  if (neg) {
    for (int i = 0; i < LDET_NDIGITS; ++i) m[i] = -m[i];
    normalize(m);
  }
  int h = LDET_TOP;
  while (h >= 0 && m[h] == 0) --h;
  if (h < 0) return 0.0f;  // exact zero -> +0.0
  const int msb = 32 * h + (63 - clz64(uint64_t(m[h])));  // bit index of the leading one
  const int base = LDET_LSB_EXP + scale_exp;  // weight of bit 0 after scaling
  const int p = msb + base;                     // value in [2^p, 2^(p+1))
  int ulp = p - (prec - 1);
  if (ulp < emin_ulp) ulp = emin_ulp;
  const int u = ulp - base;  // >= 0 for every supported format, as scale_exp <= 0
  uint64_t q = 0;
  for (int i = msb; i >= u; --i) q = (q << 1) | mag_bit(m, i);
  const bool round_bit = u >= 1 && mag_bit(m, u - 1);
  const bool sticky = mag_any_below(m, u - 1);
  return round_finish(neg, q, ulp, round_bit, sticky, emax_excl);
}

LDET_HD float finalize_fp32(const int64_t* acc, int scale_exp = 0) { return round_acc(acc, 24, -149, 128, scale_exp); }
LDET_HD float finalize_bf16_as_fp32(const int64_t* acc, int scale_exp = 0) { return round_acc(acc, 8, -133, 128, scale_exp); }
LDET_HD float finalize_fp16_as_fp32(const int64_t* acc, int scale_exp = 0) { return round_acc(acc, 11, -24, 16, scale_exp); }

// Bit patterns of a value already rounded into bf16 / fp16 (so exactly representable there).
// Written out rather than left to a library cast, so NaN is the canonical quiet NaN everywhere.
LDET_HD uint16_t bf16_bits_exact(float v) {
  if (v != v) return 0x7fc0u;
  return uint16_t(bits_of(v) >> 16);  // low 16 bits are zero for a bf16 value
}
LDET_HD uint16_t fp16_bits_exact(float v) {
  if (v != v) return 0x7e00u;
  const uint32_t u = bits_of(v);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a == 0x7f800000u) return uint16_t(sign | 0x7c00u);
  if (a == 0) return sign;
  const int e = int(a >> 23) - 127;  // v is fp16-representable: e in [-24, 15], normal in fp32
  const uint32_t m = (a & 0x7fffffu) | 0x800000u;
  if (e >= -14) return uint16_t(sign | (uint32_t(e + 15) << 10) | ((m >> 13) & 0x3ffu));
  return uint16_t(sign | (m >> (13 + (-14 - e))));  // fp16 subnormal: value / 2^-24
}

// Output formats of the one rounding, shared by every kernel that finalizes.
enum OutFormat { kFmtF32 = 0, kFmtBF16 = 1, kFmtF16 = 2 };

LDET_HD float finalize_fmt(const int64_t* acc, int fmt, int scale_exp = 0) {
  if (fmt == kFmtBF16) return finalize_bf16_as_fp32(acc, scale_exp);
  if (fmt == kFmtF16) return finalize_fp16_as_fp32(acc, scale_exp);
  return finalize_fp32(acc, scale_exp);
}

// Stores a value rounded by finalize_fmt into element i of a buffer of that format.
LDET_HD void store_fmt(void* out, int64_t i, float v, int fmt) {
  if (fmt == kFmtBF16) {
    static_cast<uint16_t*>(out)[i] = bf16_bits_exact(v);
  } else if (fmt == kFmtF16) {
    static_cast<uint16_t*>(out)[i] = fp16_bits_exact(v);
  } else {
    static_cast<float*>(out)[i] = v;
  }
}

// Exponent statistics of one fp64-converted input value, for the fast-path exactness check:
// hi = floor(log2|v|), lo = exponent of its lowest set bit. Specials and zeros are flagged.
struct ExpStat {
  int hi;
  int lo;
};
LDET_HD ExpStat exp_stat(double v) {
  const uint64_t u = bits_of(v);
  const int e = int((u >> 52) & 0x7ff);
  uint64_t m = u & ((uint64_t(1) << 52) - 1);
  // inputs are fp32/bf16/fp16, so never fp64-subnormal; e == 0 means zero here.
  if (e == 0) return {-32768, 32767};
  const int hi = e - 1023;
  int tz = 52;
  if (m) {
#if defined(__CUDA_ARCH__)
    tz = __ffsll((long long)m) - 1;
#else
    tz = __builtin_ctzll(m);
#endif
  }
  return {hi, hi - 52 + tz};
}

}  // namespace ldet

// Exact GEMM through integer slices: per-element arithmetic shared by the CPU and CUDA builds.
//
// Why: int8 x int8 -> int32 GEMMs (cuBLASLt's integer tensor cores, oneDNN's VNNI on the CPU)
// are exact integer arithmetic and 15-30x faster than fp32 ones, and their sums have no order.
//
// The scheme (csrc/int_slices_host.h drives it):
//   1. Each row r of an operand (x's rows, w's rows) gets one scale: sh_r = bits*S - 3 - hi_r,
//      hi_r the exponent of the row's largest |value|. Every value times 2^sh_r is then an
//      integer X with |X| < 2^(bits*S - 2), *exactly*, when the row's span hi_r - lo_r + 3 is at
//      most bits*S (lo_r: the exponent of the lowest set bit in the row). S, the slice count, is
//      the largest count any row of the operand needs; a row needing more than kSliceMax (or
//      holding inf/NaN) is left out here and computed by the long-accumulator kernel instead.
//   2. X = sum_s d_s 2^(bits*s) in balanced digits d_s in [-2^(bits-1), 2^(bits-1)): S int8
//      slices. The digits of a multiple of 2^t are each multiples of 2^t, so every slice term,
//      and every product of two, is still an integer number of 2^-298 digit units.
//   3. For each diagonal d = i + j, C_d = sum_{i+j=d} X_i . W_j is ONE int8 GEMM over the
//      concatenated K-blocks of the slices (x's slices in order, w's reversed), exact in int32
//      while pairs * K * 2^(2 bits - 2) < 2^31 (the host splits K to keep it so).
//   4. Per output: exact = sum_d C_d 2^(bits*d - sh_x[m] - sh_w[n]) (+ bias), rounded once. The
//      sum is formed exactly as a 128-bit integer and rounded by round_int128, which follows
//      round_acc bit for bit; outputs where that does not apply (a bias below the product grid
//      or non-finite, a digits result) go through the long accumulator itself.
// Only speed depends on the slicing: every byte of output equals the long-accumulator kernel's.
#pragma once

#include <cstdint>

#include "longacc.h"

namespace ldet {

constexpr int kSliceMax = 8;         // slices per operand; X then needs 8 * 8 - 2 = 62 bits
constexpr int kSliceNeedBad = 127;   // "needs" value of a row holding inf or NaN
constexpr int64_t kSliceIntBound = (int64_t(1) << 31) - 1;

// Slices a row needs: its span (hi - lo + 1) plus 2 bits of sign/headroom, in `bits`-bit digits.
LDET_HD int slices_needed(int hi, int lo, int bits) {
  if (hi < lo) return 0;  // no nonzero value: an all-zero row
  return (hi - lo + 3 + bits - 1) / bits;
}

// Writes the S balanced digits of the integer X to dst[s * stride] for s = 0..S-1 (least
// significant first).
LDET_HD void slice_integer(int64_t X, int S, int bits, int8_t* dst, int64_t stride) {
  const int64_t half = int64_t(1) << (bits - 1), mask = (int64_t(1) << bits) - 1;
  for (int s = 0; s < S; ++s) {
    const int64_t d = ((X + half) & mask) - half;
    dst[s * stride] = int8_t(d);
    X = (X - d) >> bits;  // exact: X - d is a multiple of 2^bits
  }
}

// The digits of v * 2^sh, an exact integer with |X| < 2^62 by construction (header comment).
LDET_HD void slice_digits(double v, int sh, int S, int bits, int8_t* dst, int64_t stride) {
  slice_integer(int64_t(ldexp(v, sh)), S, bits, dst, stride);
}

#if defined(__SIZEOF_INT128__)
using i128 = __int128;
using u128 = unsigned __int128;

LDET_HD int clz128(u128 v) {
  const uint64_t hi = uint64_t(v >> 64);
  return hi ? clz64(hi) : 64 + clz64(uint64_t(v));
}

// Rounds (neg ? -mag : mag) * 2^E, mag > 0, exactly as round_acc rounds the same value held in
// digits (same ulp choice, ties to even, overflow test, -0.0 for a negative value that rounds to
// zero). Returns the value as an fp32 (exact for bf16/fp16).
LDET_HD float round_int128(bool neg, u128 mag, int E, int prec, int emin_ulp, int emax_excl) {
  const int msb = 127 - clz128(mag);
  const int p = msb + E;
  int ulp = p - (prec - 1);
  if (ulp < emin_ulp) ulp = emin_ulp;
  const int u = ulp - E;  // low bits dropped
  uint64_t q;
  bool round_bit, sticky;
  if (u <= 0) {
    q = uint64_t(mag) << (-u);  // mag < 2^prec here: exact, fits
    round_bit = sticky = false;
  } else if (u > 127) {
    q = 0;  // mag < 2^127 <= 2^(u-1): below half an ulp
    round_bit = false;
    sticky = true;
  } else {
    q = uint64_t(mag >> u);
    round_bit = ((mag >> (u - 1)) & 1) != 0;
    sticky = u >= 2 && (mag & ((u128(1) << (u - 1)) - 1)) != 0;
  }
  return round_finish(neg, q, ulp, round_bit, sticky, emax_excl);
}

LDET_HD float round_int128_fmt(bool neg, u128 mag, int E, int fmt) {
  if (fmt == kFmtBF16) return round_int128(neg, mag, E, 8, -133, 128);
  if (fmt == kFmtF16) return round_int128(neg, mag, E, 11, -24, 16);
  return round_int128(neg, mag, E, 24, -149, 128);
}
#endif

// One output of the combine. c[p * pstride], p < P, are the int32 diagonal sums (p = chunk * D +
// d); their exact sum with bias (may be null) times 2^E is rounded to fmt (acc_out == null) or
// stored as canonical digits in acc_out. `wide` says the caller proved |sum_d C_d 2^(bits d)| <
// 2^125, so the 128-bit route cannot overflow.
LDET_HD void combine_output(const int32_t* c, int64_t pstride, int P, int D, int bits, int E, const double* bias,
                            bool wide, int fmt, float* out_val, int64_t* acc_out) {
#if defined(__SIZEOF_INT128__)
  if (acc_out == nullptr && wide) {
    i128 T = 0;
    for (int p = 0; p < P; ++p) T += i128(c[p * pstride]) << (bits * (p % D));
    bool ok = true;
    if (bias != nullptr && *bias != 0.0) {
      // the bias joins T when it is a finite integer multiple of 2^E below 2^100 units
      const double b = *bias;
      const uint64_t u = bits_of(b);
      const int e = int((u >> 52) & 0x7ff);
      ok = e != 0x7ff;
      if (ok) {
        uint64_t m = u & ((uint64_t(1) << 52) - 1);
        int sh;  // |b| = m * 2^(sh + E)
        if (e == 0) {
          sh = -1074 - E;
        } else {
          m |= uint64_t(1) << 52;
          sh = e - 1075 - E;
        }
        const int tz = m ? (63 - clz64(m & (~m + 1))) : 0;
        if (sh + tz < 0 || sh > 100 - 53) {
          ok = false;
        } else {
          const i128 bi = sh >= 0 ? (i128(m) << sh) : i128(m >> (-sh));
          T += (u >> 63) ? -bi : bi;
        }
      }
    }
    if (ok) {
      if (T == 0) {
        *out_val = 0.0f;  // exact zero -> +0.0
      } else {
        const bool neg = T < 0;
        *out_val = round_int128_fmt(neg, neg ? u128(-T) : u128(T), E, fmt);
      }
      return;
    }
  }
#endif
  int64_t acc[LDET_WORDS];
  zero(acc);
  for (int p = 0; p < P; ++p) {
    const int32_t v = c[p * pstride];
    if (v) add_double(acc, ldexp(double(v), E + bits * (p % D)));  // exact (header comment, step 2)
  }
  if (bias != nullptr) add_value(acc, *bias);
  normalize(acc);
  if (acc_out != nullptr) {
    for (int i = 0; i < LDET_WORDS; ++i) acc_out[i] = acc[i];
  } else {
    *out_val = finalize_fmt(acc, fmt);
  }
}

}  // namespace ldet

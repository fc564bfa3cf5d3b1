// Exact GEMM through integer slices: per-element arithmetic shared by the CPU and CUDA builds.
//
// Why: int8 x int8 -> int32 GEMMs (cuBLASLt's integer tensor cores, oneDNN's VNNI on the CPU)
// are exact integer arithmetic and 15-30x faster than fp32 ones, and their sums have no order.
//
// The scheme (csrc/int_slices_host.h drives it):
//   1. Each row r of an operand (x's rows, w's rows) gets one scale: sh_r = bits*S - 3 - hi_r,
//      hi_r the exponent of the row's largest |value|. Every value v times 2^sh_r, truncated
//      toward zero, is an integer X with |X| < 2^(bits*S - 2). Values whose lowest set bit lies
//      below the window (v * 2^sh_r not an integer) are the row's *residues*: r = v - X 2^-sh_r,
//      exact in fp64. S, the slice count, is chosen per operand (host: the fewest slices that
//      every row holds with at most kResidueCap residues reaching at most kResidueDepthCap bits
//      below the window, weighed against the residues' cost); a row that no S <= kSliceMax
//      holds so (or holding inf/NaN) is left out here and computed by the long-accumulator
//      kernel instead.
//   2. X = sum_s d_s 2^(bits*s) in balanced digits d_s in [-2^(bits-1), 2^(bits-1)): S int8
//      slices. The digits of a multiple of 2^t are each multiples of 2^t, so every slice term,
//      and every product of two, is still an integer number of 2^-298 digit units.
//   3. For each diagonal d = i + j, C_d = sum_{i+j=d} X_i . W_j is ONE int8 GEMM over the
//      concatenated K-blocks of the slices (x's slices in order, w's reversed), exact in int32
//      while pairs * K * 2^(2 bits - 2) < 2^31 (the host splits K to keep it so). Or (csrc/crt.h)
//      the same integer sum_d C_d 2^(bits d) = sum_k X_k W_k from Q int8 GEMMs of its remainders
//      modulo pairwise coprime moduli (the CPU's choice for fp32; on CUDA only when forced).
//   4. Per output: x.w = x3.w3 + sum_k xr w + sum_k x3 wr (x = x3 + xr, w = w3 + wr: the
//      truncated values and the residues). The first is sum_d C_d 2^(bits*d - sh_x[m] - sh_w[n]);
//      each residue term is one exact fp64 product (both factors hold at most 24 bits). With
//      the bias, the sum is formed exactly as a 128-bit integer in units of 2^(E - F) (F: how
//      far the two rows' residues reach below their windows) and rounded by round_int128, which
//      follows round_acc bit for bit; outputs where that does not apply (a bias below the grid
//      or non-finite, a digits result, a sum the host could not bound below 2^125) go through
//      the long accumulator itself.
// Only speed depends on the slicing: every byte of output equals the long-accumulator kernel's.
#pragma once

#include <cstdint>

#include "longacc.h"
#include "window_acc.h"

namespace ldet {

constexpr int kSliceMax = 8;         // slices per operand; X then needs 8 * 8 - 2 = 62 bits
constexpr int kSliceNeedBad = 127;   // "needs" value of a row left to the long-accumulator kernel
constexpr int64_t kSliceIntBound = (int64_t(1) << 31) - 1;
constexpr int kMaxDiagonals = 2 * kSliceMax - 1;
// Residues per row, and how far below the row's window they may reach. Each residue costs one
// exact product per output of its row (combine); rows past either cap take more slices.
constexpr int kResidueCap = 32;
constexpr int kResidueDepthCap = 40;

// Per-operand summary (int32, kSumLen) that row_needs writes: the largest need of a row that
// fits, the count of rows that fit no S, and for each S = 1..kSliceMax the deepest residue
// (bits below the window) and the number of residues over the rows that fit at that S.
constexpr int kSumNeed = 0, kSumBad = 1, kSumDepth = 2, kSumCount = 2 + kSliceMax, kSumLen = 2 + 2 * kSliceMax;
// Histogram bins of element needs: 0 (a zero), 1..kSliceMax, kSliceMax + 1 (more).
constexpr int kNeedBins = kSliceMax + 2;

// Slices a value (or row) needs: its span (hi - lo + 1) plus 2 bits of sign/headroom, in
// `bits`-bit digits. hi: the row's top exponent; lo: the lowest set bit.
LDET_HD int slices_needed(int hi, int lo, int bits) {
  if (hi < lo) return 0;  // no nonzero value: an all-zero row
  return (hi - lo + 3 + bits - 1) / bits;
}

// The histogram bin of one element with lowest set bit lo_el in a row whose top exponent is hi.
LDET_HD int need_bin(int hi, int lo_el, int bits) {
  const int n = slices_needed(hi, lo_el, bits);
  return n > kSliceMax ? kSliceMax + 1 : n;
}

// A row's plan from its histogram of element needs (hist[kNeedBins]), top exponent hi and lowest
// set bit lo: returns the fewest slices S holding it (residues within both caps), 0 for a zero
// row, kSliceNeedBad for none. depth[s-1], count[s-1]: its residues at S = s.
LDET_HD int row_plan(const int* hist, int hi, int lo, int bits, int* depth, int* count) {
  int need = kSliceNeedBad;
  for (int s = kSliceMax; s >= 1; --s) {
    int c = 0;
    for (int b = s + 1; b < kNeedBins; ++b) c += hist[b];
    const int bottom = hi + 3 - bits * s;  // exponent of the window's lowest bit
    depth[s - 1] = c > 0 ? bottom - lo : 0;
    count[s - 1] = c;
    if (c <= kResidueCap && depth[s - 1] <= kResidueDepthCap) need = s;
  }
  if (hi < lo) need = 0;
  return need;
}

LDET_HD int ceil_log2(int64_t v) {
  int b = 0;
  while ((int64_t(1) << b) < v) ++b;
  return b;
}

// Whether the combine's 128-bit sum is proven for slice counts (Sa, Sb), K cut into nch chunks of
// Kc, from both operands' summaries (kSum*, of the rows that fit at those counts): the diagonal
// sums |sum_d C_d 2^(bits d)| < 2^base; times 2^Fmax, plus residue terms (each below
// 2^(F + bits S - 2), at most 2 kResidueCap of them) and a bias below 2^100, it stays below
// 2^126. The host asks before it slices; a guessed plan (int_slices_host.h) asks on the device.
LDET_HD bool slices_wide(const int32_t* sx, const int32_t* sw, int Sa, int Sb, int64_t nch, int64_t Kc, int bits) {
  if (Sa == 0 || Sb == 0) return true;  // no products: nothing to bound
  const int pairs = Sa < Sb ? Sa : Sb;
  const int Fmax = sx[kSumDepth + Sa - 1] + sw[kSumDepth + Sb - 1];
  const int base = ceil_log2(nch * Kc) + ceil_log2(pairs) + bits * (Sa + Sb) - 1;
  return base + Fmax <= 124 && Fmax + bits * (Sa > Sb ? Sa : Sb) + 4 <= 124;
}

// The least significant balanced digit of X, which then drops it (X becomes (X - d) / 2^bits).
LDET_HD int8_t next_digit(int64_t& X, int bits) {
  const int64_t half = int64_t(1) << (bits - 1), mask = (int64_t(1) << bits) - 1;
  const int64_t d = ((X + half) & mask) - half;
  X = (X - d) >> bits;  // exact: X - d is a multiple of 2^bits
  return int8_t(d);
}

// Writes the S balanced digits of the integer X to dst[s * stride] for s = 0..S-1 (least
// significant first).
LDET_HD void slice_integer(int64_t X, int S, int bits, int8_t* dst, int64_t stride) {
  for (int s = 0; s < S; ++s) dst[s * stride] = next_digit(X, bits);
}

// The window part of v: v * 2^sh truncated toward zero, an integer with |X| < 2^62 by
// construction (header comment, step 1). v - X * 2^-sh is v's residue.
LDET_HD int64_t window_integer(double v, int sh) { return int64_t(v * pow2(sh)); }

// Element kinds of the operands the combine reads back for residue terms.
enum ElemKind { kElemF32 = 0, kElemBF16 = 1, kElemF16 = 2 };

LDET_HD double fp16_bits_to_double(uint16_t h) {
  const int e = (h >> 10) & 0x1f;
  double mag;
  if (e == 0x1f) {  // inf / NaN: rows holding them reach exact_output, never a residue term
    mag = (h & 0x3ff) ? double_of(0x7ff8000000000000ULL) : double_of(0x7ff0000000000000ULL);
  } else {
    mag = e == 0 ? double(h & 0x3ff) * pow2(-24) : double((h & 0x3ff) | 0x400) * pow2(e - 25);
  }
  return (h & 0x8000) ? -mag : mag;
}

// A row-major (R, ld) operand of fp32 / bf16 / fp16 elements, read exactly as fp64.
struct Elems {
  const void* p;
  int kind;
  int64_t ld;
  LDET_HD double at(int64_t r, int64_t k) const {
    const int64_t i = r * ld + k;
    if (kind == kElemF32) return double(static_cast<const float*>(p)[i]);
    const uint16_t h = static_cast<const uint16_t*>(p)[i];
    if (kind == kElemBF16) return double(float_of(uint32_t(h) << 16));
    return fp16_bits_to_double(h);
  }
};

// One operand's residues: per row their count, their columns k and values (kResidueCap slots a
// row), and F, how many bits the deepest lies below the window. count == null: none at all.
struct Residues {
  const int32_t* count;
  const int32_t* idx;
  const double* val;
  const int32_t* F;
};

// The residue terms of one output (m, n): xr[m,k] * w[n,k] for x's residues and x3[m,k] * wr[n,k]
// for w's (x3: x's window part, so that no product is counted twice). each(f) calls f on each.
struct ResidueTerms {
  Residues rx;
  Elems x;
  int shx;
  int64_t m;
  Residues rw;
  Elems w;
  int64_t n;
  template <class Fn>
  LDET_HD void each(Fn&& f) const {
    if (rx.count != nullptr) {
      const int c = rx.count[m];
      for (int j = 0; j < c; ++j) {
        const int64_t s = m * kResidueCap + j;
        f(rx.val[s] * w.at(n, rx.idx[s]));
      }
    }
    if (rw.count != nullptr) {
      const int c = rw.count[n];
      for (int j = 0; j < c; ++j) {
        const int64_t s = n * kResidueCap + j;
        // x's row m in the slices has |x * 2^shx| < 2^62; a row left to the long-accumulator
        // kernel (inf/NaN, or too wide) may not, and its outputs are recomputed: no term
        const double scaled = x.at(m, rw.idx[s]) * pow2(shx);
        if (!(scaled < 0x1p62 && scaled > -0x1p62)) continue;
        const double x3 = double(int64_t(scaled)) * pow2(-shx);  // window_integer, unscaled
        f(x3 * rw.val[s]);
      }
    }
  }
};

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

// The top 64 bits of mag (> 0), with a sticky bit for the bits below them at bit 0 (an OR into
// what is then at least 39 bits below any rounding bit of a 24-bit or narrower result, so it only
// breaks ties, as the dropped bits would): mag ~ top * 2^(64 - s), top in [2^63, 2^64), s the
// leading zeros of mag.
LDET_HD uint64_t top64_sticky(u128 mag, int* s) {
  const uint64_t hi = uint64_t(mag >> 64), lo = uint64_t(mag);
  if (hi == 0) {
    const int z = clz64(lo);
    *s = 64 + z;
    return lo << z;  // exact
  }
  const int z = clz64(hi);
  *s = z;
  const uint64_t top = z ? (hi << z) | (lo >> (64 - z)) : hi;
  return top | uint64_t((lo << z) != 0);  // (lo << z: the bits below top; z < 64)
}

#if defined(__CUDA_ARCH__)
// mag * 2^E (mag > 0, below 2^127) rounded to nearest-even into fp32 when the result is a normal
// fp32 value, into *out; false otherwise (subnormal, overflow: round_int128 decides those).
// top64_sticky goes through the hardware's 64-bit integer conversion (round-to-nearest-even);
// the scale then enters the exponent field, exact for a normal result. The combine spent ~670
// instructions an output, with round_int128's shifts, branches and fp64 scaling among them.
__device__ __forceinline__ bool round_u128_f32_normal(u128 mag, int E, float* out) {
  int s;
  const float f = __ull2float_rn(top64_sticky(mag, &s));  // in [2^63, 2^64]
  const int k = E + 64 - s;                               // mag * 2^E ~ top * 2^k
  const int biased = int((__float_as_uint(f) >> 23) & 0xff) + k;
  if (biased < 1 || biased > 254) return false;
  *out = __uint_as_float(__float_as_uint(f) + (uint32_t(k) << 23));
  return true;
}
#endif

// mag * 2^E (0 < mag < 2^127) rounded to nearest-even at prec <= 24 significant bits when both
// the value and its rounding are normal numbers of the format (leading exponent in [emin, emax]),
// into *out as the fp32 of that value (exact: the format's normal numbers are fp32's); false
// otherwise (subnormal, overflow: round_int128 decides those). The same rounding as round_int128
// on that range, in 64-bit integer steps on top64_sticky: to bf16, 68 PTX instructions in a
// one-output kernel where round_int128 takes 113 (sm_90). bf16 and fp16 outputs (and fp32 on the
// CPU) take this.
LDET_HD bool round_u128_normal(u128 mag, int E, int prec, int emin, int emax, float* out) {
  int s;
  const uint64_t top = top64_sticky(mag, &s);
  int e = E + 127 - s;  // the leading bit's exponent: mag * 2^E ~ top * 2^(E + 64 - s)
  if (e < emin) return false;
  const int drop = 64 - prec;
  uint64_t q = top >> drop;
  const uint64_t rest = top & ((uint64_t(1) << drop) - 1), half = uint64_t(1) << (drop - 1);
  if (rest > half || (rest == half && (q & 1) != 0)) ++q;
  if (q >> prec) {  // carried into the next binade
    q >>= 1;
    ++e;
  }
  if (e > emax) return false;
  *out = float_of((uint32_t(e + 127) << 23) | (uint32_t(q << (24 - prec)) & 0x7fffffu));
  return true;
}

// T * 2^E (two's complement) rounded once to fmt: round_int128 of its magnitude; an exact zero
// gives +0.0.
LDET_HD float round_signed_int128(i128 T, int E, int fmt) {
  if (T == 0) return 0.0f;
  const bool neg = T < 0;
  const u128 mag = neg ? u128(-T) : u128(T);
  float f;
#if defined(__CUDA_ARCH__)
  if (fmt == kFmtF32 && round_u128_f32_normal(mag, E, &f)) return neg ? -f : f;
#else
  if (fmt == kFmtF32 && round_u128_normal(mag, E, 24, -126, 127, &f)) return neg ? -f : f;
#endif
  if (fmt == kFmtBF16 && round_u128_normal(mag, E, 8, -126, 127, &f)) return neg ? -f : f;
  if (fmt == kFmtF16 && round_u128_normal(mag, E, 11, -14, 15, &f)) return neg ? -f : f;
  return round_int128_fmt(neg, mag, E, fmt);
}

// Adds the finite fp64 value b to T (two's complement, in units of 2^Eu) when b is an integer
// number of units below 2^max_bits units; returns false, T unchanged, otherwise.
LDET_HD bool add_units(u128& T, double b, int Eu, int max_bits) {
  const uint64_t u = bits_of(b);
  const int e = int((u >> 52) & 0x7ff);
  if (e == 0x7ff) return false;
  uint64_t m = u & ((uint64_t(1) << 52) - 1);
  int sh;  // |b| = m * 2^(sh + Eu)
  if (e == 0) {
    sh = -1074 - Eu;
  } else {
    m |= uint64_t(1) << 52;
    sh = e - 1075 - Eu;
  }
  if (m == 0) return true;
  const int tz = 63 - clz64(m & (~m + 1));
  if (sh + tz < 0 || sh > max_bits - 53) return false;
  // m << sh in 64-bit halves (0 <= sh <= max_bits - 53 < 72), or m >> -sh (-sh <= tz <= 52):
  // nvcc's generic 128-bit shift by a runtime count was ~180 PTX instructions of branches
  uint64_t lo, hi = 0;
  if (sh >= 64) {
    lo = 0;
    hi = m << (sh - 64);
  } else if (sh > 0) {
    lo = m << sh;
    hi = m >> (64 - sh);
  } else {
    lo = m >> (-sh);
  }
  const u128 v = (u128(hi) << 64) | lo;
  T = (u >> 63) ? T - v : T + v;
  return true;
}
#endif

// The end of the long-accumulator route of one output: acc already holds its product sums; adds
// the residue terms and the bias, normalizes, and writes the digits (acc_out) or their rounding.
LDET_HD void finish_output_digits(int64_t* acc, const double* bias, int fmt, const ResidueTerms& terms,
                                  float* out_val, int64_t* acc_out) {
  // exact products of parts of the inputs; add_value: an output of a row left to the kernel
  // (recomputed there) may meet inf/NaN here, which must not index past the digits
  terms.each([&](double t) { add_value(acc, t); });
  if (bias != nullptr) add_value(acc, *bias);
  normalize(acc);
  if (acc_out != nullptr) {
    for (int i = 0; i < LDET_WORDS; ++i) acc_out[i] = acc[i];
  } else {
    *out_val = finalize_fmt(acc, fmt);
  }
}

// The long-accumulator route of one output (combine_output's fallback, and its digits): every
// int32 diagonal sum, residue term and the bias added exactly as fp64 values.
LDET_HD void combine_output_digits(const int32_t* c, int64_t pstride, int nch, int D, int bits, int E,
                                   const double* bias, int fmt, const ResidueTerms& terms, float* out_val,
                                   int64_t* acc_out) {
  int64_t acc[LDET_WORDS];
  zero(acc);
  for (int ch = 0; ch < nch; ++ch) {
    for (int d = 0; d < D; ++d) {
      const int32_t v = c[(ch * D + d) * pstride];
      if (v) add_double(acc, ldexp(double(v), E + bits * d));  // exact (header comment, step 2)
    }
  }
  finish_output_digits(acc, bias, fmt, terms, out_val, acc_out);
}

// One output straight from the operands: x[m, :] . w[n, :] (+ bias), every product exact in fp64
// (inf/NaN as the long accumulator's status flags), rounded once to fmt into *out_val, or its
// digits into acc_out. For the rows a guessed slice plan left out (int_slices_host.h): the same
// exact sum as the long-accumulator kernel's, so the same bytes.
LDET_HD void exact_output(const Elems& x, int64_t m, const Elems& w, int64_t n, int64_t K, const double* bias,
                          int fmt, float* out_val, int64_t* acc_out) {
  int64_t acc[LDET_WORDS];
  zero(acc);
  int64_t adds = 0;
  for (int64_t k = 0; k < K; ++k) {
    add_value(acc, x.at(m, k) * w.at(n, k));
    if (++adds == LDET_NORM_INTERVAL) {
      normalize(acc);
      adds = 0;
    }
  }
  if (bias != nullptr) add_value(acc, *bias);
  normalize(acc);
  if (acc_out != nullptr) {
    for (int i = 0; i < LDET_WORDS; ++i) acc_out[i] = acc[i];
  } else {
    *out_val = finalize_fmt(acc, fmt);
  }
}

#if defined(__SIZEOF_INT128__)
// The diagonals' exact sum sum_d C_d 2^(bits d), c[(ch * D + d) * pstride] the int32 diagonal sums
// of K-chunk ch, as a two's complement 128-bit integer (the caller's proof keeps it in range).
// DC > 0: one K-chunk and DC == D diagonals known at compile time (both devices' common case):
// every load first, so their latencies overlap, and no work for absent diagonals.
template <int DC = 0>
LDET_HD u128 diagonal_sum(const int32_t* c, int64_t pstride, int nch, int D, int bits) {
  // Horner from the top diagonal: modular (unsigned) arithmetic
  u128 T = 0;
  if (DC > 0) {
    int32_t v[DC > 0 ? DC : 1];
#pragma unroll
    for (int d = 0; d < DC; ++d) v[d] = c[d * pstride];
    // Four diagonals at a time in 64 bits (|sum_j v_j 2^(bits j)| < 2^31 2^(3 bits + 1) <= 2^56
    // for bits <= 8: the modular sum is the exact one), then the groups in 128: a quarter of the
    // 128-bit shifts and adds of a Horner step per diagonal.
    constexpr int G = (DC + 3) / 4;
#pragma unroll
    for (int g = G - 1; g >= 0; --g) {
      uint64_t s = 0;
#pragma unroll
      for (int d = (4 * g + 3 < DC ? 4 * g + 3 : DC - 1); d >= 4 * g; --d) s = (s << bits) + uint64_t(int64_t(v[d]));
      T = (T << (4 * bits)) + u128(i128(int64_t(s)));
    }
  } else {
    for (int d = D - 1; d >= 0; --d) {
      int64_t s = 0;
      for (int ch = 0; ch < nch; ++ch) s += c[(ch * D + d) * pstride];
      T = (T << bits) + u128(i128(s));
    }
  }
  return T;
}

// The 128-bit route of one rounded output: T, the product sums' integer in units of 2^E (the
// diagonals' sum, or its reconstruction from remainders: crt.h), the residue terms and the bias (may be
// null), rounded once to fmt into *out_val. F: bits the output's residues reach below 2^E. The
// caller proved the sum in units of 2^(E - F) stays below 2^126 (the host's `wide`). Returns
// false, leaving the output to the digits, when the bias or a term is not an integer number of
// those units within range.
LDET_HD bool finish_output_fast(u128 T, int E, int F, const double* bias, int fmt, const ResidueTerms& terms,
                                float* out_val) {
  if (F != 0) T <<= F;  // F: 0 unless residues reach below 2^E
  const int Eu = E - F;
  // the bias joins T when it is an integer number of units below 2^100 of them
  bool ok = bias == nullptr || *bias == 0.0 || add_units(T, *bias, Eu, 100);
  if (ok) terms.each([&](double t) { ok = ok && add_units(T, t, Eu, 124); });
  if (!ok) return false;
  *out_val = round_signed_int128(i128(T), Eu, fmt);
  return true;
}

// The 128-bit route of one rounded output from its int32 diagonal sums (finish_output_fast).
template <int DC = 0>
LDET_HD bool combine_output_fast(const int32_t* c, int64_t pstride, int nch, int D, int bits, int E, int F,
                                 const double* bias, int fmt, const ResidueTerms& terms, float* out_val) {
  return finish_output_fast(diagonal_sum<DC>(c, pstride, nch, D, bits), E, F, bias, fmt, terms, out_val);
}

// One output from its product sums' integer P (units of 2^E) instead of the diagonals (the
// CRT route, crt.h): the 128-bit route where `wide` and a rounded output allow it, else the
// digits, P entering them as the window's flush adds its 128 bits (window_acc.h).
LDET_HD void combine_output_value(i128 P, int E, int F, const double* bias, bool wide, int fmt,
                                  const ResidueTerms& terms, float* out_val, int64_t* acc_out) {
  if (acc_out == nullptr && wide && finish_output_fast(u128(P), E, F, bias, fmt, terms, out_val)) return;
  int64_t acc[LDET_WORDS];
  zero(acc);
  const bool neg = P < 0;
  u128 mag = neg ? u128(-P) : u128(P);
  if (mag != 0) {
    int off = E - LDET_LSB_EXP;  // P's bit 0 in units of 2^-298
    if (off < 0) {  // exact: P 2^E lies on the 2^-298 grid (header comment, step 2), so -off < 128
      mag >>= -off;
      off = 0;
    }
    add_u128_at(acc, neg ? -1 : 1, uint64_t(mag), uint64_t(mag >> 64), off);
  }
  finish_output_digits(acc, bias, fmt, terms, out_val, acc_out);
}
#endif

// One output of the combine: the 128-bit route where `wide` and a rounded output allow it, else
// the long accumulator (combine_output_digits), which also gives the digits (acc_out non-null).
// DC: as combine_output_fast (D at compile time for one K-chunk, or 0).
template <int DC = 0>
LDET_HD void combine_output(const int32_t* c, int64_t pstride, int nch, int D, int bits, int E, int F,
                            const double* bias, bool wide, int fmt, const ResidueTerms& terms, float* out_val,
                            int64_t* acc_out) {
#if defined(__SIZEOF_INT128__)
  if (acc_out == nullptr && wide &&
      combine_output_fast<DC>(c, pstride, nch, D, bits, E, F, bias, fmt, terms, out_val))
    return;
#endif
  combine_output_digits(c, pstride, nch, D, bits, E, bias, fmt, terms, out_val, acc_out);
}

}  // namespace ldet

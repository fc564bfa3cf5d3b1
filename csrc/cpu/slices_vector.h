// The CPU's per-row slice statistics (row_needs) and CRT remainder planes (make_slices) for fp32 /
// bf16 / fp16 operands in AVX-512 (csrc/int_slices.h and crt.h have the scheme; int_slices_cpu.cpp the
// scalar loops these replace where the build has AVX-512).
//
// Why: row_needs_cpu converted every element to fp64 and took exp_stat's 64-bit bit scans one
// element at a time, twice: ~2.5 ms of a ~14 ms fp32 512^3 det_gemm on one core under perf. The
// same integers as the scalar loops, as the CUDA kernel computes them (its
// row_needs_kernel): an element's top exponent and lowest set bit from its exponent field and the
// leading / trailing zeros of its significand; per slice count s, the elements whose lowest set
// bit lies below the s-slice window (lo_el < hi + 3 - bits s), which is what row_plan needs of the
// histogram of element needs. Max, min and counts: no order can show.
#pragma once

#include "cpu/avx512.h"

#if defined(LDET_CPU_AVX512)
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

#include "crt.h"
#include "int_slices.h"

namespace ldet {

// The element types the vector forms read (as fp32 bit patterns: load_f32_bits16).
template <typename T>
constexpr bool kVectorElems = std::is_same<T, float>::value || std::is_same<T, c10::BFloat16>::value ||
                                 std::is_same<T, c10::Half>::value;

// Sixteen elements of a row from p as fp32 bit patterns (zeros where `live` is clear): a bf16
// element is the top half of the fp32 with the same value; an fp16 one converts exactly
// (vcvtph2ps: every fp16 value, subnormals and specials included, is an fp32 value).
template <typename T>
inline __m512i load_f32_bits16(const T* p, __mmask16 live) {
  if constexpr (std::is_same<T, float>::value) {
    return _mm512_maskz_loadu_epi32(live, p);
  } else if constexpr (std::is_same<T, c10::BFloat16>::value) {
    return _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, p)), 16);
  } else {
    return _mm512_castps_si512(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, p)));
  }
}

// Per lane: the exponent of the lowest set bit (lo) and, when hi_out, of the top bit, of a finite
// nonzero fp32 pattern u; *nonzero: such lanes, *finite: lanes not inf/NaN.
inline __m512i f32_low_bit(__m512i u, __mmask16* nonzero, __mmask16* finite, __m512i* hi_out) {
  const __m512i e = _mm512_and_si512(_mm512_srli_epi32(u, 23), _mm512_set1_epi32(0xff));
  __m512i m = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffff));
  const __mmask16 normal = _mm512_test_epi32_mask(e, e);
  m = _mm512_mask_or_epi32(m, normal, m, _mm512_set1_epi32(0x800000));
  // |v| = m 2^unit: unit = e - 150 for normals, -149 for subnormals
  const __m512i unit = _mm512_mask_sub_epi32(_mm512_set1_epi32(-149), normal, e, _mm512_set1_epi32(150));
  *finite = _mm512_cmpneq_epi32_mask(e, _mm512_set1_epi32(0xff));
  *nonzero = _mm512_test_epi32_mask(m, m) & *finite;
  const __m512i lsb = _mm512_and_si512(m, _mm512_sub_epi32(_mm512_setzero_si512(), m));
  const __m512i c31 = _mm512_set1_epi32(31);
  if (hi_out != nullptr) *hi_out = _mm512_add_epi32(unit, _mm512_sub_epi32(c31, _mm512_lzcnt_epi32(m)));
  return _mm512_add_epi32(unit, _mm512_sub_epi32(c31, _mm512_lzcnt_epi32(lsb)));
}

// row[0..K)'s statistics, as row_needs_cpu's scalar loops give them for a row without inf/NaN:
// *hi, *lo (exp_stat's, over the nonzero elements; -32768 / 32767 for an all-zero row), and
// over[s - 1] for s = 1..kSliceMax: the elements needing more than s slices. Returns false
// (nothing else written) when the row holds an inf or a NaN.
template <typename T>
inline bool row_stats_vec(const T* row, int64_t K, int bits, int* hi, int* lo, int* over) {
  __m512i vhi = _mm512_set1_epi32(-32768), vlo = _mm512_set1_epi32(32767);
  __mmask16 all_finite = 0xffff;
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 live = K - k >= 16 ? __mmask16(0xffff) : __mmask16((1u << (K - k)) - 1);
    __mmask16 nz, fin;
    __m512i top;
    const __m512i low = f32_low_bit(load_f32_bits16(row + k, live), &nz, &fin, &top);
    all_finite &= fin;
    vhi = _mm512_mask_max_epi32(vhi, nz, vhi, top);
    vlo = _mm512_mask_min_epi32(vlo, nz, vlo, low);
  }
  if (all_finite != 0xffff) return false;
  *hi = _mm512_reduce_max_epi32(vhi);
  *lo = _mm512_reduce_min_epi32(vlo);
  for (int s = 0; s < kSliceMax; ++s) over[s] = 0;
  if (*hi < *lo) return true;  // all zero: no element needs a slice
  __m512i thr[kSliceMax], cnt[kSliceMax];
  for (int s = 0; s < kSliceMax; ++s) {
    thr[s] = _mm512_set1_epi32(*hi + 3 - bits * (s + 1));
    cnt[s] = _mm512_setzero_si512();
  }
  const __m512i one = _mm512_set1_epi32(1);
  for (int64_t k = 0; k < K; k += 16) {  // the row again, from L1 for rows up to ~16K elements
    const __mmask16 live = K - k >= 16 ? __mmask16(0xffff) : __mmask16((1u << (K - k)) - 1);
    __mmask16 nz, fin;
    const __m512i low = f32_low_bit(load_f32_bits16(row + k, live), &nz, &fin, nullptr);
    for (int s = 0; s < kSliceMax; ++s)
      cnt[s] = _mm512_mask_add_epi32(cnt[s], _mm512_mask_cmplt_epi32_mask(nz, low, thr[s]), cnt[s], one);
  }
  for (int s = 0; s < kSliceMax; ++s) over[s] = _mm512_reduce_add_epi32(cnt[s]);
  return true;
}

// Remainder planes of one row (make_slices' CRT route) for rows whose window integers stay below
// 2^46 in magnitude (bits S - 2 <= 46): X = trunc(v 2^s) exactly in fp64 (v 2^s by scalef, exact;
// truncation by conversion), and per modulus the same remainder as crt_remainders_fp64,
// X - m floor((X + floor(m/2) + 1/2) / m) in [-floor(m/2), m - 1 - floor(m/2)], here as
// X - m round((X + c) fl(1/m)) with c = 1/2 for the even modulus 2^bits (fl(1/m) exact) and c = 0
// for odd m: (X + floor(m/2) + 1/2) / m - 1/2 = (X + c) / m, never within 1/(2m) of a
// half-integer for odd m, and fl's error stays below 2^(46 - 7 - 52) = 2^-13: the rounding is
// floor's. Why not the scalar loop: one pass in registers instead of one to split each X into two
// doubles and one more per modulus over them (under perf: ~0.5 of a torch.mm's time).
// out[t * Kc + k] for t < Q, k < K; the residues (v not on the window's grid: v - X 2^-s, exact)
// appended in order of k to ridx / rval when `residues`; returns their count.
template <typename T>
inline int crt_row_remainders_vec(const T* row, int64_t K, int s, const CrtConsts& t, int8_t* out, int64_t Kc,
                                  bool residues, int32_t* ridx, double* rval) {
  const __m512d scale = _mm512_set1_pd(double(s)), unscale = _mm512_set1_pd(double(-s));
  int nres = 0;
  for (int64_t k = 0; k < K; k += 8) {
    const __mmask8 live = K - k >= 8 ? __mmask8(0xff) : __mmask8((1u << (K - k)) - 1);
    const __m512d v = _mm512_cvtps_pd(_mm256_castsi256_ps(
        _mm512_castsi512_si256(load_f32_bits16(row + k, __mmask16(live)))));
    const __m512d X = _mm512_cvtepi64_pd(_mm512_cvttpd_epi64(_mm512_scalef_pd(v, scale)));  // trunc, exact
    if (residues) {
      const __m512d back = _mm512_scalef_pd(X, unscale);  // exact: X 2^-s is v with its low bits cut
      for (unsigned rm = _mm512_mask_cmpneq_pd_mask(live, back, v); rm != 0; rm &= rm - 1) {
        const int j = __builtin_ctz(rm);  // row_plan bounded this row's residues at S by kResidueCap
        alignas(64) double vv[8], bb[8];
        _mm512_store_pd(vv, v);
        _mm512_store_pd(bb, back);
        ridx[nres] = int32_t(k + j);
        rval[nres] = vv[j] - bb[j];
        ++nres;
      }
    }
    for (int i = 0; i < t.count; ++i) {
      const double m = double(t.m[i]);
      const __m512d a = (t.m[i] & 1) ? X : _mm512_add_pd(X, _mm512_set1_pd(0.5));
      const __m512d q = crt_round_pd(_mm512_mul_pd(a, _mm512_set1_pd(t.rinv[i])));
      const __m512i y = _mm512_cvtpd_epi64(_mm512_fnmadd_pd(q, _mm512_set1_pd(m), X));  // exact
      _mm512_mask_cvtepi64_storeu_epi8(out + i * Kc + k, live, y);
    }
  }
  return nres;
}

}  // namespace ldet
#endif

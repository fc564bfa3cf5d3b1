// AVX-512 form of the erf-GELU's fp64 values (detmath.h act_forward / act_derivative with
// kActGeluErf), eight elements at a time, for the elements on the erf series' branch
// (|z| = |x| / sqrt 2 < 3, not NaN): the scalar code costs ~150 ns an element there (a chain of
// up to 45 dependent terms), 365x F.gelu on two cores; eight lanes run eight chains side by side.
//
// Same bits as the scalar code: every lane runs detmath.h's operations in its order, each one
// IEEE operation rounded to nearest (vmulpd, vaddpd, vsubpd, vdivpd; truncation by vroundscale,
// exact), branches as masks. The series' quotient is vdivpd, where the scalar code has div_odd,
// whose bits are the division's (proof in detmath.h). exp's special inputs (NaN, overflow,
// underflow) cannot occur on this branch (its arguments lie in (-9, 0]). Elements off the
// branch (the continued fraction, the far tails, NaN) are left to the scalar code.
// tests/test_detmath_reference.py compares the fp64 values with an eager evaluation (this
// form where the build has AVX-512); tests/test_cpu_arch.py compares them with a build without it.
#pragma once

#include "cpu/avx512.h"

#if defined(LDET_CPU_AVX512)
#include "detmath.h"

namespace ldet {
namespace dmv {

inline __m512d set1(double v) { return _mm512_set1_pd(v); }
inline __m512d neg(__m512d v) { return _mm512_xor_pd(v, set1(-0.0)); }  // exact, -0 for +0 as in C
inline __m512d trunc(__m512d v) { return _mm512_roundscale_pd(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC); }

// 2^k for integer-valued k in the normal range, from its exponent bits (longacc.h pow2).
inline __m512d pow2(__m512d k) {
  const __m512i e = _mm512_add_epi64(_mm512_cvtpd_epi64(k), _mm512_set1_epi64(1023));  // k exact
  return _mm512_castsi512_pd(_mm512_slli_epi64(e, 52));
}

// dm::exp for x in (-745.2, 709.78), not NaN.
inline __m512d exp(__m512d x) {
  const __m512d t = _mm512_mul_pd(x, set1(dm::kInvLn2));
  const __mmask8 up = _mm512_cmp_pd_mask(t, _mm512_setzero_pd(), _CMP_GE_OQ);
  const __m512d k = trunc(_mm512_add_pd(t, _mm512_mask_blend_pd(up, set1(-0.5), set1(0.5))));  // int(t +- 0.5)
  const __m512d r = _mm512_sub_pd(_mm512_sub_pd(x, _mm512_mul_pd(k, set1(dm::kLn2Hi))), _mm512_mul_pd(k, set1(dm::kLn2Lo)));
  __m512d p = set1(dm::inv_fact(13));
  for (int n = 12; n >= 0; --n) p = _mm512_add_pd(_mm512_mul_pd(p, r), set1(dm::inv_fact(n)));
  const __m512d k1 = trunc(_mm512_mul_pd(k, set1(0.5)));  // C's k / 2
  return _mm512_mul_pd(_mm512_mul_pd(p, pow2(k1)), pow2(_mm512_sub_pd(k, k1)));
}

// dm::exp_neg_sq for |z| < 3.
inline __m512d exp_neg_sq(__m512d z) {
  const __m512d c = _mm512_mul_pd(set1(134217729.0), z);
  const __m512d zh = _mm512_sub_pd(c, _mm512_sub_pd(c, z));
  const __m512d zl = _mm512_sub_pd(z, zh);
  const __m512d hi = _mm512_mul_pd(z, z);
  const __m512d lo = _mm512_add_pd(
      _mm512_add_pd(_mm512_sub_pd(_mm512_mul_pd(zh, zh), hi), _mm512_mul_pd(_mm512_mul_pd(set1(2.0), zh), zl)),
      _mm512_mul_pd(zl, zl));
  return _mm512_mul_pd(exp(neg(hi)), _mm512_sub_pd(set1(1.0), lo));
}

// dm::erf_series for 0 <= z < 3 (z may be -0, as the scalar code's |z| is for z = -0).
inline __m512d erf_series(__m512d z) {
  const __m512d z2 = _mm512_mul_pd(_mm512_mul_pd(set1(2.0), z), z);
  __m512d t = z, s = z;
  __mmask8 live = 0xFF;
  for (int n = 1; n < 60 && live; ++n) {
    const __m512d tn = _mm512_div_pd(_mm512_mul_pd(t, z2), set1(double(2 * n + 1)));
    const __m512d sn = _mm512_add_pd(s, tn);
    t = _mm512_mask_blend_pd(live, t, tn);
    s = _mm512_mask_blend_pd(live, s, sn);
    live &= ~_mm512_cmp_pd_mask(t, _mm512_mul_pd(s, set1(0x1p-56)), _CMP_LT_OQ);  // the scalar break
  }
  return _mm512_mul_pd(_mm512_mul_pd(s, exp_neg_sq(z)), set1(dm::kTwoOverSqrtPi));
}

// The lanes of x that take the series branch of dm::norm_cdf: |x / sqrt 2| < 3 (NaN: no).
inline __mmask8 series_lanes(__m512d x, __m512d* a) {
  const __m512d z = _mm512_mul_pd(x, set1(dm::kInvSqrt2));
  *a = _mm512_mask_blend_pd(_mm512_cmp_pd_mask(z, _mm512_setzero_pd(), _CMP_LT_OQ), z, neg(z));
  return _mm512_cmp_pd_mask(*a, set1(3.0), _CMP_LT_OQ);
}

// dm::norm_cdf on the series lanes.
inline __m512d norm_cdf(__m512d x, __m512d a) {
  const __m512d erf_a = erf_series(a);
  const __mmask8 up = _mm512_cmp_pd_mask(x, _mm512_setzero_pd(), _CMP_GE_OQ);
  return _mm512_mask_blend_pd(up, _mm512_mul_pd(set1(0.5), _mm512_sub_pd(set1(1.0), erf_a)),
                              _mm512_mul_pd(set1(0.5), _mm512_add_pd(set1(1.0), erf_a)));
}

// v[l] = act_forward(x[l]) (g null) or g[l] * act_derivative(x[l]) for the erf-GELU, for the lanes
// it returns (the series lanes); the other lanes of v are not written.
inline __mmask8 gelu_erf8(const double* x, const double* g, double* v) {
  const __m512d xv = _mm512_loadu_pd(x);
  __m512d a;
  const __mmask8 lanes = series_lanes(xv, &a);
  if (!lanes) return 0;
  // Lanes off the branch compute on x = 0 here (no special values in flight) and are not stored.
  const __m512d xs = _mm512_maskz_mov_pd(lanes, xv);
  a = _mm512_maskz_mov_pd(lanes, a);
  const __m512d phi = norm_cdf(xs, a);
  __m512d r;
  if (!g) {
    r = _mm512_mul_pd(xs, phi);
  } else {
    const __m512d pdf = _mm512_mul_pd(exp(_mm512_mul_pd(_mm512_mul_pd(set1(-0.5), xs), xs)), set1(dm::kInvSqrt2Pi));
    r = _mm512_mul_pd(_mm512_loadu_pd(g), _mm512_add_pd(phi, _mm512_mul_pd(xs, pdf)));
  }
  _mm512_mask_storeu_pd(v, lanes, r);
  return lanes;
}

}  // namespace dmv
}  // namespace ldet
#endif

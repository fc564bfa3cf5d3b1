// The CPU's CRT reconstruction and rounding, eight outputs a vector (two vectors a modulus's
// constants) in AVX-512 (csrc/crt.h has the scheme; csrc/cpu/int_slices_cpu.cpp calls this from
// its combine).
//
// Why: crt_values_fp64 plus the per-output 128-bit rounding (round_signed_int128) took ~40% of a
// fp32 512^3 det_gemm on a 2-core CPU under perf, more than its 11 int8 GEMMs:
// the sums went through memory once per modulus, and every output then ran ~100 scalar 128-bit
// instructions. Here each lane keeps its sums in registers across the moduli, and the rounding
// is vector integer work plus one IEEE conversion. Same integers, same bytes:
//
//  1. y_t = c_t (M/m_t)^-1 mod m_t, symmetric: p = c_t inv_t is an exact fp64 integer (|c_t| <
//     2^31, inv_t < 2^8, so |p| < 2^39); q = round(fl(p fl(1/m_t))) is within one of p / m_t
//     (error < 2^-20), and y = p - q m_t (exact) is congruent to p with |y| <= m_t / 2: q can miss
//     round(p / m_t) only within 2^-20 of a half-integer, where both neighbours give |y| <= m_t / 2.
//  2. S = sum_t y_t M/m_t in three 40-bit limbs (each limb sum below 15 2^7 2^40 < 2^51: exact),
//     and f = sum_t y_t / m_t, S / M's estimate (error below 2^-45). |P| < M/2
//     (crt_moduli_needed), so S / M = k + P / M with |P / M| < 1/2: where |f - round(f)| <=
//     1/2 - 2^-40, k = round(f) exactly and P = S - k M. Other lanes (none in practice: P then lies
//     within ~2^-40 M of M/2) are marked and left to crt_value, the exact scalar form.
//  3. P's limbs (minus k M's limbs, exact) carried into a two's complement 128-bit integer in two
//     64-bit lanes, then its magnitude truncated to 53 bits with a sticky bit in bit 0: that is
//     P rounded to odd at 53 bits, and rounding-to-odd at p >= q + 2 bits then to nearest at q
//     bits is the single rounding to q bits (Boldo & Melquiond), for fp32 normals and subnormals
//     alike. So fp32(fp64(that) * 2^(E + shift)) (exact scaling: checked normal in fp64) is
//     round_signed_int128(P, E, fp32): ties to even, overflow to inf, -0.0 for a negative value
//     that rounds to zero, +0.0 for P = 0.
//  4. With residue terms or a bias, finish_output_fast's sum: T = P 2^F plus each as an integer
//     number of units 2^(E - F) (add_units8), then step 3 with E - F. A term off that grid sends
//     its lane to the scalar route (which then takes the digits).
// The conversion and step 1's rounding need round-to-nearest without flush-to-zero: every CPU op
// runs under the IEEE default environment (csrc/cpu/fp_env.h; torch.set_flush_denormal(True)
// sets FTZ/DAZ).
// tests/test_crt_route.py checks these bytes against the exact Python reference on rounding edges
// (ties decided past 53 bits at normals, subnormals and the overflow edge; P = -2^66, whose low
// word is zero) and runs the unproven lanes' scalar route (LIGHTNING_DET_CRT_VECTOR_UNPROVEN=1);
// tests/test_int_slices.py the residue terms; tests/test_cpu_arch.py a build without AVX-512.
#pragma once

#include "cpu/avx512.h"

#if defined(LDET_CPU_AVX512)
#include <cstdint>

#include "crt.h"

namespace ldet {

// One call's constants as fp64 (all exact): per modulus m_t, fl(1/m_t), (M/m_t)^-1 mod m_t and
// M/m_t in 40-bit limbs; M in 40-bit limbs (M < 2^(8 kCrtMax) = 2^120: three).
struct CrtVecConsts {
  int count;
  double m[kCrtMax], r[kCrtMax], inv[kCrtMax], cof[kCrtMax][3];
  double M[3];
};

inline CrtVecConsts crt_vec_consts(const CrtConsts& t) {
  CrtVecConsts v{};
  v.count = t.count;
  const u128 mask = (u128(1) << 40) - 1;
  for (int i = 0; i < t.count; ++i) {
    v.m[i] = double(t.m[i]);
    v.r[i] = t.rinv[i];
    v.inv[i] = double(t.cinv[i]);
    for (int j = 0; j < 3; ++j) v.cof[i][j] = double(uint64_t((t.cof[i] >> (40 * j)) & mask));
  }
  for (int j = 0; j < 3; ++j) v.M[j] = double(uint64_t((t.M >> (40 * j)) & mask));
  return v;
}

// Steps 1 and 2's sums for U groups of eight outputs, c + 8 u + j (plane t at c + t * pstride),
// lanes live[u]: f[u] (S / M's estimate) and s[u][0 .. NL) (S's 40-bit limbs; NL = 2 when every
// M / m_t is below 2^80, i.e. Q <= 11, else 3, the rest zero). U = 2 loads each modulus's
// constants once for sixteen outputs: loads, not arithmetic, bound the one-group loop (perf).
template <int U, int NL>
inline void crt_sums(const int32_t* c, int64_t pstride, const CrtVecConsts& k, const __mmask8* live, __m512d* f,
                     __m512d (*s)[3]) {
  for (int u = 0; u < U; ++u) f[u] = s[u][0] = s[u][1] = s[u][2] = _mm512_setzero_pd();
  for (int t = 0; t < k.count; ++t) {
    const __m512d m = _mm512_set1_pd(k.m[t]), r = _mm512_set1_pd(k.r[t]), inv = _mm512_set1_pd(k.inv[t]);
    __m512d cof[NL];
    for (int j = 0; j < NL; ++j) cof[j] = _mm512_set1_pd(k.cof[t][j]);
    for (int u = 0; u < U; ++u) {
      const __m256i ci = _mm256_maskz_loadu_epi32(live[u], c + t * pstride + 8 * u);
      const __m512d p = _mm512_mul_pd(_mm512_cvtepi32_pd(ci), inv);
      const __m512d y = _mm512_fnmadd_pd(crt_round_pd(_mm512_mul_pd(p, r)), m, p);  // exact
      f[u] = _mm512_fmadd_pd(y, r, f[u]);
      for (int j = 0; j < NL; ++j) s[u][j] = _mm512_fmadd_pd(y, cof[j], s[u][j]);  // exact integers below 2^51
    }
  }
}

// Eight two's complement 128-bit integers, hi 2^64 + lo.
struct I128x8 {
  __m512i hi, lo;
};

// Step 2's check and P for eight lanes (live) with sums f, s0, s1, s2 (crt_sums) into *P; returns
// the lanes whose P was proven.
inline __mmask8 crt_p8(__m512d f, __m512d s0, __m512d s1, __m512d s2, const CrtVecConsts& k, __mmask8 live,
                       I128x8* P) {
  const __m512d q = crt_round_pd(f);
  const __m512d gap = _mm512_abs_pd(_mm512_sub_pd(f, q));
  const __mmask8 proven = _mm512_mask_cmp_pd_mask(live, gap, _mm512_set1_pd(0.5 - 0x1p-40), _CMP_LE_OQ);
  // P's limbs, then carried: P = t0 + t1 2^40 + d2 2^80 with t0, t1 in [0, 2^40)
  const __m512i d0 = _mm512_cvtpd_epi64(_mm512_fnmadd_pd(q, _mm512_set1_pd(k.M[0]), s0));
  __m512i d1 = _mm512_cvtpd_epi64(_mm512_fnmadd_pd(q, _mm512_set1_pd(k.M[1]), s1));
  __m512i d2 = _mm512_cvtpd_epi64(_mm512_fnmadd_pd(q, _mm512_set1_pd(k.M[2]), s2));
  const __m512i mask40 = _mm512_set1_epi64((int64_t(1) << 40) - 1);
  const __m512i t0 = _mm512_and_si512(d0, mask40);
  d1 = _mm512_add_epi64(d1, _mm512_srai_epi64(d0, 40));
  const __m512i t1 = _mm512_and_si512(d1, mask40);
  d2 = _mm512_add_epi64(d2, _mm512_srai_epi64(d1, 40));
  P->lo = _mm512_or_si512(t0, _mm512_slli_epi64(t1, 40));
  P->hi = _mm512_add_epi64(_mm512_srli_epi64(t1, 24), _mm512_slli_epi64(d2, 16));
  return proven;
}

// T << F per lane, 0 <= F < 128 (modulo 2^128; the caller's proof keeps the value in range).
inline I128x8 shl128(I128x8 T, __m512i F) {
  const __m512i c64 = _mm512_set1_epi64(64);
  // counts >= 64 (or negative, i.e. huge as unsigned) give 0
  const __m512i hi = _mm512_or_si512(_mm512_or_si512(_mm512_sllv_epi64(T.hi, F), _mm512_srlv_epi64(T.lo, _mm512_sub_epi64(c64, F))),
                                     _mm512_sllv_epi64(T.lo, _mm512_sub_epi64(F, c64)));
  return {hi, _mm512_sllv_epi64(T.lo, F)};
}

// add_units (csrc/int_slices.h) for eight lanes: T += b where the finite fp64 b is an integer
// number of units 2^Eu below 2^max_bits units; returns the lanes of `lanes` where it is not
// (T unchanged there; the caller then takes the scalar route, which finds the same and falls
// back to the digits).
inline __mmask8 add_units8(I128x8* T, __m512d b, __m512i Eu, int max_bits, __mmask8 lanes) {
  const __m512i u = _mm512_castpd_si512(b);
  const __m512i e = _mm512_and_si512(_mm512_srli_epi64(u, 52), _mm512_set1_epi64(0x7ff));
  __m512i m = _mm512_and_si512(u, _mm512_set1_epi64((int64_t(1) << 52) - 1));
  const __mmask8 normal = _mm512_test_epi64_mask(e, e);
  m = _mm512_mask_or_epi64(m, normal, m, _mm512_set1_epi64(int64_t(1) << 52));
  // |b| = m 2^(sh + Eu): sh = e - 1075 - Eu for normals, -1074 - Eu for subnormals
  const __m512i sh = _mm512_sub_epi64(_mm512_mask_sub_epi64(_mm512_set1_epi64(-1074), normal, e, _mm512_set1_epi64(1075)), Eu);
  const __mmask8 special = _mm512_cmpeq_epi64_mask(e, _mm512_set1_epi64(0x7ff));
  const __mmask8 nonzero = _mm512_test_epi64_mask(m, m) & ~special;
  const __m512i tz = _mm512_sub_epi64(_mm512_set1_epi64(63), _mm512_lzcnt_epi64(_mm512_and_si512(m, _mm512_sub_epi64(_mm512_setzero_si512(), m))));
  const __mmask8 off_grid = _mm512_cmplt_epi64_mask(_mm512_add_epi64(sh, tz), _mm512_setzero_si512());
  const __mmask8 too_big = _mm512_cmpgt_epi64_mask(sh, _mm512_set1_epi64(max_bits - 53));
  const __mmask8 bad = lanes & (special | (nonzero & (off_grid | too_big)));
  const __mmask8 add = lanes & nonzero & ~bad;
  if (add == 0) return bad;
  // v = m 2^sh as 128 bits: sh in [-52, max_bits - 53]; right shifts drop only zeros (tz above)
  const __m512i zero = _mm512_setzero_si512();
  const __m512i neg_sh = _mm512_sub_epi64(zero, sh);
  const __mmask8 right = _mm512_cmplt_epi64_mask(sh, zero);
  I128x8 v = shl128({zero, m}, _mm512_max_epi64(sh, zero));
  v.lo = _mm512_mask_srlv_epi64(v.lo, right, m, neg_sh);
  // T +- v with the carry (borrow) between the words
  const __mmask8 minus = add & _mm512_cmplt_epi64_mask(u, zero), plus = add & ~minus;
  const __m512i lo_add = _mm512_add_epi64(T->lo, v.lo), lo_sub = _mm512_sub_epi64(T->lo, v.lo);
  const __mmask8 carry = _mm512_cmplt_epu64_mask(lo_add, T->lo), borrow = _mm512_cmplt_epu64_mask(T->lo, v.lo);
  const __m512i one = _mm512_set1_epi64(1);
  __m512i hi = _mm512_mask_add_epi64(T->hi, plus, T->hi, v.hi);
  hi = _mm512_mask_add_epi64(hi, plus & carry, hi, one);
  hi = _mm512_mask_sub_epi64(hi, minus, hi, v.hi);
  hi = _mm512_mask_sub_epi64(hi, minus & borrow, hi, one);
  T->hi = hi;
  T->lo = _mm512_mask_mov_epi64(_mm512_mask_mov_epi64(T->lo, plus, lo_add), minus, lo_sub);
  return bad;
}

// Step 3 for the lanes `go`: fp32(T 2^E) into out[j], T two's complement, E per lane (int64).
// Lanes whose E lies outside [-1000, 800] are left (the caller's scalar route takes them): with
// at most 75 bits dropped below, 2^(s + E) and q 2^(s + E) < 2^(53 + 875) stay normal doubles.
// Returns the lanes written.
inline __mmask8 round_to_f32_8(I128x8 T, __m512i E, __mmask8 go, float* out) {
  go &= _mm512_cmpge_epi64_mask(E, _mm512_set1_epi64(-1000)) & _mm512_cmple_epi64_mask(E, _mm512_set1_epi64(800));
  if (go == 0) return 0;
  // |T| as (ah, al): negate the 128-bit value where it is negative
  const __m512i zero = _mm512_setzero_si512();
  const __mmask8 neg = _mm512_cmplt_epi64_mask(T.hi, zero);
  const __mmask8 lo_zero = _mm512_cmpeq_epi64_mask(T.lo, zero);
  const __m512i al = _mm512_mask_sub_epi64(T.lo, neg, zero, T.lo);
  __m512i ah = _mm512_mask_xor_epi64(T.hi, neg, T.hi, _mm512_set1_epi64(-1));
  ah = _mm512_mask_add_epi64(ah, neg & lo_zero, ah, _mm512_set1_epi64(1));
  // bit length L, drop s = max(0, L - 53) bits, sticky into bit 0: |T| rounded to odd at 53 bits
  const __mmask8 hi_set = _mm512_cmpneq_epi64_mask(ah, zero);
  const __m512i lz = _mm512_mask_add_epi64(_mm512_add_epi64(_mm512_lzcnt_epi64(al), _mm512_set1_epi64(64)), hi_set,
                                           _mm512_lzcnt_epi64(ah), zero);
  const __m512i s = _mm512_max_epi64(_mm512_sub_epi64(_mm512_set1_epi64(128 - 53), lz), zero);
  const __m512i s64 = _mm512_sub_epi64(s, _mm512_set1_epi64(64));  // negative: a count >= 2^63, i.e. 0
  __m512i qv = _mm512_or_si512(_mm512_srlv_epi64(al, s), _mm512_sllv_epi64(ah, _mm512_sub_epi64(_mm512_set1_epi64(64), s)));
  qv = _mm512_or_si512(qv, _mm512_srlv_epi64(ah, s64));
  const __m512i ones = _mm512_set1_epi64(-1);
  const __m512i below_lo = _mm512_andnot_si512(_mm512_sllv_epi64(ones, s), al);
  const __m512i below_hi = _mm512_andnot_si512(_mm512_sllv_epi64(ones, _mm512_max_epi64(s64, zero)), ah);
  const __mmask8 sticky = _mm512_test_epi64_mask(_mm512_or_si512(below_lo, below_hi), ones);
  qv = _mm512_mask_or_epi64(qv, sticky, qv, _mm512_set1_epi64(1));
  // value = +-q 2^(s + E), exact
  __m512d v = _mm512_scalef_pd(_mm512_cvtepu64_pd(qv), _mm512_cvtepi64_pd(_mm512_add_epi64(s, E)));
  v = _mm512_mask_sub_pd(v, neg, _mm512_setzero_pd(), v);  // T != 0 where negative: no -0.0 from here
  _mm256_mask_storeu_ps(out, go, _mm512_cvtpd_ps(v));
  return go;
}

}  // namespace ldet
#endif

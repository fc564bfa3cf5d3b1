// The slices' product sums through remainders (Chinese remainder theorem): fewer int8 GEMMs.
//
// Why: the diagonal route (int_slices.h, step 3) multiplies every pair of slices, Sx * Sw int8
// GEMMs' worth of multiply-adds: 25 for fp32 operands at S = 5. The integer it builds per output,
// P = sum_k X_k W_k (X, W the rows' window integers), is below 2^B with B = ceil_log2(K) +
// bits (Sx + Sw) - 4. Its remainders modulo Q pairwise coprime moduli m_t <= 2^bits determine it
// once prod m_t > 2^(B+1): Q int8 GEMMs of the remainder planes r_t(X) . r_t(W), each exact in int32
// while K 2^(2 bits - 2) < 2^31, give P mod m_t, and the explicit CRT reconstruction gives P.
// For fp32 at S = 5, K = 4096 and 8-bit digits: 12 GEMMs instead of 25 (the reconstruction is
// O(Q) multiply-adds per output).
//
// Remainders are symmetric, r in [-2^(bits-1), 2^(bits-1)): the same int8 range the balanced digits
// use, so the same int8 GEMM stays exact (bits = 7 where it could saturate 16-bit pair sums).
// P is the same integer the diagonals' Horner sum gives, so everything downstream (residue
// terms, bias, the one rounding, the 128-bit proof) is unchanged: the bytes cannot move.
//
// Two forms of the same arithmetic: per element / per output in 32-bit integer operations
// (crt_remainder, crt_value: LDET_HD, what the CUDA kernels make_slices_kernel and the combine
// kernels run), and fp64 loops over consecutive elements / outputs that vectorize on the CPU
// (crt_remainders_fp64, crt_values_fp64). Both give the one mathematically defined remainder and
// P, so the bytes agree: the CUDA tests compare the CUDA route with the CPU route, and with
// LIGHTNING_DET_CRT_SCALAR=1 the CPU runs the 32-bit forms (tests/test_crt_route.py). The constants
// for one call's Q moduli (CrtConsts, < 1 KB) go to the kernels by value: kernel parameters sit
// in the constant bank, and every thread reads the same modulus at the same time (a broadcast).
#pragma once

#include <array>
#include <cstdint>
#include <stdexcept>

#include "int_slices.h"

namespace ldet {

constexpr int kCrtMax = 15;  // moduli at most: 15 M < 2^122 (the reconstruction's S, in 128 bits)

// Pairwise coprime moduli <= 2^bits, largest first (their product grows fastest); built once
// on the host.
struct CrtTable {
  int count;
  int64_t m[kCrtMax];
  u128 prod[kCrtMax + 1];  // prod[q] = M_q = m_0 ... m_(q-1)
  // The reconstruction's constants for the first q moduli (crt_value): cof[q][t] = M_q / m_t and
  // cinv[q][t] = (M_q / m_t)^-1 mod m_t.
  u128 cof[kCrtMax + 1][kCrtMax];
  uint32_t cinv[kCrtMax + 1][kCrtMax];
};

// What one call with Q moduli needs of the table, per modulus t < count (by value: see above).
struct CrtConsts {
  int count;
  uint32_t m[kCrtMax];
  uint32_t sm[kCrtMax];     // mod_small's constant: 2^32 / m_t rounded up
  uint32_t cinv[kCrtMax];   // (M / m_t)^-1 mod m_t
  int32_t p16[kCrtMax];     // 2^16 mod m_t, symmetric (crt_mod_i32)
  uint32_t pk[kCrtMax][2];  // 2^(bits s) mod m_t, symmetric, as int8 bytes: s = 0..3, 4..7 (crt_remainder)
  double rinv[kCrtMax];     // 1 / m_t, rounded: the quotient's estimate
  u128 cof[kCrtMax];        // M / m_t
  u128 M;                   // m_0 ... m_(count-1)
};

inline int64_t crt_mod(int64_t v, int64_t m) {  // the table's set-up only
  const int64_t r = v % m;
  return r < 0 ? r + m : r;
}

inline int64_t crt_inverse(int64_t a, int64_t m) {  // a^-1 mod m for gcd(a, m) = 1 (extended Euclid)
  int64_t r0 = m, r1 = crt_mod(a, m), s0 = 0, s1 = 1;
  while (r1 != 0) {
    const int64_t q = r0 / r1, r2 = r0 - q * r1, s2 = s0 - q * s1;
    r0 = r1;
    r1 = r2;
    s0 = s1;
    s1 = s2;
  }
  return crt_mod(s0, m);
}

inline int64_t crt_gcd(int64_t a, int64_t b) {
  while (b != 0) {
    const int64_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}

// Greedy from 2^bits down: each candidate coprime to every modulus taken so far.
inline CrtTable make_crt_table(int bits) {
  CrtTable t{};
  for (int64_t c = int64_t(1) << bits; c >= 3 && t.count < kCrtMax; --c) {
    bool ok = true;
    for (int i = 0; i < t.count && ok; ++i) ok = crt_gcd(c, t.m[i]) == 1;
    if (ok) t.m[t.count++] = c;
  }
  t.prod[0] = 1;
  for (int q = 1; q <= t.count; ++q) t.prod[q] = t.prod[q - 1] * u128(t.m[q - 1]);
  for (int q = 1; q <= t.count; ++q) {
    for (int i = 0; i < q; ++i) {
      t.cof[q][i] = t.prod[q] / u128(t.m[i]);
      t.cinv[q][i] = uint32_t(crt_inverse(int64_t(t.cof[q][i] % u128(t.m[i])), t.m[i]));
    }
  }
  for (int i = 0; i < t.count; ++i)
    if (2 * t.m[i] <= (int64_t(1) << bits)) throw std::logic_error("crt table: a modulus at or below 2^(bits-1)");
  return t;
}

// v mod m moved into [-m/2, m/2): for m <= 256 an int8 value.
inline int32_t crt_symmetric(int64_t v, int64_t m) {
  const int64_t r = crt_mod(v, m);
  return int32_t(2 * r >= m ? r - m : r);
}

inline const CrtTable& crt_table(int bits) {
  static const CrtTable t7 = make_crt_table(7), t8 = make_crt_table(8);
  return bits == 7 ? t7 : t8;
}

// The constants of the first Q moduli of crt_table(bits), 1 <= Q <= its count (crt_consts).
inline CrtConsts make_crt_consts(int bits, int Q) {
  const CrtTable& t = crt_table(bits);
  CrtConsts c{};
  c.count = Q;
  c.M = t.prod[Q];
  for (int i = 0; i < Q; ++i) {
    const int64_t m = t.m[i];
    c.m[i] = uint32_t(m);
    c.sm[i] = uint32_t(UINT32_MAX / uint32_t(m) + 1);
    c.cinv[i] = t.cinv[Q][i];
    c.cof[i] = t.cof[Q][i];
    c.rinv[i] = 1.0 / double(m);
    c.p16[i] = crt_symmetric(int64_t(1) << 16, m);
    static_assert(kSliceMax == 8, "pk holds eight slice weights");
    for (int s = 0; s < kSliceMax; ++s) {  // four int8 bytes a word
      const int64_t w = crt_symmetric(int64_t((u128(1) << (bits * s)) % u128(m)), m);
      c.pk[i][s / 4] |= uint32_t(uint8_t(int8_t(w))) << (8 * (s % 4));
    }
  }
  return c;
}

// make_crt_consts, built once per process for every (bits, Q): each slices GEMM asks for them
// three times, and building them takes ~120 128-bit remainders.
inline const CrtConsts& crt_consts(int bits, int Q) {
  static const auto all = [] {
    std::array<std::array<CrtConsts, kCrtMax + 1>, 2> a{};
    for (int b = 7; b <= 8; ++b)
      for (int q = 1; q <= crt_table(b).count; ++q) a[b - 7][q] = make_crt_consts(b, q);
    return a;
  }();
  if ((bits != 7 && bits != 8) || Q < 1 || Q > crt_table(bits).count)
    throw std::logic_error("crt_consts: digit width or moduli count out of range");
  return all[bits - 7][Q];
}

// Moduli for the products of (Sa, Sb)-slice windows over K terms: the fewest whose product
// exceeds 2^(B+1) (|P| < 2^B; the reconstruction covers [-M/2, M/2)); 0 when none does within
// the table or the int32 sums could overflow (K 2^(2 bits - 2) must stay below 2^31).
inline int crt_moduli_needed(int64_t K, int Sa, int Sb, int bits) {
  if (Sa == 0 || Sb == 0) return 0;
  if (K > (kSliceIntBound >> (2 * bits - 2))) return 0;  // |r| <= 2^(bits-1): K r^2 < 2^31
  const int need = ceil_log2(K) + bits * (Sa + Sb) - 4 + 1;  // M >= 2^need > 2 |P|
  const CrtTable& t = crt_table(bits);
  if (need >= 127) return 0;
  for (int q = 1; q <= t.count; ++q)
    if ((t.prod[q] >> need) != 0) return q;
  return 0;
}

// a mod m for a m < 2^32 (a < 2^24 for m <= 2^8), with c = 2^32 / m rounded up: the quotient
// (a c) >> 32 is exact while a m < 2^32 (its error a (c - 2^32/m) / 2^32 < a / 2^32 stays below
// the distance 1/m from a/m to the next integer), so one 32 x 32 -> 64 multiply and a
// multiply-subtract.
LDET_HD uint32_t mod_small(uint32_t a, uint32_t m, uint32_t c) {
  return a - uint32_t((uint64_t(a) * c) >> 32) * m;
}

// The balanced digits of X (slice_integer's, S <= kSliceMax, zeros above S) as two words of int8
// bytes: digits 0..3 in lo, 4..7 in hi.
LDET_HD void digit_words(int64_t X, int S, int bits, uint32_t* lo, uint32_t* hi) {
  uint32_t w[2] = {0, 0};
#pragma unroll
  for (int s = 0; s < kSliceMax; ++s)
    if (s < S) w[s / 4] |= uint32_t(uint8_t(next_digit(X, bits))) << (8 * (s % 4));
  *lo = w[0];
  *hi = w[1];
}

// c + the dot product of a's and b's four int8 bytes (CUDA's dp4a: one instruction).
LDET_HD int32_t dot4_i8(uint32_t a, uint32_t b, int32_t c) {
#if defined(__CUDA_ARCH__)
  return __dp4a(int(a), int(b), c);
#else
  for (int e = 0; e < 4; ++e) c += int32_t(int8_t(a >> (8 * e))) * int32_t(int8_t(b >> (8 * e)));
  return c;
#endif
}

// r in [0, m) moved into [-(m/2), m/2) (as an int8: m <= 2^8).
LDET_HD int8_t crt_to_symmetric(uint32_t r, uint32_t m) {
  return int8_t(r >= (m + 1) / 2 ? int32_t(r) - int32_t(m) : int32_t(r));
}

// The symmetric remainder modulo m_i of X = sum_s d_s 2^(bits s) from its digit words
// (digit_words): sum_s d_s w_s with w_s = 2^(bits s) mod m_i taken symmetric, |d_s|, |w_s| <=
// 2^(bits-1), has |.| <= 8 2^(2 bits - 2) = 2^(2 bits + 1); adding m_i 2^11 (> 2^(bits + 10), every
// modulus being above 2^(bits-1)) makes it non-negative and below 2^20 for bits <= 8 (mod_small).
LDET_HD int8_t crt_remainder(uint32_t lo, uint32_t hi, int i, const CrtConsts& t) {
  const uint32_t m = t.m[i];
  const int32_t sum = dot4_i8(lo, t.pk[i][0], dot4_i8(hi, t.pk[i][1], int32_t(m << 11)));
  return crt_to_symmetric(mod_small(uint32_t(sum), m, t.sm[i]), m);
}

// c mod m_i in [0, m_i) for any int32 c: c = h 2^16 + l with h = c >> 16 (arithmetic, |h| <= 2^15)
// and l < 2^16; h (2^16 mod m_i, symmetric: |.| <= 2^22) + l + m_i 2^15 (> 2^22) is non-negative
// and below 2^24, where mod_small is exact (a m < 2^32). 32-bit operations only.
LDET_HD uint32_t crt_mod_i32(int32_t c, int i, const CrtConsts& t) {
  const uint32_t m = t.m[i];
  const int32_t a = (c >> 16) * t.p16[i] + (c & 0xffff) + int32_t(m << 15);
  return mod_small(uint32_t(a), m, t.sm[i]);
}

// P from S = sum_t y_t M/m_t (congruent to P modulo M, below Q M) and f = sum_t y_t / m_t
// (S / M's estimate): P = S - k M with k the integer nearest f, then the exact fix-up below.
LDET_HD i128 crt_from_sum(u128 S, double f, u128 M) {
  i128 P = i128(S) - i128(M) * i128(uint64_t(f + 0.5));
  // The estimate can miss only where S / M lies within ~2^-47 of a half-integer, i.e. |P| within
  // 2^-46 of M/2: then k is one off and one of these moves P back (no test data reaches them;
  // they keep the result exact regardless of the estimate, |P| < 3/2 M before them).
  if (2 * P >= i128(M)) P -= i128(M);
  if (2 * P < -i128(M)) P += i128(M);
  return P;
}

// P from its Q int32 remainder sums c[t * pstride] (t < Q), by the explicit CRT: with r_t = c_t
// mod m_t and y_t = r_t (M/m_t)^-1 mod m_t, S = sum_t y_t M/m_t is congruent to P modulo M and
// below Q M, and S / M = sum_t y_t / m_t. So P = S - k M with k the integer nearest that sum:
// estimated in fp64 (error below Q 2^-50, far under 1/2), then the exact 128-bit fix-up moves the
// result into [-M/2, M/2), where |P| < M/2 lies (crt_moduli_needed). O(Q) work per output, where
// Garner's mixed radix takes Q^2/2 dependent remainders.
LDET_HD i128 crt_value(const int32_t* c, int64_t pstride, const CrtConsts& t) {
  u128 S = 0;
  double f = 0.0;
  // unrolled to the table's size: each modulus's constants are then fixed kernel-parameter slots
#pragma unroll
  for (int i = 0; i < kCrtMax; ++i) {
    if (i < t.count) {
      const uint32_t mi = t.m[i];
      const uint32_t y = mod_small(crt_mod_i32(c[i * pstride], i, t) * t.cinv[i], mi, t.sm[i]);  // both < 2^8
      S += t.cof[i] * y;  // each term below M: S < Q M < 2^122
      f += double(y) * t.rinv[i];
    }
  }
  return crt_from_sum(S, f, t.M);
}

// ---- The CPU's vector forms (csrc/cpu/int_slices_cpu.cpp) ----
// The same remainders and the same P as crt_remainder / crt_value, in fp64 arithmetic that is exact
// where it has to be, in loops over consecutive elements (outputs) that the compiler turns into
// AVX-512: through the scalar forms (32-bit Barrett steps, dp4a emulated byte by byte, 128-bit
// multiply-adds) the CPU's CRT way ran at a third of its diagonals' speed.
//
// Floor division in fp64: for an integer a with |a| < 2^46 and 2 < m <= 2^8,
// floor(fl(a + 1/2) * fl(1/m)) = floor((a + 1/2) / m) = floor(a / m): a + 1/2 is exact, the
// product's error is below 2^-52 relative, under 2^46 / 2^7 * 2^-51 = 2^-12 absolute, and
// (a + 1/2) / m lies at least 1 / (2m) >= 2^-9 from every integer. a - m q is then exact too.
// (Below: |a| < 2^38 for the remainders, |a| < 2^31 and < 2^16 for the reconstruction.)

// floor(v) for |v| < 2^50 lying at least 2^-12 from every integer (the divisions above: 2^-9 less
// their error): v - 1/2 is then at least that far from every half-integer, and adding 1.5 2^52
// rounds it to its nearest integer (round-to-nearest, the default mode), which is floor(v). The
// compiler vectorizes this, where std::floor kept these loops scalar (GCC 12).
inline double floor_off_integers(double v) {
  constexpr double kRound = 6755399441055744.0;  // 1.5 * 2^52: sums with it have unit spacing
  return ((v - 0.5) + kRound) - kRound;
}

// out[i * stride + k] = crt_remainder's value for the window integer X = hi[k] 2^32 + lo[k]
// (|X| < 2^62, int_slices.h step 1: |hi| < 2^30, 0 <= lo < 2^32, both held exactly) and modulus i,
// for k < n. Per modulus: a = hi (2^32 mod m, symmetric: |.| <= 2^7) + lo is congruent to X and
// |a| < 2^38; then a - m floor((a + h) / m) with h = floor(m/2) lies in [-h, m - 1 - h], the
// range crt_to_symmetric maps into.
inline void crt_remainders_fp64(const double* hi, const double* lo, int64_t n, const CrtConsts& t, int8_t* out,
                                int64_t stride) {
  for (int i = 0; i < t.count; ++i) {
    const double m = double(t.m[i]), r = t.rinv[i], h = double(t.m[i] / 2) + 0.5;
    const double p32 = double(crt_symmetric(int64_t(1) << 32, t.m[i]));
    int8_t* o = out + i * stride;
    for (int64_t k = 0; k < n; ++k) {
      const double a = hi[k] * p32 + lo[k];
      o[k] = int8_t(int32_t(a - m * floor_off_integers((a + h) * r)));
    }
  }
}

// Each M / m_t in four 30-bit limbs (below 2^120 = 2^(8 kCrtMax)), as exact doubles.
struct CrtLimbs {
  double limb[kCrtMax][4];
};

inline CrtLimbs crt_limbs(const CrtConsts& t) {
  CrtLimbs L{};
  for (int i = 0; i < t.count; ++i)
    for (int j = 0; j < 4; ++j) L.limb[i][j] = double(uint64_t(t.cof[i] >> (30 * j)) & ((uint64_t(1) << 30) - 1));
  return L;
}

constexpr int64_t kCrtBlock = 256;  // outputs per crt_values_fp64 call

// P[j] = crt_value(c + j, pstride, t) for j < n <= kCrtBlock. Per modulus: c mod m and y = (c mod
// m) (M/m)^-1 mod m by the fp64 floor division (|c| < 2^31; products below 2^16); y times each limb
// of M / m summed per limb (below 2^8 2^30 15 < 2^42: exact), and the quotient's estimate.
inline void crt_values_fp64(const int32_t* c, int64_t pstride, int64_t n, const CrtConsts& t, const CrtLimbs& L,
                            i128* P) {
  double f[kCrtBlock], s[4][kCrtBlock];
  for (int64_t j = 0; j < n; ++j) f[j] = s[0][j] = s[1][j] = s[2][j] = s[3][j] = 0.0;
  for (int i = 0; i < t.count; ++i) {
    const int32_t* ci = c + i * pstride;
    const double m = double(t.m[i]), r = t.rinv[i], inv = double(t.cinv[i]);
    const double l0 = L.limb[i][0], l1 = L.limb[i][1], l2 = L.limb[i][2], l3 = L.limb[i][3];
    for (int64_t j = 0; j < n; ++j) {
      const double a = double(ci[j]);
      const double p = (a - m * floor_off_integers((a + 0.5) * r)) * inv;
      const double y = p - m * floor_off_integers((p + 0.5) * r);
      f[j] += y * r;
      s[0][j] += y * l0;
      s[1][j] += y * l1;
      s[2][j] += y * l2;
      s[3][j] += y * l3;
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    const u128 S = u128(uint64_t(s[0][j])) + (u128(uint64_t(s[1][j])) << 30) + (u128(uint64_t(s[2][j])) << 60) +
                   (u128(uint64_t(s[3][j])) << 90);
    P[j] = crt_from_sum(S, f[j], t.M);
  }
}

}  // namespace ldet

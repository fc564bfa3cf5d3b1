// The slices' product sums through remainders (Chinese remainder theorem): fewer int8 GEMMs.
//
// Why: the diagonal route (int_slices.h, step 3) multiplies every pair of slices, Sx * Sw int8
// GEMMs' worth of multiply-adds: 25 for fp32 operands at S = 5. The integer it builds per output,
// P = sum_k X_k W_k (X, W the rows' window integers), is below 2^B with B = ceil_log2(K) +
// bits (Sx + Sw) - 4. Its remainders modulo Q pairwise coprime moduli m_t <= 2^bits determine it
// once prod m_t > 2^(B+1): Q int8 GEMMs of the remainder planes r_t(X) . r_t(W), each exact in int32
// while K 2^(2 bits - 2) < 2^31, give P mod m_t, and the explicit CRT reconstruction gives P.
// For fp32 at S = 5, K = 4096 and 8-bit digits: 12 GEMMs instead of 25 (benchmarks/NOTES.md,
// session 11, has the costs; the reconstruction is O(Q) multiply-adds per output).
//
// Remainders are symmetric, r in [-2^(bits-1), 2^(bits-1)): the same int8 range the balanced digits
// use, so the same int8 GEMM stays exact (bits = 7 where it could saturate 16-bit pair sums).
// P is the same integer the diagonals' Horner sum gives, so everything downstream (residue
// terms, bias, the one rounding, the 128-bit proof) is unchanged: the bytes cannot move.
//
// The per-element and per-output functions are LDET_HD: the CPU backend and the CUDA kernels
// (make_slices_kernel, the combine kernels) run the same code; the table is built on the host
// and copied to each device once (csrc/cuda/int_slices_cuda.cu, crt_table_on).
#pragma once

#include <cstdint>
#include <stdexcept>

#include "int_slices.h"

namespace ldet {

constexpr int kCrtMax = 15;  // moduli at most: 15 M < 2^122 (the reconstruction's S, in 128 bits)

// Pairwise coprime moduli <= 2^bits, largest first (their product grows fastest).
struct CrtTable {
  int count;
  int64_t m[kCrtMax];
  u128 prod[kCrtMax + 1];  // prod[q] = M_q = m_0 ... m_(q-1)
  // The reconstruction's constants for the first q moduli (crt_value): cof[q][t] = M_q / m_t and
  // cinv[q][t] = (M_q / m_t)^-1 mod m_t.
  u128 cof[kCrtMax + 1][kCrtMax];
  uint32_t cinv[kCrtMax + 1][kCrtMax];
  double rinv[kCrtMax];    // 1 / m_t, rounded: the quotient's estimate
  uint64_t fm[kCrtMax];    // fastmod's constants: 2^64 / m_t rounded up
  uint32_t sm[kCrtMax];    // mod_small's constants: 2^32 / m_t rounded up
  uint32_t pw[kCrtMax][kSliceMax];  // 2^(bits s) mod m_t: a slice's weight
};

inline int64_t crt_mod(int64_t v, int64_t m) {  // the table's set-up only
  const int64_t r = v % m;
  return r < 0 ? r + m : r;
}

// a mod d for any 32-bit a, with c = 2^64 / d rounded up: two multiplications instead of a
// division (Lemire, Kaser, Kurz, "Faster remainder by direct computation", 2019: exact for every
// 32-bit a and d). Here: each remainder sum c_t of the reconstruction (|c_t| < 2^31).
LDET_HD uint32_t fastmod(uint32_t a, uint64_t c, uint32_t d) {
  const uint64_t low = c * a;
#if defined(__CUDA_ARCH__)
  return uint32_t(__umul64hi(low, uint64_t(d)));
#else
  return uint32_t((u128(low) * d) >> 64);
#endif
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
  for (int i = 0; i < t.count; ++i) {
    if (2 * t.m[i] <= (int64_t(1) << bits)) throw std::logic_error("crt table: a modulus at or below 2^(bits-1)");
    t.rinv[i] = 1.0 / double(t.m[i]);
    t.fm[i] = UINT64_MAX / uint64_t(t.m[i]) + 1;
    t.sm[i] = uint32_t(UINT32_MAX / uint32_t(t.m[i]) + 1);
    for (int s = 0; s < kSliceMax; ++s) t.pw[i][s] = uint32_t((u128(1) << (bits * s)) % u128(t.m[i]));
  }
  return t;
}

inline const CrtTable& crt_table(int bits) {
  static const CrtTable t7 = make_crt_table(7), t8 = make_crt_table(8);
  return bits == 7 ? t7 : t8;
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

// a mod m for a < 2^20 and m <= 2^8, with c = 2^32 / m rounded up: the quotient (a c) >> 32 is
// exact while a m < 2^32 (its error a (c - 2^32/m) / 2^32 < a / 2^32 stays below the distance
// 1/m from a/m to the next integer), so one 32 x 32 -> 64 multiply and a multiply-subtract.
LDET_HD uint32_t mod_small(uint32_t a, uint32_t m, uint32_t c) {
  return a - uint32_t((uint64_t(a) * c) >> 32) * m;
}

// The symmetric remainder modulo m_i of the integer with balanced digits d[s * dstride] (s < S;
// X = sum_s d_s 2^(bits s), |d_s| <= 2^(bits-1)): sum_s d_s (2^(bits s) mod m_i) has
// |.| < 8 2^(bits-1) 2^bits; adding m_i 2^11 (> 2^(bits + 10): every modulus is above 2^(bits-1),
// bits <= 8) makes it non-negative and below 2^20 for mod_small; the result then moves into
// [-(m_i/2), m_i/2), inside the digits' int8 range.
LDET_HD int8_t crt_remainder(const int8_t* d, int64_t dstride, int S, int i, const CrtTable& t) {
  const uint32_t m = uint32_t(t.m[i]);
  int32_t sum = int32_t(m << 11);
  for (int s = 0; s < S; ++s) sum += int32_t(d[s * dstride]) * int32_t(t.pw[i][s]);
  const uint32_t r = mod_small(uint32_t(sum), m, t.sm[i]);
  return int8_t(r >= (m + 1) / 2 ? int32_t(r) - int32_t(m) : int32_t(r));
}

// The remainder planes of one row: for each of its K integers with digits d[s * K + k], the
// remainder modulo m_i into out[i * stride + k], i < Q (the loop over k has no dependences).
inline void crt_remainder_planes(const int8_t* d, int64_t K, int S, int Q, const CrtTable& t, int8_t* out,
                                 int64_t stride) {
  for (int i = 0; i < Q; ++i)
    for (int64_t k = 0; k < K; ++k) out[i * stride + k] = crt_remainder(d + k, K, S, i, t);
}

// P from its Q int32 remainder sums c[t * pstride] (t < Q), by the explicit CRT: with r_t = c_t
// mod m_t and y_t = r_t (M/m_t)^-1 mod m_t, S = sum_t y_t M/m_t is congruent to P modulo M and
// below Q M, and S / M = sum_t y_t / m_t. So P = S - k M with k the integer nearest that sum:
// estimated in fp64 (error below Q 2^-50, far under 1/2), then the exact 128-bit fix-up moves the
// result into [-M/2, M/2), where |P| < M/2 lies (crt_moduli_needed). O(Q) work per output, where
// Garner's mixed radix took Q^2/2 dependent remainders (NOTES, session 11).
LDET_HD i128 crt_value(const int32_t* c, int64_t pstride, int Q, const CrtTable& t) {
  u128 S = 0;
  double f = 0.0;
  for (int i = 0; i < Q; ++i) {
    const uint32_t mi = uint32_t(t.m[i]);
    const int32_t ci = c[i * pstride];
    // |ci| < 2^31: its magnitude's remainder, negated for a negative sum
    uint32_t r = fastmod(ci < 0 ? uint32_t(-int64_t(ci)) : uint32_t(ci), t.fm[i], mi);
    if (ci < 0 && r != 0) r = mi - r;
    const uint32_t y = mod_small(r * t.cinv[Q][i], mi, t.sm[i]);  // both below 2^8
    S += t.cof[Q][i] * y;  // each term below M: S < Q M < 2^122
    f += double(y) * t.rinv[i];
  }
  const u128 M = t.prod[Q];
  i128 P = i128(S) - i128(M) * i128(uint64_t(f + 0.5));
  // The estimate can miss only where S / M lies within ~2^-47 of a half-integer, i.e. |P| within
  // 2^-46 of M/2: then k is one off and one of these moves P back (no test data reaches them;
  // they keep the result exact regardless of the estimate, |P| < 3/2 M before them).
  if (2 * P >= i128(M)) P -= i128(M);
  if (2 * P < -i128(M)) P += i128(M);
  return P;
}

}  // namespace ldet

// The slices' product sums through remainders (Chinese remainder theorem): fewer int8 GEMMs.
//
// Why: the diagonal route (int_slices.h, step 3) multiplies every pair of slices, Sx * Sw int8
// GEMMs' worth of multiply-adds: 25 for fp32 operands at S = 5. The integer it builds per output,
// P = sum_k X_k W_k (X, W the rows' window integers), is below 2^B with B = ceil_log2(K) +
// bits (Sx + Sw) - 4. Its remainders modulo Q pairwise coprime moduli m_t <= 2^bits determine it
// once prod m_t > 2^(B+1): Q int8 GEMMs of the remainder planes r_t(X) . r_t(W), each exact in int32
// while K 2^(2 bits - 2) < 2^31, give P mod m_t, and Garner's mixed-radix reconstruction gives P.
// For fp32 at S = 5, K = 4096 and 8-bit digits: 12 GEMMs instead of 25 (benchmarks/NOTES.md,
// session 11, has the costs; the reconstruction is ~Q^2/2 modular multiply-adds per output).
//
// Remainders are symmetric, r in [-2^(bits-1), 2^(bits-1)): the same int8 range the balanced digits
// use, so the same int8 GEMM stays exact (bits = 7 where it could saturate 16-bit pair sums).
// P is the same integer the diagonals' Horner sum gives, so everything downstream (residue
// terms, bias, the one rounding, the 128-bit proof) is unchanged: the bytes cannot move.
//
// Host-only for now: the CPU backend uses it; the CUDA backend has no remainder kernels yet
// (SliceBackend::crt_output_cost == 0 keeps it on the diagonals).
#pragma once

#include <cstdint>
#include <stdexcept>

#include "int_slices.h"

namespace ldet {

constexpr int kCrtMax = 15;  // moduli at most: their product stays below 2^127 (u128 Garner)

// Pairwise coprime moduli <= 2^bits, largest first (their product grows fastest).
struct CrtTable {
  int count;
  int64_t m[kCrtMax];
  int64_t inv[kCrtMax][kCrtMax];  // inv[i][j] = m_j^-1 mod m_i, j < i (Garner's constants)
  u128 prod[kCrtMax + 1];  // prod[q] = m_0 ... m_(q-1)
  uint64_t fm[kCrtMax];    // fastmod's constants: 2^64 / m_t rounded up
  uint32_t p32[kCrtMax];   // 2^32 mod m_t
};

inline int64_t crt_mod(int64_t v, int64_t m) {  // the table's set-up and the reference only
  const int64_t r = v % m;
  return r < 0 ? r + m : r;
}

// a mod d for any 32-bit a, with c = 2^64 / d rounded up: two multiplications instead of a
// division (Lemire, Kaser, Kurz, "Faster remainder by direct computation", 2019: exact for every
// 32-bit a and d). The reconstruction takes ~Q^2/2 remainders per output: the division was
// most of the route's CPU time.
inline uint32_t fastmod(uint32_t a, uint64_t c, uint32_t d) {
  const uint64_t low = c * a;
  return uint32_t((u128(low) * d) >> 64);
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
  for (int i = 0; i < t.count; ++i)
    for (int j = 0; j < i; ++j) t.inv[i][j] = crt_inverse(t.m[j], t.m[i]);
  t.prod[0] = 1;
  for (int q = 1; q <= t.count; ++q) t.prod[q] = t.prod[q - 1] * u128(t.m[q - 1]);
  for (int i = 0; i < t.count; ++i) {
    // crt_value's 2 m_i bound needs every modulus above half the largest
    if (2 * t.m[i] <= t.m[0]) throw std::logic_error("crt table: a modulus below half the largest");
    t.fm[i] = UINT64_MAX / uint64_t(t.m[i]) + 1;
    t.p32[i] = uint32_t((uint64_t(1) << 32) % uint64_t(t.m[i]));
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

// |X| mod m_t for |X| < 2^62: (hi 2^32 + lo) mod m from the two 32-bit halves.
inline uint32_t crt_abs_mod(uint64_t u, const CrtTable& t, int i) {
  const uint32_t m = uint32_t(t.m[i]);
  const uint32_t hi = fastmod(uint32_t(u >> 32), t.fm[i], m), lo = fastmod(uint32_t(u), t.fm[i], m);
  return fastmod(hi * t.p32[i] + lo, t.fm[i], m);  // < 2^16 + 2^8: 32 bits hold it
}

// The symmetric remainder of X (|X| < 2^62) modulo m_t, in [-(m_t/2), m_t/2) rounded toward the
// int8 range: [-2^(bits-1), 2^(bits-1)) for every m_t <= 2^bits.
inline int8_t crt_remainder(int64_t X, const CrtTable& t, int i) {
  const int64_t m = t.m[i];
  int64_t r = crt_abs_mod(uint64_t(X < 0 ? -X : X), t, i);
  if (X < 0 && r != 0) r = m - r;
  return int8_t(r >= (m + 1) / 2 ? r - m : r);
}

// P from its Q int32 remainder sums c[t * pstride] (t < Q): Garner's mixed-radix digits, then
// P = a_0 + m_0 (a_1 + m_1 (a_2 + ...)) in [0, M), moved to [-M/2, M/2).
inline i128 crt_value(const int32_t* c, int64_t pstride, int Q, const CrtTable& t) {
  uint32_t a[kCrtMax];
  for (int i = 0; i < Q; ++i) {
    const uint32_t mi = uint32_t(t.m[i]);
    const int32_t ci = c[i * pstride];
    // |ci| < 2^31: its magnitude's remainder, negated for a negative sum
    uint32_t v = fastmod(ci < 0 ? uint32_t(-int64_t(ci)) : uint32_t(ci), t.fm[i], mi);
    if (ci < 0 && v != 0) v = mi - v;
    // (v - a_j) inv mod m_i; + 2 m_i keeps it non-negative (a_j < m_j <= 2^bits <= 2 m_i: every
    // modulus of a table is above half its largest) and below 3 * 2^8 * 2^8
    for (int j = 0; j < i; ++j) v = fastmod((v + 2 * mi - a[j]) * uint32_t(t.inv[i][j]), t.fm[i], mi);
    a[i] = v;
  }
  u128 P = 0;
  for (int i = Q - 1; i >= 0; --i) P = P * u128(t.m[i]) + u128(a[i]);
  const u128 M = t.prod[Q];
  return P >= M - M / 2 ? i128(P) - i128(M) : i128(P);  // M - M/2 = ceil(M/2)
}

}  // namespace ldet

// A 128-bit window in front of a long accumulator: exact sums of many narrow products at a few
// integer instructions per term (the dot kernels: LayerNorm statistics, bias and norm-weight
// gradients, CPU and CUDA alike).
//
// Why: add_value puts every term into the 19-word digit array as three limbs at an index that
// depends on the term's exponent. On the GPU that array lives in local memory (indexed at run
// time), so each term cost three read-modify-writes there; the dot kernels took ~2 ms of the
// det_ddp step, and the window alone removed only about a quarter of that. The terms of one sum mostly lie within
// a few dozen binades of each other, so they fit one 128-bit integer W in units of 2^(base - 298):
//
//   - the first finite nonzero term places the window: base = its unit shift - kWindowBelow
//     (clamped at 0), so terms down to 2^kWindowBelow times finer still fit;
//   - a term m * 2^(shift - 298) (m < 2^53, add_double's decomposition) with
//     0 <= shift - base <= kWindowSpan goes into W as m << (shift - base) < 2^110, exactly;
//   - any other finite term goes to the digits as before (add_double); inf/NaN to the status word;
//   - after kWindowTerms terms, and at the end, flush() adds W to the digits (at most 2^16 terms
//     below 2^110 each: |W| < 2^126, no overflow of the signed 128 bits).
//
// The digits then hold the same exact sum as with add_value per term; their canonical form is
// unique, so normalize() gives the same bytes. Preconditions as add_double's (every term an integer
// number of 2^-298 units below 2^300); the digit-headroom count is unchanged in kind: a flush adds
// at most two limbs to a digit, far fewer than the per-term adds it replaces.
#pragma once

#include <cstdint>

#include "longacc.h"

namespace ldet {

constexpr int kWindowBelow = 28;
constexpr int kWindowSpan = 57;
constexpr int kWindowTerms = 1 << 16;

struct WindowAcc {
  uint64_t lo = 0;
  int64_t hi = 0;  // W = hi * 2^64 + lo, two's complement
  int base = -1;   // unit shift of W's bit 0; -1: not placed yet
  int terms = 0;   // terms in W since the last flush
};

// Adds the 32-bit magnitude t at bit `off` (units of 2^-298) with sign s: two limbs, as add_double's.
LDET_HD void add_u32_at(int64_t* acc, int64_t s, uint64_t t, int off) {
  const int q = off >> 5, r = off & 31;
  add_limb(acc, q, s * int64_t((t << r) & uint64_t(LDET_MASK32)));
  const uint64_t up = t >> (32 - r);  // r = 0: t < 2^32, so nothing
  if (up) add_limb(acc, q + 1, s * int64_t(up));
}

// Adds s * (hi 2^64 + lo) at bit `off` (units of 2^-298): four 32-bit limbs, zero ones skipped
// (so never past the top). The window's flush, and the slices' CRT route (int_slices.h).
LDET_HD void add_u128_at(int64_t* acc, int64_t s, uint64_t lo, uint64_t hi, int off) {
  const uint64_t part[4] = {lo & uint64_t(LDET_MASK32), lo >> 32, hi & uint64_t(LDET_MASK32), hi >> 32};
  for (int k = 0; k < 4; ++k)
    if (part[k]) add_u32_at(acc, s, part[k], off + 32 * k);
}

// Moves W into the digits and empties it (the window keeps its place).
LDET_HD void window_flush(WindowAcc& w, int64_t* acc) {
  w.terms = 0;
  if (w.lo == 0 && w.hi == 0) return;
  const bool neg = w.hi < 0;
  uint64_t lo = w.lo, hi = uint64_t(w.hi);
  if (neg) {  // magnitude of the two's complement value
    lo = ~lo + 1;
    hi = ~hi + (lo == 0 ? 1 : 0);
  }
  add_u128_at(acc, neg ? -1 : 1, lo, hi, w.base);
  w.lo = 0;
  w.hi = 0;
}

// Adds any fp64 term exactly: into W when it fits, else into the digits (or the status word).
LDET_HD void window_add(WindowAcc& w, int64_t* acc, double v) {
  const uint64_t u = bits_of(v);
  const int e = int((u >> 52) & 0x7ff);
  if (e == 0x7ff) {
    add_special(acc, v);
    return;
  }
  if (v == 0.0) return;
  if (e == 0) {  // fp64 subnormal: below every term the kernels form; add_double's own case
    add_double(acc, v);
    return;
  }
  uint64_t m = (u & ((uint64_t(1) << 52) - 1)) | (uint64_t(1) << 52);
  int shift = e - 1075 - LDET_LSB_EXP;  // v = m * 2^(shift + LDET_LSB_EXP)
  if (shift < 0) {  // low bits are zero by the precondition
    m >>= -shift;
    shift = 0;
  }
  if (w.base < 0) w.base = shift > kWindowBelow ? shift - kWindowBelow : 0;
  const unsigned s = unsigned(shift - w.base);  // negative (below the window) wraps: > kWindowSpan
  if (s > unsigned(kWindowSpan)) {
    add_double(acc, v);
    return;
  }
  const uint64_t l = m << s;
  const uint64_t h = s ? m >> (64 - s) : 0;
  if (u >> 63) {
    const uint64_t borrow = w.lo < l ? 1 : 0;
    w.lo -= l;
    w.hi -= int64_t(h + borrow);
  } else {
    w.lo += l;
    w.hi += int64_t(h + (w.lo < l ? 1 : 0));
  }
  if (++w.terms == kWindowTerms) window_flush(w, acc);
}

}  // namespace ldet

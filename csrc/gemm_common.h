// Per-output accumulation logic shared by the CPU and CUDA GEMM kernels.
//
// Every output keeps a running fp64 sum S plus a long accumulator that is touched only when S
// cannot absorb a term exactly. The invariant is:   exact sum = S + value(digits).
//
// K is cut into blocks of LDET_KBLOCK. For each (output, block) the kernels read per-row and
// per-column exponent statistics (BlockStat) and pick one of three paths:
//   fast    the block's products provably sum exactly in fp64 (LDET_FAST_SPREAD), so any order
//           of fma's gives the exact block sum; it enters S through one TwoSum.
//   exact   every product (exact in fp64) enters S through TwoSum; a non-zero rounding error
//           goes into the digits. Used when the spread check fails (adversarial data, fp32).
//   special a row or column block holds inf/NaN: like `exact`, plus status flags.
// A block whose row or column is all zero (and holds no special) contributes nothing.
// At the end S goes into the digits, which are normalized: the canonical digits are the same
// whichever paths ran, so the bytes do not depend on the device, tiling or data layout.
#pragma once

#include <cmath>

#include "longacc.h"

namespace ldet {

// Per (row, K-block) exponent statistics of one operand, packed in an int32:
// high 16 bits: max hi (floor log2 |v|) over the block, low 16 bits: min lo (lowest set bit).
constexpr int kStatEmpty = -32768;  // the block is all zeros
constexpr int kStatSpecial = 32767;  // the block holds an inf or NaN

LDET_HD int32_t pack_stat(int hi, int lo) { return int32_t((uint32_t(uint16_t(int16_t(hi))) << 16) | uint16_t(int16_t(lo))); }
LDET_HD int stat_hi(int32_t s) { return int(int16_t(uint16_t(uint32_t(s) >> 16))); }
LDET_HD int stat_lo(int32_t s) { return int(int16_t(uint16_t(uint32_t(s) & 0xffffu))); }

// Running reduction of a block's statistics, value by value.
struct StatAcc {
  int hi = kStatEmpty;
  int lo = 32767;
  bool special = false;
  LDET_HD void add(double v) {
    if (!is_finite(v)) {
      special = true;
      return;
    }
    if (v == 0.0) return;
    const ExpStat s = exp_stat(v);
    if (s.hi > hi) hi = s.hi;
    if (s.lo < lo) lo = s.lo;
  }
  LDET_HD int32_t packed() const {
    if (special) return pack_stat(kStatSpecial, 0);
    if (hi == kStatEmpty) return pack_stat(kStatEmpty, 0);
    return pack_stat(hi, lo);
  }
};

enum BlockPath { kPathSkip = 0, kPathFast = 1, kPathExact = 2 };

LDET_HD BlockPath block_path(int32_t sx, int32_t sw) {
  const int hx = stat_hi(sx), hw = stat_hi(sw);
  if (hx == kStatSpecial || hw == kStatSpecial) return kPathExact;  // inf * 0 -> NaN: no skip
  if (hx == kStatEmpty || hw == kStatEmpty) return kPathSkip;
  const int spread = (hx - stat_lo(sx)) + (hw - stat_lo(sw));
  return spread <= LDET_FAST_SPREAD ? kPathFast : kPathExact;
}

// acc_digits adds a finite fp64 value straight into the digits (exact). acc_term adds a finite
// fp64 term (a multiple of 2^-298) exactly: TwoSum into the running sum S, the rounding error (if
// any) into the digits. `adds` counts digit additions since the last
// normalization; `interval` (LDET_NORM_INTERVAL in production, tiny in the headroom tests)
// bounds it, keeping every digit inside the headroom of longacc.h.
LDET_HD void acc_digits(int64_t* digits, int64_t& adds, int64_t interval, double v) {
  add_double(digits, v);
  if (++adds >= interval) {
    normalize(digits);
    adds = 0;
  }
}

LDET_HD void acc_term(double& S, int64_t* digits, int64_t& adds, int64_t interval, double t) {
  double e;
  S = two_sum(S, t, &e);
  if (e != 0.0) acc_digits(digits, adds, interval, e);
}

// Adds any product or bias value, finite or not.
LDET_HD void acc_any(double& S, int64_t* digits, int64_t& adds, int64_t interval, double t) {
  if (is_finite(t)) {
    acc_term(S, digits, adds, interval, t);
  } else {
    add_special(digits, t);
  }
}

// The exact sum of n finite doubles as an unevaluated pair hi + lo with hi = RN(hi + lo), when
// the TwoSum chain can prove it (every error of the errors' own sum is zero); false otherwise.
// Used for the running sums of the fp32 split's four K-segments, whose total usually spans more
// than 53 bits but far fewer than 106.
LDET_HD bool exact_pair_sum(const double* v, int n, double* hi, double* lo) {
  double s = v[0], errs = 0.0;
  for (int i = 1; i < n; ++i) {
    double e, f;
    s = two_sum(s, v[i], &e);
    errs = two_sum(errs, e, &f);
    if (f != 0.0) return false;
  }
  *hi = two_sum(s, errs, lo);  // s + errs == hi + lo exactly
  return true;
}

// The fp32 rounding (nearest-even, finalize_fp32's) of the exact value V = hi + lo, where
// hi = RN64(V), without the digits: true with *out set, or false when it cannot be decided
// this way (V is within fp64 rounding of an fp32 midpoint, or at the overflow edge).
// Why it is right: let f = RN32(hi). If hi == f, V is within half an fp64 ulp of an fp32
// value, far inside f's rounding interval. Otherwise let m be the fp32 midpoint between f and
// its neighbour on hi's side (a double). If hi != m, then V is strictly on hi's side of m and
// of the other midpoint of f's interval: were it not, RN64 (monotone) would map V to a double
// on the other side, not to hi. So RN32(V) == f.
LDET_HD bool round_pair_to_fp32(double hi, double lo, float* out) {
  if (lo == 0.0) {
    *out = hi == 0.0 ? 0.0f : static_cast<float>(hi);  // exact zero is +0.0 (finalize_fp32)
    return true;
  }
  const float f = static_cast<float>(hi);
  const double fd = static_cast<double>(f);
  if (!(fd - fd == 0.0)) return false;  // overflowed to inf: the overflow edge, leave it to the digits
  if (fd == hi) {
    *out = f;
    return true;
  }
  const float f2 = nextafterf(f, hi > fd ? HUGE_VALF : -HUGE_VALF);
  const double f2d = static_cast<double>(f2);
  if (!(f2d - f2d == 0.0)) return false;
  const double mid = (fd + f2d) * 0.5;  // exact: two fp32 values' sum fits in 25 bits
  if (hi == mid) return false;
  *out = f;
  return true;
}

// Moves S into the digits and normalizes: the canonical exact sum, whatever paths ran.
LDET_HD void acc_finish(double& S, int64_t* digits) {
  add_double(digits, S);
  S = 0.0;
  normalize(digits);
}

}  // namespace ldet

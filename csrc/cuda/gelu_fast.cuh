// erf-GELU and its derivative on the GPU from CUDA's normcdf and exp, with the bytes of
// detmath.h's series (the CPU's and the reference's), or no answer.
//
// Why: detmath.h's norm_cdf sums up to 43 fp64 series terms an element (a warp runs as many as
// its slowest lane), so ldet::act / act_backward of det_ddp's 4096 x 4096 MLP activation took
// ~7% of the step's GPU time. CUDA's double normcdf and exp
// cost a few dozen fp64 operations.
//
// Why the bytes cannot change. Let v be the value computed here and s the series' fp64 value
// (detmath.h act_forward / g * act_derivative). normcdf and exp have documented maximum errors of
// 5 and 1 ulp (CUDA Math API, double precision). The series is ~1e-15 relative to the true value
// (up to 2 z^2 2^-53 more from the rounding of z = x / sqrt 2: <= 2^-45 for |x| <= 16, the only
// inputs taken here), except where it forms Phi(x) = (1 - erf(a)) / 2 for -4.25 < x < 0
// (a = |x| / sqrt 2 < 3): there its error is absolute, erf(a)'s ~2^-48 (the sum's roundings),
// i.e. up to ~2^-36 relative to Phi(-4.2). The first version here bounded only the relative
// part, and the exhaustive test found 125 fp32 inputs near x = -3.6 where the two ways rounded
// apart. So h = 2^-40 (|v|, or |g| (P + |x phi|) for the derivative: P + x phi cancels near
// x = -0.75) plus 2^-44 (|x|, or |g|) for -4.25 < x < 0, and |v - s| <= h with a margin of 2^4
// or more. Rounding is monotone: when v - h and v + h round to the same output value, so does
// every value between them, s included, and that value is the series' output. Else (about one
// element in 2^15 for fp32 outputs away from that range, more inside it, and every zero, tiny,
// huge, NaN or |x| > 16 case) the caller runs the series. tests/test_gelu_fast.py compares both
// ways on every fp32, bf16 and fp16 input.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "detmath.h"

namespace ldet {

// v rounded to nearest-even into fmt, as an fp32 value (exact for bf16 / fp16).
__device__ __forceinline__ float narrow_rn(float v, int fmt) {
  if (fmt == kFmtBF16) return __bfloat162float(__float2bfloat16_rn(v));
  if (fmt == kFmtF16) return __half2float(__float2half_rn(v));
  return v;
}

// The output of an fp64 value known only to lie in [lo, hi] (same sign, both nonzero), or false
// when the interval holds a rounding boundary of fmt. bf16 / fp16: r = fp32(lo) = fp32(hi) and
// r's two fp32 neighbours all round to one fmt value, so no boundary of fmt lies between them
// (every bf16 / fp16 midpoint is an fp32 value; one inside would have rounded to itself).
__device__ __forceinline__ bool round_interval(double lo, double hi, int fmt, float* out) {
  if (!((lo > 0.0 && hi > 0.0) || (lo < 0.0 && hi < 0.0))) return false;  // the sign of a zero
  const float r = __double2float_rn(lo);
  if (__float_as_uint(r) != __float_as_uint(__double2float_rn(hi))) return false;
  if (fmt == kFmtF32) {
    *out = r;
    return true;
  }
  const float y = narrow_rn(r, fmt);
  const uint32_t yb = __float_as_uint(y);
  if (yb != __float_as_uint(narrow_rn(nextafterf(r, -INFINITY), fmt)) ||
      yb != __float_as_uint(narrow_rn(nextafterf(r, INFINITY), fmt))) {
    return false;
  }
  *out = y;
  return true;
}

// GELU(x) (backward == false) or g * GELU'(x) rounded into fmt, when that is provably the
// series' output; false: the caller computes the series.
__device__ __forceinline__ bool gelu_erf_fast(double x, double g, bool backward, int fmt, float* out) {
  if (!(x >= -16.0 && x <= 16.0)) return false;  // NaN too
  const double P = ::normcdf(x);
  // the series' Phi = (1 - erf) / 2 for these x: an absolute error of erf's size
  const double cancel = (x < 0.0 && x > -4.25) ? 0x1p-44 : 0.0;
  double v, h;
  if (backward) {
    const double q = x * (::exp(-0.5 * x * x) * dm::kInvSqrt2Pi);
    v = g * (P + q);
    h = fabs(g) * ((P + fabs(q)) * 0x1p-40 + cancel);  // P + q cancels near x = -0.75: bound by the terms
  } else {
    v = x * P;
    h = fabs(v) * 0x1p-40 + fabs(x) * cancel;
  }
  const double a = fabs(v);
  if (!(a >= 0x1p-900 && a <= 0x1p+1000)) return false;  // zero, tiny, huge, NaN or inf g
  return round_interval(v - h, v + h, fmt, out);
}

}  // namespace ldet

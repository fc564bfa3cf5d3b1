// The Det norms' arithmetic (lightning_det/nn/norm.py states it), one header for the CPU and the
// CUDA kernels of norm_forward / norm_backward so the two cannot drift.
//
// Why fused ops: the same arithmetic as eager PyTorch ops around the exact row sums was ~24 ops a
// forward and ~18 a backward per norm (each a dispatch, an allocation, often a fill and a kernel
// launch), in a det_ddp step whose host time bounds it.
//
// Each step below is one IEEE fp32 (or the stated fp64) operation, written out so that nothing is
// contracted (the build passes -ffp-contract=off / -fmad=false) and nothing is reordered: the bytes
// are the eager version's.
#pragma once

#include <cmath>
#include <cstdint>

#include "detmath.h"
#include "longacc.h"
#include "window_acc.h"

namespace ldet {

// Adds one fp64 term (an exact product of two fp32 values, or an fp32 value) to a row's exact sum;
// `j` counts the terms added before it (the in-kernel normalization interval, longacc.h).
LDET_HD void norm_sum_add(WindowAcc& win, int64_t* acc, double v, int64_t j) {
  window_add(win, acc, v);
  if (((j + 1) & (LDET_NORM_INTERVAL - 1)) == 0) normalize(acc);
}

// round(exact sum) / W: the row mean of a sum's terms, an IEEE fp32 division by fp32(W).
LDET_HD float norm_mean(const int64_t* acc, float width) { return finalize_fp32(acc) / width; }

// rstd = fp32(1 / sqrt_fp64(fp64(var + eps))): fp32 add, exact widening, fp64 sqrt and division
// (both correctly rounded on every CPU and GPU), one rounding to fp32. Never rsqrt (approximate
// on CUDA).
LDET_HD float norm_rstd(float var, float eps) {
  const float t = var + eps;
  return float(1.0 / sqrt(double(t)));
}

// y = xhat (* weight) (+ bias), fp32, as two separate operations.
LDET_HD float norm_affine(float xhat, const float* weight, const float* bias, int64_t j) {
  float y = xhat;
  if (weight) y = y * weight[j];
  if (bias) y = y + bias[j];
  return y;
}

// The input gradient of one element: ((g - m1) - xhat * m2) * rstd (RMSNorm: (g - xhat * m2) * rstd),
// g = gy * weight already formed; the order is the eager version's: t = xhat * m2, g - m1, then (g - t) * rstd.
LDET_HD float norm_grad_input(float g, float xhat, float m1, float m2, float rstd, bool rms) {
  const float t = xhat * m2;
  const float gc = rms ? g : g - m1;
  return (gc - t) * rstd;
}

}  // namespace ldet

// The exact cross-entropy's per-row arithmetic (lightning_det/nn/loss.py states it), one header for
// the CPU and CUDA kernels of ce_forward / ce_backward so the two cannot drift.
//
// Why fused ops: the same steps as eager PyTorch ops (max, subtract, exp, row sums, gather,
// where, division, ...) were ~27 ops a step around the exact sums, each with its dispatch,
// allocation and launch, in a det_ddp step bound by its host time.
#pragma once

#include <cstdint>

#include "detmath.h"
#include "longacc.h"

namespace ldet {

// The running row maximum, NaN propagating as torch.amax (a NaN, once met, stays).
LDET_HD float ce_max(float m, float v) { return (v > m || v != v) ? v : m; }

// e_j = fp32(exp_fp64(x_j - m)): the fp32 subtract, detmath.h's exp, one rounding (det_exp's bytes).
LDET_HD float ce_exp_term(float x, float m) { return float(act_forward(double(x - m), kActExp)); }

// A row's loss from its exact digits of sum_j e_j (canonical; consumed): S = round(sum) for the
// gradient, T = round(sum - 1), loss = ce_row_loss(m, x_t, T) (detmath.h). *s receives S.
LDET_HD float ce_row_finish(int64_t* acc, float m, float picked, float* s) {
  *s = finalize_fp32(acc);
  add_double(acc, -1.0);  // exact: the sum minus one, then its own one rounding
  normalize(acc);
  return ce_row_loss(m, picked, finalize_fp32(acc));
}

// One element of the input gradient: (e / S - [j == t]) * g, fp32 IEEE division, subtract, multiply.
LDET_HD float ce_grad(float e, float s, bool is_target, float g) {
  const float p = e / s;
  return (is_target ? p - 1.0f : p) * g;
}

}  // namespace ldet

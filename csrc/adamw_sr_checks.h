// Argument checks shared by the CPU and CUDA implementations of the AdamWSR ops, so both
// devices reject the same inputs with the same messages.
#pragma once

#include <ATen/ATen.h>

#include "check.h"
#include "adamw_sr.h"

namespace ldet {

inline void check_adamw_sr_args(const at::Tensor& param, const at::Tensor& grad,
                                const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                                int64_t base_index) {
  LDET_CHECK(param.scalar_type() == at::kFloat || param.scalar_type() == at::kBFloat16,
              "adamw_sr_step: param must be float32 or bfloat16, got ", param.scalar_type());
  LDET_CHECK(grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kBFloat16,
              "adamw_sr_step: grad must be float32 or bfloat16, got ", grad.scalar_type());
  LDET_CHECK(exp_avg.scalar_type() == at::kFloat && exp_avg_sq.scalar_type() == at::kFloat,
              "adamw_sr_step: exp_avg and exp_avg_sq must be float32, got ",
              exp_avg.scalar_type(), " and ", exp_avg_sq.scalar_type());
  LDET_CHECK(!grad.is_sparse(), "adamw_sr_step: sparse gradients are not supported");
  const int64_t n = param.numel();
  LDET_CHECK(grad.numel() == n && exp_avg.numel() == n && exp_avg_sq.numel() == n,
              "adamw_sr_step: grad, exp_avg and exp_avg_sq must have param's ", n,
              " elements, got ", grad.numel(), ", ", exp_avg.numel(), ", ", exp_avg_sq.numel());
  LDET_CHECK(param.is_contiguous() && grad.is_contiguous() && exp_avg.is_contiguous() &&
                  exp_avg_sq.is_contiguous(),
              "adamw_sr_step: param, grad, exp_avg and exp_avg_sq must be contiguous (the "
              "Philox index of an element is its offset in memory order)");
  LDET_CHECK(grad.device() == param.device() && exp_avg.device() == param.device() &&
                  exp_avg_sq.device() == param.device(),
              "adamw_sr_step: grad, exp_avg and exp_avg_sq must be on param's device ",
              param.device());
  LDET_CHECK(base_index >= 0 && base_index <= INT64_MAX - n,
              "adamw_sr_step: base_index must be in [0, 2^63 - numel], got ", base_index);
}

inline AdamWScalars make_scalars(double decay, double beta1, double one_minus_beta1, double beta2,
                                 double one_minus_beta2, double step_size, double bc2_sqrt,
                                 double eps) {
  // double -> float rounds to nearest even on every host compiler we build with.
  return AdamWScalars{static_cast<float>(decay),           static_cast<float>(beta1),
                      static_cast<float>(one_minus_beta1), static_cast<float>(beta2),
                      static_cast<float>(one_minus_beta2), static_cast<float>(step_size),
                      static_cast<float>(bc2_sqrt),        static_cast<float>(eps)};
}

// The kernels' view of one adamw_sr_step call: fp32 scalars and the 64-bit Philox inputs.
struct AdamWLaunch {
  AdamWScalars s;
  uint64_t seed, step, base;
  bool param_fp32, grad_fp32;
};

inline AdamWLaunch prepare_adamw_sr(const at::Tensor& param, const at::Tensor& grad,
                                    const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                                    double decay, double beta1, double one_minus_beta1,
                                    double beta2, double one_minus_beta2, double step_size,
                                    double bc2_sqrt, double eps, int64_t seed, int64_t step,
                                    int64_t base_index) {
  check_adamw_sr_args(param, grad, exp_avg, exp_avg_sq, base_index);
  return AdamWLaunch{make_scalars(decay, beta1, one_minus_beta1, beta2, one_minus_beta2,
                                  step_size, bc2_sqrt, eps),
                     static_cast<uint64_t>(seed), static_cast<uint64_t>(step),
                     static_cast<uint64_t>(base_index), param.scalar_type() == at::kFloat,
                     grad.scalar_type() == at::kFloat};
}

inline void check_sr_round_args(const at::Tensor& x, int64_t base_index) {
  LDET_CHECK(x.scalar_type() == at::kFloat, "sr_round_bf16: x must be float32, got ",
              x.scalar_type());
  LDET_CHECK(base_index >= 0 && base_index <= INT64_MAX - x.numel(),
              "sr_round_bf16: base_index must be in [0, 2^63 - numel], got ", base_index);
}

}  // namespace ldet

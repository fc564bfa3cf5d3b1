// Argument checks of norm_forward / norm_backward (schemas: csrc/schema/norm.cpp), shared by the
// CPU and CUDA implementations.
#pragma once

#include "check.h"
#include "op_checks.h"

namespace ldet {

// weight / bias: undefined, or a (W,) float32 tensor on x's device.
inline void check_norm_param(const c10::optional<at::Tensor>& p, const char* name, const at::Tensor& x) {
  if (!p.has_value()) return;
  LDET_CHECK(p->scalar_type() == at::kFloat, name, ": expected float32, got ", p->scalar_type());
  LDET_CHECK(p->dim() == 1 && p->size(0) == x.size(1), name, ": expected shape (", x.size(1), ",), got ", p->sizes());
  LDET_CHECK(p->device() == x.device(), name, ": expected device ", x.device(), " like the rows, got ", p->device());
}

inline void check_norm_forward_args(const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                                    const c10::optional<at::Tensor>& bias) {
  check_float_input(x, "x");
  LDET_CHECK(x.dim() == 2, "x: expected a 2-D (R, W) tensor, got shape ", x.sizes());
  check_norm_param(weight, "weight", x);
  check_norm_param(bias, "bias", x);
}

inline void check_norm_backward_args(const at::Tensor& gy, const at::Tensor& xhat, const at::Tensor& rstd,
                                     const c10::optional<at::Tensor>& weight) {
  check_float_input(gy, "gy");
  LDET_CHECK(gy.dim() == 2, "gy: expected a 2-D (R, W) tensor, got shape ", gy.sizes());
  LDET_CHECK(xhat.scalar_type() == at::kFloat && xhat.sizes() == gy.sizes() && xhat.device() == gy.device(),
              "xhat: expected float32 of shape ", gy.sizes(), " on ", gy.device(), " like gy, got ", xhat.scalar_type(),
              " of shape ", xhat.sizes(), " on ", xhat.device());
  LDET_CHECK(rstd.scalar_type() == at::kFloat && rstd.dim() == 1 && rstd.size(0) == gy.size(0) &&
                  rstd.device() == gy.device(),
              "rstd: expected float32 of shape (", gy.size(0), ",) on ", gy.device(), ", got ", rstd.scalar_type(),
              " of shape ", rstd.sizes(), " on ", rstd.device());
  check_norm_param(weight, "weight", gy);
}

}  // namespace ldet

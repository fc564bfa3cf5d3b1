// Argument checks of the detmath ops, shared by the CPU and CUDA implementations.
#pragma once

#include "check.h"
#include "op_checks.h"

namespace ldet {

inline void check_act_kind(int64_t kind) {
  LDET_CHECK(kind >= 0 && kind <= 7,
              "kind: expected 0 (gelu erf), 1 (gelu tanh), 2 (silu), 3 (tanh), 4 (exp), 5 (sin), 6 (cos) or 7 "
              "(sigmoid), got ", kind);
}

// act_fp64's arguments: float64 x, and grad (optional) of x's shape and device.
inline void check_act_fp64_args(const at::Tensor& x, const c10::optional<at::Tensor>& grad) {
  LDET_CHECK(x.scalar_type() == at::kDouble, "x: expected float64, got ", x.scalar_type());
  if (grad.has_value()) {
    LDET_CHECK(grad->scalar_type() == at::kDouble, "grad: expected float64, got ", grad->scalar_type());
    LDET_CHECK(grad->sizes() == x.sizes(), "grad: expected shape ", x.sizes(), " like x, got ", grad->sizes());
    LDET_CHECK(grad->device() == x.device(), "grad: expected device ", x.device(), " like x, got ", grad->device());
  }
}

inline void check_dot_args(const at::Tensor& a, const c10::optional<at::Tensor>& b) {
  check_float_input(a, "a");
  LDET_CHECK(a.dim() == 2, "a: expected a 2-D (R, W) tensor, got shape ", a.sizes());
  if (b.has_value()) {
    check_float_input(*b, "b");
    LDET_CHECK(b->sizes() == a.sizes(), "b: expected shape ", a.sizes(), " like a, got ", b->sizes());
    LDET_CHECK(b->device() == a.device(), "b: expected device ", a.device(), " like a, got ", b->device());
  }
}

// m, picked, t_minus of ce_row_loss: fp32 vectors of one length on one device.
inline void check_ce_row_arg(const at::Tensor& t, const char* name, const at::Tensor& m) {
  LDET_CHECK(t.scalar_type() == at::kFloat && t.dim() == 1, name, ": expected a 1-D float32 tensor, got ",
              t.scalar_type(), " of shape ", t.sizes());
  LDET_CHECK(t.sizes() == m.sizes() && t.device() == m.device(), name, ": expected shape ", m.sizes(), " on ",
              m.device(), " like m, got ", t.sizes(), " on ", t.device());
}

inline void check_ce_row_args(const at::Tensor& m, const at::Tensor& picked, const at::Tensor& t_minus) {
  check_ce_row_arg(m, "m", m);
  check_ce_row_arg(picked, "picked", m);
  check_ce_row_arg(t_minus, "t_minus", m);
}

}  // namespace ldet

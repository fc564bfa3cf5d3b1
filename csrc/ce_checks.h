// Argument checks of ce_forward / ce_backward (schemas: csrc/schema/cross_entropy.cpp), shared by
// the CPU and CUDA implementations.
#pragma once

#include "check.h"
#include "op_checks.h"

namespace ldet {

// target (N,) int64 and valid (N,) bool on `like`'s device, N = like.size(0).
inline void check_ce_rows(const at::Tensor& target, const at::Tensor& valid, const at::Tensor& like) {
  const int64_t n = like.size(0);
  LDET_CHECK(target.scalar_type() == at::kLong && target.dim() == 1 && target.size(0) == n &&
                  target.device() == like.device(),
              "target: expected int64 of shape (", n, ",) on ", like.device(), ", got ", target.scalar_type(),
              " of shape ", target.sizes(), " on ", target.device());
  LDET_CHECK(valid.scalar_type() == at::kBool && valid.dim() == 1 && valid.size(0) == n &&
                  valid.device() == like.device(),
              "valid: expected bool of shape (", n, ",) on ", like.device(), ", got ", valid.scalar_type(),
              " of shape ", valid.sizes(), " on ", valid.device());
}

inline void check_ce_forward_args(const at::Tensor& x, const at::Tensor& target, const at::Tensor& valid) {
  check_float_input(x, "x");
  LDET_CHECK(x.dim() == 2 && x.size(1) >= 1, "x: expected a 2-D (N, C) tensor with C >= 1, got shape ", x.sizes());
  check_ce_rows(target, valid, x);
}

inline void check_ce_backward_args(const at::Tensor& e, const at::Tensor& s, const at::Tensor& target,
                                   const at::Tensor& valid, const at::Tensor& grad) {
  LDET_CHECK(e.scalar_type() == at::kFloat && e.dim() == 2, "e: expected a 2-D float32 tensor, got ",
              e.scalar_type(), " of shape ", e.sizes());
  LDET_CHECK(s.scalar_type() == at::kFloat && s.dim() == 1 && s.size(0) == e.size(0) && s.device() == e.device(),
              "s: expected float32 of shape (", e.size(0), ",) on ", e.device(), ", got ", s.scalar_type(),
              " of shape ", s.sizes(), " on ", s.device());
  check_ce_rows(target, valid, e);
  check_float_input(grad, "grad");
  LDET_CHECK(grad.dim() == 1 && grad.size(0) == e.size(0) && grad.device() == e.device(), "grad: expected shape (",
              e.size(0), ",) on ", e.device(), ", got ", grad.sizes(), " on ", grad.device());
}

}  // namespace ldet

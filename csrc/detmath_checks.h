// Argument checks of the detmath ops, shared by the CPU and CUDA implementations.
#pragma once

#include "op_checks.h"

namespace ldet {

inline void check_act_kind(int64_t kind) {
  TORCH_CHECK(kind >= 0 && kind <= 4,
              "kind: expected 0 (gelu erf), 1 (gelu tanh), 2 (silu), 3 (tanh) or 4 (exp), got ",
              kind);
}

inline void check_dot_args(const at::Tensor& a, const c10::optional<at::Tensor>& b) {
  check_float_input(a, "a");
  TORCH_CHECK(a.dim() == 2, "a: expected a 2-D (R, W) tensor, got shape ", a.sizes());
  if (b.has_value()) {
    check_float_input(*b, "b");
    TORCH_CHECK(b->sizes() == a.sizes(), "b: expected shape ", a.sizes(), " like a, got ", b->sizes());
    TORCH_CHECK(b->device() == a.device(), "b: expected device ", a.device(), " like a, got ", b->device());
  }
}

}  // namespace ldet

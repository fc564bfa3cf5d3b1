// Argument checks and dtype mapping shared by the CPU and CUDA op implementations.
#pragma once

#include <ATen/ATen.h>

#include "check.h"
#include "longacc.h"

namespace ldet {

inline void check_acc(const at::Tensor& acc, const char* name) {
  LDET_CHECK(acc.scalar_type() == at::kLong, name, ": expected an int64 long accumulator, got ",
              acc.scalar_type());
  LDET_CHECK(acc.dim() >= 1 && acc.size(-1) == LDET_WORDS, name,
              ": expected a trailing digit dimension of ", LDET_WORDS, ", got shape ", acc.sizes());
}

inline void check_float_input(const at::Tensor& t, const char* name) {
  const auto st = t.scalar_type();
  LDET_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, name,
              ": expected float32, bfloat16 or float16, got ", st);
}

// The OutFormat code (longacc.h) of an output dtype.
inline int out_format(at::ScalarType dt) {
  if (dt == at::kBFloat16) return kFmtBF16;
  if (dt == at::kHalf) return kFmtF16;
  LDET_CHECK(dt == at::kFloat, "dtype: expected torch.float32, torch.bfloat16 or torch.float16, got ", dt);
  return kFmtF32;
}

// scatter_sum's arguments (schema: csrc/schema/digits.cpp); the index range is checked by each
// device (the CPU directly, CUDA with a device-side assert: no host synchronization).
inline void check_scatter_sum_args(const at::Tensor& a, const at::Tensor& index, int64_t n_out) {
  check_float_input(a, "a");
  LDET_CHECK(a.dim() == 2, "a: expected a 2-D (rows, width) tensor, got shape ", a.sizes());
  LDET_CHECK(index.scalar_type() == at::kLong && index.dim() == 1 && index.size(0) == a.size(0),
              "index: expected a 1-D int64 tensor of ", a.size(0), " row indices, got ", index.scalar_type(), " of shape ",
              index.sizes());
  LDET_CHECK(index.device() == a.device(), "index: expected device ", a.device(), " like a, got ", index.device());
  LDET_CHECK(n_out >= 0, "n_out: expected a count >= 0, got ", n_out);
  // every output receives at most one accumulator per block of rows (csrc/cuda/digits_cuda.cu):
  // inside the status counters' 2^21 additions for any count of rows this bound allows
  LDET_CHECK(a.size(0) < (int64_t(1) << 40), "a: expected fewer than 2^40 rows, got ", a.size(0));
}

inline void check_scale_exp(int64_t scale_exp) {
  LDET_CHECK(scale_exp <= 0 && scale_exp >= -64, "scale_exp: expected an integer in [-64, 0], got ", scale_exp);
}

inline void check_gemm_args(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  check_float_input(x, "x");
  check_float_input(w, "w");
  LDET_CHECK(x.dim() == 2, "x: expected a 2-D (M, K) tensor, got shape ", x.sizes());
  LDET_CHECK(w.dim() == 2, "w: expected a 2-D (N, K) tensor, got shape ", w.sizes());
  LDET_CHECK(x.size(1) == w.size(1), "w: expected K = ", x.size(1), " columns to match x, got shape ",
              w.sizes());
  if (bias.has_value()) {
    check_float_input(*bias, "bias");
    LDET_CHECK(bias->dim() == 1 && bias->size(0) == w.size(0), "bias: expected shape (", w.size(0),
                ",), got ", bias->sizes());
  }
}

// gemm_batched's operands: x (B, M, K) and w (B, N, K) of one float dtype each, one device.
inline void check_gemm_batched_args(const at::Tensor& x, const at::Tensor& w) {
  check_float_input(x, "x");
  check_float_input(w, "w");
  LDET_CHECK(x.dim() == 3, "x: expected a 3-D (B, M, K) tensor, got shape ", x.sizes());
  LDET_CHECK(w.dim() == 3, "w: expected a 3-D (B, N, K) tensor, got shape ", w.sizes());
  LDET_CHECK(x.size(0) == w.size(0) && x.size(2) == w.size(2), "w: expected (B, N, K) with B = ", x.size(0),
              " and K = ", x.size(2), " to match x, got shape ", w.sizes());
  LDET_CHECK(x.device() == w.device(), "w: expected device ", x.device(), " to match x, got ", w.device());
}

}  // namespace ldet

// Small helpers shared by the CPU implementations.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "longacc.h"

namespace ldet {

inline void check_acc(const at::Tensor& acc, const char* name) {
  TORCH_CHECK(acc.scalar_type() == at::kLong, name, ": expected an int64 long accumulator, got ",
              acc.scalar_type());
  TORCH_CHECK(acc.dim() >= 1 && acc.size(-1) == LDET_WORDS, name,
              ": expected a trailing digit dimension of ", LDET_WORDS, ", got shape ", acc.sizes());
}

inline void check_float_input(const at::Tensor& t, const char* name) {
  const auto st = t.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, name,
              ": expected float32, bfloat16 or float16, got ", st);
}

// Finalizes one canonical accumulator into the requested floating dtype, as an fp32 value
// (bf16/fp16 results are exactly representable in fp32, so the cast afterwards is exact).
LDET_HD float finalize_as(const int64_t* acc, at::ScalarType dt) {
  if (dt == at::kBFloat16) return finalize_bf16_as_fp32(acc);
  if (dt == at::kHalf) return finalize_fp16_as_fp32(acc);
  return finalize_fp32(acc);
}

// Stores a value rounded by finalize_as into element i of a float32/bfloat16/float16 buffer.
inline void store_as(void* out, int64_t i, float v, at::ScalarType dt) {
  if (dt == at::kBFloat16) {
    static_cast<uint16_t*>(out)[i] = bf16_bits_exact(v);
  } else if (dt == at::kHalf) {
    static_cast<uint16_t*>(out)[i] = fp16_bits_exact(v);
  } else {
    static_cast<float*>(out)[i] = v;
  }
}

}  // namespace ldet

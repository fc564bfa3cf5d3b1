// int8 x int8 -> int32 GEMMs through cuBLASLt with each shape's algorithm chosen once and cached.
#pragma once

#include <ATen/ATen.h>

namespace ldet {

// out (M, N) int32 contiguous = a (M, K) . b (N, K)^T, a and b int8 row-major views (unit column
// stride, any row stride). Exact: int32 accumulation with no narrower intermediate (the caller
// bounds K so no sum can overflow). LIGHTNING_DET_INT8_GEMM=torch routes through at::_int_mm_out
// instead (benchmarks compare the two).
void int8_gemm_lt(at::Tensor& out, const at::Tensor& a, const at::Tensor& b);

}  // namespace ldet

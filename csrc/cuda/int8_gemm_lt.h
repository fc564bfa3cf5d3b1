// int8 x int8 -> int32 GEMMs through cuBLASLt with each shape's algorithm chosen once and cached.
#pragma once

#include <ATen/ATen.h>

#include "int_slices_host.h"

namespace ldet {

// g.c (m, n) int32 = g.a (m, k) . g.b (n, k)^T on `device` (Int8Gemm: raw int8 row-major operands,
// unit column stride, any row stride). Exact: int32 accumulation with no narrower intermediate
// (the caller bounds k so no sum can overflow). LIGHTNING_DET_INT8_GEMM=torch routes through
// at::_int_mm_out instead (benchmarks compare the two).
void int8_gemm_lt(const Int8Gemm& g, const at::Device& device);

}  // namespace ldet

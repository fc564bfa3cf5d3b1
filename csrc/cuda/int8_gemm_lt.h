// int8 x int8 -> int32 and fp64 GEMMs through cuBLASLt with each shape's algorithm chosen once and
// cached.
#pragma once

#include <ATen/ATen.h>

#include "int_slices_host.h"

namespace ldet {

// g.c (m, n) int32 = g.a (m, k) . g.b (n, k)^T on `device` (Int8Gemm: raw int8 row-major operands,
// unit column stride, any row stride). Exact: int32 accumulation with no narrower intermediate
// (the caller bounds k so no sum can overflow). LIGHTNING_DET_INT8_GEMM=torch routes through
// at::_int_mm_out instead (benchmarks compare the two).
void int8_gemm_lt(const Int8Gemm& g, const at::Device& device);

// c (m, n) fp64 row-major with row stride ldc = a (m, k) . b (n, k)^T in native IEEE fp64
// (CUBLAS_COMPUTE_64F), a and b each row-major (a_rows: element (i, j) at a[i * lda + j]) or
// column-major (a[i + j * lda]). The fp64 route's GEMM (csrc/fp64_bound_host.h).
struct Fp64Gemm {
  const double* a;
  bool a_rows;
  int64_t lda;
  const double* b;
  bool b_rows;
  int64_t ldb;
  double* c;
  int64_t ldc;
  int64_t m, n, k;
};
void fp64_gemm_lt(const Fp64Gemm& g, const at::Device& device);

}  // namespace ldet

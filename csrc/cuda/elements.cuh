// Element access shared by the CUDA kernels that read fp32 / bf16 / fp16 inputs as fp64.
#pragma once

#include <ATen/ATen.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace ldet {

// Exact widening of one element (every fp32, bf16 and fp16 value is an fp64 value).
__device__ __forceinline__ double wide(const float* p, int64_t i) { return double(p[i]); }
__device__ __forceinline__ double wide(const __nv_bfloat16* p, int64_t i) { return double(__bfloat162float(p[i])); }
__device__ __forceinline__ double wide(const __half* p, int64_t i) { return double(__half2float(p[i])); }

// Calls f(T*) with ``t``'s data as its element type (float, bfloat16 or half).
template <typename F>
void with_elements(const at::Tensor& t, F&& f) {
  switch (t.scalar_type()) {
    case at::kFloat:
      f(t.data_ptr<float>());
      break;
    case at::kBFloat16:
      f(reinterpret_cast<const __nv_bfloat16*>(t.data_ptr()));
      break;
    default:
      f(reinterpret_cast<const __half*>(t.data_ptr()));
      break;
  }
}

}  // namespace ldet

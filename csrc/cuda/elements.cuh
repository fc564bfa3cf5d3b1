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

// An element's fp32 bit pattern (every bf16 and fp16 value is an fp32 value: bf16 is its upper
// half, fp16 widens exactly). The slicing kernels work on it with 32-bit integer operations:
// the GPU converts to and from fp64 at a quarter of its integer rate.
__device__ __forceinline__ uint32_t f32_bits(float v) { return __float_as_uint(v); }
__device__ __forceinline__ uint32_t f32_bits(__nv_bfloat16 v) { return uint32_t(__bfloat16_as_ushort(v)) << 16; }
__device__ __forceinline__ uint32_t f32_bits(__half v) { return __float_as_uint(__half2float(v)); }

// |v| = m 2^e for the finite fp32 pattern u (m < 2^24; m == 0 for a zero).
struct F32Parts {
  uint32_t m;
  int e;
  bool neg;
};
__device__ __forceinline__ F32Parts f32_parts(uint32_t u) {
  const int E = int((u >> 23) & 0xff);
  const uint32_t f = u & 0x7fffffu;
  return {E == 0 ? f : f | 0x800000u, E == 0 ? -149 : E - 150, (u >> 31) != 0};
}
__device__ __forceinline__ bool f32_finite(uint32_t u) { return (u & 0x7f800000u) != 0x7f800000u; }

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

// The AdamWSR __global__ kernels, header-only and free of torch headers so that
// tests/csrc/adamw_sr_kernels_check.cu can compile (and run, on a GPU) them with nvcc alone.
#pragma once

#include <cstdint>

#include "adamw_sr.h"

namespace ldet {

// 8 consecutive elements through 16-byte vector loads/stores: 8 bf16 = one 16-byte access,
// 8 fp32 = two. Only the memory access differs from the scalar path; the arithmetic is the
// same adamw_sr_block, run on registers.
template <typename T>
__device__ __forceinline__ void copy8(T* dst, const T* src) {
  constexpr int kVec = 16 / sizeof(T);
#pragma unroll
  for (int j = 0; j < 8; j += kVec) {
    *reinterpret_cast<uint4*>(dst + j) = *reinterpret_cast<const uint4*>(src + j);
  }
}
__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// Grid-stride loop over the tensor's Philox blocks: f(lo, hi) for each block's local range.
template <typename F>
__device__ __forceinline__ void for_each_philox_block(int64_t n, int64_t nblk, uint64_t base,
                                                      F&& f) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < nblk;
       t += stride) {
    int64_t lo, hi;
    philox_block_range(t, base, n, &lo, &hi);
    f(lo, hi);
  }
}

template <typename ParamT, typename GradT>
__global__ void adamw_sr_kernel(ParamT* __restrict__ param, const GradT* __restrict__ grad,
                                float* __restrict__ m, float* __restrict__ v, int64_t n,
                                int64_t nblk, AdamWScalars s, uint64_t seed, uint64_t step,
                                uint64_t base) {
  for_each_philox_block(n, nblk, base, [&](int64_t lo, int64_t hi) {
    if (hi - lo == 8 && aligned16(param + lo) && aligned16(grad + lo) && aligned16(m + lo) &&
        aligned16(v + lo)) {
      alignas(16) ParamT pr[8];
      alignas(16) GradT gr[8];
      alignas(16) float mr[8], vr[8];
      copy8(pr, param + lo);
      copy8(gr, grad + lo);
      copy8(mr, m + lo);
      copy8(vr, v + lo);
      adamw_sr_block<ParamT, GradT>(pr, gr, mr, vr, 0, 8, s, seed, step,
                                    base + static_cast<uint64_t>(lo));
      copy8(param + lo, pr);
      copy8(m + lo, mr);
      copy8(v + lo, vr);
    } else {
      adamw_sr_block<ParamT, GradT>(param, grad, m, v, lo, hi, s, seed, step, base);
    }
  });
}

__global__ void sr_round_kernel(const float* __restrict__ x, uint16_t* __restrict__ out,
                                int64_t n, int64_t nblk, uint64_t seed, uint64_t step,
                                uint64_t base) {
  for_each_philox_block(n, nblk, base, [&](int64_t lo, int64_t hi) {
    sr_round_block(x, out, lo, hi, seed, step, base);
  });
}

}  // namespace ldet

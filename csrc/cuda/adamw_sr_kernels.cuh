// The AdamWSR __global__ kernels, header-only and free of torch headers so that
// tests/csrc/adamw_sr_kernels_check.cu can compile (and run, on a GPU) them with nvcc alone.
#pragma once

#include <cstdint>

#include "adamw_sr.h"

namespace ldet {

template <typename ParamT, typename GradT>
__global__ void adamw_sr_kernel(ParamT* __restrict__ param, const GradT* __restrict__ grad,
                                float* __restrict__ m, float* __restrict__ v, int64_t n,
                                int64_t nblk, AdamWScalars s, uint64_t seed, uint64_t step,
                                uint64_t base) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < nblk;
       t += stride) {
    int64_t lo, hi;
    philox_block_range(t, base, n, &lo, &hi);
    adamw_sr_block<ParamT, GradT>(param, grad, m, v, lo, hi, s, seed, step, base);
  }
}

__global__ void sr_round_kernel(const float* __restrict__ x, uint16_t* __restrict__ out,
                                int64_t n, int64_t nblk, uint64_t seed, uint64_t step,
                                uint64_t base) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < nblk;
       t += stride) {
    int64_t lo, hi;
    philox_block_range(t, base, n, &lo, &hi);
    sr_round_block(x, out, lo, hi, seed, step, base);
  }
}

}  // namespace ldet

// Standalone check of the AdamWSR device code, without torch:
//   nvcc -std=c++17 -fmad=false -I csrc tests/csrc/adamw_sr_kernels_check.cu -o /tmp/k && /tmp/k
// Compiles the __global__ kernels (syntax check on machines with no GPU) and, where a GPU is
// present, compares the device result bitwise with the host path of the same header.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <vector>

#include "cuda/adamw_sr_kernels.cuh"

template <typename ParamT, typename GradT>
void instantiate() {
  ldet::adamw_sr_kernel<ParamT, GradT><<<1, 1>>>(nullptr, nullptr, nullptr, nullptr, 0, 0,
                                                 ldet::AdamWScalars{}, 0, 0, 0);
}
template void instantiate<float, float>();
template void instantiate<float, uint16_t>();
template void instantiate<uint16_t, float>();
template void instantiate<uint16_t, uint16_t>();

// base % 8 == 0 exercises the vector-load path, base % 8 != 0 the scalar one.
bool check(uint64_t base) {
  const int64_t n = 100003;
  const uint64_t seed = 0x123456789abcdefULL, step = 7;
  ldet::AdamWScalars s{0.99999f, 0.9f, 0.1f, 0.999f, 0.001f, 1e-3f, 0.5f, 1e-8f};
  std::vector<uint16_t> p(n), g(n);
  std::vector<float> m(n), v(n);
  uint32_t x = 12345;
  for (int64_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    p[i] = static_cast<uint16_t>(0x3f80u + (x >> 25));
    g[i] = static_cast<uint16_t>(0x3a00u + ((x >> 9) & 0x3ff) + ((x & 1) << 15));
    m[i] = 1e-3f * static_cast<float>((x >> 12) & 0xff);
    v[i] = 1e-6f * static_cast<float>((x >> 4) & 0xff);
  }
  uint16_t *dp, *dg;
  float *dm, *dv;
  cudaMalloc(&dp, n * 2); cudaMalloc(&dg, n * 2); cudaMalloc(&dm, n * 4); cudaMalloc(&dv, n * 4);
  cudaMemcpy(dp, p.data(), n * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dg, g.data(), n * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dm, m.data(), n * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(dv, v.data(), n * 4, cudaMemcpyHostToDevice);
  const int64_t nblk = ldet::num_philox_blocks(base, n);
  ldet::adamw_sr_kernel<uint16_t, uint16_t><<<7, 128>>>(dp, dg, dm, dv, n, nblk, s, seed, step, base);
  for (int64_t t = 0; t < nblk; ++t) {
    int64_t lo, hi;
    ldet::philox_block_range(t, base, n, &lo, &hi);
    ldet::adamw_sr_block<uint16_t, uint16_t>(p.data(), g.data(), m.data(), v.data(), lo, hi, s,
                                             seed, step, base);
  }
  std::vector<uint16_t> p2(n);
  std::vector<float> m2(n), v2(n);
  cudaMemcpy(p2.data(), dp, n * 2, cudaMemcpyDeviceToHost);
  cudaMemcpy(m2.data(), dm, n * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(v2.data(), dv, n * 4, cudaMemcpyDeviceToHost);
  const bool same = std::memcmp(p.data(), p2.data(), n * 2) == 0 &&
                    std::memcmp(m.data(), m2.data(), n * 4) == 0 &&
                    std::memcmp(v.data(), v2.data(), n * 4) == 0;
  std::printf("base %llu: device vs host: %s\n", static_cast<unsigned long long>(base),
              same ? "bitwise equal" : "DIFFERENT");
  cudaFree(dp); cudaFree(dg); cudaFree(dm); cudaFree(dv);
  return same;
}

int main() {
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    std::printf("compiled; no GPU, nothing run\n");
    return 0;
  }
  const bool ok = check(5) && check(0) && check(1024);
  return ok ? 0 : 1;
}

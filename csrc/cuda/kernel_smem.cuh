// Dynamic shared memory of a kernel launch, set up once per (device, kernel): shared by the
// CUDA files whose kernels take more than the default 48 KB.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <utility>

namespace ldet {

// The shared-memory facts a launch needs never change for a (device, kernel), but querying
// them costs host time on every call (cudaDeviceGetAttribute, cudaFuncGetAttributes,
// cudaFuncSetAttribute): each is asked or set once per process and remembered here.
struct KernelSmem {
  size_t static_bytes = 0;  // the kernel's static shared memory
  size_t dyn_limit = 0;     // the dynamic limit already set for it on this device
};

inline std::mutex& smem_cache_mutex() {
  static std::mutex m;
  return m;
}

inline int optin_smem_bytes(int dev) {  // caller holds smem_cache_mutex()
  static std::map<int, int> optin;
  auto it = optin.find(dev);
  if (it == optin.end()) {
    int bytes = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    it = optin.emplace(dev, bytes).first;
  }
  return it->second;
}

inline KernelSmem& kernel_smem(int dev, const void* kernel) {  // caller holds smem_cache_mutex()
  static std::map<std::pair<int, const void*>, KernelSmem> cache;
  auto it = cache.find({dev, kernel});
  if (it == cache.end()) {
    cudaFuncAttributes attr;
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
    KernelSmem k;
    k.static_bytes = attr.sharedSizeBytes;
    it = cache.emplace(std::make_pair(dev, kernel), k).first;
  }
  return it->second;
}

// True when ``kernel`` with ``dyn_bytes`` of dynamic shared memory fits this device's opt-in
// limit; then its dynamic limit is set (once) so the launch may use them.
template <typename Kernel>
bool prepare_smem(int dev, Kernel kernel, size_t dyn_bytes, int* optin_out) {
  std::lock_guard<std::mutex> lock(smem_cache_mutex());
  const int optin = optin_smem_bytes(dev);
  *optin_out = optin;
  KernelSmem& k = kernel_smem(dev, reinterpret_cast<const void*>(kernel));
  if (k.static_bytes + dyn_bytes > size_t(optin)) return false;
  if (k.dyn_limit < dyn_bytes) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(dyn_bytes)));
    k.dyn_limit = dyn_bytes;
  }
  return true;
}

}  // namespace ldet

// Schemas of the exact GEMM ops. Implementations: csrc/cpu/gemm_cpu.cpp, csrc/cuda/gemm_cuda.cu.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(ldet, m) {
  // x (M, K), w (N, K), bias (N,) or None; each fp32, bf16 or fp16 (mixing is fine: every
  // product is exact in fp64 either way); all on one device.
  // Returns canonical digits (M, N, 19) int64 of sum_k x[m,k] * w[n,k] (+ bias[n]), exactly.
  // norm_interval: digit additions between normalizations; 0 = the production bound. Tests
  // lower it to force the normalization path (the result must not change).
  m.def("gemm_partial(Tensor x, Tensor w, Tensor? bias=None, int norm_interval=0) -> Tensor");
  // The same exact sum rounded once, to nearest-even, straight to out_dtype (default float32;
  // bfloat16 / float16 are never rounded through fp32 first): (M, N).
  m.def("gemm(Tensor x, Tensor w, Tensor? bias=None, ScalarType? out_dtype=None) -> Tensor");
}

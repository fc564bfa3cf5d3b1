// Schemas of the exact GEMM ops. Implementations: csrc/cpu/gemm_cpu.cpp, csrc/cuda/gemm_cuda.cu.
#include <torch/library.h>

#include <array>
#include <atomic>
#include <vector>

#include "int_slices_host.h"

namespace ldet {
namespace {
std::atomic<int> g_gemm_path{kPathAuto};

// Sets the route every gemm / gemm_partial takes from now on (0 auto, 1 the long-accumulator
// kernel only, 2 the integer slices wherever they apply); returns the previous one. Every route
// gives the same bytes: the switch exists for tests and benchmarks.
int64_t set_gemm_path(int64_t path) {
  TORCH_CHECK(path >= kPathAuto && path <= kPathSlices, "path: expected 0 (auto), 1 (kernel) or 2 (slices), got ", path);
  return g_gemm_path.exchange(int(path));
}
}  // namespace

int gemm_path() { return g_gemm_path.load(std::memory_order_relaxed); }

std::array<int64_t, 6>& last_slices_plan() {
  thread_local std::array<int64_t, 6> plan{};
  return plan;
}

namespace {
std::vector<int64_t> last_slices_plan_op() {
  const auto& p = last_slices_plan();
  return std::vector<int64_t>(p.begin(), p.end());
}
}  // namespace
}  // namespace ldet

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
  // Route switch for tests and benchmarks (csrc/int_slices_host.h): returns the previous route.
  m.def("set_gemm_path(int path) -> int", &ldet::set_gemm_path);
  // The last slices GEMM of this thread: [Sx, Sw, x residues, w residues, x rows and w rows left
  // to the kernel] (tests and benchmarks; zeros before any).
  m.def("last_slices_plan() -> int[]", &ldet::last_slices_plan_op);
}

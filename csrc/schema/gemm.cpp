// Schemas of the exact GEMM ops. Implementations: csrc/cpu/gemm_cpu.cpp, csrc/cuda/gemm_cuda.cu.
#include <torch/library.h>

#include <array>
#include <atomic>
#include <vector>

#include "fp64_bound_host.h"
#include "int_slices_host.h"

namespace ldet {
namespace {
std::atomic<int> g_gemm_path{kPathAuto};

// Sets the route every gemm / gemm_partial takes from now on (0 auto, 1 the long-accumulator
// kernel only, 2 the integer slices wherever they apply, 3 / 4 the slices with their diagonals /
// CRT remainders forced: int_slices_host.h; 5 the fp64 route for rounded outputs:
// fp64_bound_host.h); returns the previous one. Every route gives the same bytes: the switch
// exists for tests and benchmarks.
int64_t set_gemm_path(int64_t path) {
  TORCH_CHECK(path >= kPathAuto && path <= kPathFp64,
              "path: expected 0 (auto), 1 (kernel), 2 (slices), 3 (slices, diagonals), 4 (slices, CRT) or 5 (fp64), "
              "got ", path);
  return g_gemm_path.exchange(int(path));
}

}  // namespace

std::array<int64_t, 2> checked_plans(at::IntArrayRef plans) {
  TORCH_CHECK(plans.size() == 2, "plans: expected two integers, got ", plans.size());
  const int64_t sx = plans[0], sw = plans[1];
  const bool mode = (sx == sw) && (sx == -1 || sx == -2 || sx == 0);
  const bool fixed = sx >= 1 && sx <= kSliceMax && sw >= 1 && sw <= kSliceMax;
  TORCH_CHECK(mode || fixed, "plans: expected (-1, -1) the default, (-2, -2) cached guesses, (0, 0) no "
              "guess, or slice counts in [1, ", kSliceMax, "], got (", sx, ", ", sw, ")");
  return {sx, sw};
}

int gemm_path() { return g_gemm_path.load(std::memory_order_relaxed); }

std::array<int64_t, 7>& last_slices_plan() {
  thread_local std::array<int64_t, 7> plan{};
  return plan;
}

at::Tensor& last_fp64_counts() {
  thread_local at::Tensor counts;
  return counts;
}

namespace {
// A copy on the host (one synchronization: tests and benchmarks only); zeros before any call.
std::vector<int64_t> last_fp64_counts_op() {
  const at::Tensor& c = last_fp64_counts();
  if (!c.defined()) return {0, 0};
  const at::Tensor h = c.cpu();
  return {h[0].item<int64_t>(), h[1].item<int64_t>()};
}

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
  // plans: how the integer-slice route plans this call (csrc/int_slices_host.h, "Guessed plans"):
  // (-1, -1) the device's default, (-2, -2) cached guesses, (0, 0) from this call's summaries,
  // (Sx, Sw) that fixed guess. Every setting gives the same bytes.
  m.def("gemm_partial(Tensor x, Tensor w, Tensor? bias=None, int norm_interval=0, int[2] plans=[-1, -1]) -> Tensor");
  // The same exact sum rounded once, to nearest-even, straight to out_dtype (default float32;
  // bfloat16 / float16 are never rounded through fp32 first): (M, N).
  m.def("gemm(Tensor x, Tensor w, Tensor? bias=None, ScalarType? out_dtype=None, int[2] plans=[-1, -1]) -> Tensor");
  // Route switch for tests and benchmarks (csrc/int_slices_host.h): returns the previous route.
  m.def("set_gemm_path(int path) -> int", &ldet::set_gemm_path);
  // The last slices GEMM of this thread: [Sx, Sw, x residues, w residues, x rows and w rows left
  // to the kernel] (tests and benchmarks; zeros before any; -1 for counts a guessed plan did not
  // wait for).
  m.def("last_slices_plan() -> int[]", &ldet::last_slices_plan_op);
  // The last fp64-route GEMM of this thread (csrc/fp64_bound_host.h): [outputs its fp64 GEMM's
  // bound left undecided, of those the ones left to the long accumulator] (one synchronization).
  m.def("last_fp64_counts() -> int[]", &ldet::last_fp64_counts_op);
}

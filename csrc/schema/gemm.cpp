// Schemas of the exact GEMM ops. Implementations: csrc/cpu/gemm_cpu.cpp, csrc/cuda/gemm_cuda.cu.
#include <torch/library.h>

#include <array>
#include <stdexcept>
#include <string>
#include <vector>

#include "gemm_execute.h"

namespace ldet {

GemmOptions checked_options(at::IntArrayRef options) {
  try {
    return parse_gemm_options(options.data(), options.size());
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  return GemmOptions();  // not reached: the check throws
}

GemmPlan& last_gemm_plan() {
  thread_local GemmPlan plan;
  return plan;
}

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

std::string last_gemm_plan_op() { return plan_json(last_gemm_plan()); }

// Stage 1 of the planner alone (gemm_plan.h, plan_gemm), for any device class on any machine: the
// route a call of this shape, these dtypes and this output kind starts on, from the cost table.
std::string plan_gemm_shape_op(int64_t M, int64_t N, int64_t K, at::ScalarType x_dtype, at::ScalarType w_dtype,
                               c10::string_view device, bool digits, at::IntArrayRef options,
                               c10::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK_VALUE(M >= 0 && N >= 0 && K >= 0, "plan_gemm: M, N and K must be >= 0, got ", M, ", ", N, ", ", K);
  for (const at::ScalarType t : {x_dtype, w_dtype})
    TORCH_CHECK_TYPE(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf,
                     "plan_gemm: dtypes must be float32, bfloat16 or float16, got ", t);
  GemmDevice d;
  if (device == "cpu") {
    d = GemmDevice::kCpu;
  } else if (device == "cpu-avx512") {
    d = GemmDevice::kCpuAvx512;
  } else if (device == "cuda") {
    d = GemmDevice::kCuda;
  } else {
    TORCH_CHECK_VALUE(false, "device: expected 'cpu', 'cpu-avx512' or 'cuda', got '", std::string(device), "'");
  }
  const at::ScalarType out = out_dtype.value_or(at::kFloat);
  TORCH_CHECK_TYPE(out == at::kFloat || out == at::kBFloat16 || out == at::kHalf,
                   "plan_gemm: out_dtype must be float32, bfloat16 or float16, got ", out);
  return plan_json(plan_gemm(M, N, K, x_dtype == at::kFloat, w_dtype == at::kFloat, d, digits, out != at::kFloat,
                             checked_options(options)));
}
}  // namespace
}  // namespace ldet

TORCH_LIBRARY_FRAGMENT(ldet, m) {
  // x (M, K), w (N, K), bias (N,) or None; each fp32, bf16 or fp16 (mixing is fine: every
  // product is exact in fp64 either way); all on one device.
  // Returns canonical digits (M, N, 19) int64 of sum_k x[m,k] * w[n,k] (+ bias[n]), exactly.
  // norm_interval: digit additions between normalizations; 0 = the production bound. Tests
  // lower it to force the normalization path (the result must not change).
  // options: [plan_x, plan_w, route], explicit per call (csrc/gemm_plan.h, GemmOptions): how the
  // integer-slice route plans this call ((-1, -1) the device's default, (-2, -2) cached guesses,
  // (0, 0) from this call's summaries, (Sx, Sw) that fixed guess) and the route (0 auto, 1
  // kernel, 2 slices, 3 slices with diagonals, 4 slices with CRT, 5 fp64 for rounded outputs).
  // Every setting gives the same bytes.
  m.def("gemm_partial(Tensor x, Tensor w, Tensor? bias=None, int norm_interval=0, int[] options=[-1, -1, 0]) -> Tensor");
  // The same exact sum rounded once, to nearest-even, straight to out_dtype (default float32;
  // bfloat16 / float16 are never rounded through fp32 first): (M, N).
  m.def("gemm(Tensor x, Tensor w, Tensor? bias=None, ScalarType? out_dtype=None, int[] options=[-1, -1, 0]) -> Tensor");
  // Batched: x (B, M, K), w (B, N, K) -> (B, M, N) of out_dtype, slice b byte for byte gemm(x[b],
  // w[b]): each slice's exact sums rounded once, whatever B. On CUDA, under route auto or kernel,
  // one launch of the long-accumulator kernel covers every slice; elsewhere the slices run one
  // after another, each planned as gemm plans it.
  m.def("gemm_batched(Tensor x, Tensor w, ScalarType? out_dtype=None, int[] options=[-1, -1, 0]) -> Tensor");
  // The plan a gemm (digits false) or gemm_partial (true) call with these operands and options
  // would run, as JSON (csrc/gemm_plan.h, plan_json); runs the planner only (and, for the
  // slices, both operands' row summaries).
  // out_dtype: the rounded outputs' (default float32).
  m.def("explain_gemm(Tensor x, Tensor w, bool digits=False, int[] options=[-1, -1, 0], "
        "ScalarType? out_dtype=None) -> str");
  // Stage 1 of the planner for a shape, dtypes and device class ('cpu', 'cpu-avx512', 'cuda'),
  // without operands: the cost table's route (the data-dependent stages need explain_gemm).
  m.def("plan_gemm_shape(int M, int N, int K, ScalarType x_dtype, ScalarType w_dtype, str device, bool digits=False, "
        "int[] options=[-1, -1, 0], ScalarType? out_dtype=None) -> str",
        &ldet::plan_gemm_shape_op);
  // This thread's last gemm / gemm_partial's plan as executed, as JSON (an empty plan before any).
  m.def("last_gemm_plan() -> str", &ldet::last_gemm_plan_op);
  // The last slices GEMM of this thread: [Sx, Sw, x residues, w residues, x rows and w rows left
  // to the kernel] (tests and benchmarks; zeros before any; -1 for counts a guessed plan did not
  // wait for).
  m.def("last_slices_plan() -> int[]", &ldet::last_slices_plan_op);
  // The last fp64-route GEMM of this thread (csrc/fp64_bound_host.h): [outputs its fp64 GEMM's
  // bound left undecided, of those the ones left to the long accumulator] (one synchronization).
  m.def("last_fp64_counts() -> int[]", &ldet::last_fp64_counts_op);
}

// Runs an exact GEMM's plan (csrc/gemm_plan.h) with one device's routes: the same steps on the
// CPU (csrc/cpu/gemm_cpu.cpp) and CUDA (csrc/cuda/gemm_cuda.cu).
#pragma once

#include <ATen/ATen.h>

#include <functional>

#include "fp64_bound_host.h"
#include "gemm_plan.h"
#include "int_slices_host.h"

namespace ldet {

// The executed plan of this thread's last gemm / gemm_partial (lightning_det.ops.last_gemm_plan:
// tests and benchmarks; csrc/schema/gemm.cpp).
GemmPlan& last_gemm_plan();

// Stage 1 of the planner for one call's operands (gemm_plan.h, plan_gemm).
// out_dtype: the rounded outputs' dtype (digits: ignored).
inline GemmPlan plan_for(const at::Tensor& x, const at::Tensor& w, GemmDevice device, bool digits,
                         at::ScalarType out_dtype, const GemmOptions& options, bool allow_fast) {
  return plan_gemm(x.size(0), w.size(0), x.size(1), x.scalar_type() == at::kFloat, w.scalar_type() == at::kFloat,
                   device, digits, out_dtype != at::kFloat, options, allow_fast);
}

// The probe of auto's kernel choice (gemm_plan.h, plan_kernel_stage): the share of the kernel's
// steps off its fast path on these operands, -1 where the backend does not probe them. The CPU
// probes every call; CUDA 16-bit operands (csrc/cuda/gemm_cuda.cu) on a shape's first call, then
// from a share read back later without a synchronization.
using KernelProbe = std::function<double(const at::Tensor& x, const at::Tensor& w)>;

// Stage 2 for a plan whose route is auto's kernel: the probe may send it to the fp64 route.
inline void probe_kernel_plan(GemmPlan* plan, const at::Tensor& x, const at::Tensor& w, const KernelProbe& probe) {
  if (probe && plan->route == GemmRoute::kKernel && plan->auto_route && plan->fp64_ok && plan->M * plan->N * plan->K)
    plan_kernel_stage(plan, probe(x, w));
}

// The slices route, in the orientation slices_transposed_for picks (gemm_plan.h): transposed,
// the call runs as C^T = w x^T and its result is transposed back; *plan ends in the
// call's own orientation. Undefined when the slices' own plan hands the call to another route.
inline at::Tensor run_slices(GemmPlan* plan, const at::Tensor& x, const at::Tensor& w,
                             const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype, const SliceBackend& slices,
                             const LongAccGemm& kernel) {
  if (!slices_transposed_for(plan->M, plan->N, bias.has_value(), plan->digits, slice_target(slices)))
    return gemm_int_slices(plan, x, w, bias, out_dtype, slices, kernel);
  transpose_plan(plan);
  at::Tensor out = gemm_int_slices(plan, w, x, bias, out_dtype, slices, kernel);
  transpose_plan(plan);
  if (plan->route != GemmRoute::kSlices) return out;  // undefined: the route that takes over runs as given
  plan->slices_transposed = true;
  record_slices_plan(plan->slices);
  return out.transpose(0, 1).contiguous();
}

// Runs the plan: the slices (whose own plan may hand the call to the fp64 route or the kernel),
// the fp64 route, or the long-accumulator kernel `kernel` (which also recomputes the rows the
// slices cannot hold; the probe may first send auto's kernel to the fp64 route). *plan ends as
// executed.
inline at::Tensor execute_gemm(GemmPlan* plan, const at::Tensor& x, const at::Tensor& w,
                               const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype, const Fp64Backend& fp64,
                               const SliceBackend& slices, const LongAccGemm& kernel, const KernelProbe& probe) {
  if (!plan->digits) last_fp64_counts() = at::Tensor();  // until this call takes the fp64 route
  at::Tensor out;
  if (plan->route == GemmRoute::kSlices) out = run_slices(plan, x, w, bias, out_dtype, slices, kernel);
  probe_kernel_plan(plan, x, w, probe);
  if (!out.defined() && plan->route == GemmRoute::kFp64) out = gemm_fp64_bound(*plan, x, w, bias, out_dtype, fp64);
  if (!out.defined()) out = kernel(x, w, bias);
  last_gemm_plan() = *plan;
  return out;
}

// The plan a call with these operands and options (and no bias) would run, without running it:
// stage 1, the kernel probe on these operands, and for the slices their orientation and their
// plan from both operands' summaries (computed here, one synchronization), or from the options'
// fixed guess. The guess cache and
// CUDA's probe cache are neither read nor changed: with cached guesses a call may take larger
// counts than this shows, and on CUDA the route of its shape's last probe (never different bytes).
inline GemmPlan explain_gemm_plan(const at::Tensor& x, const at::Tensor& w, bool digits, at::ScalarType out_dtype,
                                  const GemmOptions& options, const SliceBackend& slices, const KernelProbe& probe) {
  GemmPlan plan = plan_for(x, w, slices.device, digits, out_dtype, options, true);
  probe_kernel_plan(&plan, x, w, probe);
  if (plan.route != GemmRoute::kSlices) return plan;
  const bool transposed = slices_transposed_for(plan.M, plan.N, false, digits, slice_target(slices));
  if (transposed) transpose_plan(&plan);
  if (plan.options.plan_x > 0) {
    plan_slices_stage(&plan, nullptr, nullptr, plan.options.plan_x, plan.options.plan_w, slice_target(slices));
  } else {
    const SliceRun r = transposed ? slices_summaries(w, x, false, slices) : slices_summaries(x, w, false, slices);
    const at::Tensor summary = r.sums.cpu();
    const int32_t* sx = summary.data_ptr<int32_t>();
    plan_slices_stage(&plan, sx, sx + kSumLen, 0, 0, slice_target(slices));
  }
  if (transposed) {
    transpose_plan(&plan);
    plan.slices_transposed = plan.route == GemmRoute::kSlices;
  }
  return plan;
}

}  // namespace ldet

// warp_row_sum_fp32 (csrc/cuda/warp_digits.cuh), the CUDA norms' row sums, run on the CPU under
// the CUDA emulation of tests/csrc/cuda_emu.h as op ldet_warp_emu::warp_row_sums: one warp (a
// block of 32 threads) per row of fp64 terms, the threads' order within a barrier phase given
// (0 ascending, 1 descending, 2 shuffled). tests/test_warp_sum_emulated.py compares it with the
// exact sums rounded once.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cuda_emu.h"
#include "cuda/warp_digits.cuh"

namespace {

at::Tensor warp_row_sums(const at::Tensor& terms, int64_t order) {
  TORCH_CHECK(terms.dim() == 2 && terms.scalar_type() == at::kDouble, "terms: expected a 2-D float64 tensor");
  TORCH_CHECK(order >= 0 && order <= 2, "order: expected 0, 1 or 2, got ", order);
  const at::Tensor t = terms.contiguous();
  const int64_t R = t.size(0), W = t.size(1);
  at::Tensor out = at::empty({R}, t.options().dtype(at::kFloat));
  const double* tp = t.data_ptr<double>();
  float* op = out.data_ptr<float>();
  if (R == 0) return out;
  const std::function<void()> body = [&] {
    const int lane = int(threadIdx.x);
    const int64_t r = blockIdx.x;
    const double* row = tp + r * W;
    const float v = ldet::warp_row_sum_fp32(W, lane, [&](int64_t j) { return row[j]; });
    if (lane == 0) op[r] = v;
  };
  emu::launch(dim3(unsigned(R)), dim3(ldet::kWarpLanes), static_cast<emu::Order>(order), body);
  return out;
}

}  // namespace

TORCH_LIBRARY(ldet_warp_emu, m) { m.def("warp_row_sums(Tensor terms, int order) -> Tensor"); }

TORCH_LIBRARY_IMPL(ldet_warp_emu, CPU, m) { m.impl("warp_row_sums", &warp_row_sums); }

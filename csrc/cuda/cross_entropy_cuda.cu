// CUDA implementations of ce_forward / ce_backward (schemas: csrc/schema/cross_entropy.cpp; the
// arithmetic: csrc/cross_entropy.h, the CPU's too). Forward: one warp per row, its exact sum by
// warp_row_digits (csrc/cuda/warp_digits.cuh). Backward: one thread per element.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>
#include <type_traits>

#include "ce_checks.h"
#include "cross_entropy.h"
#include "cuda/elements.cuh"
#include "cuda/warp_digits.cuh"
#include "uninit.h"

namespace ldet {
namespace {

constexpr int kRowsPerBlock = 8;  // warps of a 256-thread block, a row each
constexpr int kThreads = kRowsPerBlock * kWarpLanes;

template <typename T>
__global__ void ce_forward_kernel(const T* __restrict__ x, const int64_t* __restrict__ target,
                                  const bool* __restrict__ valid, int64_t N, int64_t C, float* __restrict__ loss,
                                  float* __restrict__ e, float* __restrict__ s) {
  const int lane = threadIdx.x % kWarpLanes;
  const int64_t r = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarpLanes;
  if (r >= N) return;  // the whole warp: r is the same for its lanes
  const T* xr = x + r * C;
  float* er = e + r * C;
  float m = -__int_as_float(0x7f800000);
  for (int64_t j = lane; j < C; j += kWarpLanes) m = ce_max(m, float(wide(xr, j)));
#pragma unroll
  for (int o = kWarpLanes / 2; o > 0; o >>= 1) m = ce_max(m, __shfl_xor_sync(0xffffffffu, m, o));
  int64_t acc[LDET_WORDS];
  warp_row_digits(C, lane, [&](int64_t j) {
    const float v = ce_exp_term(float(wide(xr, j)), m);
    er[j] = v;
    return double(v);
  }, acc);
  if (lane != 0) return;
  const int64_t t = valid[r] ? target[r] : 0;
  const bool in_range = t >= 0 && t < C;
  const float l = ce_row_finish(acc, m, in_range ? float(wide(xr, t)) : 0.0f, s + r);
  loss[r] = !valid[r] ? 0.0f : in_range ? l : __int_as_float(0x7fc00000);
}

__global__ void ce_backward_kernel(const float* __restrict__ e, const float* __restrict__ s,
                                   const int64_t* __restrict__ target, const bool* __restrict__ valid,
                                   const float* __restrict__ grad, int64_t N, int64_t C, int fmt, void* __restrict__ dx) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= N * C) return;
  const int64_t r = i / C, j = i - r * C;
  const float v = valid[r] ? ce_grad(e[i], s[r], j == target[r], grad[r]) : 0.0f;
  store_fmt(dx, i, round_float_fmt(v, fmt), fmt);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ce_forward_cuda(const at::Tensor& x, const at::Tensor& target,
                                                               const at::Tensor& valid) {
  check_ce_forward_args(x, target, valid);
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t N = x.size(0), C = x.size(1);
  const at::Tensor xc = x.contiguous(), tc = target.contiguous(), vc = valid.contiguous();
  const auto fopt = x.options().dtype(at::kFloat);
  // uninit: every element of the three is written by the kernel
  at::Tensor loss = uninit({N}, fopt), e = uninit({N, C}, fopt), s = uninit({N}, fopt);
  if (N > 0) {
    with_elements(xc, [&](auto xp) {
      using T = std::remove_cv_t<std::remove_pointer_t<decltype(xp)>>;
      ce_forward_kernel<T><<<unsigned((N + kRowsPerBlock - 1) / kRowsPerBlock), kThreads, 0,
                             c10::cuda::getCurrentCUDAStream()>>>(xp, tc.data_ptr<int64_t>(), vc.data_ptr<bool>(), N, C,
                                                                  loss.data_ptr<float>(), e.data_ptr<float>(),
                                                                  s.data_ptr<float>());
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {loss, e, s};
}

at::Tensor ce_backward_cuda(const at::Tensor& e, const at::Tensor& s, const at::Tensor& target, const at::Tensor& valid,
                            const at::Tensor& grad, at::ScalarType out_dtype) {
  check_ce_backward_args(e, s, target, valid, grad);
  const int fmt = out_format(out_dtype);
  c10::cuda::CUDAGuard guard(e.device());
  const int64_t N = e.size(0), C = e.size(1);
  const at::Tensor ec = e.contiguous(), sc = s.contiguous(), tc = target.contiguous(), vc = valid.contiguous();
  const at::Tensor gf = grad.contiguous().to(at::kFloat);  // exact widening
  at::Tensor dx = uninit({N, C}, e.options().dtype(out_dtype));  // every element written by the kernel
  if (N * C > 0) {
    ce_backward_kernel<<<unsigned((N * C + kThreads - 1) / kThreads), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        ec.data_ptr<float>(), sc.data_ptr<float>(), tc.data_ptr<int64_t>(), vc.data_ptr<bool>(), gf.data_ptr<float>(), N,
        C, fmt, dx.data_ptr());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return dx;
}

}  // namespace

TORCH_LIBRARY_IMPL(ldet, CUDA, m) {
  m.impl("ce_forward", &ce_forward_cuda);
  m.impl("ce_backward", &ce_backward_cuda);
}

}  // namespace ldet

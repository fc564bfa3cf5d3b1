// CUDA implementations of norm_forward / norm_backward (schemas: csrc/schema/norm.cpp; the
// arithmetic: csrc/norm.h, the CPU's too). One warp per row, its exact sums by warp_row_digits
// (csrc/cuda/warp_digits.cuh): every lane holds the row's canonical sum and its one rounding.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>
#include <type_traits>

#include "cuda/elements.cuh"
#include "cuda/warp_digits.cuh"
#include "norm.h"
#include "norm_checks.h"
#include "uninit.h"

namespace ldet {
namespace {

constexpr int kRowsPerBlock = 8;  // warps of a 256-thread block, a row each
constexpr int kLanes = kWarpLanes;

const float* data_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

at::Tensor contiguous_or_undefined(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->contiguous() : at::Tensor();
}

// round(exact sum_j term(j)) / W over one row (norm_mean's value), the warp's lanes taking
// j = lane, lane + 32, ...; every lane returns it. Most rows are decided by an fp64 sum and its
// error bound (warp_row_sum_fp32), the rest by the digits.
template <class Term>
__device__ float warp_row_mean(int64_t W, float width, int lane, const Term& term) {
  return warp_row_sum_fp32(W, lane, term) / width;
}

template <typename T>
__global__ void norm_forward_kernel(const T* __restrict__ x, const float* __restrict__ weight,
                                    const float* __restrict__ bias, int64_t R, int64_t W, float width, float eps,
                                    bool rms, int fmt, void* __restrict__ y, float* __restrict__ xhat,
                                    float* __restrict__ rstd) {
  const int lane = threadIdx.x % kLanes;
  const int64_t r = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kLanes;
  if (r >= R) return;  // the whole warp: r is the same for its lanes
  const T* xr = x + r * W;
  const float mean = rms ? 0.0f : warp_row_mean(W, width, lane, [&](int64_t j) { return wide(xr, j); });
  const auto d = [&](int64_t j) {
    const float v = float(wide(xr, j));  // exact
    return rms ? v : v - mean;
  };
  const float rs = norm_rstd(warp_row_mean(W, width, lane,
                                           [&](int64_t j) {
                                             const double v = d(j);
                                             return v * v;  // exact: two 24-bit significands
                                           }),
                             eps);
  for (int64_t j = lane; j < W; j += kLanes) {
    const float xh = d(j) * rs;
    xhat[r * W + j] = xh;
    store_fmt(y, r * W + j, round_float_fmt(norm_affine(xh, weight, bias, j), fmt), fmt);
  }
  if (lane == 0) rstd[r] = rs;
}

template <typename T>
__global__ void norm_backward_kernel(const T* __restrict__ gy, const float* __restrict__ xhat,
                                     const float* __restrict__ rstd, const float* __restrict__ weight, int64_t R,
                                     int64_t W, float width, bool rms, int fmt, void* __restrict__ gx) {
  const int lane = threadIdx.x % kLanes;
  const int64_t r = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kLanes;
  if (r >= R) return;
  const T* gr = gy + r * W;
  const float* hr = xhat + r * W;
  const auto g = [&](int64_t j) {
    const float v = float(wide(gr, j));  // exact
    return weight ? v * weight[j] : v;
  };
  const float m2 = warp_row_mean(W, width, lane, [&](int64_t j) { return double(g(j)) * double(hr[j]); });
  const float m1 = rms ? 0.0f : warp_row_mean(W, width, lane, [&](int64_t j) { return double(g(j)); });
  const float rs = rstd[r];
  for (int64_t j = lane; j < W; j += kLanes)
    store_fmt(gx, r * W + j, round_float_fmt(norm_grad_input(g(j), hr[j], m1, m2, rs, rms), fmt), fmt);
}

unsigned row_blocks(int64_t R) { return unsigned((R + kRowsPerBlock - 1) / kRowsPerBlock); }

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_forward_cuda(const at::Tensor& x,
                                                                 const c10::optional<at::Tensor>& weight,
                                                                 const c10::optional<at::Tensor>& bias, double eps,
                                                                 bool rms) {
  check_norm_forward_args(x, weight, bias);
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t R = x.size(0), W = x.size(1);
  const at::Tensor xc = x.contiguous();
  const at::Tensor wc = contiguous_or_undefined(weight), bc = contiguous_or_undefined(bias);
  const auto fopt = x.options().dtype(at::kFloat);
  // uninit: every element of the three is written by the kernel
  at::Tensor y = uninit({R, W}, x.options()), xhat = uninit({R, W}, fopt), rstd = uninit({R}, fopt);
  if (R > 0) {
    const int fmt = out_format(x.scalar_type());
    with_elements(xc, [&](auto xp) {
      using T = std::remove_cv_t<std::remove_pointer_t<decltype(xp)>>;
      norm_forward_kernel<T><<<row_blocks(R), kRowsPerBlock * kLanes, 0, c10::cuda::getCurrentCUDAStream()>>>(
          xp, data_or_null(wc), data_or_null(bc), R, W, float(W), float(eps), rms, fmt, y.data_ptr(),
          xhat.data_ptr<float>(), rstd.data_ptr<float>());
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {y, xhat, rstd};
}

at::Tensor norm_backward_cuda(const at::Tensor& gy, const at::Tensor& xhat, const at::Tensor& rstd,
                              const c10::optional<at::Tensor>& weight, bool rms, at::ScalarType out_dtype) {
  check_norm_backward_args(gy, xhat, rstd, weight);
  const int fmt = out_format(out_dtype);
  c10::cuda::CUDAGuard guard(gy.device());
  const int64_t R = gy.size(0), W = gy.size(1);
  const at::Tensor gc = gy.contiguous(), hc = xhat.contiguous(), sc = rstd.contiguous();
  const at::Tensor wc = contiguous_or_undefined(weight);
  at::Tensor gx = uninit({R, W}, gy.options().dtype(out_dtype));  // every element written by the kernel
  if (R > 0) {
    with_elements(gc, [&](auto gp) {
      using T = std::remove_cv_t<std::remove_pointer_t<decltype(gp)>>;
      norm_backward_kernel<T><<<row_blocks(R), kRowsPerBlock * kLanes, 0, c10::cuda::getCurrentCUDAStream()>>>(
          gp, hc.data_ptr<float>(), sc.data_ptr<float>(), data_or_null(wc), R, W, float(W), rms, fmt, gx.data_ptr());
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return gx;
}

}  // namespace

TORCH_LIBRARY_IMPL(ldet, CUDA, m) {
  m.impl("norm_forward", &norm_forward_cuda);
  m.impl("norm_backward", &norm_backward_cuda);
}

}  // namespace ldet

// CUDA implementation of the AdamWSR ops (formula and rounding: csrc/adamw_sr.h). One launch
// per parameter; each thread owns one 8-element Philox block of global indices, so every draw
// is computed once and the result cannot depend on the launch shape.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "check.h"
#include "adamw_sr.h"
#include "adamw_sr_checks.h"
#include "cuda/adamw_sr_kernels.cuh"

namespace {

using ldet::AdamWScalars;

constexpr int kThreads = 256;

int64_t grid_for(int64_t nblk) {
  // Grid-stride loops cap the grid; 32 CTAs per SM keeps every SM busy without tail effects.
  int dev = 0, sms = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const int64_t want = (nblk + kThreads - 1) / kThreads;
  return std::max<int64_t>(1, std::min<int64_t>(want, int64_t(sms) * 32));
}

template <typename ParamT, typename GradT>
void launch(at::Tensor& param, const at::Tensor& grad, at::Tensor& m, at::Tensor& v,
            const ldet::AdamWLaunch& a) {
  const int64_t n = param.numel();
  const int64_t nblk = ldet::num_philox_blocks(a.base, n);
  ldet::adamw_sr_kernel<ParamT, GradT>
      <<<grid_for(nblk), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          reinterpret_cast<ParamT*>(param.data_ptr()),
          reinterpret_cast<const GradT*>(grad.data_ptr()), m.data_ptr<float>(),
          v.data_ptr<float>(), n, nblk, a.s, a.seed, a.step, a.base);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void adamw_sr_step_cuda(at::Tensor param, const at::Tensor& grad, at::Tensor exp_avg,
                        at::Tensor exp_avg_sq, double decay, double beta1, double one_minus_beta1,
                        double beta2, double one_minus_beta2, double step_size, double bc2_sqrt,
                        double eps, int64_t seed, int64_t step, int64_t base_index) {
  const ldet::AdamWLaunch a =
      ldet::prepare_adamw_sr(param, grad, exp_avg, exp_avg_sq, decay, beta1, one_minus_beta1,
                             beta2, one_minus_beta2, step_size, bc2_sqrt, eps, seed, step,
                             base_index);
  LDET_CHECK(param.is_cuda(), "adamw_sr_step (CUDA): param must be a CUDA tensor");
  if (param.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(param.device());
  if (a.param_fp32 && a.grad_fp32) launch<float, float>(param, grad, exp_avg, exp_avg_sq, a);
  if (a.param_fp32 && !a.grad_fp32) launch<float, uint16_t>(param, grad, exp_avg, exp_avg_sq, a);
  if (!a.param_fp32 && a.grad_fp32) launch<uint16_t, float>(param, grad, exp_avg, exp_avg_sq, a);
  if (!a.param_fp32 && !a.grad_fp32) launch<uint16_t, uint16_t>(param, grad, exp_avg, exp_avg_sq, a);
}

at::Tensor sr_round_bf16_cuda(const at::Tensor& x_in, int64_t seed, int64_t step,
                              int64_t base_index) {
  ldet::check_sr_round_args(x_in, base_index);
  LDET_CHECK(x_in.is_cuda(), "sr_round_bf16 (CUDA): x must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kBFloat16));
  const int64_t n = x.numel();
  if (n == 0) return out;
  const uint64_t base = static_cast<uint64_t>(base_index);
  const int64_t nblk = ldet::num_philox_blocks(base, n);
  ldet::sr_round_kernel<<<grid_for(nblk), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      x.data_ptr<float>(), reinterpret_cast<uint16_t*>(out.data_ptr()), n, nblk,
      static_cast<uint64_t>(seed), static_cast<uint64_t>(step), base);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(ldet, CUDA, m) {
  m.impl("adamw_sr_step", &adamw_sr_step_cuda);
  m.impl("sr_round_bf16", &sr_round_bf16_cuda);
}

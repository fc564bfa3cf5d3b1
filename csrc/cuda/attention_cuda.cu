// CUDA implementation of ldet::attention_fwd / attention_bwd / attention_probs: launches of the
// kernels in csrc/cuda/attention_kernels.cuh (the definition they compute: csrc/attention.h).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "check.h"
#include "attention.h"
#include "attention_checks.h"
#include "cuda/attention_kernels.cuh"
#include "cuda/kernel_smem.cuh"
#include "uninit.h"

namespace ldet {
namespace {

using namespace attn_kernels;

int ep_of(const attn::Shape& s) {
  const int64_t e = std::max(s.E, s.Ev);
  return e <= 64 ? 64 : (e <= 128 ? 128 : 256);
}

// The kernel's dynamic shared memory, set up for this device (csrc/cuda/kernel_smem.cuh), or an
// error naming what the device lacks.
template <typename Kernel>
void require_smem(Kernel kernel, size_t bytes, int ep, const char* op) {
  int dev = 0, optin = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  LDET_CHECK(prepare_smem(dev, kernel, bytes, &optin), op, " (CUDA): head dimensions up to ", ep, " need ", bytes,
              " bytes of shared memory per block; this GPU offers ", optin);
}

template <int EP>
void launch_fwd(const AttnLaunch& a, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& o,
                at::Tensor& stats, cudaStream_t stream) {
  constexpr size_t smem = fwd_smem<EP>();
  require_smem(attn_fwd_kernel<EP>, smem, EP, "attention_fwd");
  const auto& s = a.shape;
  const int64_t blocks = (s.Lq + Tiles<EP>::FQ - 1) / Tiles<EP>::FQ * s.B * s.H;
  LDET_CHECK(blocks < (int64_t(1) << 31), "attention_fwd (CUDA): too many query tiles: ", blocks);
  attn_fwd_kernel<EP><<<unsigned(blocks), kThreads, smem, stream>>>(a, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                                        o.data_ptr<float>(), stats.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int EP>
void launch_bwd(const AttnLaunch& a, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const at::Tensor& dout, const at::Tensor& stats, const at::Tensor& delta, at::Tensor& dq,
                at::Tensor& dk, at::Tensor& dv, cudaStream_t stream) {
  constexpr size_t smem_q = bwd_q_smem<EP>(), smem_kv = bwd_kv_smem<EP>();
  require_smem(attn_bwd_q_kernel<EP>, smem_q, EP, "attention_bwd");
  require_smem(attn_bwd_kv_kernel<EP>, smem_kv, EP, "attention_bwd");
  const auto& s = a.shape;
  const int64_t blocks_q = (s.Lq + Tiles<EP>::FQ - 1) / Tiles<EP>::FQ * s.B * s.H;
  const int64_t blocks_kv = (s.Lk + Tiles<EP>::KK - 1) / Tiles<EP>::KK * s.B * s.Hkv;
  LDET_CHECK(blocks_q < (int64_t(1) << 31) && blocks_kv < (int64_t(1) << 31),
              "attention_bwd (CUDA): too many tiles: ", blocks_q, " and ", blocks_kv);
  attn_bwd_q_kernel<EP><<<unsigned(blocks_q), kThreads, smem_q, stream>>>(a, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                                              dout.data_ptr(), stats.data_ptr<float>(),
                                                              delta.data_ptr<float>(), dq.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  attn_bwd_kv_kernel<EP><<<unsigned(blocks_kv), kThreads, smem_kv, stream>>>(a, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                                                 dout.data_ptr(), stats.data_ptr<float>(),
                                                                 delta.data_ptr<float>(), dk.data_ptr<float>(),
                                                                 dv.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor> attention_fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                      const c10::optional<at::Tensor>& mask, double scale, bool causal,
                                                      at::IntArrayRef dropout, double dropout_mult) {
  const AttnLaunch a = prepare_attention(q, k, v, mask, scale, causal, dropout, dropout_mult);
  LDET_CHECK(q.device().is_cuda(), "attention_fwd (CUDA): q must be on a CUDA device");
  c10::cuda::CUDAGuard guard(q.device());
  const auto& s = a.shape;
  // every element is written: each row of each query tile, each column below Ev
  at::Tensor o = uninit({s.B, s.H, s.Lq, s.Ev}, q.options().dtype(at::kFloat));
  at::Tensor stats = uninit({s.B, s.H, s.Lq, 2}, q.options().dtype(at::kFloat));
  if (s.B * s.H * s.Lq == 0) return {o, stats};
  if (s.Lk == 0) {
    o.zero_();
    stats.zero_();
    return {o, stats};
  }
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  switch (ep_of(s)) {
    case 64: launch_fwd<64>(a, q, k, v, o, stats, stream); break;
    case 128: launch_fwd<128>(a, q, k, v, o, stats, stream); break;
    default: launch_fwd<256>(a, q, k, v, o, stats, stream); break;
  }
  return {o, stats};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& o,
    const at::Tensor& stats, const c10::optional<at::Tensor>& mask, double scale, bool causal, at::IntArrayRef dropout,
    double dropout_mult) {
  const AttnLaunch a = prepare_attention(q, k, v, mask, scale, causal, dropout, dropout_mult);
  check_attention_bwd(dout, o, stats, a, q);
  LDET_CHECK(q.device().is_cuda(), "attention_bwd (CUDA): q must be on a CUDA device");
  c10::cuda::CUDAGuard guard(q.device());
  const auto& s = a.shape;
  // dq: every row of every query tile; dk, dv: every key of every key tile (a key no query may
  // attend keeps its zero chains)
  at::Tensor dq = uninit({s.B, s.H, s.Lq, s.E}, q.options().dtype(at::kFloat));
  at::Tensor dk = uninit({s.B, s.Hkv, s.Lk, s.E}, q.options().dtype(at::kFloat));
  at::Tensor dv = uninit({s.B, s.Hkv, s.Lk, s.Ev}, q.options().dtype(at::kFloat));
  if (s.B * s.H * s.Lq == 0 || s.Lk == 0) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return {dq, dk, dv};
  }
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t rows = s.B * s.H * s.Lq;
  at::Tensor delta = uninit({rows}, q.options().dtype(at::kFloat));  // every row written
  attn_delta_kernel<<<unsigned((rows + 255) / 256), 256, 0, stream>>>(dout.data_ptr(), o.data_ptr<float>(),
                                                                       delta.data_ptr<float>(), rows, s.Ev, s.dtype);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  switch (ep_of(s)) {
    case 64: launch_bwd<64>(a, q, k, v, dout, stats, delta, dq, dk, dv, stream); break;
    case 128: launch_bwd<128>(a, q, k, v, dout, stats, delta, dq, dk, dv, stream); break;
    default: launch_bwd<256>(a, q, k, v, dout, stats, delta, dq, dk, dv, stream); break;
  }
  return {dq, dk, dv};
}

at::Tensor attention_probs_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& stats,
                                const c10::optional<at::Tensor>& mask, double scale, bool causal) {
  const AttnLaunch a = prepare_attention(q, k, k, mask, scale, causal, {}, 1.0);
  check_attention_stats(stats, a, q);
  LDET_CHECK(q.device().is_cuda(), "attention_probs (CUDA): q must be on a CUDA device");
  c10::cuda::CUDAGuard guard(q.device());
  const auto& s = a.shape;
  at::Tensor p = uninit({s.B, s.H, s.Lq, s.Lk}, q.options().dtype(at::kFloat));  // one thread per element
  const int64_t n = p.numel();
  if (n == 0) return p;
  attn_probs_kernel<<<unsigned((n + 255) / 256), 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
      a, q.data_ptr(), k.data_ptr(), stats.data_ptr<float>(), p.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return p;
}

}  // namespace
}  // namespace ldet

TORCH_LIBRARY_IMPL(ldet, CUDA, m) {
  m.impl("attention_fwd", &ldet::attention_fwd_cuda);
  m.impl("attention_bwd", &ldet::attention_bwd_cuda);
  m.impl("attention_probs", &ldet::attention_probs_cuda);
}

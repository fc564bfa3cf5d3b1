// The CUDA attention kernels (csrc/cuda/attention_kernels.cuh) run on the CPU under the CUDA
// emulation of tests/csrc/cuda_emu.h, as ops ldet_emu::attention_fwd / attention_bwd /
// attention_probs with the signatures of the ldet ops plus the threads' order within a barrier
// phase (0 ascending, 1 descending, 2 shuffled). The host steps are those of
// csrc/cuda/attention_cuda.cu: the same argument checks, tile counts and launch order.
// tests/test_attention_cuda_emulated.py builds it and compares its bytes with the CPU kernels'.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

#include "cuda_emu.h"

namespace ldet {
namespace attn_kernels {
alignas(16) float4 smem4[232448 / sizeof(float4)];  // the kernels' dynamic shared memory (227 KB)
}  // namespace attn_kernels
}  // namespace ldet

#include "attention_checks.h"
#include "cuda/attention_kernels.cuh"

namespace {

using namespace ldet;
using namespace ldet::attn_kernels;

int ep_of(const attn::Shape& s) {
  const int64_t e = std::max(s.E, s.Ev);
  return e <= 64 ? 64 : (e <= 128 ? 128 : 256);
}

// Unwritten memory reads as a NaN that no arithmetic makes, so a kernel that reads shared memory
// it did not write, or leaves an output element unwritten, shows in the bytes.
constexpr uint32_t kPoison = 0x7fa5a5a5u;

void poison_smem() {
  float* f = reinterpret_cast<float*>(smem4);
  const float p = __uint_as_float(kPoison);
  for (size_t i = 0; i < sizeof(smem4) / sizeof(float); ++i) f[i] = p;
}

at::Tensor poisoned(at::IntArrayRef sizes, const at::Tensor& like) {
  at::Tensor t = at::empty(sizes, like.options().dtype(at::kFloat));
  t.view(at::kInt).fill_(int32_t(kPoison));
  return t;
}

emu::Order order_of(int64_t order) {
  TORCH_CHECK(order >= 0 && order <= 2, "order: expected 0, 1 or 2, got ", order);
  return static_cast<emu::Order>(order);
}

template <int EP>
void fwd(const AttnLaunch& a, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& o,
         at::Tensor& stats, emu::Order order) {
  static_assert(fwd_smem<EP>() <= sizeof(smem4), "shared memory");
  const auto& s = a.shape;
  const int64_t blocks = (s.Lq + Tiles<EP>::FQ - 1) / Tiles<EP>::FQ * s.B * s.H;
  const void *qp = q.data_ptr(), *kp = k.data_ptr(), *vp = v.data_ptr();
  float *op = o.data_ptr<float>(), *sp = stats.data_ptr<float>();
  emu::launch(dim3(unsigned(blocks)), dim3(kThreads), order, [&] { attn_fwd_kernel<EP>(a, qp, kp, vp, op, sp); },
              poison_smem);
}

template <int EP>
void bwd(const AttnLaunch& a, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& dout,
         const at::Tensor& stats, const at::Tensor& delta, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
         emu::Order order) {
  static_assert(bwd_q_smem<EP>() <= sizeof(smem4) && bwd_kv_smem<EP>() <= sizeof(smem4), "shared memory");
  const auto& s = a.shape;
  const int64_t blocks_q = (s.Lq + Tiles<EP>::FQ - 1) / Tiles<EP>::FQ * s.B * s.H;
  const int64_t blocks_kv = (s.Lk + Tiles<EP>::KK - 1) / Tiles<EP>::KK * s.B * s.Hkv;
  const void *qp = q.data_ptr(), *kp = k.data_ptr(), *vp = v.data_ptr(), *dop = dout.data_ptr();
  const float *sp = stats.data_ptr<float>(), *dp = delta.data_ptr<float>();
  float *dqp = dq.data_ptr<float>(), *dkp = dk.data_ptr<float>(), *dvp = dv.data_ptr<float>();
  emu::launch(dim3(unsigned(blocks_q)), dim3(kThreads), order,
              [&] { attn_bwd_q_kernel<EP>(a, qp, kp, vp, dop, sp, dp, dqp); }, poison_smem);
  emu::launch(dim3(unsigned(blocks_kv)), dim3(kThreads), order,
              [&] { attn_bwd_kv_kernel<EP>(a, qp, kp, vp, dop, sp, dp, dkp, dvp); }, poison_smem);
}

std::tuple<at::Tensor, at::Tensor> attention_fwd_emu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const c10::optional<at::Tensor>& mask, double scale, bool causal,
                                                     at::IntArrayRef dropout, double dropout_mult, int64_t order) {
  const AttnLaunch a = prepare_attention(q, k, v, mask, scale, causal, dropout, dropout_mult);
  const auto& s = a.shape;
  at::Tensor o = poisoned({s.B, s.H, s.Lq, s.Ev}, q), stats = poisoned({s.B, s.H, s.Lq, 2}, q);
  if (s.B * s.H * s.Lq == 0 || s.Lk == 0) return {o.zero_(), stats.zero_()};
  switch (ep_of(s)) {
    case 64: fwd<64>(a, q, k, v, o, stats, order_of(order)); break;
    case 128: fwd<128>(a, q, k, v, o, stats, order_of(order)); break;
    default: fwd<256>(a, q, k, v, o, stats, order_of(order)); break;
  }
  return {o, stats};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd_emu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& o,
    const at::Tensor& stats, const c10::optional<at::Tensor>& mask, double scale, bool causal, at::IntArrayRef dropout,
    double dropout_mult, int64_t order) {
  const AttnLaunch a = prepare_attention(q, k, v, mask, scale, causal, dropout, dropout_mult);
  check_attention_bwd(dout, o, stats, a, q);
  const auto& s = a.shape;
  at::Tensor dq = poisoned({s.B, s.H, s.Lq, s.E}, q), dk = poisoned({s.B, s.Hkv, s.Lk, s.E}, q),
             dv = poisoned({s.B, s.Hkv, s.Lk, s.Ev}, q);
  if (s.B * s.H * s.Lq == 0 || s.Lk == 0) return {dq.zero_(), dk.zero_(), dv.zero_()};
  const int64_t rows = s.B * s.H * s.Lq;
  at::Tensor delta = poisoned({rows}, q);
  const void* dop = dout.data_ptr();
  const float* opp = o.data_ptr<float>();
  float* dp = delta.data_ptr<float>();
  emu::launch(dim3(unsigned((rows + 255) / 256)), dim3(256), order_of(order),
              [&] { attn_delta_kernel(dop, opp, dp, rows, s.Ev, s.dtype); });
  switch (ep_of(s)) {
    case 64: bwd<64>(a, q, k, v, dout, stats, delta, dq, dk, dv, order_of(order)); break;
    case 128: bwd<128>(a, q, k, v, dout, stats, delta, dq, dk, dv, order_of(order)); break;
    default: bwd<256>(a, q, k, v, dout, stats, delta, dq, dk, dv, order_of(order)); break;
  }
  return {dq, dk, dv};
}

at::Tensor attention_probs_emu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& stats,
                               const c10::optional<at::Tensor>& mask, double scale, bool causal, int64_t order) {
  const AttnLaunch a = prepare_attention(q, k, k, mask, scale, causal, {}, 1.0);
  check_attention_stats(stats, a, q);
  const auto& s = a.shape;
  at::Tensor p = poisoned({s.B, s.H, s.Lq, s.Lk}, q);
  const int64_t n = p.numel();
  if (n == 0) return p;
  const void *qp = q.data_ptr(), *kp = k.data_ptr();
  const float* sp = stats.data_ptr<float>();
  float* pp = p.data_ptr<float>();
  emu::launch(dim3(unsigned((n + 255) / 256)), dim3(256), order_of(order),
              [&] { attn_probs_kernel(a, qp, kp, sp, pp); });
  return p;
}

// A probe of the emulation itself: each thread writes its slot of shared memory, then (after a
// barrier or not) reads its neighbour's. Without the barrier the read races the write, which the
// emulation shows as poison in ascending order.
void probe_kernel(bool with_barrier, float* out) {
  float* s = reinterpret_cast<float*>(smem4);
  const int t = int(threadIdx.x), n = int(blockDim.x);
  s[t] = float(t);
  if (with_barrier) __syncthreads();
  out[t] = s[(t + 1) % n];
}

at::Tensor barrier_probe_emu(bool with_barrier, int64_t order) {
  at::Tensor out = at::empty({64}, at::TensorOptions().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  emu::launch(dim3(1), dim3(64), order_of(order), [&] { probe_kernel(with_barrier, op); }, poison_smem);
  return out;
}

}  // namespace

TORCH_LIBRARY(ldet_emu, m) {
  m.def("barrier_probe(bool with_barrier, int order) -> Tensor", &barrier_probe_emu);  // no tensor in: catch-all
  m.def("attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, bool causal, int[] dropout, "
        "float dropout_mult, int order) -> (Tensor, Tensor)");
  m.def("attention_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor o, Tensor stats, Tensor? mask, "
        "float scale, bool causal, int[] dropout, float dropout_mult, int order) -> (Tensor, Tensor, Tensor)");
  m.def("attention_probs(Tensor q, Tensor k, Tensor stats, Tensor? mask, float scale, bool causal, int order) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(ldet_emu, CPU, m) {
  m.impl("attention_fwd", &attention_fwd_emu);
  m.impl("attention_bwd", &attention_bwd_emu);
  m.impl("attention_probs", &attention_probs_emu);
}

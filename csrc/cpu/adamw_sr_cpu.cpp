// CPU implementation of the AdamWSR ops (formula and rounding: csrc/adamw_sr.h). Named
// *_cpu.cpp because the loader builds every source into one flat folder of .o files.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "adamw_sr.h"
#include "adamw_sr_checks.h"

namespace {

using ldet::AdamWScalars;

// Philox blocks per parallel task: 4096 blocks = 32768 elements, enough work to amortize the
// task, small enough to spread a 1M-element parameter over all cores.
constexpr int64_t kGrainBlocks = 4096;

template <typename ParamT, typename GradT>
void run(at::Tensor& param, const at::Tensor& grad, at::Tensor& m, at::Tensor& v,
         const AdamWScalars& s, uint64_t seed, uint64_t step, uint64_t base) {
  ParamT* p = reinterpret_cast<ParamT*>(param.data_ptr());
  const GradT* g = reinterpret_cast<const GradT*>(grad.data_ptr());
  float* mp = m.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  const int64_t n = param.numel();
  const int64_t nblk = ldet::num_philox_blocks(base, n);
  at::parallel_for(0, nblk, kGrainBlocks, [&](int64_t b0, int64_t b1) {
    // Consecutive Philox blocks form one contiguous local range; only the bf16 path needs
    // the block boundaries, for its draws.
    int64_t lo, hi, lo_end, hi_end;
    ldet::philox_block_range(b0, base, n, &lo, &hi);
    ldet::philox_block_range(b1 - 1, base, n, &lo_end, &hi_end);
    if constexpr (std::is_same<ParamT, float>::value) {
      ldet::adamw_sr_block<ParamT, GradT>(p, g, mp, vp, lo, hi_end, s, seed, step, base);
    } else {
      for (int64_t t = b0; t < b1; ++t) {
        ldet::philox_block_range(t, base, n, &lo, &hi);
        ldet::adamw_sr_block<ParamT, GradT>(p, g, mp, vp, lo, hi, s, seed, step, base);
      }
    }
  });
}

void adamw_sr_step_cpu(at::Tensor param, const at::Tensor& grad, at::Tensor exp_avg,
                       at::Tensor exp_avg_sq, double decay, double beta1, double one_minus_beta1,
                       double beta2, double one_minus_beta2, double step_size, double bc2_sqrt,
                       double eps, int64_t seed, int64_t step, int64_t base_index) {
  ldet::check_adamw_sr_args(param, grad, exp_avg, exp_avg_sq, base_index);
  TORCH_CHECK(param.device().is_cpu(), "adamw_sr_step (CPU): param must be on the CPU");
  if (param.numel() == 0) return;
  const AdamWScalars s = ldet::make_scalars(decay, beta1, one_minus_beta1, beta2,
                                            one_minus_beta2, step_size, bc2_sqrt, eps);
  const uint64_t sd = static_cast<uint64_t>(seed), st = static_cast<uint64_t>(step),
                 base = static_cast<uint64_t>(base_index);
  const bool p32 = param.scalar_type() == at::kFloat;
  const bool g32 = grad.scalar_type() == at::kFloat;
  if (p32 && g32) run<float, float>(param, grad, exp_avg, exp_avg_sq, s, sd, st, base);
  if (p32 && !g32) run<float, uint16_t>(param, grad, exp_avg, exp_avg_sq, s, sd, st, base);
  if (!p32 && g32) run<uint16_t, float>(param, grad, exp_avg, exp_avg_sq, s, sd, st, base);
  if (!p32 && !g32) run<uint16_t, uint16_t>(param, grad, exp_avg, exp_avg_sq, s, sd, st, base);
}

at::Tensor sr_round_bf16_cpu(const at::Tensor& x_in, int64_t seed, int64_t step,
                             int64_t base_index) {
  ldet::check_sr_round_args(x_in, base_index);
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kBFloat16));
  const int64_t n = x.numel();
  const float* xp = x.data_ptr<float>();
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const uint64_t base = static_cast<uint64_t>(base_index);
  at::parallel_for(0, ldet::num_philox_blocks(base, n), kGrainBlocks, [&](int64_t b0, int64_t b1) {
    for (int64_t t = b0; t < b1; ++t) {
      int64_t lo, hi;
      ldet::philox_block_range(t, base, n, &lo, &hi);
      ldet::sr_round_block(xp, op, lo, hi, static_cast<uint64_t>(seed),
                           static_cast<uint64_t>(step), base);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(ldet, CPU, m) {
  m.impl("adamw_sr_step", &adamw_sr_step_cpu);
  m.impl("sr_round_bf16", &sr_round_bf16_cpu);
}

// CPU implementation of the AdamWSR ops (formula and rounding: csrc/adamw_sr.h). Named
// *_cpu.cpp because the loader builds every source into one flat folder of .o files.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "check.h"
#include "cpu/fp_env.h"
#include "adamw_sr.h"
#include "adamw_sr_checks.h"

namespace {

using ldet::AdamWScalars;

// Philox blocks per parallel task: 4096 blocks = 32768 elements, enough work to amortize the
// task, small enough to spread a 1M-element parameter over all cores.
constexpr int64_t kGrainBlocks = 4096;

constexpr int64_t kChunk = 1024;  // elements per pass; a multiple of 8
constexpr int kLanes = 8;          // Philox blocks computed together

// Writes out[i] = SR(x[i]) for i < len, where x[0] has global index g0. The draws of a chunk
// are computed first, kLanes Philox blocks at a time (the tail lanes compute blocks past the
// end, which are discarded), then applied in one tight loop.
__attribute__((always_inline)) inline void sr_write(uint16_t* __restrict__ out,
                                                    const float* __restrict__ x, int64_t len,
                                                    uint64_t g0, uint64_t seed, uint64_t step) {
  alignas(64) uint32_t draws[kChunk + 8 * kLanes + 8];
  const uint64_t blk0 = g0 >> 3, nblk = ((g0 + static_cast<uint64_t>(len) + 7) >> 3) - blk0;
  for (uint64_t b = 0; b < nblk; b += kLanes) {
    uint32_t w[4][kLanes];
    ldet::philox_block_lanes<kLanes>(seed, step, blk0 + b, w);
    for (int l = 0; l < kLanes; ++l) {
      uint32_t* d = draws + 8 * (b + l);
      for (int k = 0; k < 4; ++k) {
        d[2 * k] = w[k][l] & 0xffffu;
        d[2 * k + 1] = w[k][l] >> 16;
      }
    }
  }
  const uint32_t* d = draws + (g0 & 7u);
  for (int64_t i = 0; i < len; ++i) out[i] = ldet::bf16_stochastic_round(x[i], d[i]);
}

// bf16 parameters, local elements [lo, hi): the same per-element arithmetic as
// ldet::adamw_sr_block, in passes over a chunk so that the fp32 update and the Philox draws
// each run as a loop the compiler can vectorize.
template <typename GradT>
__attribute__((always_inline)) inline void bf16_range(uint16_t* __restrict__ p,
                                                      const GradT* __restrict__ g,
                                                      float* __restrict__ m, float* __restrict__ v,
                                                      int64_t lo, int64_t hi,
                                                      const AdamWScalars& s, uint64_t seed,
                                                      uint64_t step, uint64_t base) {
  alignas(64) float buf[kChunk];
  for (int64_t c0 = lo; c0 < hi; c0 += kChunk) {
    const int64_t len = std::min<int64_t>(hi - c0, kChunk);
    for (int64_t i = 0; i < len; ++i) {
      const int64_t k = c0 + i;
      buf[i] = ldet::adamw_element(ldet::bf16_to_float(p[k]), ldet::Elem<GradT>::load(g, k),
                                   m + k, v + k, s);
    }
    sr_write(p + c0, buf, len, base + static_cast<uint64_t>(c0), seed, step);
  }
}

}  // namespace

// The hot loops are compiled twice, for AVX2 and for baseline x86-64, and picked at load time
// (GCC ifunc). Neither may change bytes: both use only IEEE-rounded +,-,*,/,sqrt without FMA
// (-ffp-contract=off; "avx2" does not enable FMA) and integer Philox arithmetic.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define LDET_CPU_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define LDET_CPU_CLONES
#endif

namespace ldet {
namespace cpu_detail {

using RangeFn = void (*)(void*, const void*, float*, float*, int64_t, int64_t,
                         const AdamWScalars&, uint64_t, uint64_t, uint64_t);

#define LDET_F32_RANGE(NAME, GT)                                                              \
  LDET_CPU_CLONES void NAME(void* p, const void* g, float* m, float* v, int64_t lo, int64_t hi, \
                            const AdamWScalars& s, uint64_t seed, uint64_t step, uint64_t base) { \
    adamw_sr_block<float, GT>(static_cast<float*>(p), static_cast<const GT*>(g), m, v, lo, hi,  \
                              s, seed, step, base);                                             \
  }
#define LDET_BF16_RANGE(NAME, GT)                                                             \
  LDET_CPU_CLONES void NAME(void* p, const void* g, float* m, float* v, int64_t lo, int64_t hi, \
                            const AdamWScalars& s, uint64_t seed, uint64_t step, uint64_t base) { \
    bf16_range<GT>(static_cast<uint16_t*>(p), static_cast<const GT*>(g), m, v, lo, hi, s, seed, \
                   step, base);                                                                 \
  }
LDET_F32_RANGE(range_f32_f32, float)
LDET_F32_RANGE(range_f32_bf16, uint16_t)
LDET_BF16_RANGE(range_bf16_f32, float)
LDET_BF16_RANGE(range_bf16_bf16, uint16_t)

LDET_CPU_CLONES void sr_range(uint16_t* out, const float* x, int64_t lo, int64_t hi,
                              uint64_t seed, uint64_t step, uint64_t base) {
  for (int64_t c0 = lo; c0 < hi; c0 += kChunk) {
    sr_write(out + c0, x + c0, std::min<int64_t>(hi - c0, kChunk),
             base + static_cast<uint64_t>(c0), seed, step);
  }
}

}  // namespace cpu_detail
}  // namespace ldet

namespace {

void adamw_sr_step_cpu(at::Tensor param, const at::Tensor& grad, at::Tensor exp_avg,
                       at::Tensor exp_avg_sq, double decay, double beta1, double one_minus_beta1,
                       double beta2, double one_minus_beta2, double step_size, double bc2_sqrt,
                       double eps, int64_t seed, int64_t step, int64_t base_index) {
  const ldet::AdamWLaunch a =
      ldet::prepare_adamw_sr(param, grad, exp_avg, exp_avg_sq, decay, beta1, one_minus_beta1,
                             beta2, one_minus_beta2, step_size, bc2_sqrt, eps, seed, step,
                             base_index);
  LDET_CHECK(param.device().is_cpu(), "adamw_sr_step (CPU): param must be on the CPU");
  const int64_t n = param.numel();
  if (n == 0) return;
  using namespace ldet::cpu_detail;
  const RangeFn fns[2][2] = {{range_bf16_bf16, range_bf16_f32}, {range_f32_bf16, range_f32_f32}};
  const RangeFn fn = fns[a.param_fp32][a.grad_fp32];
  void* p = param.data_ptr();
  const void* g = grad.data_ptr();
  float* mp = exp_avg.data_ptr<float>();
  float* vp = exp_avg_sq.data_ptr<float>();
  // Tasks own whole Philox blocks of global indices, so which task computes an element (and
  // how many threads there are) cannot change its bytes.
  const int64_t nblk = ldet::num_philox_blocks(a.base, n);
  ldet::ieee_parallel_for(0, nblk, kGrainBlocks, [&](int64_t b0, int64_t b1) {
    int64_t lo, hi, lo_end, hi_end;
    ldet::philox_block_range(b0, a.base, n, &lo, &hi);
    ldet::philox_block_range(b1 - 1, a.base, n, &lo_end, &hi_end);
    fn(p, g, mp, vp, lo, hi_end, a.s, a.seed, a.step, a.base);
  });
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
  ldet::ieee_parallel_for(0, ldet::num_philox_blocks(base, n), kGrainBlocks, [&](int64_t b0, int64_t b1) {
    int64_t lo, hi, lo_end, hi_end;
    ldet::philox_block_range(b0, base, n, &lo, &hi);
    ldet::philox_block_range(b1 - 1, base, n, &lo_end, &hi_end);
    ldet::cpu_detail::sr_range(op, xp, lo, hi_end, static_cast<uint64_t>(seed),
                               static_cast<uint64_t>(step), base);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(ldet, CPU, m) {
  m.impl("adamw_sr_step", &ldet::ieee_op<&adamw_sr_step_cpu>::call);
  m.impl("sr_round_bf16", &ldet::ieee_op<&sr_round_bf16_cpu>::call);
}

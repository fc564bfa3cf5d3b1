// The AdamWSR element update and the bf16 stochastic rounding, shared by csrc/cpu/adamw_sr.cpp
// and csrc/cuda/adamw_sr.cu so that CPU and GPU compute the same bytes.
//
// ---------------------------------------------------------------------------------------
// Update of one element (ldet-v1). Every line is one IEEE fp32 operation, rounded to nearest
// even, in this order; nothing is fused (device code uses the __f*_rn intrinsics, which nvcc
// never contracts into FMA; host code is built with -ffp-contract=off). Subnormals are kept.
//   p, g  = param and grad, widened exactly to fp32 (bf16 -> fp32 is exact)
//   m     = (beta1 * m) + (one_minus_beta1 * g)
//   v     = (beta2 * v) + (one_minus_beta2 * (g * g))
//   p     = p * decay
//   denom = (sqrt(v) / bias_correction2_sqrt) + eps
//   p     = p - (step_size * (m / denom))
// The fp32 scalars are the host's fp64 values (see lightning_det/optim/adamw_sr.py) rounded
// once to fp32 with round-to-nearest-even.
//
// bf16 write-back (stochastic rounding, ldet-v1)
//   u = bits of the fp32 result p.
//   Inf:  u >> 16 (exact: the low half is zero).
//   NaN:  (u >> 16) | 0x0040: sign and high payload kept, forced quiet so that truncation
//         cannot turn it into an infinity.
//   Else: (u + r) >> 16 with r the element's 16-bit Philox draw (csrc/philox.h). The magnitude
//         rounds away from zero with probability (u & 0xffff) / 65536 and toward zero
//         otherwise, so E[result] = p exactly. A value within one bf16 ULP of the largest finite
//         bf16 may round up to inf, as true stochastic rounding must.
// ---------------------------------------------------------------------------------------
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "longacc.h"
#include "philox.h"

namespace ldet {
namespace fp32 {

#if defined(__CUDA_ARCH__)
LDET_HD float add(float a, float b) { return __fadd_rn(a, b); }
LDET_HD float sub(float a, float b) { return __fsub_rn(a, b); }
LDET_HD float mul(float a, float b) { return __fmul_rn(a, b); }
LDET_HD float div(float a, float b) { return __fdiv_rn(a, b); }
LDET_HD float sqrt(float a) { return __fsqrt_rn(a); }
#else
LDET_HD float add(float a, float b) { return a + b; }
LDET_HD float sub(float a, float b) { return a - b; }
LDET_HD float mul(float a, float b) { return a * b; }
LDET_HD float div(float a, float b) { return a / b; }
LDET_HD float sqrt(float a) { return std::sqrt(a); }
#endif

}  // namespace fp32

// bf16 is carried as its raw 16 bits so that CPU and CUDA need no bf16 type of their own.
LDET_HD float bf16_to_float(uint16_t h) { return float_of(static_cast<uint32_t>(h) << 16); }

// r16 in [0, 65535]: the element's Philox draw.
LDET_HD uint16_t bf16_stochastic_round(float x, uint32_t r16) {
  const uint32_t u = bits_of(x);
  if ((u & 0x7f800000u) == 0x7f800000u) {
    const uint32_t hi = u >> 16;
    return static_cast<uint16_t>((u & 0x007fffffu) ? (hi | 0x0040u) : hi);
  }
  return static_cast<uint16_t>((u + r16) >> 16);
}

struct AdamWScalars {
  float decay;            // 1 - lr * weight_decay
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float step_size;        // lr / (1 - beta1^step)
  float bc2_sqrt;         // sqrt(1 - beta2^step)
  float eps;
};

// Returns the new parameter value in fp32; updates m and v in place.
LDET_HD float adamw_element(float p, float g, float* m, float* v, const AdamWScalars& s) {
  using namespace fp32;
  const float m1 = add(mul(s.beta1, *m), mul(s.one_minus_beta1, g));
  const float v1 = add(mul(s.beta2, *v), mul(s.one_minus_beta2, mul(g, g)));
  *m = m1;
  *v = v1;
  const float pd = mul(p, s.decay);
  const float denom = add(div(sqrt(v1), s.bc2_sqrt), s.eps);
  return sub(pd, mul(s.step_size, div(m1, denom)));
}

template <typename T>
struct Elem;
template <>
struct Elem<float> {
  LDET_HD static float load(const float* p, int64_t i) { return p[i]; }
};
template <>
struct Elem<uint16_t> {
  LDET_HD static float load(const uint16_t* p, int64_t i) { return bf16_to_float(p[i]); }
};

// Philox blocks are aligned to global indices, not to the tensor: block t of a tensor with
// base_index `base` and n elements covers local indices [*lo, *hi). Threads and CUDA blocks
// own whole Philox blocks, so each draw is computed once.
LDET_HD int64_t num_philox_blocks(uint64_t base, int64_t n) {
  return static_cast<int64_t>(((base + static_cast<uint64_t>(n) + 7) >> 3) - (base >> 3));
}
LDET_HD void philox_block_range(int64_t t, uint64_t base, int64_t n, int64_t* lo, int64_t* hi) {
  const int64_t start = static_cast<int64_t>(((base >> 3) + static_cast<uint64_t>(t)) << 3) -
                        static_cast<int64_t>(base);
  *lo = start < 0 ? 0 : start;
  *hi = start + 8 > n ? n : start + 8;
}

// Updates local elements [lo, hi), which share one Philox block. ParamT/GradT: float or
// uint16_t (bf16 bits). base: the tensor's base_index.
template <typename ParamT, typename GradT>
LDET_HD void adamw_sr_block(ParamT* param, const GradT* grad, float* m, float* v, int64_t lo,
                            int64_t hi, const AdamWScalars& s, uint64_t seed, uint64_t step,
                            uint64_t base) {
  if constexpr (std::is_same<ParamT, float>::value) {
    for (int64_t i = lo; i < hi; ++i) {
      param[i] = adamw_element(param[i], Elem<GradT>::load(grad, i), m + i, v + i, s);
    }
  } else {
    const Philox4 bits = philox_block(seed, step, (base + static_cast<uint64_t>(lo)) >> 3);
    for (int64_t i = lo; i < hi; ++i) {
      const float out =
          adamw_element(bf16_to_float(param[i]), Elem<GradT>::load(grad, i), m + i, v + i, s);
      param[i] = bf16_stochastic_round(out, philox_draw16(bits, base + static_cast<uint64_t>(i)));
    }
  }
}

// Stochastic rounding alone (the op ldet::sr_round_bf16), same draws as adamw_sr_block.
LDET_HD void sr_round_block(const float* x, uint16_t* out, int64_t lo, int64_t hi, uint64_t seed,
                            uint64_t step, uint64_t base) {
  const Philox4 bits = philox_block(seed, step, (base + static_cast<uint64_t>(lo)) >> 3);
  for (int64_t i = lo; i < hi; ++i) {
    out[i] = bf16_stochastic_round(x[i], philox_draw16(bits, base + static_cast<uint64_t>(i)));
  }
}

}  // namespace ldet

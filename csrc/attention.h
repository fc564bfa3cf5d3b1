// Fused deterministic attention: the definition every device computes, written once for the CPU
// and the CUDA build (csrc/cpu/attention_cpu.cpp, csrc/cuda/attention_cuda.cu).
//
// Why this arithmetic: attention's sums run over one (batch, head) slice only (over the head
// dimension and over the keys or queries of one sequence), never across samples or ranks. A sum
// that is a fixed sequence of IEEE operations is then a fixed function of that slice's inputs:
// it cannot depend on the batch, the other heads, the world size, tiling, thread counts or the
// device, as long as every device runs the same sequence. So each sum below is a *chain*: fp32
// fused multiply-adds in ascending index order, starting from +0,
//
//     chain_x (a_x * b_x) = fma(a_{n-1}, b_{n-1}, ... fma(a_1, b_1, fma(a_0, b_0, +0)))
//
// and a kernel may tile and parallelize across outputs as it likes but never splits or reorders
// one output's chain. "+ 0" below turns a -0 into +0 (the rest is unchanged). Nothing is materialized per (query, key) pair beyond a tile.
//
// Per slice, inputs widened exactly to fp32; i a query row, j a key, c a feature; "allowed":
// j <= i when causal, mask[i, j] when the mask is boolean, every j otherwise:
//
//   s_ij  = (chain_c q_ic k_jc + 0) * scale   [+ mask_ij when the mask is additive (float)]
//   m_i   = max over allowed j of s_ij (NaN ignored); 0 when that is -inf or no j is allowed
//   e_ij  = exp32(s_ij - m_i)                   the fp32 exp below (attn::exp32), one fixed sequence
//   l_i   = (((+0 + e_i0) + e_i1) + ...)        over allowed j ascending
//   r_i   = 1 / l_i  (0 when l_i == 0: a row with nothing to attend gives 0, as PyTorch's SDPA)
//   k_ij  = the keyed dropout multiplier (csrc/dropout.h; 1 without dropout): 1/(1-p) or 0
//   t_ij  = e_ij * k_ij
//   u_ic  = chain over allowed j of t_ij v_jc,  o_ic = u_ic * r_i
//
// Backward, from dO and the forward's fp32 o, m, r:
//
//   d_i   = chain_c dO_ic o_ic                  (= rowsum(dO * O), dropout included)
//   p_ij  = e_ij * r_i,  pk_ij = p_ij * k_ij   (0 where not allowed)
//   dp_ij = (chain_c dO_ic v_jc + 0) * k_ij
//   ds_ij = (p_ij * (dp_ij - d_i)) * scale
//   dv_jc = chain over allowed (h, i) of pk_ij dO_ic   (query heads h of a key/value head, each
//   dk_jc = chain over allowed (h, i) of ds_ij q_ic     ascending, then i ascending)
//   dq_ic = chain over allowed j of ds_ij k_jc
//
// A key that is not allowed adds no term to any chain (it is skipped, not multiplied by zero),
// so a non-finite value there cannot reach an output. Every listed step is one IEEE operation
// (each device rounds it identically: builds pass -ffp-contract=off / -fmad=false) except exp,
// which is the fp32 sequence of attn::exp32. Result: the same bytes on every device, for any batch,
// head count and tiling; tests/test_fused_attention.py holds both devices to a plain-PyTorch
// evaluation of this definition (lightning_det/reference/attention_ref.py).
//
// Unlike the GEMMs, these sums are not the exact sum rounded once: fp32 chains round at each
// step, with the accuracy of an fp32 attention (tests compare against fp64). Exactness would not
// buy any invariance here, since no sum is ever split across devices or micro-batches.
#pragma once

#include <cmath>
#include <cstdint>

#include "detmath.h"
#include "dropout.h"
#include "ldet_hd.h"
#include "longacc.h"

namespace ldet {
namespace attn {

// Element type codes of the inputs (q, k, v, dO) and of an additive mask.
enum Dtype : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// fp16 bits -> fp32, exactly (every fp16 value is an fp32 value).
LDET_HD float half_bits_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t ex = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (ex == 0x1fu) return float_of(sign | 0x7f800000u | (man << 13));  // inf / NaN
  if (ex != 0) return float_of(sign | ((ex + 112u) << 23) | (man << 13));
  if (man == 0) return float_of(sign);
  // subnormal fp16: man * 2^-24, a normal fp32
  int shift = 0;
  uint32_t m = man;
  while ((m & 0x400u) == 0) {
    m <<= 1;
    ++shift;
  }
  return float_of(sign | (uint32_t(113 - shift) << 23) | ((m & 0x3ffu) << 13));
}

// Element i of a buffer of dtype code dt, widened exactly to fp32.
LDET_HD float load(const void* p, int64_t i, int dt) {
  if (dt == kF32) return static_cast<const float*>(p)[i];
  const uint16_t b = static_cast<const uint16_t*>(p)[i];
  if (dt == kBF16) return float_of(uint32_t(b) << 16);
  return half_bits_to_float(b);
}

LDET_HD float fma32(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// The steps of the definition above, one function each, so both devices call the same code.
// A chain's end is taken + 0 (an exact zero is +0): a kernel may pad a chain with fma(0, 0, acc)
// terms (the head dimension up to its tile width), which change nothing else.
LDET_HD float chain_end(float acc) { return acc + 0.0f; }
LDET_HD float score(float chain, float scale) { return chain_end(chain) * scale; }
LDET_HD float row_max_step(float m, float s) { return s > m ? s : m; }  // NaN never wins
LDET_HD float row_max_final(float m) { return m == -INFINITY ? 0.0f : m; }
LDET_HD float rint32(float x) {  // round to nearest, ties to even (the default rounding mode)
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  return std::rint(x);
#endif
}

// exp(x) in fp32 operations: x = k ln2 + r (Cody-Waite, ln2 in two parts: k * kLn2Hi is exact
// for |k| < 2^9), |r| <= ~ln2/2, then the Taylor polynomial of degree 7 in Horner form with fma
// (truncation below 2^-27 of the result, so within about an ulp of exp), times 2^k in two exact
// steps. Below -87.33 (results under the smallest normal fp32) it is 0; above 88.72, +inf; NaN
// stays NaN. Fixed and fp32 throughout: the attention weights cost a dozen fp32 operations each,
// where the fp64 detmath exp cost some thirty fp64 ones, on a GPU's fp64 units at half the rate.
constexpr float kExpLn2Hi = 0x1.62e400p-1f;   // low 12 bits of the significand zero
constexpr float kExpLn2Lo = 0x1.7f7d1cp-20f;
constexpr float kExpLog2e = 0x1.715476p+0f;
LDET_HD float exp32(float x) {
  if (x != x) return x;
  if (x > 88.72f) return float_of(0x7f800000u);
  if (x < -87.33f) return 0.0f;
  const float k = rint32(x * kExpLog2e);
  const float r = fma32(k, -kExpLn2Lo, fma32(k, -kExpLn2Hi, x));
  constexpr float c[8] = {0x1p+0f, 0x1p+0f, 0x1p-1f, 0x1.555556p-3f, 0x1.555556p-5f, 0x1.111112p-7f,
                          0x1.6c16c2p-10f, 0x1.a01a02p-13f};  // 1/n!, each rounded to fp32
  float p = c[7];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int n = 6; n >= 0; --n) p = fma32(p, r, c[n]);
  const int ki = static_cast<int>(k);  // in [-126, 128]
  const int k1 = ki / 2;
  return (p * float_of(uint32_t(k1 + 127) << 23)) * float_of(uint32_t(ki - k1 + 127) << 23);
}

LDET_HD float weight(float s, float m) { return exp32(s - m); }
LDET_HD float reciprocal(float l) { return l == 0.0f ? 0.0f : 1.0f / l; }
LDET_HD float grad_score(float p, float dp, float d, float scale) { return (p * (dp - d)) * scale; }

// Shapes and element strides, read by both devices. q: (B, H, Lq, E), k: (B, Hkv, Lk, E),
// v: (B, Hkv, Lk, Ev), each with unit stride in its last dimension; query head h reads key/value
// head h / (H / Hkv).
struct Shape {
  int64_t B, H, Hkv, Lq, Lk, E, Ev;
  int64_t q_sb, q_sh, q_sl;
  int64_t k_sb, k_sh, k_sl;
  int64_t v_sb, v_sh, v_sl;
  int dtype;
};

// The mask: none, boolean (which keys each query may attend) or additive, as an expanded
// (B, H, Lq, Lk) view with any strides.
struct Mask {
  enum Kind : int { kNone = 0, kBool = 1, kAdd = 2 };
  int kind = kNone;
  int dtype = kF32;  // of an additive mask
  const void* ptr = nullptr;
  int64_t sb = 0, sh = 0, sq = 0, sk = 0;
  bool causal = false;

  LDET_HD int64_t offset(int64_t b, int64_t h, int64_t i, int64_t j) const {
    return b * sb + h * sh + i * sq + j * sk;
  }
  LDET_HD bool allowed(int64_t b, int64_t h, int64_t i, int64_t j) const {
    if (causal && j > i) return false;
    if (kind == kBool) return static_cast<const bool*>(ptr)[offset(b, h, i, j)];
    return true;
  }
  // s_ij with the additive mask applied (one IEEE add), for an allowed key.
  LDET_HD float apply(float s, int64_t b, int64_t h, int64_t i, int64_t j) const {
    return kind == kAdd ? s + load(ptr, offset(b, h, i, j), dtype) : s;
  }
};

// Attention dropout: element (h, i, j) of sample b is element (h * Lq + i) * Lk + j of global
// sample offset + b (the order of a (B, H, Lq, Lk) probability tensor, batch taken out), drawn
// as lightning_det.ops.dropout.dropout_mask draws it.
struct Dropout {
  bool on = false;
  DropoutKey key{0, 0};
  uint64_t step = 0, threshold = 0;
  uint32_t offset = 0;
  float mult = 1.0f;  // 1/(1-p) rounded to fp32; 0 when p == 1

  LDET_HD float multiplier(int64_t b, int64_t h, int64_t i, int64_t j, int64_t Lq, int64_t Lk) const {
    if (!on) return 1.0f;
    const uint64_t e = (uint64_t(h) * uint64_t(Lq) + uint64_t(i)) * uint64_t(Lk) + uint64_t(j);
    const Philox4 bits = dropout_block(key, step, offset + uint32_t(b), uint32_t(e >> 2));
    return dropout_kept(bits, e, threshold) ? mult : 0.0f;
  }
};

}  // namespace attn

// Everything a kernel needs besides the tensors' data (csrc/attention_checks.h fills it in).
struct AttnLaunch {
  attn::Shape shape;
  attn::Mask mask;
  attn::Dropout dropout;
  float scale;
};

}  // namespace ldet

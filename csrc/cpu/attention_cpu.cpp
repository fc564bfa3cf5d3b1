// CPU implementation of ldet::attention_fwd / attention_bwd (the definition: csrc/attention.h).
//
// The forward runs one task per block of query rows; each row keeps one row of scores (Lk
// floats). The backward runs one task per key/value head of a sequence: it walks that head's
// query heads and rows in the definition's order, so every dk/dv chain receives its terms in
// ascending (h, i) and every dq chain in ascending j. Loops run across independent chains
// (keys, features), never inside one, so the compiler may vectorize them without reordering a
// sum.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

#include "check.h"
#include "attention.h"
#include "attention_checks.h"
#include "cpu/fp_env.h"

namespace {

using namespace ldet;
using attn::fma32;

constexpr uint32_t kCanonicalNaN = 0x7fc00000u;

// NaN bytes differ between devices (x86 produces a negative quiet NaN): every NaN result is
// written as the canonical quiet NaN.
inline float canonical(float x) { return x != x ? float_of(kCanonicalNaN) : x; }

// rows x width elements of a strided buffer (row r at element r * row_stride), widened to fp32.
void widen_rows(const void* p, int dt, int64_t rows, int64_t width, int64_t row_stride, float* out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < width; ++c) out[r * width + c] = attn::load(p, r * row_stride + c, dt);
}

// The same, transposed: out[c * rows + r].
void widen_rows_t(const void* p, int dt, int64_t rows, int64_t width, int64_t row_stride, float* out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < width; ++c) out[c * rows + r] = attn::load(p, r * row_stride + c, dt);
}

// s[j] = chain_c a[c] * bt[c * n + j] for j < n: n independent chains, each over c ascending.
inline void chains_over_c(const float* __restrict a, const float* __restrict bt, int64_t width, int64_t n,
                          int64_t bt_stride, float* __restrict s) {
  for (int64_t j = 0; j < n; ++j) s[j] = 0.0f;
  for (int64_t c = 0; c < width; ++c) {
    const float ac = a[c];
    const float* row = bt + c * bt_stride;
    for (int64_t j = 0; j < n; ++j) s[j] = fma32(ac, row[j], s[j]);
  }
}

struct Slice {
  const char* q;  // element pointers of query head h's slice (widened on read)
  const char* k;
  const char* v;
};

inline int64_t elem_size(int dt) { return dt == attn::kF32 ? 4 : 2; }

// One query row's scores s[j] (j < n, the keys it may reach: n = min(i + 1, Lk) when causal)
// and which of them are allowed.
inline int64_t row_scores(const AttnLaunch& a, int64_t b, int64_t h, int64_t i, const float* qrow, const float* kt,
                          float* s, unsigned char* ok) {
  const auto& sh = a.shape;
  const int64_t n = a.mask.causal ? std::min(i + 1, sh.Lk) : sh.Lk;
  chains_over_c(qrow, kt, sh.E, n, sh.Lk, s);
  for (int64_t j = 0; j < n; ++j) {
    ok[j] = a.mask.allowed(b, h, i, j);
    s[j] = a.mask.apply(attn::score(s[j], a.scale), b, h, i, j);
  }
  return n;
}

std::tuple<at::Tensor, at::Tensor> attention_fwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const c10::optional<at::Tensor>& mask, double scale, bool causal,
                                                     at::IntArrayRef dropout, double dropout_mult) {
  const AttnLaunch a = prepare_attention(q, k, v, mask, scale, causal, dropout, dropout_mult);
  LDET_CHECK(q.device().is_cpu(), "attention_fwd (CPU): q must be on the CPU");
  const auto& sh = a.shape;
  at::Tensor o = at::empty({sh.B, sh.H, sh.Lq, sh.Ev}, q.options().dtype(at::kFloat));
  at::Tensor stats = at::empty({sh.B, sh.H, sh.Lq, 2}, q.options().dtype(at::kFloat));
  if (o.numel() == 0) {
    stats.zero_();
    return {o, stats};
  }
  const int64_t group = sh.H / sh.Hkv, es = elem_size(sh.dtype);
  constexpr int64_t kRows = 16;
  const int64_t blocks = (sh.Lq + kRows - 1) / kRows;
  const char* qp = static_cast<const char*>(q.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  float* op = o.data_ptr<float>();
  float* stp = stats.data_ptr<float>();
  ieee_parallel_for(0, sh.B * sh.H * blocks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> kt(sh.E * sh.Lk), vr(sh.Lk * sh.Ev), s(sh.Lk), w(sh.Lk), qrow(sh.E), u(sh.Ev);
    std::vector<unsigned char> ok(sh.Lk);
    int64_t loaded = -1;  // the (b, kv head) whose k, v are in kt, vr
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / (sh.H * blocks), h = (t / blocks) % sh.H, blk = t % blocks;
      const int64_t hk = h / group;
      if (loaded != b * sh.Hkv + hk) {
        widen_rows_t(kp + (b * sh.k_sb + hk * sh.k_sh) * es, sh.dtype, sh.Lk, sh.E, sh.k_sl, kt.data());
        widen_rows(vp + (b * sh.v_sb + hk * sh.v_sh) * es, sh.dtype, sh.Lk, sh.Ev, sh.v_sl, vr.data());
        loaded = b * sh.Hkv + hk;
      }
      for (int64_t i = blk * kRows; i < std::min(sh.Lq, (blk + 1) * kRows); ++i) {
        widen_rows(qp + (b * sh.q_sb + h * sh.q_sh + i * sh.q_sl) * es, sh.dtype, 1, sh.E, 0, qrow.data());
        const int64_t n = row_scores(a, b, h, i, qrow.data(), kt.data(), s.data(), ok.data());
        float m = -INFINITY;
        for (int64_t j = 0; j < n; ++j)
          if (ok[j]) m = attn::row_max_step(m, s[j]);
        m = attn::row_max_final(m);
        float l = 0.0f;
        for (int64_t j = 0; j < n; ++j) {
          if (!ok[j]) continue;
          const float e = attn::weight(s[j], m);
          l = l + e;
          w[j] = a.dropout.on ? e * a.dropout.multiplier(b, h, i, j, sh.Lq, sh.Lk) : e;
        }
        const float r = attn::reciprocal(l);
        std::fill(u.begin(), u.end(), 0.0f);
        for (int64_t j = 0; j < n; ++j) {
          if (!ok[j]) continue;
          const float wj = w[j];
          const float* vj = vr.data() + j * sh.Ev;
          for (int64_t c = 0; c < sh.Ev; ++c) u[c] = fma32(wj, vj[c], u[c]);
        }
        const int64_t row = (b * sh.H + h) * sh.Lq + i;
        for (int64_t c = 0; c < sh.Ev; ++c) op[row * sh.Ev + c] = canonical(u[c] * r);
        stp[row * 2] = canonical(m);
        stp[row * 2 + 1] = canonical(r);
      }
    }
  });
  return {o, stats};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& o,
    const at::Tensor& stats, const c10::optional<at::Tensor>& mask, double scale, bool causal, at::IntArrayRef dropout,
    double dropout_mult) {
  const AttnLaunch a = prepare_attention(q, k, v, mask, scale, causal, dropout, dropout_mult);
  check_attention_bwd(dout, o, stats, a, q);
  LDET_CHECK(q.device().is_cpu(), "attention_bwd (CPU): q must be on the CPU");
  const auto& sh = a.shape;
  at::Tensor dq = at::zeros({sh.B, sh.H, sh.Lq, sh.E}, q.options().dtype(at::kFloat));
  at::Tensor dk = at::zeros({sh.B, sh.Hkv, sh.Lk, sh.E}, q.options().dtype(at::kFloat));
  at::Tensor dv = at::zeros({sh.B, sh.Hkv, sh.Lk, sh.Ev}, q.options().dtype(at::kFloat));
  if (sh.B * sh.H * sh.Lq == 0 || sh.Lk == 0) return {dq, dk, dv};
  const int64_t group = sh.H / sh.Hkv, es = elem_size(sh.dtype);
  const char* qp = static_cast<const char*>(q.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const void* dop = dout.data_ptr();
  const float* opp = o.data_ptr<float>();
  const float* stp = stats.data_ptr<float>();
  float* dqp = dq.data_ptr<float>();
  float* dkp = dk.data_ptr<float>();
  float* dvp = dv.data_ptr<float>();
  ieee_parallel_for(0, sh.B * sh.Hkv, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> kt(sh.E * sh.Lk), kr(sh.Lk * sh.E), vt(sh.Ev * sh.Lk), s(sh.Lk), dp(sh.Lk), pk(sh.Lk),
        ds(sh.Lk), qrow(sh.E), dorow(sh.Ev), dqrow(sh.E);
    std::vector<unsigned char> ok(sh.Lk);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / sh.Hkv, hk = t % sh.Hkv;
      const char* kb = kp + (b * sh.k_sb + hk * sh.k_sh) * es;
      widen_rows_t(kb, sh.dtype, sh.Lk, sh.E, sh.k_sl, kt.data());
      widen_rows(kb, sh.dtype, sh.Lk, sh.E, sh.k_sl, kr.data());
      widen_rows_t(vp + (b * sh.v_sb + hk * sh.v_sh) * es, sh.dtype, sh.Lk, sh.Ev, sh.v_sl, vt.data());
      float* dkb = dkp + t * sh.Lk * sh.E;
      float* dvb = dvp + t * sh.Lk * sh.Ev;
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        for (int64_t i = 0; i < sh.Lq; ++i) {
          const int64_t row = (b * sh.H + h) * sh.Lq + i;
          widen_rows(qp + (b * sh.q_sb + h * sh.q_sh + i * sh.q_sl) * es, sh.dtype, 1, sh.E, 0, qrow.data());
          for (int64_t c = 0; c < sh.Ev; ++c) dorow[c] = attn::load(dop, row * sh.Ev + c, sh.dtype);
          float d = 0.0f;
          for (int64_t c = 0; c < sh.Ev; ++c) d = fma32(dorow[c], opp[row * sh.Ev + c], d);
          const float m = stp[row * 2], r = stp[row * 2 + 1];
          const int64_t n = row_scores(a, b, h, i, qrow.data(), kt.data(), s.data(), ok.data());
          chains_over_c(dorow.data(), vt.data(), sh.Ev, n, sh.Lk, dp.data());
          for (int64_t j = 0; j < n; ++j) {
            if (!ok[j]) continue;
            const float p = attn::weight(s[j], m) * r;
            float dpj = attn::chain_end(dp[j]);
            pk[j] = p;
            if (a.dropout.on) {
              const float mult = a.dropout.multiplier(b, h, i, j, sh.Lq, sh.Lk);
              pk[j] = p * mult;
              dpj = dpj * mult;
            }
            ds[j] = attn::grad_score(p, dpj, d, a.scale);
          }
          std::fill(dqrow.begin(), dqrow.end(), 0.0f);
          for (int64_t j = 0; j < n; ++j) {
            if (!ok[j]) continue;
            const float dsj = ds[j], pkj = pk[j];
            const float* kj = kr.data() + j * sh.E;
            float* dkj = dkb + j * sh.E;
            float* dvj = dvb + j * sh.Ev;
            for (int64_t c = 0; c < sh.E; ++c) dqrow[c] = fma32(dsj, kj[c], dqrow[c]);
            for (int64_t c = 0; c < sh.E; ++c) dkj[c] = fma32(dsj, qrow[c], dkj[c]);
            for (int64_t c = 0; c < sh.Ev; ++c) dvj[c] = fma32(pkj, dorow[c], dvj[c]);
          }
          for (int64_t c = 0; c < sh.E; ++c) dqp[row * sh.E + c] = canonical(dqrow[c]);
        }
      }
      for (int64_t x = 0; x < sh.Lk * sh.E; ++x) dkb[x] = canonical(dkb[x]);
      for (int64_t x = 0; x < sh.Lk * sh.Ev; ++x) dvb[x] = canonical(dvb[x]);
    }
  });
  return {dq, dk, dv};
}

at::Tensor attention_probs_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& stats,
                               const c10::optional<at::Tensor>& mask, double scale, bool causal) {
  const AttnLaunch a = prepare_attention(q, k, k, mask, scale, causal, {}, 1.0);
  check_attention_stats(stats, a, q);
  LDET_CHECK(q.device().is_cpu(), "attention_probs (CPU): q must be on the CPU");
  const auto& sh = a.shape;
  at::Tensor p = at::zeros({sh.B, sh.H, sh.Lq, sh.Lk}, q.options().dtype(at::kFloat));
  if (p.numel() == 0) return p;
  const int64_t group = sh.H / sh.Hkv, es = elem_size(sh.dtype);
  const char* qp = static_cast<const char*>(q.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const float* stp = stats.data_ptr<float>();
  float* pp = p.data_ptr<float>();
  ieee_parallel_for(0, sh.B * sh.H, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> kt(sh.E * sh.Lk), s(sh.Lk), qrow(sh.E);
    std::vector<unsigned char> ok(sh.Lk);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / sh.H, h = t % sh.H, hk = h / group;
      widen_rows_t(kp + (b * sh.k_sb + hk * sh.k_sh) * es, sh.dtype, sh.Lk, sh.E, sh.k_sl, kt.data());
      for (int64_t i = 0; i < sh.Lq; ++i) {
        const int64_t row = t * sh.Lq + i;
        widen_rows(qp + (b * sh.q_sb + h * sh.q_sh + i * sh.q_sl) * es, sh.dtype, 1, sh.E, 0, qrow.data());
        const int64_t n = row_scores(a, b, h, i, qrow.data(), kt.data(), s.data(), ok.data());
        for (int64_t j = 0; j < n; ++j)
          if (ok[j]) pp[row * sh.Lk + j] = canonical(attn::weight(s[j], stp[row * 2]) * stp[row * 2 + 1]);
      }
    }
  });
  return p;
}

}  // namespace

TORCH_LIBRARY_IMPL(ldet, CPU, m) {
  m.impl("attention_fwd", &attention_fwd_cpu);
  m.impl("attention_bwd", &attention_bwd_cpu);
  m.impl("attention_probs", &attention_probs_cpu);
}

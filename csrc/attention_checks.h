// Argument checks of ldet::attention_fwd / attention_bwd shared by the CPU and CUDA
// implementations, so both devices reject the same inputs with the same messages, and the
// translation of the tensors into the plain structs of csrc/attention.h.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "check.h"
#include "attention.h"
#include "dropout.h"

namespace ldet {

inline int attn_dtype(at::ScalarType st, const char* name) {
  if (st == at::kFloat) return attn::kF32;
  if (st == at::kBFloat16) return attn::kBF16;
  LDET_CHECK(st == at::kHalf, name, ": expected float32, bfloat16 or float16, got ", st);
  return attn::kF16;
}

inline void check_attn_operand(const at::Tensor& t, const char* name, const at::Tensor& q) {
  LDET_CHECK(t.dim() == 4, name, ": expected a 4-D (B, heads, L, E) tensor, got shape ", t.sizes());
  LDET_CHECK(t.scalar_type() == q.scalar_type(), name, ": expected dtype ", q.scalar_type(), " like q, got ",
              t.scalar_type());
  LDET_CHECK(t.device() == q.device(), name, ": expected device ", q.device(), " like q, got ", t.device());
  LDET_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, name, ": expected unit stride in the last dimension, got strides ",
              t.strides());
}

inline AttnLaunch prepare_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const c10::optional<at::Tensor>& mask, double scale, bool causal,
                                    at::IntArrayRef dropout, double dropout_mult) {
  AttnLaunch a{};
  a.shape.dtype = attn_dtype(q.scalar_type(), "q");
  check_attn_operand(q, "q", q);
  check_attn_operand(k, "k", q);
  check_attn_operand(v, "v", q);
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), E = q.size(3);
  const int64_t Hkv = k.size(1), Lk = k.size(2), Ev = v.size(3);
  LDET_CHECK(k.size(0) == B && k.size(3) == E, "k: expected shape (", B, ", Hkv, Lk, ", E, ") to match q ", q.sizes(),
              ", got ", k.sizes());
  LDET_CHECK(v.size(0) == B && v.size(1) == Hkv && v.size(2) == Lk, "v: expected shape (", B, ", ", Hkv, ", ", Lk,
              ", Ev) to match k ", k.sizes(), ", got ", v.sizes());
  LDET_CHECK(Hkv >= 1 && H % Hkv == 0, "k: expected a number of heads dividing q's ", H, ", got ", Hkv);
  LDET_CHECK(E >= 1 && E <= 256 && Ev >= 1 && Ev <= 256, "q, v: expected head dimensions in [1, 256], got E = ", E,
              " and Ev = ", Ev);
  a.shape.B = B, a.shape.H = H, a.shape.Hkv = Hkv, a.shape.Lq = Lq, a.shape.Lk = Lk, a.shape.E = E, a.shape.Ev = Ev;
  a.shape.q_sb = q.stride(0), a.shape.q_sh = q.stride(1), a.shape.q_sl = q.stride(2);
  a.shape.k_sb = k.stride(0), a.shape.k_sh = k.stride(1), a.shape.k_sl = k.stride(2);
  a.shape.v_sb = v.stride(0), a.shape.v_sh = v.stride(1), a.shape.v_sl = v.stride(2);
  LDET_CHECK(std::isfinite(scale), "scale: expected a finite float, got ", scale);
  a.scale = static_cast<float>(scale);
  LDET_CHECK(static_cast<double>(a.scale) == scale, "scale: expected a value representable in float32, got ", scale);

  a.mask.causal = causal;
  if (mask.has_value()) {
    const at::Tensor& mk = *mask;
    LDET_CHECK(!causal, "mask: expected None when causal is true");
    LDET_CHECK(mk.device() == q.device(), "mask: expected device ", q.device(), " like q, got ", mk.device());
    LDET_CHECK(mk.dim() == 4 && mk.size(0) == B && mk.size(1) == H && mk.size(2) == Lq && mk.size(3) == Lk,
                "mask: expected shape (", B, ", ", H, ", ", Lq, ", ", Lk, "), got ", mk.sizes());
    if (mk.scalar_type() == at::kBool) {
      a.mask.kind = attn::Mask::kBool;
    } else {
      a.mask.kind = attn::Mask::kAdd;
      a.mask.dtype = attn_dtype(mk.scalar_type(), "mask");
    }
    a.mask.ptr = mk.data_ptr();
    a.mask.sb = mk.stride(0), a.mask.sh = mk.stride(1), a.mask.sq = mk.stride(2), a.mask.sk = mk.stride(3);
  }

  if (!dropout.empty()) {
    LDET_CHECK(dropout.size() == 5, "dropout: expected [] or [threshold, seed, step, offset, site], got ",
                dropout.size(), " values");
    const int64_t threshold = dropout[0], seed = dropout[1], step = dropout[2], offset = dropout[3];
    LDET_CHECK(threshold >= 0 && threshold <= (int64_t(1) << 32), "dropout: threshold must be in [0, 2^32], got ",
                threshold);
    LDET_CHECK(seed >= 0 && step >= 0, "dropout: seed and step must be >= 0, got ", seed, " and ", step);
    LDET_CHECK(offset >= 0 && offset + B <= (int64_t(1) << 32), "dropout: offset + B must be in [0, 2^32], got ",
                offset, " + ", B);
    LDET_CHECK(H * Lq * Lk <= (int64_t(1) << 34), "dropout: at most 2^34 elements per sample, got H * Lq * Lk = ",
                H * Lq * Lk);
    a.dropout.on = true;
    a.dropout.key = dropout_site_key(static_cast<uint64_t>(seed), static_cast<uint64_t>(dropout[4]));
    a.dropout.step = static_cast<uint64_t>(step);
    a.dropout.threshold = static_cast<uint64_t>(threshold);
    a.dropout.offset = static_cast<uint32_t>(offset);
    a.dropout.mult = static_cast<float>(dropout_mult);
    LDET_CHECK(static_cast<double>(a.dropout.mult) == dropout_mult && dropout_mult >= 0,
                "dropout_mult: expected a float32 value >= 0, got ", dropout_mult);
  }
  return a;
}

inline void check_attention_stats(const at::Tensor& stats, const AttnLaunch& a, const at::Tensor& q) {
  const auto& s = a.shape;
  LDET_CHECK(stats.scalar_type() == at::kFloat && stats.is_contiguous() && stats.dim() == 4 &&
                  stats.size(0) == s.B && stats.size(1) == s.H && stats.size(2) == s.Lq && stats.size(3) == 2,
              "stats: expected the forward's contiguous float32 statistics of shape (", s.B, ", ", s.H, ", ", s.Lq,
              ", 2), got ", stats.scalar_type(), " of shape ", stats.sizes());
  LDET_CHECK(stats.device() == q.device(), "stats: expected device ", q.device(), " like q, got ", stats.device());
}

inline void check_attention_bwd(const at::Tensor& dout, const at::Tensor& o, const at::Tensor& stats,
                                const AttnLaunch& a, const at::Tensor& q) {
  const auto& s = a.shape;
  LDET_CHECK(dout.dim() == 4 && dout.size(0) == s.B && dout.size(1) == s.H && dout.size(2) == s.Lq &&
                  dout.size(3) == s.Ev,
              "dout: expected shape (", s.B, ", ", s.H, ", ", s.Lq, ", ", s.Ev, "), got ", dout.sizes());
  LDET_CHECK(dout.scalar_type() == q.scalar_type(), "dout: expected dtype ", q.scalar_type(), " like q, got ",
              dout.scalar_type());
  LDET_CHECK(dout.is_contiguous(), "dout: expected a contiguous tensor");
  LDET_CHECK(o.scalar_type() == at::kFloat && o.is_contiguous() && o.sizes() == dout.sizes(),
              "o: expected the forward's contiguous float32 output of shape ", dout.sizes(), ", got ",
              o.scalar_type(), " of shape ", o.sizes());
  for (const at::Tensor* t : {&dout, &o})
    LDET_CHECK(t->device() == q.device(), "dout, o: expected device ", q.device(), " like q, got ", t->device());
  check_attention_stats(stats, a, q);
}

}  // namespace ldet

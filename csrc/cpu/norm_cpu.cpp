// CPU implementations of norm_forward / norm_backward (schemas: csrc/schema/norm.cpp; the
// arithmetic: csrc/norm.h). One row at a time, rows in parallel: a row's bytes never depend on
// the thread split or on the other rows.
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "cpu/fp_env.h"
#include "norm.h"
#include "norm_checks.h"
#include "uninit.h"

namespace ldet {
namespace {

// Rows per parallel chunk: about 16K elements, so narrow rows do not pay a task each.
int64_t row_grain(int64_t W) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, W)); }

const float* data_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

at::Tensor contiguous_or_undefined(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->contiguous() : at::Tensor();
}

// round(exact sum_j term(j)) / W over one row.
template <class Term>
float row_mean(int64_t W, float width, const Term& term) {
  int64_t acc[LDET_WORDS];
  zero(acc);
  WindowAcc win;
  for (int64_t j = 0; j < W; ++j) norm_sum_add(win, acc, term(j), j);
  window_flush(win, acc);
  normalize(acc);
  return norm_mean(acc, width);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_forward_cpu(const at::Tensor& x,
                                                                const c10::optional<at::Tensor>& weight,
                                                                const c10::optional<at::Tensor>& bias, double eps,
                                                                bool rms) {
  check_norm_forward_args(x, weight, bias);
  const int64_t R = x.size(0), W = x.size(1);
  const at::Tensor xf = x.contiguous().to(at::kFloat);  // exact widening
  const at::Tensor wc = contiguous_or_undefined(weight), bc = contiguous_or_undefined(bias);
  const auto fopt = x.options().dtype(at::kFloat);
  // uninit: every element of the three is written below
  at::Tensor y = uninit({R, W}, x.options()), xhat = uninit({R, W}, fopt), rstd = uninit({R}, fopt);
  const float* xp = xf.data_ptr<float>();
  const float* wp = data_or_null(wc);
  const float* bp = data_or_null(bc);
  float* hp = xhat.data_ptr<float>();
  float* sp = rstd.data_ptr<float>();
  void* yp = y.data_ptr();
  const int fmt = out_format(x.scalar_type());
  const float width = float(W), e = float(eps);
  ieee_parallel_for(0, R, row_grain(W), [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r) {
      const float* xr = xp + r * W;
      const float mean = rms ? 0.0f : row_mean(W, width, [&](int64_t j) { return double(xr[j]); });
      const auto d = [&](int64_t j) { return rms ? xr[j] : xr[j] - mean; };
      const float rs = norm_rstd(row_mean(W, width, [&](int64_t j) {
                                   const double v = d(j);
                                   return v * v;  // exact: two 24-bit significands
                                 }),
                                 e);
      for (int64_t j = 0; j < W; ++j) {
        const float xh = d(j) * rs;
        hp[r * W + j] = xh;
        store_fmt(yp, r * W + j, round_float_fmt(norm_affine(xh, wp, bp, j), fmt), fmt);
      }
      sp[r] = rs;
    }
  });
  return {y, xhat, rstd};
}

at::Tensor norm_backward_cpu(const at::Tensor& gy, const at::Tensor& xhat, const at::Tensor& rstd,
                             const c10::optional<at::Tensor>& weight, bool rms, at::ScalarType out_dtype) {
  check_norm_backward_args(gy, xhat, rstd, weight);
  const int fmt = out_format(out_dtype);
  const int64_t R = gy.size(0), W = gy.size(1);
  const at::Tensor gf = gy.contiguous().to(at::kFloat), hc = xhat.contiguous(), sc = rstd.contiguous();
  const at::Tensor wc = contiguous_or_undefined(weight);
  at::Tensor gx = uninit({R, W}, gy.options().dtype(out_dtype));  // every element written below
  const float* gp = gf.data_ptr<float>();
  const float* hp = hc.data_ptr<float>();
  const float* sp = sc.data_ptr<float>();
  const float* wp = data_or_null(wc);
  void* op = gx.data_ptr();
  const float width = float(W);
  ieee_parallel_for(0, R, row_grain(W), [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r) {
      const float* gr = gp + r * W;
      const float* hr = hp + r * W;
      const auto g = [&](int64_t j) { return wp ? gr[j] * wp[j] : gr[j]; };
      const float m2 = row_mean(W, width, [&](int64_t j) { return double(g(j)) * double(hr[j]); });
      const float m1 = rms ? 0.0f : row_mean(W, width, [&](int64_t j) { return double(g(j)); });
      for (int64_t j = 0; j < W; ++j)
        store_fmt(op, r * W + j, round_float_fmt(norm_grad_input(g(j), hr[j], m1, m2, sp[r], rms), fmt), fmt);
    }
  });
  return gx;
}

}  // namespace

TORCH_LIBRARY_IMPL(ldet, CPU, m) {
  m.impl("norm_forward", &ldet::ieee_op<&norm_forward_cpu>::call);
  m.impl("norm_backward", &ldet::ieee_op<&norm_backward_cpu>::call);
}

}  // namespace ldet

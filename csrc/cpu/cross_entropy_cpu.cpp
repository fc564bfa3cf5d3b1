// CPU implementations of ce_forward / ce_backward (schemas: csrc/schema/cross_entropy.cpp; the
// arithmetic: csrc/cross_entropy.h). One row at a time, rows in parallel.
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "ce_checks.h"
#include "cpu/fp_env.h"
#include "cross_entropy.h"
#include "uninit.h"
#include "window_acc.h"

namespace ldet {
namespace {

int64_t row_grain(int64_t C) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, C)); }

std::tuple<at::Tensor, at::Tensor, at::Tensor> ce_forward_cpu(const at::Tensor& x, const at::Tensor& target,
                                                              const at::Tensor& valid) {
  check_ce_forward_args(x, target, valid);
  const int64_t N = x.size(0), C = x.size(1);
  const at::Tensor xf = x.contiguous().to(at::kFloat);  // exact widening
  const at::Tensor tc = target.contiguous(), vc = valid.contiguous();
  const auto fopt = x.options().dtype(at::kFloat);
  // uninit: every element of the three is written below
  at::Tensor loss = uninit({N}, fopt), e = uninit({N, C}, fopt), s = uninit({N}, fopt);
  const float* xp = xf.data_ptr<float>();
  const int64_t* tp = tc.data_ptr<int64_t>();
  const bool* vp = vc.data_ptr<bool>();
  float *lp = loss.data_ptr<float>(), *ep = e.data_ptr<float>(), *sp = s.data_ptr<float>();
  ieee_parallel_for(0, N, row_grain(C), [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r) {
      const float* xr = xp + r * C;
      float* er = ep + r * C;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < C; ++j) m = ce_max(m, xr[j]);
      int64_t acc[LDET_WORDS];
      zero(acc);
      WindowAcc win;
      for (int64_t j = 0; j < C; ++j) {
        er[j] = ce_exp_term(xr[j], m);
        window_add(win, acc, double(er[j]));
        if (((j + 1) & (LDET_NORM_INTERVAL - 1)) == 0) normalize(acc);
      }
      window_flush(win, acc);
      normalize(acc);
      const int64_t t = vp[r] ? tp[r] : 0;
      const bool in_range = t >= 0 && t < C;
      const float l = ce_row_finish(acc, m, in_range ? xr[t] : 0.0f, sp + r);
      lp[r] = !vp[r] ? 0.0f : in_range ? l : std::numeric_limits<float>::quiet_NaN();
    }
  });
  return {loss, e, s};
}

at::Tensor ce_backward_cpu(const at::Tensor& e, const at::Tensor& s, const at::Tensor& target, const at::Tensor& valid,
                           const at::Tensor& grad, at::ScalarType out_dtype) {
  check_ce_backward_args(e, s, target, valid, grad);
  const int fmt = out_format(out_dtype);
  const int64_t N = e.size(0), C = e.size(1);
  const at::Tensor ec = e.contiguous(), sc = s.contiguous(), tc = target.contiguous(), vc = valid.contiguous();
  const at::Tensor gf = grad.contiguous().to(at::kFloat);  // exact widening
  at::Tensor dx = uninit({N, C}, e.options().dtype(out_dtype));  // every element written below
  const float *ep = ec.data_ptr<float>(), *sp = sc.data_ptr<float>(), *gp = gf.data_ptr<float>();
  const int64_t* tp = tc.data_ptr<int64_t>();
  const bool* vp = vc.data_ptr<bool>();
  void* op = dx.data_ptr();
  ieee_parallel_for(0, N, row_grain(C), [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r)
      for (int64_t j = 0; j < C; ++j) {
        const float v = vp[r] ? ce_grad(ep[r * C + j], sp[r], j == tp[r], gp[r]) : 0.0f;
        store_fmt(op, r * C + j, round_float_fmt(v, fmt), fmt);
      }
  });
  return dx;
}

}  // namespace

TORCH_LIBRARY_IMPL(ldet, CPU, m) {
  m.impl("ce_forward", &ldet::ieee_op<&ce_forward_cpu>::call);
  m.impl("ce_backward", &ldet::ieee_op<&ce_backward_cpu>::call);
}

}  // namespace ldet

// round_double_fmt (csrc/detmath.h), the one rounding of the fused norm, cross-entropy and
// activation kernels into bf16/fp16, built for the host (the same source the CUDA kernels compile:
// LDET_HD), as op ldet_round_check::round_fmt. With digits=true, the reference instead: the value
// into a long accumulator and finalize_fmt's one rounding of it (longacc.h), an independent way to
// the same rounding. tests/test_round_fmt.py compares the two.
#include <ATen/ATen.h>
#include <cmath>
#include <torch/library.h>

#include "detmath.h"
#include "longacc.h"

namespace {

float via_digits(double v, int fmt) {
  if (fmt == ldet::kFmtF32) return float(v);
  if (v != v) return ldet::float_of(0x7fc00000u);
  const double a = v < 0 ? -v : v;
  if (a >= 0x1p+200) return ldet::float_of(v < 0 ? 0xff800000u : 0x7f800000u);
  if (a < 0x1p-160) return float(std::copysign(0.0, v));
  int64_t acc[ldet::LDET_WORDS];
  ldet::zero(acc);
  ldet::add_double(acc, v);  // |v| >= 2^-160: every bit of v is a multiple of 2^-298
  ldet::normalize(acc);
  const float r = ldet::finalize_fmt(acc, fmt);
  return (r == 0.0f && std::signbit(v)) ? -0.0f : r;
}

at::Tensor round_fmt(const at::Tensor& values, int64_t fmt, bool digits) {
  TORCH_CHECK(values.scalar_type() == at::kDouble, "values: expected float64, got ", values.scalar_type());
  TORCH_CHECK(fmt >= 0 && fmt <= 2, "fmt: expected 0 (fp32), 1 (bf16) or 2 (fp16), got ", fmt);
  const at::Tensor v = values.contiguous();
  at::Tensor out = at::empty(v.sizes(), v.options().dtype(at::kFloat));
  const double* vp = v.data_ptr<double>();
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < v.numel(); ++i)
    op[i] = digits ? via_digits(vp[i], int(fmt)) : ldet::round_double_fmt(vp[i], int(fmt));
  return out;
}

}  // namespace

TORCH_LIBRARY(ldet_round_check, m) { m.def("round_fmt(Tensor values, int fmt, bool digits) -> Tensor"); }

TORCH_LIBRARY_IMPL(ldet_round_check, CPU, m) { m.impl("round_fmt", &round_fmt); }

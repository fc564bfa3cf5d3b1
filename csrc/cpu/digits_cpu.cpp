// CPU implementations of normalize / finalize / to_digits (schemas: csrc/schema/digits.cpp).
#include <torch/library.h>

#include <ATen/Parallel.h>

#include "op_checks.h"

namespace ldet {
namespace {

at::Tensor normalize_cpu(const at::Tensor& acc) {
  check_acc(acc, "acc");
  at::Tensor out = acc.contiguous().clone();
  int64_t* p = out.data_ptr<int64_t>();
  const int64_t n = out.numel() / LDET_WORDS;
  at::parallel_for(0, n, 4096, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) normalize(p + i * LDET_WORDS);
  });
  return out;
}

at::Tensor finalize_cpu(const at::Tensor& acc, at::ScalarType dtype, int64_t scale_exp) {
  check_acc(acc, "acc");
  check_scale_exp(scale_exp);
  const int fmt = out_format(dtype);
  const at::Tensor a = acc.contiguous();
  auto sizes = a.sizes().vec();
  sizes.pop_back();
  at::Tensor out = at::empty(sizes, a.options().dtype(dtype));
  const int64_t* p = a.data_ptr<int64_t>();
  void* o = out.data_ptr();
  at::parallel_for(0, out.numel(), 2048, [&](int64_t b, int64_t e) {
    int64_t tmp[LDET_WORDS];
    for (int64_t i = b; i < e; ++i) {
      for (int w = 0; w < LDET_WORDS; ++w) tmp[w] = p[i * LDET_WORDS + w];
      normalize(tmp);
      store_fmt(o, i, finalize_fmt(tmp, fmt, int(scale_exp)), fmt);
    }
  });
  return out;
}

at::Tensor to_digits_cpu(const at::Tensor& x) {
  check_float_input(x, "x");
  const at::Tensor xd = x.contiguous().to(at::kDouble);  // exact widening
  auto sizes = x.sizes().vec();
  sizes.push_back(LDET_WORDS);
  at::Tensor out = at::empty(sizes, x.options().dtype(at::kLong));
  const double* src = xd.data_ptr<double>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, xd.numel(), 4096, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      int64_t* d = o + i * LDET_WORDS;
      zero(d);
      add_value(d, src[i]);
      normalize(d);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(ldet, CPU, m) {
  m.impl("normalize", &normalize_cpu);
  m.impl("finalize", &finalize_cpu);
  m.impl("to_digits", &to_digits_cpu);
}

}  // namespace ldet

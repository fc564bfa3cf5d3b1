// CPU implementations of normalize / finalize / to_digits / scatter_sum (schemas: csrc/schema/digits.cpp).
#include <torch/library.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "check.h"
#include "cpu/fp_env.h"
#include "op_checks.h"
#include "uninit.h"

namespace ldet {
namespace {

at::Tensor normalize_cpu(const at::Tensor& acc) {
  check_acc(acc, "acc");
  at::Tensor out = acc.contiguous().clone();
  int64_t* p = out.data_ptr<int64_t>();
  const int64_t n = out.numel() / LDET_WORDS;
  ieee_parallel_for(0, n, 4096, [&](int64_t b, int64_t e) {
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
  at::Tensor out = uninit(sizes, a.options().dtype(dtype));  // every output written
  const int64_t* p = a.data_ptr<int64_t>();
  void* o = out.data_ptr();
  ieee_parallel_for(0, out.numel(), 2048, [&](int64_t b, int64_t e) {
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
  at::Tensor out = uninit(sizes, x.options().dtype(at::kLong));  // every element's words written
  const double* src = xd.data_ptr<double>();
  int64_t* o = out.data_ptr<int64_t>();
  ieee_parallel_for(0, xd.numel(), 4096, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      int64_t* d = o + i * LDET_WORDS;
      zero(d);
      add_value(d, src[i]);
      normalize(d);
    }
  });
  return out;
}

at::Tensor scatter_sum_cpu(const at::Tensor& a, const at::Tensor& index, int64_t n_out) {
  check_scatter_sum_args(a, index, n_out);
  const at::Tensor ad = a.contiguous().to(at::kDouble);  // exact widening
  const at::Tensor ic = index.contiguous();
  const int64_t R = a.size(0), W = a.size(1);
  const int64_t* idx = ic.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    LDET_CHECK(idx[r] >= 0 && idx[r] < n_out, "index: expected values in [0, ", n_out, "), got ", idx[r],
                " at position ", r);
  at::Tensor out = at::zeros({n_out, W, LDET_WORDS}, a.options().dtype(at::kLong));
  const double* src = ad.data_ptr<double>();
  int64_t* o = out.data_ptr<int64_t>();
  // Column blocks, rows in order: each output's accumulator is owned by one thread. An output
  // is normalized after 2^20 additions (the status counters hold 2^21, longacc.h).
  constexpr int64_t kBlock = 32, kInterval = int64_t(1) << 20;
  const int64_t nblocks = (W + kBlock - 1) / kBlock;
  ieee_parallel_for(0, nblocks, 1, [&](int64_t bb, int64_t be) {
    std::vector<int64_t> since(size_t(n_out), 0);
    for (int64_t blk = bb; blk < be; ++blk) {
      const int64_t c0 = blk * kBlock, c1 = std::min(W, c0 + kBlock);
      std::fill(since.begin(), since.end(), 0);
      for (int64_t r = 0; r < R; ++r) {
        const int64_t g = idx[r];
        int64_t* og = o + g * W * LDET_WORDS;
        for (int64_t c = c0; c < c1; ++c) add_value(og + c * LDET_WORDS, src[r * W + c]);
        if (++since[size_t(g)] == kInterval) {
          for (int64_t c = c0; c < c1; ++c) normalize(og + c * LDET_WORDS);
          since[size_t(g)] = 0;
        }
      }
      for (int64_t g = 0; g < n_out; ++g)
        for (int64_t c = c0; c < c1; ++c) normalize(o + (g * W + c) * LDET_WORDS);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(ldet, CPU, m) {
  m.impl("normalize", &ldet::ieee_op<&normalize_cpu>::call);
  m.impl("finalize", &ldet::ieee_op<&finalize_cpu>::call);
  m.impl("to_digits", &ldet::ieee_op<&to_digits_cpu>::call);
  m.impl("scatter_sum", &ldet::ieee_op<&scatter_sum_cpu>::call);
}

}  // namespace ldet

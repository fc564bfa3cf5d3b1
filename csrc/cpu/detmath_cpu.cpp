// CPU implementations of act / act_backward / act_fp64 / dot_rows / dot_cols / ce_row_loss
// (schemas: csrc/schema/detmath.cpp). Each element's arithmetic is the scalar detmath.h code (for
// the erf-GELU on AVX-512 builds its vector form, cpu/detmath_vector.h, whose lanes give the same
// bits), the same whatever its position or the thread split, and the same as the CUDA kernels.
#include <torch/library.h>

#include <algorithm>

#include <ATen/Parallel.h>

#include "check.h"
#include "cpu/detmath_vector.h"
#include "cpu/fp_env.h"
#include "detmath.h"
#include "detmath_checks.h"
#include "uninit.h"
#include "window_acc.h"

namespace ldet {
namespace {

// The fp64 values act(xs[i]) (gs null) or gs[i] * act'(xs[i]) for i in [b, e), into v[i - b]:
// the erf-GELU eight at a time where the build has AVX-512 (cpu/detmath_vector.h, same bits),
// everything else by the scalar detmath.h code.
void act_values(const double* xs, const double* gs, int64_t b, int64_t e, int kind, double* v) {
  const auto scalar = [&](int64_t i) { return gs ? gs[i] * act_derivative(xs[i], kind) : act_forward(xs[i], kind); };
  int64_t i = b;
#if defined(LDET_CPU_AVX512)
  if (kind == kActGeluErf) {
    for (; i + 8 <= e; i += 8) {
      const unsigned done = dmv::gelu_erf8(xs + i, gs ? gs + i : nullptr, v + (i - b));
      for (int l = 0; l < 8; ++l)
        if (!(done >> l & 1u)) v[i - b + l] = scalar(i + l);
    }
  }
#endif
  for (; i < e; ++i) v[i - b] = scalar(i);
}

// act_values rounded once to fmt and stored, a block at a time.
void act_store(const double* xs, const double* gs, int64_t n, int kind, int fmt, void* o) {
  constexpr int64_t kBlock = 256;
  ieee_parallel_for(0, n, 2048, [&](int64_t b, int64_t e) {
    double v[kBlock];
    for (int64_t s = b; s < e; s += kBlock) {
      const int64_t t = std::min(e, s + kBlock);
      act_values(xs, gs, s, t, kind, v);
      for (int64_t i = s; i < t; ++i) store_fmt(o, i, round_double_fmt(v[i - s], fmt), fmt);
    }
  });
}

at::Tensor act_cpu(const at::Tensor& x, int64_t kind) {
  check_float_input(x, "x");
  check_act_kind(kind);
  const int fmt = out_format(x.scalar_type());
  const at::Tensor xd = x.contiguous().to(at::kDouble);  // exact widening
  at::Tensor out = uninit(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));  // every element
  act_store(xd.data_ptr<double>(), nullptr, xd.numel(), int(kind), fmt, out.data_ptr());
  return out;
}

at::Tensor act_backward_cpu(const at::Tensor& grad, const at::Tensor& x, int64_t kind) {
  check_float_input(x, "x");
  check_float_input(grad, "grad");
  check_act_kind(kind);
  LDET_CHECK(grad.sizes() == x.sizes(), "grad: expected shape ", x.sizes(), " like x, got ", grad.sizes());
  const int fmt = out_format(x.scalar_type());
  const at::Tensor xd = x.contiguous().to(at::kDouble);
  const at::Tensor gd = grad.contiguous().to(at::kDouble);
  at::Tensor out = uninit(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));  // every element
  act_store(xd.data_ptr<double>(), gd.data_ptr<double>(), xd.numel(), int(kind), fmt, out.data_ptr());
  return out;
}

at::Tensor act_fp64_cpu(const at::Tensor& x, int64_t kind, const c10::optional<at::Tensor>& grad) {
  check_act_fp64_args(x, grad);
  check_act_kind(kind);
  const at::Tensor xc = x.contiguous();
  const at::Tensor gc = grad.has_value() ? grad->contiguous() : at::Tensor();
  at::Tensor out = uninit(x.sizes(), xc.options());  // every element
  const double* xs = xc.data_ptr<double>();
  const double* gs = gc.defined() ? gc.data_ptr<double>() : nullptr;
  double* o = out.data_ptr<double>();
  ieee_parallel_for(0, xc.numel(), 2048, [&](int64_t b, int64_t e) { act_values(xs, gs, b, e, int(kind), o + b); });
  return out;
}

// Widened (R, W) operands: exact fp64 copies, b = nullptr meaning ones.
struct DotOperands {
  at::Tensor a, b;
  const double* pa;
  const double* pb;
  int64_t rows, cols;
};

DotOperands dot_operands(const at::Tensor& a, const c10::optional<at::Tensor>& b) {
  check_dot_args(a, b);
  DotOperands d;
  d.a = a.contiguous().to(at::kDouble);
  d.pa = d.a.data_ptr<double>();
  d.pb = nullptr;
  if (b.has_value()) {
    d.b = b->contiguous().to(at::kDouble);
    d.pb = d.b.data_ptr<double>();
  }
  d.rows = a.size(0);
  d.cols = a.size(1);
  return d;
}

at::Tensor dot_rows_cpu(const at::Tensor& a, const c10::optional<at::Tensor>& b) {
  const DotOperands d = dot_operands(a, b);
  at::Tensor out = uninit({d.rows, LDET_WORDS}, a.options().dtype(at::kLong));  // every row's words written
  int64_t* o = out.data_ptr<int64_t>();
  ieee_parallel_for(0, d.rows, 16, [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r) {
      int64_t* acc = o + r * LDET_WORDS;
      zero(acc);
      const double* xa = d.pa + r * d.cols;
      const double* xb = d.pb ? d.pb + r * d.cols : nullptr;
      WindowAcc win;  // the CUDA kernels' window (csrc/window_acc.h): one code path for both; CPU speed unchanged
      for (int64_t j = 0; j < d.cols; ++j) {
        window_add(win, acc, xb ? xa[j] * xb[j] : xa[j]);  // exact product of two narrow floats
        if (((j + 1) & (LDET_NORM_INTERVAL - 1)) == 0) normalize(acc);
      }
      window_flush(win, acc);
      normalize(acc);
    }
  });
  return out;
}

at::Tensor dot_cols_cpu(const at::Tensor& a, const c10::optional<at::Tensor>& b) {
  const DotOperands d = dot_operands(a, b);
  at::Tensor out = uninit({d.cols, LDET_WORDS}, a.options().dtype(at::kLong));  // every column's words written
  int64_t* o = out.data_ptr<int64_t>();
  // Column blocks, rows streamed in order: each column's accumulator is owned by one thread,
  // and integer addition makes the row order irrelevant anyway.
  constexpr int64_t kBlock = 32;
  const int64_t nblocks = (d.cols + kBlock - 1) / kBlock;
  ieee_parallel_for(0, nblocks, 1, [&](int64_t bb, int64_t be) {
    for (int64_t blk = bb; blk < be; ++blk) {
      const int64_t c0 = blk * kBlock;
      const int64_t c1 = std::min(d.cols, c0 + kBlock);
      for (int64_t c = c0; c < c1; ++c) zero(o + c * LDET_WORDS);
      WindowAcc win[kBlock];  // one window per column (csrc/window_acc.h)
      for (int64_t r = 0; r < d.rows; ++r) {
        const double* xa = d.pa + r * d.cols;
        const double* xb = d.pb ? d.pb + r * d.cols : nullptr;
        for (int64_t c = c0; c < c1; ++c) window_add(win[c - c0], o + c * LDET_WORDS, xb ? xa[c] * xb[c] : xa[c]);
        if (((r + 1) & (LDET_NORM_INTERVAL - 1)) == 0)
          for (int64_t c = c0; c < c1; ++c) normalize(o + c * LDET_WORDS);
      }
      for (int64_t c = c0; c < c1; ++c) {
        window_flush(win[c - c0], o + c * LDET_WORDS);
        normalize(o + c * LDET_WORDS);
      }
    }
  });
  return out;
}

at::Tensor ce_row_loss_cpu(const at::Tensor& m, const at::Tensor& picked, const at::Tensor& t_minus) {
  check_ce_row_args(m, picked, t_minus);
  const at::Tensor mc = m.contiguous(), pc = picked.contiguous(), tc = t_minus.contiguous();
  at::Tensor out = uninit(m.sizes(), m.options());  // every element written
  const float *pm = mc.data_ptr<float>(), *pp = pc.data_ptr<float>(), *pt = tc.data_ptr<float>();
  float* o = out.data_ptr<float>();
  ieee_parallel_for(0, m.numel(), 2048, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) o[i] = ce_row_loss(pm[i], pp[i], pt[i]);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(ldet, CPU, m) {
  m.impl("act", &ldet::ieee_op<&act_cpu>::call);
  m.impl("act_backward", &ldet::ieee_op<&act_backward_cpu>::call);
  m.impl("act_fp64", &ldet::ieee_op<&act_fp64_cpu>::call);
  m.impl("dot_rows", &ldet::ieee_op<&dot_rows_cpu>::call);
  m.impl("dot_cols", &ldet::ieee_op<&dot_cols_cpu>::call);
  m.impl("ce_row_loss", &ldet::ieee_op<&ce_row_loss_cpu>::call);
}

}  // namespace ldet

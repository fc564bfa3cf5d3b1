// CPU kernels of the fp64 route (scheme and proof: csrc/fp64_bound.h; driver: fp64_bound_host.h).
//
// The CPU's auto choice for rounded outputs with an fp32 operand from 128^3 (the cost table,
// csrc/gemm_plan.h), and what CPU CI checks of the decision and the recomputation the GPU runs,
// on the same header's arithmetic, against the long accumulator. No lists: fix sweeps the
// output's marks.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "cpu/fp_env.h"
#include "fp64_bound_host.h"
#include "window_acc.h"

namespace ldet {
namespace {

constexpr int64_t kChunk = 32;  // the recomputation's sum: chunks of 32 products, then the chunks

std::pair<at::Tensor, at::Tensor> widen_cpu(const at::Tensor& a) {
  const int64_t R = a.size(0), K = a.size(1);
  at::Tensor ad = at::empty({R, K}, a.options().dtype(at::kDouble));
  at::Tensor norms = at::empty({R}, a.options().dtype(at::kDouble));
  const Elems e = elems_of(a);
  double* d = ad.data_ptr<double>();
  double* o = norms.data_ptr<double>();
  ieee_parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      double q = 0.0;
      for (int64_t k = 0; k < K; ++k) {
        const double v = e.at(r, k);  // exact widening
        d[r * K + k] = v;
        q += v * v;  // each square exact; any order: norm_upper allows it
      }
      o[r] = norm_upper(q, K);
    }
  });
  return {ad, norms};
}

void fp64_gemm_cpu(const at::Tensor& xd, const at::Tensor& wd, at::Tensor& D) {
  // any fp64 GEMM serves: the bound holds for every order of its additions, and charges each
  // rounding 2u, so even a caller's directed rounding mode inside the BLAS is covered
  at::mm_out(D, xd, wd.t());
}

// round_if_decided for one row of fp32 outputs, written without branches so the compiler runs
// it in vector registers: the same operations in the same order (finite tests as x - x == 0,
// the fp32 ends by the IEEE conversion, as round_double_prec_fmt takes them; a == z compares
// their bits, since both ends have one sign), the mark where round_if_decided returns false.
// Scalar, the decision pass cost about half as much as the fp64 GEMM itself at 512^3.
template <bool kBias>
void decide_row_f32(const double* __restrict d, double ux, const double* __restrict pw, const double* __restrict pb,
                    int64_t K, int64_t n, float* __restrict o) {
  const float mark = float_of(0x7fc00000u);
  for (int64_t j = 0; j < n; ++j) {
    const double c = d[j], r = gemm_radius(ux, pw[j], K), b = kBias ? pb[j] : 0.0;
    const bool finite = (c - c == 0.0) & (r - r == 0.0) & (b - b == 0.0);
    const double slack = ((std::fabs(c) + r) + std::fabs(b)) * 0x1p-50;
    const double lo = ((c - r) + b) - slack, hi = ((c + r) + b) + slack;
    const float a = float(lo), z = float(hi);
    const bool ok = finite & ((lo > 0.0) | (hi < 0.0)) & (a == z);
    o[j] = ok ? a : mark;
  }
}

void decide_cpu(const at::Tensor& D, const at::Tensor& ux, const at::Tensor& uw, const at::Tensor& bias, int64_t K,
                int64_t n0, int fmt, at::Tensor& out, Fp64Lists&) {
  const int64_t M = D.size(0), n = D.size(1), N = out.size(1);
  const double* d = D.data_ptr<double>();
  const double* px = ux.data_ptr<double>();
  const double* pw = uw.data_ptr<double>() + n0;
  const double* pb = bias.defined() ? bias.data_ptr<double>() + n0 : nullptr;
  void* o = out.data_ptr();
  const float mark = float_of(0x7fc00000u);
  ieee_parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      if (fmt == kFmtF32) {
        float* row = static_cast<float*>(o) + m * N + n0;
        if (pb != nullptr)
          decide_row_f32<true>(d + m * n, px[m], pw, pb, K, n, row);
        else
          decide_row_f32<false>(d + m * n, px[m], pw, pb, K, n, row);
        continue;
      }
      for (int64_t j = 0; j < n; ++j) {
        float v;
        const double b = pb ? pb[j] : 0.0;
        if (!round_if_decided(d[m * n + j], gemm_radius(px[m], pw[j], K), b, fmt, &v)) v = mark;
        store_fmt(o, m * N + n0 + j, v, fmt);
      }
    }
  });
}

bool marked(const void* out, int64_t i, int fmt) {
  if (fmt == kFmtF32) return undecided_mark_f32(bits_of(static_cast<const float*>(out)[i]));
  return undecided_mark_16(static_cast<const uint16_t*>(out)[i], fmt);
}

void fix_cpu(const at::Tensor& xa, const at::Tensor& wa, const at::Tensor& bias, const at::Tensor& ux,
             const at::Tensor& uw, int fmt, at::Tensor& out, Fp64Lists& lists) {
  const int64_t M = out.size(0), N = out.size(1), K = xa.size(1);
  const Elems x = elems_of(xa), w = elems_of(wa);
  const double* px = ux.data_ptr<double>();
  const double* pw = uw.data_ptr<double>();
  const double* pb = bias.defined() ? bias.data_ptr<double>() : nullptr;
  // each product passes through at most kChunk additions in its chunk and one per later chunk
  const int64_t depth = kChunk + (K + kChunk - 1) / kChunk;
  void* o = out.data_ptr();
  std::vector<int64_t> marked_rows(size_t(M), 0), digit_rows(size_t(M), 0);
  ieee_parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t n = 0; n < N; ++n) {
        const int64_t i = m * N + n;
        if (!marked(o, i, fmt)) continue;
        ++marked_rows[size_t(m)];
        const double b = pb ? pb[n] : 0.0;
        double S = 0.0;
        for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
          double c = 0.0;
          for (int64_t k = k0; k < std::min(K, k0 + kChunk); ++k) c += x.at(m, k) * w.at(n, k);  // exact products
          S += c;
        }
        float v;
        bool ok = round_ordered(S, px[m], pw[n], depth, b, fmt, &v);
        if (!ok) {  // S was formed from these products in some order: round_if_exact needs only q
          int q = kNoBits;
          for (int64_t k = 0; k < K; ++k) q = std::min(q, lowest_bit(x.at(m, k) * w.at(n, k)));
          ok = round_if_exact(S, q, px[m], pw[n], b, fmt, &v);
        }
        if (!ok) {
          ++digit_rows[size_t(m)];
          int64_t acc[LDET_WORDS];
          zero(acc);
          WindowAcc win;
          for (int64_t k = 0; k < K; ++k) {
            window_add(win, acc, x.at(m, k) * w.at(n, k));
            if (((k + 1) & (LDET_NORM_INTERVAL - 1)) == 0) normalize(acc);
          }
          window_flush(win, acc);
          if (pb != nullptr) add_value(acc, b);
          normalize(acc);
          v = finalize_fmt(acc, fmt);
        }
        store_fmt(o, i, v, fmt);
      }
    }
  });
  int64_t* cnt = lists.counts.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {
    cnt[0] += marked_rows[size_t(m)];
    cnt[1] += digit_rows[size_t(m)];
  }
}

int64_t no_lists(int64_t) { return 0; }

}  // namespace

const Fp64Backend& fp64_backend_cpu() {
  static const Fp64Backend be = [] {
    Fp64Backend b;
    b.widen = &widen_cpu;
    b.gemm = &fp64_gemm_cpu;
    b.decide = &decide_cpu;
    b.fix = &fix_cpu;
    b.list_cap = &no_lists;
    return b;
  }();
  return be;
}

}  // namespace ldet

// CPU exact GEMM (schemas: csrc/schema/gemm.cpp; algorithm: csrc/gemm_common.h).
//
// Outputs are processed in 4 x 8 tiles spread over threads with at::parallel_for. For a K-block
// where every pair of the tile passes the fast check, a register-blocked micro-kernel forms all
// 32 block sums at once (vectorized over the 8 columns; any order is exact on this path). Other
// blocks go pair by pair through the exact path. Results do not depend on the tiling: the
// canonical digits of the exact sum are unique.
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "cpu/common_cpu.h"
#include "gemm_common.h"

namespace ldet {
namespace {

constexpr int TM = 4;
constexpr int TN = 8;

// Per (row, K-block) statistics of a (rows, K) fp64 matrix with row stride ld and element
// stride es (so the same code reads x row-major and w^T column-wise).
std::vector<int32_t> block_stats(const double* a, int64_t rows, int64_t K, int64_t ld, int64_t es) {
  const int64_t nkb = (K + LDET_KBLOCK - 1) / LDET_KBLOCK;
  std::vector<int32_t> st(rows * nkb);
  at::parallel_for(0, rows, 64, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      for (int64_t kb = 0; kb < nkb; ++kb) {
        StatAcc s;
        const int64_t k1 = std::min(K, (kb + 1) * LDET_KBLOCK);
        for (int64_t k = kb * LDET_KBLOCK; k < k1; ++k) s.add(a[r * ld + k * es]);
        st[r * nkb + kb] = s.packed();
      }
    }
  });
  return st;
}

struct GemmArgs {
  const double* x;   // (M, K) row-major
  const double* wt;  // (K, N) row-major: w transposed, so the micro-kernel reads columns in a row
  const int32_t* xs;
  const int32_t* ws;
  const double* bias;  // (N,) or null
  int64_t M, N, K, nkb, interval;
  at::ScalarType out_dtype = at::kFloat;  // the one rounding goes straight to this format
};

// Exact block sum on the fast path for a full TM x TN tile. Every partial sum is exact, so the
// compiler may vectorize freely: the result is the same for any evaluation order.
inline void micro_block(const GemmArgs& g, int64_t i0, int64_t j0, int64_t k0, int64_t k1,
                        double blk[TM][TN]) {
  double acc[TM][TN] = {};
  for (int64_t k = k0; k < k1; ++k) {
    const double* wk = g.wt + k * g.N + j0;
    for (int a = 0; a < TM; ++a) {
      const double xa = g.x[(i0 + a) * g.K + k];
      for (int b = 0; b < TN; ++b) acc[a][b] += xa * wk[b];
    }
  }
  for (int a = 0; a < TM; ++a)
    for (int b = 0; b < TN; ++b) blk[a][b] = acc[a][b];
}

// One (output, K-block) pair on the path chosen for it.
inline void pair_block(const GemmArgs& g, int64_t i, int64_t j, int64_t k0, int64_t k1,
                       BlockPath path, double& S, int64_t* dig, int64_t& adds) {
  if (path == kPathSkip) return;
  const double* xr = g.x + i * g.K;
  if (path == kPathFast) {
    double s0 = 0, s1 = 0;
    int64_t k = k0;
    for (; k + 1 < k1; k += 2) {
      s0 += xr[k] * g.wt[k * g.N + j];
      s1 += xr[k + 1] * g.wt[(k + 1) * g.N + j];
    }
    if (k < k1) s0 += xr[k] * g.wt[k * g.N + j];
    acc_term(S, dig, adds, g.interval, s0 + s1);
    return;
  }
  for (int64_t k = k0; k < k1; ++k) acc_any(S, dig, adds, g.interval, xr[k] * g.wt[k * g.N + j]);
}

template <bool kFinalize>
void run_gemm(const GemmArgs& g, void* out_f, int64_t* out_d) {
  const int64_t tiles_m = (g.M + TM - 1) / TM;
  const int64_t tiles_n = (g.N + TN - 1) / TN;
  at::parallel_for(0, tiles_m * tiles_n, 1, [&](int64_t tb, int64_t te) {
    double S[TM][TN];
    int64_t dig[TM][TN][LDET_WORDS];
    int64_t adds[TM][TN];
    double blk[TM][TN];
    for (int64_t t = tb; t < te; ++t) {
      const int64_t i0 = (t / tiles_n) * TM, j0 = (t % tiles_n) * TN;
      const int mm = int(std::min<int64_t>(TM, g.M - i0));
      const int nn = int(std::min<int64_t>(TN, g.N - j0));
      const bool full = mm == TM && nn == TN;
      for (int a = 0; a < mm; ++a)
        for (int b = 0; b < nn; ++b) {
          S[a][b] = 0.0;
          adds[a][b] = 0;
          zero(dig[a][b]);
        }
      for (int64_t kb = 0; kb < g.nkb; ++kb) {
        const int64_t k0 = kb * LDET_KBLOCK, k1 = std::min(g.K, k0 + LDET_KBLOCK);
        BlockPath path[TM][TN];
        bool all_fast = full;
        for (int a = 0; a < mm; ++a)
          for (int b = 0; b < nn; ++b) {
            path[a][b] = block_path(g.xs[(i0 + a) * g.nkb + kb], g.ws[(j0 + b) * g.nkb + kb]);
            all_fast = all_fast && path[a][b] != kPathExact;
          }
        if (all_fast) {
          micro_block(g, i0, j0, k0, k1, blk);
          for (int a = 0; a < TM; ++a)
            for (int b = 0; b < TN; ++b)
              if (path[a][b] == kPathFast) acc_term(S[a][b], dig[a][b], adds[a][b], g.interval, blk[a][b]);
        } else {
          for (int a = 0; a < mm; ++a)
            for (int b = 0; b < nn; ++b)
              pair_block(g, i0 + a, j0 + b, k0, k1, path[a][b], S[a][b], dig[a][b], adds[a][b]);
        }
      }
      for (int a = 0; a < mm; ++a)
        for (int b = 0; b < nn; ++b) {
          if (g.bias) acc_any(S[a][b], dig[a][b], adds[a][b], g.interval, g.bias[j0 + b]);
          acc_finish(S[a][b], dig[a][b]);
          const int64_t o = (i0 + a) * g.N + (j0 + b);
          if (kFinalize) {
            store_as(out_f, o, finalize_as(dig[a][b], g.out_dtype), g.out_dtype);
          } else {
            for (int w = 0; w < LDET_WORDS; ++w) out_d[o * LDET_WORDS + w] = dig[a][b][w];
          }
        }
    }
  });
}

void check_gemm_args(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  check_float_input(x, "x");
  check_float_input(w, "w");
  TORCH_CHECK(x.dim() == 2, "x: expected a 2-D (M, K) tensor, got shape ", x.sizes());
  TORCH_CHECK(w.dim() == 2, "w: expected a 2-D (N, K) tensor, got shape ", w.sizes());
  TORCH_CHECK(x.size(1) == w.size(1), "w: expected K = ", x.size(1), " columns to match x, got shape ",
              w.sizes());
  if (bias.has_value()) {
    check_float_input(*bias, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == w.size(0), "bias: expected shape (", w.size(0),
                ",), got ", bias->sizes());
  }
}

template <bool kFinalize>
at::Tensor gemm_common_cpu(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                           int64_t norm_interval, at::ScalarType out_dtype = at::kFloat) {
  check_gemm_args(x, w, bias);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const at::Tensor xd = x.to(at::kDouble).contiguous();     // exact widening
  const at::Tensor wt = w.to(at::kDouble).t().contiguous();  // (K, N)
  at::Tensor bd;
  if (bias.has_value()) bd = bias->to(at::kDouble).contiguous();
  GemmArgs g;
  g.x = xd.data_ptr<double>();
  g.wt = wt.data_ptr<double>();
  g.M = M;
  g.N = N;
  g.K = K;
  g.nkb = (K + LDET_KBLOCK - 1) / LDET_KBLOCK;
  g.interval = norm_interval > 0 ? norm_interval : LDET_NORM_INTERVAL;
  g.bias = bias.has_value() ? bd.data_ptr<double>() : nullptr;
  const std::vector<int32_t> xs = block_stats(g.x, M, K, K, 1);
  const std::vector<int32_t> ws = block_stats(g.wt, N, K, 1, N);
  g.xs = xs.data();
  g.ws = ws.data();
  if (kFinalize) {
    at::Tensor out = at::empty({M, N}, x.options().dtype(out_dtype));
    g.out_dtype = out_dtype;
    if (M * N) run_gemm<true>(g, out.data_ptr(), nullptr);
    return out;
  }
  at::Tensor out = at::empty({M, N, LDET_WORDS}, x.options().dtype(at::kLong));
  if (M * N) run_gemm<false>(g, nullptr, out.data_ptr<int64_t>());
  return out;
}

at::Tensor gemm_partial_cpu(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                            int64_t norm_interval) {
  return gemm_common_cpu<false>(x, w, bias, norm_interval);
}

at::Tensor gemm_cpu(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                    c10::optional<at::ScalarType> out_dtype) {
  const at::ScalarType dt = out_dtype.value_or(at::kFloat);
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "out_dtype: expected torch.float32, torch.bfloat16 or torch.float16, got ", dt);
  return gemm_common_cpu<true>(x, w, bias, 0, dt);
}

}  // namespace

TORCH_LIBRARY_IMPL(ldet, CPU, m) {
  m.impl("gemm_partial", &gemm_partial_cpu);
  m.impl("gemm", &gemm_cpu);
}

}  // namespace ldet

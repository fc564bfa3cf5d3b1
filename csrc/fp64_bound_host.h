// Host side of the fp64 route (csrc/fp64_bound.h has the scheme and its proof).
//
// gemm_fp64_bound() runs a plan whose route is fp64 (csrc/gemm_plan.h chooses it; rounded outputs
// only: digits need the exact sum itself, which the slices give).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <tuple>
#include <utility>

#include "check.h"
#include "fp64_bound.h"
#include "gemm_plan.h"
#include "int_slices_host.h"
#include "op_checks.h"
#include "uninit.h"

namespace ldet {

// The undecided outputs on their way from the decision to the recomputation. counts (3,) int64,
// zeroed: {outputs the decision marked, outputs left to the long accumulator, the second list's
// length}. list1: the marked outputs' flat indices m N + n, at most cap of them (the rest stay
// marked in the output, for a sweep that finds them); list2 (cap): those the recomputation's sum
// could not decide (some of which its exactness certificate then decides, fp64_bound.h step 2).
// cap == 0: no lists (a backend that sweeps the output instead).
struct Fp64Lists {
  at::Tensor counts, list1, list2;
  int64_t cap;
};

struct Fp64Backend {
  // a (R, K) fp32 / bf16 / fp16 with unit column stride -> its fp64 copy (R, K) contiguous, and
  // (R,) fp64 norm_upper of each row.
  std::pair<at::Tensor, at::Tensor> (*widen)(const at::Tensor& a);
  // D (M, nc) fp64 row-major = xd (M, K) . wd (nc, K)^T, both fp64 with unit column stride.
  void (*gemm)(const at::Tensor& xd, const at::Tensor& wd, at::Tensor& D);
  // out[:, n0 : n0 + nc] (out (M, N) of fmt, contiguous) := each output's rounding where
  // round_if_decided proves it from D (M, nc) and the radius, else the undecided mark (a NaN),
  // listed. ux (M,), uw (N,), bias (N,) fp64 or undefined: whole, indexed from n0.
  void (*decide)(const at::Tensor& D, const at::Tensor& ux, const at::Tensor& uw, const at::Tensor& bias, int64_t K,
                 int64_t n0, int fmt, at::Tensor& out, Fp64Lists& lists);
  // Every marked output recomputed from the operands x (M, K), w (N, K) (as widen takes them):
  // the ordered sum, else the long accumulator.
  void (*fix)(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, const at::Tensor& ux,
              const at::Tensor& uw, int fmt, at::Tensor& out, Fp64Lists& lists);
  // The lists' capacity for M N outputs (0: none).
  int64_t (*list_cap)(int64_t outputs);
};

const Fp64Backend& fp64_backend_cpu();   // csrc/cpu/fp64_bound_cpu.cpp
const Fp64Backend& fp64_backend_cuda();  // csrc/cuda/fp64_bound_cuda.cu

// The last rounded GEMM of this thread, when it took the fp64 route: its Fp64Lists::counts on its
// device; undefined otherwise (lightning_det.ops.last_fp64_counts: tests and benchmarks).
at::Tensor& last_fp64_counts();

inline at::Tensor gemm_fp64_bound(const GemmPlan& plan, const at::Tensor& x_in, const at::Tensor& w_in,
                                  const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype,
                                  const Fp64Backend& be) {
  const int64_t M = plan.M, K = plan.K, N = plan.N;
  LDET_CHECK(K <= (int64_t(1) << 33), "x: K = ", K, " exceeds the fp64 route's bound (2^33)");
  const int fmt = out_format(out_dtype);
  // row-major operands (DetLinear's backward passes transposed views): the GEMM, the norms and
  // the recomputation of undecided outputs (a warp along a row) all read rows
  at::Tensor x = dense_rows(x_in), w = dense_rows(w_in);
  if (x.scalar_type() != w.scalar_type()) {  // one element type for the kernels: fp32 holds both exactly
    x = x.to(at::kFloat);
    w = w.to(at::kFloat);
  }
  at::Tensor xd, ux, wd, uw;
  std::tie(xd, ux) = be.widen(x);
  std::tie(wd, uw) = be.widen(w);
  at::Tensor bd;
  if (bias.has_value()) bd = bias->to(at::kDouble).contiguous();
  at::Tensor out = uninit({M, N}, x_in.options().dtype(out_dtype));  // decide writes every output
  Fp64Lists lists{at::zeros({3}, x_in.options().dtype(at::kLong)), {}, {}, be.list_cap(M * N)};
  if (lists.cap > 0) {  // read only below their counts
    lists.list1 = uninit({lists.cap}, lists.counts.options());
    lists.list2 = uninit({lists.cap}, lists.counts.options());
  }

  // N in chunks so the fp64 products D stay within the chunk MiB (they live at the step's peak).
  const int64_t nc = plan.fp64_n_chunk;
  for (int64_t n0 = 0; n0 < N; n0 += nc) {
    const int64_t n = std::min(nc, N - n0);
    at::Tensor D = uninit({M, n}, xd.options());  // the GEMM writes all of it
    be.gemm(xd, n0 == 0 && n == N ? wd : wd.narrow(0, n0, n), D);
    be.decide(D, ux, uw, bd, K, n0, fmt, out, lists);
  }
  xd.reset();  // the recomputation reads the operands as given: the fp64 copies can go
  wd.reset();
  be.fix(x, w, bd, ux, uw, fmt, out, lists);
  last_fp64_counts() = lists.counts;
  return out;
}

}  // namespace ldet

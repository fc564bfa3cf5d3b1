// CUDA exact GEMM (schemas: csrc/schema/gemm.cpp; algorithm: csrc/gemm_common.h).
//
// v1 structure (see benchmarks/NOTES.md for the floor and the measurements):
//   1. a statistics kernel: per (row, 32-wide K-block) exponent bounds of x and of w;
//   2. the main kernel: 64 x 64 output tile per block of 256 threads, 4 x 4 outputs per
//      thread, K staged through shared memory as fp64 in steps of LDET_KBLOCK. A K-block on
//      the fast path is 32 DFMAs per output into a block sum that is exact by construction,
//      then one TwoSum into the running sum S; other blocks go product by product (TwoSum, and
//      the rounding error into the per-output digits, which live in local memory and are
//      touched only then). The digits are normalized at the end and rounded in the same thread
//      (det_gemm) or written out (det_gemm_partial).
// The canonical digits are unique, so results equal the CPU's bit for bit.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include "gemm_common.h"
#include "op_checks.h"
#include "split.h"

namespace ldet {
namespace {

constexpr int BM = 64, BN = 64, BK = LDET_KBLOCK;
constexpr int THREADS = 256;
constexpr int RM = 4, RN = 4;  // outputs per thread

__device__ __forceinline__ double to_d(float v) { return double(v); }
__device__ __forceinline__ double to_d(__nv_bfloat16 v) { return double(__bfloat162float(v)); }
__device__ __forceinline__ double to_d(__half v) { return double(__half2float(v)); }

// One thread per (row, K-block).
template <typename T>
__global__ void stats_kernel(const T* __restrict__ a, int64_t rows, int64_t K, int64_t nkb, int32_t* __restrict__ out) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= rows * nkb) return;
  const int64_t r = idx / nkb, kb = idx % nkb;
  StatAcc s;
  const int64_t k1 = min(K, (kb + 1) * BK);
  for (int64_t k = kb * BK; k < k1; ++k) s.add(to_d(a[r * K + k]));
  out[idx] = s.packed();
}

template <typename T, bool kFinalize>
__global__ void __launch_bounds__(THREADS) gemm_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                                       const int32_t* __restrict__ xs, const int32_t* __restrict__ ws,
                                                       const double* __restrict__ bias, int64_t M, int64_t N, int64_t K,
                                                       int64_t nkb, int64_t interval, int out_fmt, void* __restrict__ out_f,
                                                       int64_t* __restrict__ out_d) {
  __shared__ double xsh[BK][BM + 1];
  __shared__ double wsh[BK][BN + 1];
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int64_t m0 = int64_t(blockIdx.y) * BM, n0 = int64_t(blockIdx.x) * BN;

  double S[RM][RN];
  int64_t dig[RM][RN][LDET_WORDS];  // local memory; written only on rounding errors
  int64_t adds[RM][RN];
#pragma unroll
  for (int a = 0; a < RM; ++a)
#pragma unroll
    for (int b = 0; b < RN; ++b) {
      S[a][b] = 0.0;
      adds[a][b] = 0;
      zero(dig[a][b]);
    }

  for (int64_t kb = 0; kb < nkb; ++kb) {
    const int64_t k0 = kb * BK;
    // Stage the tiles as fp64 (exact widening); out-of-range elements are zeros, which add
    // nothing and are ignored by the statistics.
    for (int e = threadIdx.x; e < BM * BK; e += THREADS) {
      const int r = e / BK, kk = e % BK;
      const int64_t gm = m0 + r, gk = k0 + kk, gn = n0 + r;
      xsh[kk][r] = (gm < M && gk < K) ? to_d(x[gm * K + gk]) : 0.0;
      wsh[kk][r] = (gn < N && gk < K) ? to_d(w[gn * K + gk]) : 0.0;
    }
    __syncthreads();

    BlockPath path[RM][RN];
    bool all_fast = true;
#pragma unroll
    for (int a = 0; a < RM; ++a) {
      const int64_t gm = m0 + ty + 16 * a;
      const int32_t sx = gm < M ? xs[gm * nkb + kb] : pack_stat(kStatEmpty, 0);
#pragma unroll
      for (int b = 0; b < RN; ++b) {
        const int64_t gn = n0 + tx + 16 * b;
        const int32_t sw = gn < N ? ws[gn * nkb + kb] : pack_stat(kStatEmpty, 0);
        path[a][b] = block_path(sx, sw);
        all_fast = all_fast && path[a][b] != kPathExact;
      }
    }

    if (all_fast) {
      double blk[RM][RN];
#pragma unroll
      for (int a = 0; a < RM; ++a)
#pragma unroll
        for (int b = 0; b < RN; ++b) blk[a][b] = 0.0;
#pragma unroll 8
      for (int kk = 0; kk < BK; ++kk) {
        double xv[RM], wv[RN];
#pragma unroll
        for (int a = 0; a < RM; ++a) xv[a] = xsh[kk][ty + 16 * a];
#pragma unroll
        for (int b = 0; b < RN; ++b) wv[b] = wsh[kk][tx + 16 * b];
#pragma unroll
        for (int a = 0; a < RM; ++a)
#pragma unroll
          for (int b = 0; b < RN; ++b) blk[a][b] = fma(xv[a], wv[b], blk[a][b]);  // exact here
      }
#pragma unroll
      for (int a = 0; a < RM; ++a)
#pragma unroll
        for (int b = 0; b < RN; ++b)
          if (path[a][b] == kPathFast) acc_term(S[a][b], dig[a][b], adds[a][b], interval, blk[a][b]);
    } else {
#pragma unroll
      for (int a = 0; a < RM; ++a)
#pragma unroll
        for (int b = 0; b < RN; ++b) {
          if (path[a][b] == kPathSkip) continue;
          const int r = ty + 16 * a, c = tx + 16 * b;
          if (path[a][b] == kPathFast) {
            double s = 0.0;
            for (int kk = 0; kk < BK; ++kk) s = fma(xsh[kk][r], wsh[kk][c], s);
            acc_term(S[a][b], dig[a][b], adds[a][b], interval, s);
          } else {
            for (int kk = 0; kk < BK; ++kk)
              acc_any(S[a][b], dig[a][b], adds[a][b], interval, xsh[kk][r] * wsh[kk][c]);
          }
        }
    }
    __syncthreads();
  }

#pragma unroll
  for (int a = 0; a < RM; ++a)
#pragma unroll
    for (int b = 0; b < RN; ++b) {
      const int64_t gm = m0 + ty + 16 * a, gn = n0 + tx + 16 * b;
      if (gm >= M || gn >= N) continue;
      if (bias) acc_any(S[a][b], dig[a][b], adds[a][b], interval, bias[gn]);
      acc_finish(S[a][b], dig[a][b]);
      const int64_t o = gm * N + gn;
      if (kFinalize) {
        store_fmt(out_f, o, finalize_fmt(dig[a][b], out_fmt), out_fmt);
      } else {
        for (int q = 0; q < LDET_WORDS; ++q) out_d[o * LDET_WORDS + q] = dig[a][b][q];
      }
    }
}

template <typename T, bool kFinalize>
void launch(const at::Tensor& x, const at::Tensor& w, const at::Tensor& xs, const at::Tensor& ws, const double* bias,
            int64_t nkb, int64_t interval, int out_fmt, at::Tensor& out) {
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  const T* wp = reinterpret_cast<const T*>(w.data_ptr());
  const int st_threads = 256;
  if (M * nkb > 0) {
    stats_kernel<T><<<unsigned((M * nkb + st_threads - 1) / st_threads), st_threads, 0, stream>>>(
        xp, M, K, nkb, xs.data_ptr<int32_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (N * nkb > 0) {
    stats_kernel<T><<<unsigned((N * nkb + st_threads - 1) / st_threads), st_threads, 0, stream>>>(
        wp, N, K, nkb, ws.data_ptr<int32_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  TORCH_CHECK((M + BM - 1) / BM < 65536, "x: M = ", M, " exceeds this kernel's grid limit of ", 65535 * BM, " rows");
  dim3 grid(unsigned((N + BN - 1) / BN), unsigned((M + BM - 1) / BM));
  gemm_kernel<T, kFinalize><<<grid, THREADS, 0, stream>>>(
      xp, wp, xs.data_ptr<int32_t>(), ws.data_ptr<int32_t>(), bias, M, N, K, nkb, interval, out_fmt,
      kFinalize ? out.data_ptr() : nullptr, kFinalize ? nullptr : out.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <bool kFinalize>
at::Tensor gemm_common_cuda(const at::Tensor& x_in, const at::Tensor& w_in, const c10::optional<at::Tensor>& bias,
                            int64_t norm_interval, at::ScalarType out_dtype) {
  check_gemm_args(x_in, w_in, bias);
  TORCH_CHECK(x_in.device() == w_in.device(), "w: expected device ", x_in.device(), " to match x, got ", w_in.device());
  c10::cuda::CUDAGuard guard(x_in.device());
  // Mixed input dtypes: widen both to fp32 (exact), so one kernel type serves.
  at::Tensor x = x_in, w = w_in;
  if (x.scalar_type() != w.scalar_type()) {
    x = x.to(at::kFloat);
    w = w.to(at::kFloat);
  }
  auto [xsplit, wsplit] = split_fp32_for_fast_path(x, w);
  if (xsplit.defined()) {
    x = xsplit;
    w = wsplit;
  }
  x = x.contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const int64_t nkb = (K + BK - 1) / BK;
  const int64_t interval = norm_interval > 0 ? norm_interval : LDET_NORM_INTERVAL;
  at::Tensor bd;
  if (bias.has_value()) {
    TORCH_CHECK(bias->device() == x_in.device(), "bias: expected device ", x_in.device(), ", got ", bias->device());
    bd = bias->to(at::kDouble).contiguous();
  }
  at::Tensor xs = at::empty({M * nkb}, x.options().dtype(at::kInt));
  at::Tensor ws = at::empty({N * nkb}, x.options().dtype(at::kInt));
  at::Tensor out = kFinalize ? at::empty({M, N}, x.options().dtype(out_dtype))
                             : at::empty({M, N, LDET_WORDS}, x.options().dtype(at::kLong));
  if (M * N == 0) return out;
  const double* bp = bias.has_value() ? bd.data_ptr<double>() : nullptr;
  const int fmt = out_format(out_dtype);
  switch (x.scalar_type()) {
    case at::kFloat:
      launch<float, kFinalize>(x, w, xs, ws, bp, nkb, interval, fmt, out);
      break;
    case at::kBFloat16:
      launch<__nv_bfloat16, kFinalize>(x, w, xs, ws, bp, nkb, interval, fmt, out);
      break;
    default:
      launch<__half, kFinalize>(x, w, xs, ws, bp, nkb, interval, fmt, out);
      break;
  }
  return out;
}

at::Tensor gemm_partial_cuda(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                             int64_t norm_interval) {
  return gemm_common_cuda<false>(x, w, bias, norm_interval, at::kFloat);
}

at::Tensor gemm_cuda(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                     c10::optional<at::ScalarType> out_dtype) {
  return gemm_common_cuda<true>(x, w, bias, 0, out_dtype.value_or(at::kFloat));
}

}  // namespace

TORCH_LIBRARY_IMPL(ldet, CUDA, m) {
  m.impl("gemm_partial", &gemm_partial_cuda);
  m.impl("gemm", &gemm_cuda);
}

}  // namespace ldet

// CUDA kernels of the fp64 route (scheme and proof: csrc/fp64_bound.h; driver: fp64_bound_host.h).
//
// Per GEMM: the operands' row norms (a warp a row), cuBLASLt's native fp64 GEMM, the decision (a
// thread an output: one fp64 read, the rounding of both ends of its interval, one store), and a
// sweep that finds the undecided marks 32 outputs at a time and recomputes each marked output by
// one warp (compensated sum; the long accumulator where that cannot decide either). No host
// synchronization: the sweep reads the marks on the device.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>

#include "cuda/int8_gemm_lt.h"
#include "cuda/warp_digits.cuh"
#include "fp64_bound_host.h"

namespace ldet {
namespace {

constexpr int kThreads = 256;
constexpr unsigned kFull = 0xffffffffu;

unsigned blocks_for(int64_t items, int per_block) {
  return unsigned(std::max<int64_t>(1, std::min<int64_t>((items + per_block - 1) / per_block, 65535 * 8)));
}

void fp64_gemm_cuda(const at::Tensor& xd, const at::Tensor& wd, at::Tensor& D) {
  fp64_gemm_lt(Fp64Gemm{xd.data_ptr<double>(), true, xd.stride(0), wd.data_ptr<double>(), true, wd.stride(0),
                        D.data_ptr<double>(), D.stride(0), xd.size(0), wd.size(0), xd.size(1)},
               xd.device());
}

// A warp per row: each lane's share of the squares (exact in fp64), added in any order (the
// bound allows every order), then norm_upper.
__global__ void __launch_bounds__(kThreads) row_norms_kernel(Elems a, int64_t R, int64_t K, double* __restrict__ out) {
  const int lane = threadIdx.x & 31;
  const int64_t nwarps = (int64_t(gridDim.x) * blockDim.x) >> 5;
  for (int64_t r = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; r < R; r += nwarps) {
    double q = 0.0;
    for (int64_t k = lane; k < K; k += 32) {
      const double v = a.at(r, k);
      q += v * v;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) q += __shfl_xor_sync(kFull, q, o);
    if (lane == 0) out[r] = norm_upper(q, K);
  }
}

at::Tensor row_norms_cuda(const at::Tensor& a) {
  const int64_t R = a.size(0), K = a.size(1);
  at::Tensor out = uninit({R}, a.options().dtype(at::kDouble));  // every row written
  if (R > 0) {
    row_norms_kernel<<<blocks_for(R, kThreads / 32), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        elems_of(a), R, K, out.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out;
}

// A block per row of D (grid-stride over rows), its threads along the row: no division per output.
__global__ void __launch_bounds__(kThreads)
    decide_kernel(const double* __restrict__ D, int64_t M, int64_t n, const double* __restrict__ ux,
                  const double* __restrict__ uw, const double* __restrict__ bias, int64_t K, int64_t N, int64_t n0,
                  int fmt, void* __restrict__ out) {
  const float mark = __uint_as_float(0x7fc00000u);
  for (int64_t m = blockIdx.x; m < M; m += gridDim.x) {
    const double xm = ux[m];
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      float v;
      const double b = bias != nullptr ? bias[n0 + j] : 0.0;
      if (!round_if_decided(D[m * n + j], gemm_radius(xm, uw[n0 + j], K), b, fmt, &v)) v = mark;
      store_fmt(out, m * N + n0 + j, v, fmt);
    }
  }
}

void decide_cuda(const at::Tensor& D, const at::Tensor& ux, const at::Tensor& uw, const at::Tensor& bias, int64_t K,
                 int64_t n0, int fmt, at::Tensor& out) {
  const int64_t M = D.size(0), n = D.size(1);
  decide_kernel<<<unsigned(std::min<int64_t>(M, 65535 * 8)), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      D.data_ptr<double>(), M, n, ux.data_ptr<double>(), uw.data_ptr<double>(),
      bias.defined() ? bias.data_ptr<double>() : nullptr, K, out.size(1), n0, fmt, out.data_ptr());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

__device__ __forceinline__ bool marked(const void* out, int64_t i, int fmt) {
  if (fmt == kFmtF32) return undecided_mark_f32(__float_as_uint(static_cast<const float*>(out)[i]));
  return undecided_mark_16(static_cast<const uint16_t*>(out)[i], fmt);
}

// A warp per 32 outputs (grid-stride): the lanes read their outputs' marks, and the warp then
// recomputes each marked one in turn, lanes along its row (header comment of fp64_bound.h, steps
// 1 and 2). The butterfly's merges give every lane the same sums; lane 0's decision and value are
// taken all the same, so the warp never splits around the shuffles of the long accumulator.
__global__ void __launch_bounds__(kThreads)
    fix_kernel(Elems x, Elems w, int64_t M, int64_t N, int64_t K, const double* __restrict__ bias,
               const double* __restrict__ ux, const double* __restrict__ uw, int fmt, void* __restrict__ out,
               unsigned long long* __restrict__ counts) {
  const int lane = threadIdx.x & 31;
  const int64_t total = M * N, groups = (total + 31) / 32;
  const int64_t nwarps = (int64_t(gridDim.x) * blockDim.x) >> 5;
  for (int64_t g = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; g < groups; g += nwarps) {
    const int64_t i = g * 32 + lane;
    unsigned mask = __ballot_sync(kFull, i < total && marked(out, i, fmt));
    while (mask != 0u) {
      const int64_t o = g * 32 + (__ffs(mask) - 1);
      mask &= mask - 1;
      const int64_t m = o / N, n = o - m * N;
      CompensatedSum cs;
      for (int64_t k = lane; k < K; k += 32) cs.add(x.at(m, k) * w.at(n, k));  // exact products
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        CompensatedSum other;
        other.s = __shfl_xor_sync(kFull, cs.s, off);
        other.c = __shfl_xor_sync(kFull, cs.c, off);
        cs.merge(other);
      }
      const double b = bias != nullptr ? bias[n] : 0.0;
      float v = 0.0f;
      bool ok = round_compensated(cs, ux[m], uw[n], K, b, fmt, &v);
      ok = __shfl_sync(kFull, ok, 0) != 0;
      v = __shfl_sync(kFull, v, 0);
      if (!ok) {
        int64_t acc[LDET_WORDS];
        warp_row_digits(K, lane, [&](int64_t k) { return x.at(m, k) * w.at(n, k); }, acc);
        if (bias != nullptr) {
          add_value(acc, b);
          normalize(acc);
        }
        v = finalize_fmt(acc, fmt);
      }
      if (lane == 0) {
        store_fmt(out, o, v, fmt);
        atomicAdd(&counts[0], 1ull);
        if (!ok) atomicAdd(&counts[1], 1ull);
      }
    }
  }
}

void fix_cuda(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, const at::Tensor& ux,
              const at::Tensor& uw, int fmt, at::Tensor& out, at::Tensor& counts) {
  const int64_t M = out.size(0), N = out.size(1);
  fix_kernel<<<blocks_for((M * N + 31) / 32, kThreads / 32), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      elems_of(x), elems_of(w), M, N, x.size(1), bias.defined() ? bias.data_ptr<double>() : nullptr,
      ux.data_ptr<double>(), uw.data_ptr<double>(), fmt, out.data_ptr(),
      reinterpret_cast<unsigned long long*>(counts.data_ptr<int64_t>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

const Fp64Backend& fp64_backend_cuda() {
  static const Fp64Backend be{&fp64_gemm_cuda, &row_norms_cuda, &decide_cuda, &fix_cuda,
                              // rounded outputs with an fp32 operand from 2^30 multiply-adds
                              // (benchmarks/NOTES.md, session 20; bf16/fp16 keep the slices)
                              int64_t(1) << 30};
  return be;
}

}  // namespace ldet

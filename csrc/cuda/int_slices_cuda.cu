// CUDA kernels of the integer-slice GEMM (scheme: csrc/int_slices.h; driver: csrc/int_slices_host.h).
// The int8 GEMMs themselves are cuBLASLt's (at::_int_mm): exact int32 accumulation.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "cuda/elements.cuh"
#include "int_slices_host.h"
#include "op_checks.h"

namespace ldet {
namespace {

constexpr int kRowThreads = 256;
constexpr int kThreads = 256;

unsigned grid_for(int64_t n) { return unsigned(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535 * 16)); }

// One block per row: the row's largest exponent, lowest set bit and any inf/NaN, reduced.
template <typename T>
__global__ void row_needs_kernel(const T* __restrict__ a, int64_t R, int64_t K, int bits, int32_t* __restrict__ out) {
  __shared__ int s_hi[kRowThreads], s_lo[kRowThreads], s_bad[kRowThreads];
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    int hi = -32768, lo = 32767, bad = 0;
    for (int64_t k = threadIdx.x; k < K; k += blockDim.x) {
      const double v = wide(a, r * K + k);
      if (!is_finite(v)) {
        bad = 1;
      } else {
        const ExpStat s = exp_stat(v);
        hi = max(hi, s.hi);
        lo = min(lo, s.lo);
      }
    }
    s_hi[threadIdx.x] = hi;
    s_lo[threadIdx.x] = lo;
    s_bad[threadIdx.x] = bad;
    __syncthreads();
    for (int st = blockDim.x / 2; st > 0; st >>= 1) {
      if (threadIdx.x < st) {
        s_hi[threadIdx.x] = max(s_hi[threadIdx.x], s_hi[threadIdx.x + st]);
        s_lo[threadIdx.x] = min(s_lo[threadIdx.x], s_lo[threadIdx.x + st]);
        s_bad[threadIdx.x] |= s_bad[threadIdx.x + st];
      }
      __syncthreads();
    }
    if (threadIdx.x == 0) {
      out[2 * r] = s_hi[0];
      out[2 * r + 1] = s_bad[0] ? kSliceNeedBad : slices_needed(s_hi[0], s_lo[0], bits);
    }
    __syncthreads();
  }
}

template <typename T>
__global__ void make_slices_kernel(const T* __restrict__ a, const int32_t* __restrict__ needs, int64_t R, int64_t K,
                                   int S, int bits, bool reverse, int64_t Kc, int64_t width, int8_t* __restrict__ out,
                                   int32_t* __restrict__ sh) {
  const int64_t n = R * K;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / K, k = i - r * K;
    const int need = needs[2 * r + 1];
    if (need == 0 || need > S) continue;  // zero row, or left to the long-accumulator kernel
    const int s = bits * S - 3 - needs[2 * r];
    if (k == 0) sh[r] = s;
    const int64_t c = k / Kc, kk = k - c * Kc;
    int8_t* dst = out + r * width + (c * S + (reverse ? S - 1 : 0)) * Kc + kk;
    slice_digits(wide(a, i), s, S, bits, dst, reverse ? -Kc : Kc);
  }
}

__global__ void combine_kernel(const int32_t* __restrict__ C, int64_t P, int64_t Mp, int64_t Ncp, int64_t M,
                               int64_t Nv, const int32_t* __restrict__ shx, const int32_t* __restrict__ shw,
                               const double* __restrict__ bias, int D, int bits, bool wide_ok, bool digits, int fmt,
                               void* __restrict__ out) {
  const int64_t n_out = M * Nv;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n_out; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t m = i / Nv, n = i - m * Nv;
    const int32_t* cp = C + m * Ncp + n;
    const int E = -(shx[m] + shw[n]);
    const double* bn = bias ? bias + n : nullptr;
    if (digits) {
      combine_output(cp, Mp * Ncp, int(P), D, bits, E, bn, wide_ok, fmt, nullptr,
                     static_cast<int64_t*>(out) + i * LDET_WORDS);
    } else {
      float v;
      combine_output(cp, Mp * Ncp, int(P), D, bits, E, bn, wide_ok, fmt, &v, nullptr);
      store_fmt(out, i, v, fmt);
    }
  }
}

at::Tensor row_needs_cuda(const at::Tensor& a, int64_t bits) {
  const int64_t R = a.size(0), K = a.size(1);
  at::Tensor out = at::empty({R, 2}, a.options().dtype(at::kInt));
  const unsigned grid = unsigned(std::min<int64_t>(R, 65535 * 4));
  with_elements(a, [&](auto* p) {
    row_needs_kernel<<<grid, kRowThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(p, R, K, int(bits),
                                                                                   out.data_ptr<int32_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

std::pair<at::Tensor, at::Tensor> make_slices_cuda(const at::Tensor& a, const at::Tensor& needs, int64_t S,
                                                   int64_t bits, bool reverse, int64_t Kc, int64_t nch, int64_t Rp) {
  const int64_t R = a.size(0), K = a.size(1), width = nch * S * Kc;
  at::Tensor out = at::zeros({Rp, width}, a.options().dtype(at::kChar));
  at::Tensor sh = at::zeros({R}, a.options().dtype(at::kInt));
  if (S > 0 && R * K > 0) {
    with_elements(a, [&](auto* p) {
      make_slices_kernel<<<grid_for(R * K), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          p, needs.data_ptr<int32_t>(), R, K, int(S), int(bits), reverse, Kc, width, out.data_ptr<int8_t>(),
          sh.data_ptr<int32_t>());
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {out, sh};
}

at::Tensor combine_cuda(const at::Tensor& C, int64_t M, int64_t Nv, const at::Tensor& shx, const at::Tensor& shw,
                        const at::Tensor& bias, int64_t D, int64_t bits, bool wide_ok, bool digits,
                        at::ScalarType out_dtype) {
  const int fmt = out_format(out_dtype);
  at::Tensor out = digits ? at::empty({M, Nv, LDET_WORDS}, C.options().dtype(at::kLong))
                          : at::empty({M, Nv}, C.options().dtype(out_dtype));
  const at::Tensor shw_c = shw.contiguous();
  if (M * Nv > 0) {
    combine_kernel<<<grid_for(M * Nv), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        C.data_ptr<int32_t>(), C.size(0), C.size(1), C.size(2), M, Nv, shx.data_ptr<int32_t>(),
        shw_c.data_ptr<int32_t>(), bias.defined() ? bias.data_ptr<double>() : nullptr, int(D), int(bits), wide_ok,
        digits, fmt, out.data_ptr());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out;
}

}  // namespace

const SliceBackend& slice_backend_cuda() {
  // cuBLASLt's int8 GEMM accumulates in int32 with no 16-bit intermediate: 8-bit digits.
  static const SliceBackend be{&row_needs_cuda, &make_slices_cuda, &combine_cuda, 8,
                               // bf16 at 1024^3: kernel 0.52x, slices 0.14x torch.mm fp32 (fixed costs);
                               // at 4096^3: 0.57x against 0.68x
                               int64_t(1) << 18, int64_t(1) << 34};
  return be;
}

}  // namespace ldet

// CUDA implementations of normalize / finalize / to_digits / scatter_sum (schemas: csrc/schema/digits.cpp).
// One thread per accumulator, running the same longacc.h code as the CPU.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <algorithm>

#include "cuda/elements.cuh"
#include "longacc.h"
#include "op_checks.h"
#include "uninit.h"

namespace ldet {
namespace {

constexpr int kThreads = 256;

unsigned blocks_for(int64_t n) { return unsigned((n + kThreads - 1) / kThreads); }

__global__ void normalize_kernel(int64_t* __restrict__ acc, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) normalize(acc + i * LDET_WORDS);
}

__global__ void finalize_kernel(const int64_t* __restrict__ acc, int64_t n, int fmt, int scale_exp, void* __restrict__ out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  int64_t tmp[LDET_WORDS];
  for (int w = 0; w < LDET_WORDS; ++w) tmp[w] = acc[i * LDET_WORDS + w];
  normalize(tmp);
  store_fmt(out, i, finalize_fmt(tmp, fmt, scale_exp), fmt);
}

template <typename T>
__device__ __forceinline__ double widen(T v);
template <>
__device__ __forceinline__ double widen<float>(float v) { return double(v); }
template <>
__device__ __forceinline__ double widen<__nv_bfloat16>(__nv_bfloat16 v) { return double(__bfloat162float(v)); }
template <>
__device__ __forceinline__ double widen<__half>(__half v) { return double(__half2float(v)); }

template <typename T>
__global__ void to_digits_kernel(const T* __restrict__ x, int64_t n, int64_t* __restrict__ out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  int64_t* d = out + i * LDET_WORDS;
  zero(d);
  add_value(d, widen<T>(x[i]));
  normalize(d);
}

at::Tensor normalize_cuda(const at::Tensor& acc) {
  check_acc(acc, "acc");
  c10::cuda::CUDAGuard guard(acc.device());
  at::Tensor out = acc.contiguous().clone();
  const int64_t n = out.numel() / LDET_WORDS;
  if (n) {
    normalize_kernel<<<blocks_for(n), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(out.data_ptr<int64_t>(), n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out;
}

at::Tensor finalize_cuda(const at::Tensor& acc, at::ScalarType dtype, int64_t scale_exp) {
  check_acc(acc, "acc");
  check_scale_exp(scale_exp);
  const int fmt = out_format(dtype);
  c10::cuda::CUDAGuard guard(acc.device());
  const at::Tensor a = acc.contiguous();
  auto sizes = a.sizes().vec();
  sizes.pop_back();
  at::Tensor out = uninit(sizes, a.options().dtype(dtype));  // one thread per output
  const int64_t n = out.numel();
  if (n) {
    finalize_kernel<<<blocks_for(n), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(a.data_ptr<int64_t>(), n, fmt, int(scale_exp),
                                                                                        out.data_ptr());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out;
}

at::Tensor to_digits_cuda(const at::Tensor& x_in) {
  check_float_input(x_in, "x");
  c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  auto sizes = x.sizes().vec();
  sizes.push_back(LDET_WORDS);
  at::Tensor out = uninit(sizes, x.options().dtype(at::kLong));  // every element's words written
  const int64_t n = x.numel();
  if (!n) return out;
  auto stream = c10::cuda::getCurrentCUDAStream();
  int64_t* o = out.data_ptr<int64_t>();
  switch (x.scalar_type()) {
    case at::kFloat:
      to_digits_kernel<float><<<blocks_for(n), kThreads, 0, stream>>>(x.data_ptr<float>(), n, o);
      break;
    case at::kBFloat16:
      to_digits_kernel<__nv_bfloat16><<<blocks_for(n), kThreads, 0, stream>>>(
          reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()), n, o);
      break;
    default:
      to_digits_kernel<__half><<<blocks_for(n), kThreads, 0, stream>>>(reinterpret_cast<const __half*>(x.data_ptr()), n, o);
      break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// Adds a chunk's canonical accumulator into out's words (integer atomics: exact, order-free).
__device__ void flush_into(int64_t* acc, unsigned long long* dst) {
  normalize(acc);
  for (int w = 0; w < LDET_WORDS; ++w) {
    if (acc[w] != 0) atomicAdd(dst + w, static_cast<unsigned long long>(acc[w]));  // two's complement
    acc[w] = 0;
  }
}

// Rows sorted by their output (sorted[t] = index[perm[t]]). Thread (chunk c of L sorted rows,
// column j) sums its rows' values in registers and flushes once per output it meets: ~ R / L
// accumulators a column instead of one (R, W, 19) array of every value's digits (a 640 MB
// temporary and 4 ms of the det_ddp step for a 4096 x 1024 embedding gradient).
template <typename T>
__global__ void scatter_sum_kernel(const T* __restrict__ a, const int64_t* __restrict__ sorted,
                                   const int64_t* __restrict__ perm, int64_t R, int64_t W, int64_t L, int64_t nchunks,
                                   int64_t n_out, unsigned long long* __restrict__ out) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= nchunks * W) return;
  const int64_t c = t / W, j = t - c * W;  // neighbouring threads: neighbouring columns
  const int64_t r0 = c * L, r1 = r0 + L < R ? r0 + L : R;
  int64_t acc[LDET_WORDS];
  zero(acc);
  int64_t cur = sorted[r0];
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t g = sorted[r];
    if (g != cur) {
      if (cur >= 0 && cur < n_out) flush_into(acc, out + (cur * W + j) * LDET_WORDS);
      zero(acc);
      cur = g;
    }
    add_value(acc, wide(a, perm[r] * W + j));
  }
  if (cur >= 0 && cur < n_out) flush_into(acc, out + (cur * W + j) * LDET_WORDS);
}

at::Tensor scatter_sum_cuda(const at::Tensor& a_in, const at::Tensor& index, int64_t n_out) {
  check_scatter_sum_args(a_in, index, n_out);
  c10::cuda::CUDAGuard guard(a_in.device());
  const at::Tensor a = a_in.contiguous();
  const int64_t R = a.size(0), W = a.size(1);
  at::Tensor out = at::zeros({n_out, W, LDET_WORDS}, a.options().dtype(at::kLong));
  if (R == 0 || W == 0) return out;
  auto [sorted, perm] = at::sort(index.contiguous());
  // checked on the device, in stream order: no host synchronization (the kernel skips such rows)
  at::_assert_async(at::logical_and(sorted.select(0, 0) >= 0, sorted.select(0, R - 1) < n_out),
                    "scatter_sum: index values must lie in [0, n_out)");
  // chunks of at least 64 rows, at most 2^20 of them: each output then receives fewer than 2^21
  // accumulators and each accumulator fewer than 2^21 values (the status counters' bound)
  const int64_t L = std::max<int64_t>(64, (R + (int64_t(1) << 20) - 1) >> 20);
  const int64_t nchunks = (R + L - 1) / L;
  auto stream = c10::cuda::getCurrentCUDAStream();
  with_elements(a, [&](auto* p) {
    scatter_sum_kernel<<<blocks_for(nchunks * W), kThreads, 0, stream>>>(
        p, sorted.data_ptr<int64_t>(), perm.data_ptr<int64_t>(), R, W, L, nchunks, n_out,
        reinterpret_cast<unsigned long long*>(out.data_ptr<int64_t>()));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t n = out.numel() / LDET_WORDS;
  normalize_kernel<<<blocks_for(n), kThreads, 0, stream>>>(out.data_ptr<int64_t>(), n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(ldet, CUDA, m) {
  m.impl("normalize", &normalize_cuda);
  m.impl("finalize", &finalize_cuda);
  m.impl("to_digits", &to_digits_cuda);
  m.impl("scatter_sum", &scatter_sum_cuda);
}

}  // namespace ldet

// CUDA implementations of act / act_backward / dot_rows / dot_cols (schemas:
// csrc/schema/detmath.cpp). One thread per element (activations) or per output sum (dots),
// running the same detmath.h / longacc.h code as the CPU. Inputs are widened to fp64 first
// (exact), which keeps one kernel per op; speed is a later concern, the bytes are the point.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "detmath.h"
#include "detmath_checks.h"

namespace ldet {
namespace {

constexpr int kThreads = 256;

unsigned blocks_for(int64_t n) { return unsigned((n + kThreads - 1) / kThreads); }

__global__ void act_kernel(const double* __restrict__ x, const double* __restrict__ g, int64_t n, int kind,
                           int fmt, void* __restrict__ out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const double v = g ? g[i] * act_derivative(x[i], kind) : act_forward(x[i], kind);
  store_fmt(out, i, round_double_fmt(v, fmt), fmt);
}

at::Tensor act_launch(const at::Tensor& x, const at::Tensor* grad, int64_t kind) {
  check_float_input(x, "x");
  check_act_kind(kind);
  c10::cuda::CUDAGuard guard(x.device());
  const int fmt = out_format(x.scalar_type());
  const at::Tensor xd = x.contiguous().to(at::kDouble);  // exact widening
  at::Tensor gd;
  if (grad) {
    check_float_input(*grad, "grad");
    TORCH_CHECK(grad->sizes() == x.sizes(), "grad: expected shape ", x.sizes(), " like x, got ", grad->sizes());
    TORCH_CHECK(grad->device() == x.device(), "grad: expected device ", x.device(), ", got ", grad->device());
    gd = grad->contiguous().to(at::kDouble);
  }
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t n = xd.numel();
  if (n) {
    act_kernel<<<blocks_for(n), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        xd.data_ptr<double>(), grad ? gd.data_ptr<double>() : nullptr, n, int(kind), fmt, out.data_ptr());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out;
}

at::Tensor act_cuda(const at::Tensor& x, int64_t kind) { return act_launch(x, nullptr, kind); }

at::Tensor act_backward_cuda(const at::Tensor& grad, const at::Tensor& x, int64_t kind) {
  return act_launch(x, &grad, kind);
}

// Sum over `len` elements starting at `base` with stride `step` (b == nullptr: ones).
__device__ void dot_strided(const double* a, const double* b, int64_t base, int64_t step, int64_t len,
                            int64_t* __restrict__ out) {
  int64_t acc[LDET_WORDS];
  zero(acc);
  for (int64_t j = 0; j < len; ++j) {
    const int64_t k = base + j * step;
    add_value(acc, b ? a[k] * b[k] : a[k]);  // exact product of two narrow floats
    if (((j + 1) & (LDET_NORM_INTERVAL - 1)) == 0) normalize(acc);
  }
  normalize(acc);
  for (int w = 0; w < LDET_WORDS; ++w) out[w] = acc[w];
}

__global__ void dot_rows_kernel(const double* a, const double* b, int64_t rows, int64_t cols,
                                int64_t* __restrict__ out) {
  const int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r < rows) dot_strided(a, b, r * cols, 1, cols, out + r * LDET_WORDS);
}

__global__ void dot_cols_kernel(const double* a, const double* b, int64_t rows, int64_t cols,
                                int64_t* __restrict__ out) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c < cols) dot_strided(a, b, c, cols, rows, out + c * LDET_WORDS);
}

at::Tensor dot_launch(const at::Tensor& a, const c10::optional<at::Tensor>& b, bool by_rows) {
  check_dot_args(a, b);
  c10::cuda::CUDAGuard guard(a.device());
  const at::Tensor ad = a.contiguous().to(at::kDouble);
  at::Tensor bd;
  if (b.has_value()) bd = b->contiguous().to(at::kDouble);
  const int64_t rows = a.size(0), cols = a.size(1);
  const int64_t n = by_rows ? rows : cols;
  at::Tensor out = at::empty({n, LDET_WORDS}, a.options().dtype(at::kLong));
  if (n) {
    const double* pb = b.has_value() ? bd.data_ptr<double>() : nullptr;
    auto stream = c10::cuda::getCurrentCUDAStream();
    if (by_rows) {
      dot_rows_kernel<<<blocks_for(n), kThreads, 0, stream>>>(ad.data_ptr<double>(), pb, rows, cols,
                                                              out.data_ptr<int64_t>());
    } else {
      dot_cols_kernel<<<blocks_for(n), kThreads, 0, stream>>>(ad.data_ptr<double>(), pb, rows, cols,
                                                              out.data_ptr<int64_t>());
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out;
}

at::Tensor dot_rows_cuda(const at::Tensor& a, const c10::optional<at::Tensor>& b) { return dot_launch(a, b, true); }
at::Tensor dot_cols_cuda(const at::Tensor& a, const c10::optional<at::Tensor>& b) { return dot_launch(a, b, false); }

}  // namespace

TORCH_LIBRARY_IMPL(ldet, CUDA, m) {
  m.impl("act", &act_cuda);
  m.impl("act_backward", &act_backward_cuda);
  m.impl("dot_rows", &dot_rows_cuda);
  m.impl("dot_cols", &dot_cols_cuda);
}

}  // namespace ldet

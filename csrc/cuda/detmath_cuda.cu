// CUDA implementations of act / act_backward / dot_rows / dot_cols / ce_row_loss (schemas:
// csrc/schema/detmath.cpp). One thread per element (activations) or per output sum (dots),
// running the same detmath.h / longacc.h code as the CPU. Each thread widens its inputs to fp64
// as it loads them (exact): no fp64 copies of whole tensors, which were twice an fp32 input's
// bytes beside it at det_ddp's memory peak (GELU's backward on the 4d-wide MLP activation).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <cstdlib>
#include <tuple>
#include <type_traits>
#include <utility>

#include "check.h"
#include "cuda/elements.cuh"
#include "cuda/gelu_fast.cuh"
#include "detmath.h"
#include "detmath_checks.h"
#include "uninit.h"
#include "window_acc.h"

namespace ldet {
namespace {

constexpr int kThreads = 256;

unsigned blocks_for(int64_t n) { return unsigned((n + kThreads - 1) / kThreads); }

// Two inputs of one element type: the same dtype as they are, else both widened to fp32 (exact).
std::pair<at::Tensor, at::Tensor> same_type(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() == b.scalar_type()) return {a.contiguous(), b.contiguous()};
  return {a.to(at::kFloat).contiguous(), b.to(at::kFloat).contiguous()};
}

// gelu_fast: erf-GELU takes gelu_fast.cuh's way first (the series' bytes, proven per element).
template <typename T>
__global__ void act_kernel(const T* __restrict__ x, const T* __restrict__ g, int64_t n, int kind,
                           int fmt, bool gelu_fast, void* __restrict__ out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const double xi = wide(x, i);
  const double gi = g ? wide(g, i) : 0.0;
  float r;
  if (!(gelu_fast && gelu_erf_fast(xi, gi, g != nullptr, fmt, &r))) {
    r = round_double_fmt(g ? gi * act_derivative(xi, kind) : act_forward(xi, kind), fmt);
  }
  store_fmt(out, i, r, fmt);
}

// LIGHTNING_DET_GELU_SERIES=1: erf-GELU by the series alone (tests/test_gelu_fast.py compares
// both ways; read at every call so a test can switch it).
bool gelu_fast_enabled(int64_t kind) {
  if (kind != kActGeluErf) return false;
  const char* env = std::getenv("LIGHTNING_DET_GELU_SERIES");
  return !(env != nullptr && env[0] == '1');
}

at::Tensor act_launch(const at::Tensor& x, const at::Tensor* grad, int64_t kind) {
  check_float_input(x, "x");
  check_act_kind(kind);
  c10::cuda::CUDAGuard guard(x.device());
  const int fmt = out_format(x.scalar_type());
  at::Tensor xc = x.contiguous(), gc;
  if (grad) {
    check_float_input(*grad, "grad");
    LDET_CHECK(grad->sizes() == x.sizes(), "grad: expected shape ", x.sizes(), " like x, got ", grad->sizes());
    LDET_CHECK(grad->device() == x.device(), "grad: expected device ", x.device(), ", got ", grad->device());
    std::tie(xc, gc) = same_type(x, *grad);
  }
  at::Tensor out = uninit(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));  // one thread per element
  const int64_t n = xc.numel();
  if (n) {
    auto stream = c10::cuda::getCurrentCUDAStream();
    const bool fast = gelu_fast_enabled(kind);
    with_elements(xc, [&](auto xp) {
      using T = std::remove_cv_t<std::remove_pointer_t<decltype(xp)>>;
      const T* gp = grad ? reinterpret_cast<const T*>(gc.data_ptr()) : nullptr;
      act_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(xp, gp, n, int(kind), fmt, fast, out.data_ptr());
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out;
}

at::Tensor act_cuda(const at::Tensor& x, int64_t kind) { return act_launch(x, nullptr, kind); }

__global__ void act_fp64_kernel(const double* __restrict__ x, const double* __restrict__ g, int64_t n, int kind,
                                double* __restrict__ out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = g ? g[i] * act_derivative(x[i], kind) : act_forward(x[i], kind);
}

at::Tensor act_fp64_cuda(const at::Tensor& x, int64_t kind, const c10::optional<at::Tensor>& grad) {
  check_act_fp64_args(x, grad);
  check_act_kind(kind);
  c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  const at::Tensor gc = grad.has_value() ? grad->contiguous() : at::Tensor();
  at::Tensor out = uninit(x.sizes(), xc.options());  // one thread per element
  const int64_t n = xc.numel();
  if (n) {
    act_fp64_kernel<<<blocks_for(n), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        xc.data_ptr<double>(), gc.defined() ? gc.data_ptr<double>() : nullptr, n, int(kind), out.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out;
}

at::Tensor act_backward_cuda(const at::Tensor& grad, const at::Tensor& x, int64_t kind) {
  return act_launch(x, &grad, kind);
}

// Terms loaded before any is added: a thread of dot_partial_kernel kept one load in flight
// while window_add's branches ran (under a fifth of a wave resident, stalls on L1TEX loads), so
// the kernel ran at a fraction of its memory floor.
constexpr int kDotLoadsInFlight = 8;

// Sum over `len` elements starting at `base` with stride `step` (b == nullptr: ones). The terms
// are added in index order, kDotLoadsInFlight loaded at a time; the order cannot show in the
// bytes anyway (the digits' canonical form of an exact sum is unique).
template <typename T>
__device__ void dot_strided(const T* a, const T* b, int64_t base, int64_t step, int64_t len,
                            int64_t* __restrict__ out) {
  int64_t acc[LDET_WORDS];
  zero(acc);
  WindowAcc win;  // most terms stay in registers (csrc/window_acc.h)
  for (int64_t j0 = 0; j0 < len; j0 += kDotLoadsInFlight) {
    const int64_t n = len - j0 < kDotLoadsInFlight ? len - j0 : kDotLoadsInFlight;
    double v[kDotLoadsInFlight];
#pragma unroll
    for (int u = 0; u < kDotLoadsInFlight; ++u) {
      const int64_t k = base + (j0 + u) * step;
      v[u] = u < n ? (b ? wide(a, k) * wide(b, k) : wide(a, k)) : 0.0;  // exact product of two narrow floats
    }
#pragma unroll
    for (int u = 0; u < kDotLoadsInFlight; ++u) {
      if (u < n) window_add(win, acc, v[u]);
    }
    // LDET_NORM_INTERVAL (2^30) is a multiple of kDotLoadsInFlight: this is the per-term rule
    if (((j0 + kDotLoadsInFlight) & (LDET_NORM_INTERVAL - 1)) == 0) normalize(acc);
  }
  window_flush(win, acc);
  normalize(acc);
  for (int w = 0; w < LDET_WORDS; ++w) out[w] = acc[w];
}

// Output o's sum runs over len elements a[o * o_step + j * e_step], j < len (rows: o_step =
// cols, e_step = 1; columns: o_step = 1, e_step = cols). One thread per output left most of the
// GPU idle (1024 threads for a LayerNorm's column sums over 4096 rows: 13% of det_ddp's step),
// so each thread sums one chunk of one output into canonical partial digits, and a second
// kernel adds an output's partials (integers: exact in any order) and normalizes. The canonical
// form of an exact sum is unique, so the chunking never shows in the bytes.
template <typename T>
__global__ void dot_partial_kernel(const T* a, const T* b, int64_t n, int64_t len, int64_t o_step, int64_t e_step,
                                   int64_t chunk, int64_t nchunks, int64_t* __restrict__ partial) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= n * nchunks) return;
  const int64_t o = t % n, c = t / n;  // neighbouring threads: neighbouring outputs
  const int64_t j0 = c * chunk, j1 = j0 + chunk < len ? j0 + chunk : len;
  dot_strided(a, b, o * o_step + j0 * e_step, e_step, j1 > j0 ? j1 - j0 : 0, partial + (c * n + o) * LDET_WORDS);
}

// Outputs per block of the combine: one thread per (output, word), 13 outputs at 256 threads.
constexpr int kCombineOutputs = kThreads / LDET_WORDS;

// Adds each output's nchunks partials word by word, then normalizes. One thread per (output,
// word): a block's loads of one chunk are kCombineOutputs * 19 consecutive words (coalesced).
// One thread per output instead gave each thread 19 * nchunks loads (1024 threads for a
// LayerNorm's column sums, 1216 loads each: ~40% of the dot sums' GPU time).
__global__ void dot_combine_kernel(const int64_t* __restrict__ partial, int64_t n, int64_t nchunks,
                                   int64_t* __restrict__ out) {
  __shared__ int64_t s[kCombineOutputs * LDET_WORDS];
  const int64_t o0 = int64_t(blockIdx.x) * kCombineOutputs;
  const int64_t outputs = n - o0 < kCombineOutputs ? n - o0 : kCombineOutputs;
  const int i = threadIdx.x;  // word i % 19 of output o0 + i / 19
  if (i < outputs * LDET_WORDS) {
    // nchunks canonical words: far inside the headroom (2^31 - 1 of them, longacc.h)
    const int64_t* p = partial + o0 * LDET_WORDS + i;
    int64_t sum = 0;
    for (int64_t c = 0; c < nchunks; ++c) sum += p[c * n * LDET_WORDS];
    s[i] = sum;
  }
  __syncthreads();
  if (i < outputs) {
    int64_t acc[LDET_WORDS];
    for (int w = 0; w < LDET_WORDS; ++w) acc[w] = s[i * LDET_WORDS + w];
    normalize(acc);
    for (int w = 0; w < LDET_WORDS; ++w) s[i * LDET_WORDS + w] = acc[w];
  }
  __syncthreads();
  if (i < outputs * LDET_WORDS) out[o0 * LDET_WORDS + i] = s[i];
}

// Chunks per output: enough threads to fill the GPU (~64K), chunks of at least 64 elements.
int64_t dot_chunks(int64_t n, int64_t len) {
  constexpr int64_t kTargetThreads = int64_t(1) << 16, kMinChunk = 64;
  int64_t want = (kTargetThreads + n - 1) / n;
  const int64_t most = (len + kMinChunk - 1) / kMinChunk;
  if (want > most) want = most;
  return want < 1 ? 1 : want;
}

at::Tensor dot_launch(const at::Tensor& a, const c10::optional<at::Tensor>& b, bool by_rows) {
  check_dot_args(a, b);
  c10::cuda::CUDAGuard guard(a.device());
  at::Tensor ac = a.contiguous(), bc;
  if (b.has_value()) std::tie(ac, bc) = same_type(a, *b);
  const int64_t rows = a.size(0), cols = a.size(1);
  const int64_t n = by_rows ? rows : cols, len = by_rows ? cols : rows;
  const int64_t o_step = by_rows ? cols : 1, e_step = by_rows ? 1 : cols;
  at::Tensor out = uninit({n, LDET_WORDS}, a.options().dtype(at::kLong));  // every output's words written
  if (n) {
    int64_t nchunks = dot_chunks(n, len);
    const int64_t chunk = len > 0 ? (len + nchunks - 1) / nchunks : 0;
    if (chunk > 0) nchunks = (len + chunk - 1) / chunk;
    at::Tensor partial = nchunks == 1 ? out : uninit({nchunks, n, LDET_WORDS}, out.options());  // every (chunk, output)
    auto stream = c10::cuda::getCurrentCUDAStream();
    with_elements(ac, [&](auto ap) {
      using T = std::remove_cv_t<std::remove_pointer_t<decltype(ap)>>;
      const T* bp = b.has_value() ? reinterpret_cast<const T*>(bc.data_ptr()) : nullptr;
      dot_partial_kernel<T><<<blocks_for(n * nchunks), kThreads, 0, stream>>>(
          ap, bp, n, len, o_step, e_step, chunk, nchunks, partial.data_ptr<int64_t>());
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (nchunks > 1) {
      const unsigned blocks = unsigned((n + kCombineOutputs - 1) / kCombineOutputs);
      dot_combine_kernel<<<blocks, kThreads, 0, stream>>>(partial.data_ptr<int64_t>(), n, nchunks,
                                                          out.data_ptr<int64_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
  return out;
}

at::Tensor dot_rows_cuda(const at::Tensor& a, const c10::optional<at::Tensor>& b) { return dot_launch(a, b, true); }
at::Tensor dot_cols_cuda(const at::Tensor& a, const c10::optional<at::Tensor>& b) { return dot_launch(a, b, false); }

__global__ void ce_row_loss_kernel(const float* __restrict__ m, const float* __restrict__ picked,
                                   const float* __restrict__ t_minus, int64_t n, float* __restrict__ out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = ce_row_loss(m[i], picked[i], t_minus[i]);
}

at::Tensor ce_row_loss_cuda(const at::Tensor& m, const at::Tensor& picked, const at::Tensor& t_minus) {
  check_ce_row_args(m, picked, t_minus);
  c10::cuda::CUDAGuard guard(m.device());
  const at::Tensor mc = m.contiguous(), pc = picked.contiguous(), tc = t_minus.contiguous();
  at::Tensor out = uninit(m.sizes(), m.options());  // one thread per element
  const int64_t n = m.numel();
  if (n) {
    ce_row_loss_kernel<<<blocks_for(n), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        mc.data_ptr<float>(), pc.data_ptr<float>(), tc.data_ptr<float>(), n, out.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(ldet, CUDA, m) {
  m.impl("act", &act_cuda);
  m.impl("act_backward", &act_backward_cuda);
  m.impl("act_fp64", &act_fp64_cuda);
  m.impl("dot_rows", &dot_rows_cuda);
  m.impl("dot_cols", &dot_cols_cuda);
  m.impl("ce_row_loss", &ce_row_loss_cuda);
}

}  // namespace ldet

// CUDA kernels of the fp64 route (scheme and proof: csrc/fp64_bound.h; driver: fp64_bound_host.h).
//
// Per GEMM: each operand widened to fp64 with its row norms in the same pass (a warp a row),
// cuBLASLt's native fp64 GEMM, the decision (a thread an output: one fp64 read, its interval's
// two roundings, one store; undecided outputs marked and listed with one atomic a warp), then the
// listed outputs recomputed by a warp each (an fp64 sum of known depth; for the few it leaves, a
// certificate that an fp64 sum was exact, else the long accumulator), and a sweep for marks past
// the list's capacity (adversarial data). No host synchronization: every count is read on the
// device.
//
// Why this shape: a sweep of the whole output that recomputed each mark with a compensated sum
// and carried the long accumulator's registers cost a det_ddp step more than its fp64 GEMMs did;
// the decision with the generic rounding, and widening and norms in separate passes with
// PyTorch's fill of new buffers, each cost a large share of the GEMMs' time too.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <utility>

#include "cuda/elements.cuh"
#include "cuda/int8_gemm_lt.h"
#include "cuda/warp_digits.cuh"
#include "fp64_bound_host.h"

namespace ldet {
namespace {

constexpr int kThreads = 256;
constexpr unsigned kFull = 0xffffffffu;
constexpr int kLanesUnroll = 4;  // independent sums a lane keeps: loads in flight, and depth K / 128

unsigned blocks_for(int64_t items, int per_block) {
  return unsigned(std::max<int64_t>(1, std::min<int64_t>((items + per_block - 1) / per_block, 65535 * 8)));
}

// Enough resident warps to keep every SM busy on a list whose length only the device knows
// (the SM count read once per device: host time per GEMM).
unsigned persistent_blocks() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> sms_of[kMaxDevices] = {};
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  int sms = dev < kMaxDevices ? sms_of[dev].load(std::memory_order_relaxed) : 0;
  if (sms == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    if (dev < kMaxDevices) sms_of[dev].store(sms, std::memory_order_relaxed);
  }
  return unsigned(std::max(1, sms) * 8);
}

// A warp per row: the exact fp64 copy, and the sum of squares (each exact) in any order for
// norm_upper, which allows every order.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    widen_kernel(const T* __restrict__ a, int64_t lda, int64_t R, int64_t K, double* __restrict__ ad,
                 double* __restrict__ norms) {
  const int lane = threadIdx.x & 31;
  const int64_t nwarps = (int64_t(gridDim.x) * blockDim.x) >> 5;
  for (int64_t r = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; r < R; r += nwarps) {
    double q = 0.0;
    for (int64_t k = lane; k < K; k += 32) {
      const double v = wide(a, r * lda + k);
      ad[r * K + k] = v;
      q += v * v;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) q += __shfl_xor_sync(kFull, q, o);
    if (lane == 0) norms[r] = norm_upper(q, K);
  }
}

std::pair<at::Tensor, at::Tensor> widen_cuda(const at::Tensor& a) {
  const int64_t R = a.size(0), K = a.size(1);
  at::Tensor ad = uninit({R, K}, a.options().dtype(at::kDouble));  // every element written
  at::Tensor norms = uninit({R}, a.options().dtype(at::kDouble));  // every row written
  if (R > 0) {
    with_elements(a, [&](auto* p) {
      widen_kernel<<<blocks_for(R, kThreads / 32), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          p, a.stride(0), R, K, ad.data_ptr<double>(), norms.data_ptr<double>());
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {ad, norms};
}

void fp64_gemm_cuda(const at::Tensor& xd, const at::Tensor& wd, at::Tensor& D) {
  fp64_gemm_lt(Fp64Gemm{xd.data_ptr<double>(), true, xd.stride(0), wd.data_ptr<double>(), true, wd.stride(0),
                        D.data_ptr<double>(), D.stride(0), xd.size(0), wd.size(0), xd.size(1)},
               xd.device());
}

// Appends o (flat output index) for each lane with `want` among the active lanes: one atomic a
// warp. Indices past cap are counted, not stored (their outputs stay marked for the sweep).
__device__ __forceinline__ void append(bool want, int64_t o, unsigned long long* count, int64_t* list, int64_t cap) {
  const unsigned active = __activemask();
  const unsigned ball = __ballot_sync(active, want);
  if (ball == 0u) return;
  const int lane = threadIdx.x & 31, leader = __ffs(ball) - 1;
  unsigned long long base = 0;
  if (lane == leader) base = atomicAdd(count, (unsigned long long)__popc(ball));
  base = __shfl_sync(active, base, leader);
  if (want) {
    const unsigned long long at = base + __popc(ball & ((1u << lane) - 1u));
    if (at < (unsigned long long)cap) list[at] = o;
  }
}

// A block per row of D (grid-stride over rows), its threads along the row: no division per output.
__global__ void __launch_bounds__(kThreads)
    decide_kernel(const double* __restrict__ D, int64_t M, int64_t n, const double* __restrict__ ux,
                  const double* __restrict__ uw, const double* __restrict__ bias, int64_t K, int64_t N, int64_t n0,
                  int fmt, void* __restrict__ out, unsigned long long* __restrict__ count, int64_t* __restrict__ list,
                  int64_t cap) {
  const float mark = __uint_as_float(0x7fc00000u);
  for (int64_t m = blockIdx.x; m < M; m += gridDim.x) {
    const double xm = ux[m];
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      float v;
      const double b = bias != nullptr ? bias[n0 + j] : 0.0;
      const bool ok = round_if_decided(D[m * n + j], gemm_radius(xm, uw[n0 + j], K), b, fmt, &v);
      const int64_t o = m * N + n0 + j;
      store_fmt(out, o, ok ? v : mark, fmt);
      append(!ok, o, count, list, cap);
    }
  }
}

void decide_cuda(const at::Tensor& D, const at::Tensor& ux, const at::Tensor& uw, const at::Tensor& bias, int64_t K,
                 int64_t n0, int fmt, at::Tensor& out, Fp64Lists& lists) {
  const int64_t M = D.size(0), n = D.size(1);
  decide_kernel<<<unsigned(std::min<int64_t>(M, 65535 * 8)), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      D.data_ptr<double>(), M, n, ux.data_ptr<double>(), uw.data_ptr<double>(),
      bias.defined() ? bias.data_ptr<double>() : nullptr, K, out.size(1), n0, fmt, out.data_ptr(),
      reinterpret_cast<unsigned long long*>(lists.counts.data_ptr<int64_t>()), lists.list1.data_ptr<int64_t>(),
      lists.cap);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The warp's fp64 sum of x[m, :] . w[n, :] (exact products) in an order of depth ordered_depth(K):
// lane l takes k = l (mod 32) into kLanesUnroll sums in turn (each at most ceil(K / 128) deep),
// which are added pairwise, then across the lanes by a butterfly. Every lane ends with the same
// value (fl(a + b) = fl(b + a)).
template <typename T>
__device__ double warp_ordered_sum(const T* __restrict__ xr, const T* __restrict__ wr, int64_t K, int lane) {
  double a[kLanesUnroll] = {0.0, 0.0, 0.0, 0.0};
  for (int64_t k0 = lane; k0 < K; k0 += 32 * kLanesUnroll) {
    double xv[kLanesUnroll], wv[kLanesUnroll];
#pragma unroll
    for (int u = 0; u < kLanesUnroll; ++u) {  // every load first: several in flight
      const int64_t k = k0 + 32 * u;
      xv[u] = k < K ? wide(xr, k) : 0.0;
      wv[u] = k < K ? wide(wr, k) : 0.0;
    }
#pragma unroll
    for (int u = 0; u < kLanesUnroll; ++u) a[u] = __fma_rn(xv[u], wv[u], a[u]);  // exact product, one rounding
  }
  double s = (a[0] + a[1]) + (a[2] + a[3]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(kFull, s, o);
  return s;
}

__host__ __device__ inline int64_t ordered_depth(int64_t K) {
  return (K + 32 * kLanesUnroll - 1) / (32 * kLanesUnroll) + 2 + 5;
}

// The warp's exact output (x[m, :] . w[n, :] + b), rounded once: the long accumulator.
template <typename T>
__device__ float warp_exact_output(const T* __restrict__ xr, const T* __restrict__ wr, int64_t K, const double* bias,
                                   int fmt, int lane) {
  int64_t acc[LDET_WORDS];
  warp_row_digits(K, lane, [&](int64_t k) { return wide(xr, k) * wide(wr, k); }, acc);
  if (bias != nullptr) {
    add_value(acc, *bias);
    normalize(acc);
  }
  return finalize_fmt(acc, fmt);
}

// The warp's fp64 sum (any order) of x[m, :] . w[n, :]'s exact products and the least lowest_bit
// among them, what round_if_exact needs; every lane ends with both.
template <typename T>
__device__ double warp_sum_lowest_bit(const T* __restrict__ xr, const T* __restrict__ wr, int64_t K, int lane,
                                      int* q_out) {
  double s = 0.0;
  int q = kNoBits;
  for (int64_t k = lane; k < K; k += 32) {
    const double p = wide(xr, k) * wide(wr, k);
    s += p;
    q = min(q, lowest_bit(p));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    s += __shfl_xor_sync(kFull, s, o);
    q = min(q, __shfl_xor_sync(kFull, q, o));
  }
  *q_out = q;
  return s;
}

// Steps 2 and 3 for one output, a warp: the exactness certificate, else the long accumulator
// (*long_acc says which). Every lane returns the value.
template <typename T>
__device__ float warp_certified_or_exact(const T* __restrict__ xr, const T* __restrict__ wr, int64_t K, double ux,
                                         double uw, const double* bias, int fmt, int lane, bool* long_acc) {
  int q;
  const double S = warp_sum_lowest_bit(xr, wr, K, lane, &q);
  float v;
  *long_acc = !round_if_exact(S, q, ux, uw, bias != nullptr ? *bias : 0.0, fmt, &v);  // warp-uniform
  if (*long_acc) v = warp_exact_output(xr, wr, K, bias, fmt, lane);
  return v;
}

// Step 1 for the listed outputs, a warp each; those it cannot decide go to list2.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    fix_listed_kernel(const T* __restrict__ x, int64_t ldx, const T* __restrict__ w, int64_t ldw, int64_t N, int64_t K,
                      const double* __restrict__ bias, const double* __restrict__ ux, const double* __restrict__ uw,
                      int fmt, void* __restrict__ out, unsigned long long* __restrict__ counts,
                      const int64_t* __restrict__ list1, int64_t* __restrict__ list2, int64_t cap) {
  const int lane = threadIdx.x & 31;
  const int64_t n1 = std::min<int64_t>(int64_t(counts[0]), cap);
  const int64_t nwarps = (int64_t(gridDim.x) * blockDim.x) >> 5;
  const int64_t depth = ordered_depth(K);
  for (int64_t e = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; e < n1; e += nwarps) {
    const int64_t o = list1[e], m = o / N, n = o - m * N;
    const double S = warp_ordered_sum(x + m * ldx, w + n * ldw, K, lane);
    if (lane == 0) {
      float v;
      if (round_ordered(S, ux[m], uw[n], depth, bias != nullptr ? bias[n] : 0.0, fmt, &v)) {
        store_fmt(out, o, v, fmt);
      } else {  // list2 holds at most as many as list1 (cap): no overflow
        list2[atomicAdd(&counts[2], 1ull)] = o;
      }
    }
  }
}

// Steps 2 and 3 for list2, a warp an output.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    exact_listed_kernel(const T* __restrict__ x, int64_t ldx, const T* __restrict__ w, int64_t ldw, int64_t N,
                        int64_t K, const double* __restrict__ bias, const double* __restrict__ ux,
                        const double* __restrict__ uw, int fmt, void* __restrict__ out,
                        unsigned long long* __restrict__ counts, const int64_t* __restrict__ list2) {
  const int lane = threadIdx.x & 31;
  const int64_t n2 = int64_t(counts[2]);
  const int64_t nwarps = (int64_t(gridDim.x) * blockDim.x) >> 5;
  for (int64_t e = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; e < n2; e += nwarps) {
    const int64_t o = list2[e], m = o / N, n = o - m * N;
    bool long_acc;
    const float v = warp_certified_or_exact(x + m * ldx, w + n * ldw, K, ux[m], uw[n],
                                            bias != nullptr ? bias + n : nullptr, fmt, lane, &long_acc);
    if (lane == 0) {
      store_fmt(out, o, v, fmt);
      if (long_acc) atomicAdd(&counts[1], 1ull);
    }
  }
}

__device__ __forceinline__ bool marked(const void* out, int64_t i, int fmt) {
  if (fmt == kFmtF32) return undecided_mark_f32(__float_as_uint(static_cast<const float*>(out)[i]));
  return undecided_mark_16(static_cast<const uint16_t*>(out)[i], fmt);
}

// The marks past list1's capacity (only when more outputs were marked than it holds: returns at
// once otherwise): a warp per 32 outputs (grid-stride) finds them and does both steps for each.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    sweep_kernel(const T* __restrict__ x, int64_t ldx, const T* __restrict__ w, int64_t ldw, int64_t M, int64_t N,
                 int64_t K, const double* __restrict__ bias, const double* __restrict__ ux,
                 const double* __restrict__ uw, int fmt, void* __restrict__ out,
                 unsigned long long* __restrict__ counts, int64_t cap) {
  if (int64_t(counts[0]) <= cap) return;
  const int lane = threadIdx.x & 31;
  const int64_t total = M * N, groups = (total + 31) / 32, depth = ordered_depth(K);
  const int64_t nwarps = (int64_t(gridDim.x) * blockDim.x) >> 5;
  for (int64_t g = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; g < groups; g += nwarps) {
    const int64_t i = g * 32 + lane;
    unsigned mask = __ballot_sync(kFull, i < total && marked(out, i, fmt));
    while (mask != 0u) {
      const int64_t o = g * 32 + (__ffs(mask) - 1);
      mask &= mask - 1;
      const int64_t m = o / N, n = o - m * N;
      const double S = warp_ordered_sum(x + m * ldx, w + n * ldw, K, lane);
      float v = 0.0f;
      bool long_acc = false;
      if (!round_ordered(S, ux[m], uw[n], depth, bias != nullptr ? bias[n] : 0.0, fmt, &v)) {
        v = warp_certified_or_exact(x + m * ldx, w + n * ldw, K, ux[m], uw[n], bias != nullptr ? bias + n : nullptr,
                                    fmt, lane, &long_acc);
      }
      if (lane == 0) {
        store_fmt(out, o, v, fmt);
        if (long_acc) atomicAdd(&counts[1], 1ull);
      }
    }
  }
}

void fix_cuda(const at::Tensor& xa, const at::Tensor& wa, const at::Tensor& bias, const at::Tensor& ux,
              const at::Tensor& uw, int fmt, at::Tensor& out, Fp64Lists& lists) {
  const int64_t M = out.size(0), N = out.size(1), K = xa.size(1);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const double* bp = bias.defined() ? bias.data_ptr<double>() : nullptr;
  auto* counts = reinterpret_cast<unsigned long long*>(lists.counts.data_ptr<int64_t>());
  const unsigned grid = persistent_blocks();
  with_elements(xa, [&](auto* px) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(px)>>;
    // one element type: the driver widened a mixed pair to fp32
    const T* pw = reinterpret_cast<const T*>(wa.data_ptr());
    fix_listed_kernel<T><<<grid, kThreads, 0, stream>>>(px, xa.stride(0), pw, wa.stride(0), N, K, bp,
                                                        ux.data_ptr<double>(), uw.data_ptr<double>(), fmt,
                                                        out.data_ptr(), counts, lists.list1.data_ptr<int64_t>(),
                                                        lists.list2.data_ptr<int64_t>(), lists.cap);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    exact_listed_kernel<T><<<grid, kThreads, 0, stream>>>(px, xa.stride(0), pw, wa.stride(0), N, K, bp,
                                                          ux.data_ptr<double>(), uw.data_ptr<double>(), fmt,
                                                          out.data_ptr(), counts, lists.list2.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    // a persistent grid: nearly always every block reads the count and returns (as many blocks as
    // 32-output groups cost ~27 us a launch, a few percent of a det_ddp step's GPU time)
    sweep_kernel<T><<<grid, kThreads, 0, stream>>>(
        px, xa.stride(0), pw, wa.stride(0), M, N, K, bp, ux.data_ptr<double>(), uw.data_ptr<double>(), fmt,
        out.data_ptr(), counts, lists.cap);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// Room for one output in 8 (random data at K = 4096 marks ~1 in 110); more go to the sweep.
int64_t list_cap_cuda(int64_t outputs) { return outputs / 8 + 1024; }

}  // namespace

const Fp64Backend& fp64_backend_cuda() {
  // When auto takes the route: csrc/gemm_plan.h's cost table.
  static const Fp64Backend be = [] {
    Fp64Backend b;
    b.widen = &widen_cuda;
    b.gemm = &fp64_gemm_cuda;
    b.decide = &decide_cuda;
    b.fix = &fix_cuda;
    b.list_cap = &list_cap_cuda;
    return b;
  }();
  return be;
}

}  // namespace ldet

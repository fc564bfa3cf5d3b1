// CUDA implementation of ldet::dropout_mask (schema: csrc/schema/dropout.cpp; stream layout:
// csrc/dropout.h). Each thread computes one Philox block, i.e. the (up to) four elements of one
// (outer, sample) row that share it, with the same integer arithmetic as the CPU build.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "check.h"
#include "dropout.h"
#include "dropout_checks.h"
#include "uninit.h"

namespace ldet {
namespace {

constexpr int kThreads = 256;

// Thread t: row r = t / blocks_per_row of the (outer, samples) rows, Philox block
// (e0 >> 2) + t % blocks_per_row of that row's elements e0 .. e0 + inner - 1.
__global__ void dropout_mask_kernel(bool* __restrict__ out, DropoutShape s, DropoutKey key, uint64_t step,
                                    uint64_t threshold, uint32_t offset, int64_t n_threads) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= n_threads) return;
  const int64_t rows = s.outer * s.samples;
  const int64_t per_row = n_threads / rows;
  const int64_t r = t / per_row, k = t % per_row;
  const int64_t o = r / s.samples, b = r % s.samples;
  const uint64_t e0 = uint64_t(o) * uint64_t(s.inner);
  const uint64_t blk = (e0 >> 2) + uint64_t(k);
  const Philox4 bits = dropout_block(key, step, offset + uint32_t(b), uint32_t(blk));
  bool* row = out + r * s.inner;
  for (uint64_t e = blk << 2; e < (blk << 2) + 4; ++e) {
    if (e >= e0 && e < e0 + uint64_t(s.inner)) row[e - e0] = dropout_kept(bits, e, threshold);
  }
}

at::Tensor dropout_mask_cuda(const at::Tensor& x, int64_t batch_dim, int64_t threshold, int64_t seed, int64_t step,
                             int64_t offset, int64_t site) {
  const DropoutLaunch a = prepare_dropout_mask(x, batch_dim, threshold, seed, step, offset, site);
  LDET_CHECK(x.device().is_cuda(), "dropout_mask (CUDA): x must be on a CUDA device");
  c10::cuda::CUDAGuard guard(x.device());
  // every element is written: each row's blocks cover all of its elements
  at::Tensor out = uninit(x.sizes(), x.options().dtype(at::kBool).memory_format(at::MemoryFormat::Contiguous));
  const int64_t rows = a.shape.outer * a.shape.samples, inner = a.shape.inner;
  if (rows == 0 || inner == 0) return out;
  // blocks a row's elements touch: at most (inner + 3) / 4 + 1 (an unaligned start); the same
  // count for every row keeps the thread -> (row, block) map a division
  const int64_t per_row = (inner + 3) / 4 + 1;
  const int64_t n_threads = rows * per_row;
  dropout_mask_kernel<<<unsigned((n_threads + kThreads - 1) / kThreads), kThreads, 0,
                        c10::cuda::getCurrentCUDAStream()>>>(out.data_ptr<bool>(), a.shape, a.key, a.step,
                                                             a.threshold, a.offset, n_threads);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace
}  // namespace ldet

TORCH_LIBRARY_IMPL(ldet, CUDA, m) { m.impl("dropout_mask", &ldet::dropout_mask_cuda); }

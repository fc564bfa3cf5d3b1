// CUDA implementation of ldet::digest_chunks (definition in csrc/hash.h).
// One block per 16 KiB chunk; the per-chunk sum is a wrapping uint64 sum, so the reduction
// tree below may be any shape and still give the CPU's bits.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>

#include "digest_common.h"

namespace {

constexpr int kThreads = 256;

__global__ void digest_chunks_kernel(const uint8_t* __restrict__ p, int64_t nbytes, bool aligned,
                                     int64_t* __restrict__ out) {
  const int64_t c = blockIdx.x;
  const int64_t nwords = (nbytes + 7) / 8;
  const int64_t nfull = nbytes / 8;
  const int64_t w0 = c * ldet::LDET_HASH_CHUNK_WORDS;
  int64_t w1 = w0 + ldet::LDET_HASH_CHUNK_WORDS;
  if (w1 > nwords) w1 = nwords;
  uint64_t acc = 0;
  // Consecutive threads read consecutive words: coalesced 8-byte loads.
  for (int64_t i = w0 + threadIdx.x; i < w1; i += blockDim.x) {
    uint64_t w;
    if (aligned && i < nfull) {
      w = reinterpret_cast<const uint64_t*>(p)[i];  // CUDA devices are little-endian
    } else {
      w = ldet::load_word_bytes(p, nbytes, i);
    }
    acc += ldet::hash_word(w, static_cast<uint64_t>(i));
  }
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
  __shared__ uint64_t warp_sums[kThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint64_t s = 0;
    for (int k = 0; k < kThreads / 32; ++k) s += warp_sums[k];
    out[c] = static_cast<int64_t>(s);
  }
}

at::Tensor digest_chunks_cuda(const at::Tensor& self) {
  c10::cuda::CUDAGuard guard(self.device());
  const int64_t nbytes = ldet::digest_check_input(self);
  const int64_t nchunks = ldet::hash_num_chunks(nbytes);
  at::Tensor out = at::empty({nchunks}, self.options().dtype(at::kLong));
  if (nchunks == 0) return out;
  TORCH_CHECK(nchunks < (int64_t(1) << 31), "ldet::digest_chunks: tensor too large (", nbytes, " bytes)");
  const uint8_t* p = static_cast<const uint8_t*>(self.data_ptr());
  const bool aligned = (reinterpret_cast<uintptr_t>(p) % 8) == 0;
  auto stream = c10::cuda::getCurrentCUDAStream();
  digest_chunks_kernel<<<static_cast<unsigned>(nchunks), kThreads, 0, stream>>>(p, nbytes, aligned,
                                                                                 out.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(ldet, CUDA, m) { m.impl("digest_chunks", &digest_chunks_cuda); }

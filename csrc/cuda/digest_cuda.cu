// CUDA implementation of ldet::digest_chunks (definition in csrc/hash.h).
// One block per 16 KiB chunk, for one tensor or for a list of them in one launch. The per-chunk
// sum is a wrapping uint64 sum, so the reduction tree below may be any shape and still give the
// CPU's bits.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>

#include "check.h"
#include "digest_common.h"

namespace {

constexpr int kThreads = 256;

// Chunk c's hash of the `nbytes` bytes at `p` (the whole block takes part; thread 0 holds the
// result).
__device__ uint64_t hash_chunk(const uint8_t* __restrict__ p, int64_t nbytes, bool aligned, int64_t c) {
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
  uint64_t s = 0;
  if (threadIdx.x == 0) {
    for (int k = 0; k < kThreads / 32; ++k) s += warp_sums[k];
  }
  return s;
}

// One block per 16 KiB chunk.
__global__ void digest_chunks_kernel(const uint8_t* __restrict__ p, int64_t nbytes, bool aligned,
                                     int64_t* __restrict__ out) {
  const uint64_t s = hash_chunk(p, nbytes, aligned, blockIdx.x);
  if (threadIdx.x == 0) out[blockIdx.x] = static_cast<int64_t>(s);
}

// Several tensors in one launch: block g hashes global chunk g. The table holds, per tensor,
// its address, its byte count and its first global chunk (ascending); a tensor of no bytes has
// no chunks, so the last entry whose first chunk is <= g owns chunk g.
__global__ void digest_chunks_many_kernel(const int64_t* __restrict__ table, int n, int64_t* __restrict__ out) {
  const int64_t g = blockIdx.x;
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (table[3 * mid + 2] <= g) lo = mid; else hi = mid - 1;
  }
  const uint8_t* p = reinterpret_cast<const uint8_t*>(table[3 * lo]);
  const int64_t nbytes = table[3 * lo + 1];
  const bool aligned = (reinterpret_cast<uintptr_t>(p) % 8) == 0;
  const uint64_t s = hash_chunk(p, nbytes, aligned, g - table[3 * lo + 2]);
  if (threadIdx.x == 0) out[g] = static_cast<int64_t>(s);
}

at::Tensor digest_chunks_cuda(const at::Tensor& self) {
  c10::cuda::CUDAGuard guard(self.device());
  const int64_t nbytes = ldet::digest_check_input(self);
  const int64_t nchunks = ldet::hash_num_chunks(nbytes);
  at::Tensor out = at::empty({nchunks}, self.options().dtype(at::kLong));
  if (nchunks == 0) return out;
  LDET_CHECK(nchunks < (int64_t(1) << 31), "ldet::digest_chunks: tensor too large (", nbytes, " bytes)");
  const uint8_t* p = static_cast<const uint8_t*>(self.data_ptr());
  const bool aligned = (reinterpret_cast<uintptr_t>(p) % 8) == 0;
  auto stream = c10::cuda::getCurrentCUDAStream();
  digest_chunks_kernel<<<static_cast<unsigned>(nchunks), kThreads, 0, stream>>>(p, nbytes, aligned,
                                                                                 out.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor digest_chunks_many_cuda(at::TensorList tensors) {
  const std::vector<int64_t> nbytes = ldet::digest_check_many(tensors);
  LDET_CHECK(!tensors.empty(), "ldet::digest_chunks_many: tensors must not be empty");
  LDET_CHECK(tensors.size() < (size_t(1) << 30), "ldet::digest_chunks_many: too many tensors (", tensors.size(), ")");
  c10::cuda::CUDAGuard guard(tensors[0].device());
  const int n = static_cast<int>(tensors.size());
  // The table goes to the device through pinned memory: a non-blocking copy, and the caching
  // host allocator keeps the buffer until the copy is done.
  at::Tensor host = at::empty({3 * int64_t(n)}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* h = host.data_ptr<int64_t>();
  int64_t total = 0;
  for (int i = 0; i < n; ++i) {
    h[3 * i] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(tensors[i].data_ptr()));
    h[3 * i + 1] = nbytes[i];
    h[3 * i + 2] = total;
    total += ldet::hash_num_chunks(nbytes[i]);
  }
  at::Tensor out = at::empty({total}, tensors[0].options().dtype(at::kLong));
  if (total == 0) return out;
  LDET_CHECK(total < (int64_t(1) << 31), "ldet::digest_chunks_many: too many chunks (", total, ")");
  at::Tensor table = host.to(tensors[0].device(), /*non_blocking=*/true);
  auto stream = c10::cuda::getCurrentCUDAStream();
  digest_chunks_many_kernel<<<static_cast<unsigned>(total), kThreads, 0, stream>>>(
      table.data_ptr<int64_t>(), n, out.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(ldet, CUDA, m) {
  m.impl("digest_chunks", &digest_chunks_cuda);
  m.impl("digest_chunks_many", &digest_chunks_many_cuda);
}

// Dense rows for the slicing kernels: the transposed views DetLinear's backward passes to
// det_gemm (g^T and x^T of dW = g^T x, W^T of dX = g W) copied through shared-memory tiles.
//
// Why: at::Tensor::contiguous() of such a view runs PyTorch's generic strided copy, which took
// ~4x the copy's memory floor on det_ddp's step (one side of each copy uncoalesced). A tile of 32 x 32 elements is read along the view's
// columns (the source's rows, coalesced) and written along its rows (coalesced). The bytes are the
// elements' bit patterns moved unchanged, so the copy cannot differ from contiguous()'s.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

#include "uninit.h"

namespace ldet {
namespace {

constexpr int kTile = 32, kTileRows = 8;  // a block: 32 x 8 threads, four elements each

// dst (R, C) row-major = src^T for src (C, R) row-major; E: the element's bits, moved unchanged.
template <typename E>
__global__ void __launch_bounds__(kTile * kTileRows) transpose_tiles_kernel(const E* __restrict__ src, int64_t R,
                                                                          int64_t C, E* __restrict__ dst) {
  __shared__ E tile[kTile][kTile + 1];  // +1: a column of the tile spreads over the banks
  const int64_t r0 = int64_t(blockIdx.x) * kTile, c0 = int64_t(blockIdx.y) * kTile;
  const int tx = threadIdx.x, ty = threadIdx.y;
#pragma unroll
  for (int i = ty; i < kTile; i += kTileRows) {
    const int64_t c = c0 + i, r = r0 + tx;
    if (c < C && r < R) tile[i][tx] = src[c * R + r];
  }
  __syncthreads();
#pragma unroll
  for (int i = ty; i < kTile; i += kTileRows) {
    const int64_t r = r0 + i, c = c0 + tx;
    if (r < R && c < C) dst[r * C + c] = tile[tx][i];
  }
}

}  // namespace

at::Tensor dense_rows_cuda(const at::Tensor& a) {
  // only a 2-D transposed view of a dense matrix (strides (1, R), never contiguous with both
  // sizes > 1) whose tiles fit the grid; everything else as before
  const bool transposed = a.dim() == 2 && a.size(0) > 1 && a.size(1) > 1 && a.stride(0) == 1 &&
                          a.stride(1) == a.size(0) && (a.element_size() == 4 || a.element_size() == 2);
  if (!transposed || (a.size(1) + kTile - 1) / kTile > 65535) return a.contiguous();
  const int64_t R = a.size(0), C = a.size(1);
  c10::cuda::CUDAGuard guard(a.device());
  at::Tensor out = uninit({R, C}, a.options());  // every element written
  const dim3 grid(unsigned((R + kTile - 1) / kTile), unsigned((C + kTile - 1) / kTile)), block(kTile, kTileRows);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  if (a.element_size() == 4) {
    transpose_tiles_kernel<uint32_t><<<grid, block, 0, stream>>>(static_cast<const uint32_t*>(a.data_ptr()), R, C,
                                                               static_cast<uint32_t*>(out.data_ptr()));
  } else {
    transpose_tiles_kernel<uint16_t><<<grid, block, 0, stream>>>(static_cast<const uint16_t*>(a.data_ptr()), R, C,
                                                               static_cast<uint16_t*>(out.data_ptr()));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace ldet

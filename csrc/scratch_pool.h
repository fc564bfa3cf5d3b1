// Scratch buffers of the CPU's slice GEMMs, kept between calls instead of freed.
//
// Why: a slice GEMM's int32 planes (Q or D x M x N) and int8 slices are tens of MB; glibc serves
// allocations past its mmap threshold (32 MB at most) by mmap, so each call took a page fault and
// a zeroed page from the kernel for every 4 KB it wrote: at fp32 1024 x 1024 x 256 (46 MB of
// planes) the kernel's page-fault path took a quarter of the call under perf.
// CUDA's caching allocator already reuses its memory; this is the CPU's counterpart, per thread
// (no locks; a slice GEMM never nests). A buffer is free when no tensor shares its storage.
// Like uninit(): every element is written before it is read (each call site says why), so reuse
// cannot move a byte; LIGHTNING_DET_FILL_EMPTY=1 bypasses the pool to check exactly that.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstdint>

#include "uninit.h"

namespace ldet {

inline at::Tensor pooled_uninit(at::IntArrayRef size, const at::TensorOptions& opt) {
  constexpr int kSlots = 4;                      // a GEMM holds three at once: x's and w's slices, the planes
  constexpr int64_t kMaxBytes = int64_t(1) << 30;  // larger ones are not kept
  int64_t numel = 1;
  for (int64_t s : size) numel *= s;
  const int64_t bytes = numel * int64_t(c10::elementSize(c10::typeMetaToScalarType(opt.dtype())));
  if (!opt.device().is_cpu() || fill_empty_requested() || bytes > kMaxBytes) return uninit(size, opt);
  thread_local std::array<at::Tensor, kSlots> pool;
  // the smallest free buffer that is large enough; else an empty slot, else the smallest free one
  int fit = -1, other = -1;
  for (int i = 0; i < kSlots; ++i) {
    const at::Tensor& t = pool[size_t(i)];
    if (t.defined() && t.storage().use_count() > 1) continue;  // in use
    if (t.defined() && t.numel() >= bytes && (fit < 0 || t.numel() < pool[size_t(fit)].numel())) fit = i;
    if (other < 0 || !t.defined() || (pool[size_t(other)].defined() && t.numel() < pool[size_t(other)].numel()))
      other = i;
  }
  const int pick = fit >= 0 ? fit : other;
  if (pick < 0) return uninit(size, opt);  // all in use
  at::Tensor& b = pool[size_t(pick)];
  if (!b.defined() || b.numel() < bytes) b = uninit({bytes}, opt.dtype(at::kByte));
  // a tensor on the buffer's storage made directly (no narrow / view ops: the host-bound GPU step
  // counts dispatcher calls, tests/test_int_slices.py), sharing the storage so the slot reads busy
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(b.storage()), b.key_set(), opt.dtype());
  t.unsafeGetTensorImpl()->set_sizes_contiguous(size);
  return t;
}

}  // namespace ldet

// Host-side pieces of ldet::digest_chunks shared by the CPU and CUDA implementations.
#pragma once

#include <ATen/ATen.h>

#include "hash.h"

namespace ldet {

// Argument checks that name the argument; returns the byte count of `self`.
inline int64_t digest_check_input(const at::Tensor& self) {
  TORCH_CHECK(self.layout() == at::kStrided,
              "ldet::digest_chunks: `self` must be a strided (dense) tensor, got layout ", self.layout());
  TORCH_CHECK(self.is_contiguous(),
              "ldet::digest_chunks: `self` must be contiguous (call .contiguous() first); got strides ",
              self.strides());
  return self.numel() * static_cast<int64_t>(self.element_size());
}

}  // namespace ldet

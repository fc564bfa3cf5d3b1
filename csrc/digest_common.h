// Host-side pieces of ldet::digest_chunks shared by the CPU and CUDA implementations.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "check.h"
#include "hash.h"

namespace ldet {

// Argument checks that name the argument (`self`, or tensors[i] of digest_chunks_many); returns
// the byte count of `self`.
inline int64_t digest_check_input(const at::Tensor& self, const char* op = "ldet::digest_chunks",
                                  const std::string& name = "`self`") {
  LDET_CHECK(self.layout() == at::kStrided,
              op, ": ", name, " must be a strided (dense) tensor, got layout ", self.layout());
  LDET_CHECK(self.is_contiguous(),
              op, ": ", name, " must be contiguous (call .contiguous() first); got strides ", self.strides());
  return self.numel() * static_cast<int64_t>(self.element_size());
}

// Checks of digest_chunks_many's list (each tensor as above, all on the first one's device);
// returns each tensor's byte count.
inline std::vector<int64_t> digest_check_many(at::TensorList tensors) {
  std::vector<int64_t> nbytes;
  nbytes.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    LDET_CHECK(t.device() == tensors[0].device(), "ldet::digest_chunks_many: tensors[", i, "] is on ",
                t.device(), ", expected ", tensors[0].device(), " like tensors[0]");
    nbytes.push_back(digest_check_input(t, "ldet::digest_chunks_many", "tensors[" + std::to_string(i) + "]"));
  }
  return nbytes;
}

}  // namespace ldet

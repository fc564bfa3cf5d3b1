// Buffers the kernels write in full before anything reads them, allocated without PyTorch's
// deterministic-mode fill.
//
// Why: under torch.use_deterministic_algorithms(True) (the strategy's strict environment) every
// at::empty also fills its memory (NaN / the largest integer), so that a kernel reading memory it
// never wrote stays deterministic. Each call site here says why nothing unwritten is read; the
// fill cost the det_ddp step ~300 extra kernels a step on the GPU, and their launches sit on the
// critical path of a step bound by its host time. at::detail::empty_cpu / empty_cuda are
// the allocations at::empty makes before that fill (no dispatcher round trip either).
#pragma once

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>

#include <cstdlib>
#include <string>

namespace ldet {

using UninitFn = at::Tensor (*)(at::IntArrayRef, const at::TensorOptions&);

// Set by the CUDA build (csrc/cuda/uninit_cuda.cu); null in a CPU-only build.
inline UninitFn& cuda_uninit_fn() {
  static UninitFn fn = nullptr;
  return fn;
}

// LIGHTNING_DET_FILL_EMPTY=1 allocates through at::empty again (with the fill, when deterministic
// algorithms are on): a switch for checking that no result depends on these buffers' contents.
inline bool fill_empty_requested() {
  static const bool on = [] {
    const char* env = std::getenv("LIGHTNING_DET_FILL_EMPTY");
    return env != nullptr && std::string(env) == "1";
  }();
  return on;
}

inline at::Tensor uninit(at::IntArrayRef size, const at::TensorOptions& opt) {
  if (fill_empty_requested()) return at::empty(size, opt);
  if (opt.device().is_cpu()) return at::detail::empty_cpu(size, opt);
  if (opt.device().is_cuda() && cuda_uninit_fn() != nullptr) return cuda_uninit_fn()(size, opt);
  return at::empty(size, opt);
}

}  // namespace ldet

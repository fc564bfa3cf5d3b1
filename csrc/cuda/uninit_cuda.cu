// Registers the CUDA allocation of ldet::uninit (csrc/uninit.h).
#include <ATen/cuda/EmptyTensor.h>

#include "uninit.h"

namespace ldet {
namespace {

at::Tensor uninit_cuda(at::IntArrayRef size, const at::TensorOptions& opt) { return at::detail::empty_cuda(size, opt); }

const bool registered = [] {
  cuda_uninit_fn() = &uninit_cuda;
  return true;
}();

}  // namespace
}  // namespace ldet

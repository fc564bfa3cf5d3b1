// Schema of the keyed dropout mask; csrc/cpu/dropout_cpu.cpp and csrc/cuda/dropout_cuda.cu
// implement it (stream layout: csrc/dropout.h).
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(ldet, m) {
  // bool tensor of x's shape (x is read for its shape and device only): True where the element
  // is kept. batch_dim: x's sample dimension; sample b is global sample offset + b of the step.
  m.def(
      "dropout_mask(Tensor x, int batch_dim, int threshold, int seed, int step, int offset, "
      "int site) -> Tensor");
}

// Schemas of the exact cross-entropy's fused row ops (lightning_det/nn/loss.py; arithmetic in
// csrc/cross_entropy.h). Implementations: csrc/cpu/cross_entropy_cpu.cpp, csrc/cuda/cross_entropy_cuda.cu.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(ldet, m) {
  // x: (N, C) float32/bfloat16/float16 logits; target: (N,) int64; valid: (N,) bool. Per row:
  // loss (N,) float32 (+0.0 where not valid), and for the backward e (N, C) float32 (the exps)
  // and S (N,) float32 (their rounded exact sum). A valid row's target must lie in [0, C) (the
  // callers check it first); a row whose does not reads loss NaN, never memory outside the row.
  m.def("ce_forward(Tensor x, Tensor target, Tensor valid) -> (Tensor, Tensor, Tensor)");
  // e, s, target, valid as above; grad: (N,) float (the losses' gradient). The input gradient
  // (N, C) of out_dtype: (e / S - [j == target]) * grad on valid rows, +0.0 elsewhere.
  m.def("ce_backward(Tensor e, Tensor s, Tensor target, Tensor valid, Tensor grad, ScalarType out_dtype) -> Tensor");
}

// Schemas of the Det norms' fused ops (lightning_det/nn/norm.py; arithmetic in csrc/norm.h).
// Implementations: csrc/cpu/norm_cpu.cpp, csrc/cuda/norm_cuda.cu.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(ldet, m) {
  // x: (R, W) float32/bfloat16/float16; weight, bias: optional (W,) float32. LayerNorm (rms
  // false) or RMSNorm of each row: y (R, W) of x's dtype, and for the backward xhat (R, W)
  // float32 and rstd (R,) float32. Row r's outputs depend on row r alone, the same bytes on
  // CPU and CUDA.
  m.def("norm_forward(Tensor x, Tensor? weight, Tensor? bias, float eps, bool rms) -> (Tensor, Tensor, Tensor)");
  // gy: (R, W) float32/bfloat16/float16; xhat, rstd: norm_forward's; weight as given to it. The
  // input gradient (R, W) of out_dtype. (The weight and bias gradients are column sums over
  // all rows: dot_cols.)
  m.def("norm_backward(Tensor gy, Tensor xhat, Tensor rstd, Tensor? weight, bool rms, ScalarType out_dtype) -> Tensor");
}

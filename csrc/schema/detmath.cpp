// Schemas of the elementwise activations, the exact row/column dot sums used by the Det
// norms, and the cross-entropy's row losses. Implementations: csrc/cpu/detmath_cpu.cpp, csrc/cuda/detmath_cuda.cu; the math is in
// csrc/detmath.h, the digit format in csrc/longacc.h.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(ldet, m) {
  // y = act(x) elementwise, computed in fp64 by detmath.h and rounded once to x's dtype.
  // kind: 0 GELU (erf), 1 GELU (tanh approximation), 2 SiLU, 3 tanh, 4 exp, 5 sin, 6 cos, 7 sigmoid
  // (ActKind in detmath.h).
  m.def("act(Tensor x, int kind) -> Tensor");
  // grad * act'(x), the product formed in fp64 and rounded once to x's dtype.
  m.def("act_backward(Tensor grad, Tensor x, int kind) -> Tensor");
  // The fp64 values the two ops above round: act(x) (grad None) or grad * act'(x), for float64
  // x and grad, unrounded. For audits and for the tests that hold detmath.h's operation sequence
  // to an eager reference (fp32 outputs rarely show a last-bit change of the fp64 value).
  m.def("act_fp64(Tensor x, int kind, Tensor? grad=None) -> Tensor");
  // a, b: (R, W) float32/bfloat16/float16 (b optional = ones). Canonical LongAcc (R, 19) of
  // the exact sums sum_j a[r, j] * b[r, j] (every product is exact in fp64).
  m.def("dot_rows(Tensor a, Tensor? b) -> Tensor");
  // Same over rows: LongAcc (W, 19) of sum_r a[r, j] * b[r, j].
  m.def("dot_cols(Tensor a, Tensor? b) -> Tensor");
  // m, picked, t_minus: (N,) float32. The per-row cross-entropy losses (N,) float32,
  // fp32((m - picked) + log1p(t_minus)) in fp64 (detmath.h ce_row_loss): one kernel instead of
  // ~40 eager fp64 ops per call.
  m.def("ce_row_loss(Tensor m, Tensor picked, Tensor t_minus) -> Tensor");
}

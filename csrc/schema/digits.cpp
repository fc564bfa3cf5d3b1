// Schemas of the elementwise long-accumulator ops. Implementations: csrc/cpu/digits_cpu.cpp,
// csrc/cuda/digits_cuda.cu. The digit format is documented in csrc/longacc.h.
#include <torch/library.h>

#include <string>
#include <vector>

#include "longacc.h"

TORCH_LIBRARY_FRAGMENT(ldet, m) {
  // (..., 19) int64 -> canonical (..., 19) int64 (carry propagation, status clamped).
  m.def("normalize(Tensor acc) -> Tensor");
  // (..., 19) int64 -> (...) of `dtype` (float32, bfloat16, float16): value * 2^scale_exp
  // (scale_exp in [-64, 0]: an exact power-of-two division), rounded once.
  m.def("finalize(Tensor acc, ScalarType dtype, int scale_exp=0) -> Tensor");
  // (...) float32/bfloat16/float16 -> canonical (..., 19) int64 holding each value exactly.
  m.def("to_digits(Tensor x) -> Tensor");
  // a (R, W) float32/bfloat16/float16, index (R,) int64 in [0, n_out) -> canonical (n_out, W, 19):
  // out[g, j] = the exact sum of a[r, j] over the rows r with index[r] == g (an embedding's
  // weight gradient). Exact, so independent of row order; no (R, W, 19) temporary.
  m.def("scatter_sum(Tensor a, Tensor index, int n_out) -> Tensor");
  // Layout constants of the compiled core, checked against lightning_det/profile.py at load.
  m.def("layout() -> int[]", []() {
    return std::vector<int64_t>{ldet::LDET_NDIGITS, ldet::LDET_WORDS, ldet::LDET_LSB_EXP,
                                ldet::LDET_STATUS_BITS, ldet::LDET_KBLOCK, ldet::LDET_TOP_BITS,
                                ldet::LDET_COMBINE_MAX};
  });
  m.def("profile() -> str", []() { return std::string(ldet::kProfile); });
}

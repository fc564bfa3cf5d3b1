// Schemas of the AdamWSR ops; csrc/cpu/adamw_sr.cpp and csrc/cuda/adamw_sr.cu implement them.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(ldet, m) {
  // One fused AdamW step of one parameter, in place. The float scalars are the host's fp64
  // values; the kernels round each once to fp32 (formula in csrc/adamw_sr.h).
  m.def(
      "adamw_sr_step(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "float decay, float beta1, float one_minus_beta1, float beta2, float one_minus_beta2, "
      "float step_size, float bias_correction2_sqrt, float eps, int seed, int step, "
      "int base_index) -> ()");
  // fp32 -> bf16 with the same stochastic rounding and Philox draws as adamw_sr_step.
  m.def("sr_round_bf16(Tensor x, int seed, int step, int base_index) -> Tensor");
}

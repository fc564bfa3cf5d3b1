// Schemas of the fused deterministic attention; the definition both devices compute is in
// csrc/attention.h, the argument checks in csrc/attention_checks.h, the implementations in
// csrc/cpu/attention_cpu.cpp and csrc/cuda/attention_cuda.cu.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(ldet, m) {
  // q (B, H, Lq, E), k (B, Hkv, Lk, E), v (B, Hkv, Lk, Ev): one dtype of float32, bfloat16,
  // float16, unit stride in the last dimension; H a multiple of Hkv. mask: None, or bool or
  // float of shape (B, H, Lq, Lk) (an expanded view is fine). dropout: [] or [threshold, seed,
  // step, offset, site] (csrc/dropout.h), dropout_mult the kept elements' multiplier.
  // Returns o (B, H, Lq, Ev) float32 and the row statistics (B, H, Lq, 2) float32: m and r.
  m.def(
      "attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, bool causal, int[] dropout, "
      "float dropout_mult) -> (Tensor, Tensor)");
  // The gradients (dq, dk, dv) as float32, from dout (B, H, Lq, Ev) of q's dtype and the
  // forward's o and statistics.
  m.def(
      "attention_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor o, Tensor stats, Tensor? mask, "
      "float scale, bool causal, int[] dropout, float dropout_mult) -> (Tensor, Tensor, Tensor)");
  // The weights p (B, H, Lq, Lk) float32 of the forward that gave stats, before dropout (0 where
  // a key is not allowed): for callers that ask for the attention weights.
  m.def("attention_probs(Tensor q, Tensor k, Tensor stats, Tensor? mask, float scale, bool causal) -> Tensor");
}

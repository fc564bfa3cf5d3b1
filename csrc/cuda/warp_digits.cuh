// Exact row sums by one warp: each lane sums its strided share of the terms (window + digits,
// csrc/window_acc.h), then the lanes' digit words are added by shuffles (integers: exact in any
// order) and normalized, so every lane holds the row's canonical digits. The canonical form of an
// exact sum is unique, so the lane split never shows in the bytes. Used by the fused row ops
// (norm_cuda.cu, cross_entropy_cuda.cu).
#pragma once

#include <cstdint>

#include "longacc.h"
#include "window_acc.h"

namespace ldet {

constexpr int kWarpLanes = 32;

// acc := the exact sum over j = lane, lane + 32, ... < W of term(j) (fp64 terms, each exact),
// canonical, the same in every lane. 32 canonical words per digit are far inside the headroom
// (longacc.h).
template <class Term>
__device__ void warp_row_digits(int64_t W, int lane, const Term& term, int64_t* acc) {
  zero(acc);
  WindowAcc win;
  int64_t n = 0;
  for (int64_t j = lane; j < W; j += kWarpLanes, ++n) {
    window_add(win, acc, term(j));
    if (((n + 1) & (LDET_NORM_INTERVAL - 1)) == 0) normalize(acc);
  }
  window_flush(win, acc);
  normalize(acc);
#pragma unroll
  for (int w = 0; w < LDET_WORDS; ++w) {
    long long v = acc[w];
#pragma unroll
    for (int o = kWarpLanes / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    acc[w] = v;
  }
  normalize(acc);
}

}  // namespace ldet

// fp32 inputs on the fast path: split each value into two pieces aligned to its K-block.
//
// x = xh + xl exactly. For each (row, 32-wide K-block) let E be the exponent of the block's
// largest |x|; xh keeps x's bits of weight >= 2^(E - kSplitBits), xl is the rest. Then
//   x . w = xh.wh + xh.wl + xl.wh + xl.wl,
// laid out as four K-segments, x' = [xh | xh | xl | xl] and w' = [wh | wl | wh | wl]: every
// 32-wide K-block holds one kind of piece. Why aligned to the block, not to each value: an xh
// block then spans at most kSplitBits + 1 bits whatever the values (an xl block the block's own
// exponent spread + 22 - kSplitBits), so a pair of pieces fits the fast path's 46-bit budget
// (LDET_FAST_SPREAD) on ordinary data. Splitting each value at its own 12th bit instead left the
// low pieces as wide as the block's exponent spread + 11; on real activations and gradients
// 17-87% of the GPU kernel's warp-blocks then fell back to output-by-output sums (as a
// simulation of its per-warp checks showed). kSplitBits = 17 measured best there: 16-20 keep
// xh.wh inside the budget, and a larger value leaves less room for the spread of rows in one
// thread group.
// Only speed depends on this choice: the exact sum over the 4K columns equals the exact sum over
// the K original ones, so the canonical digits (and every byte of output) are unchanged.
// Not used when an input holds inf/NaN: a split inf would meet a zero piece (inf x 0 = NaN).
#pragma once

#include <ATen/ATen.h>

#include <utility>

#include "longacc.h"

namespace ldet {

constexpr int kSplitBits = 17;

// (xh, xl) of an fp32 (rows, K) tensor, on its own device, in exact integer and fp32 operations.
// In-place steps keep at most three (rows, K) temporaries alive at once: the split runs right
// before the GEMM, at the step's memory peak.
inline std::pair<at::Tensor, at::Tensor> split_pieces(const at::Tensor& t) {
  const int64_t rows = t.size(0), K = t.size(1), BK = LDET_KBLOCK, nkb = (K + BK - 1) / BK;
  const at::Tensor bits = t.contiguous().view(at::kInt);
  at::Tensor field = at::bitwise_right_shift(bits, 23).bitwise_and_(0xff);  // biased exponent
  // The block's largest exponent field is the exponent of its largest |x| (0: zeros, subnormals).
  const at::Tensor emax = at::constant_pad_nd(field, {0, nkb * BK - K}, 0).view({rows, nkb, BK}).amax(2);
  // A value's lowest significand bit weighs 2^(max(field, 1) - 150) and the cut 2^(emax - 127 -
  // kSplitBits): clear the `shift` bits below the cut. shift >= 24 clears all of it (xh = 0),
  // shift <= 0 none.
  at::Tensor shift = (emax - (kSplitBits - 23)).repeat_interleave(BK, 1).narrow(1, 0, K).contiguous();
  shift.sub_(field.clamp_min_(1));
  field.reset();
  const at::Tensor all_cut = shift >= 24;
  // ~(2^s - 1) == -(2^s) in two's complement: the mask keeps the bits at and above the cut.
  at::Tensor mask = at::bitwise_left_shift(1, shift.clamp_(0, 23)).neg_().masked_fill_(all_cut, 0);
  shift.reset();
  at::Tensor hi = mask.bitwise_and_(bits).view(at::kFloat);
  at::Tensor lo = t - hi;  // exact: t's bits below the cut
  return {hi, lo};
}

// Returns (x', w') for the split product, or undefined tensors when the split does not apply.
inline std::pair<at::Tensor, at::Tensor> split_fp32_for_fast_path(const at::Tensor& x, const at::Tensor& w) {
  if (x.scalar_type() != at::kFloat || w.scalar_type() != at::kFloat) return {};
  if (x.numel() == 0 || w.numel() == 0) return {};
  // One host synchronization for both inputs, not one each: this runs before every fp32 GEMM,
  // and the det_ddp step's profile counted 28 synchronizations per step.
  if (!at::logical_and(x.isfinite().all(), w.isfinite().all()).item<bool>()) return {};
  at::Tensor xs, ws;
  {
    auto [xh, xl] = split_pieces(x);  // released before w is split
    xs = at::cat({xh, xh, xl, xl}, 1);
  }
  {
    auto [wh, wl] = split_pieces(w);
    ws = at::cat({wh, wl, wh, wl}, 1);
  }
  return {xs, ws};
}

}  // namespace ldet

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
// 17-87% of the GPU kernel's warp-blocks then fell back to output-by-output sums
// (benchmarks/simulate_paths.py). kSplitBits = 17 measured best there: 16-20 keep xh.wh inside
// the budget, and a larger value leaves less room for the spread of rows in one thread group.
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
inline std::pair<at::Tensor, at::Tensor> split_pieces(const at::Tensor& t) {
  const int64_t rows = t.size(0), K = t.size(1), BK = LDET_KBLOCK, nkb = (K + BK - 1) / BK;
  const at::Tensor bits = t.contiguous().view(at::kInt);
  const at::Tensor field = at::bitwise_and(at::bitwise_right_shift(bits, 23), 0xff);  // biased exponent
  // The block's largest exponent field is the exponent of its largest |x| (0: zeros, subnormals).
  const at::Tensor emax = at::constant_pad_nd(field, {0, nkb * BK - K}, 0).view({rows, nkb, BK}).amax(2);
  const at::Tensor cut = (emax - kSplitBits).repeat_interleave(BK, 1).narrow(1, 0, K);  // biased 2^cut
  // A value's lowest significand bit weighs 2^(max(field, 1) - 150); clear the bits below the
  // cut: `shift` of them. shift >= 24 clears all of it (xh = 0), shift <= 0 none.
  const at::Tensor shift = cut - at::clamp_min(field, 1) + 23;
  const at::Tensor low = at::bitwise_left_shift(at::ones_like(shift), at::clamp(shift, 0, 23)) - 1;
  const at::Tensor mask = at::where(shift >= 24, at::zeros_like(low), at::bitwise_not(low));
  const at::Tensor hi = at::bitwise_and(bits, mask).view(at::kFloat);
  return {hi, t - hi};  // t - hi is exact: it is t's bits below the cut
}

// Returns (x', w') for the split product, or undefined tensors when the split does not apply.
inline std::pair<at::Tensor, at::Tensor> split_fp32_for_fast_path(const at::Tensor& x, const at::Tensor& w) {
  if (x.scalar_type() != at::kFloat || w.scalar_type() != at::kFloat) return {};
  if (x.numel() == 0 || w.numel() == 0) return {};
  if (!(x.isfinite().all().item<bool>() && w.isfinite().all().item<bool>())) return {};
  auto [xh, xl] = split_pieces(x);
  auto [wh, wl] = split_pieces(w);
  return {at::cat({xh, xh, xl, xl}, 1), at::cat({wh, wl, wh, wl}, 1)};
}

}  // namespace ldet

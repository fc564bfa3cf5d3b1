// fp32 inputs on the fast path: split each value into two 12-bit pieces.
//
// x = xh + xl exactly, with xh = x's top 12 significand bits and xl the remaining 12, so
//   x . w = xh.wh + xh.wl + xl.wh + xl.wl   (each a product of two <= 12-bit pieces).
// Laid out as four K-segments, x' = [xh | xh | xl | xl] and w' = [wh | wl | wh | wl], every
// 32-wide K-block holds one kind of piece, whose exponent spread is small enough for exact
// fp64 block sums on ordinary data. The exact sum over the 4K columns equals the exact sum over
// the K original ones, so the canonical digits (and every byte of output) are unchanged.
// Not used when an input holds inf/NaN: a split inf would meet a zero piece (inf x 0 = NaN).
#pragma once

#include <ATen/ATen.h>

#include <utility>

namespace ldet {

inline std::pair<at::Tensor, at::Tensor> split_pieces(const at::Tensor& t) {
  const at::Tensor bits = t.contiguous().view(at::kInt);
  const at::Tensor hi = at::bitwise_and(bits, int64_t(0xFFFFF000u) - (int64_t(1) << 32)).view(at::kFloat);
  return {hi, t - hi};  // t - hi is exact: it is t's low 12 significand bits
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

// Argument checks of ldet::dropout_mask shared by the CPU and CUDA implementations, so both
// devices reject the same inputs with the same messages.
#pragma once

#include <ATen/ATen.h>

#include "check.h"
#include "dropout.h"

namespace ldet {

struct DropoutLaunch {
  DropoutShape shape;
  DropoutKey key;
  uint64_t step, threshold;
  uint32_t offset;
};

inline DropoutLaunch prepare_dropout_mask(const at::Tensor& x, int64_t batch_dim, int64_t threshold,
                                          int64_t seed, int64_t step, int64_t offset, int64_t site) {
  const int64_t dim = x.dim();
  LDET_CHECK(dim >= 1, "dropout_mask: x must have a batch dimension, got a 0-d tensor");
  LDET_CHECK(batch_dim >= 0 && batch_dim < dim, "dropout_mask: batch_dim must be in [0, ", dim,
              ") for x of shape ", x.sizes(), ", got ", batch_dim);
  LDET_CHECK(threshold >= 0 && threshold <= (int64_t(1) << 32),
              "dropout_mask: threshold must be in [0, 2^32], got ", threshold);
  LDET_CHECK(seed >= 0, "dropout_mask: seed must be >= 0, got ", seed);
  LDET_CHECK(step >= 0, "dropout_mask: step must be >= 0, got ", step);
  DropoutShape s{1, x.size(batch_dim), 1};
  for (int64_t d = 0; d < batch_dim; ++d) s.outer *= x.size(d);
  for (int64_t d = batch_dim + 1; d < dim; ++d) s.inner *= x.size(d);
  LDET_CHECK(offset >= 0 && offset + s.samples <= (int64_t(1) << 32),
              "dropout_mask: offset + samples must be in [0, 2^32], got offset ", offset, " and ",
              s.samples, " samples");
  LDET_CHECK(s.outer * s.inner <= (int64_t(1) << 34),
              "dropout_mask: at most 2^34 elements per sample, got ", s.outer * s.inner);
  return DropoutLaunch{s,
                       dropout_site_key(static_cast<uint64_t>(seed), static_cast<uint64_t>(site)),
                       static_cast<uint64_t>(step), static_cast<uint64_t>(threshold),
                       static_cast<uint32_t>(offset)};
}

}  // namespace ldet

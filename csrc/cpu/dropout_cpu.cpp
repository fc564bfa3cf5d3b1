// CPU implementation of ldet::dropout_mask (stream layout: csrc/dropout.h). Tasks own whole
// (outer, sample) rows; which task or thread computes an element cannot change its bit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <torch/library.h>

#include "check.h"
#include "dropout.h"
#include "dropout_checks.h"

namespace {

at::Tensor dropout_mask_cpu(const at::Tensor& x, int64_t batch_dim, int64_t threshold, int64_t seed,
                            int64_t step, int64_t offset, int64_t site) {
  const ldet::DropoutLaunch a = ldet::prepare_dropout_mask(x, batch_dim, threshold, seed, step, offset, site);
  LDET_CHECK(x.device().is_cpu(), "dropout_mask (CPU): x must be on the CPU");
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kBool).memory_format(at::MemoryFormat::Contiguous));
  const int64_t rows = a.shape.outer * a.shape.samples, inner = a.shape.inner;
  if (rows == 0 || inner == 0) return out;
  bool* op = out.data_ptr<bool>();
  const int64_t grain = std::max<int64_t>(1, 32768 / inner);
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t o = r / a.shape.samples, b = r % a.shape.samples;
      const uint32_t sample = a.offset + static_cast<uint32_t>(b);
      const uint64_t e0 = static_cast<uint64_t>(o) * static_cast<uint64_t>(inner);
      bool* row = op + r * inner;
      ldet::Philox4 bits{};
      uint64_t cur = ~uint64_t(0);
      for (int64_t j = 0; j < inner; ++j) {
        const uint64_t e = e0 + static_cast<uint64_t>(j);
        if ((e >> 2) != cur) {
          cur = e >> 2;
          bits = ldet::dropout_block(a.key, a.step, sample, static_cast<uint32_t>(cur));
        }
        row[j] = ldet::dropout_kept(bits, e, a.threshold);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(ldet, CPU, m) { m.impl("dropout_mask", &dropout_mask_cpu); }

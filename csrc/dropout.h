// Keyed dropout masks: whether an element is kept is a pure function of
// (seed, step, site, sample, element) drawn from Philox 4x32-10 (philox.h), shared by the CPU
// and the CUDA build, integer arithmetic only, so both give the same bits by construction.
//
// ---------------------------------------------------------------------------------------
// Stream layout (ldet-v1)
//   site key  = Philox4x32-10(counter = (site & 0xffffffff, site >> 32, 0x706f7264, 0x6b736d64),
//                             key = (seed & 0xffffffff, seed >> 32)), words 0 and 1
//               site: 64-bit call-site key (lightning_det.ops.dropout.site_key), seed: 64-bit
//   counter   = (e >> 2, sample, step & 0xffffffff, step >> 32)
//               e: the element's index within its sample (< 2^34), sample: the global sample
//               index within the optimizer step (< 2^32)
//   draw      = word (e & 3) of Philox4x32-10(counter, site key)
//   kept      = draw >= threshold, threshold = round(p * 2^32) in [0, 2^32]
// The tag words 0x706f7264 0x6b736d64 ("drop", "dmsk") keep the site-key derivation apart from
// the stochastic-rounding stream (counter words 2, 3 = the optimizer step there).
// ---------------------------------------------------------------------------------------
#pragma once

#include <cstdint>

#include "ldet_hd.h"
#include "philox.h"

namespace ldet {

struct DropoutKey {
  uint32_t k0, k1;
};

LDET_HD DropoutKey dropout_site_key(uint64_t seed, uint64_t site) {
  Philox4 c;
  c.v[0] = static_cast<uint32_t>(site);
  c.v[1] = static_cast<uint32_t>(site >> 32);
  c.v[2] = 0x706f7264u;
  c.v[3] = 0x6b736d64u;
  const Philox4 r = philox4x32_10(c, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  return DropoutKey{r.v[0], r.v[1]};
}

// The four draws of elements 4*blk .. 4*blk+3 of one sample.
LDET_HD Philox4 dropout_block(DropoutKey key, uint64_t step, uint32_t sample, uint32_t blk) {
  Philox4 c;
  c.v[0] = blk;
  c.v[1] = sample;
  c.v[2] = static_cast<uint32_t>(step);
  c.v[3] = static_cast<uint32_t>(step >> 32);
  return philox4x32_10(c, key.k0, key.k1);
}

LDET_HD bool dropout_kept(const Philox4& bits, uint64_t e, uint64_t threshold) {
  return static_cast<uint64_t>(bits.v[e & 3u]) >= threshold;
}

// A mask tensor seen as (outer, samples, inner) in memory order: element (o, b, j) belongs to
// sample offset + b, at index o * inner + j within it (the batch dimension taken out).
struct DropoutShape {
  int64_t outer, samples, inner;
};

}  // namespace ldet

// Counter-based Philox 4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
// SC'11; the Random123 reference algorithm), and the stream layout lightning_det draws from it.
//
// This one header is compiled into both the CPU and the CUDA build, so the two cannot drift.
// Part of numerical profile "ldet-v1": changing the layout below changes result bytes.
//
// ---------------------------------------------------------------------------------------
// Stream layout (ldet-v1)
//   key     = (seed & 0xffffffff, seed >> 32)                     seed: 64-bit unsigned
//   counter = (blk & 0xffffffff, blk >> 32, step & 0xffffffff, step >> 32)
//             blk = g >> 3, g = the element's global index (64-bit unsigned)
//   One Philox call gives 4 x 32 = 128 bits, i.e. eight 16-bit draws, shared by the eight
//   global indices 8*blk .. 8*blk+7. Element g takes word (g & 7) >> 1 of the output, its low
//   half when g is even and its high half when g is odd.
//   The draw is a pure function of (seed, step, g): it cannot depend on how the tensor is
//   split into shards, threads or CUDA blocks.
// ---------------------------------------------------------------------------------------
#pragma once

#include <cstdint>

#include "ldet_hd.h"

namespace ldet {

constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;  // golden ratio
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;  // sqrt(3) - 1

struct Philox4 {
  uint32_t v[4];
};

LDET_HD void philox_mulhilo(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  const uint64_t p = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  *hi = static_cast<uint32_t>(p >> 32);
  *lo = static_cast<uint32_t>(p);
}

// Philox4x32 with 10 rounds; the key is bumped by the Weyl constants between rounds.
LDET_HD Philox4 philox4x32_10(Philox4 ctr, uint32_t k0, uint32_t k1) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(kPhiloxM0, ctr.v[0], &hi0, &lo0);
    philox_mulhilo(kPhiloxM1, ctr.v[2], &hi1, &lo1);
    Philox4 out;
    out.v[0] = hi1 ^ ctr.v[1] ^ k0;
    out.v[1] = lo1;
    out.v[2] = hi0 ^ ctr.v[3] ^ k1;
    out.v[3] = lo0;
    ctr = out;
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
  return ctr;
}

// The 128 bits serving global indices 8*blk .. 8*blk+7 (see the stream layout above).
LDET_HD Philox4 philox_block(uint64_t seed, uint64_t step, uint64_t blk) {
  Philox4 c;
  c.v[0] = static_cast<uint32_t>(blk);
  c.v[1] = static_cast<uint32_t>(blk >> 32);
  c.v[2] = static_cast<uint32_t>(step);
  c.v[3] = static_cast<uint32_t>(step >> 32);
  return philox4x32_10(c, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// The 16-bit draw of global index g, taken from the block that philox_block(seed, step, g >> 3)
// returned.
LDET_HD uint32_t philox_draw16(const Philox4& blk_bits, uint64_t g) {
  const uint32_t w = blk_bits.v[(g & 7u) >> 1];
  return (g & 1u) ? (w >> 16) : (w & 0xffffu);
}

// L consecutive blocks blk0 .. blk0+L-1 at once, lanes innermost, so a host compiler can
// vectorize the 32x32->64 multiplies across blocks. Bitwise equal to L philox_block calls.
// out[w][l] = word w of block blk0 + l.
template <int L>
LDET_HD void philox_block_lanes(uint64_t seed, uint64_t step, uint64_t blk0, uint32_t out[4][L]) {
  uint32_t c0[L], c1[L], c2[L], c3[L];
  for (int l = 0; l < L; ++l) {
    const uint64_t blk = blk0 + static_cast<uint64_t>(l);
    c0[l] = static_cast<uint32_t>(blk);
    c1[l] = static_cast<uint32_t>(blk >> 32);
    c2[l] = static_cast<uint32_t>(step);
    c3[l] = static_cast<uint32_t>(step >> 32);
  }
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int r = 0; r < 10; ++r) {
    for (int l = 0; l < L; ++l) {
      const uint64_t p0 = static_cast<uint64_t>(kPhiloxM0) * c0[l];
      const uint64_t p1 = static_cast<uint64_t>(kPhiloxM1) * c2[l];
      const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1[l] ^ k0;
      const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3[l] ^ k1;
      c1[l] = static_cast<uint32_t>(p1);
      c3[l] = static_cast<uint32_t>(p0);
      c0[l] = n0;
      c2[l] = n2;
    }
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
  for (int l = 0; l < L; ++l) {
    out[0][l] = c0[l];
    out[1][l] = c1[l];
    out[2][l] = c2[l];
    out[3][l] = c3[l];
  }
}

}  // namespace ldet

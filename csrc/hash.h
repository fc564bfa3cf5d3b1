// The tensor digest primitive (digest format "ldet-digest-v1"), shared by the CPU and CUDA builds.
//
// One header for both devices so the two cannot drift: the same bytes give the same chunk hashes
// on any device, which is what lets a digest written on a GPU run be compared with a CPU run.
//
// Definition (the pure-Python reference is lightning_det/digest/reference.py; keep them in step):
//   The tensor's raw bytes (row-major contiguous) are read as little-endian uint64 words
//   w_0, w_1, ...; a trailing partial word is zero-padded (the byte count goes into the final
//   SHA-256, so padding cannot collide with real zero bytes).
//   Words are grouped into chunks of LDET_HASH_CHUNK_WORDS (16 KiB). Chunk c's hash is
//       h_c = sum_{i in chunk c} mix(w_i, i)   (mod 2^64)
//   where i is the GLOBAL word index and mix(w, i) = fmix64(w ^ ((i + 1) * GOLDEN)) (mod 2^64).
//   - Mixing the index into every word makes the hash element-order sensitive (unlike an
//     XOR-sum such as torch.hash_tensor), while the sum itself is commutative and associative:
//     any reduction order (threads, blocks, warps) gives the same bits, with no atomics needed.
//   - fmix64 is a bijection and x -> x ^ k is too, so for a fixed index mix is a bijection in w:
//     changing any single word ALWAYS changes its chunk hash (not just with high probability).
//   - GOLDEN is odd, so the per-index keys (i + 1) * GOLDEN are distinct. One fmix64 per word
//     (two multiplies) keeps the CPU path near memory speed; measured 3.5 -> 5.3 GB/s per core
//     against keys made by a second fmix64, which adds no order sensitivity (a swap of a and b
//     collides exactly when a ^ b equals the XOR of the two keys, whatever the keys are).
//   The host then hashes the chunk list with SHA-256 together with dtype, shape and byte count.
#pragma once

#include <cstdint>

#include "ldet_hd.h"

namespace ldet {

constexpr int64_t LDET_HASH_CHUNK_BYTES = 16384;
constexpr int64_t LDET_HASH_CHUNK_WORDS = LDET_HASH_CHUNK_BYTES / 8;
constexpr uint64_t LDET_HASH_GOLDEN = 0x9E3779B97F4A7C15ULL;

// SplitMix64 / MurmurHash3 finalizer: a bijection on 64-bit integers with full avalanche.
LDET_HD uint64_t fmix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBULL;
  x ^= x >> 31;
  return x;
}

LDET_HD uint64_t hash_word(uint64_t word, uint64_t global_index) {
  return fmix64(word ^ ((global_index + 1) * LDET_HASH_GOLDEN));
}

// Word `i` of a byte buffer of length `nbytes`, little-endian, zero-padded past the end.
// Byte-wise assembly makes it independent of alignment and host endianness.
LDET_HD uint64_t load_word_bytes(const uint8_t* p, int64_t nbytes, int64_t i) {
  uint64_t w = 0;
  const int64_t base = i * 8;
  for (int b = 0; b < 8; ++b) {
    if (base + b < nbytes) w |= uint64_t(p[base + b]) << (8 * b);
  }
  return w;
}

inline int64_t hash_num_chunks(int64_t nbytes) {
  return (nbytes + LDET_HASH_CHUNK_BYTES - 1) / LDET_HASH_CHUNK_BYTES;
}

}  // namespace ldet

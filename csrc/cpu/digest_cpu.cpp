// CPU implementation of ldet::digest_chunks (definition in csrc/hash.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "cpu/fp_env.h"
#include "digest_common.h"

namespace {

// The chunk hashes of `nbytes` bytes at `p` into o[0, hash_num_chunks(nbytes)).
void hash_chunks(const uint8_t* p, int64_t nbytes, int64_t* o) {
  const int64_t nchunks = ldet::hash_num_chunks(nbytes);
  const int64_t nfull_words = nbytes / 8;
  const int64_t nwords = (nbytes + 7) / 8;
  // Chunks are independent, so any thread split gives the same result.
  ldet::ieee_parallel_for(0, nchunks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t w0 = c * ldet::LDET_HASH_CHUNK_WORDS;
      int64_t w1 = w0 + ldet::LDET_HASH_CHUNK_WORDS;
      if (w1 > nwords) w1 = nwords;
      uint64_t acc = 0;
      // Branch-free body over whole words (vectorizable), then the zero-padded partial word.
      const int64_t wfull = w1 < nfull_words ? w1 : nfull_words;
      for (int64_t i = w0; i < wfull; ++i) {
        uint64_t w;
        std::memcpy(&w, p + i * 8, 8);  // alignment-safe; x86/ARM hosts are little-endian
        acc += ldet::hash_word(w, static_cast<uint64_t>(i));
      }
      for (int64_t i = wfull > w0 ? wfull : w0; i < w1; ++i) {
        acc += ldet::hash_word(ldet::load_word_bytes(p, nbytes, i), static_cast<uint64_t>(i));
      }
      o[c] = static_cast<int64_t>(acc);
    }
  });
}

at::Tensor digest_chunks_cpu(const at::Tensor& self) {
  const int64_t nbytes = ldet::digest_check_input(self);
  at::Tensor out = at::empty({ldet::hash_num_chunks(nbytes)}, self.options().dtype(at::kLong));
  if (nbytes > 0) hash_chunks(static_cast<const uint8_t*>(self.data_ptr()), nbytes, out.data_ptr<int64_t>());
  return out;
}

at::Tensor digest_chunks_many_cpu(at::TensorList tensors) {
  const std::vector<int64_t> nbytes = ldet::digest_check_many(tensors);
  int64_t total = 0;
  for (int64_t n : nbytes) total += ldet::hash_num_chunks(n);
  at::Tensor out = at::empty({total}, at::TensorOptions().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (nbytes[i] > 0) hash_chunks(static_cast<const uint8_t*>(tensors[i].data_ptr()), nbytes[i], o);
    o += ldet::hash_num_chunks(nbytes[i]);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(ldet, CPU, m) {
  m.impl("digest_chunks", &ldet::ieee_op<&digest_chunks_cpu>::call);
  m.impl("digest_chunks_many", &ldet::ieee_op<&digest_chunks_many_cpu>::call);
}

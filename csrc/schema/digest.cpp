// Schema of the digest op; the device files register implementations.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(ldet, m) {
  // Per-16KiB-chunk 64-bit hashes of a contiguous tensor's raw bytes (see csrc/hash.h),
  // as an int64 tensor of ceil(nbytes / 16384) elements on the input's device.
  m.def("digest_chunks(Tensor self) -> Tensor");
  // The same for several contiguous tensors on one device, in one pass: their chunk hashes
  // concatenated in list order (one launch on CUDA, however many tensors).
  m.def("digest_chunks_many(Tensor[] tensors) -> Tensor");
}

// Whether the work before a CUDA event has finished, without waiting: the host reads results that
// were sent on their way (pinned copies) once it has.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

namespace ldet {

inline bool event_done(cudaEvent_t e) {
  const cudaError_t st = cudaEventQuery(e);
  if (st == cudaErrorNotReady) {
    (void)cudaGetLastError();  // not an error: clear it
    return false;
  }
  C10_CUDA_CHECK(st);
  return true;
}

}  // namespace ldet

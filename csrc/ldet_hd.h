// LDET_HD: marks a function for both the host and the device build (inline on a plain C++ build).
// Every header shared by the CPU and CUDA code includes this one definition.
#pragma once

#if defined(__CUDACC__)
#define LDET_HD __host__ __device__ __forceinline__
#else
#define LDET_HD inline
#endif

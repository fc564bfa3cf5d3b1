// Whether this CPU build has the AVX-512 subsets the vector forms in csrc/cpu/*_vector.h use
// (-march=native decides; without them the scalar and auto-vectorized loops run, same bytes).
#pragma once

#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512CD__) && defined(__AVX512VL__) && \
    defined(__AVX512BW__)
#define LDET_CPU_AVX512 1
#include <immintrin.h>
#endif

// Whether this CPU build has the AVX-512 subsets the vector forms in csrc/cpu/*_vector.h use
// (-march=native decides; without them the scalar and auto-vectorized loops run, same bytes),
// and the helpers those forms share. They round to nearest: each op runs under the IEEE default
// environment (csrc/cpu/fp_env.h).
#pragma once

#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512CD__) && defined(__AVX512VL__) && \
    defined(__AVX512BW__)
#define LDET_CPU_AVX512 1
#include <immintrin.h>

namespace ldet {

// x rounded to the nearest integer (ties to even) for |x| < 2^51 (floor_off_integers' trick).
inline __m512d crt_round_pd(__m512d x) {
  const __m512d k = _mm512_set1_pd(6755399441055744.0);  // 1.5 * 2^52
  return _mm512_sub_pd(_mm512_add_pd(x, k), k);
}

}  // namespace ldet
#endif

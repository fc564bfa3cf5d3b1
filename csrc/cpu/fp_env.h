// The IEEE default floating-point environment for the CPU kernels, whatever the caller set.
//
// Why: torch.set_flush_denormal(True) (or any library the process loads) can set flush-to-zero
// and denormals-are-zero on a thread (x86 MXCSR): every SSE/AVX instruction then reads subnormal
// inputs as zero and writes subnormal results as zero, and a rounding-mode change would move every
// fp64 step the exactness proofs count on. The GPU kernels have no such state, so a CPU result
// computed under it would differ from the CUDA one and from the exact sum
// (tests/test_fp_environment.py: the long-accumulator kernel, the diagonals and AdamWSR did).
// Each CPU op therefore runs under the default environment (round to nearest, no flushing, every
// exception masked): at its entry on the calling thread (ieee_op) and in each parallel chunk on
// the worker threads (ieee_parallel_for); the caller's environment is restored after.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>
#include <utility>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#else
#include <cfenv>
#endif

namespace ldet {

struct IeeeFpEnv {
#if defined(__x86_64__) || defined(__i386__)
  unsigned saved;
  IeeeFpEnv() : saved(_mm_getcsr()) { _mm_setcsr(0x1F80u); }  // the SSE default: RN, all masked, no FTZ/DAZ
  ~IeeeFpEnv() { _mm_setcsr(saved); }
#else
  std::fenv_t saved;
  IeeeFpEnv() {
    std::fegetenv(&saved);
    std::fesetenv(FE_DFL_ENV);  // AArch64: also clears FPCR.FZ
  }
  ~IeeeFpEnv() { std::fesetenv(&saved); }
#endif
  IeeeFpEnv(const IeeeFpEnv&) = delete;
  IeeeFpEnv& operator=(const IeeeFpEnv&) = delete;
};

// at::parallel_for with each chunk under IeeeFpEnv.
template <class F>
void ieee_parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) {
    const IeeeFpEnv env;
    f(b, e);
  });
}

// An op's CPU implementation run under IeeeFpEnv: m.impl("name", &ieee_op<&name_cpu>::call).
template <auto F>
struct ieee_op;

template <typename R, typename... A, R (*F)(A...)>
struct ieee_op<F> {
  static R call(A... args) {
    const IeeeFpEnv env;
    return F(std::forward<A>(args)...);
  }
};

}  // namespace ldet

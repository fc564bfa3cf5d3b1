// A CPU emulation of the CUDA execution model, enough to run the project's kernels on a machine
// without a GPU: each CUDA thread of a block is a fiber (ucontext), __syncthreads() yields to a
// scheduler that resumes every thread of the block before any passes the barrier, and
// __shfl_xor_sync exchanges through the block. Blocks run one after another.
//
// What it checks: the kernels' indexing, tiling, barriers and arithmetic, bit for bit against the
// CPU kernels (fp32 fma and every IEEE operation round the same on both). What it cannot: timing,
// resource limits (registers, the shared memory size: ptxas reports those) and races that every
// interleaving of whole barrier phases hides. Threads of a phase run in ascending, descending or
// shuffled order (Order), so a read that a missing barrier leaves unordered sees different data.
//
// Include it before the kernel header: it defines the CUDA keywords and built-ins that header
// uses. Dynamic shared memory is the kernel's `extern __shared__ float4 smem4[]`, which the
// including file defines (emu_smem) in the kernel's namespace, poisoned with NaN per block.
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <vector>

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) float2 {
  float x, y;
};
inline float2 make_float2(float x, float y) { return {x, y}; }

namespace emu {

enum class Order { kAscending, kDescending, kShuffled };

struct Block {
  dim3 grid, block, block_idx;
  int nthreads = 0, cur = 0;
  std::vector<ucontext_t> ctx;
  std::vector<std::vector<char>> stacks;
  std::vector<char> done;
  std::vector<float> exch;
  std::vector<uint64_t> exch64;
  ucontext_t sched;
  const std::function<void()>* body = nullptr;
};

inline Block& blk() {
  static Block b;
  return b;
}

inline dim3 thread_idx() {
  const Block& b = blk();
  const unsigned t = unsigned(b.cur);
  return dim3(t % b.block.x, (t / b.block.x) % b.block.y, t / (b.block.x * b.block.y));
}

inline void barrier() {
  Block& b = blk();
  swapcontext(&b.ctx[b.cur], &b.sched);
}

inline float shfl_xor(float v, int off) {
  Block& b = blk();
  b.exch[b.cur] = v;
  barrier();
  const float r = b.exch[b.cur ^ off];  // off < 32: the partner lane of the same warp
  barrier();
  return r;
}

template <typename T>
inline T shfl_xor64(T v, int off) {
  static_assert(sizeof(T) == 8, "64-bit values");
  Block& b = blk();
  std::memcpy(&b.exch64[b.cur], &v, 8);
  barrier();
  T r;
  std::memcpy(&r, &b.exch64[b.cur ^ off], 8);
  barrier();
  return r;
}

// x rounded toward +inf (dir > 0) or -inf (dir < 0), from its nearest rounding rn and err =
// x - rn (exact: TwoSum, or an fma for a product); a and b the operands of an addition, for the
// sign of an exact zero (IEEE: -0 toward -inf unless both are +0, +0 toward +inf unless both -0).
inline double round_dir(double rn, double err, int dir) {
  if (!std::isfinite(rn)) return rn;
  if (err > 0 && dir > 0) return std::nextafter(rn, INFINITY);
  if (err < 0 && dir < 0) return std::nextafter(rn, -INFINITY);
  return rn;
}

inline double add_dir(double a, double b, int dir) {
  const double s = a + b;
  if (s == 0) {  // an exact zero (a sum of doubles that rounds to 0 is 0)
    if (std::signbit(a) == std::signbit(b)) return a;  // two zeros of one sign
    return dir < 0 ? -0.0 : 0.0;
  }
  const double bb = s - a;
  return round_dir(s, (a - (s - bb)) + (b - bb), dir);  // TwoSum's error term
}

inline void trampoline() {
  Block& b = blk();
  (*b.body)();
  b.done[b.cur] = 1;  // returning resumes the scheduler (uc_link)
}

// Runs body() as every thread of every block of grid x block; on_block() before each block.
inline void launch(dim3 grid, dim3 block, Order order, const std::function<void()>& body,
                   const std::function<void()>& on_block = {}) {
  constexpr size_t kStack = 256 * 1024;
  Block& b = blk();
  b.grid = grid;
  b.block = block;
  b.body = &body;
  b.nthreads = int(block.x * block.y * block.z);
  b.ctx.resize(b.nthreads);
  b.stacks.resize(b.nthreads);
  b.exch.assign(b.nthreads, 0.0f);
  b.exch64.assign(b.nthreads, 0);
  std::vector<int> seq(b.nthreads);
  uint32_t rng = 12345u;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        b.block_idx = dim3(x, y, z);
        if (on_block) on_block();
        b.done.assign(b.nthreads, 0);
        for (int t = 0; t < b.nthreads; ++t) {
          b.stacks[t].resize(kStack);
          getcontext(&b.ctx[t]);
          b.ctx[t].uc_stack.ss_sp = b.stacks[t].data();
          b.ctx[t].uc_stack.ss_size = kStack;
          b.ctx[t].uc_link = &b.sched;
          makecontext(&b.ctx[t], trampoline, 0);
        }
        for (;;) {
          for (int t = 0; t < b.nthreads; ++t) seq[t] = order == Order::kDescending ? b.nthreads - 1 - t : t;
          if (order == Order::kShuffled)
            for (int t = b.nthreads - 1; t > 0; --t) {
              rng = rng * 1664525u + 1013904223u;
              std::swap(seq[t], seq[(rng >> 8) % unsigned(t + 1)]);
            }
          int ran = 0, finished = 0;
          for (int t : seq) {
            if (b.done[t]) continue;
            b.cur = t;
            swapcontext(&b.sched, &b.ctx[t]);
            ++ran;
            finished += b.done[t];
          }
          if (ran == 0) break;
          if (finished != 0 && finished != ran)
            throw std::runtime_error("cuda_emu: some threads of a block left before a barrier the others wait at");
        }
      }
}

}  // namespace emu

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__
#define threadIdx (::emu::thread_idx())
#define blockIdx (::emu::blk().block_idx)
#define gridDim (::emu::blk().grid)
#define blockDim (::emu::blk().block)

inline void __syncthreads() { ::emu::barrier(); }
inline float __shfl_xor_sync(unsigned, float v, int off) { return ::emu::shfl_xor(v, off); }
inline double __shfl_xor_sync(unsigned, double v, int off) { return ::emu::shfl_xor64(v, off); }
inline long long __shfl_xor_sync(unsigned, long long v, int off) { return ::emu::shfl_xor64(v, off); }
// fp64 arithmetic in a stated rounding direction, as the CUDA intrinsics
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dadd_ru(double a, double b) { return ::emu::add_dir(a, b, 1); }
inline double __dsub_rd(double a, double b) { return ::emu::add_dir(a, -b, -1); }
inline double __dmul_ru(double a, double b) {
  const double p = a * b;
  return ::emu::round_dir(p, std::fma(a, b, -p), 1);  // exact error while a * b does not underflow
}
inline float __double2float_rn(double d) { return float(d); }
using std::isfinite;
inline uint32_t __float_as_uint(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline long long __double_as_longlong(double d) {
  long long u;
  std::memcpy(&u, &d, 8);
  return u;
}
inline int __ffsll(long long v) { return v == 0 ? 0 : __builtin_ctzll(static_cast<unsigned long long>(v)) + 1; }
inline int __shfl_xor_sync(unsigned, int v, int off) { return int(::emu::shfl_xor64(static_cast<long long>(v), off)); }
using std::ldexp;
using std::min;
inline float __uint_as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

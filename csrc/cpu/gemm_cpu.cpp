// CPU exact GEMM (schemas: csrc/schema/gemm.cpp; algorithm: csrc/gemm_common.h).
//
// Outputs are processed in 6 x 8 tiles spread over threads with at::parallel_for. For a K-block
// where every pair of the tile passes the fast check, a register-blocked micro-kernel forms all
// 48 block sums at once (vectorized over the 8 columns; any order is exact on this path). Other
// blocks go pair by pair through the exact path. Results do not depend on the tiling: the
// canonical digits of the exact sum are unique.
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <limits>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <vector>

#include <ATen/Parallel.h>

#include "cpu/fp_env.h"
#include "op_checks.h"
#include "gemm_execute.h"
#include "split.h"
#include "gemm_common.h"

namespace ldet {
namespace {

static_assert(std::numeric_limits<double>::is_iec559 && std::numeric_limits<float>::is_iec559,
              "the fp32 epilogue's double -> float conversion relies on IEEE rounding");

// 6 x 8: 12 accumulator registers + 2 for w + 1 broadcast = 15 of AVX2's 16, enough independent
// FMAs in flight to cover their latency (4 x 8 measured 15-25% slower).
constexpr int TM = 6;
constexpr int TN = 8;
static_assert(kernel_tiles(GemmDevice::kCpu).tile_m == TM && kernel_tiles(GemmDevice::kCpu).tile_n == TN &&
                  kernel_tiles(GemmDevice::kCpu).k_block == LDET_KBLOCK,
              "the plan prints this kernel's tiling (csrc/gemm_plan.h)");

// Per (row, K-block) statistics of a row-major (rows, K) fp64 matrix (x, and w itself).
std::vector<int32_t> block_stats(const double* a, int64_t rows, int64_t K) {
  const int64_t nkb = (K + LDET_KBLOCK - 1) / LDET_KBLOCK;
  std::vector<int32_t> st(rows * nkb);
  ieee_parallel_for(0, rows, 64, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      for (int64_t kb = 0; kb < nkb; ++kb) {
        StatAcc s;
        const int64_t k1 = std::min(K, (kb + 1) * LDET_KBLOCK);
        for (int64_t k = kb * LDET_KBLOCK; k < k1; ++k) s.add(a[r * K + k]);
        st[r * nkb + kb] = s.packed();
      }
    }
  });
  return st;
}

// The widest spread (hi - lo) of each tile's rows per K-block: tiles of `tile` rows of a stats
// matrix (rows, nkb), as a histogram per K-block over 0 .. LDET_FAST_SPREAD + 1 (the last bin:
// beyond the fast path alone, or inf / NaN).
std::vector<int64_t> tile_spread_hist(const std::vector<int32_t>& st, int64_t rows, int64_t nkb, int tile) {
  constexpr int kBins = LDET_FAST_SPREAD + 2;
  std::vector<int64_t> hist(nkb * kBins, 0);
  for (int64_t r0 = 0; r0 < rows; r0 += tile) {
    for (int64_t kb = 0; kb < nkb; ++kb) {
      int widest = 0;
      for (int64_t r = r0; r < std::min(rows, r0 + tile); ++r) {
        const int hi = stat_hi(st[r * nkb + kb]);
        if (hi == kStatSpecial) widest = kBins - 1;
        else if (hi != kStatEmpty) widest = std::max(widest, std::min(kBins - 1, hi - stat_lo(st[r * nkb + kb])));
      }
      ++hist[kb * kBins + widest];
    }
  }
  return hist;
}

// block_stats of a 16-bit operand, read in place from its bits (the probe below runs before every
// auto kernel call on the CPU: no widened copy, and no threads for small operands). A value with
// exponent field e and fraction f (mb bits) has hi = floor(log2 |v|) and lo = its lowest set bit.
std::vector<int32_t> block_stats_16bit(const at::Tensor& t) {
  const at::Tensor a = t.contiguous();
  const int64_t rows = a.size(0), K = a.size(1), nkb = (K + LDET_KBLOCK - 1) / LDET_KBLOCK;
  const bool bf16 = a.scalar_type() == at::kBFloat16;
  const int mb = bf16 ? 7 : 10, emax = bf16 ? 255 : 31, bias = bf16 ? 127 : 15;
  const uint16_t* p = static_cast<const uint16_t*>(a.data_ptr());
  std::vector<int32_t> st(rows * nkb);
  auto run = [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      for (int64_t kb = 0; kb < nkb; ++kb) {
        int hi = kStatEmpty, lo = 32767;
        bool special = false;
        const int64_t k1 = std::min(K, (kb + 1) * LDET_KBLOCK);
        for (int64_t k = kb * LDET_KBLOCK; k < k1; ++k) {
          const uint32_t u = p[r * K + k] & 0x7fffu;
          if (u == 0) continue;
          const int ex = int(u >> mb);
          const uint32_t f = u & ((1u << mb) - 1);
          if (ex == emax) {
            special = true;
            continue;
          }
          const uint32_t sig = ex ? (f | (1u << mb)) : f;  // subnormal: no implicit bit
          const int scale = (ex ? ex : 1) - bias - mb;       // v = sig * 2^scale
          hi = std::max(hi, scale + 31 - __builtin_clz(sig));
          lo = std::min(lo, scale + __builtin_ctz(sig));
        }
        st[r * nkb + kb] = special ? pack_stat(kStatSpecial, 0) : hi == kStatEmpty ? pack_stat(kStatEmpty, 0)
                                                                                 : pack_stat(hi, lo);
      }
    }
  };
  if (rows * K < (int64_t(1) << 20)) {
    run(0, rows);
  } else {
    ieee_parallel_for(0, rows, 64, run);
  }
  return st;
}

// The kernel's share of (TM x TN tile, K-block) steps that miss its fast path (tile_all_fast) on
// these operands: the probe of auto's kernel choice (gemm_plan.h, plan_kernel_stage), O((M + N) K)
// against the GEMM's O(M N K). On the CPU auto takes the kernel for 16-bit inputs alone (the cost
// table sends fp32 to the fp64 route), so fp32 operands are widened as the kernel widens them.
double kernel_slow_share_cpu(const at::Tensor& x, const at::Tensor& w) {
  auto stats = [](const at::Tensor& t) {
    if (t.scalar_type() != at::kFloat) return block_stats_16bit(t);
    const at::Tensor d = t.to(at::kDouble).contiguous();
    return block_stats(d.data_ptr<double>(), d.size(0), d.size(1));
  };
  auto [xsplit, wsplit] = split_fp32_for_fast_path(x, w);
  const at::Tensor& xin = xsplit.defined() ? xsplit : x;
  const at::Tensor& win = wsplit.defined() ? wsplit : w;
  const int64_t M = xin.size(0), N = win.size(0), K = xin.size(1), nkb = (K + LDET_KBLOCK - 1) / LDET_KBLOCK;
  constexpr int kBins = LDET_FAST_SPREAD + 2;
  const std::vector<int64_t> hx = tile_spread_hist(stats(xin), M, nkb, TM);
  const std::vector<int64_t> hw = tile_spread_hist(stats(win), N, nkb, TN);
  double slow = 0;
  for (int64_t kb = 0; kb < nkb; ++kb) {
    const int64_t* a = &hx[kb * kBins];
    const int64_t* b = &hw[kb * kBins];
    for (int i = 0; i < kBins; ++i)
      for (int j = LDET_FAST_SPREAD + 1 - i; j < kBins; ++j) slow += double(a[i]) * double(b[j]);
  }
  const double steps = double((M + TM - 1) / TM) * double((N + TN - 1) / TN) * double(nkb);
  return steps > 0 ? slow / steps : 0.0;
}

struct GemmArgs {
  const double* x;   // (M, K) row-major
  // w in column panels: panel j / TN is a contiguous (K, TN) block holding w[j0 + b, k] at
  // [k * TN + b], so the micro-kernel reads its 8 columns of row k in one run (N padded with zero
  // columns to whole panels).
  const double* wp;
  const int32_t* xs;
  const int32_t* ws;
  const double* bias;  // (N,) or null
  int64_t M, N, K, nkb, interval;
  int64_t seg = 0;        // K of one fp32 split segment (csrc/split.h), 0 when not split
  int out_fmt = kFmtF32;  // the one rounding goes straight to this format
};

// After the K-block that ends a split segment, S is put aside (one slot per segment) and
// restarts at zero: the later segments' products lie 2^17 (kSplitBits, csrc/split.h) and 2^34
// below the hi-hi ones, so with S still at the hi-hi magnitude nearly every later block would
// leave a TwoSum rounding error to the digits. The epilogue adds the segments' sums exactly.
inline bool segment_ends(const GemmArgs& g, int64_t kb) {
  return g.seg > 0 && ((kb + 1) * LDET_KBLOCK) / g.seg != (kb * LDET_KBLOCK) / g.seg;
}

// Exact block sum on the fast path for a full TM x TN tile. Every partial sum is exact on this
// path, so evaluation order and fma-vs-mul+add cannot change the result; we use whatever the
// machine does fastest.
inline void micro_block(const GemmArgs& g, int64_t i0, int64_t j0, int64_t k0, int64_t k1,
                        double blk[TM][TN]) {
#if defined(__AVX2__) && defined(__FMA__)
  static_assert(TN == 8, "the AVX2 micro-kernel holds 8 columns in two registers");
  __m256d acc[TM][2];
  for (int a = 0; a < TM; ++a) acc[a][0] = acc[a][1] = _mm256_setzero_pd();
  // Sequential reads, which the prefetcher follows (a (K, N) row-major w^T put successive k
  // N doubles apart, a new page every few rows: 1.7-3x slower for fp32's long K).
  const double* wk = g.wp + (j0 / TN) * g.K * TN + k0 * TN;
  const double* xr[TM];
  for (int a = 0; a < TM; ++a) xr[a] = g.x + (i0 + a) * g.K;
  for (int64_t k = k0; k < k1; ++k, wk += TN) {
    const __m256d w0 = _mm256_loadu_pd(wk), w1 = _mm256_loadu_pd(wk + 4);
    for (int a = 0; a < TM; ++a) {
      const __m256d xa = _mm256_broadcast_sd(xr[a] + k);
      acc[a][0] = _mm256_fmadd_pd(xa, w0, acc[a][0]);
      acc[a][1] = _mm256_fmadd_pd(xa, w1, acc[a][1]);
    }
  }
  for (int a = 0; a < TM; ++a) {
    _mm256_storeu_pd(blk[a], acc[a][0]);
    _mm256_storeu_pd(blk[a] + 4, acc[a][1]);
  }
#else
  double acc[TM][TN] = {};
  for (int64_t k = k0; k < k1; ++k) {
    const double* wk = g.wp + (j0 / TN) * g.K * TN + k * TN;
    for (int a = 0; a < TM; ++a) {
      const double xa = g.x[(i0 + a) * g.K + k];
      for (int b = 0; b < TN; ++b) acc[a][b] += xa * wk[b];
    }
  }
  for (int a = 0; a < TM; ++a)
    for (int b = 0; b < TN; ++b) blk[a][b] = acc[a][b];
#endif
}

// True when every pair of a full tile may take the fast path for K-block kb: the widest row
// spread plus the widest column spread passes the check (all-zero rows/columns pass too, their
// block sums are exact zeros). 14 statistics read instead of 48 pair decisions.
inline bool tile_all_fast(const GemmArgs& g, int64_t i0, int64_t j0, int64_t kb) {
  int sx = 0, sw = 0;
  for (int a = 0; a < TM; ++a) {
    const int32_t st = g.xs[(i0 + a) * g.nkb + kb];
    const int hi = stat_hi(st);
    if (hi == kStatSpecial) return false;
    if (hi != kStatEmpty) sx = std::max(sx, hi - stat_lo(st));
  }
  for (int b = 0; b < TN; ++b) {
    const int32_t st = g.ws[(j0 + b) * g.nkb + kb];
    const int hi = stat_hi(st);
    if (hi == kStatSpecial) return false;
    if (hi != kStatEmpty) sw = std::max(sw, hi - stat_lo(st));
  }
  return sx + sw <= LDET_FAST_SPREAD;
}

// TwoSum of a tile's block sums into its running sums; rounding errors (rare) go to the digits.
// The vector and scalar TwoSum are the same IEEE operations, so the result is identical.
inline void flush_tile(const GemmArgs& g, double S[TM][TN], int64_t dig[TM][TN][LDET_WORDS],
                       int64_t adds[TM][TN], const double blk[TM][TN]) {
#if defined(__AVX2__)
  for (int a = 0; a < TM; ++a)
    for (int h = 0; h < TN; h += 4) {
      const __m256d sv = _mm256_loadu_pd(S[a] + h), bv = _mm256_loadu_pd(blk[a] + h);
      const __m256d s = _mm256_add_pd(sv, bv);
      const __m256d bb = _mm256_sub_pd(s, sv);
      const __m256d e = _mm256_add_pd(_mm256_sub_pd(sv, _mm256_sub_pd(s, bb)), _mm256_sub_pd(bv, bb));
      _mm256_storeu_pd(S[a] + h, s);
      if (_mm256_movemask_pd(_mm256_cmp_pd(e, _mm256_setzero_pd(), _CMP_NEQ_UQ))) {
        double ev[4];
        _mm256_storeu_pd(ev, e);
        for (int l = 0; l < 4; ++l)
          if (ev[l] != 0.0) acc_digits(dig[a][h + l], adds[a][h + l], g.interval, ev[l]);
      }
    }
#else
  for (int a = 0; a < TM; ++a)
    for (int b = 0; b < TN; ++b) acc_term(S[a][b], dig[a][b], adds[a][b], g.interval, blk[a][b]);
#endif
}

// One (output, K-block) pair on the path chosen for it.
inline void pair_block(const GemmArgs& g, int64_t i, int64_t j, int64_t k0, int64_t k1,
                       BlockPath path, double& S, int64_t* dig, int64_t& adds) {
  if (path == kPathSkip) return;
  const double* xr = g.x + i * g.K;
  const double* wc = g.wp + (j / TN) * g.K * TN + j % TN;  // column j: wc[k * TN]
  if (path == kPathFast) {
    double s0 = 0, s1 = 0;
    int64_t k = k0;
    for (; k + 1 < k1; k += 2) {
      s0 += xr[k] * wc[k * TN];
      s1 += xr[k + 1] * wc[(k + 1) * TN];
    }
    if (k < k1) s0 += xr[k] * wc[k * TN];
    acc_term(S, dig, adds, g.interval, s0 + s1);
    return;
  }
  for (int64_t k = k0; k < k1; ++k) acc_any(S, dig, adds, g.interval, xr[k] * wc[k * TN]);
}

inline bool all_zero(const int64_t* d) {
  int64_t any = 0;
  for (int q = 0; q < LDET_WORDS; ++q) any |= d[q];
  return any == 0;
}

template <bool kFinalize>
void run_gemm(const GemmArgs& g, void* out_f, int64_t* out_d) {
  const int64_t tiles_m = (g.M + TM - 1) / TM;
  const int64_t tiles_n = (g.N + TN - 1) / TN;
  ieee_parallel_for(0, tiles_m * tiles_n, 1, [&](int64_t tb, int64_t te) {
    double S[TM][TN];
    double seg_sums[TM][TN][4];  // S of each finished fp32-split segment (4 at most)
    int64_t dig[TM][TN][LDET_WORDS];
    int64_t adds[TM][TN];
    double blk[TM][TN];
    for (int64_t t = tb; t < te; ++t) {
      const int64_t i0 = (t / tiles_n) * TM, j0 = (t % tiles_n) * TN;
      const int mm = int(std::min<int64_t>(TM, g.M - i0));
      const int nn = int(std::min<int64_t>(TN, g.N - j0));
      const bool full = mm == TM && nn == TN;
      int nseg = 0;  // finished segments
      for (int a = 0; a < mm; ++a)
        for (int b = 0; b < nn; ++b) {
          S[a][b] = 0.0;
          adds[a][b] = 0;
          zero(dig[a][b]);
        }
      for (int64_t kb = 0; kb < g.nkb; ++kb) {
        const int64_t k0 = kb * LDET_KBLOCK, k1 = std::min(g.K, k0 + LDET_KBLOCK);
        if (full && tile_all_fast(g, i0, j0, kb)) {
          micro_block(g, i0, j0, k0, k1, blk);
          flush_tile(g, S, dig, adds, blk);
        } else {
          for (int a = 0; a < mm; ++a)
            for (int b = 0; b < nn; ++b) {
              const BlockPath path = block_path(g.xs[(i0 + a) * g.nkb + kb], g.ws[(j0 + b) * g.nkb + kb]);
              pair_block(g, i0 + a, j0 + b, k0, k1, path, S[a][b], dig[a][b], adds[a][b]);
            }
        }
        if (segment_ends(g, kb)) {
          for (int a = 0; a < mm; ++a)
            for (int b = 0; b < nn; ++b) {
              seg_sums[a][b][nseg] = S[a][b];
              S[a][b] = 0.0;
            }
          ++nseg;
        }
      }
      for (int a = 0; a < mm; ++a)
        for (int b = 0; b < nn; ++b) {
          if (g.bias) acc_any(S[a][b], dig[a][b], adds[a][b], g.interval, g.bias[j0 + b]);
          const int64_t o = (i0 + a) * g.N + (j0 + b);
          if (kFinalize && g.out_fmt == kFmtF32 && all_zero(dig[a][b])) {
            // No digit was needed: the exact sum is S plus the finished segments' sums. When
            // those add up to a provably exact pair hi + lo, round_pair_to_fp32 gives the value
            // finalize_fp32 would (with one segment: IEEE double -> float of S, nearest-even,
            // subnormals and overflow included), at a fraction of normalize + round_acc.
            double v[5], hi, lo;
            for (int q = 0; q < nseg; ++q) v[q] = seg_sums[a][b][q];
            v[nseg] = S[a][b];
            float f;
            if (exact_pair_sum(v, nseg + 1, &hi, &lo) && round_pair_to_fp32(hi, lo, &f)) {
              static_cast<float*>(out_f)[o] = f;
              continue;
            }
          }
          for (int q = 0; q < nseg; ++q) acc_digits(dig[a][b], adds[a][b], g.interval, seg_sums[a][b][q]);
          acc_finish(S[a][b], dig[a][b]);
          if (kFinalize) {
            store_fmt(out_f, o, finalize_fmt(dig[a][b], g.out_fmt), g.out_fmt);
          } else {
            for (int w = 0; w < LDET_WORDS; ++w) out_d[o * LDET_WORDS + w] = dig[a][b][w];
          }
        }
    }
  });
}

// The long-accumulator kernel (csrc/gemm_common.h): the kernel route, and the rows the slices
// cannot hold.
template <bool kFinalize>
at::Tensor gemm_kernel_cpu(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                           int64_t norm_interval, at::ScalarType out_dtype) {
  auto [xsplit, wsplit] = split_fp32_for_fast_path(x, w);
  const at::Tensor& xin = xsplit.defined() ? xsplit : x;
  const at::Tensor& win = wsplit.defined() ? wsplit : w;
  const int64_t M = xin.size(0), K = xin.size(1), N = win.size(0);
  const at::Tensor xd = xin.to(at::kDouble).contiguous();     // exact widening
  const at::Tensor wd = win.to(at::kDouble).contiguous();  // (N, K): the statistics read its rows
  const int64_t npan = (N + TN - 1) / TN;
  const at::Tensor wpanels =  // (N/TN, K, TN), see GemmArgs::wp
      at::constant_pad_nd(wd, {0, 0, 0, npan * TN - N}).view({npan, TN, K}).permute({0, 2, 1}).contiguous();
  at::Tensor bd;
  if (bias.has_value()) bd = bias->to(at::kDouble).contiguous();
  GemmArgs g;
  g.x = xd.data_ptr<double>();
  g.wp = wpanels.data_ptr<double>();
  g.M = M;
  g.N = N;
  g.K = K;
  g.nkb = (K + LDET_KBLOCK - 1) / LDET_KBLOCK;
  g.seg = xsplit.defined() ? x.size(1) : 0;
  g.interval = norm_interval > 0 ? norm_interval : LDET_NORM_INTERVAL;
  g.bias = bias.has_value() ? bd.data_ptr<double>() : nullptr;
  const std::vector<int32_t> xs = block_stats(g.x, M, K);
  const std::vector<int32_t> ws = block_stats(wd.data_ptr<double>(), N, K);
  g.xs = xs.data();
  g.ws = ws.data();
  if (kFinalize) {
    at::Tensor out = at::empty({M, N}, x.options().dtype(out_dtype));
    g.out_fmt = out_format(out_dtype);
    if (M * N) run_gemm<true>(g, out.data_ptr(), nullptr);
    return out;
  }
  at::Tensor out = at::empty({M, N, LDET_WORDS}, x.options().dtype(at::kLong));
  if (M * N) run_gemm<false>(g, nullptr, out.data_ptr<int64_t>());
  return out;
}

// Plans the call (csrc/gemm_plan.h) and runs the plan (csrc/gemm_execute.h).
template <bool kFinalize>
at::Tensor gemm_common_cpu(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                           int64_t norm_interval, at::ScalarType out_dtype, at::IntArrayRef options) {
  check_gemm_args(x, w, bias);
  const GemmOptions opt = checked_options(options);
  if (kFinalize) out_format(out_dtype);  // a bad dtype fails here, before any route runs
  const SliceBackend& slices = slice_backend_cpu();
  GemmPlan plan = plan_for(x, w, slices.device, !kFinalize, out_dtype, opt, norm_interval == 0);
  const LongAccGemm kernel = [&](const at::Tensor& xs, const at::Tensor& ws, const c10::optional<at::Tensor>& bs) {
    return gemm_kernel_cpu<kFinalize>(xs, ws, bs, norm_interval, out_dtype);
  };
  return execute_gemm(&plan, x, w, bias, out_dtype, fp64_backend_cpu(), slices, kernel, kernel_slow_share_cpu);
}

at::Tensor gemm_partial_cpu(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                            int64_t norm_interval, at::IntArrayRef options) {
  return gemm_common_cpu<false>(x, w, bias, norm_interval, at::kFloat, options);
}

at::Tensor gemm_cpu(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                    c10::optional<at::ScalarType> out_dtype, at::IntArrayRef options) {
  return gemm_common_cpu<true>(x, w, bias, 0, out_dtype.value_or(at::kFloat), options);
}

// Slice by slice, each exactly as gemm runs it.
at::Tensor gemm_batched_cpu(const at::Tensor& x, const at::Tensor& w, c10::optional<at::ScalarType> out_dtype,
                            at::IntArrayRef options) {
  check_gemm_batched_args(x, w);
  const at::ScalarType dt = out_dtype.value_or(at::kFloat);
  out_format(dt);  // a bad dtype fails before any slice runs
  checked_options(options);
  at::Tensor out = at::empty({x.size(0), x.size(1), w.size(1)}, x.options().dtype(dt));
  for (int64_t b = 0; b < x.size(0); ++b)
    out.select(0, b).copy_(gemm_common_cpu<true>(x.select(0, b), w.select(0, b), c10::nullopt, 0, dt, options));
  return out;
}

// The plan a gemm (digits false) / gemm_partial (true) call would run, as JSON (explain_gemm).
std::string explain_gemm_cpu(const at::Tensor& x, const at::Tensor& w, bool digits, at::IntArrayRef options,
                             c10::optional<at::ScalarType> out_dtype) {
  check_gemm_args(x, w, c10::nullopt);
  return plan_json(explain_gemm_plan(x, w, digits, out_dtype.value_or(at::kFloat), checked_options(options),
                                     slice_backend_cpu(), kernel_slow_share_cpu));
}

}  // namespace

TORCH_LIBRARY_IMPL(ldet, CPU, m) {
  m.impl("gemm_partial", &ldet::ieee_op<&gemm_partial_cpu>::call);
  m.impl("gemm", &ldet::ieee_op<&gemm_cpu>::call);
  m.impl("gemm_batched", &ldet::ieee_op<&gemm_batched_cpu>::call);
  m.impl("explain_gemm", &explain_gemm_cpu);
}

}  // namespace ldet

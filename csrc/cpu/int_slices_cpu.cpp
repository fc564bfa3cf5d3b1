// CPU kernels of the integer-slice GEMM (scheme: csrc/int_slices.h; driver: csrc/int_slices_host.h).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>

#include "cpu/fp_env.h"
#include "cpu/crt_vector.h"
#include "cpu/slices_vector.h"
#include "int_slices_host.h"
#include "op_checks.h"

namespace ldet {
namespace {

// The kernels read the operands as they are (AT_DISPATCH over fp32 / bf16 / fp16): every value
// widens to fp64 exactly (static_cast<double>), so fp64 copies of whole operands are not needed.

// Adds one row's plan to the operand summary (int_slices.h, kSum*).
void add_row_to_summary(int need, const int* depth, const int* count, int32_t* sum) {
  if (need == 0) return;  // a zero row: no slices, no residues
  if (need > kSliceMax) {
    ++sum[kSumBad];
    return;
  }
  sum[kSumNeed] = std::max(sum[kSumNeed], need);
  for (int s = need; s <= kSliceMax; ++s) {
    sum[kSumDepth + s - 1] = std::max(sum[kSumDepth + s - 1], depth[s - 1]);
    sum[kSumCount + s - 1] += count[s - 1];
  }
}

// One row's statistics in scalar loops (any element type): hi, lo (exp_stat's over its nonzero
// elements) and its histogram of element needs; returns false at the first inf/NaN.
template <typename T>
bool row_stats_scalar(const T* row, int64_t K, int bits, int* hi_out, int* lo_out, int* hist) {
  int hi = -32768, lo = 32767;
  for (int64_t k = 0; k < K; ++k) {
    const double v = static_cast<double>(row[k]);
    if (!is_finite(v)) return false;
    const ExpStat s = exp_stat(v);
    hi = std::max(hi, s.hi);
    lo = std::min(lo, s.lo);
  }
  for (int64_t k = 0; k < K && hi >= lo; ++k) {
    const double v = static_cast<double>(row[k]);
    if (v != 0.0) ++hist[need_bin(hi, exp_stat(v).lo, bits)];
  }
  *hi_out = hi;
  *lo_out = lo;
  return true;
}

// One row's statistics: the vector form where it exists (csrc/cpu/slices_vector.h: counts of the
// elements needing more than s slices, turned into row_plan's histogram bins 2 .. kSliceMax + 1,
// the only ones it reads), else the scalar loops.
template <typename T>
bool row_stats(const T* row, int64_t K, int bits, int* hi, int* lo, int* hist) {
#if defined(LDET_CPU_AVX512)
  if constexpr (kVectorElems<T>) {
    int over[kSliceMax];
    if (!row_stats_vec(row, K, bits, hi, lo, over)) return false;
    for (int b = 2; b < kNeedBins; ++b) hist[b] = over[b - 2] - (b - 1 < kSliceMax ? over[b - 1] : 0);
    return true;
  }
#endif
  return row_stats_scalar(row, K, bits, hi, lo, hist);
}

at::Tensor row_needs_cpu(const at::Tensor& a, int64_t bits, at::Tensor& summary) {
  const int64_t R = a.size(0), K = a.size(1);
  at::Tensor out = uninit({R, 3}, a.options().dtype(at::kInt));  // every row written
  int32_t* o = out.data_ptr<int32_t>();
  int32_t* sum = summary.data_ptr<int32_t>();
  std::mutex mu;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.scalar_type(), "row_needs_cpu", [&] {
    const scalar_t* p = a.data_ptr<scalar_t>();
    ieee_parallel_for(0, R, 16, [&](int64_t b, int64_t e) {
      int32_t local[kSumLen] = {};
      for (int64_t r = b; r < e; ++r) {
        // a row holding inf/NaN: its hi and lo are never read (make_slices skips it)
        int hi = -32768, lo = 32767, hist[kNeedBins] = {}, depth[kSliceMax], count[kSliceMax];
        const int need = row_stats(p + r * K, K, int(bits), &hi, &lo, hist)
                             ? row_plan(hist, hi, lo, int(bits), depth, count)
                             : kSliceNeedBad;
        o[3 * r] = hi;
        o[3 * r + 1] = need;
        o[3 * r + 2] = lo;
        add_row_to_summary(need, depth, count, local);
      }
      std::lock_guard<std::mutex> lock(mu);
      sum[kSumNeed] = std::max(sum[kSumNeed], local[kSumNeed]);
      sum[kSumBad] += local[kSumBad];
      for (int s = 0; s < kSliceMax; ++s) {
        sum[kSumDepth + s] = std::max(sum[kSumDepth + s], local[kSumDepth + s]);
        sum[kSumCount + s] += local[kSumCount + s];
      }
    });
  });
  return out;
}

// LIGHTNING_DET_CRT_SCALAR=1: the CRT way through crt.h's 32-bit per-element and per-output
// forms (crt_remainder, crt_value), the arithmetic the CUDA kernels run, instead of the fp64
// loops: the CPU tests then check that arithmetic too (tests/test_crt_route.py; slower).
bool crt_scalar_forms() { return gemm_env().crt_scalar; }

SliceOperand make_slices_cpu(const at::Tensor& a, const at::Tensor& needs, int64_t S, int64_t bits, bool reverse,
                             int64_t Kc, int64_t nch, int64_t Rp, const at::Tensor& rcount, const at::Tensor& left,
                             int64_t moduli) {
  const bool residues = rcount.defined();
  const int64_t R = a.size(0), K = a.size(1), width = moduli > 0 ? moduli * Kc : nch * S * Kc;
  const CrtConsts crt = moduli > 0 ? crt_consts(int(bits), int(moduli)) : CrtConsts{};
  const bool scalar = crt_scalar_forms();
  SliceOperand so = new_slice_operand(a, Rp, width, rcount, /*zero_fill=*/true, /*zero_slices=*/false);
  const int32_t* nd = needs.data_ptr<int32_t>();
  int8_t* o = so.q.data_ptr<int8_t>();
  int32_t* sho = so.sh.data_ptr<int32_t>();
  int32_t* rc = residues ? so.rcount.data_ptr<int32_t>() : nullptr;
  int32_t* ri = residues ? so.ridx.data_ptr<int32_t>() : nullptr;
  double* rv = residues ? so.rval.data_ptr<double>() : nullptr;
  int32_t* Fo = residues ? so.F.data_ptr<int32_t>() : nullptr;
  // slice 0 sits in slot 0 (x) or slot S-1 (w, reversed); consecutive slices one Kc apart
  const int64_t slot0 = reverse ? S - 1 : 0, step = reverse ? -Kc : Kc;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.scalar_type(), "make_slices_cpu", [&] {
    const scalar_t* p = a.data_ptr<scalar_t>();
    ieee_parallel_for(0, R, 16, [&](int64_t b, int64_t e) {
      // the CRT route: a row's window integers as two exact doubles each, for crt_remainders_fp64
      std::vector<double> xhi(moduli > 0 ? K : 0), xlo(moduli > 0 ? K : 0);
      for (int64_t r = b; r < e; ++r) {
        const int need = nd[3 * r + 1];
        // the row's slices start as zeros (q is not zero-filled: see new_slice_operand): a zero
        // row, a row left to the long-accumulator kernel, the padding past K
        std::memset(o + r * width, 0, size_t(width));
        if (need == 0 || need > S) continue;
        const int s = int(bits * S) - 3 - nd[3 * r];
        sho[r] = s;
        const int F = (nd[3 * r] + 3 - int(bits * S)) - nd[3 * r + 2];  // bits the residues reach below
#if defined(LDET_CPU_AVX512)
        if constexpr (kVectorElems<scalar_t>) {
          if (moduli > 0 && !scalar && bits * S - 2 <= 46) {  // window integers exact in fp64
            const int nres = crt_row_remainders_vec(p + r * K, K, s, crt, o + r * width, Kc, residues,
                                                    residues ? ri + r * kResidueCap : nullptr,
                                                    residues ? rv + r * kResidueCap : nullptr);
            if (residues) {
              rc[r] = nres;
              Fo[r] = nres > 0 ? F : 0;
            }
            continue;
          }
        }
#endif
        const double unscale = pow2(-s);
        int nres = 0;
        for (int64_t c = 0; c < nch; ++c) {
          int8_t* base = o + r * width + (c * S + slot0) * Kc;
          for (int64_t k = c * Kc, kk = 0; k < std::min(K, (c + 1) * Kc); ++k, ++kk) {
            const double v = static_cast<double>(p[r * K + k]);
            const int64_t X = window_integer(v, s);
            if (moduli > 0 && scalar) {  // crt_scalar_forms: plane t at columns [t * Kc, +Kc)
              uint32_t lo, hi;
              digit_words(X, int(S), int(bits), &lo, &hi);
              for (int t = 0; t < int(moduli); ++t) o[r * width + t * Kc + kk] = crt_remainder(lo, hi, t, crt);
            } else if (moduli > 0) {
              xhi[k] = double(X >> 32);  // arithmetic shift: X = hi 2^32 + lo, 0 <= lo < 2^32
              xlo[k] = double(X & int64_t(0xffffffff));
            } else {
              slice_integer(X, int(S), int(bits), base + kk, step);
            }
            if (residues && v != double(X) * unscale) {
              // row_plan bounded this row's residues at S by kResidueCap
              ri[r * kResidueCap + nres] = int32_t(k);
              rv[r * kResidueCap + nres] = v - double(X) * unscale;  // exact: the bits below the window
              ++nres;
            }
          }
        }
        if (moduli > 0 && !scalar)  // plane t at columns [t * Kc, +Kc) (nch == 1)
          crt_remainders_fp64(xhi.data(), xlo.data(), K, crt, o + r * width, Kc);
        if (residues) {
          rc[r] = nres;
          Fo[r] = nres > 0 ? F : 0;
        }
      }
    });
  });
  // padding rows: their products reach no output (the combine reads rows < R), zeros all the same
  if (Rp > R) std::memset(o + R * width, 0, size_t((Rp - R) * width));
  if (left.defined()) {  // rows needing more than S (a guessed plan): exact_rows recomputes them
    int32_t* l = left.data_ptr<int32_t>();
    for (int64_t r = 0; r < R; ++r)
      if (nd[3 * r + 1] > S) l[1 + l[0]++] = int32_t(r);
  }
  return so;
}

// The combine's view of one operand's residues (null pointers when it has none).
Residues residues_of(const SliceOperand& o) {
  if (!o.rcount.defined()) return {nullptr, nullptr, nullptr, nullptr};
  return {o.rcount.data_ptr<int32_t>(), o.ridx.data_ptr<int32_t>(), o.rval.data_ptr<double>(), o.F.data_ptr<int32_t>()};
}

// What the combine reads for every output (combine_cpu).
struct CombineView {
  const int32_t* c;
  int64_t pstride, Ncp, Nv;
  int nch, D, bits, fmt, moduli;  // moduli > 0: c holds remainder sums (crt.h), not diagonals
  CrtConsts crt;                  // their moduli
  bool wide, digits;
  const int32_t *sx, *sw;
  Residues rx, rw;
  Elems ex, ew;
  const double* bias;
  void* out;
  int64_t ldo;  // out's row stride, in outputs
};

// One output of the CRT route from its product sums' integer P: finished as the diagonals' are.
// plain_row: wide, no bias and no residues in x's row m.
void finish_crt_output(const CombineView& v, int64_t m, int64_t n, i128 P, bool plain_row) {
  const int64_t i = m * v.ldo + n;
  if (plain_row && !v.digits && (v.rw.count == nullptr || v.rw.count[n] == 0)) {
    // no residue terms, no bias: finish_output_fast's rounding alone (wide: P is proven)
    store_fmt(v.out, i, round_signed_int128(P, -(v.sx[m] + v.sw[n]), v.fmt), v.fmt);
    return;
  }
  const ResidueTerms terms{v.rx, v.ex, v.sx[m], m, v.rw, v.ew, n};
  const int F = (v.rx.F ? v.rx.F[m] : 0) + (v.rw.F ? v.rw.F[n] : 0);
  float val;
  combine_output_value(P, -(v.sx[m] + v.sw[n]), F, v.bias ? v.bias + n : nullptr, v.wide, v.fmt, terms,
                       v.digits ? nullptr : &val, v.digits ? static_cast<int64_t*>(v.out) + i * LDET_WORDS : nullptr);
  if (!v.digits) store_fmt(v.out, i, val, v.fmt);
}

bool plain_crt_row(const CombineView& v, int64_t m) {
  return v.wide && v.bias == nullptr && (v.rx.count == nullptr || v.rx.count[m] == 0);
}

#if defined(LDET_CPU_AVX512)
// LIGHTNING_DET_CRT_VECTOR_UNPROVEN=1: every lane of the vector form counts as unproven, so each
// output takes the exact scalar form (crt_value) and the one-by-one finish: tests run that branch,
// which real data reaches only within ~2^-40 M of the moduli's bound (crt_vector.h, step 2).
bool crt_vector_unproven() { return gemm_env().crt_vector_unproven; }

// The residue terms and bias of eight outputs (m, n1 + j), j in `go`, added to T in units of
// 2^Eu as finish_output_fast adds them (csrc/int_slices.h; the terms' order cannot matter: integer
// sums); returns the lanes where a term is not an integer number of units in range.
__mmask8 add_terms8(const CombineView& v, int64_t m, int64_t n1, __mmask8 go, I128x8* T, __m512i Eu) {
  __mmask8 bad = 0;
  alignas(64) double t[8];
  if (v.bias != nullptr)  // the bias joins T when it is an integer number of units below 2^100 of them
    bad |= add_units8(T, _mm512_maskz_loadu_pd(go, v.bias + n1), Eu, 100, go);
  const int cx = v.rx.count ? v.rx.count[m] : 0;
  for (int r = 0; r < cx; ++r) {  // x's residues times w: xr[m, k] w[n, k]
    const int64_t slot = m * kResidueCap + r;
    const double xr = v.rx.val[slot];
    for (int j = 0; j < 8; ++j) t[j] = (go >> j) & 1 ? xr * v.ew.at(n1 + j, v.rx.idx[slot]) : 0.0;
    bad |= add_units8(T, _mm512_load_pd(t), Eu, 124, go);
  }
  if (v.rw.count == nullptr) return bad;
  const __m256i cw = _mm256_maskz_loadu_epi32(go, v.rw.count + n1);
  const int cmax = _mm512_reduce_max_epi64(_mm512_cvtepi32_epi64(cw));
  const double up = pow2(v.sx[m]), down = pow2(-v.sx[m]);
  for (int r = 0; r < cmax; ++r) {  // x's window part times w's residues: x3[m, k] wr[n, k]
    const __mmask8 has = go & _mm256_cmpgt_epi32_mask(cw, _mm256_set1_epi32(r));
    __mmask8 use = has;
    for (int j = 0; j < 8; ++j) {
      t[j] = 0.0;
      if (!((has >> j) & 1)) continue;
      const int64_t slot = (n1 + j) * kResidueCap + r;
      // ResidueTerms::each's window part: a row left to the kernel (outputs recomputed) adds nothing
      const double scaled = v.ex.at(m, v.rw.idx[slot]) * up;
      if (!(scaled < 0x1p62 && scaled > -0x1p62)) {
        use &= __mmask8(~(1u << j));
        continue;
      }
      t[j] = double(int64_t(scaled)) * down * v.rw.val[slot];
    }
    bad |= add_units8(T, _mm512_load_pd(t), Eu, 124, use);
  }
  return bad;
}

// combine_rows_crt sixteen outputs at a time (csrc/cpu/crt_vector.h): P in vector registers, and
// fp32 outputs with a proven 128-bit sum (wide) rounded there too, their residue terms and bias
// added as integers first; the other outputs (digits, other formats, a term off the grid, a lane
// whose P the vector form could not prove) finished one by one as before.
template <int NL>
void combine_rows_crt_vec(const CombineView& v, int64_t b, int64_t e) {
  const CrtVecConsts k = crt_vec_consts(v.crt);
  const bool round_here = v.fmt == kFmtF32 && !v.digits && v.wide;
  const bool unproven = crt_vector_unproven();
  constexpr int U = 2;
  int64_t hi[8 * U];
  uint64_t lo[8 * U];
  for (int64_t m = b; m < e; ++m) {
    const bool plain_row = plain_crt_row(v, m);
    const int32_t* crow = v.c + m * v.Ncp;
    const __m512i Fx = _mm512_set1_epi64(v.rx.F ? v.rx.F[m] : 0);
    const __m512i shx = _mm512_set1_epi64(v.sx[m]);
    for (int64_t n0 = 0; n0 < v.Nv; n0 += 8 * U) {
      __mmask8 live[U];
      for (int u = 0; u < U; ++u) {
        const int64_t nb = std::max<int64_t>(0, std::min<int64_t>(8, v.Nv - n0 - 8 * u));
        live[u] = __mmask8((1u << nb) - 1);
      }
      __m512d f[U], s[U][3];
      crt_sums<U, NL>(crow + n0, v.pstride, k, live, f, s);
      for (int u = 0; u < U; ++u) {
        const int64_t n1 = n0 + 8 * u;
        I128x8 P;
        const __mmask8 proven = unproven ? 0 : crt_p8(f[u], s[u][0], s[u][1], s[u][2], k, live[u], &P);
        __mmask8 done = 0;
        if (proven) {
          _mm512_mask_storeu_epi64(hi + 8 * u, proven, P.hi);
          _mm512_mask_storeu_epi64(lo + 8 * u, proven, P.lo);
        }
        if (round_here && proven) {
          float* o = static_cast<float*>(v.out) + m * v.ldo + n1;
          const __m512i E = _mm512_sub_epi64(_mm512_setzero_si512(),
                                             _mm512_add_epi64(shx, _mm512_cvtepi32_epi64(_mm256_maskz_loadu_epi32(proven, v.sw + n1))));
          if (plain_row && v.rw.count == nullptr) {
            done = round_to_f32_8(P, E, proven, o);
          } else {  // T = P 2^F plus the terms, in units of 2^(E - F) (finish_output_fast)
            __m512i F = Fx;
            if (v.rw.F) F = _mm512_add_epi64(F, _mm512_cvtepi32_epi64(_mm256_maskz_loadu_epi32(proven, v.rw.F + n1)));
            const __m512i Eu = _mm512_sub_epi64(E, F);
            I128x8 T = shl128(P, F);
            const __mmask8 bad = add_terms8(v, m, n1, proven, &T, Eu);
            done = round_to_f32_8(T, Eu, proven & ~bad, o);
          }
        }
        for (unsigned rest = unsigned(live[u] & ~done); rest != 0; rest &= rest - 1) {
          const int j = __builtin_ctz(rest);
          const i128 P1 = (proven >> j) & 1 ? i128(u128(uint64_t(hi[8 * u + j])) << 64 | u128(lo[8 * u + j]))
                                            : crt_value(crow + n1 + j, v.pstride, v.crt);
          finish_crt_output(v, m, n1 + j, P1, plain_row);
        }
      }
    }
  }
}
#endif

// The CRT route's outputs of rows [b, e): the same integer the diagonals build, reconstructed a
// block of outputs at a time (crt.h, crt_values_fp64; with AVX-512 crt_vector.h), then finished
// as theirs.
void combine_rows_crt(const CombineView& v, int64_t b, int64_t e) {
#if defined(LDET_CPU_AVX512)
  if (!crt_scalar_forms()) {  // two limbs of S while every M / m_t < 2^80 (Q <= 11: each m_t <= 2^8)
    if (v.crt.count <= 11) return combine_rows_crt_vec<2>(v, b, e);
    return combine_rows_crt_vec<3>(v, b, e);
  }
#endif
  const CrtLimbs limbs = crt_limbs(v.crt);
  i128 P[kCrtBlock];
  for (int64_t m = b; m < e; ++m) {
    const bool plain_row = plain_crt_row(v, m);
    for (int64_t n0 = 0; n0 < v.Nv; n0 += kCrtBlock) {
      const int64_t nb = std::min(kCrtBlock, v.Nv - n0);
      if (crt_scalar_forms()) {
        for (int64_t j = 0; j < nb; ++j) P[j] = crt_value(v.c + m * v.Ncp + n0 + j, v.pstride, v.crt);
      } else {
        crt_values_fp64(v.c + m * v.Ncp + n0, v.pstride, nb, v.crt, limbs, P);
      }
      for (int64_t j = 0; j < nb; ++j) finish_crt_output(v, m, n0 + j, P[j], plain_row);
    }
  }
}

// Outputs of rows [b, e) (the CRT route: combine_rows_crt). DC > 0: the diagonal count at compile
// time for one K-chunk (the Horner sum unrolled, as on CUDA: the combine at fp32 512^3 6.4 -> 5.5
// ms), else 0.
template <int DC>
void combine_rows(const CombineView& v, int64_t b, int64_t e) {
  if (v.moduli > 0) return combine_rows_crt(v, b, e);
  for (int64_t m = b; m < e; ++m) {
    const int Fx = v.rx.F ? v.rx.F[m] : 0;
    for (int64_t n = 0; n < v.Nv; ++n) {
      const int32_t* cp = v.c + m * v.Ncp + n;
      const int E = -(v.sx[m] + v.sw[n]);
      const int F = Fx + (v.rw.F ? v.rw.F[n] : 0);
      const double* bn = v.bias ? v.bias + n : nullptr;
      const ResidueTerms terms{v.rx, v.ex, v.sx[m], m, v.rw, v.ew, n};
      const int64_t i = m * v.ldo + n;
      if (v.digits) {
        combine_output<DC>(cp, v.pstride, v.nch, v.D, v.bits, E, F, bn, v.wide, v.fmt, terms, nullptr,
                           static_cast<int64_t*>(v.out) + i * LDET_WORDS);
      } else {
        float val;
        combine_output<DC>(cp, v.pstride, v.nch, v.D, v.bits, E, F, bn, v.wide, v.fmt, terms, &val, nullptr);
        store_fmt(v.out, i, val, v.fmt);
      }
    }
  }
}

// combine_rows<D> when D is a compile-time candidate (one K-chunk), else combine_rows<0>.
template <int DC = kMaxDiagonals>
void combine_rows_for(const CombineView& v, int64_t b, int64_t e) {
  if constexpr (DC >= 1) {
    if (v.moduli == 0 && v.nch == 1 && v.D == DC) return combine_rows<DC>(v, b, e);
    return combine_rows_for<DC - 1>(v, b, e);
  } else {
    combine_rows<0>(v, b, e);
  }
}

at::Tensor combine_cpu(const at::Tensor& C, int64_t M, int64_t Nv, const SliceOperand& x, const SliceOperand& w,
                       const at::Tensor& bias, int64_t D, int64_t bits, bool wide, const WideCheck& check,
                       bool digits, at::ScalarType out_dtype, int64_t moduli, const at::Tensor& dst,
                       int32_t* /*count: the CUDA combine's*/) {
  if (check.sums != nullptr)  // the summaries are host memory here
    wide = slices_wide(check.sums, check.sums + kSumLen, check.Sx, check.Sw, check.nch, check.Kc, int(bits));
  const int64_t P = C.size(0), Mp = C.size(1), Ncp = C.size(2);
  const int fmt = out_format(out_dtype);
  at::Tensor out = combine_output(C, M, Nv, digits, out_dtype, dst);
  const at::Tensor shw_c = w.sh.contiguous();
  const CombineView v{C.data_ptr<int32_t>(), Mp * Ncp, Ncp, Nv, D > 0 && moduli == 0 ? int(P / D) : 0, int(D),
                      int(bits), fmt, int(moduli), moduli > 0 ? crt_consts(int(bits), int(moduli)) : CrtConsts{},
                      wide, digits, x.sh.data_ptr<int32_t>(), shw_c.data_ptr<int32_t>(), residues_of(x), residues_of(w),
                      elems_of(x.a), elems_of(w.a), bias.defined() ? bias.data_ptr<double>() : nullptr, out.data_ptr(),
                      output_row_stride(out, digits)};
  ieee_parallel_for(0, M, 8, [&](int64_t b, int64_t e) { combine_rows_for(v, b, e); });
  return out;
}

void exact_rows_cpu(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                    const at::Tensor& left, bool x_rows, bool digits, at::ScalarType out_dtype) {
  const int32_t* l = left.data_ptr<int32_t>();
  const int64_t count = l[0], M = x.size(0), N = w.size(0), K = x.size(1), per = x_rows ? N : M;
  if (count == 0) return;
  const Elems ex = elems_of(x), ew = elems_of(w);
  const double* bp = bias.defined() ? bias.data_ptr<double>() : nullptr;
  const int fmt = out_format(out_dtype);
  void* o = out.data_ptr();
  ieee_parallel_for(0, count * per, 64, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t row = l[1 + t / per], other = t % per;
      const int64_t m = x_rows ? row : other, n = x_rows ? other : row;
      const int64_t i = m * N + n;
      if (digits) {
        exact_output(ex, m, ew, n, K, bp ? bp + n : nullptr, fmt, nullptr, static_cast<int64_t*>(o) + i * LDET_WORDS);
      } else {
        float v;
        exact_output(ex, m, ew, n, K, bp ? bp + n : nullptr, fmt, &v, nullptr);
        store_fmt(o, i, v, fmt);
      }
    }
  });
}

// The CPU computes in order: the summaries are final when the call returns.
struct ReadySummary : PendingSummary {
  bool ready() override { return true; }
};

std::shared_ptr<PendingSummary> summary_later_cpu(const at::Tensor& sums) {
  auto p = std::make_shared<ReadySummary>();
  p->host = sums.clone();
  return p;
}

// 8-bit digits need the int8 GEMM to keep every int32 sum exact. Without VNNI, an int8 GEMM may
// add u8 x s8 pairs in saturating 16-bit lanes (oneDNN documents this for AVX2): 7-bit digits
// keep such pairs below 2^15. Ask the GEMM itself once, with the largest magnitudes.
int probe_bits() {
  // LIGHTNING_DET_SLICE_BITS=7 forces the 7-bit digits (tests run that branch on VNNI machines too).
  if (gemm_env().slice_bits == 7) return 7;
  const int64_t M = 32, K = 256, N = 32;
  at::Tensor a = at::full({M, K}, 127, at::kChar), b = at::full({K, N}, 127, at::kChar);
  a.narrow(0, 0, 8).fill_(-128);
  b.narrow(1, 0, 8).fill_(-128);
  const at::Tensor got = at::_int_mm(a, b).to(at::kLong);
  const at::Tensor want = at::mm(a.to(at::kLong), b.to(at::kLong));
  return at::equal(got, want) ? 8 : 7;
}

}  // namespace

#if defined(LDET_CPU_AVX512)
constexpr bool kCpuVectorForms = true;  // csrc/cpu/*_vector.h
#else
constexpr bool kCpuVectorForms = false;
#endif

const SliceBackend& slice_backend_cpu() {
  // The route's costs (when the slices pay, residue terms, the CRT way): csrc/gemm_plan.h.
  static const SliceBackend be = [] {
    SliceBackend b;
    b.row_needs = &row_needs_cpu;
    b.make_slices = &make_slices_cpu;
    b.combine = &combine_cpu;
    b.int8_mm = &int8_mm_aten;
    b.exact_rows = &exact_rows_cpu;
    b.summary_later = &summary_later_cpu;
    b.bits = probe_bits();
    b.chunk_max_outputs = 0;
    b.guess_by_default = false;  // plans from this call's summaries: nothing to gain from guesses
    b.crt_route = true;
    b.device = kCpuVectorForms ? GemmDevice::kCpuAvx512 : GemmDevice::kCpu;
    return b;
  }();
  return be;
}

}  // namespace ldet

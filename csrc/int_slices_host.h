// Host side of the integer-slice GEMM (csrc/int_slices.h has the scheme and its proof).
//
// gemm_int_slices() is tried first by both devices' gemm / gemm_partial. It returns an undefined
// tensor when the path does not apply (switched off, too small in auto mode, most rows out of
// range), and the caller runs the long-accumulator kernel as before. Rows of x (columns of the
// result) that the slices cannot hold exactly are recomputed by that kernel, so the result is
// always the long accumulator's, byte for byte.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <functional>
#include <utility>

#include "int_slices.h"

namespace ldet {

// Path switch (ldet::set_gemm_path, lightning_det.ops.gemm_path): which exact route gemm takes.
enum GemmPath { kPathAuto = 0, kPathKernel = 1, kPathSlices = 2 };
int gemm_path();  // csrc/schema/gemm.cpp

struct SliceBackend {
  // (R, 2) int32 per row: the exponent of its largest |value| and the slices it needs at `bits`
  // (kSliceNeedBad for a row holding inf/NaN, 0 for an all-zero row).
  at::Tensor (*row_needs)(const at::Tensor& a, int64_t bits);
  // int8 (Rp, nch * S * Kc): for chunk c and slice s (slot s, or S-1-s when reverse) the columns
  // [(c*S + slot) * Kc, +Kc) hold slice s of a[:, c*Kc : (c+1)*Kc]; zero padding and zero rows
  // for rows needing more than S. Also the int32 (R,) scales sh_r.
  std::pair<at::Tensor, at::Tensor> (*make_slices)(const at::Tensor& a, const at::Tensor& needs, int64_t S,
                                                   int64_t bits, bool reverse, int64_t Kc, int64_t nch,
                                                   int64_t Rp);
  // Rounded (M, Nv) of out_dtype, or digits (M, Nv, 19), from C (P, Mp, Ncp) int32.
  at::Tensor (*combine)(const at::Tensor& C, int64_t M, int64_t Nv, const at::Tensor& shx, const at::Tensor& shw,
                        const at::Tensor& bias, int64_t D, int64_t bits, bool wide, bool digits,
                        at::ScalarType out_dtype);
  int bits;          // digit width: 8, or 7 where the int8 GEMM could saturate 16-bit pair sums
  // Auto mode: M*N*K from which the slices beat the long-accumulator kernel, when an input is
  // fp32 (the kernel then splits it into four products) and when both are bf16 / fp16. Measured
  // (benchmarks/results/h200-gemm.json, cpu-gemm.json; NOTES "Session 6").
  int64_t min_work_fp32;
  int64_t min_work_16bit;
};

// Each device's kernels (csrc/cpu/int_slices_cpu.cpp, csrc/cuda/int_slices_cuda.cu).
const SliceBackend& slice_backend_cpu();
const SliceBackend& slice_backend_cuda();

using LongAccGemm = std::function<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&)>;

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

inline int ceil_log2(int64_t v) {
  int b = 0;
  while ((int64_t(1) << b) < v) ++b;
  return b;
}

inline at::Tensor gemm_int_slices(const at::Tensor& x_in, const at::Tensor& w_in, const c10::optional<at::Tensor>& bias,
                                  bool digits, at::ScalarType out_dtype, const SliceBackend& be,
                                  const LongAccGemm& long_acc) {
  const int mode = gemm_path();
  if (mode == kPathKernel) return {};
  const int64_t M = x_in.size(0), K = x_in.size(1), N = w_in.size(0);
  if (M == 0 || N == 0 || K == 0) return {};
  if (mode == kPathAuto) {
    const bool fp32 = x_in.scalar_type() == at::kFloat || w_in.scalar_type() == at::kFloat;
    if (double(M) * double(N) * double(K) < double(fp32 ? be.min_work_fp32 : be.min_work_16bit)) return {};
  }
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int bits = be.bits;

  const at::Tensor nx = be.row_needs(x, bits), nw = be.row_needs(w, bits);
  const at::Tensor need_x = nx.select(1, 1), need_w = nw.select(1, 1);
  const at::Tensor bad_x = need_x > kSliceMax, bad_w = need_w > kSliceMax;
  // One host synchronization: both slice counts and both counts of rows left out.
  const at::Tensor summary = at::stack({need_x.masked_fill(bad_x, 0).max(), bad_x.sum().to(at::kInt),
                                        need_w.masked_fill(bad_w, 0).max(), bad_w.sum().to(at::kInt)})
                                 .cpu();
  const int32_t* sm = summary.data_ptr<int32_t>();
  const int64_t Sx = sm[0], nbad_x = sm[1], Sw = sm[2], nbad_w = sm[3];
  // Auto mode: when most rows would be recomputed anyway, the long-accumulator kernel alone is cheaper.
  if (mode == kPathAuto && (2 * nbad_x > M || 2 * nbad_w > N)) return {};

  // K chunk: int32 holds a diagonal's sum while pairs * Kc * 2^(2 bits - 2) < 2^31.
  const int64_t pairs_max = std::max<int64_t>(1, std::min(Sx, Sw));
  const int64_t kc_max = (kSliceIntBound / (pairs_max << (2 * bits - 2))) / 16 * 16;
  const int64_t nch = (round_up(K, 16) + kc_max - 1) / kc_max;
  const int64_t Kc = round_up((K + nch - 1) / nch, 16);
  const int64_t Mp = std::max<int64_t>(M, 17), Np = round_up(N, 8);  // cuBLASLt int8: M > 16, N % 8
  const int64_t D = (Sx > 0 && Sw > 0) ? Sx + Sw - 1 : 0, P = D * nch;
  const bool wide = ceil_log2(nch * Kc) + ceil_log2(pairs_max) + bits * (Sx + Sw) - 1 <= 125;

  auto [xs, shx] = be.make_slices(x, nx, Sx, bits, false, Kc, nch, Mp);
  auto [ws, shw] = be.make_slices(w, nw, Sw, bits, true, Kc, nch, Np);
  at::Tensor bd;
  if (bias.has_value()) bd = bias->to(at::kDouble).contiguous();

  // N in chunks so the int32 diagonals stay within ~256 MiB (they live at the training step's peak).
  // LIGHTNING_DET_SLICES_CHUNK_MIB changes the cap (benchmarks: wider GEMMs against memory).
  int64_t cap_mib = 256;
  if (const char* env = std::getenv("LIGHTNING_DET_SLICES_CHUNK_MIB")) cap_mib = std::max<int64_t>(1, std::atoll(env));
  // LIGHTNING_DET_SLICES_CONTIGUOUS=1 hands each diagonal's operands to the int8 GEMM as contiguous
  // copies instead of column views (benchmarks: which kernels cuBLASLt then picks).
  const char* contig_env = std::getenv("LIGHTNING_DET_SLICES_CONTIGUOUS");
  const bool contig = contig_env != nullptr && std::string(contig_env) == "1";
  const int64_t per_col = std::max<int64_t>(1, P) * Mp * 4;
  const int64_t Nc = std::min(Np, std::max<int64_t>(8, ((cap_mib << 20) / per_col) / 8 * 8));
  at::Tensor out;
  for (int64_t n0 = 0; n0 < N; n0 += Nc) {
    const int64_t ncp = std::min(Nc, Np - n0), nv = std::min(Nc, N - n0);
    at::Tensor C = at::empty({P, Mp, ncp}, x.options().dtype(at::kInt));
    for (int64_t c = 0; c < nch; ++c) {
      for (int64_t d = 0; d < D; ++d) {
        const int64_t i0 = std::max<int64_t>(0, d - (Sw - 1)), i1 = std::min<int64_t>(d, Sx - 1);
        // x slices i0..i1 and w slices d-i0 .. d-i1, whose reversed slots are contiguous too
        const at::Tensor a = xs.narrow(1, (c * Sx + i0) * Kc, (i1 - i0 + 1) * Kc);
        const at::Tensor b = ws.narrow(0, n0, ncp).narrow(1, (c * Sw + (Sw - 1 - d + i0)) * Kc, (i1 - i0 + 1) * Kc);
        at::Tensor cd = C.select(0, c * D + d);
        if (contig) {
          at::_int_mm_out(cd, a.contiguous(), b.contiguous().t());
        } else {
          at::_int_mm_out(cd, a, b.t());
        }
      }
    }
    at::Tensor part = be.combine(C, M, nv, shx, shw.narrow(0, n0, nv), bd.defined() ? bd.narrow(0, n0, nv) : bd, D,
                                 bits, wide, digits, out_dtype);
    if (n0 == 0 && nv == N) {
      out = part;
    } else {
      if (!out.defined())
        out = digits ? at::empty({M, N, LDET_WORDS}, part.options()) : at::empty({M, N}, part.options());
      out.narrow(1, n0, nv).copy_(part);
    }
  }

  // Rows the slices could not hold exactly: the long-accumulator kernel, for those rows alone.
  if (nbad_x > 0) {
    const at::Tensor idx = bad_x.nonzero().select(1, 0);
    out.index_copy_(0, idx, long_acc(x.index_select(0, idx), w, bias));
  }
  if (nbad_w > 0) {
    const at::Tensor idx = bad_w.nonzero().select(1, 0);
    c10::optional<at::Tensor> bsel;
    if (bias.has_value()) bsel = bias->index_select(0, idx);
    out.index_copy_(1, idx, long_acc(x, w.index_select(0, idx), bsel));
  }
  return out;
}

}  // namespace ldet

// CPU kernels of the integer-slice GEMM (scheme: csrc/int_slices.h; driver: csrc/int_slices_host.h).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>

#include "int_slices_host.h"
#include "op_checks.h"

namespace ldet {
namespace {

// The kernels read the operands as they are (AT_DISPATCH over fp32 / bf16 / fp16): every value
// widens to fp64 exactly (static_cast<double>), so fp64 copies of whole operands are not needed.

at::Tensor row_needs_cpu(const at::Tensor& a, int64_t bits) {
  const int64_t R = a.size(0), K = a.size(1);
  at::Tensor out = at::empty({R, 2}, a.options().dtype(at::kInt));
  int32_t* o = out.data_ptr<int32_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.scalar_type(), "row_needs_cpu", [&] {
    const scalar_t* p = a.data_ptr<scalar_t>();
    at::parallel_for(0, R, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        int hi = -32768, lo = 32767;
        bool bad = false;
        for (int64_t k = 0; k < K; ++k) {
          const double v = static_cast<double>(p[r * K + k]);
          if (!is_finite(v)) {
            bad = true;
            break;
          }
          const ExpStat s = exp_stat(v);
          hi = std::max(hi, s.hi);
          lo = std::min(lo, s.lo);
        }
        o[2 * r] = hi;
        o[2 * r + 1] = bad ? kSliceNeedBad : slices_needed(hi, lo, int(bits));
      }
    });
  });
  return out;
}

std::pair<at::Tensor, at::Tensor> make_slices_cpu(const at::Tensor& a, const at::Tensor& needs, int64_t S,
                                                  int64_t bits, bool reverse, int64_t Kc, int64_t nch, int64_t Rp) {
  const int64_t R = a.size(0), K = a.size(1), width = nch * S * Kc;
  at::Tensor out = at::zeros({Rp, width}, a.options().dtype(at::kChar));
  at::Tensor sh = at::zeros({R}, a.options().dtype(at::kInt));
  const int32_t* nd = needs.data_ptr<int32_t>();
  int8_t* o = out.data_ptr<int8_t>();
  int32_t* so = sh.data_ptr<int32_t>();
  // slice 0 sits in slot 0 (x) or slot S-1 (w, reversed); consecutive slices one Kc apart
  const int64_t slot0 = reverse ? S - 1 : 0, step = reverse ? -Kc : Kc;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.scalar_type(), "make_slices_cpu", [&] {
    const scalar_t* p = a.data_ptr<scalar_t>();
    at::parallel_for(0, R, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const int need = nd[2 * r + 1];
        if (need == 0 || need > S) continue;  // zero row, or left to the long-accumulator kernel
        const int s = int(bits * S) - 3 - nd[2 * r];
        so[r] = s;
        const double scale = std::ldexp(1.0, s);  // v * 2^s is exact: an integer below 2^62
        for (int64_t c = 0; c < nch; ++c) {
          int8_t* base = o + r * width + (c * S + slot0) * Kc;
          for (int64_t k = c * Kc, kk = 0; k < std::min(K, (c + 1) * Kc); ++k, ++kk)
            slice_integer(int64_t(static_cast<double>(p[r * K + k]) * scale), int(S), int(bits), base + kk, step);
        }
      }
    });
  });
  return {out, sh};
}

at::Tensor combine_cpu(const at::Tensor& C, int64_t M, int64_t Nv, const at::Tensor& shx, const at::Tensor& shw,
                       const at::Tensor& bias, int64_t D, int64_t bits, bool wide, bool digits,
                       at::ScalarType out_dtype) {
  const int64_t P = C.size(0), Mp = C.size(1), Ncp = C.size(2);
  const int fmt = out_format(out_dtype);
  at::Tensor out = digits ? at::empty({M, Nv, LDET_WORDS}, C.options().dtype(at::kLong))
                          : at::empty({M, Nv}, C.options().dtype(out_dtype));
  const int32_t* c = C.data_ptr<int32_t>();
  const int32_t* sx = shx.data_ptr<int32_t>();
  const int32_t* sw = shw.data_ptr<int32_t>();
  const double* bp = bias.defined() ? bias.data_ptr<double>() : nullptr;
  void* o = out.data_ptr();
  at::parallel_for(0, M, 8, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) {
      for (int64_t n = 0; n < Nv; ++n) {
        const int32_t* cp = c + m * Ncp + n;
        const int E = -(sx[m] + sw[n]);
        const double* bn = bp ? bp + n : nullptr;
        if (digits) {
          combine_output(cp, Mp * Ncp, int(P), int(D), int(bits), E, bn, wide, fmt, nullptr,
                         static_cast<int64_t*>(o) + (m * Nv + n) * LDET_WORDS);
        } else {
          float v;
          combine_output(cp, Mp * Ncp, int(P), int(D), int(bits), E, bn, wide, fmt, &v, nullptr);
          store_fmt(o, m * Nv + n, v, fmt);
        }
      }
    }
  });
  return out;
}

// 8-bit digits need the int8 GEMM to keep every int32 sum exact. Without VNNI, an int8 GEMM may
// add u8 x s8 pairs in saturating 16-bit lanes (oneDNN documents this for AVX2): 7-bit digits
// keep such pairs below 2^15. Ask the GEMM itself once, with the largest magnitudes.
int probe_bits() {
  // LIGHTNING_DET_SLICE_BITS=7 forces the 7-bit digits (tests run that branch on VNNI machines too).
  if (const char* env = std::getenv("LIGHTNING_DET_SLICE_BITS")) {
    TORCH_CHECK(std::string(env) == "7" || std::string(env) == "8",
                "LIGHTNING_DET_SLICE_BITS: expected 7 or 8, got ", env);
    if (std::string(env) == "7") return 7;
  }
  const int64_t M = 32, K = 256, N = 32;
  at::Tensor a = at::full({M, K}, 127, at::kChar), b = at::full({K, N}, 127, at::kChar);
  a.narrow(0, 0, 8).fill_(-128);
  b.narrow(1, 0, 8).fill_(-128);
  const at::Tensor got = at::_int_mm(a, b).to(at::kLong);
  const at::Tensor want = at::mm(a.to(at::kLong), b.to(at::kLong));
  return at::equal(got, want) ? 8 : 7;
}

}  // namespace

const SliceBackend& slice_backend_cpu() {
  static const SliceBackend be{&row_needs_cpu, &make_slices_cpu, &combine_cpu, probe_bits(),
                               // 16-bit inputs: the kernel stays faster at every size measured
                               // (512^3 bf16: 8.6 ms against 16.6 ms), so never in auto mode
                               int64_t(1) << 15, std::numeric_limits<int64_t>::max()};
  return be;
}

}  // namespace ldet

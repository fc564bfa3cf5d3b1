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
#include <array>
#include <limits>
#include <cstdlib>
#include <string>
#include <functional>
#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <utility>

#include "crt.h"
#include "int_slices.h"
#include "scratch_pool.h"
#include "uninit.h"

namespace ldet {

// Path switch (ldet::set_gemm_path, lightning_det.ops.gemm_path): which exact route gemm takes.
// kPathSlices: the slices, with the backend's choice between diagonals and the CRT route (crt.h);
// kPathSlicesDiagonals / kPathSlicesCrt force one of them (CRT where the backend has
// it and the moduli cover the products; else the diagonals). kPathFp64: rounded outputs through the
// fp64 route (csrc/fp64_bound_host.h) whatever their size and dtypes; digits as in auto mode.
enum GemmPath {
  kPathAuto = 0,
  kPathKernel = 1,
  kPathSlices = 2,
  kPathSlicesDiagonals = 3,
  kPathSlicesCrt = 4,
  kPathFp64 = 5
};
int gemm_path();  // csrc/schema/gemm.cpp

// A row-major (unit column stride) fp32 / bf16 / fp16 operand as the kernels read it (int_slices.h).
inline Elems elems_of(const at::Tensor& a) {
  const auto st = a.scalar_type();
  return Elems{a.data_ptr(), st == at::kFloat ? kElemF32 : st == at::kBFloat16 ? kElemBF16 : kElemF16, a.stride(0)};
}

// One operand's slices and what the combine needs of it (rows narrowed for an N-chunk of w).
struct SliceOperand {
  at::Tensor a;        // the operand (R, K) as given: the combine reads it back for residue terms
  at::Tensor q;        // int8 (Rp, nch * S * Kc): the slices (SliceBackend::make_slices)
  at::Tensor sh;       // int32 (R,): the row scales sh_r
  // Residues (undefined when the operand has none at its S): int32 (R,) count, (R, kResidueCap)
  // columns, fp64 (R, kResidueCap) values, int32 (R,) F (bits below the window).
  at::Tensor rcount, ridx, rval, F;
  SliceOperand rows(int64_t r0, int64_t n) const {
    if (r0 == 0 && n == a.size(0)) return *this;  // one N-chunk: no views to build (host time)
    SliceOperand o{a.narrow(0, r0, n), at::Tensor(), sh.narrow(0, r0, n), {}, {}, {}, {}};
    if (rcount.defined()) {
      o.rcount = rcount.narrow(0, r0, n);
      o.ridx = ridx.narrow(0, r0, n);
      o.rval = rval.narrow(0, r0, n);
      o.F = F.narrow(0, r0, n);
    }
    return o;
  }
};

// A SliceOperand's buffers for operand a: slices (Rp, width), scales and, when `residues`, the
// residue lists (counts zeroed). zero_fill: zeros in sh and F where the slicing kernel writes only
// live rows; zero_slices: in q too (the CPU's kernel zeroes q a row at a time instead, where the
// row is in cache: one pass over the planes fewer).
inline SliceOperand new_slice_operand(const at::Tensor& a, int64_t Rp, int64_t width, bool residues, bool zero_fill,
                                      bool zero_slices) {
  const int64_t R = a.size(0);
  auto make = [&](at::IntArrayRef size, at::ScalarType t, bool zeros) {
    // uninit: the CUDA slicing kernel writes every element of q, sh and F (zeros for padding and
    // rows it leaves)
    return zeros ? at::zeros(size, a.options().dtype(t)) : uninit(size, a.options().dtype(t));
  };
  // q: kept between calls on the CPU (scratch_pool.h), whose kernel writes every byte of it
  at::Tensor q = zero_slices ? at::zeros({Rp, width}, a.options().dtype(at::kChar))
                             : pooled_uninit({Rp, width}, a.options().dtype(at::kChar));
  SliceOperand so{a, q, make({R}, at::kInt, zero_fill), {}, {}, {}, {}};
  if (residues) {
    so.rcount = at::zeros({R}, a.options().dtype(at::kInt));
    // read only below their row's count
    so.ridx = uninit({R, kResidueCap}, a.options().dtype(at::kInt));
    so.rval = uninit({R, kResidueCap}, a.options().dtype(at::kDouble));
    so.F = make({R}, at::kInt, zero_fill);
  }
  return so;
}

// The combine's proof that its 128-bit sum cannot overflow, when the host could not decide it
// before slicing (a guessed plan): the backend evaluates slices_wide on both operands' summaries
// where they are (int_slices.h). sums == nullptr: the host's `wide` stands.
struct WideCheck {
  const int32_t* sums;  // x's summary, then w's (2 kSumLen int32, on the operands' device)
  int Sx, Sw;
  int64_t nch, Kc;
};

// Both operands' summaries on their way to the host without a synchronization (a guessed plan
// reads them at the GEMM's next call with the same shapes): `host` is valid once ready().
struct PendingSummary {
  at::Tensor host;
  virtual bool ready() = 0;
  virtual ~PendingSummary() = default;
};

// c (m, n) int32 with row stride ldc = a (m, k) . b (n, k)^T, a and b int8 row-major with row
// strides lda, ldb (unit column stride). Raw pointers into the slices and diagonals: a slice GEMM
// makes 9-27 of these, and three tensor views for each were most of its host-side aten ops (in a
// det_ddp step bound by its host time).
struct Int8Gemm {
  const int8_t* a;
  int64_t lda;
  const int8_t* b;
  int64_t ldb;
  int32_t* c;
  int64_t ldc;
  int64_t m, n, k;
};

// at::_int_mm_out on views of g's operands: the CPU's int8 GEMM (oneDNN), and CUDA's
// LIGHTNING_DET_INT8_GEMM=torch route.
inline void int8_mm_aten(const Int8Gemm& g, const at::Device& device) {
  const auto opt = at::TensorOptions().dtype(at::kChar).device(device);
  const at::Tensor a = at::from_blob(const_cast<int8_t*>(g.a), {g.m, g.k}, {g.lda, 1}, opt);
  const at::Tensor b = at::from_blob(const_cast<int8_t*>(g.b), {g.n, g.k}, {g.ldb, 1}, opt);
  at::Tensor out = at::from_blob(g.c, {g.m, g.n}, {g.ldc, 1}, opt.dtype(at::kInt));
  at::_int_mm_out(out, a, b.t());
}

struct SliceBackend {
  // Per row (R, 3) int32: the exponent of its largest |value|, the slices it needs (residues
  // allowed: int_slices.h, row_plan; kSliceNeedBad for a row holding inf/NaN or that no S holds,
  // 0 for an all-zero row) and its lowest set bit. Adds the operand's summary into `sum`
  // ((kSumLen,) int32, zeroed by the caller).
  at::Tensor (*row_needs)(const at::Tensor& a, int64_t bits, at::Tensor& sum);
  // The slices at S: int8 (Rp, nch * S * Kc): for chunk c and slice s (slot s, or S-1-s when
  // reverse) the columns [(c*S + slot) * Kc, +Kc) hold slice s of a[:, c*Kc : (c+1)*Kc]'s window
  // parts; zero padding and zero rows for rows needing more than S. Also the scales and, when
  // `residues`, the residue lists (SliceOperand). left: undefined, or (R + 1,) int32 zeros that
  // receive the rows needing more than S (left[0] their count, left[1..] the rows, any order).
  // moduli > 0 (the CRT route, crt.h; nch == 1): int8 (Rp, moduli * Kc) instead, columns
  // [t * Kc, +Kc) holding the symmetric remainders of the window integers modulo crt_table(bits).m[t].
  SliceOperand (*make_slices)(const at::Tensor& a, const at::Tensor& needs, int64_t S, int64_t bits, bool reverse,
                              int64_t Kc, int64_t nch, int64_t Rp, bool residues, const at::Tensor& left,
                              int64_t moduli);
  // Rounded (M, Nv) of out_dtype, or digits (M, Nv, 19), from C (nch * D, Mp, Ncp) int32 and
  // both operands' residues (w's narrowed to the chunk's Nv rows). `wide`, or check.sums: the
  // 128-bit route's proof (WideCheck). moduli > 0: C is (moduli, Mp, Ncp), the remainder sums.
  // Written into dst when defined (combine_output's view of the whole output: an N-chunk's
  // columns), else into a new tensor; returns it.
  at::Tensor (*combine)(const at::Tensor& C, int64_t M, int64_t Nv, const SliceOperand& x, const SliceOperand& w,
                        const at::Tensor& bias, int64_t D, int64_t bits, bool wide, const WideCheck& check,
                        bool digits, at::ScalarType out_dtype, int64_t moduli, const at::Tensor& dst);
  // One int8 GEMM (Int8Gemm) on `device`, exact in int32.
  void (*int8_mm)(const Int8Gemm& g, const at::Device& device);
  // Overwrites the outputs of the rows listed in `left` (make_slices' list: x's rows when x_rows,
  // else w's, i.e. output columns) with exact_output's: out (M, N) of out_dtype or digits
  // (M, N, 19); bias fp64 (N,) or undefined.
  void (*exact_rows)(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                     const at::Tensor& left, bool x_rows, bool digits, at::ScalarType out_dtype);
  // Both summaries (2 kSumLen int32) copied toward the host without waiting for them.
  std::shared_ptr<PendingSummary> (*summary_later)(const at::Tensor& sums);
  int bits;          // digit width: 8, or 7 where the int8 GEMM could saturate 16-bit pair sums
  // Auto mode: M*N*K from which the slices beat the long-accumulator kernel, when an input is
  // fp32 (the kernel then splits it into four products) and when both are bf16 / fp16, as
  // benchmarks/gemm.py measures the two routes on each device.
  int64_t min_work_fp32;
  int64_t min_work_16bit;
  // Cost of one residue term of the combine in int8 multiply-adds of the GEMMs: the host weighs
  // a slice fewer against the residues it leaves.
  double term_macs;
  // chunk_columns' rule for the int8 GEMM library: 0, or the most outputs a chunk may hold.
  int64_t chunk_max_outputs;
  // Whether slice GEMMs plan from cached guesses when a call asks for the default (plans (-1, -1)).
  bool guess_by_default;
  // The CRT route (crt.h): whether make_slices / combine take moduli > 0, and the cost of one
  // output's reconstruction per modulus, in int8 multiply-adds (the auto choice weighs Q GEMMs
  // plus that against Sx * Sw GEMMs; infinity: only where a path forces it).
  bool crt_route;
  double crt_output_macs;
};

// The plan of the last GEMM this thread ran on the slices: Sx, Sw, x's and w's residues, x's and
// w's rows left to the kernel, and the moduli of the CRT route (0: the diagonals) (tests and
// benchmarks read it: lightning_det.ops.last_slices_plan). A guessed plan (below) records -1 for
// the counts it did not wait for.
std::array<int64_t, 7>& last_slices_plan();

// How a slice GEMM gets its plan, the gemm / gemm_partial ops' plans argument checked
// (csrc/schema/gemm.cpp): {-1, -1} the backend's default, {-2, -2} cached guesses on every device,
// {0, 0} from this call's summaries (one host synchronization), {Sx, Sw} >= 1 that fixed guess
// (tests: guesses too small and too large).
std::array<int64_t, 2> checked_plans(at::IntArrayRef plans);

// Each device's kernels (csrc/cpu/int_slices_cpu.cpp, csrc/cuda/int_slices_cuda.cu).
const SliceBackend& slice_backend_cpu();
const SliceBackend& slice_backend_cuda();

#ifdef LDET_WITH_CUDA
at::Tensor dense_rows_cuda(const at::Tensor& a);  // csrc/cuda/dense_rows_cuda.cu
#endif

// The operand with dense rows: contiguous(), and on the GPU a tiled transpose for the transposed
// views of DetLinear's backward (csrc/cuda/dense_rows_cuda.cu; the same bytes).
inline at::Tensor dense_rows(const at::Tensor& a) {
#ifdef LDET_WITH_CUDA
  if (a.is_cuda()) return dense_rows_cuda(a);
#endif
  return a.contiguous();
}

// A combine's destination: dst when defined, else a new (M, Nv) of out_dtype or digits (M, Nv, 19)
// on C's device (every output written), and its row stride in outputs.
inline at::Tensor combine_output(const at::Tensor& C, int64_t M, int64_t Nv, bool digits, at::ScalarType out_dtype,
                                 const at::Tensor& dst = at::Tensor()) {
  if (dst.defined()) return dst;
  return digits ? uninit({M, Nv, LDET_WORDS}, C.options().dtype(at::kLong)) : uninit({M, Nv}, C.options().dtype(out_dtype));
}
inline int64_t output_row_stride(const at::Tensor& out, bool digits) {
  return digits ? out.stride(0) / LDET_WORDS : out.stride(0);
}

using LongAccGemm = std::function<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&)>;

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// The N-chunk width Nc and the padded column count Np (>= N, a multiple of 8; the last chunk may
// be narrower) for int32 diagonals (P, Mp, Nc) within cap_mib. max_outputs > 0 (CUDA): every chunk
// Nc = 8 (mod 16) wide with Mp * Nc <= max_outputs, padding w's slices with zero rows: cuBLASLt
// then runs its sm90 int8 kernels, where multiples of 16 get its sm80 ones (~0.8x) and wider
// chunks a slow sm80 one (~0.3x), as a scan of the chunk width on Hopper showed.
inline std::pair<int64_t, int64_t> chunk_columns(int64_t N, int64_t Mp, int64_t P, int64_t cap_mib,
                                                 int64_t max_outputs) {
  const int64_t N8 = round_up(N, 8), per_col = std::max<int64_t>(1, P) * Mp * 4;
  const int64_t cap = std::max<int64_t>(8, ((cap_mib << 20) / per_col) / 8 * 8);
  if (max_outputs > 0 && max_outputs / Mp >= 8) {
    const int64_t c8 = (std::min(cap, max_outputs / Mp) - 8) / 16 * 16 + 8;  // the widest = 8 (mod 16)
    const int64_t n_chunks = (N8 + c8 - 1) / c8;
    const int64_t want = std::max<int64_t>(8, (N8 + n_chunks - 1) / n_chunks);
    const int64_t w = round_up(want - 8, 16) + 8;  // <= c8: c8 = 8 (mod 16) and want <= c8
    return {w, w * n_chunks};
  }
  const int64_t n_chunks = (N8 + cap - 1) / cap;
  return {std::min(N8, round_up((N8 + n_chunks - 1) / n_chunks, max_outputs > 0 ? 16 : 8)), N8};
}

// How one GEMM is sliced: slices per operand, the K-chunk and its count, and whether the
// combine's 128-bit sum is proven (else every output takes the long accumulator).
struct SlicePlan {
  int64_t Sx, Sw, Kc, nch;
  bool wide;
};

// The K-chunk for (Sa, Sb) slices: int32 holds a diagonal's sum while pairs * Kc * 2^(2 bits - 2)
// < 2^31. Sets Kc and nch; returns the pairs of the longest diagonal.
inline int64_t slice_k_chunks(int64_t K, int64_t Sa, int64_t Sb, int bits, int64_t* Kc, int64_t* nch) {
  const int64_t pairs = std::max<int64_t>(1, std::min(Sa, Sb));
  const int64_t kc_max = (kSliceIntBound / (pairs << (2 * bits - 2))) / 16 * 16;
  *nch = (round_up(K, 16) + kc_max - 1) / kc_max;
  *Kc = round_up((K + *nch - 1) / *nch, 16);
  return pairs;
}

// The slice counts from both operands' summaries (int_slices.h, kSum*): from each operand's least
// up to kSliceMax, the pair with the least work (int8 multiply-adds plus term_macs per residue
// term) among those whose 128-bit combine is proven.
inline SlicePlan plan_slices(const int32_t* sx, const int32_t* sw, int64_t M, int64_t N, int64_t K, int bits,
                             double term_macs) {
  auto plan_for = [&](int64_t Sa, int64_t Sb) {
    SlicePlan p{Sa, Sb, 0, 0, true};
    slice_k_chunks(K, Sa, Sb, bits, &p.Kc, &p.nch);
    p.wide = slices_wide(sx, sw, int(Sa), int(Sb), p.nch, p.Kc, bits);
    return p;
  };
  const int64_t Sx0 = sx[kSumNeed], Sw0 = sw[kSumNeed];
  SlicePlan best = plan_for(Sx0, Sw0);
  if (Sx0 == 0 || Sw0 == 0) return best;  // an all-zero (or all left-out) operand
  double best_cost = std::numeric_limits<double>::infinity();
  for (int64_t a = Sx0; a <= kSliceMax; ++a) {
    for (int64_t b = Sw0; b <= kSliceMax; ++b) {
      const SlicePlan p = plan_for(a, b);
      const double cost = double(a * b) * double(M) * double(N) * double(K) +
                          term_macs * (double(sx[kSumCount + a - 1]) * double(N) + double(sw[kSumCount + b - 1]) * double(M));
      if ((p.wide && !best.wide) || (p.wide == best.wide && cost < best_cost)) {
        best = p;
        best_cost = cost;
      }
    }
  }
  return best;
}

// Guessed plans. The plan needs both operands' summaries, which live on the device: reading them
// synchronizes the host with the GPU once per GEMM, and the host then cannot queue work ahead.
// A training run repeats its GEMM shapes, so with cached guesses (the plans argument) a later call
// with the same key takes the largest (Sx, Sw) planned from the last few summaries of that key,
// and reads its own summary only at a later call. Not the default anywhere: the det_ddp step is
// host-bound, and dropping its nine synchronizations left its time unchanged;
// they are what a captured or run-ahead step needs first. Whatever the guess, the
// bytes are the same: rows needing more slices than guessed are zero rows in the slices, listed
// on the device, and their outputs recomputed by exact_rows; the 128-bit route's proof is
// checked on the device (WideCheck). A guess too small costs time at that call, one too large
// costs zero slices.
struct GuessKey {
  int64_t M, N, K;
  int x_type, w_type, device_type, device_index;
  bool digits, bias;
  bool operator==(const GuessKey& o) const {
    return M == o.M && N == o.N && K == o.K && x_type == o.x_type && w_type == o.w_type &&
           device_type == o.device_type && device_index == o.device_index && digits == o.digits && bias == o.bias;
  }
};

struct GuessKeyHash {
  size_t operator()(const GuessKey& k) const {
    size_t h = std::hash<int64_t>()(k.M);
    for (int64_t v : {k.N, k.K, int64_t(k.x_type), int64_t(k.w_type), int64_t(k.device_type), int64_t(k.device_index),
                      int64_t(k.digits), int64_t(k.bias)})
      h = h * 1000003u ^ std::hash<int64_t>()(v);
    return h;
  }
};

struct GuessState {
  static constexpr int kRecent = 4;  // one key serves several layers (forward and gradients alike)
  std::array<std::pair<int64_t, int64_t>, kRecent> recent{};
  int n_recent = 0, next = 0;
  bool usable = false;  // false: the last summary asked for the kernel, or none was read yet
  std::shared_ptr<PendingSummary> pending;
  void record(int64_t Sx, int64_t Sw, bool ok) {
    recent[next] = {Sx, Sw};
    next = (next + 1) % kRecent;
    n_recent = std::min(n_recent + 1, kRecent);
    usable = ok && Sx > 0 && Sw > 0;
  }
  std::pair<int64_t, int64_t> guess() const {
    std::pair<int64_t, int64_t> g{0, 0};
    for (int i = 0; i < n_recent; ++i) g = {std::max(g.first, recent[i].first), std::max(g.second, recent[i].second)};
    return g;
  }
};

struct GuessCache {
  std::mutex mu;
  std::unordered_map<GuessKey, GuessState, GuessKeyHash> states;
};

inline GuessCache& guess_cache() {
  // Never destroyed: its pending summaries hold pinned host memory and CUDA events, which must not
  // be freed after the CUDA runtime has shut down at exit (that ended processes with SIGSEGV).
  static GuessCache* cache = new GuessCache;
  return *cache;
}

// The plan from both summaries (host memory), and whether the slices should run at all in auto
// mode (when most rows would be recomputed anyway, the long-accumulator kernel alone is cheaper).
inline SlicePlan plan_from_summaries(const int32_t* sx, const int32_t* sw, int64_t M, int64_t N, int64_t K,
                                     const SliceBackend& be, bool* worth_it) {
  *worth_it = !(2 * int64_t(sx[kSumBad]) > M || 2 * int64_t(sw[kSumBad]) > N);
  return plan_slices(sx, sw, M, N, K, be.bits, be.term_macs);
}

// The CRT route's moduli for this GEMM (crt.h), or 0 for the diagonals: forced by the path,
// else where the backend has the route and Q GEMMs plus the reconstruction cost less than the
// diagonals' Sx * Sw GEMMs.
inline int64_t crt_moduli(const SliceBackend& be, int mode, int64_t M, int64_t N, int64_t K, int64_t Sx,
                          int64_t Sw) {
  if (!be.crt_route || mode == kPathSlicesDiagonals) return 0;
  const int64_t Q = crt_moduli_needed(K, int(Sx), int(Sw), be.bits);
  if (Q == 0 || mode == kPathSlicesCrt) return Q;
  const double mn = double(M) * double(N);
  const double crt_cost = double(Q) * mn * double(K) + be.crt_output_macs * double(Q) * mn;
  return crt_cost < double(Sx * Sw) * mn * double(K) ? Q : 0;
}

inline at::Tensor gemm_int_slices(const at::Tensor& x_in, const at::Tensor& w_in, const c10::optional<at::Tensor>& bias,
                                  bool digits, at::ScalarType out_dtype, const std::array<int64_t, 2>& gm,
                                  const SliceBackend& be, const LongAccGemm& long_acc) {
  // the fp64 route's switch leaves digits (and what it declined) to the auto choice
  const int mode = gemm_path() == kPathFp64 ? kPathAuto : gemm_path();
  if (mode == kPathKernel) return {};
  const int64_t M = x_in.size(0), K = x_in.size(1), N = w_in.size(0);
  if (M == 0 || N == 0 || K == 0) return {};
  if (mode == kPathAuto) {
    const bool fp32 = x_in.scalar_type() == at::kFloat || w_in.scalar_type() == at::kFloat;
    if (double(M) * double(N) * double(K) < double(fp32 ? be.min_work_fp32 : be.min_work_16bit)) return {};
  }
  const at::Tensor x = dense_rows(x_in), w = dense_rows(w_in);
  const int bits = be.bits;

  // The guess, if this call takes one (gm: checked_plans).
  const bool cached = gm[0] == -2 || (gm[0] == -1 && be.guess_by_default);
  int64_t gSx = gm[0] > 0 ? gm[0] : 0, gSw = gm[1] > 0 ? gm[1] : 0;
  GuessState* st = nullptr;
  if (cached) {
    const GuessKey key{M, N, K, int(x.scalar_type()), int(w.scalar_type()), int(x.device().type()),
                       int(x.device().index()), digits, bias.has_value()};
    GuessCache& gc = guess_cache();
    std::lock_guard<std::mutex> lock(gc.mu);
    st = &gc.states[key];  // node-based map: the pointer stays valid
    if (st->pending && st->pending->ready()) {
      const int32_t* hs = st->pending->host.data_ptr<int32_t>();
      bool worth_it;
      const SlicePlan p = plan_from_summaries(hs, hs + kSumLen, M, N, K, be, &worth_it);
      st->record(p.Sx, p.Sw, worth_it);
      st->pending.reset();
    }
    if (st->usable) std::tie(gSx, gSw) = st->guess();
  }
  const bool guessed = gSx > 0 && gSw > 0;

  // One zeroed buffer: both summaries, then (guessed) the lists of rows left to exact_rows.
  const at::Tensor scratch = at::zeros({2 * kSumLen + (guessed ? M + 1 + N + 1 : 0)}, x.options().dtype(at::kInt));
  const at::Tensor sums = scratch.narrow(0, 0, 2 * kSumLen);
  at::Tensor sum_x = sums.narrow(0, 0, kSumLen), sum_w = sums.narrow(0, kSumLen, kSumLen);
  const at::Tensor nx = be.row_needs(x, bits, sum_x);
  const at::Tensor nw = be.row_needs(w, bits, sum_w);

  SlicePlan plan{};
  bool res_x = true, res_w = true;
  int64_t nbad_x = 0, nbad_w = 0;
  at::Tensor left_x, left_w;
  if (guessed) {
    if (st != nullptr) {  // one summary on its way per key at a time
      bool wanted;
      {
        std::lock_guard<std::mutex> lock(guess_cache().mu);
        wanted = !st->pending;
      }
      if (wanted) {
        std::shared_ptr<PendingSummary> later = be.summary_later(sums);
        std::lock_guard<std::mutex> lock(guess_cache().mu);
        if (!st->pending) st->pending = std::move(later);
      }
    }
    plan = SlicePlan{gSx, gSw, 0, 0, false};
    slice_k_chunks(K, gSx, gSw, bits, &plan.Kc, &plan.nch);
    left_x = scratch.narrow(0, 2 * kSumLen, M + 1);
    left_w = scratch.narrow(0, 2 * kSumLen + M + 1, N + 1);
    last_slices_plan() = {gSx, gSw, -1, -1, -1, -1, 0};
  } else {
    // One host synchronization: both operands' summaries (int_slices.h, kSum*).
    const at::Tensor summary = sums.cpu();
    const int32_t* sx = summary.data_ptr<int32_t>();
    const int32_t* sw = sx + kSumLen;
    bool worth_it;
    plan = plan_from_summaries(sx, sw, M, N, K, be, &worth_it);
    if (st != nullptr) {
      std::lock_guard<std::mutex> lock(guess_cache().mu);
      st->record(plan.Sx, plan.Sw, worth_it);
    }
    if (mode == kPathAuto && !worth_it) return {};
    nbad_x = sx[kSumBad];
    nbad_w = sw[kSumBad];
    res_x = plan.Sx > 0 && sx[kSumCount + plan.Sx - 1] > 0;
    res_w = plan.Sw > 0 && sw[kSumCount + plan.Sw - 1] > 0;
    last_slices_plan() = {plan.Sx, plan.Sw, plan.Sx > 0 ? sx[kSumCount + plan.Sx - 1] : 0,
                          plan.Sw > 0 ? sw[kSumCount + plan.Sw - 1] : 0, nbad_x, nbad_w, 0};
  }
  const int64_t Sx = plan.Sx, Sw = plan.Sw;
  const WideCheck check{guessed ? sums.data_ptr<int32_t>() : nullptr, int(Sx), int(Sw), plan.nch, plan.Kc};
  const int64_t Mp = std::max<int64_t>(M, 17);  // cuBLASLt int8: M > 16
  // Diagonals (Sx * Sw GEMMs' multiply-adds, K in nch chunks) or CRT (Q GEMMs of all of K).
  const int64_t Q = crt_moduli(be, mode, M, N, K, Sx, Sw);
  last_slices_plan()[6] = Q;
  const int64_t Kc = Q > 0 ? round_up(K, 16) : plan.Kc, nch = Q > 0 ? 1 : plan.nch;
  const int64_t D = (Sx > 0 && Sw > 0) ? Sx + Sw - 1 : 0, P = Q > 0 ? Q : D * nch;

  // N in chunks so the int32 diagonals stay within ~256 MiB (they live at the training step's peak).
  // LIGHTNING_DET_SLICES_CHUNK_MIB changes the cap (benchmarks: wider GEMMs against memory).
  int64_t cap_mib = 256;
  if (const char* env = std::getenv("LIGHTNING_DET_SLICES_CHUNK_MIB")) cap_mib = std::max<int64_t>(1, std::atoll(env));
  const auto [Nc, Np] = chunk_columns(N, Mp, P, cap_mib, be.chunk_max_outputs);
  // LIGHTNING_DET_SLICES_CONTIGUOUS=1 hands each diagonal's operands to the int8 GEMM as contiguous
  // copies instead of column views (benchmarks: which kernels cuBLASLt then picks; diagonals only).
  const char* contig_env = std::getenv("LIGHTNING_DET_SLICES_CONTIGUOUS");
  const bool contig = contig_env != nullptr && std::string(contig_env) == "1";

  const SliceOperand xo = be.make_slices(x, nx, Sx, bits, false, Kc, nch, Mp, res_x, left_x, Q);
  const SliceOperand wo = be.make_slices(w, nw, Sw, bits, Q == 0, Kc, nch, Np, res_w, left_w, Q);
  const at::Tensor& xs = xo.q;
  const at::Tensor& ws = wo.q;
  at::Tensor bd;
  if (bias.has_value()) bd = bias->to(at::kDouble).contiguous();

  at::Tensor out;
  const int8_t* xq = xs.numel() ? xs.data_ptr<int8_t>() : nullptr;
  const int8_t* wq = ws.numel() ? ws.data_ptr<int8_t>() : nullptr;
  const int64_t ldx = xs.size(1), ldw = ws.size(1);
  for (int64_t n0 = 0; n0 < N; n0 += Nc) {
    const int64_t ncp = std::min(Nc, Np - n0), nv = std::min(Nc, N - n0);
    // each diagonal's GEMM writes all of it; kept between calls on the CPU (scratch_pool.h)
    at::Tensor C = pooled_uninit({P, Mp, ncp}, x.options().dtype(at::kInt));
    int32_t* Cq = C.numel() ? C.data_ptr<int32_t>() : nullptr;
    if (Q > 0) {  // one int8 GEMM per modulus t: its planes at columns t * Kc, its sums at plane t
      // (one strided-batched cuBLASLt call instead ran 2.2x slower: cuBLASLt picks an sm80 kernel)
      for (int64_t t = 0; t < Q; ++t)
        be.int8_mm(Int8Gemm{xq + t * Kc, ldx, wq + n0 * ldw + t * Kc, ldw, Cq + t * Mp * ncp, ncp, Mp, ncp, Kc},
                   x.device());
    } else {  // one int8 GEMM per (K-chunk, diagonal)
      for (int64_t c = 0; c < nch; ++c) {
        for (int64_t d = 0; d < D; ++d) {
          const int64_t i0 = std::max<int64_t>(0, d - (Sw - 1)), i1 = std::min<int64_t>(d, Sx - 1);
          // x slices i0..i1 and w slices d-i0 .. d-i1, whose reversed slots are contiguous too
          const int64_t xcol = (c * Sx + i0) * Kc, wcol = (c * Sw + (Sw - 1 - d + i0)) * Kc;
          const int64_t klen = (i1 - i0 + 1) * Kc, plane = c * D + d;
          Int8Gemm g{xq + xcol, ldx, wq + n0 * ldw + wcol, ldw, Cq + plane * Mp * ncp, ncp, Mp, ncp, klen};
          at::Tensor a_copy, b_copy;  // stream-ordered: they may be freed once the GEMM is queued
          if (contig) {  // the benchmarks' variant: contiguous copies of both operands
            a_copy = xs.narrow(1, xcol, klen).contiguous();
            b_copy = ws.narrow(0, n0, ncp).narrow(1, wcol, klen).contiguous();
            g.a = a_copy.data_ptr<int8_t>();
            g.b = b_copy.data_ptr<int8_t>();
            g.lda = g.ldb = klen;
          }
          be.int8_mm(g, x.device());
        }
      }
    }
    // an N-chunk's outputs straight into their columns (a copy per chunk cost ~50 us at 4096^3)
    if (!out.defined()) out = combine_output(C, M, N, digits, out_dtype);  // every chunk lands
    const bool whole = n0 == 0 && nv == N;  // no views then (host time)
    be.combine(C, M, nv, xo, wo.rows(n0, nv), bd.defined() && !whole ? bd.narrow(0, n0, nv) : bd, D, bits, plan.wide,
               check, digits, out_dtype, Q, whole ? out : out.narrow(1, n0, nv));
  }

  if (guessed) {  // rows needing more slices than guessed: listed on the device, recomputed there
    be.exact_rows(out, x, w, bd, left_x, true, digits, out_dtype);
    be.exact_rows(out, x, w, bd, left_w, false, digits, out_dtype);
    return out;
  }
  // Rows the slices could not hold exactly: the long-accumulator kernel, for those rows alone.
  if (nbad_x > 0) {
    const at::Tensor idx = (nx.select(1, 1) > kSliceMax).nonzero().select(1, 0);
    out.index_copy_(0, idx, long_acc(x.index_select(0, idx), w, bias));
  }
  if (nbad_w > 0) {
    const at::Tensor idx = (nw.select(1, 1) > kSliceMax).nonzero().select(1, 0);
    c10::optional<at::Tensor> bsel;
    if (bias.has_value()) bsel = bias->index_select(0, idx);
    out.index_copy_(1, idx, long_acc(x, w.index_select(0, idx), bsel));
  }
  return out;
}

}  // namespace ldet

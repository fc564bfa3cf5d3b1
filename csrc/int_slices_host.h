// Host side of the integer-slice GEMM (csrc/int_slices.h has the scheme and its proof).
//
// gemm_int_slices() runs a plan whose route is the slices (csrc/gemm_plan.h chooses it), in named
// steps: plan (a guess, or both operands' row summaries and the planner's slices stage), slice,
// multiply and combine (per N-chunk), fix-up. Rows of x (columns of the result) that the slices
// cannot hold exactly are recomputed by the long-accumulator kernel, so the result is always the
// long accumulator's, byte for byte.
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
#include "gemm_plan.h"
#include "int_slices.h"
#include "scratch_pool.h"
#include "uninit.h"

namespace ldet {

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

// A SliceOperand's buffers for operand a: slices (Rp, width), scales and, when rcount (the
// caller's (R,) int32 zeros, SliceRun) is defined, the residue lists counted there. zero_fill: zeros in sh and F where the slicing kernel writes only
// live rows; zero_slices: in q too (the CPU's kernel zeroes q a row at a time instead, where the
// row is in cache: one pass over the planes fewer).
inline SliceOperand new_slice_operand(const at::Tensor& a, int64_t Rp, int64_t width, const at::Tensor& rcount,
                                      bool zero_fill, bool zero_slices) {
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
  if (rcount.defined()) {
    so.rcount = rcount;
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
// reads them at the GEMM's next call with the same shapes; CUDA's kernel probe sends its count
// the same way): `host` is valid once ready().
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
  // rcount is defined ((R,) int32 zeros), the residue lists (SliceOperand). left: undefined, or (R + 1,) int32 zeros that
  // receive the rows needing more than S (left[0] their count, left[1..] the rows, any order).
  // moduli > 0 (the CRT route, crt.h; nch == 1): int8 (Rp, moduli * Kc) instead, columns
  // [t * Kc, +Kc) holding the symmetric remainders of the window integers modulo crt_table(bits).m[t].
  SliceOperand (*make_slices)(const at::Tensor& a, const at::Tensor& needs, int64_t S, int64_t bits, bool reverse,
                              int64_t Kc, int64_t nch, int64_t Rp, const at::Tensor& rcount,
                              const at::Tensor& left, int64_t moduli);
  // Rounded (M, Nv) of out_dtype, or digits (M, Nv, 19), from C (nch * D, Mp, Ncp) int32 and
  // both operands' residues (w's narrowed to the chunk's Nv rows). `wide`, or check.sums: the
  // 128-bit route's proof (WideCheck). moduli > 0: C is (moduli, Mp, Ncp), the remainder sums.
  // Written into dst when defined (combine_output's view of the whole output: an N-chunk's
  // columns), else into a new tensor; returns it. count: null, or an int32 zero on the operands'
  // device the backend may use as a counter (SliceRun::count; the CUDA combine's list of outputs
  // left to its second kernel), saving it a zero-filled allocation.
  at::Tensor (*combine)(const at::Tensor& C, int64_t M, int64_t Nv, const SliceOperand& x, const SliceOperand& w,
                        const at::Tensor& bias, int64_t D, int64_t bits, bool wide, const WideCheck& check,
                        bool digits, at::ScalarType out_dtype, int64_t moduli, const at::Tensor& dst,
                        int32_t* count);
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
  // chunk_columns' rule for the int8 GEMM library (gemm_plan.h): 0, or the most outputs a chunk may hold.
  int64_t chunk_max_outputs;
  // Whether slice GEMMs plan from cached guesses when a call asks for the default (plans (-1, -1)).
  bool guess_by_default;
  // The CRT route (crt.h): whether make_slices / combine take moduli > 0.
  bool crt_route;
  // The cost table's device (gemm_plan.h): the route and the slices' costs are chosen for it.
  GemmDevice device;
};

// The plan of the last GEMM this thread ran on the slices: Sx, Sw, x's and w's residues, x's and
// w's rows left to the kernel, and the moduli of the CRT route (0: the diagonals) (tests and
// benchmarks read it: lightning_det.ops.last_slices_plan). A guessed plan (below) records -1 for
// the counts it did not wait for.
std::array<int64_t, 7>& last_slices_plan();

inline void record_slices_plan(const SlicesPlan& s) {
  last_slices_plan() = {s.slices_x, s.slices_w, s.residues_x, s.residues_w, s.kernel_rows_x, s.kernel_rows_w, s.moduli};
}

// The gemm / gemm_partial ops' options argument [plan_x, plan_w(, route)] checked
// (csrc/schema/gemm.cpp; gemm_plan.h, GemmOptions): a clear error names the bad value.
GemmOptions checked_options(at::IntArrayRef options);

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

// ---------------------------------------------------------------------------------------------
// A slice GEMM in steps: plan (guess or summaries, then gemm_plan.h's slices stage), slice,
// multiply (int8 GEMMs per N-chunk), combine, fix-up (rows the slices could not hold).

// What the plan step hands to the later steps.
// N-chunks whose combine gets a counter from SliceRun's zeroed buffer (later ones allocate their own).
constexpr int64_t kCombineCounts = 8;

struct SliceRun {
  at::Tensor x, w;            // the operands with dense rows
  at::Tensor sums;            // both summaries (2 kSumLen int32, on the operands' device)
  at::Tensor nx, nw;          // per-row needs (SliceBackend::row_needs)
  at::Tensor left_x, left_w;  // guessed plan: the rows needing more slices than guessed
  // int32 zeros, one buffer (slices_summaries): the summaries, then x's and w's residue counts
  // (M and N of them; make_slices), then kCombineCounts counters for the first N-chunks' combine
  at::Tensor zeroed;
  at::Tensor rcount_x() const { return zeroed.narrow(0, 2 * kSumLen, x.size(0)); }
  at::Tensor rcount_w() const { return zeroed.narrow(0, 2 * kSumLen + x.size(0), w.size(0)); }
  int32_t* count(int64_t chunk) const;
  bool res_x = true, res_w = true;  // an operand has residue lists at its slice count
};

inline int32_t* SliceRun::count(int64_t chunk) const {
  if (chunk >= kCombineCounts) return nullptr;
  return zeroed.data_ptr<int32_t>() + 2 * kSumLen + x.size(0) + w.size(0) + chunk;
}

// Plan, part 1: the guess this call takes, if any: a fixed one from the options, or the cache of
// this key's recent plans (which first takes in a summary that has since reached the host).
inline std::pair<int64_t, int64_t> slices_guess(const GemmPlan& plan, const at::Tensor& x, const at::Tensor& w,
                                                bool has_bias, const SliceBackend& be, GuessState** state) {
  const GemmOptions& o = plan.options;
  std::pair<int64_t, int64_t> g{o.plan_x > 0 ? o.plan_x : 0, o.plan_w > 0 ? o.plan_w : 0};
  *state = nullptr;
  if (!(o.plan_x == -2 || (o.plan_x == -1 && be.guess_by_default))) return g;
  const GuessKey key{plan.M, plan.N, plan.K, int(x.scalar_type()), int(w.scalar_type()), int(x.device().type()),
                     int(x.device().index()), plan.digits, has_bias};
  GuessCache& gc = guess_cache();
  std::lock_guard<std::mutex> lock(gc.mu);
  GuessState* st = &gc.states[key];  // node-based map: the pointer stays valid
  if (st->pending && st->pending->ready()) {
    const int32_t* hs = st->pending->host.data_ptr<int32_t>();
    SlicesPlan counts;
    plan_slice_counts(hs, hs + kSumLen, plan.M, plan.N, plan.K, be.bits, slice_costs(be.device).term_macs, &counts);
    st->record(counts.slices_x, counts.slices_w, slices_worth_it(hs, hs + kSumLen, plan.M, plan.N));
    st->pending.reset();
  }
  if (st->usable) g = st->guess();
  *state = st;
  return g;
}

// Plan, part 2: both operands' row needs and summaries. Everything a call needs zeroed is one
// buffer, zeroed in one launch: the summaries, both operands' residue counts, the combine's
// counters, then, for a guessed plan, the lists of rows left to exact_rows.
inline SliceRun slices_summaries(const at::Tensor& x_in, const at::Tensor& w_in, bool guessed, const SliceBackend& be) {
  SliceRun r;
  r.x = dense_rows(x_in);
  r.w = dense_rows(w_in);
  const int64_t M = r.x.size(0), N = r.w.size(0);
  const int64_t head = 2 * kSumLen + M + N + kCombineCounts;
  const at::Tensor scratch = at::zeros({head + (guessed ? M + 1 + N + 1 : 0)}, r.x.options().dtype(at::kInt));
  r.zeroed = scratch;
  r.sums = scratch.narrow(0, 0, 2 * kSumLen);
  at::Tensor sum_x = r.sums.narrow(0, 0, kSumLen), sum_w = r.sums.narrow(0, kSumLen, kSumLen);
  r.nx = be.row_needs(r.x, be.bits, sum_x);
  r.nw = be.row_needs(r.w, be.bits, sum_w);
  if (guessed) {
    r.left_x = scratch.narrow(0, head, M + 1);
    r.left_w = scratch.narrow(0, head + M + 1, N + 1);
  }
  return r;
}

inline SliceTarget slice_target(const SliceBackend& be) {
  SliceTarget t;
  t.bits = be.bits;
  t.crt_available = be.crt_route;
  t.chunk_max_outputs = be.chunk_max_outputs;
  return t;
}

// Plan, part 3: the slices' plan (gemm_plan.h, plan_slices_stage) from the guess, or from the
// summaries read on the host (one synchronization). False: auto sends the call to the fp64 route
// or the kernel.
inline bool slices_plan_step(GemmPlan* plan, SliceRun& r, std::pair<int64_t, int64_t> guess, GuessState* st,
                             const SliceBackend& be) {
  const bool guessed = guess.first > 0 && guess.second > 0;
  if (guessed) {
    if (st != nullptr) {  // one summary on its way per key at a time
      bool wanted;
      {
        std::lock_guard<std::mutex> lock(guess_cache().mu);
        wanted = !st->pending;
      }
      if (wanted) {
        std::shared_ptr<PendingSummary> later = be.summary_later(r.sums);
        std::lock_guard<std::mutex> lock(guess_cache().mu);
        if (!st->pending) st->pending = std::move(later);
      }
    }
    plan_slices_stage(plan, nullptr, nullptr, guess.first, guess.second, slice_target(be));
  } else {
    const at::Tensor summary = r.sums.cpu();
    const int32_t* sx = summary.data_ptr<int32_t>();
    plan_slices_stage(plan, sx, sx + kSumLen, 0, 0, slice_target(be));
    if (st != nullptr) {
      std::lock_guard<std::mutex> lock(guess_cache().mu);
      st->record(plan->slices.slices_x, plan->slices.slices_w, plan->slices.worth_it);
    }
    if (plan->route != GemmRoute::kSlices) return false;
    r.res_x = plan->slices.residues_x > 0;
    r.res_w = plan->slices.residues_w > 0;
  }
  record_slices_plan(plan->slices);
  return true;
}

// Multiply: the int8 GEMMs of one N-chunk (columns [n0, n0 + ncp) of w's slices) into C
// (planes, Mp, ncp): one per CRT modulus, or one per (K-chunk, diagonal of slice pairs).
inline void slices_multiply(const SlicesPlan& s, const at::Tensor& xs, const at::Tensor& ws, int64_t n0, int64_t ncp,
                            at::Tensor& C, const at::Device& device, const SliceBackend& be) {
  const int8_t* xq = xs.numel() ? xs.data_ptr<int8_t>() : nullptr;
  const int8_t* wq = ws.numel() ? ws.data_ptr<int8_t>() : nullptr;
  int32_t* Cq = C.numel() ? C.data_ptr<int32_t>() : nullptr;
  const int64_t ldx = xs.size(1), ldw = ws.size(1), Mp = s.rows_padded, Kc = s.sliced_k_chunk;
  if (s.moduli > 0) {  // one int8 GEMM per modulus t: its planes at columns t * Kc, its sums at plane t
    // (one strided-batched cuBLASLt call instead ran 2.2x slower: cuBLASLt picks an sm80 kernel)
    for (int64_t t = 0; t < s.moduli; ++t)
      be.int8_mm(Int8Gemm{xq + t * Kc, ldx, wq + n0 * ldw + t * Kc, ldw, Cq + t * Mp * ncp, ncp, Mp, ncp, Kc}, device);
    return;
  }
  const int64_t Sx = s.slices_x, Sw = s.slices_w, D = s.diagonals;
  for (int64_t c = 0; c < s.sliced_k_chunks; ++c) {
    for (int64_t d = 0; d < D; ++d) {
      const int64_t i0 = std::max<int64_t>(0, d - (Sw - 1)), i1 = std::min<int64_t>(d, Sx - 1);
      // x slices i0..i1 and w slices d-i0 .. d-i1, whose reversed slots are contiguous too
      const int64_t xcol = (c * Sx + i0) * Kc, wcol = (c * Sw + (Sw - 1 - d + i0)) * Kc;
      const int64_t klen = (i1 - i0 + 1) * Kc, plane = c * D + d;
      Int8Gemm g{xq + xcol, ldx, wq + n0 * ldw + wcol, ldw, Cq + plane * Mp * ncp, ncp, Mp, ncp, klen};
      at::Tensor a_copy, b_copy;  // stream-ordered: they may be freed once the GEMM is queued
      if (gemm_env().slices_contiguous) {  // the benchmarks' variant: contiguous copies of both operands
        a_copy = xs.narrow(1, xcol, klen).contiguous();
        b_copy = ws.narrow(0, n0, ncp).narrow(1, wcol, klen).contiguous();
        g.a = a_copy.data_ptr<int8_t>();
        g.b = b_copy.data_ptr<int8_t>();
        g.lda = g.ldb = klen;
      }
      be.int8_mm(g, device);
    }
  }
}

// Multiply and combine, N-chunk by N-chunk (the int32 planes stay within the chunk's MiB); each
// chunk's outputs go straight into their columns of the result (a copy per chunk cost ~50 us at
// 4096^3).
inline at::Tensor slices_multiply_combine(const GemmPlan& plan, const SliceRun& r, const SliceOperand& xo,
                                          const SliceOperand& wo, const at::Tensor& bd, at::ScalarType out_dtype,
                                          const SliceBackend& be) {
  const SlicesPlan& s = plan.slices;
  const int64_t M = plan.M, N = plan.N, Nc = s.n_chunk, Np = s.n_padded;
  const bool guessed = s.guessed;
  const WideCheck check{guessed ? r.sums.data_ptr<int32_t>() : nullptr, int(s.slices_x), int(s.slices_w), s.k_chunks,
                        s.k_chunk};
  at::Tensor out;
  for (int64_t n0 = 0; n0 < N; n0 += Nc) {
    const int64_t ncp = std::min(Nc, Np - n0), nv = std::min(Nc, N - n0);
    // each plane's GEMM writes all of it; kept between calls on the CPU (scratch_pool.h)
    at::Tensor C = pooled_uninit({s.planes, s.rows_padded, ncp}, r.x.options().dtype(at::kInt));
    slices_multiply(s, xo.q, wo.q, n0, ncp, C, r.x.device(), be);
    if (!out.defined()) out = combine_output(C, M, N, plan.digits, out_dtype);  // every chunk lands
    const bool whole = n0 == 0 && nv == N;  // no views then (host time)
    be.combine(C, M, nv, xo, wo.rows(n0, nv), bd.defined() && !whole ? bd.narrow(0, n0, nv) : bd, s.diagonals, be.bits,
               s.wide, check, plan.digits, out_dtype, s.moduli, whole ? out : out.narrow(1, n0, nv),
               r.count(n0 / Nc));
  }
  return out;
}

// Fix-up: the outputs of rows the slices could not hold exactly. A guessed plan's rows needing
// more slices than guessed were listed on the device and are recomputed there; otherwise the rows
// beyond kSliceMax (or holding inf/NaN) go to the long-accumulator kernel, for those rows alone.
inline void slices_fix_up(const GemmPlan& plan, const SliceRun& r, at::Tensor& out, const at::Tensor& bd,
                          const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype, const SliceBackend& be,
                          const LongAccGemm& long_acc) {
  if (plan.slices.guessed) {
    be.exact_rows(out, r.x, r.w, bd, r.left_x, true, plan.digits, out_dtype);
    be.exact_rows(out, r.x, r.w, bd, r.left_w, false, plan.digits, out_dtype);
    return;
  }
  if (plan.slices.kernel_rows_x > 0) {
    const at::Tensor idx = (r.nx.select(1, 1) > kSliceMax).nonzero().select(1, 0);
    out.index_copy_(0, idx, long_acc(r.x.index_select(0, idx), r.w, bias));
  }
  if (plan.slices.kernel_rows_w > 0) {
    const at::Tensor idx = (r.nw.select(1, 1) > kSliceMax).nonzero().select(1, 0);
    c10::optional<at::Tensor> bsel;
    if (bias.has_value()) bsel = bias->index_select(0, idx);
    out.index_copy_(1, idx, long_acc(r.x, r.w.index_select(0, idx), bsel));
  }
}

// The slices route of a plan whose stage 1 chose it (gemm_plan.h): its steps in order. Returns an
// undefined tensor when the slices' own plan sends the call to the fp64 route or the kernel (auto,
// most rows beyond the slices); *plan then says which. The result is the long accumulator's, byte for byte.
inline at::Tensor gemm_int_slices(GemmPlan* plan, const at::Tensor& x_in, const at::Tensor& w_in,
                                  const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype,
                                  const SliceBackend& be, const LongAccGemm& long_acc) {
  GuessState* st = nullptr;
  const std::pair<int64_t, int64_t> guess = slices_guess(*plan, x_in, w_in, bias.has_value(), be, &st);
  SliceRun r = slices_summaries(x_in, w_in, guess.first > 0 && guess.second > 0, be);
  if (!slices_plan_step(plan, r, guess, st, be)) return {};
  const SlicesPlan& s = plan->slices;
  const SliceOperand xo = be.make_slices(r.x, r.nx, s.slices_x, be.bits, false, s.sliced_k_chunk, s.sliced_k_chunks,
                                         s.rows_padded, r.res_x ? r.rcount_x() : at::Tensor(), r.left_x, s.moduli);
  const SliceOperand wo = be.make_slices(r.w, r.nw, s.slices_w, be.bits, s.moduli == 0, s.sliced_k_chunk,
                                         s.sliced_k_chunks, s.n_padded, r.res_w ? r.rcount_w() : at::Tensor(), r.left_w,
                                         s.moduli);
  at::Tensor bd;
  if (bias.has_value()) bd = bias->to(at::kDouble).contiguous();
  at::Tensor out = slices_multiply_combine(*plan, r, xo, wo, bd, out_dtype, be);
  slices_fix_up(*plan, r, out, bd, bias, out_dtype, be, long_acc);
  return out;
}

}  // namespace ldet

// The one place where an exact GEMM's route is chosen: a pure planner over the call's shape,
// dtypes, device, output kind and explicit options, and its cost model as data.
//
// Every route returns the exact sum (rounded once, or as canonical digits), so a plan changes
// speed only, never bytes. Routes (csrc/gemm_common.h, int_slices_host.h, fp64_bound_host.h):
//   kernel  the long-accumulator kernel (any data, any output);
//   slices  int8 slice GEMMs (csrc/int_slices.h), their products formed per diagonal of slice
//           pairs or per CRT modulus (csrc/crt.h); rows they cannot hold go to the kernel;
//   fp64    rounded outputs from one fp64 GEMM and a proven error bound (csrc/fp64_bound.h);
//           outputs it cannot decide are recomputed (ordered sum, then the long accumulator).
//
// Planning runs in two pure steps:
//   plan_gemm           (M, N, K, dtypes, device, output kind, options) -> GemmPlan: the route;
//   plan_slices_stage   the slices' counts, K-chunks, 128-bit proof, CRT moduli and N-chunks,
//                       from both operands' row summaries (int_slices.h, kSum*): data, measured
//                       on the device by the slicing step; may send the call back to the kernel.
// The execution (csrc/gemm_execute.h) runs the plan; lightning_det.ops.explain_gemm prints it.
//
// Options arrive explicitly per call (GemmOptions: the gemm / gemm_partial ops' `options`
// argument). Environment knobs are read once, at the first GEMM, into GemmEnv (below).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

#include "crt.h"
#include "int_slices.h"

namespace ldet {

// Route forcing (GemmOptions::route; lightning_det.ops route names in brackets): kPathAuto
// ("auto") takes the cost table's cheapest route; kPathKernel ("kernel") the long-accumulator
// kernel only; kPathSlices ("slices") the slices wherever they apply, with the cost model's choice
// between diagonals and CRT; kPathSlicesDiagonals / kPathSlicesCrt ("slices_diagonals" /
// "slices_crt") force one of those (CRT where the backend has it and the moduli cover the
// products, else the diagonals); kPathFp64 ("fp64") rounded outputs through the fp64 route,
// digits outputs as under auto.
enum GemmPath {
  kPathAuto = 0,
  kPathKernel = 1,
  kPathSlices = 2,
  kPathSlicesDiagonals = 3,
  kPathSlicesCrt = 4,
  kPathFp64 = 5
};

// The explicit options of one call: the ops' `options` argument [plan_x, plan_w, route].
// plan_x, plan_w: how a slice GEMM gets its counts: (-1, -1) the backend's default, (-2, -2)
// cached guesses, (0, 0) from this call's summaries, (Sx, Sw) in [1, kSliceMax] that fixed guess.
struct GemmOptions {
  int64_t plan_x = -1;
  int64_t plan_w = -1;
  GemmPath route = kPathAuto;
};

// The options argument checked (2 values: the planning mode, route auto; 3: with the route).
// Throws std::invalid_argument naming the argument and what was expected.
inline GemmOptions parse_gemm_options(const int64_t* v, size_t n) {
  if (n != 2 && n != 3)
    throw std::invalid_argument("options: expected [plan_x, plan_w] or [plan_x, plan_w, route], got " +
                                std::to_string(n) + " integers");
  const int64_t sx = v[0], sw = v[1];
  const bool mode = (sx == sw) && (sx == -1 || sx == -2 || sx == 0);
  const bool fixed = sx >= 1 && sx <= kSliceMax && sw >= 1 && sw <= kSliceMax;
  if (!mode && !fixed)
    throw std::invalid_argument("plans: expected (-1, -1) the default, (-2, -2) cached guesses, (0, 0) no guess, "
                                "or slice counts in [1, " + std::to_string(kSliceMax) + "], got (" +
                                std::to_string(sx) + ", " + std::to_string(sw) + ")");
  GemmOptions o;
  o.plan_x = sx;
  o.plan_w = sw;
  if (n == 3) {
    if (v[2] < kPathAuto || v[2] > kPathFp64)
      throw std::invalid_argument("route: expected 0 (auto), 1 (kernel), 2 (slices), 3 (slices, diagonals), "
                                  "4 (slices, CRT) or 5 (fp64), got " + std::to_string(v[2]));
    o.route = GemmPath(v[2]);
  }
  return o;
}

// The GEMM's environment knobs, read once (the first GEMM of the process) and never again:
//   LIGHTNING_DET_FP64_CHUNK_MIB        fp64 route: MiB of fp64 products D per N-chunk (256)
//   LIGHTNING_DET_SLICES_CHUNK_MIB      slices: MiB of int32 diagonals per N-chunk (256)
//   LIGHTNING_DET_SLICES_CONTIGUOUS=1   slices, diagonals: contiguous operand copies per int8
//                                       GEMM (benchmarks: which cuBLASLt kernels that picks)
//   LIGHTNING_DET_SLICE_BITS=7|8        CPU: 7-bit digits forced (tests; default: probed)
//   LIGHTNING_DET_CRT_SCALAR=1          CPU: the CRT way through crt.h's 32-bit scalar forms
//   LIGHTNING_DET_CRT_VECTOR_UNPROVEN=1 CPU, AVX-512: every CRT vector lane counts as unproven
//   LIGHTNING_DET_INT8_GEMM=torch       CUDA: int8 GEMMs through at::_int_mm, not cuBLASLt
//   LIGHTNING_DET_INT8_GEMM_TUNE=1      CUDA: time cuBLASLt's candidates once per shape
// None changes a byte of any result (tests run each branch). LIGHTNING_DET_FILL_EMPTY
// (csrc/uninit.h) is not a GEMM knob: every op's scratch buffers follow it.
struct GemmEnv {
  int64_t fp64_chunk_mib = 256;
  int64_t slices_chunk_mib = 256;
  bool slices_contiguous = false;
  int slice_bits = 0;  // 0: probe the int8 GEMM (csrc/cpu/int_slices_cpu.cpp)
  bool crt_scalar = false;
  bool crt_vector_unproven = false;
  bool int8_gemm_torch = false;
  bool int8_gemm_tune = false;
};

inline GemmEnv read_gemm_env() {
  auto get = [](const char* name) -> std::string {
    const char* v = std::getenv(name);
    return v == nullptr ? std::string() : std::string(v);
  };
  auto mib = [&](const char* name, int64_t dflt) {
    const std::string v = get(name);
    return v.empty() ? dflt : std::max<int64_t>(1, std::atoll(v.c_str()));
  };
  GemmEnv e;
  e.fp64_chunk_mib = mib("LIGHTNING_DET_FP64_CHUNK_MIB", 256);
  e.slices_chunk_mib = mib("LIGHTNING_DET_SLICES_CHUNK_MIB", 256);
  e.slices_contiguous = get("LIGHTNING_DET_SLICES_CONTIGUOUS") == "1";
  const std::string bits = get("LIGHTNING_DET_SLICE_BITS");
  if (!bits.empty() && bits != "7" && bits != "8")
    throw std::invalid_argument("LIGHTNING_DET_SLICE_BITS: expected 7 or 8, got " + bits);
  e.slice_bits = bits.empty() ? 0 : std::atoi(bits.c_str());
  e.crt_scalar = get("LIGHTNING_DET_CRT_SCALAR") == "1";
  e.crt_vector_unproven = get("LIGHTNING_DET_CRT_VECTOR_UNPROVEN") == "1";
  e.int8_gemm_torch = get("LIGHTNING_DET_INT8_GEMM") == "torch";
  e.int8_gemm_tune = get("LIGHTNING_DET_INT8_GEMM_TUNE") == "1";
  return e;
}

inline const GemmEnv& gemm_env() {
  static const GemmEnv env = read_gemm_env();
  return env;
}

// ---------------------------------------------------------------------------------------------
// The cost model, as data.

// Where the GEMM runs, as far as costs differ: the CPU with or without the AVX-512 vector forms
// of the slices (csrc/cpu/*_vector.h), and CUDA.
enum class GemmDevice { kCpu = 0, kCpuAvx512 = 1, kCuda = 2 };
// kFp32: an fp32 operand (the kernel then splits it into four products); k16Bit: both bf16/fp16.
enum class InputClass { kFp32 = 0, k16Bit = 1 };
enum class GemmRoute { kKernel = 0, kSlices = 1, kFp64 = 2 };

constexpr double kNoFigure = std::numeric_limits<double>::infinity();  // not an auto candidate

// One shape class of one device and input class: M N K >= 2^from_log2_work (up to the next
// row's). Costs: time relative to torch.mm fp32 on the same shape (1 / the benchmark's
// ratio_vs_fp32_mm in the results file that `source` names). kNoFigure: never chosen by auto
// there (fp64 also needs rounded outputs). Auto takes the least cost; a tie goes to the earlier
// route (kernel, slices, fp64). The rows of one (device, inputs) are in increasing from_log2_work.
struct CostRow {
  GemmDevice device;
  InputClass inputs;
  int from_log2_work;
  double kernel, slices, fp64;
  const char* source;
};

// The CPU without the AVX-512 forms: benchmarks/results/cpu-gemm_routes.json (2 threads, idle,
// routes interleaved per round), 1 / ratio_vs_fp32_mm, medians over 8^3-32^3, 64^3-256^3 and
// 512^3. The slices' int8 GEMMs there run at a fraction of the VNNI machine's (0.005-0.12x
// torch.mm fp32), so rounded fp32 outputs take the fp64 route and 16-bit inputs the kernel.
inline constexpr const char* kCpuRoutesSource = "cpu-gemm_routes.json (no AVX-512)";
// With the AVX-512 forms: the slices from benchmarks/results/cpu-gemm.json (fp32 and bf16 at
// 512^3, a VNNI machine); the kernel and the fp64 route from cpu-gemm_routes.json, measured
// without AVX-512 (neither has AVX-512 forms of its own; the fp64 GEMM is the BLAS's, so the
// figure is a bound from above). Below 512^3 the slices' figure is not measured there.
inline constexpr const char* kCpuAvx512Source = "slices: cpu-gemm.json 512^3; kernel, fp64: cpu-gemm_routes.json";

// clang-format off
inline constexpr CostRow kCostTable[] = {
  // CPU, 2 threads.
  {GemmDevice::kCpu, InputClass::kFp32, 0, 14.1, 8.7, 4.3, kCpuRoutesSource},
  {GemmDevice::kCpu, InputClass::kFp32, 18, 21.0, 133, 5.4, kCpuRoutesSource},
  {GemmDevice::kCpu, InputClass::kFp32, 27, 20.5, 192, 2.84, kCpuRoutesSource},
  {GemmDevice::kCpu, InputClass::k16Bit, 0, 5.4, 7.4, 5.7, kCpuRoutesSource},
  {GemmDevice::kCpu, InputClass::k16Bit, 18, 4.85, 73.5, 10.7, kCpuRoutesSource},
  {GemmDevice::kCpu, InputClass::k16Bit, 27, 3.7, 159, 6.6, kCpuRoutesSource},
  {GemmDevice::kCpuAvx512, InputClass::kFp32, 0, 14.1, kNoFigure, 4.3, kCpuAvx512Source},
  {GemmDevice::kCpuAvx512, InputClass::kFp32, 18, 21.0, kNoFigure, 5.4, kCpuAvx512Source},
  {GemmDevice::kCpuAvx512, InputClass::kFp32, 27, 25.6, 3.05, 2.84, kCpuAvx512Source},
  {GemmDevice::kCpuAvx512, InputClass::k16Bit, 0, 1.0, 1.0, kNoFigure, "bf16 128^3 ms: a tie"},
  {GemmDevice::kCpuAvx512, InputClass::k16Bit, 21, 3.94, 2.04, kNoFigure, "cpu-gemm.json bf16 512^3"},
  // CUDA, one H200 or H100 (cuBLASLt int8 and fp64).
  {GemmDevice::kCuda, InputClass::kFp32, 0, 10.9, 6.7, 3.15, "h100-gemm_routes.json fp32 16^3, 32^3 normal"},
  {GemmDevice::kCuda, InputClass::kFp32, 18, 23.3, 12.0, 5.00, "h200-gemm_small.json fp32 64^3 normal"},
  {GemmDevice::kCuda, InputClass::kFp32, 24, 21.7, 10.4, 5.52, "h200-gemm_small.json fp32 256^3 normal"},
  {GemmDevice::kCuda, InputClass::kFp32, 30, 24.4, 4.98, 2.15, "h200-gemm_small.json fp32 1024^3 normal"},
  {GemmDevice::kCuda, InputClass::kFp32, 36, 7.41, 1.54, 1.28, "h200-gemm.json fp32 4096^3 normal"},
  {GemmDevice::kCuda, InputClass::k16Bit, 0, 1.74, 7.62, 4.44, "h200-gemm_small.json bf16 64^3 normal"},
  {GemmDevice::kCuda, InputClass::k16Bit, 24, 2.99, 9.84, 4.01, "h200-gemm_small.json bf16 256^3 normal"},
  {GemmDevice::kCuda, InputClass::k16Bit, 30, 4.54, 4.30, 2.48, "h200-gemm_small.json bf16 1024^3 normal"},
  {GemmDevice::kCuda, InputClass::k16Bit, 32, 4.07, 1.87, 2.22, "h100-gemm_routes.json bf16 8192x768x768"},
  {GemmDevice::kCuda, InputClass::k16Bit, 34, 1.75, 0.77, 1.57, "h200-gemm.json bf16 4096^3 normal"},
};
// clang-format on

// CUDA calls with 16-bit inputs whose rounded outputs are 16-bit too (a bf16 step's forward and
// dgrad), K <= max_k, M N K >= 2^from_log2_work: these rows come before kCostTable's. The fp64
// route's undecided outputs are far fewer at a bf16/fp16 rounding than at an fp32 one, and its
// cost does not grow with K the way the slices' fixed costs shrink: with bf16 outputs it beat the
// slices on every GPT-2-small forward and dgrad shape (K 768-3072: 0.78-1.01x `torch.mm` fp32
// against 0.64-0.99x) and on 1024^3-2048^3, and lost from K = 4096 (4096^3: 1.06 against 1.32;
// K 8192 and 32768: 1.00-1.01 against 1.18-1.30), h100-gemm_routes.json --out-dtype inputs.
struct Round16Row {
  GemmDevice device;
  int from_log2_work;
  int64_t max_k;
  double kernel, slices, fp64;
  const char* source;
};

inline constexpr Round16Row kRound16Table[] = {
  {GemmDevice::kCuda, 30, 3072, 8.0, 1.57, 1.29, "h100-gemm_routes.json bf16 8192x768x768, bf16 outputs"},
};

// The slices' own cost figures per device, in int8 multiply-adds of the slice GEMMs:
// term_macs, one residue term of the combine (the slice counts weigh a slice fewer against the
// residues it leaves); crt_output_macs, one output's CRT reconstruction per modulus beyond the
// diagonals' combine (kNoFigure: the CRT way only where a route forces it).
struct SliceCosts {
  GemmDevice device;
  double term_macs, crt_output_macs;
  const char* source;
};

inline constexpr SliceCosts kSliceCostTable[] = {
  // a residue term ~2 ns on one core against ~300 G int8 multiply-adds a second on two. The
  // fp64 loops' CRT: fp32 at 0.71-0.78 of the diagonals for K >= 256, 0.94 at K = 64; bf16 at 7
  // moduli for 9 pairs 0.95-1.13: 150.
  {GemmDevice::kCpu, 2000.0, 150.0, "CPU without the AVX-512 forms"},
  // the AVX-512 CRT forms took 0.26-0.45 of the diagonals' time on every shape measured: fewer
  // GEMMs decide
  {GemmDevice::kCpuAvx512, 2000.0, 0.0, "CPU with the AVX-512 forms"},
  // a residue term ~10 instructions, scattered reads, against ~10^15 int8 multiply-adds a
  // second; CRT at 4096^3 ties the diagonals on fp32 and is slower on bf16 (8 moduli for 9 pairs)
  {GemmDevice::kCuda, 10000.0, kNoFigure, "H200, cuBLASLt"},
};

inline const SliceCosts& slice_costs(GemmDevice d) {
  for (const SliceCosts& c : kSliceCostTable)
    if (c.device == d) return c;
  return kSliceCostTable[0];
}

// The table row of (device, inputs) for M N K = work.
inline const CostRow* cost_row(GemmDevice d, InputClass in, double work) {
  const CostRow* best = nullptr;
  for (const CostRow& r : kCostTable)
    if (r.device == d && r.inputs == in && work >= std::ldexp(1.0, r.from_log2_work)) best = &r;
  return best;
}

// The kRound16Table row of a device for M N K = work and this K, or null.
inline const Round16Row* round16_row(GemmDevice d, double work, int64_t K) {
  const Round16Row* best = nullptr;
  for (const Round16Row& r : kRound16Table)
    if (r.device == d && K <= r.max_k && work >= std::ldexp(1.0, r.from_log2_work)) best = &r;
  return best;
}

// ---------------------------------------------------------------------------------------------
// The plan.

inline const char* route_name(GemmRoute r) {
  return r == GemmRoute::kKernel ? "kernel" : r == GemmRoute::kSlices ? "slices" : "fp64";
}
inline const char* device_name(GemmDevice d) {
  return d == GemmDevice::kCpu ? "cpu" : d == GemmDevice::kCpuAvx512 ? "cpu-avx512" : "cuda";
}

// The long-accumulator kernel's tiling (csrc/cpu/gemm_cpu.cpp, csrc/cuda/gemm_cuda.cu): output
// tile and K-block. Fixed per device; in the plan so that it can be printed.
struct KernelTiles {
  int tile_m, tile_n, k_block;
};
constexpr KernelTiles kernel_tiles(GemmDevice d) {
  return d == GemmDevice::kCuda ? KernelTiles{64, 64, 32} : KernelTiles{6, 8, 32};
}

// The slices' plan, from both operands' summaries (plan_slices_stage).
struct SlicesPlan {
  bool planned = false;      // the stage ran (the route reached the slices)
  bool guessed = false;      // counts from a guess (options or cache), not this call's summaries
  int64_t slices_x = 0, slices_w = 0;
  int64_t k_chunk = 0, k_chunks = 0;  // Kc, nch: int32 holds a diagonal's sum over a K-chunk
  // (and the 128-bit proof counts on them); the slices' layout: the same, or for the CRT way
  // all of K (rounded up to 16) in one chunk
  int64_t sliced_k_chunk = 0, sliced_k_chunks = 0;
  bool wide = false;         // the combine's 128-bit sum is proven (else checked on the device)
  int64_t residues_x = 0, residues_w = 0;        // values kept out of the digits (-1: not read)
  int64_t kernel_rows_x = 0, kernel_rows_w = 0;  // rows left to the long-accumulator kernel
  int64_t moduli = 0;        // CRT moduli; 0: one int8 GEMM per (K-chunk, diagonal)
  int64_t diagonals = 0;     // Sx + Sw - 1
  int64_t planes = 0;        // int32 planes per N-chunk: moduli, or diagonals x K-chunks
  int64_t rows_padded = 0;   // Mp: cuBLASLt's int8 GEMM needs M > 16
  int64_t n_chunk = 0, n_padded = 0;  // N-chunk width and the padded column count
  bool worth_it = true;      // auto: false when most rows would be recomputed anyway
  std::string counts_reason, way_reason;
};

struct GemmPlan {
  // What was planned for.
  int64_t M = 0, N = 0, K = 0;
  InputClass inputs = InputClass::kFp32;
  bool digits = false;  // canonical digits out (gemm_partial), else rounded
  bool out16 = false;   // rounded to bf16 / fp16 (else to fp32, or digits)
  GemmDevice device = GemmDevice::kCpu;
  GemmOptions options;
  // The route and why.
  GemmRoute route = GemmRoute::kKernel;
  std::string route_reason;
  // The cost table's figures for this call's class (kNoFigure: none), and the row's source.
  double cost_kernel = kNoFigure, cost_slices = kNoFigure, cost_fp64 = kNoFigure;
  const char* cost_source = "";
  // What handles what the route cannot: a short description.
  std::string fallback;
  KernelTiles tiles{0, 0, 0};
  bool fp32_split = false;  // the kernel runs fp32 inputs as four 2^17-scaled segments (split.h)
  int64_t fp64_n_chunk = 0;  // fp64 route: columns per fp64 GEMM (products within the chunk MiB)
  bool auto_route = false;   // the route is the cost table's choice (no route was forced)
  bool fp64_ok = false;      // the fp64 route can run this call (rounded outputs, K <= 2^33)
  // Auto's kernel on a device that probes the operands first (plan_kernel_stage): the share of
  // the kernel's (tile, K-block) steps that miss its fast path; -1 when not probed.
  double kernel_slow_share = -1;
  // The slices ran as C^T = w x^T (slices_transposed_for), their result transposed back; the
  // slices' fields below stay named by x and w, their chunks (n_chunk) cut x's rows.
  bool slices_transposed = false;
  SlicesPlan slices;
};

// Wide exponent spread. The kernel's cost grows with it: a K-block of a tile whose row and column
// spreads together exceed LDET_FAST_SPREAD goes product by product through the exact path, about
// 75x a fast block on the CPU (bf16, e uniform in [-40, 40], 512^3: 1.14 s against 15 ms on normal
// data), and on the GPU 0.003x torch.mm fp32 at 1024^3 against 0.22x on normal data
// (h200-gemm_small.json). The fp64 route's cost does not depend on the spread (0.37-0.40x there;
// on normal data it takes 1.1-2.2x the kernel's time on the CPU, 0.55-2.5x on the GPU,
// kCostTable). Auto hands a rounded call to the fp64 route when more than this share s of the
// kernel's steps would be slow. Below it the kernel takes at most 1 + 74 s = 2.16x its time on
// normal data, within 2x of the fp64 route's 1.1x or more on the CPU.
constexpr double kKernelSlowShare = 1.0 / 64;

// Sends an auto plan to the fp64 route, with the reason appended.
// The fp64 route's columns per fp64 GEMM: its (M, nc) fp64 products within the chunk MiB.
inline int64_t fp64_n_chunk(int64_t M, int64_t N) {
  const int64_t cap = gemm_env().fp64_chunk_mib;
  return std::min<int64_t>(N, std::max<int64_t>(8, ((cap << 20) / (8 * std::max<int64_t>(M, 1))) / 8 * 8));
}

inline void take_fp64_route(GemmPlan* p, const std::string& why) {
  p->route = GemmRoute::kFp64;
  p->route_reason += why;
  p->fp64_n_chunk = fp64_n_chunk(p->M, p->N);
  p->fallback = "outputs the bound cannot decide: ordered fp64 sum, then the long accumulator";
}

// Stage 2 of auto's kernel choice where the backend probes the operands (gemm_execute.h,
// KernelProbe; slow_share -1: not probed): with more than kKernelSlowShare of the kernel's steps
// off its fast path, a rounded call takes the fp64 route.
inline void plan_kernel_stage(GemmPlan* p, double slow_share) {
  p->kernel_slow_share = slow_share;
  if (p->route != GemmRoute::kKernel || !p->auto_route || !p->fp64_ok || slow_share <= kKernelSlowShare) return;
  char share[32];
  std::snprintf(share, sizeof share, "%.3g", slow_share);
  take_fp64_route(p, std::string("; then the fp64 route: ") + share +
                         " of the kernel's tile K-blocks miss its fast path (wide exponent spread)");
}

// Stage 1: the route from the call's shape, dtypes, device, output kind and options.
// allow_fast: false for the tests' normalization-interval calls (the kernel's own headroom path).
inline GemmPlan plan_gemm(int64_t M, int64_t N, int64_t K, bool x_fp32, bool w_fp32, GemmDevice device, bool digits,
                          bool out16, const GemmOptions& opt, bool allow_fast = true) {
  GemmPlan p;
  p.M = M;
  p.N = N;
  p.K = K;
  p.inputs = (x_fp32 || w_fp32) ? InputClass::kFp32 : InputClass::k16Bit;
  p.digits = digits;
  p.out16 = out16 && !digits;
  p.device = device;
  p.options = opt;
  p.tiles = kernel_tiles(device);
  p.fp32_split = p.inputs == InputClass::kFp32;
  const double work = double(M) * double(N) * double(K);
  if (const Round16Row* r = p.out16 && p.inputs == InputClass::k16Bit ? round16_row(device, work, K) : nullptr) {
    p.cost_kernel = r->kernel;
    p.cost_slices = r->slices;
    p.cost_fp64 = r->fp64;
    p.cost_source = r->source;
  } else if (const CostRow* r = cost_row(device, p.inputs, work)) {
    p.cost_kernel = r->kernel;
    p.cost_slices = r->slices;
    p.cost_fp64 = r->fp64;
    p.cost_source = r->source;
  }
  p.fallback = "none: the kernel takes any data";
  auto kernel = [&](const char* why) {
    p.route = GemmRoute::kKernel;
    p.route_reason = why;
    return p;
  };
  if (!allow_fast) return kernel("a normalization interval was given (tests): the kernel's own path");
  if (M == 0 || N == 0 || K == 0) return kernel("empty: no products");
  const bool fp64_ok = !digits && K <= (int64_t(1) << 33);
  p.fp64_ok = fp64_ok;
  // The fp64 route's switch leaves digits outputs to the auto choice.
  const GemmPath mode = (opt.route == kPathFp64 && digits) ? kPathAuto : opt.route;
  p.auto_route = mode == kPathAuto;
  if (mode == kPathKernel) return kernel("forced by route=kernel");
  GemmRoute want;
  if (mode == kPathFp64) {
    if (!fp64_ok) return kernel("forced fp64, K beyond its bound");  // unreachable below 2^33
    want = GemmRoute::kFp64;
    p.route_reason = "forced by route=fp64";
  } else if (mode != kPathAuto) {
    want = GemmRoute::kSlices;
    p.route_reason = "forced by route=" + std::string(mode == kPathSlices ? "slices"
                                                      : mode == kPathSlicesCrt ? "slices_crt" : "slices_diagonals");
  } else {
    want = GemmRoute::kKernel;
    double best = p.cost_kernel;
    if (p.cost_slices < best) {
      want = GemmRoute::kSlices;
      best = p.cost_slices;
    }
    if (fp64_ok && p.cost_fp64 < best) want = GemmRoute::kFp64;
    const char* output = digits ? ", digits" : p.out16 ? ", rounded to 16 bits" : ", rounded";
    p.route_reason = std::string("auto: least cost for ") + device_name(device) + ", " +
                     (p.inputs == InputClass::kFp32 ? "fp32" : "16-bit") + " inputs, M N K = 2^" +
                     std::to_string(std::ilogb(work)) + output + " (" + p.cost_source + ")";
  }
  p.route = want;
  if (want == GemmRoute::kSlices) {
    p.fallback = "rows the slices cannot hold (or needing more than a guess) go to the kernel";
  } else if (want == GemmRoute::kFp64) {
    take_fp64_route(&p, "");
  }
  return p;
}

// The K-chunk for (Sa, Sb) slices: int32 holds a diagonal's sum while pairs * Kc * 2^(2 bits - 2)
// < 2^31. Sets Kc and nch; returns the pairs of the longest diagonal.
inline int64_t slice_k_chunks(int64_t K, int64_t Sa, int64_t Sb, int bits, int64_t* Kc, int64_t* nch) {
  const int64_t pairs = std::max<int64_t>(1, std::min(Sa, Sb));
  const int64_t kc_max = (kSliceIntBound / (pairs << (2 * bits - 2))) / 16 * 16;
  *nch = ((K + 15) / 16 * 16 + kc_max - 1) / kc_max;
  *Kc = ((K + *nch - 1) / *nch + 15) / 16 * 16;
  return pairs;
}

// The slice counts from both operands' summaries (int_slices.h, kSum*): from each operand's least
// up to kSliceMax, the pair with the least work (int8 multiply-adds plus term_macs per residue
// term) among those whose 128-bit combine is proven. Sets slices_x/w, k_chunk(s), wide.
inline void plan_slice_counts(const int32_t* sx, const int32_t* sw, int64_t M, int64_t N, int64_t K, int bits,
                              double term_macs, SlicesPlan* out) {
  auto plan_for = [&](int64_t Sa, int64_t Sb, SlicesPlan* p) {
    p->slices_x = Sa;
    p->slices_w = Sb;
    slice_k_chunks(K, Sa, Sb, bits, &p->k_chunk, &p->k_chunks);
    p->wide = slices_wide(sx, sw, int(Sa), int(Sb), p->k_chunks, p->k_chunk, bits);
  };
  const int64_t Sx0 = sx[kSumNeed], Sw0 = sw[kSumNeed];
  plan_for(Sx0, Sw0, out);
  if (Sx0 == 0 || Sw0 == 0) {  // an all-zero (or all left-out) operand
    out->counts_reason = "an operand is all zero or all left to the kernel";
    return;
  }
  double best_cost = std::numeric_limits<double>::infinity();
  SlicesPlan best = *out;
  for (int64_t a = Sx0; a <= kSliceMax; ++a) {
    for (int64_t b = Sw0; b <= kSliceMax; ++b) {
      SlicesPlan p = *out;
      plan_for(a, b, &p);
      const double cost = double(a * b) * double(M) * double(N) * double(K) +
                          term_macs * (double(sx[kSumCount + a - 1]) * double(N) + double(sw[kSumCount + b - 1]) * double(M));
      if ((p.wide && !best.wide) || (p.wide == best.wide && cost < best_cost)) {
        best = p;
        best_cost = cost;
      }
    }
  }
  *out = best;
  out->counts_reason = best.wide ? "least int8 work plus residue terms with a proven 128-bit combine"
                                 : "no count pair proves the 128-bit combine: every output takes the long accumulator";
}

// Whether the slices should run at all under auto: when most rows of an operand would be
// recomputed by the kernel anyway, the kernel alone is cheaper.
inline bool slices_worth_it(const int32_t* sx, const int32_t* sw, int64_t M, int64_t N) {
  return !(2 * int64_t(sx[kSumBad]) > M || 2 * int64_t(sw[kSumBad]) > N);
}

// The N-chunk width Nc and the padded column count Np (>= N, a multiple of 8; the last chunk may
// be narrower) for int32 planes (P, Mp, Nc) within cap_mib. max_outputs > 0 (CUDA): every chunk
// Nc = 8 (mod 16) wide with Mp * Nc <= max_outputs, padding w's slices with zero rows: cuBLASLt
// then runs its sm90 int8 kernels, where multiples of 16 get its sm80 ones (~0.8x) and wider
// chunks a slow sm80 one (~0.3x), as a scan of the chunk width on Hopper showed.
inline std::pair<int64_t, int64_t> chunk_columns(int64_t N, int64_t Mp, int64_t P, int64_t cap_mib,
                                                 int64_t max_outputs) {
  auto round_up = [](int64_t v, int64_t m) { return (v + m - 1) / m * m; };
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

// The CRT way's moduli (crt.h), or 0 for the diagonals: forced by the route, else where the
// backend has the way and Q GEMMs plus the reconstruction cost less than the diagonals' Sx Sw.
inline int64_t plan_crt_moduli(bool crt_available, GemmPath mode, double crt_output_macs, int64_t M, int64_t N,
                               int64_t K, int64_t Sx, int64_t Sw, int bits, std::string* why) {
  if (!crt_available) {
    *why = "diagonals: this device has no CRT way";
    return 0;
  }
  if (mode == kPathSlicesDiagonals) {
    *why = "diagonals: forced by route=slices_diagonals";
    return 0;
  }
  const int64_t Q = crt_moduli_needed(K, int(Sx), int(Sw), bits);
  if (Q == 0) {
    *why = "diagonals: no moduli cover the products";
    return 0;
  }
  if (mode == kPathSlicesCrt) {
    *why = "crt: forced by route=slices_crt";
    return Q;
  }
  const double mn = double(M) * double(N);
  const double crt_cost = double(Q) * mn * double(K) + crt_output_macs * double(Q) * mn;
  const bool crt = crt_cost < double(Sx * Sw) * mn * double(K);
  *why = std::string(crt ? "crt: " : "diagonals: ") + std::to_string(Q) + " moduli against " + std::to_string(Sx * Sw) +
         " slice pairs (cost table)";
  return crt ? Q : 0;
}

// What a backend contributes to the slices' plan.
struct SliceTarget {
  int bits;                   // digit width (8, or 7 where the int8 GEMM could saturate)
  bool crt_available;         // the backend has the CRT way
  int64_t chunk_max_outputs;  // chunk_columns' rule (0: none)
};

// The slices' orientation. Their int8 GEMMs take x's rows whole and w's rows in N-chunks
// (chunk_columns). Where x has so many rows that w's chunks would be narrower than kNarrowChunk
// columns, and fewer than N, the int8 GEMMs run far below their rate: GPT-2's head wgrad
// (50304 x 768 x 8192, bf16) took 37 ms in chunks of 136 columns and 7.6 ms transposed, in chunks
// of 10072, on an H100. There the slices run C^T = w x^T when that widens the chunks, and the
// result is transposed back: the same exact sums, the same bytes. Rounded outputs without a bias
// only: a bias joins each output column's exact sum, and a digits output's transposed copy would
// hold 19 int64 per output at a training step's memory peak (5.9 GB for that wgrad). The widths
// are compared at one plane (the chunk MiB's widest).
constexpr int64_t kNarrowChunk = 256;

inline bool slices_transposed_for(int64_t M, int64_t N, bool has_bias, bool digits, const SliceTarget& t) {
  if (has_bias || digits || M <= N) return false;
  const int64_t mib = gemm_env().slices_chunk_mib;
  const int64_t as_is = chunk_columns(N, std::max<int64_t>(M, 17), 1, mib, t.chunk_max_outputs).first;
  const int64_t swapped = chunk_columns(M, std::max<int64_t>(N, 17), 1, mib, t.chunk_max_outputs).first;
  return as_is < std::min(N, kNarrowChunk) && swapped > as_is;
}

// The plan of the transposed call (x and w exchanged, M and N with them), or back: the slices'
// counts, residues, rows left to the kernel and fixed guesses change operands; an fp64 route's
// chunk is recomputed for the new M and N.
inline void transpose_plan(GemmPlan* p) {
  std::swap(p->M, p->N);
  std::swap(p->options.plan_x, p->options.plan_w);
  SlicesPlan& s = p->slices;
  std::swap(s.slices_x, s.slices_w);
  std::swap(s.residues_x, s.residues_w);
  std::swap(s.kernel_rows_x, s.kernel_rows_w);
  if (p->route == GemmRoute::kFp64) p->fp64_n_chunk = fp64_n_chunk(p->M, p->N);
}

// Stage 2: the slices' plan from the summaries sx, sw (host memory, kSumLen int32 each), or, with
// guess (Sx, Sw) > 0 and null summaries, from that guess. Fills p->slices; the caller falls back
// to the kernel when !p->slices.worth_it under auto.
inline void plan_slices_stage(GemmPlan* p, const int32_t* sx, const int32_t* sw, int64_t guess_x, int64_t guess_w,
                              const SliceTarget& t) {
  SlicesPlan& s = p->slices;
  s.planned = true;
  const SliceCosts& costs = slice_costs(p->device);
  const int64_t M = p->M, N = p->N, K = p->K;
  if (sx == nullptr) {
    s.guessed = true;
    s.slices_x = guess_x;
    s.slices_w = guess_w;
    slice_k_chunks(K, guess_x, guess_w, t.bits, &s.k_chunk, &s.k_chunks);
    s.wide = false;
    s.residues_x = s.residues_w = s.kernel_rows_x = s.kernel_rows_w = -1;
    s.counts_reason = "guessed (plans argument or the cache of this shape); rows needing more are recomputed";
  } else {
    plan_slice_counts(sx, sw, M, N, K, t.bits, costs.term_macs, &s);
    s.worth_it = slices_worth_it(sx, sw, M, N);
    s.kernel_rows_x = sx[kSumBad];
    s.kernel_rows_w = sw[kSumBad];
    s.residues_x = s.slices_x > 0 ? sx[kSumCount + s.slices_x - 1] : 0;
    s.residues_w = s.slices_w > 0 ? sw[kSumCount + s.slices_w - 1] : 0;
  }
  const GemmPath mode = p->options.route == kPathFp64 ? kPathAuto : p->options.route;
  s.moduli = plan_crt_moduli(t.crt_available, mode, costs.crt_output_macs, M, N, K, s.slices_x, s.slices_w, t.bits,
                             &s.way_reason);
  s.sliced_k_chunk = s.moduli > 0 ? (K + 15) / 16 * 16 : s.k_chunk;
  s.sliced_k_chunks = s.moduli > 0 ? 1 : s.k_chunks;
  s.diagonals = (s.slices_x > 0 && s.slices_w > 0) ? s.slices_x + s.slices_w - 1 : 0;
  s.planes = s.moduli > 0 ? s.moduli : s.diagonals * s.sliced_k_chunks;
  s.rows_padded = std::max<int64_t>(M, 17);
  std::tie(s.n_chunk, s.n_padded) =
      chunk_columns(N, s.rows_padded, s.planes, gemm_env().slices_chunk_mib, t.chunk_max_outputs);
  if (!s.worth_it && mode == kPathAuto) {
    // the kernel would be slow on such data too (kKernelSlowShare): rounded outputs go to fp64
    if (p->fp64_ok) {
      take_fp64_route(p, "; then the fp64 route: most rows of an operand are beyond the slices (wide exponent spread)");
      return;
    }
    p->route = GemmRoute::kKernel;
    p->route_reason += "; then the kernel: most rows of an operand are beyond the slices (wide exponent spread)";
    p->fallback = "none: the kernel takes any data";
  }
}

// The plan as JSON (lightning_det.ops.explain_gemm).
// Built with std::string alone: iostreams in the CUDA extension's host code crashed there (the
// first formatted insertion segfaulted inside the library's locale code on the H200's build).
inline std::string plan_json(const GemmPlan& p) {
  std::string o;
  auto key = [&](const char* k) {
    o += '"';
    o += k;
    o += "\": ";
  };
  auto str = [&](const char* k, const std::string& v, bool comma = true) {
    key(k);
    o += '"';
    for (char c : v) {
      if (c == '"' || c == '\\') o += '\\';
      o += c;
    }
    o += comma ? "\", " : "\"";
  };
  auto num = [&](const char* k, double v) {
    key(k);
    if (std::isinf(v)) {
      o += "null";
    } else {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.6g", v);
      o += buf;
    }
    o += ", ";
  };
  auto integer = [&](const char* k, int64_t v) {
    key(k);
    o += std::to_string(v) + ", ";
  };
  auto flag = [&](const char* k, bool v) {
    key(k);
    o += v ? "true, " : "false, ";
  };
  o += "{";
  str("route", route_name(p.route));
  str("route_reason", p.route_reason);
  str("fallback", p.fallback);
  str("device", device_name(p.device));
  str("inputs", p.inputs == InputClass::kFp32 ? "fp32" : "16-bit");
  str("output", p.digits ? "digits" : "rounded");
  flag("out16", p.out16);
  integer("M", p.M);
  integer("N", p.N);
  integer("K", p.K);
  integer("forced_route", int64_t(p.options.route));
  integer("plan_x", p.options.plan_x);
  integer("plan_w", p.options.plan_w);
  num("cost_kernel", p.cost_kernel);
  num("cost_slices", p.cost_slices);
  num("cost_fp64", p.cost_fp64);
  str("cost_source", p.cost_source);
  integer("tile_m", p.tiles.tile_m);
  integer("tile_n", p.tiles.tile_n);
  integer("k_block", p.tiles.k_block);
  flag("fp32_split", p.fp32_split);
  integer("fp64_n_chunk", p.fp64_n_chunk);
  num("kernel_slow_share", p.kernel_slow_share);
  flag("slices_transposed", p.slices_transposed);
  const SlicesPlan& s = p.slices;
  flag("slices_planned", s.planned);
  flag("slices_guessed", s.guessed);
  integer("slices_x", s.slices_x);
  integer("slices_w", s.slices_w);
  integer("residues_x", s.residues_x);
  integer("residues_w", s.residues_w);
  integer("kernel_rows_x", s.kernel_rows_x);
  integer("kernel_rows_w", s.kernel_rows_w);
  integer("moduli", s.moduli);
  integer("k_chunk", s.k_chunk);
  integer("k_chunks", s.k_chunks);
  integer("n_chunk", s.n_chunk);
  flag("wide", s.wide);
  flag("slices_worth_it", s.worth_it);
  str("counts_reason", s.counts_reason);
  str("way_reason", s.way_reason, false);
  o += "}";
  return o;
}

}  // namespace ldet

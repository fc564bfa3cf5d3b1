// The int8 GEMMs of the integer-slice route (csrc/int_slices_host.h) and the fp64 GEMMs of the
// fp64 route (csrc/fp64_bound_host.h) straight through cuBLASLt.
//
// Why not at::_int_mm: it passes no algorithm to cublasLtMatmul, which then runs its heuristic
// on every call: ~85 us of host time per GEMM in a det_ddp step's profile, more
// than the GEMM itself takes on the GPU for the training step's shapes, and a slice GEMM makes
// 9-27 of them. Here the descriptors and the heuristic's first choice are kept per (kind, shape,
// strides, layouts, alignment, device); a call then costs one cublasLtMatmul. The algorithm: the
// heuristic's first choice, or for int8 on request the fastest of its first eight, timed once
// (tune, below). The fp64 GEMMs ask for CUBLAS_COMPUTE_64F, native IEEE fp64 (not cuBLAS's
// emulated fp64, a compute type of its own): fp64_bound.h's error bound assumes it.
#include "check.h"
#include "cuda/int8_gemm_lt.h"

#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cublasLt.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>

namespace ldet {
namespace {

#define LDET_LT_CHECK(expr, what)                                                                         \
  do {                                                                                                    \
    const cublasStatus_t st_ = (expr);                                                                    \
    LDET_CHECK(st_ == CUBLAS_STATUS_SUCCESS, "GEMM (cuBLASLt): ", what, " failed with status ", int(st_)); \
  } while (0)

enum LtKind { kLtInt8 = 0, kLtF64 = 1 };

// Column-major view of the row-major problem: C^T (N x M, ld N) = B (N x K) . A^T (K x M), B and
// A each stored row-major (b_rows: K x N column-major with ld ldb, op T; A^T: K x M with ld lda,
// op N) or column-major (N x K with ld ldb, op N; M x K with ld lda, op T).
struct LtKey {
  int64_t m, n, k, lda, ldb, ldc;
  int align_a, align_b, align_c, device;
  int kind, a_rows, b_rows;
  int unused = 0;  // no padding bytes: the key is compared and hashed as raw bytes
  bool operator==(const LtKey& o) const { return std::memcmp(this, &o, sizeof(LtKey)) == 0; }
};

struct LtKeyHash {
  size_t operator()(const LtKey& k) const {
    size_t h = 1469598103934665603ull;
    const unsigned char* p = reinterpret_cast<const unsigned char*>(&k);
    for (size_t i = 0; i < sizeof(LtKey); ++i) h = (h ^ p[i]) * 1099511628211ull;
    return h;
  }
};

constexpr int kCandidates = 8;  // the heuristic's first choices, timed once per plan (tune)

struct LtPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo;
  bool have_algo = false;
  cublasLtMatmulAlgo_t candidates[kCandidates];
  int n_candidates = 0;
};

// The largest power of two (<= 256) dividing the address: cuBLASLt assumes 256-byte alignment
// unless told otherwise, and an algorithm chosen for aligned pointers may not run on others.
int alignment(const void* p) {
  const uintptr_t v = reinterpret_cast<uintptr_t>(p);
  int a = 1;
  while (a < 256 && (v & uintptr_t(a)) == 0) a <<= 1;
  return a;
}

LtPlan make_plan(const LtKey& key) {
  LtPlan p;
  const bool f64 = key.kind == kLtF64;
  const cudaDataType_t in = f64 ? CUDA_R_64F : CUDA_R_8I, acc = f64 ? CUDA_R_64F : CUDA_R_32I;
  LDET_LT_CHECK(cublasLtMatmulDescCreate(&p.op, f64 ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32I, acc), "descriptor");
  const cublasOperation_t ta = key.b_rows ? CUBLAS_OP_T : CUBLAS_OP_N, tb = key.a_rows ? CUBLAS_OP_N : CUBLAS_OP_T;
  LDET_LT_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)), "transa");
  LDET_LT_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)), "transb");
  // stored shapes: A (the w operand) K x N or N x K, B (the x operand) K x M or M x K, C N x M
  LDET_LT_CHECK(cublasLtMatrixLayoutCreate(&p.a, in, key.b_rows ? key.k : key.n, key.b_rows ? key.n : key.k, key.ldb),
                "layout A");
  LDET_LT_CHECK(cublasLtMatrixLayoutCreate(&p.b, in, key.a_rows ? key.k : key.m, key.a_rows ? key.m : key.k, key.lda),
                "layout B");
  LDET_LT_CHECK(cublasLtMatrixLayoutCreate(&p.c, acc, key.n, key.m, key.ldc), "layout C");
  cublasLtMatmulPreference_t pref;
  LDET_LT_CHECK(cublasLtMatmulPreferenceCreate(&pref), "preference");
  const size_t workspace = 0;  // as at::_int_mm: no split-K workspace
  const uint32_t al_a = uint32_t(key.align_b), al_b = uint32_t(key.align_a), al_c = uint32_t(key.align_c);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof(workspace));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof(al_a));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof(al_b));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof(al_c));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof(al_c));
  cublasLtMatmulHeuristicResult_t res[kCandidates];
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(at::cuda::getCurrentCUDABlasLtHandle(), p.op, p.a, p.b,
                                                           p.c, p.c, pref, kCandidates, res, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st == CUBLAS_STATUS_SUCCESS && found > 0) {
    p.algo = res[0].algo;
    p.have_algo = true;  // else cublasLtMatmul chooses per call, as at::_int_mm does
    for (int i = 0; i < found; ++i)
      if (res[i].state == CUBLAS_STATUS_SUCCESS) p.candidates[p.n_candidates++] = res[i].algo;
  }
  return p;
}

// One GEMM's operands, whatever its kind: c = a . b^T.
struct LtArgs {
  const void* a;
  const void* b;
  void* c;
  int kind;
};

cublasStatus_t run(const LtPlan& p, const cublasLtMatmulAlgo_t* algo, const LtArgs& g, cudaStream_t stream) {
  const int32_t ialpha = 1, ibeta = 0;
  const double dalpha = 1.0, dbeta = 0.0;  // 1 * sum + 0: no rounding beyond the sum's own
  const bool f64 = g.kind == kLtF64;
  return cublasLtMatmul(at::cuda::getCurrentCUDABlasLtHandle(), p.op, f64 ? static_cast<const void*>(&dalpha) : &ialpha,
                        g.b, p.a, g.a, p.b, f64 ? static_cast<const void*>(&dbeta) : &ibeta, g.c, p.c, g.c, p.c, algo,
                        nullptr, 0, stream);
}

// Opt-in (LIGHTNING_DET_INT8_GEMM_TUNE=1): each new plan times its candidates once, on the call's
// own operands (each writes the same exact int32 sums: the choice cannot change a byte), and keeps
// the fastest; one host synchronization per shape and process, and not while the stream is being
// captured into a graph. Why not by default: a warm-up and two timed runs per candidate, once,
// chose cutlass sm80 kernels for some of the det_ddp step's shapes that ran slower in the steps
// than the heuristic's first choice (sm90): the step's int8 GEMMs took ~13% more GPU time tuned,
// det_gemm bf16 4096^3 a few percent more. One shape gained (DetLinear fp32 1024 -> 4096, ~2%).
// A guess at why, not measured: the timing reruns the same operands, which then sit in L2,
// unlike a step's.
void tune(LtPlan& p, const LtArgs& g, cudaStream_t stream) {
  const bool enabled = gemm_env().int8_gemm_tune;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (!enabled || g.kind != kLtInt8 || p.n_candidates < 2 || cudaStreamIsCapturing(stream, &capture) != cudaSuccess ||
      capture != cudaStreamCaptureStatusNone)
    return;
  cudaEvent_t start, stop;
  if (cudaEventCreate(&start) != cudaSuccess) return;
  if (cudaEventCreate(&stop) != cudaSuccess) {
    cudaEventDestroy(start);
    return;
  }
  float best = 0.0f;
  int best_i = -1;
  for (int i = 0; i < p.n_candidates; ++i) {
    if (run(p, &p.candidates[i], g, stream) != CUBLAS_STATUS_SUCCESS) continue;  // warm-up; skip one that cannot run
    cudaEventRecord(start, stream);
    for (int r = 0; r < 2; ++r) run(p, &p.candidates[i], g, stream);
    cudaEventRecord(stop, stream);
    float ms = 0.0f;
    if (cudaEventSynchronize(stop) != cudaSuccess || cudaEventElapsedTime(&ms, start, stop) != cudaSuccess) continue;
    if (best_i < 0 || ms < best) {
      best = ms;
      best_i = i;
    }
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  if (best_i >= 0) p.algo = p.candidates[best_i];
}

bool use_torch_route() { return gemm_env().int8_gemm_torch; }

}  // namespace

namespace {

// c = a . b^T through the cached plan of `key` (made, and for int8 maybe tuned, on first use).
void lt_matmul(const LtKey& key, const LtArgs& args, const at::Device& device) {
  static std::mutex mu;
  static std::unordered_map<LtKey, LtPlan, LtKeyHash> cache;
  // Shapes of one training run are few; past the cap a shape's plan is made and dropped per call.
  constexpr size_t kCacheCap = 4096;
  LtPlan plan;
  bool cached = true;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) {
      plan = it->second;
    } else {
      c10::cuda::CUDAGuard guard(device);
      plan = make_plan(key);
      tune(plan, args, c10::cuda::getCurrentCUDAStream());
      if (cache.size() < kCacheCap) {
        cache.emplace(key, plan);  // entries live as long as the process
      } else {
        cached = false;
      }
    }
  }
  LDET_LT_CHECK(run(plan, plan.have_algo ? &plan.algo : nullptr, args, c10::cuda::getCurrentCUDAStream()),
                "cublasLtMatmul");
  if (!cached) {
    cublasLtMatrixLayoutDestroy(plan.a);
    cublasLtMatrixLayoutDestroy(plan.b);
    cublasLtMatrixLayoutDestroy(plan.c);
    cublasLtMatmulDescDestroy(plan.op);
  }
}

}  // namespace

void int8_gemm_lt(const Int8Gemm& g, const at::Device& device) {
  LDET_CHECK(g.m > 0 && g.n > 0 && g.k > 0 && g.lda >= g.k && g.ldb >= g.k && g.ldc >= g.n,
              "int8 GEMM: expected positive m, n, k and row strides at least k (operands) and n (output)");
  if (use_torch_route()) return int8_mm_aten(g, device);
  const LtKey key{g.m, g.n, g.k, g.lda, g.ldb, g.ldc, alignment(g.a), alignment(g.b), alignment(g.c),
                  int(device.index()), kLtInt8, 1, 1};
  lt_matmul(key, LtArgs{g.a, g.b, g.c, kLtInt8}, device);
}

void fp64_gemm_lt(const Fp64Gemm& g, const at::Device& device) {
  LDET_CHECK(g.m > 0 && g.n > 0 && g.k > 0 && g.lda >= (g.a_rows ? g.k : g.m) && g.ldb >= (g.b_rows ? g.k : g.n) &&
                  g.ldc >= g.n,
              "fp64 GEMM: expected positive m, n, k and leading strides covering the stored rows");
  const LtKey key{g.m, g.n, g.k, g.lda, g.ldb, g.ldc, alignment(g.a), alignment(g.b), alignment(g.c),
                  int(device.index()), kLtF64, g.a_rows ? 1 : 0, g.b_rows ? 1 : 0};
  lt_matmul(key, LtArgs{g.a, g.b, g.c, kLtF64}, device);
}

}  // namespace ldet

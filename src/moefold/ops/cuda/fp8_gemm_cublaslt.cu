// The dense FP8 linear layers' GEMMs through cuBLASLt's block scaling (kernels.fp8_dense_gemm =
// cublaslt; ops/cuda/fp8.h lt_fp8_gemm): DeepSeek-V3's 1 x 128 tiles (CUBLASLT_MATMUL_MATRIX_SCALE_
// VEC128_32F) and 128 x 128 blocks (BLK128x128_32F) with f32 scales, both operands K-major ("TN").
//
// The scale layouts cuBLASLt reads were established on an H200 (bench_fp8_gemm --probe-layouts,
// 2026-12-02): 1 x 128 tiles as ops/fp8.h's rows and cols layouts store them ([ceil(K/128), M], M
// contiguous); 128 x 128 blocks as ops/fp8.h's blocks layout ([ceil(N/128), ceil(K/128)]) with its
// row stride rounded up to a multiple of 4 floats (fp8_lt_block_scales pads a copy).
#include <cublasLt.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <unordered_map>

#include "moefold/ops/cuda/common.cuh"
#include "moefold/ops/cuda/fp8.h"
#include "moefold/ops/fp8.h"

namespace moefold::cuda {
namespace {

constexpr size_t kWorkspaceBytes = size_t{32} << 20;
constexpr size_t kMaxPlans = 1024;

struct Key {
  int64_t m, n, k, lda, ldb;
  DType out;
  bool b_blocks;
  bool operator==(const Key&) const = default;
};
struct KeyHash {
  size_t operator()(const Key& k) const noexcept {
    uint64_t h = 1469598103934665603ull;
    for (const uint64_t v : {static_cast<uint64_t>(k.m), static_cast<uint64_t>(k.n), static_cast<uint64_t>(k.k),
                             static_cast<uint64_t>(k.lda), static_cast<uint64_t>(k.ldb),
                             static_cast<uint64_t>(k.out) << 1 | static_cast<uint64_t>(k.b_blocks)})
      h = (h ^ v) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

// Descriptors (initialised in place: the map's nodes never move), the algorithm, or none.
struct Plan {
  cublasLtMatmulDescOpaque_t op;
  cublasLtMatrixLayoutOpaque_t a, b, out;
  cublasLtMatmulAlgo_t algo;
  size_t workspace_bytes = 0;
  bool found = false;
};

struct LtFp8State final : ExecLibraryState {
  explicit LtFp8State(const ExecContext&) {
    if (cublasLtCreate(&handle) != CUBLAS_STATUS_SUCCESS) MF_FAIL("cuBLASLt: cublasLtCreate failed");
    workspace = device_malloc(kWorkspaceBytes);
  }
  ~LtFp8State() override {
    device_free(workspace);
    cublasLtDestroy(handle);
  }
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  std::unordered_map<Key, Plan, KeyHash> plans;
};

#define MF_LT(expr)                                                                                               \
  do {                                                                                                            \
    const cublasStatus_t mf_st_ = (expr);                                                                         \
    if (mf_st_ != CUBLAS_STATUS_SUCCESS) MF_FAIL("cuBLASLt FP8: ", #expr, ": ", cublasLtGetStatusString(mf_st_)); \
  } while (0)

template <class T>
void set_desc(cublasLtMatmulDesc_t op, cublasLtMatmulDescAttributes_t attr, const T& v) {
  MF_LT(cublasLtMatmulDescSetAttribute(op, attr, &v, sizeof v));
}

// cuBLASLt's column-major view: D[n, m] (ld n) = A^T B with A = b (K x n, ld ldb) and B = a (K x m,
// ld lda): our out[m, n] row-major = a b^T.
void init_plan(LtFp8State& s, const Key& key, Plan& p) {
  MF_LT(cublasLtMatmulDescInit(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  set_desc(&p.op, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
  set_desc(&p.op, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
  set_desc(&p.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
           static_cast<int32_t>(key.b_blocks ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                                             : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F));
  set_desc(&p.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, static_cast<int32_t>(CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F));
  MF_LT(cublasLtMatrixLayoutInit(&p.a, CUDA_R_8F_E4M3, static_cast<uint64_t>(key.k), static_cast<uint64_t>(key.n),
                                 key.ldb));
  MF_LT(cublasLtMatrixLayoutInit(&p.b, CUDA_R_8F_E4M3, static_cast<uint64_t>(key.k), static_cast<uint64_t>(key.m),
                                 key.lda));
  MF_LT(cublasLtMatrixLayoutInit(&p.out, key.out == DType::bf16 ? CUDA_R_16BF : CUDA_R_32F,
                                 static_cast<uint64_t>(key.n), static_cast<uint64_t>(key.m), key.n));
  // The heuristic sees scale pointers (each call sets its own): any device address will do.
  set_desc(&p.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const float*>(s.workspace));
  set_desc(&p.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const float*>(s.workspace));
  // Split-K partial sums in f32 in the workspace only (as the bf16 GEMMs, ops/cuda/gemm.cu) where
  // an algorithm allows it; else cuBLASLt's choice.
  for (const bool f32_reduction : {true, false}) {
    cublasLtMatmulPreferenceOpaque_t pref;
    MF_LT(cublasLtMatmulPreferenceInit(&pref));
    const uint64_t ws = kWorkspaceBytes;
    MF_LT(cublasLtMatmulPreferenceSetAttribute(&pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    if (f32_reduction) {
      const uint32_t scheme = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
      MF_LT(cublasLtMatmulPreferenceSetAttribute(&pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &scheme,
                                                 sizeof scheme));
    }
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t st =
        cublasLtMatmulAlgoGetHeuristic(s.handle, &p.op, &p.a, &p.b, &p.out, &p.out, &pref, 1, &result, &found);
    p.found = st == CUBLAS_STATUS_SUCCESS && found > 0 && result.state == CUBLAS_STATUS_SUCCESS;
    if (p.found) {
      p.algo = result.algo;
      p.workspace_bytes = result.workspaceSize;
      return;
    }
  }
  if (std::getenv("MOEFOLD_DEBUG_FP8_LT") != nullptr)  // diagnostics only
    std::fprintf(stderr, "moefold: cuBLASLt has no block-scaled FP8 algorithm for m=%lld n=%lld k=%lld\n",
                 static_cast<long long>(key.m), static_cast<long long>(key.n), static_cast<long long>(key.k));
}

std::atomic<int64_t> g_lt_calls{0};

}  // namespace

int64_t lt_fp8_gemm_calls() { return g_lt_calls.load(); }

bool lt_fp8_gemm_serves(int64_t m, int64_t n, int64_t k) {
  // Whole 1 x 128 tiles along K, and the 16-element alignment of FP8 GEMMs elsewhere: the shapes
  // whose results the parity tests cover; anything else runs on CUTLASS.
  return m > 0 && n > 0 && k > 0 && k % kFp8Tile == 0 && m % 16 == 0 && n % 16 == 0;
}

bool lt_fp8_gemm(const ExecContext& ctx, int64_t m, int64_t n, int64_t k, const uint8_t* a, int64_t lda,
                 const float* sa, const uint8_t* b, int64_t ldb, const float* sb, bool b_blocks, void* out,
                 DType out_dtype, float beta) {
  if (!lt_fp8_gemm_serves(m, n, k)) return false;
  LtFp8State& s = ctx.library<LtFp8State>(ExecLibrary::cublaslt_fp8);
  const Key key{m, n, k, lda, ldb, out_dtype, b_blocks};
  auto it = s.plans.find(key);
  if (it == s.plans.end()) {
    if (s.plans.size() >= kMaxPlans) s.plans.clear();
    it = s.plans.try_emplace(key).first;
    init_plan(s, key, it->second);
  }
  Plan& p = it->second;
  if (!p.found) return false;
  // The scale pointers change per call (operands in scratch): set on the cached descriptor.
  set_desc(&p.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, sb);
  set_desc(&p.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, sa);
  const float alpha = 1.0f;
  MF_LT(cublasLtMatmul(s.handle, &p.op, &alpha, b, &p.a, a, &p.b, &beta, out, &p.out, out, &p.out, &p.algo, s.workspace,
                       p.workspace_bytes, stream_of(ctx)));
  ++g_lt_calls;
  return true;
}

void fp8_lt_block_scales(const ExecContext& ctx, const float* s, int64_t rows, int64_t cols, float* padded) {
  const int64_t ld = fp8_lt_block_ld(cols);
  MF_CUDA_CHECK(cudaMemcpy2DAsync(padded, static_cast<size_t>(ld) * sizeof(float), s,
                                  static_cast<size_t>(cols) * sizeof(float), static_cast<size_t>(cols) * sizeof(float),
                                  static_cast<size_t>(rows), cudaMemcpyDeviceToDevice, stream_of(ctx)));
}

}  // namespace moefold::cuda

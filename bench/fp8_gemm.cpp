// bench_fp8_gemm: the FP8 GEMM ceilings of one H200 at the experts' shapes (issue 18's GEMM
// reference): cuBLASLt bf16 (the bf16 ceiling); cuBLASLt FP8 E4M3 with one scale per tensor, with
// and without fast accumulation (the FP8 ceiling: no per-block promotion); cuBLASLt FP8 with
// DeepSeek-V3's block scaling (1 x 128 activation tiles x 128 x 128 weight blocks); and moefold's
// FP8 linear (CUTLASS's blockwise-scaled grouped GEMM as one group, fp8_linear_forward with the
// weight quantized beforehand), whose activation quantization is timed apart and subtracted.
// y[M, N] = x[M, K] @ w[N, K]^T, bf16 output; the expert GEMMs of a layer as one dense GEMM of all
// its rows (the grouped GEMMs' ideal). Random unit-variance data; unit scales for cuBLASLt (its
// speed does not depend on them). Times: CUDA events on the primary stream (every GEMM runs
// there), median of --runs after --warmup.
//   ./build-gpu/bench_fp8_gemm [--runs N] [--warmup N]
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench_util.h"
#include "moefold/core/error.h"
#include "moefold/core/exec.h"
#include "moefold/ops/fp8.h"

namespace moefold {
namespace {

using bench::DeviceTensor;

struct GemmShape {
  const char* name;
  int64_t m, n, k;
};

// qwen3-30b-a3b: 16,384 tokens x top-8 = 131,072 rows, H 2048, F 768 (fc1 N = 2F); deepseek-v3:
// 8,192 tokens x 8 = 65,536 rows, H 7168, F 2048; and one expert's fc1 of each (rows per expert
// under balanced routing), the size of one group.
const GemmShape kShapes[] = {
    {"qwen3-30b-a3b fc1", 131072, 1536, 2048},  {"qwen3-30b-a3b fc2", 131072, 2048, 768},
    {"deepseek-v3 fc1", 65536, 4096, 7168},     {"deepseek-v3 fc2", 65536, 7168, 2048},
    {"qwen3 one expert fc1", 1024, 1536, 2048}, {"deepseek one expert fc1", 256, 4096, 7168},
};

#define LT_CHECK(expr)                                                                    \
  do {                                                                                    \
    const cublasStatus_t st_ = (expr);                                                    \
    if (st_ != CUBLAS_STATUS_SUCCESS) MF_FAIL(#expr, ": ", cublasLtGetStatusString(st_)); \
  } while (0)

enum class Mode { bf16, fp8_tensor, fp8_tensor_fast, fp8_block };

const char* mode_name(Mode m) {
  switch (m) {
    case Mode::bf16:
      return "cuBLASLt bf16";
    case Mode::fp8_tensor:
      return "cuBLASLt FP8 per-tensor";
    case Mode::fp8_tensor_fast:
      return "cuBLASLt FP8 per-tensor, fast accum";
    case Mode::fp8_block:
      return "cuBLASLt FP8 1x128 x 128x128";
  }
  return "";
}

// One cuBLASLt GEMM, column-major D[N, M] = W[K, N]^T X[K, M] ("TN": both K-major), timed; 0 when
// cuBLASLt has no algorithm for it (prints why).
double time_lt(cublasLtHandle_t lt, cudaStream_t stream, void* ws, size_t ws_bytes, Mode mode, const GemmShape& s,
               const void* w, const void* x, void* y, const float* w_scale, const float* x_scale, int runs,
               int warmup) {
  const bool fp8 = mode != Mode::bf16;
  const cudaDataType_t in = fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
  cublasLtMatmulDesc_t op;
  LT_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t t = CUBLAS_OP_T, n = CUBLAS_OP_N;
  LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t));
  LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &n, sizeof n));
  if (fp8) {
    LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &w_scale, sizeof w_scale));
    LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &x_scale, sizeof x_scale));
    const int8_t fast = mode == Mode::fp8_tensor_fast ? 1 : 0;
    LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast));
  }
  if (mode == Mode::fp8_block) {
    const int32_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
                  b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode, sizeof a_mode));
    LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode, sizeof b_mode));
  }
  cublasLtMatrixLayout_t a, b, d;
  LT_CHECK(cublasLtMatrixLayoutCreate(&a, in, static_cast<uint64_t>(s.k), static_cast<uint64_t>(s.n), s.k));
  LT_CHECK(cublasLtMatrixLayoutCreate(&b, in, static_cast<uint64_t>(s.k), static_cast<uint64_t>(s.m), s.k));
  LT_CHECK(cublasLtMatrixLayoutCreate(&d, CUDA_R_16BF, static_cast<uint64_t>(s.n), static_cast<uint64_t>(s.m), s.n));
  cublasLtMatmulPreference_t pref;
  LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t wsb = ws_bytes;
  LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb));
  cublasLtMatmulHeuristicResult_t res{};
  int found = 0;
  const cublasStatus_t h = cublasLtMatmulAlgoGetHeuristic(lt, op, a, b, d, d, pref, 1, &res, &found);
  double ms = 0;
  if (h != CUBLAS_STATUS_SUCCESS || found == 0) {
    std::printf("%-26s %-38s no algorithm (%s)\n", s.name, mode_name(mode), cublasLtGetStatusString(h));
  } else {
    const float alpha = 1, beta = 0;
    ms = bench::time_ms(runs, warmup, [&] {
      LT_CHECK(cublasLtMatmul(lt, op, &alpha, w, a, x, b, &beta, y, d, y, d, &res.algo, ws, ws_bytes, stream));
    });
  }
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(d);
  cublasLtMatrixLayoutDestroy(b);
  cublasLtMatrixLayoutDestroy(a);
  cublasLtMatmulDescDestroy(op);
  return ms;
}

void report(const GemmShape& s, const char* impl, double ms) {
  if (ms <= 0) return;
  const double flops = 2.0 * static_cast<double>(s.m) * s.n * s.k;
  std::printf("%-26s M=%-6lld N=%-5lld K=%-5lld %-42s %8.3f ms %7.1f TFLOP/s\n", s.name, static_cast<long long>(s.m),
              static_cast<long long>(s.n), static_cast<long long>(s.k), impl, ms, flops / ms * 1e-9);
  std::fflush(stdout);
}

int run(int argc, char** argv) {
  int runs = 20, warmup = 3;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--runs" && i + 1 < argc)
      runs = std::atoi(argv[++i]);
    else if (a == "--warmup" && i + 1 < argc)
      warmup = std::atoi(argv[++i]);
    else
      MF_FAIL("usage: bench_fp8_gemm [--runs N] [--warmup N] (got '", a, "')");
  }
  MF_CHECK(cuda_device_count() > 0, "bench_fp8_gemm needs a GPU");
  const ExecContext& ctx = ExecContext::standard(Device::cuda);
  cublasLtHandle_t lt;
  LT_CHECK(cublasLtCreate(&lt));
  const size_t ws_bytes = size_t{32} << 20;
  DeviceTensor ws({static_cast<int64_t>(ws_bytes)}, DType::u8);
  for (const GemmShape& s : kShapes) {
    DeviceTensor x({s.m, s.k}, DType::bf16), w({s.n, s.k}, DType::bf16), y({s.m, s.n}, DType::bf16);
    bench::fill_random(*x, 1);
    bench::fill_random(*w, 2);
    // E4M3 operands for cuBLASLt: the bf16 data quantized (any bytes time the same).
    const int64_t kb = (s.k + kFp8Tile - 1) / kFp8Tile, nb = (s.n + kFp8Tile - 1) / kFp8Tile;
    DeviceTensor qx({s.m, s.k}, DType::u8), sx({kb, s.m}, DType::f32);
    DeviceTensor qw({s.n, s.k}, DType::u8), sw({nb, kb}, DType::f32), qwT({s.k, s.n}, DType::u8),
        swT({kb, nb}, DType::f32);
    fp8_quantize_rows(ctx, *x, *qx, *sx);
    fp8_quantize_blocks(ctx, *w, *qw, *sw, *qwT, *swT);
    // cuBLASLt's scales: ones (a scalar, or one per block), in buffers large enough for any layout.
    const int64_t scales = std::max(s.m, s.n) * kb + 64;
    DeviceTensor ones({scales}, DType::f32);
    std::vector<float> h(static_cast<size_t>(scales), 1.0f);
    device_copy((*ones).data(), Device::cuda, h.data(), Device::cpu, h.size() * sizeof(float));
    const float* one = (*ones).ptr<float>();
    for (Mode m : {Mode::bf16, Mode::fp8_tensor, Mode::fp8_tensor_fast, Mode::fp8_block}) {
      const bool fp8 = m != Mode::bf16;
      report(s, mode_name(m),
             time_lt(lt, static_cast<cudaStream_t>(ctx.stream()), (*ws).data(), ws_bytes, m, s,
                     fp8 ? (*qw).data() : (*w).data(), fp8 ? (*qx).data() : (*x).data(), (*y).data(), one, one, runs,
                     warmup));
    }
    // moefold's FP8 linear: the weight quantized beforehand (as Fp8WeightCache does once a step).
    const Fp8Weight wq{*qw, *sw, *qwT, *swT};
    const double total = bench::time_ms(runs, warmup, [&] { fp8_linear_forward(ctx, *x, *w, *y, &wq); });
    const double quant = bench::time_ms(runs, warmup, [&] { fp8_quantize_rows(ctx, *x, *qx, *sx); });
    report(s, "moefold FP8 linear (quantize x + CUTLASS)", total);
    report(s, "  of which quantize x (1 x 128 tiles)", quant);
    report(s, "  CUTLASS blockwise GEMM (the difference)", total - quant);
  }
  cublasLtDestroy(lt);
  return 0;
}

}  // namespace
}  // namespace moefold

int main(int argc, char** argv) {
  try {
    return moefold::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_fp8_gemm: error: %s\n", e.what());
    return 1;
  }
}

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
// Then the experts' grouped GEMMs (bench_grouped). Both by default.
// --probe-layouts: which scale layouts cuBLASLt's block scaling reads (probe_layouts), nothing else.
// --wgrad-groups: the bf16 weight gradient in fewer, larger groups (bench_wgrad_groups), nothing else.
// --wgrad-own: the weight gradient on CUTLASS and on the own kernel (bench_wgrad_own), nothing else;
//   --wgrad-case NAME: only that shape (e.g. "deepseek-v3 fc1": one kernel to profile);
//   --wgrad-clusters 'C;...': the own kernel in clusters of C CTAs (default '2;1'; 2 is wgrad = own's);
//   --wgrad-units 'U;...': and units of up to U tiles, dy kept over them where every expert has at
//   most 256 rows (kernels.own_wgrad_units; default '1': one tile at a time);
//   --rest-ms N: the GPU idles N ms before each timed run (against back to back: the clocks' share).
// --wgrad-split 'S;...': the data and weight gradients one after the other against both at once on
//   two streams, the weight gradient on S SMs (bench_wgrad_split; --wgrad-case NAME, default the
//   DeepSeek-V3 shapes; --rest-ms), nothing else.
// --quantize: the activations' FP8 quantization passes alone (bench_quantize), nothing else.
//   ./build-gpu/bench_fp8_gemm [--runs N] [--warmup N] [--tiles 'a;b;...'] [--grouped-only | --dense-only |
//                              --probe-layouts | --wgrad-groups | --quantize |
//                              --wgrad-own [--wgrad-case NAME] [--wgrad-clusters 'C;...']
//                              [--wgrad-units 'U;...'] [--rest-ms N] | --wgrad-split 'S;...']
// --tiles: the kernels.fp8_tile values the grouped GEMMs run in, in turn (default
// "cooperative;rows=own;cooperative;rows=own").
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bench_util.h"
#include "moefold/core/error.h"
#include "moefold/core/exec.h"
#include "moefold/ops/cuda/fp8.h"
#include "moefold/ops/cuda/wgrad_grouped_gemm.h"
#include "moefold/ops/fp8.h"
#include "moefold/ops/moe_ops.h"
#include "moefold/ops/ops.h"

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
// fp8_block's scale modes of A (w) and B (x): 128 x 128 blocks and 1 x 128 tiles unless given
// (the layout probe also runs 1 x 128 x 1 x 128, the weight gradient's pairing).
double time_lt(cublasLtHandle_t lt, cudaStream_t stream, void* ws, size_t ws_bytes, Mode mode, const GemmShape& s,
               const void* w, const void* x, void* y, const float* w_scale, const float* x_scale, int runs, int warmup,
               int32_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
               int32_t b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F) {
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

// Which scale layouts cuBLASLt's block scaling reads (for the dense FP8 linears): y = x w^T with
// moefold's quantized operands (ops/fp8.h: x rows, scales [K/128, M]; w blocks, s [N/128, K/128]
// and sT [K/128, N/128]) and each candidate layout of the scales (the rows scales as they are or
// transposed; s or sT), against moefold's CUTLASS result; then dw = dy^T x with both operands in
// the cols layout (1 x 128 x 1 x 128, the weight gradient's pairing), scales [P/128, C] or
// transposed, against moefold's. A relative error ~1e-3 (bf16 output) names the layout.
void probe_layouts(cublasLtHandle_t lt, void* ws, size_t ws_bytes) {
  const ExecContext& ctx = ExecContext::standard(Device::cuda);
  const cudaStream_t stream = static_cast<cudaStream_t>(ctx.stream());
  const int64_t m = 384, n = 256, k = 640, kb = k / kFp8Tile, nb = n / kFp8Tile, mb = m / kFp8Tile;
  const auto transposed = [&](const Tensor& t) {  // a [r, c] f32 device tensor as [c, r]
    std::vector<float> h(static_cast<size_t>(t.numel())), o(h.size());
    device_copy(h.data(), Device::cpu, t.data(), Device::cuda, h.size() * 4);
    const int64_t r = t.size(0), c = t.size(1);
    for (int64_t i = 0; i < r; ++i)
      for (int64_t j = 0; j < c; ++j) o[static_cast<size_t>(j * r + i)] = h[static_cast<size_t>(i * c + j)];
    auto out = std::make_unique<DeviceTensor>(Shape{c, r}, DType::f32);
    device_copy((**out).data(), Device::cuda, o.data(), Device::cpu, o.size() * 4);
    return out;
  };
  const auto padded_ld = [&](const Tensor& t, int64_t multiple) {  // [r, c] f32 with rows padded to c' = c rounded up
    const int64_t r = t.size(0), c = t.size(1), cp = (c + multiple - 1) / multiple * multiple;
    std::vector<float> h(static_cast<size_t>(t.numel())), o(static_cast<size_t>(r * cp), 0.0f);
    device_copy(h.data(), Device::cpu, t.data(), Device::cuda, h.size() * 4);
    for (int64_t i = 0; i < r; ++i)
      for (int64_t j = 0; j < c; ++j) o[static_cast<size_t>(i * cp + j)] = h[static_cast<size_t>(i * c + j)];
    auto out = std::make_unique<DeviceTensor>(Shape{r, cp}, DType::f32);
    device_copy((**out).data(), Device::cuda, o.data(), Device::cpu, o.size() * 4);
    return out;
  };
  // Random values times 2^(a pattern over tiles of tile_rows x 128): each tile its own scale.
  const auto blocky = [&](const Tensor& t, int64_t tile_rows, uint64_t seed) {
    const int64_t r = t.size(0), c = t.size(1);
    std::vector<uint16_t> h(static_cast<size_t>(t.numel()));
    uint64_t v = seed * 0x9E3779B97F4A7C15ull + 1;
    for (int64_t i = 0; i < r; ++i)
      for (int64_t j = 0; j < c; ++j) {
        v ^= v >> 12, v ^= v << 25, v ^= v >> 27;
        const double u = static_cast<double>((v * 0x2545F4914F6CDD1Dull) >> 11) * 0x1.0p-53 - 0.5;
        const int e = static_cast<int>((i / tile_rows * 7 + j / kFp8Tile * 3) % 9) - 4;
        h[static_cast<size_t>(i * c + j)] = f32_to_bf16(static_cast<float>(std::ldexp(u, e)));
      }
    device_copy(t.data(), Device::cuda, h.data(), Device::cpu, h.size() * 2);
  };
  const auto rel = [&](const Tensor& a, const Tensor& b) {
    std::vector<uint16_t> ha(static_cast<size_t>(a.numel())), hb(ha.size());
    device_copy(ha.data(), Device::cpu, a.data(), Device::cuda, ha.size() * 2);
    device_copy(hb.data(), Device::cpu, b.data(), Device::cuda, hb.size() * 2);
    double num = 0, den = 0;
    for (size_t i = 0; i < ha.size(); ++i) {
      const double x = bf16_to_f32(ha[i]), y = bf16_to_f32(hb[i]);
      num += (x - y) * (x - y);
      den += y * y;
    }
    return std::sqrt(num / std::max(den, 1e-30));
  };
  {  // forward: D[N, M] (column-major) = W^T X with W [K, N], X [K, M] column-major = w [N, K], x [M, K]
    const GemmShape s{"probe forward", m, n, k};
    DeviceTensor x({m, k}, DType::bf16), w({n, k}, DType::bf16), y({m, n}, DType::bf16), ref({m, n}, DType::bf16);
    blocky(*x, 1, 7);  // a scale per 1 x 128 tile, another per 128 x 128 block: a wrong layout shows
    blocky(*w, kFp8Tile, 8);
    DeviceTensor qx({m, k}, DType::u8), sx({kb, m}, DType::f32), qw({n, k}, DType::u8), sw({nb, kb}, DType::f32),
        qwT({k, n}, DType::u8), swT({kb, nb}, DType::f32);
    fp8_quantize_rows(ctx, *x, *qx, *sx);
    fp8_quantize_blocks(ctx, *w, *qw, *sw, *qwT, *swT);
    const Fp8Weight wq{*qw, *sw, *qwT, *swT};
    fp8_linear_forward(ctx, *x, *w, *ref, &wq);
    const auto sxT = transposed(*sx);
    const auto swp = padded_ld(*sw, 4), swTp = padded_ld(*swT, 4);
    for (const auto& [wname, wscale] :
         {std::pair{"w s [N/128, K/128]", &*sw}, std::pair{"w sT [K/128, N/128]", &*swT},
          std::pair{"w s, K/128 padded to 4", &**swp}, std::pair{"w sT, N/128 padded to 4", &**swTp}})
      for (const auto& [xname, xscale] : {std::pair{"x [K/128, M]", &*sx}, std::pair{"x [M, K/128]", &**sxT}}) {
        const double ms = time_lt(lt, stream, ws, ws_bytes, Mode::fp8_block, s, (*qw).data(), (*qx).data(), (*y).data(),
                                  wscale->ptr<float>(), xscale->ptr<float>(), 1, 0);
        std::printf("probe forward  A %-22s B %-14s %s rel error %.3g\n", wname, xname, ms > 0 ? "ran" : "none",
                    ms > 0 ? rel(*y, *ref) : -1.0);
      }
  }
  {  // wgrad: dw[O, I] = dy^T x; cuBLASLt D[I, O] column-major = X^T DY, X = x cols qT [I, P], DY = dy cols [O, P]
    const int64_t o_n = n, i_n = k, r_n = m, p = fp8_cols_width(r_n, 1);
    const GemmShape s{"probe wgrad", o_n, i_n, p};  // cuBLASLt's M = O (B = dy), N = I (A = x), K = P
    DeviceTensor x({r_n, i_n}, DType::bf16), w({o_n, i_n}, DType::bf16), dy({r_n, o_n}, DType::bf16),
        dw({o_n, i_n}, DType::bf16), ref({o_n, i_n}, DType::bf16);
    bench::fill_random(*x, 9);
    bench::fill_random(*dy, 10);
    int64_t off[2] = {0, r_n};
    DeviceTensor offsets({2}, DType::i64);
    device_copy((*offsets).data(), Device::cuda, off, Device::cpu, sizeof off);
    DeviceTensor qxT({i_n, p}, DType::u8), sxT({p / kFp8Tile, i_n}, DType::f32), qdyT({o_n, p}, DType::u8),
        sdyT({p / kFp8Tile, o_n}, DType::f32);
    for (const Tensor* t : {&*qxT, &*sxT, &*qdyT, &*sdyT}) {  // the columns past the rows: zero codes and scales
      const std::vector<uint8_t> zeros(t->nbytes(), 0);
      device_copy(t->data(), Device::cuda, zeros.data(), Device::cpu, zeros.size());
    }
    fp8_quantize_cols(ctx, *x, *offsets, *qxT, *sxT);
    fp8_quantize_cols(ctx, *dy, *offsets, *qdyT, *sdyT);
    fp8_linear_backward(ctx, *x, *w, *dy, Tensor(), *ref, false);
    const auto sxT2 = transposed(*sxT), sdyT2 = transposed(*sdyT);
    for (const auto& [aname, ascale] : {std::pair{"x [P/128, I]", &*sxT}, std::pair{"x [I, P/128]", &**sxT2}})
      for (const auto& [bname, bscale] : {std::pair{"dy [P/128, O]", &*sdyT}, std::pair{"dy [O, P/128]", &**sdyT2}}) {
        const double ms = time_lt(lt, stream, ws, ws_bytes, Mode::fp8_block, s, (*qxT).data(), (*qdyT).data(),
                                  (*dw).data(), ascale->ptr<float>(), bscale->ptr<float>(), 1, 0,
                                  CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F, CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F);
        std::printf("probe wgrad    A %-22s B %-14s %s rel error %.3g\n", aname, bname, ms > 0 ? "ran" : "none",
                    ms > 0 ? rel(*dw, *ref) : -1.0);
      }
  }
  (void)mb;
  std::fflush(stdout);
}

// The experts' grouped GEMMs of one layer under balanced routing (E experts of m rows each):
// forward y = x w^T, dgrad dx = dy w, wgrad dw = dy^T x (f32, written), FP8 in each of
// kernels.fp8_tile's configurations against the bf16 grouped GEMM (kernels.cutlass_tile's
// defaults). FP8 times exclude the activations' quantization (timed apart and subtracted; the
// weight is quantized beforehand, as Fp8WeightCache does once a step).
struct GroupedShape {
  const char* name;
  int64_t e, m, o, i;
};
const GroupedShape kGrouped[] = {
    {"qwen3-30b-a3b fc1", 128, 1024, 1536, 2048},
    {"qwen3-30b-a3b fc2", 128, 1024, 2048, 768},
    {"deepseek-v3 fc1", 256, 256, 4096, 7168},
    {"deepseek-v3 fc2", 256, 256, 7168, 2048},
};

void report_grouped(const GroupedShape& g, const char* kind, const char* impl, double ms) {
  const double flops = 2.0 * static_cast<double>(g.e * g.m) * g.o * g.i;
  std::printf("grouped %-20s %-6s E=%-4lld m=%-5lld O=%-5lld I=%-5lld %-34s %8.3f ms %7.1f TFLOP/s\n", g.name, kind,
              static_cast<long long>(g.e), static_cast<long long>(g.m), static_cast<long long>(g.o),
              static_cast<long long>(g.i), impl, ms, flops / ms * 1e-9);
  std::fflush(stdout);
}

// offsets_E1[e] = e * m (i64 on the device): E experts of m rows each.
void set_equal_offsets(const Tensor& offsets_E1, int64_t m) {
  std::vector<int64_t> off(static_cast<size_t>(offsets_E1.numel()));
  for (size_t e = 0; e < off.size(); ++e) off[e] = static_cast<int64_t>(e) * m;
  device_copy(offsets_E1.data(), Device::cuda, off.data(), Device::cpu, off.size() * sizeof(int64_t));
}

void bench_grouped(int runs, int warmup, const std::vector<std::string>& tiles) {
  const ExecContext& ctx = ExecContext::standard(Device::cuda);
  for (const GroupedShape& g : kGrouped) {
    const int64_t r = g.e * g.m;
    DeviceTensor x({r, g.i}, DType::bf16), w({g.e, g.o, g.i}, DType::bf16), y({r, g.o}, DType::bf16),
        dy({r, g.o}, DType::bf16), dx({r, g.i}, DType::bf16), dw({g.e, g.o, g.i}, DType::f32);
    bench::fill_random(*x, 3);
    bench::fill_random(*w, 4);
    bench::fill_random(*dy, 5);
    DeviceTensor offsets({g.e + 1}, DType::i64);
    set_equal_offsets(*offsets, g.m);
    const int64_t ib = (g.i + kFp8Tile - 1) / kFp8Tile, ob = (g.o + kFp8Tile - 1) / kFp8Tile;
    DeviceTensor qw({g.e, g.o, g.i}, DType::u8), sw({g.e, ob, ib}, DType::f32), qwT({g.e, g.i, g.o}, DType::u8),
        swT({g.e, ib, ob}, DType::f32);
    fp8_quantize_blocks(ctx, *w, *qw, *sw, *qwT, *swT);
    const Fp8Weight wq{*qw, *sw, *qwT, *swT};
    // The activations' quantization passes, timed apart.
    const int64_t p = fp8_cols_width(r, g.e);
    DeviceTensor qx({r, g.i}, DType::u8), sx({ib, r}, DType::f32), qdy({r, g.o}, DType::u8), sdy({ob, r}, DType::f32),
        qxT({g.i, p}, DType::u8), sxT({p / kFp8Tile, g.i}, DType::f32), qdyT({g.o, p}, DType::u8),
        sdyT({p / kFp8Tile, g.o}, DType::f32);
    const double q_fwd = bench::time_ms(runs, warmup, [&] { fp8_quantize_rows(ctx, *x, *qx, *sx); });
    const double q_dgrad = bench::time_ms(runs, warmup, [&] { fp8_quantize_rows(ctx, *dy, *qdy, *sdy); });
    const double q_wgrad = bench::time_ms(runs, warmup, [&] {
      fp8_quantize_cols(ctx, *dy, *offsets, *qdyT, *sdyT);
      fp8_quantize_cols(ctx, *x, *offsets, *qxT, *sxT);
    });
    report_grouped(g, "fwd", "bf16 (CUTLASS grouped)",
                   bench::time_ms(runs, warmup, [&] { grouped_linear_forward(ctx, *x, *w, *offsets, *y); }));
    report_grouped(g, "dgrad", "bf16 (CUTLASS grouped)", bench::time_ms(runs, warmup, [&] {
                     grouped_linear_backward(ctx, *x, *w, *offsets, *dy, *dx, Tensor(), false);
                   }));
    report_grouped(g, "wgrad", "bf16 (CUTLASS grouped)", bench::time_ms(runs, warmup, [&] {
                     grouped_linear_backward(ctx, *x, *w, *offsets, *dy, Tensor(), *dw, false);
                   }));
    // Each configuration twice, in turn: the first FP8 runs after the bf16 ones measured slower
    // whichever configuration it was (an order effect of up to 15%, 2026-12-02). rows=own changes
    // only the forward and dgrad (its wgrad is cooperative's).
    for (const std::string& tile : tiles) {
      KernelOptions k;
      k.fp8_tiles = parse_fp8_tiles(tile, "kernels.fp8_tile");
      const ExecContext c(Device::cuda, k);
      const std::string name = "FP8 " + tile;
      report_grouped(g, "fwd", name.c_str(), bench::time_ms(runs, warmup, [&] {
                                               fp8_grouped_linear_forward(c, *x, *w, *offsets, *y, &wq);
                                             }) - q_fwd);
      report_grouped(g, "dgrad", name.c_str(), bench::time_ms(runs, warmup, [&] {
                                                 fp8_grouped_linear_backward(c, *x, *w, *offsets, *dy, *dx, Tensor(),
                                                                             false, &wq);
                                               }) - q_dgrad);
      if (k.fp8_tiles.rows != Fp8Tile::own)
        report_grouped(g, "wgrad", name.c_str(), bench::time_ms(runs, warmup, [&] {
                                                   fp8_grouped_linear_backward(c, *x, *w, *offsets, *dy, Tensor(), *dw,
                                                                               false, &wq);
                                                 }) - q_wgrad);
    }
    std::printf("grouped %-20s quantize ms: x rows %.3f, dy rows %.3f, dy + x cols %.3f\n", g.name, q_fwd, q_dgrad,
                q_wgrad);
  }
}

// --wgrad-groups: the bf16 weight gradient (bf16 dw written, kernels.cutlass_tile's defaults) of
// DeepSeek-V3's fc1 (256 experts of 256 rows, O 4096, I 7168) against the same work in fewer,
// larger groups (E / 4 experts of O and I twice as large, ...): the same rows per group (the
// GEMM's K), tile shape, FLOPs and bytes written, with a persistent CTA changing groups (and
// rewriting its TMA descriptors) 4, 16, 64 times less often.
void bench_wgrad_groups(int runs, int warmup) {
  const ExecContext& ctx = ExecContext::standard(Device::cuda);
  for (const int64_t scale : {1, 2, 4, 8, 1}) {
    const GroupedShape g{"deepseek-v3 fc1 work", 256 / (scale * scale), 256, 4096 * scale, 7168 * scale};
    const int64_t r = g.e * g.m;
    DeviceTensor x({r, g.i}, DType::bf16), w({g.e, g.o, g.i}, DType::bf16), dy({r, g.o}, DType::bf16),
        dw({g.e, g.o, g.i}, DType::bf16);
    bench::fill_random(*x, 3);
    bench::fill_random(*dy, 5);
    DeviceTensor offsets({g.e + 1}, DType::i64);
    set_equal_offsets(*offsets, g.m);
    report_grouped(g, "wgrad", "bf16 dw written (CUTLASS grouped)", bench::time_ms(runs, warmup, [&] {
                     grouped_linear_backward(ctx, *x, *w, *offsets, *dy, Tensor(), *dw, false);
                   }));
  }
}

// --wgrad-own: the bf16 weight gradient at the expert shapes on CUTLASS's large tiles and on the
// own kernel in each cluster size (2: kernels.cutlass_tile wgrad = own's), in turn, twice: bf16 dw
// written (a step's first micro-batch), bf16 dw accumulated (its later ones), f32 dw written; the
// DeepSeek-V3 fc1 shape also with uneven experts (128 to 383 rows, the same total: real routing's
// spread).
void bench_wgrad_own(int runs, int warmup, const std::string& only, const std::vector<int>& clusters,
                     const std::vector<int>& units, int rest_ms) {
  struct Case {
    GroupedShape g;
    bool uneven;
  };
  std::vector<Case> cases;
  for (const GroupedShape& g : kGrouped) cases.push_back({g, false});
  cases.push_back({{"deepseek-v3 fc1 uneven", 256, 256, 4096, 7168}, true});
  if (!only.empty()) {
    std::erase_if(cases, [&](const Case& c) { return c.g.name != only; });
    MF_CHECK(!cases.empty(), "bench_fp8_gemm --wgrad-case: no shape named '", only, "'");
  }
  for (const auto& [g, uneven] : cases) {
    const int64_t r = g.e * g.m;
    DeviceTensor x({r, g.i}, DType::bf16), w({g.e, g.o, g.i}, DType::bf16), dy({r, g.o}, DType::bf16),
        dw16({g.e, g.o, g.i}, DType::bf16), dw32({g.e, g.o, g.i}, DType::f32), offsets({g.e + 1}, DType::i64);
    bench::fill_random(*x, 3);
    bench::fill_random(*dy, 5);
    set_equal_offsets(*offsets, g.m);
    if (uneven) {
      std::vector<int64_t> off(static_cast<size_t>(g.e + 1), 0);
      for (int64_t e = 0; e < g.e; ++e) {  // pairs of m - d and m + d rows, d from 0 to 127
        const int64_t d = (e / 2 * 37) % 128;
        off[static_cast<size_t>(e + 1)] = off[static_cast<size_t>(e)] + (e % 2 == 0 ? g.m - d : g.m + d);
      }
      device_copy((*offsets).data(), Device::cuda, off.data(), Device::cpu, off.size() * sizeof(int64_t));
    }
    const ExecContext& c = ExecContext::standard(Device::cuda);
    KernelOptions k;
    k.cutlass_tiles = parse_cutlass_tiles("wgrad=large", "kernels.cutlass_tile");
    const ExecContext large(Device::cuda, k);
    for (int round = 0; round < 2; ++round) {
      // CUTLASS's large tiles, then the own kernel in each cluster size and unit.
      for (size_t v = 0; v <= clusters.size() * units.size(); ++v) {
        const int cluster = v == 0 ? 0 : clusters[(v - 1) / units.size()],
                  unit = v == 0 ? 0 : units[(v - 1) % units.size()];
        const std::string name =
            v == 0 ? "wgrad=large"
                   : cat("own, clusters of ", cluster, unit == 1 ? std::string() : cat(", units of ", unit));
        const auto time = [&](const Tensor& dw, bool accumulate) {
          return bench::time_ms(
              runs, warmup,
              [&] {
                if (v == 0)
                  grouped_linear_backward(large, *x, *w, *offsets, *dy, Tensor(), dw, accumulate);
                else
                  cuda::own_grouped_wgrad(c, *x, *dy, *offsets, dw, accumulate, "bench", cluster, unit);
              },
              rest_ms);
        };
        report_grouped(g, "wgrad", cat(name, ", bf16 written").c_str(), time(*dw16, false));
        report_grouped(g, "wgrad", cat(name, ", bf16 added").c_str(), time(*dw16, true));
        report_grouped(g, "wgrad", cat(name, ", f32 written").c_str(), time(*dw32, false));
      }
    }
  }
}

// --wgrad-split 'S;...': a grouped linear's data gradient (CUTLASS, the default tiles) and its
// bf16 weight gradient (written; the own kernel and CUTLASS's large tiles) one after the other on
// every SM, against both at once on two streams of their own, the weight gradient on S SMs
// (kernels.gemm_sms) and the data gradient on the rest: whether the weight gradient's stores
// overlap the data gradient's math when the two share the GPU. Times each alone first. (Session
// 41, H100: every split slower than the sequence, 1.02-1.51x; docs/benchmarks.md.)
void bench_wgrad_split(int runs, int warmup, const std::string& only, const std::vector<int>& splits, int rest_ms) {
  int sms = 0;
  MF_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) == cudaSuccess, "no GPU");
  for (const GroupedShape& g : kGrouped) {
    if (!only.empty() ? g.name != only : std::string(g.name).rfind("deepseek-v3", 0) != 0) continue;
    const int64_t r = g.e * g.m;
    DeviceTensor x({r, g.i}, DType::bf16), w({g.e, g.o, g.i}, DType::bf16), dy({r, g.o}, DType::bf16),
        dx({r, g.i}, DType::bf16), dw({g.e, g.o, g.i}, DType::bf16), offsets({g.e + 1}, DType::i64);
    bench::fill_random(*x, 3);
    bench::fill_random(*dy, 5);
    // w (15 GB at fc1) as copies of x's random values: filling it on the host would take minutes.
    const size_t piece = (*x).nbytes();
    for (size_t at = 0, n = (*w).nbytes(); at < n; at += piece)
      device_copy(static_cast<char*>((*w).data()) + at, Device::cuda, (*x).data(), Device::cuda,
                  std::min(piece, n - at));
    set_equal_offsets(*offsets, g.m);
    const ExecContext& primary = ExecContext::standard(Device::cuda);
    const auto options = [](int gemm_sms, bool own) {
      KernelOptions k;
      k.cutlass_tiles = parse_cutlass_tiles(own ? "wgrad=own" : "wgrad=large", "kernels.cutlass_tile");
      k.gemm_sms = gemm_sms;
      return k;
    };
    for (int round = 0; round < 2; ++round) {
      for (const bool own : {true, false}) {
        const char* impl = own ? "own" : "large";
        const ExecContext all(Device::cuda, options(0, own));
        const auto dgrad = [&](const ExecContext& c) {
          grouped_linear_backward(c, *x, *w, *offsets, *dy, *dx, Tensor(), false);
        };
        const auto wgrad = [&](const ExecContext& c) {
          grouped_linear_backward(c, *x, *w, *offsets, *dy, Tensor(), *dw, false);
        };
        const auto time = [&](const std::function<void()>& f) { return bench::time_ms(runs, warmup, f, rest_ms); };
        const double d = time([&] { dgrad(all); }), wg = time([&] { wgrad(all); });
        const double both = time([&] {
          dgrad(all);
          wgrad(all);
        });
        std::printf("%-18s %-6s dgrad %.3f ms, wgrad %.3f ms, sum %.3f, one after the other %.3f\n", g.name, impl, d,
                    wg, d + wg, both);
        for (const int s : splits) {
          MF_CHECK(s > 0 && s < sms, "bench_fp8_gemm --wgrad-split: ", s, " SMs of ", sms);
          const ExecContext cd(Device::cuda, options(sms - s, own), ExecContext::Stream::own),
              cw(Device::cuda, options(s, own), ExecContext::Stream::own);
          const double ms = time([&] {
            cd.wait_for(primary);
            cw.wait_for(primary);
            wgrad(cw);
            dgrad(cd);
            primary.wait_for(cd);
            primary.wait_for(cw);
          });
          std::printf("%-18s %-6s at once, wgrad on %3d SMs, dgrad on %3d: %.3f ms (%.3f of one after the other)\n",
                      g.name, impl, s, sms - s, ms, ms / both);
        }
      }
    }
  }
}

// --quantize: the rows and cols layouts (ops/fp8.h) of bf16 activations as the FP8 linears
// quantize them: the experts' output gradient dy [65536, 2048] and [65536, 1536] of 128 experts
// of 512 rows (rows with the grouped GEMM's scales, launch_fp8_quantize_rows with the offsets on
// the device; cols in the experts' segments) and a dense [8192, 4096] (rows without offsets, cols
// as one segment), and both in one pass (launch_fp8_quantize_rows_cols, the FP8 backward's dy),
// then the experts' x [65536, 2048] as packed FP8 rows in 128 segments, cols only, and the experts'
// fc1 weight into blocks with its transpose.
// Cols times include the tile map's kernel. Effective GB/s: x read plus the codes and scales
// written.
void bench_quantize(int runs, int warmup) {
  const ExecContext& ctx = ExecContext::standard(Device::cuda);
  struct Case {
    const char* name;
    int64_t rows, cols, experts;  // experts == 0: dense
  };
  for (const Case& c :
       {Case{"experts dy", 65536, 2048, 128}, Case{"experts dy", 65536, 1536, 128}, Case{"dense x", 8192, 4096, 0}}) {
    const int64_t segments = std::max<int64_t>(c.experts, 1), kb = (c.cols + kFp8Tile - 1) / kFp8Tile;
    const int64_t p = fp8_cols_width(c.rows, segments);
    const int64_t col_tiles = segments * ((c.rows / segments + kFp8Tile - 1) / kFp8Tile);  // the tiles written
    DeviceTensor x({c.rows, c.cols}, DType::bf16), q({c.rows, c.cols}, DType::u8), s({kb, c.rows}, DType::f32),
        qT({c.cols, p}, DType::u8), sT({p / kFp8Tile, c.cols}, DType::f32), offsets({segments + 1}, DType::i64);
    bench::fill_random(*x, 11);
    set_equal_offsets(*offsets, c.rows / segments);
    const double rows_ms = bench::time_ms(runs, warmup, [&] {
      if (c.experts > 0)
        cuda::launch_fp8_quantize_rows(ctx, (*x).data(), DType::bf16, c.rows, c.cols, (*q).ptr<uint8_t>(),
                                       (*s).ptr<float>(), (*offsets).ptr<int64_t>(), c.experts);
      else
        fp8_quantize_rows(ctx, *x, *q, *s);
    });
    const double cols_ms = bench::time_ms(runs, warmup, [&] { fp8_quantize_cols(ctx, *x, *offsets, *qT, *sT); });
    // Both in one pass (the backward's dy: launch_fp8_quantize_rows_cols, rows scales grouped).
    const double both_ms = bench::time_ms(runs, warmup, [&] {
      cuda::launch_fp8_quantize_rows_cols(
          ctx, (*x).data(), DType::bf16, c.rows, c.cols, c.experts > 0 ? (*offsets).ptr<int64_t>() : nullptr, segments,
          true, (*q).ptr<uint8_t>(), (*s).ptr<float>(), p, (*qT).ptr<uint8_t>(), (*sT).ptr<float>());
    });
    const double elems = static_cast<double>(c.rows) * c.cols;
    const double rows_bytes = 3 * elems + 4.0 * kb * c.rows, cols_bytes = 3 * elems + 4.0 * col_tiles * c.cols;
    const double both_bytes = 4 * elems + 4.0 * kb * c.rows + 4.0 * col_tiles * c.cols;
    std::printf(
        "quantize %-10s [%6lld, %4lld] %3lld segments  rows %7.3f ms %6.0f GB/s  cols %7.3f ms %6.0f GB/s  "
        "rows + cols in one pass %7.3f ms %6.0f GB/s\n",
        c.name, static_cast<long long>(c.rows), static_cast<long long>(c.cols), static_cast<long long>(segments),
        rows_ms, rows_bytes / rows_ms * 1e-6, cols_ms, cols_bytes / cols_ms * 1e-6, both_ms,
        both_bytes / both_ms * 1e-6);
    std::fflush(stdout);
  }
  // The experts' fc1 output gradient dgu [65536, 1536] from the SwiGLU's backward: swiglu_backward
  // then the one pass over the written dgu, against fp8_swiglu_backward_operands (dgu computed as
  // the one pass loads it). GB/s of the fused pass: gu and dh read, both operands written.
  {
    const int64_t r = 65536, f = 768, e = 128, kb2 = 2 * f / kFp8Tile, p2 = fp8_cols_width(r, e);
    DeviceTensor gu({r, 2 * f}, DType::bf16), dh({r, f}, DType::bf16), dgu({r, 2 * f}, DType::bf16),
        both({fp8_shared_operand_bytes(r, 2 * f, e, true)}, DType::u8), offsets({e + 1}, DType::i64),
        q({r, 2 * f}, DType::u8), s({kb2, r}, DType::f32), qT({2 * f, p2}, DType::u8),
        sT({p2 / kFp8Tile, 2 * f}, DType::f32);
    bench::fill_random(*gu, 13);
    bench::fill_random(*dh, 14);
    set_equal_offsets(*offsets, r / e);
    const double apart = bench::time_ms(runs, warmup, [&] {
      swiglu_backward(ctx, *gu, *dh, *dgu, GateUp::pairs);
      cuda::launch_fp8_quantize_rows_cols(ctx, (*dgu).data(), DType::bf16, r, 2 * f, (*offsets).ptr<int64_t>(), e, true,
                                          (*q).ptr<uint8_t>(), (*s).ptr<float>(), p2, (*qT).ptr<uint8_t>(),
                                          (*sT).ptr<float>());
    });
    Fp8SharedOperands dyq;
    dyq.bytes = *both;
    const double fused = bench::time_ms(runs, warmup, [&] {
      fp8_swiglu_backward_operands(ctx, *gu, *dh, *offsets, *dgu, dyq);
      dyq.reset();
    });
    const double bytes = 2.0 * r * 3 * f + 2.0 * r * 2 * f + 4.0 * kb2 * r + 4.0 * (r / kFp8Tile) * 2 * f;
    std::printf(
        "quantize experts dgu [%6lld, %4lld] %3lld segments  swiglu_backward + one pass %7.3f ms  "
        "fused (fp8_swiglu_backward_operands) %7.3f ms %6.0f GB/s\n",
        static_cast<long long>(r), static_cast<long long>(2 * f), static_cast<long long>(e), apart, fused,
        bytes / fused * 1e-6);
    std::fflush(stdout);
  }
  // The experts' x when it came packed (moe.fp8_dispatch): its cols layout for the weight gradient
  // (launch_fp8_quantize_cols_packed); GB/s: the packed rows read (codes and scales) plus the codes
  // and scales written.
  const int64_t rows = 65536, cols = 2048, segments = 128, kb = cols / kFp8Tile, w = fp8_packed_width(cols);
  const int64_t p = fp8_cols_width(rows, segments), col_tiles = rows / kFp8Tile;
  DeviceTensor x({rows, cols}, DType::bf16), packed({rows, w}, DType::u8), qT({cols, p}, DType::u8),
      sT({p / kFp8Tile, cols}, DType::f32), offsets({segments + 1}, DType::i64);
  bench::fill_random(*x, 12);
  fp8_quantize_packed(ctx, *x, *packed);
  set_equal_offsets(*offsets, rows / segments);
  const double ms = bench::time_ms(runs, warmup, [&] {
    cuda::launch_fp8_quantize_cols_packed(ctx, (*packed).ptr<uint8_t>(), rows, cols, (*offsets).ptr<int64_t>(),
                                          segments, p, (*qT).ptr<uint8_t>(), (*sT).ptr<float>());
  });
  const double bytes = 2.0 * rows * cols + 4.0 * kb * rows + 4.0 * col_tiles * cols;
  std::printf("quantize experts x packed [%6lld, %4lld] %3lld segments  cols %7.3f ms %6.0f GB/s\n",
              static_cast<long long>(rows), static_cast<long long>(cols), static_cast<long long>(segments), ms,
              bytes / ms * 1e-6);
  std::fflush(stdout);
  // The experts' fc1 weight [128, 1536, 2048] into blocks with the transposed copy (once a step):
  // from its bf16 copy, and from an f32 master via bf16 (train.fp8_param). GB/s: w read, q and qT
  // written.
  const int64_t e = 128, o = 1536, i = 2048;
  for (DType dt : {DType::bf16, DType::f32}) {
    DeviceTensor weight({e, o, i}, dt), q({e, o, i}, DType::u8), qT({e, i, o}, DType::u8),
        sb({e, o / kFp8Tile, i / kFp8Tile}, DType::f32), sbT({e, i / kFp8Tile, o / kFp8Tile}, DType::f32);
    bench::fill_random(*weight, 13);
    const bool via_bf16 = dt == DType::f32;
    const double bms =
        bench::time_ms(runs, warmup, [&] { fp8_quantize_blocks(ctx, *weight, *q, *sb, *qT, *sbT, via_bf16); });
    const double elems = static_cast<double>(e) * o * i;
    std::printf("quantize experts w %s [%lld, %lld, %lld] blocks + transposed %7.3f ms %6.0f GB/s\n",
                via_bf16 ? "f32 via bf16" : "bf16", static_cast<long long>(e), static_cast<long long>(o),
                static_cast<long long>(i), bms, (dtype_size(dt) + 2.0) * elems / bms * 1e-6);
    std::fflush(stdout);
  }
}

// "a;b;c" -> {"a", "b", "c"} (an empty piece between two ';' stays, as one after a trailing ';').
std::vector<std::string> split_semicolons(const std::string& list) {
  std::vector<std::string> pieces;
  for (size_t at = 0; at <= list.size();) {
    const size_t semi = std::min(list.find(';', at), list.size());
    pieces.push_back(list.substr(at, semi - at));
    at = semi + 1;
  }
  return pieces;
}

int run(int argc, char** argv) {
  int runs = 20, warmup = 3, rest_ms = 0;
  bool dense = true, grouped = true, probe = false, wgrad_groups = false, wgrad_own = false, quantize = false;
  std::vector<std::string> tiles = {"cooperative", "rows=own", "cooperative", "rows=own"};
  std::string wgrad_case;
  std::vector<int> clusters = {2, 1}, units = {1}, splits;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--tiles" && i + 1 < argc) {  // kernels.fp8_tile values separated by ';'
      tiles = split_semicolons(argv[++i]);
    } else if (a == "--probe-layouts")
      probe = true;
    else if (a == "--wgrad-groups")
      wgrad_groups = true;
    else if (a == "--wgrad-own")
      wgrad_own = true;
    else if (a == "--wgrad-case" && i + 1 < argc)
      wgrad_case = argv[++i];
    else if (a == "--wgrad-clusters" && i + 1 < argc) {  // 'C;C;...'
      clusters.clear();
      for (const std::string& c : split_semicolons(argv[++i])) clusters.push_back(std::atoi(c.c_str()));
    } else if (a == "--wgrad-units" && i + 1 < argc) {  // 'U;U;...'
      units.clear();
      for (const std::string& u : split_semicolons(argv[++i])) units.push_back(std::atoi(u.c_str()));
    } else if (a == "--wgrad-split" && i + 1 < argc) {  // 'S;S;...'
      for (const std::string& sm : split_semicolons(argv[++i])) splits.push_back(std::atoi(sm.c_str()));
    } else if (a == "--quantize")
      quantize = true;
    else if (a == "--grouped-only")
      dense = false;
    else if (a == "--dense-only")
      grouped = false;
    else if (a == "--runs" && i + 1 < argc)
      runs = std::atoi(argv[++i]);
    else if (a == "--warmup" && i + 1 < argc)
      warmup = std::atoi(argv[++i]);
    else if (a == "--rest-ms" && i + 1 < argc)
      rest_ms = std::atoi(argv[++i]);
    else
      MF_FAIL("usage: bench_fp8_gemm [--runs N] [--warmup N] [--tiles 'a;b;...'] [--grouped-only | --dense-only | ",
              "--probe-layouts | --wgrad-groups | --wgrad-own [--wgrad-case NAME] [--wgrad-clusters 'C;...'] ",
              "[--wgrad-units 'U;...'] [--rest-ms N] | --wgrad-split 'S;...' | --quantize] (got '", a, "')");
  }
  if (quantize) {
    bench_quantize(runs, warmup);
    return 0;
  }
  if (wgrad_groups) {
    bench_wgrad_groups(runs, warmup);
    return 0;
  }
  if (!splits.empty()) {
    bench_wgrad_split(runs, warmup, wgrad_case, splits, rest_ms);
    return 0;
  }
  if (wgrad_own) {
    bench_wgrad_own(runs, warmup, wgrad_case, clusters, units, rest_ms);
    return 0;
  }
  if (probe) {
    cublasLtHandle_t lt;
    LT_CHECK(cublasLtCreate(&lt));
    const size_t ws_bytes = size_t{32} << 20;
    DeviceTensor ws({static_cast<int64_t>(ws_bytes)}, DType::u8);
    probe_layouts(lt, (*ws).data(), ws_bytes);
    cublasLtDestroy(lt);
    return 0;
  }
  if (grouped) bench_grouped(runs, warmup, tiles);
  if (!dense) return 0;
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

// GPU parity of cuDNN's fused attention (ops/cuda/attention_cudnn.h) through the ops.h entry
// points with kernels.attention = cudnn (cuDNN serves every call or the call fails): forward and
// backward against the CPU ops run in float64 on exactly the GPU's (bf16-rounded) inputs, at head
// dims 64, 128 and 192 (192 when this cuDNN takes it), GQA ratios Q/G = 1 and 4, S not a multiple
// of 64, batch 2. Outputs start poisoned (NaN); backward runs twice (deterministic: bit-identical).
// With kernels.attention = auto, problems cuDNN does not take (head dims 4 and 12, f32) go to the
// own kernel, and head dim 8 works whichever serves it. Skipped without a GPU, or without cuDNN in
// the build (the reason is printed).
// Tolerances (relative Frobenius error, as in test_ops_cuda_attention.cpp):
// - out, dq, dk, dv (bf16): 1e-2. Each output is one bf16 rounding of a float result (2^-9 at
//   most, ~1.1e-3 RMS) plus cuDNN's flash-attention roundings inside: P is rounded to bf16 before
//   P V and P^T dO, dS before dS K and dS^T Q (~1.1e-3 RMS relative per term, averaging over the
//   keys rather than adding up), so about 2-4e-3 in all; 1e-2 leaves a margin of 2.5 or more,
//   while a wrong mask, scale, GQA head mapping or stride gives errors of order 1.
// - lse (f32 on the GPU): 1e-4. Float scores of exact bf16 products and a float log-sum-exp: a few
//   float roundings (~1e-6), with room for approximate exp2/log2 instructions; base-2 stats or a
//   missing scale would be off by tens of percent.
// - f32 problems fall back to the own kernel: its f32 tolerance, 1e-5 (test_ops_cuda_attention.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "cuda_testing.h"
#include "moefold/core/device.h"
#include "moefold/ops/cuda/attention_cudnn.h"
#include "moefold/ops/ops.h"

namespace moefold {
namespace {

#ifdef MOEFOLD_WITH_CUDA

using testing::DevicePool;
using testing::download;
using testing::Pool;
using testing::rel_error;
using testing::rounded;

constexpr double kBf16Tol = 1e-2;
constexpr double kLseTol = 1e-4;
constexpr double kF32Tol = 1e-5;

double tol(DType dt) { return dt == DType::f32 ? kF32Tol : kBf16Tol; }

// Skips without cuDNN in the build, with the reason CMake recorded (why cuDNN's path is off).
#define MF_REQUIRE_CUDNN()                                                                            \
  do {                                                                                                \
    if (!cuda::cudnn_attention_built()) {                                                             \
      std::string mf_why_;                                                                            \
      cuda::cudnn_attention_supported(testing::exec(), Case{128, 4, 4, 64}.problem(false), &mf_why_); \
      GTEST_SKIP() << mf_why_;                                                                        \
    }                                                                                                 \
  } while (0)

// A GPU context whose kernels.attention is `choice`.
KernelOptions attention(AttentionKernel choice) {
  KernelOptions k;
  k.attention = choice;
  return k;
}

struct Case {
  int64_t s, nq, ng, d;
  double scale = 0;  // 0: 1/sqrt(D)

  double softmax_scale() const { return scale != 0 ? scale : 1.0 / std::sqrt(static_cast<double>(d)); }
  std::string name() const {
    return "B=2 S=" + std::to_string(s) + " Q=" + std::to_string(nq) + " G=" + std::to_string(ng) +
           " D=" + std::to_string(d) + " scale=" + std::to_string(softmax_scale());
  }
  cuda::CudnnAttentionProblem problem(bool backward) const {
    return {2, s, nq, ng, d, DType::bf16, softmax_scale(), backward, true};
  }
};

enum class Expect { cudnn, own, any };

void expect_impl(Expect want, bool backward) {
  if (want == Expect::any) return;
  const cuda::AttentionImpl got = cuda::last_attention_impl(backward);
  EXPECT_EQ(got, want == Expect::cudnn ? cuda::AttentionImpl::cudnn : cuda::AttentionImpl::own)
      << (backward ? "backward" : "forward") << " served by " << cuda::attention_impl_name(got);
}

// Forward and backward of `c` on the GPU in `dt` (through ops.h, whatever ctx's kernels.attention says)
// against the CPU in f64. Backward gets the reference's out and lse (rounded as the GPU stores
// them), so its error is its own.
void check_parity(const ExecContext& ctx, const Case& c, DType dt, Expect want) {
  SCOPED_TRACE(c.name() + " " + std::string(dtype_name(dt)) +
               " (MOEFOLD_TEST_SEED=" + std::to_string(testing::fresh_seed()) + ")");
  Pool pool;
  DevicePool dev;
  const int64_t b = 2;
  const double scale = c.softmax_scale();
  const Shape q_shape{b, c.s, c.nq, c.d}, kv_shape{b, c.s, c.ng, c.d}, lse_shape{b, c.nq, c.s};
  Tensor q = pool.randn(q_shape), k = pool.randn(kv_shape), v = pool.randn(kv_shape), dout = pool.randn(q_shape);
  Tensor qr = rounded(pool, q, dt), kr = rounded(pool, k, dt), vr = rounded(pool, v, dt),
         doutr = rounded(pool, dout, dt);
  Tensor work = pool.zeros({2 * c.s * c.s});

  Tensor out = pool.zeros(q_shape), lse = pool.zeros(lse_shape);
  attention_forward(ctx, qr, kr, vr, scale, out, lse, work);
  Tensor qd = dev.upload(q, dt), kd = dev.upload(k, dt), vd = dev.upload(v, dt), doutd = dev.upload(dout, dt);
  Tensor outd = dev.poisoned(q_shape, dt), lsed = dev.poisoned(lse_shape, DType::f32);
  attention_forward(ctx, qd, kd, vd, scale, outd, lsed, Tensor());
  expect_impl(want, false);
  EXPECT_LE(rel_error(download(outd), out), tol(dt)) << "out";
  EXPECT_LE(rel_error(download(lsed), lse), dt == DType::f32 ? kF32Tol : kLseTol) << "lse";

  Tensor outr = rounded(pool, out, dt), lser = rounded(pool, lse, DType::f32);
  Tensor dq = pool.zeros(q_shape), dk = pool.zeros(kv_shape), dv = pool.zeros(kv_shape);
  attention_backward(ctx, qr, kr, vr, outr, lser, doutr, scale, dq, dk, dv, work);
  Tensor outd2 = dev.upload(out, dt), lsed2 = dev.upload(lse, DType::f32);
  std::vector<double> first[3];
  for (int rep = 0; rep < 2; ++rep) {
    Tensor dqd = dev.poisoned(q_shape, dt), dkd = dev.poisoned(kv_shape, dt), dvd = dev.poisoned(kv_shape, dt);
    attention_backward(ctx, qd, kd, vd, outd2, lsed2, doutd, scale, dqd, dkd, dvd, Tensor());
    expect_impl(want, true);
    const std::vector<double> got[3] = {download(dqd), download(dkd), download(dvd)};
    if (rep == 0) {
      EXPECT_LE(rel_error(got[0], dq), tol(dt)) << "dq";
      EXPECT_LE(rel_error(got[1], dk), tol(dt)) << "dk";
      EXPECT_LE(rel_error(got[2], dv), tol(dt)) << "dv";
      for (int i = 0; i < 3; ++i) first[i] = got[i];
    } else {
      for (int i = 0; i < 3; ++i) EXPECT_TRUE(got[i] == first[i]) << "backward output " << i << " not deterministic";
    }
  }
}

// S in {130, 200, 333} (never a multiple of 64: ragged last tiles), Q/G = 1 (4/4) and 4 (8/2),
// head dims 64, 128, 192; one sharper softmax (scale 0.3, about 2.4 / sqrt(64)).
const Case kCases[] = {
    {200, 4, 4, 64},  {333, 8, 2, 64},  {130, 8, 2, 64, 0.3}, {200, 8, 2, 128},
    {130, 4, 4, 128}, {200, 4, 4, 192}, {333, 8, 2, 192},
};

TEST(CudnnAttention, ForcedCudnnMatchesCpu) {
  MF_REQUIRE_GPU();
  MF_REQUIRE_CUDNN();
  std::cout << "[ INFO     ] cuDNN runtime " << cuda::cudnn_runtime_version() << ", frontend "
            << cuda::cudnn_frontend_version() << "\n";
  const ExecContext ctx(Device::cuda, attention(AttentionKernel::cudnn));
  for (const Case& c : kCases) {
    std::string why;
    const bool supported = cuda::cudnn_attention_supported(ctx, c.problem(false), &why) &&
                           cuda::cudnn_attention_supported(ctx, c.problem(true), &why);
    if (!supported && c.d == 192) {  // the brief's "192 if supported": say so, do not fail
      std::cout << "[ INFO     ] cuDNN does not take " << c.name() << ": " << why << "\n";
      continue;
    }
    ASSERT_TRUE(supported) << c.name() << ": " << why;
    check_parity(ctx, c, DType::bf16, Expect::cudnn);
  }
}

// Auto: cuDNN takes the bf16 head-dim-64 problem; head dims that are not multiples of 8, and f32,
// go to the own kernel; head dim 8 (cuDNN may take it or not) works either way. "own" is obeyed.
TEST(CudnnAttention, AutoFallsBackToOwnKernel) {
  MF_REQUIRE_GPU();
  const ExecContext ctx(Device::cuda, attention(AttentionKernel::automatic));
  if (cuda::cudnn_attention_built()) check_parity(ctx, {200, 8, 2, 64}, DType::bf16, Expect::cudnn);
  check_parity(ctx, {200, 8, 2, 4}, DType::bf16, Expect::own);
  check_parity(ctx, {130, 4, 4, 12}, DType::bf16, Expect::own);
  check_parity(ctx, {200, 8, 2, 8}, DType::bf16, Expect::any);
  check_parity(ctx, {130, 8, 2, 64}, DType::f32, Expect::own);
  const ExecContext own(Device::cuda, attention(AttentionKernel::own));
  check_parity(own, {130, 8, 2, 64}, DType::bf16, Expect::own);
}

// Forced cuDNN on a problem it cannot serve fails with the reason instead of falling back.
TEST(CudnnAttention, ForcedCudnnRefusesLoudly) {
  MF_REQUIRE_GPU();
  MF_REQUIRE_CUDNN();
  const ExecContext ctx(Device::cuda, attention(AttentionKernel::cudnn));
  DevicePool dev;
  const auto run = [&](int64_t d, DType dt) {
    Tensor q = dev.poisoned({1, 16, 2, d}, dt), k = dev.poisoned({1, 16, 1, d}, dt);
    Tensor out = dev.poisoned({1, 16, 2, d}, dt), lse = dev.poisoned({1, 2, 16}, DType::f32);
    return testing::error_of([&] { attention_forward(ctx, q, k, k, 0.5, out, lse, Tensor()); });
  };
  EXPECT_NE(run(4, DType::bf16).find("head dim 4"), std::string::npos) << run(4, DType::bf16);
  EXPECT_NE(run(64, DType::f32).find("bf16"), std::string::npos) << run(64, DType::f32);
  EXPECT_NE(run(64, DType::f32).find("kernels.attention = cudnn"), std::string::npos) << run(64, DType::f32);
}

// Graphs and workspace are made on the first call of a shape: later steps allocate nothing.
TEST(CudnnAttention, StepsAfterTheFirstDoNotAllocate) {
  MF_REQUIRE_GPU();
  MF_REQUIRE_CUDNN();
  const ExecContext ctx(Device::cuda, attention(AttentionKernel::cudnn));
  Pool pool;
  DevicePool dev;
  const int64_t b = 2, s = 200, nq = 8, ng = 2, d = 128;
  const Shape q_shape{b, s, nq, d}, kv_shape{b, s, ng, d}, lse_shape{b, nq, s};
  Tensor q = dev.upload(pool.randn(q_shape), DType::bf16), k = dev.upload(pool.randn(kv_shape), DType::bf16),
         v = dev.upload(pool.randn(kv_shape), DType::bf16), dout = dev.upload(pool.randn(q_shape), DType::bf16);
  Tensor out = dev.empty(q_shape, DType::bf16), lse = dev.empty(lse_shape, DType::f32);
  Tensor dq = dev.empty(q_shape, DType::bf16), dk = dev.empty(kv_shape, DType::bf16),
         dv = dev.empty(kv_shape, DType::bf16);
  const auto step = [&] {
    attention_forward(ctx, q, k, v, 0.1, out, lse, Tensor());
    attention_backward(ctx, q, k, v, out, lse, dout, 0.1, dq, dk, dv, Tensor());
  };
  step();
  const int64_t mallocs = device_malloc_count();
  for (int i = 0; i < 3; ++i) step();
  device_synchronize();
  EXPECT_EQ(device_malloc_count(), mallocs);
}

#else

TEST(CudnnAttention, NeedsCuda) { GTEST_SKIP() << "built without CUDA (no nvcc)"; }

#endif

}  // namespace
}  // namespace moefold

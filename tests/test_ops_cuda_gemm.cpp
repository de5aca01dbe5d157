// GPU parity, GEMMs through cuBLASLt (ops/cuda/gemm.cu): the row-major wrapper (through matmul on
// views and directly), linear and grouped linear forward and backward, against the CPU ops run in
// float64 on exactly the GPU's inputs (rounded through the GPU's storage dtype).
//
// Tolerances (Frobenius relative error, tests/cuda_testing.h):
// - f32 x f32 -> f32, full fp32 (no TF32): 1e-6 * sqrt(K). A K-long fp32 dot product is off by
//   about 2^-24 * sqrt(K) relative (rounding errors of the partial sums add like a random walk);
//   the bound leaves a 15x margin, while TF32 (10-bit mantissa, ~5e-4) fails it by far.
// - bf16 x bf16 -> f32: 1e-5 (1e-6 * sqrt(K) past K = 100). The bf16 products are exact in fp32,
//   so only the fp32 accumulation errs, as in the f32 case.
// - bf16 x bf16 -> bf16: 4e-3. One rounding of the fp32 result to bf16: 2^-9 relative per element
//   at worst, ~1.7e-3 relative in practice. Partial sums rounded through bf16 (a split-K reduction
//   in the output type) would add a rounding per split; the long-K case checks that they do not.
// Measured on an H200: f32 5e-8..5e-7, bf16 -> f32 3e-8..1.3e-6, bf16 -> bf16 1.6e-3..2.4e-3. With
// TF32 forced (CUBLAS_COMPUTE_32F_FAST_TF32), 7 of the 10 tests fail on their f32 checks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda_testing.h"
#include "moefold/ops/moe_ops.h"
#include "moefold/ops/ops.h"

#ifdef MOEFOLD_WITH_CUDA
#include "moefold/ops/cuda/gemm.h"
#include "moefold/ops/cuda/grouped_gemm_cutlass.h"
#include "moefold/ops/cuda/wgrad_grouped_gemm.h"
#endif

namespace moefold {
namespace {

using testing::DevicePool;
using testing::Pool;

// The tolerance for an output of dtype `out` from operands of dtype `in` summed over k terms (the
// header's table; bf16 operands into f32 get the f32 bound where it is looser, for very long K).
double tolerance(DType in, DType out, int64_t k) {
  if (out == DType::bf16) return 4e-3;
  const double fp32 = 1e-6 * std::sqrt(static_cast<double>(std::max<int64_t>(k, 1)));
  return in == DType::bf16 ? std::max(1e-5, fp32) : fp32;
}

// One stored matrix (rows x cols, row stride ld, `offset` elements in) on the host in f64 (the
// reference's copy, rounded through the GPU dtype) and on the device.
struct Operand {
  Tensor ref;  // f64 host storage, rounded
  Tensor dev;  // device storage in the GPU dtype
  MatrixView ref_view() const { return MatrixView{ref, rows, cols, ld, offset}; }
  MatrixView dev_view() const { return MatrixView{dev, rows, cols, ld, offset}; }
  int64_t rows = 0, cols = 0, ld = 0, offset = 0;
};

// poison: the device copy holds NaN bytes everywhere (an output that must be WRITTEN).
Operand make_operand(Pool& pool, DevicePool& dev, DType dt, int64_t rows, int64_t cols, int64_t pad, int64_t offset,
                     bool poison) {
  Operand o;
  o.rows = rows;
  o.cols = cols;
  o.ld = std::max<int64_t>(1, cols + pad);
  o.offset = offset;
  const Tensor host = pool.randn({offset + rows * o.ld + 1});
  o.ref = testing::rounded(pool, host, dt);
  o.dev = poison ? dev.poisoned(host.shape(), dt) : dev.upload(host, dt);
  return o;
}

struct GemmCase {
  int64_t m, n, k;
  bool trans_a, trans_b;
  DType ab, c;
  int64_t pad, offset;  // extra leading dimension and starting offset of every operand
  double alpha, beta;   // beta == 0: c starts as NaN bytes
};

// Runs one case through matmul (or the raw wrapper) and checks c's view against the f64 reference
// and every element outside the view for being untouched.
void check_case(const GemmCase& g, bool through_wrapper = false) {
  SCOPED_TRACE(::testing::Message() << "m " << g.m << " n " << g.n << " k " << g.k << " trans " << g.trans_a
                                    << g.trans_b << " " << dtype_name(g.ab) << " -> " << dtype_name(g.c) << " pad "
                                    << g.pad << " offset " << g.offset << " alpha " << g.alpha << " beta " << g.beta);
  Pool pool;
  DevicePool dev;
  const bool poison = g.beta == 0.0;
  Operand a = make_operand(pool, dev, g.ab, g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, g.pad, g.offset, false);
  Operand b = make_operand(pool, dev, g.ab, g.trans_b ? g.n : g.k, g.trans_b ? g.k : g.n, g.pad, g.offset, false);
  Operand c = make_operand(pool, dev, g.c, g.m, g.n, g.pad, g.offset, poison);
  const Tensor c_before = pool.clone(c.ref);
  if (through_wrapper) {
#ifdef MOEFOLD_WITH_CUDA
    const auto raw = [](const Operand& o) {
      return cuda::DeviceMatrix{
          static_cast<char*>(o.dev.data()) + o.offset * static_cast<int64_t>(dtype_size(o.dev.dtype())), o.dev.dtype(),
          o.rows, o.cols, o.ld};
    };
    cuda::gemm(testing::exec(), raw(a), g.trans_a, raw(b), g.trans_b, raw(c), g.alpha, g.beta);
#endif
  } else {
    matmul(testing::exec(), a.dev_view(), g.trans_a, b.dev_view(), g.trans_b, c.dev_view(), g.alpha, g.beta);
  }
  matmul(testing::exec(), a.ref_view(), g.trans_a, b.ref_view(), g.trans_b, c.ref_view(), g.alpha, g.beta);
  const std::vector<double> got = testing::download(c.dev);
  std::vector<double> got_view, want_view;
  int64_t outside_changed = 0;
  for (int64_t i = 0; i < c.ref.numel(); ++i) {
    const int64_t rel = i - c.offset, row = rel / c.ld, col = rel % c.ld;
    const bool inside = rel >= 0 && row < c.rows && col < c.cols;
    const double v = got[static_cast<size_t>(i)];
    if (inside) {
      got_view.push_back(v);
      want_view.push_back(testing::value_at(c.ref, i));
    } else if (poison ? !std::isnan(v) : v != testing::value_at(c_before, i)) {
      ++outside_changed;
    }
  }
  EXPECT_EQ(outside_changed, 0) << "elements outside c's view were written";
  EXPECT_LE(testing::rel_error(got_view, want_view), tolerance(g.ab, g.c, g.k));
}

struct DtypeCombo {
  DType ab, c;
};
constexpr DtypeCombo kCombos[] = {{DType::f32, DType::f32}, {DType::bf16, DType::bf16}, {DType::bf16, DType::f32}};

TEST(CudaGemm, OddShapesEveryTransposeDtypeAndLayout) {
  MF_REQUIRE_GPU();
  struct Layout {
    int64_t pad, offset;
    double alpha, beta;
  };
  // Plain; misaligned leading dimension and start (2-byte bf16 / 4-byte f32 alignment only);
  // 16-byte-aligned padding (the tensor-core path) accumulating into c.
  const Layout layouts[] = {{0, 0, 1.0, 0.0}, {3, 1, -1.25, 0.75}, {8, 8, 0.5, 1.0}};
  for (const DtypeCombo& dc : kCombos)
    for (int t = 0; t < 4; ++t)
      for (const Layout& l : layouts)
        check_case({127, 65, 33, (t & 1) != 0, (t & 2) != 0, dc.ab, dc.c, l.pad, l.offset, l.alpha, l.beta});
}

TEST(CudaGemm, TinyAndDegenerateShapes) {
  MF_REQUIRE_GPU();
  for (const DtypeCombo& dc : kCombos) {
    check_case({1, 1, 1, false, false, dc.ab, dc.c, 0, 0, 1.0, 0.0});
    check_case({3, 1, 200, true, false, dc.ab, dc.c, 1, 0, 2.0, 0.0});
    check_case({1, 300, 7, false, true, dc.ab, dc.c, 0, 3, 1.0, -1.0});
    check_case({5, 7, 0, false, false, dc.ab, dc.c, 2, 1, 1.0, 0.5});  // K = 0: c = beta * c
    check_case({5, 7, 0, true, true, dc.ab, dc.c, 0, 0, 1.0, 0.0});    // K = 0, beta = 0: zeros over NaN
    check_case({0, 7, 9, false, false, dc.ab, dc.c, 0, 0, 1.0, 0.5});  // M = 0: nothing happens
    check_case({6, 0, 9, false, true, dc.ab, dc.c, 0, 0, 1.0, 0.5});   // N = 0
  }
}

TEST(CudaGemm, RawWrapperMatchesCpu) {
  MF_REQUIRE_GPU();
  for (const DtypeCombo& dc : kCombos) {
    check_case({127, 65, 33, true, false, dc.ab, dc.c, 5, 3, 0.75, 0.0}, true);
    check_case({64, 96, 80, false, true, dc.ab, dc.c, 0, 0, 1.0, 1.0}, true);
  }
}

// A long reduction with a small output: cuBLASLt's heuristic picks split-K here. Partial sums must
// be reduced in fp32 (a bf16 result rounded once) and in a fixed order (bit-identical repeats).
TEST(CudaGemm, LongReductionIsAccurateAndDeterministic) {
  MF_REQUIRE_GPU();
  for (const DtypeCombo& dc : kCombos) {
    check_case({64, 48, 40000, true, false, dc.ab, dc.c, 0, 0, 1.0, 0.0});
    check_case({64, 48, 40000, false, true, dc.ab, dc.c, 0, 0, 1.0, 1.0});
    Pool pool;
    DevicePool dev;
    Tensor a = dev.upload(pool.randn({64, 40000}), dc.ab), b = dev.upload(pool.randn({48, 40000}), dc.ab);
    Tensor c1 = dev.poisoned({64, 48}, dc.c), c2 = dev.poisoned({64, 48}, dc.c);
    matmul(testing::exec(), as_matrix(a), false, as_matrix(b), true, as_matrix(c1), 1.0, 0.0);
    matmul(testing::exec(), as_matrix(a), false, as_matrix(b), true, as_matrix(c2), 1.0, 0.0);
    EXPECT_EQ(testing::download(c1), testing::download(c2)) << dtype_name(dc.ab) << " -> " << dtype_name(dc.c);
  }
}

TEST(CudaGemm, LargeShape) {
  MF_REQUIRE_GPU();
  // 4096 x 2048 x 768: tensor-core tiles, many waves. y = x @ w^T layout and the dw = dy^T @ x one.
  check_case({4096, 2048, 768, false, true, DType::bf16, DType::bf16, 0, 0, 1.0, 0.0});
  check_case({4096, 2048, 768, true, false, DType::bf16, DType::f32, 0, 0, 1.0, 1.0});
  check_case({4096, 2048, 768, false, false, DType::f32, DType::f32, 0, 0, 1.0, 0.0});
}

// ---- linear -------------------------------------------------------------------------------------

// The GPU linear forward and backward against the CPU ops in f64 on the rounded inputs; dw starts
// random and ACCUMULATES (in the operands' dtype or in f32); dx and y are WRITTEN (NaN before).
void check_linear(DType dt, DType dw_dt, int64_t n, int64_t in, int64_t out) {
  SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " dw " << dtype_name(dw_dt) << " n " << n << " in " << in
                                    << " out " << out);
  Pool pool;
  DevicePool dev;
  const Tensor x = pool.randn({n, in}), w = pool.randn({out, in}), dy = pool.randn({n, out}),
               dw0 = pool.randn({out, in});
  Tensor xr = testing::rounded(pool, x, dt), wr = testing::rounded(pool, w, dt), dyr = testing::rounded(pool, dy, dt),
         dwr = testing::rounded(pool, dw0, dw_dt);
  Tensor yr = pool.zeros({n, out}), dxr = pool.zeros({n, in});
  Tensor xd = dev.upload(x, dt), wd = dev.upload(w, dt), dyd = dev.upload(dy, dt), dwd = dev.upload(dw0, dw_dt);
  Tensor yd = dev.poisoned({n, out}, dt), dxd = dev.poisoned({n, in}, dt);
  linear_forward(testing::exec(), xd, wd, yd);
  linear_backward(testing::exec(), xd, wd, dyd, dxd, dwd);
  linear_forward(testing::exec(), xr, wr, yr);
  linear_backward(testing::exec(), xr, wr, dyr, dxr, dwr);
  EXPECT_LE(testing::rel_error(testing::download(yd), yr), tolerance(dt, dt, in)) << "y";
  EXPECT_LE(testing::rel_error(testing::download(dxd), dxr), tolerance(dt, dt, out)) << "dx";
  EXPECT_LE(testing::rel_error(testing::download(dwd), dwr), tolerance(dt, dw_dt, n)) << "dw";

  // Undefined dx: only dw accumulates, a second time.
  linear_backward(testing::exec(), xd, wd, dyd, Tensor{}, dwd);
  linear_backward(testing::exec(), xr, wr, dyr, Tensor{}, dwr);
  EXPECT_LE(testing::rel_error(testing::download(dwd), dwr), 2 * tolerance(dt, dw_dt, n)) << "dw twice";
}

TEST(CudaLinear, ForwardBackwardMatchCpu) {
  MF_REQUIRE_GPU();
  check_linear(DType::f32, DType::f32, 257, 96, 80);
  check_linear(DType::bf16, DType::bf16, 257, 96, 80);
  check_linear(DType::bf16, DType::f32, 257, 96, 80);
  check_linear(DType::bf16, DType::f32, 1000, 513, 385);  // odd in/out: unaligned rows
  check_linear(DType::f32, DType::f32, 3, 1, 5);
}

TEST(CudaLinear, BackwardIsDeterministic) {
  MF_REQUIRE_GPU();
  Pool pool;
  DevicePool dev;
  const int64_t n = 2048, in = 1024, out = 768;
  Tensor x = dev.upload(pool.randn({n, in}), DType::bf16), w = dev.upload(pool.randn({out, in}), DType::bf16);
  Tensor dy = dev.upload(pool.randn({n, out}), DType::bf16), dw0 = pool.randn({out, in});
  Tensor dw1 = dev.upload(dw0, DType::f32), dw2 = dev.upload(dw0, DType::f32);
  Tensor dx1 = dev.poisoned({n, in}, DType::bf16), dx2 = dev.poisoned({n, in}, DType::bf16);
  linear_backward(testing::exec(), x, w, dy, dx1, dw1);
  linear_backward(testing::exec(), x, w, dy, dx2, dw2);
  EXPECT_EQ(testing::download(dw1), testing::download(dw2));
  EXPECT_EQ(testing::download(dx1), testing::download(dx2));
}

// ---- grouped linear -------------------------------------------------------------------------------

// The i64 offsets [E + 1] of experts owning counts[e] consecutive rows each.
Tensor offsets_of(Pool& pool, const std::vector<int64_t>& counts) {
  Tensor offsets = pool.zeros({static_cast<int64_t>(counts.size()) + 1}, DType::i64);
  int64_t* off = offsets.ptr<int64_t>();
  for (size_t e = 0; e < counts.size(); ++e) off[e + 1] = off[e] + counts[e];
  return offsets;
}

// Expert e owns counts[e] consecutive rows; empty experts (first, middle, last) keep dw untouched.
void check_grouped(DType dt, DType dw_dt, const std::vector<int64_t>& counts, int64_t in, int64_t out,
                   const ExecContext& ctx = testing::exec()) {
  SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " dw " << dtype_name(dw_dt) << " experts " << counts.size());
  Pool pool;
  DevicePool dev;
  const int64_t e_n = static_cast<int64_t>(counts.size());
  const Tensor offsets = offsets_of(pool, counts);
  const int64_t r = offsets.ptr<int64_t>()[e_n];
  const Tensor x = pool.randn({r, in}), w = pool.randn({e_n, out, in}), dy = pool.randn({r, out}),
               dw0 = pool.randn({e_n, out, in});
  Tensor xr = testing::rounded(pool, x, dt), wr = testing::rounded(pool, w, dt), dyr = testing::rounded(pool, dy, dt),
         dwr = testing::rounded(pool, dw0, dw_dt);
  const Tensor dw_before = pool.clone(dwr);
  Tensor yr = pool.zeros({r, out}), dxr = pool.zeros({r, in});
  Tensor xd = dev.upload(x, dt), wd = dev.upload(w, dt), dyd = dev.upload(dy, dt), dwd = dev.upload(dw0, dw_dt);
  Tensor offd = dev.upload(offsets, DType::i64);
  Tensor yd = dev.poisoned({r, out}, dt), dxd = dev.poisoned({r, in}, dt);
  grouped_linear_forward(ctx, xd, wd, offd, yd);
  grouped_linear_backward(ctx, xd, wd, offd, dyd, dxd, dwd);
  grouped_linear_forward(ctx, xr, wr, offsets, yr);
  grouped_linear_backward(ctx, xr, wr, offsets, dyr, dxr, dwr);
  int64_t k_max = 1;
  for (int64_t c : counts) k_max = std::max(k_max, c);
  EXPECT_LE(testing::rel_error(testing::download(yd), yr), tolerance(dt, dt, in)) << "y";
  EXPECT_LE(testing::rel_error(testing::download(dxd), dxr), tolerance(dt, dt, out)) << "dx";
  const std::vector<double> dw_got = testing::download(dwd);
  EXPECT_LE(testing::rel_error(dw_got, dwr), tolerance(dt, dw_dt, k_max)) << "dw";
  // Per expert: each non-empty expert's dw matches on its own; an empty expert's is bit-identical.
  const int64_t per = out * in;
  for (int64_t e = 0; e < e_n; ++e) {
    std::vector<double> got(dw_got.begin() + e * per, dw_got.begin() + (e + 1) * per), want, before;
    for (int64_t i = 0; i < per; ++i) {
      want.push_back(testing::value_at(dwr, e * per + i));
      before.push_back(testing::value_at(dw_before, e * per + i));
    }
    if (counts[static_cast<size_t>(e)] == 0)
      EXPECT_EQ(got, before) << "dw of empty expert " << e << " changed";
    else
      EXPECT_LE(testing::rel_error(got, want), tolerance(dt, dw_dt, counts[static_cast<size_t>(e)]))
          << "dw of expert " << e;
  }
  // Written (accumulate = false): the first micro-batch's dw, whatever the buffer held; experts
  // without rows get zeros.
  {
    Tensor dw_fresh = pool.zeros({e_n, out, in}), dw_w = dev.upload(dw0, dw_dt);
    grouped_linear_backward(ctx, xr, wr, offsets, dyr, Tensor{}, dw_fresh);
    grouped_linear_backward(ctx, xd, wd, offd, dyd, Tensor{}, dw_w, /*accumulate=*/false);
    const std::vector<double> got_w = testing::download(dw_w);
    EXPECT_LE(testing::rel_error(got_w, dw_fresh), tolerance(dt, dw_dt, k_max)) << "dw written";
    for (int64_t e = 0; e < e_n; ++e) {
      if (counts[static_cast<size_t>(e)] != 0) continue;
      for (int64_t i = 0; i < per; ++i) ASSERT_EQ(got_w[static_cast<size_t>(e * per + i)], 0.0) << "expert " << e;
    }
  }
  // Undefined dx: dw accumulates again.
  grouped_linear_backward(ctx, xd, wd, offd, dyd, Tensor{}, dwd);
  grouped_linear_backward(ctx, xr, wr, offsets, dyr, Tensor{}, dwr);
  EXPECT_LE(testing::rel_error(testing::download(dwd), dwr), 2 * tolerance(dt, dw_dt, k_max)) << "dw twice";
}

// The contexts of the kernel choices the tests below switch between.
KernelOptions with_grouped_gemm(GroupedGemmImpl impl) {
  KernelOptions k;
  k.grouped_gemm = impl;
  return k;
}
#ifdef MOEFOLD_WITH_CUDA  // used only by the CUDA build's tests below
KernelOptions with_tiles(const char* tiles) {
  KernelOptions k;
  k.cutlass_tiles = parse_cutlass_tiles(tiles, "kernels.cutlass_tile");
  return k;
}
#endif

// The cuBLASLt path (one GEMM per expert), which kernels.grouped_gemm = cublaslt selects.
TEST(CudaGroupedLinear, UnevenAndEmptyExpertsMatchCpu) {
  MF_REQUIRE_GPU();
  const ExecContext ctx(Device::cuda, with_grouped_gemm(GroupedGemmImpl::cublaslt));
  const std::vector<int64_t> counts = {0, 37, 1, 0, 91, 5, 0};
  check_grouped(DType::f32, DType::f32, counts, 48, 40, ctx);
  check_grouped(DType::bf16, DType::bf16, counts, 48, 40, ctx);
  check_grouped(DType::bf16, DType::f32, counts, 48, 40, ctx);
  check_grouped(DType::bf16, DType::f32, {300, 0, 129, 1000, 3}, 129, 77, ctx);  // odd widths: unaligned experts
  check_grouped(DType::f32, DType::f32, {0, 0, 0}, 16, 8, ctx);                  // no rows at all
}

// The CUTLASS grouped GEMM (the default): the same checks and tolerances through it, where it
// serves (bf16 operands, f32 or bf16 dw (train.main_grads_dtype), widths multiple of 8: asserted
// to run), in every tile configuration and a mix of them, and the cuBLASLt fallback where it does
// not (odd widths).
TEST(CudaGroupedLinear, CutlassPathMatchesCpu) {
  MF_REQUIRE_GPU();
#ifdef MOEFOLD_WITH_CUDA
  if (!cuda::cutlass_grouped_gemm_built()) GTEST_SKIP() << "built without CUTLASS's headers (MOEFOLD_WITH_CUTLASS)";
  {
    DevicePool dev;
    Pool pool;
    Tensor offsets = pool.zeros({3}, DType::i64);
    const int64_t off[3] = {0, 5, 16};
    std::memcpy(offsets.data(), off, sizeof off);
    const Tensor x = dev.upload(pool.randn({16, 64}), DType::bf16),
                 w = dev.upload(pool.randn({2, 32, 64}), DType::bf16);
    const Tensor y = dev.poisoned({16, 32}, DType::bf16);
    EXPECT_TRUE(cuda::cutlass_grouped_linear_forward(testing::exec(), x, w, dev.upload(offsets, DType::i64), y))
        << "CUTLASS declined";
    const Tensor dy = dev.upload(pool.randn({16, 32}), DType::bf16), dw16 = dev.poisoned({2, 32, 64}, DType::bf16);
    EXPECT_TRUE(cuda::cutlass_grouped_linear_backward(testing::exec(), x, w, dev.upload(offsets, DType::i64), dy,
                                                      Tensor(), dw16, false))
        << "CUTLASS declined a bf16 weight gradient";
    EXPECT_FALSE(cuda::cutlass_grouped_linear_forward(
        testing::exec(), x.view({16, 64}), w, dev.upload(offsets, DType::i64), dev.poisoned({16, 32}, DType::f32)))
        << "an f32 output is not CUTLASS's";
  }
  const std::vector<int64_t> counts = {0, 37, 1, 0, 91, 5, 0};
  for (const char* tile :
       {"large", "small", "pingpong", "large_n2", "pingpong_n2", "large_auto", "auto",
        "forward=small,dgrad=pingpong_n2,wgrad=small", "forward=pingpong_n2,dgrad=large_n2", "wgrad=own"}) {
    SCOPED_TRACE(tile);
    const ExecContext ctx(Device::cuda, with_tiles(tile));
    // Widths of two 256-wide N tiles: large_auto picks the 1 x 2 clusters for the first (rows
    // padded to 16 tiles by 2 x 1 clusters, 12 by 1 x 2), the 2 x 1 for the second (12 both ways).
    check_grouped(DType::bf16, DType::bf16, {300, 0, 3, 129}, 512, 512, ctx);
    check_grouped(DType::bf16, DType::bf16, {256, 512}, 512, 512, ctx);
    check_grouped(DType::bf16, DType::f32, counts, 48, 40, ctx);
    check_grouped(DType::bf16, DType::f32, {300, 0, 129, 1000, 3, 64}, 256, 128, ctx);
    check_grouped(DType::bf16, DType::f32, {0, 0, 0}, 16, 8, ctx);  // no rows at all
    check_grouped(DType::bf16, DType::bf16, counts, 48, 40, ctx);
    check_grouped(DType::bf16, DType::bf16, {300, 0, 129, 1000, 3, 64}, 256, 128, ctx);
  }
  check_grouped(DType::bf16, DType::f32, {300, 0, 129, 1000, 3}, 129, 77);  // odd widths: cuBLASLt
#endif
}

// The weight gradient written (beta = 0: in large tiles a configuration without C, its own
// epilogue subtiles) and accumulated onto zeros (beta = 1: the configuration that reads C) give the
// same bits, for bf16 and f32 gradients and every tile name the kind runs differently.
TEST(CudaGroupedLinear, WeightGradientWrittenEqualsAccumulatedOntoZeros) {
  MF_REQUIRE_GPU();
#ifdef MOEFOLD_WITH_CUDA
  if (!cuda::cutlass_grouped_gemm_built()) GTEST_SKIP() << "built without CUTLASS's headers (MOEFOLD_WITH_CUTLASS)";
  const std::vector<int64_t> counts = {300, 0, 129, 1000, 3, 64, 256};
  constexpr int64_t i_n = 384, o_n = 640;
  Pool pool;
  DevicePool dev;
  const Tensor off = offsets_of(pool, counts);
  const int64_t r = off.ptr<int64_t>()[counts.size()], e_n = static_cast<int64_t>(counts.size());
  const Tensor offsets = dev.upload(off, DType::i64);
  const Tensor x = dev.upload(pool.randn({r, i_n}), DType::bf16),
               w = dev.upload(pool.randn({e_n, o_n, i_n}), DType::bf16);
  const Tensor dy = dev.upload(pool.randn({r, o_n}), DType::bf16);
  for (const char* tile : {"large", "pingpong", "small", "wgrad=own"}) {
    for (DType dt : {DType::bf16, DType::f32}) {
      SCOPED_TRACE(::testing::Message() << tile << " " << dtype_name(dt));
      const ExecContext ctx(Device::cuda, with_tiles(tile));
      const Tensor written = dev.poisoned({e_n, o_n, i_n}, dt);
      const Tensor added = dev.upload(pool.zeros({e_n, o_n, i_n}), dt);
      ASSERT_TRUE(cuda::cutlass_grouped_linear_backward(ctx, x, w, offsets, dy, Tensor(), written, false));
      ASSERT_TRUE(cuda::cutlass_grouped_linear_backward(ctx, x, w, offsets, dy, Tensor(), added, true));
      const std::vector<double> a = testing::download(written), b = testing::download(added);
      ASSERT_EQ(a.size(), b.size());
      size_t differ = 0;
      for (size_t i = 0; i < a.size(); ++i) differ += a[i] != b[i];
      EXPECT_EQ(differ, 0u) << "of " << a.size();
    }
  }
#endif
}

// The own weight-gradient kernel (kernels.cutlass_tile wgrad = own, ops/cuda/wgrad_grouped_gemm.cu):
// the same bits on 1, 7 and every SM (each tile summed by one CTA in one order), written and
// accumulated, in clusters of 2 CTAs (the default) and of 1 (264 weight rows make an odd count of
// 128-row tiles, so a cluster's second CTA has none in the last row of tiles); against CUTLASS's
// large tiles within the f32 sums' reordering; and an expert's last block, which holds the next
// expert's rows, takes none of them into its sum: the rows of experts 1 and 3 are infinite in x and
// dy, so a leak makes experts 0 and 2 (ending mid-block) non-finite.
TEST(CudaGroupedLinear, OwnWeightGradientIsGridFreeMasksForeignRowsAndMatchesCutlass) {
  MF_REQUIRE_GPU();
#ifdef MOEFOLD_WITH_CUDA
  if (!cuda::cutlass_grouped_gemm_built()) GTEST_SKIP() << "built without CUTLASS's headers (MOEFOLD_WITH_CUTLASS)";
  // Experts of at most 256 rows keep dy in shared memory over a unit's tiles; 300 rows stream it.
  const std::vector<int64_t> counts = {37, 5, 200, 64, 0, 129, 300};
  constexpr int64_t i_n = 520, o_n = 264;  // tiles cut by both widths
  Pool pool;
  DevicePool dev;
  const Tensor off = offsets_of(pool, counts);
  const int64_t* o = off.ptr<int64_t>();
  const int64_t r = o[counts.size()], e_n = static_cast<int64_t>(counts.size());
  Tensor x = pool.randn({r, i_n}), dy = pool.randn({r, o_n});
  for (const int64_t e : {1, 3})
    for (int64_t row = o[e]; row < o[e + 1]; ++row) {
      for (int64_t c = 0; c < i_n; ++c) testing::set_value_at(x, row * i_n + c, INFINITY);
      for (int64_t c = 0; c < o_n; ++c) testing::set_value_at(dy, row * o_n + c, INFINITY);
    }
  const Tensor offsets = dev.upload(off, DType::i64), xd = dev.upload(x, DType::bf16),
               dyd = dev.upload(dy, DType::bf16), w = dev.upload(pool.randn({e_n, o_n, i_n}), DType::bf16);
  const int64_t per = o_n * i_n;
  for (DType dt : {DType::bf16, DType::f32}) {
    SCOPED_TRACE(dtype_name(dt));
    const auto run = [&](const char* tiles, int sms, bool accumulate, const Tensor& onto) {
      KernelOptions k = with_tiles(tiles);
      k.gemm_sms = sms;
      const ExecContext ctx(Device::cuda, k);
      const Tensor dw = accumulate ? dev.upload(onto, dt) : dev.poisoned({e_n, o_n, i_n}, dt);
      EXPECT_TRUE(cuda::cutlass_grouped_linear_backward(ctx, xd, w, offsets, dyd, Tensor(), dw, accumulate));
      return testing::download(dw);
    };
    const Tensor before = testing::rounded(pool, pool.randn({e_n, o_n, i_n}), dt);
    const std::vector<double> own = run("wgrad=own", 0, false, before), added = run("wgrad=own", 0, true, before);
    for (const int sms : {1, 7}) {
      EXPECT_EQ(run("wgrad=own", sms, false, before), own) << sms << " SMs, written";
      EXPECT_EQ(run("wgrad=own", sms, true, before), added) << sms << " SMs, accumulated";
    }
    for (const int sms : {0, 1, 7}) {  // clusters of one CTA
      SCOPED_TRACE(::testing::Message() << "clusters of 1, " << sms << " SMs");
      KernelOptions k;
      k.gemm_sms = sms;
      const ExecContext ctx(Device::cuda, k);
      const Tensor written = dev.poisoned({e_n, o_n, i_n}, dt), onto = dev.upload(before, dt);
      cuda::own_grouped_wgrad(ctx, xd, dyd, offsets, written, false, "test", 1);
      cuda::own_grouped_wgrad(ctx, xd, dyd, offsets, onto, true, "test", 1);
      EXPECT_EQ(testing::download(written), own) << "written";
      EXPECT_EQ(testing::download(onto), added) << "accumulated";
    }
    // Units of one tile (dy streamed everywhere), of two (a unit of one tile and one of two) and of
    // up to 16, forced (by default an expert of 300 rows makes the kernel take units of one tile):
    // the experts of at most 256 rows keep dy over a unit, expert 6 streams it; the same sums in
    // the same order.
    for (const int unit : {1, 2, 16})
      for (const int cluster : {1, 2}) {
        SCOPED_TRACE(::testing::Message() << "units of " << unit << " tiles, clusters of " << cluster);
        const ExecContext ctx(Device::cuda, KernelOptions{});
        const Tensor written = dev.poisoned({e_n, o_n, i_n}, dt), onto = dev.upload(before, dt);
        cuda::own_grouped_wgrad(ctx, xd, dyd, offsets, written, false, "test", cluster, unit, true);
        cuda::own_grouped_wgrad(ctx, xd, dyd, offsets, onto, true, "test", cluster, unit, true);
        EXPECT_EQ(testing::download(written), own) << "written";
        EXPECT_EQ(testing::download(onto), added) << "accumulated";
      }
    {  // kernels.own_wgrad_units as a run sets it: units where every expert keeps dy (expert 6 emptied)
      std::vector<int64_t> fit = counts;
      fit.back() = 0;
      const Tensor fit_offsets = dev.upload(offsets_of(pool, fit), DType::i64);
      std::vector<std::vector<double>> got;
      for (const int unit : {1, 16}) {
        KernelOptions k;
        k.own_wgrad_units = unit;
        const ExecContext ctx(Device::cuda, k);
        const Tensor written = dev.poisoned({e_n, o_n, i_n}, dt);
        cuda::own_grouped_wgrad(ctx, xd, dyd, fit_offsets, written, false, "test");
        got.push_back(testing::download(written));
      }
      EXPECT_EQ(got[1], got[0]) << "kernels.own_wgrad_units = 16 against 1";
    }
    const std::vector<double> cutlass = run("large", 0, false, before), cutlass_added = run("large", 0, true, before);
    for (const int64_t e : {0, 2, 4, 5, 6}) {
      SCOPED_TRACE(::testing::Message() << "expert " << e);
      const auto slice = [&](const std::vector<double>& v) {
        return std::vector<double>(v.begin() + e * per, v.begin() + (e + 1) * per);
      };
      const std::vector<double> mine = slice(own), theirs = slice(cutlass);
      size_t finite = 0;
      for (const double v : mine) finite += std::isfinite(v);
      ASSERT_EQ(finite, mine.size()) << "the next expert's rows leaked into the sum";
      if (counts[static_cast<size_t>(e)] == 0) {
        EXPECT_EQ(mine, std::vector<double>(static_cast<size_t>(per), 0.0)) << "an expert without rows: zeros";
        std::vector<double> kept;
        for (int64_t i = 0; i < per; ++i) kept.push_back(testing::value_at(before, e * per + i));
        EXPECT_EQ(slice(added), kept) << "an expert without rows keeps its gradient";
        continue;
      }
      // The f32 sums in another order: bf16's rounding of the results at most one unit apart.
      const double bound = dt == DType::bf16 ? 4e-3 : 1e-5;
      EXPECT_LE(testing::rel_error(mine, theirs), bound) << "written";
      EXPECT_LE(testing::rel_error(slice(added), slice(cutlass_added)), bound) << "accumulated";
    }
  }
#endif
}

// kernels.cutlass_tile = auto where large_auto pays (core/kernel_options.h large_auto_pays: 64
// experts averaging 256 rows, uneven, 2^36 multiply-adds): the same bits as large_auto, forward and
// input gradient, and within bf16's rounding of large (the shapes are too large for the CPU
// reference; the tests above check large and large_auto against it).
TEST(CudaGroupedLinear, AutoTilesRunLargeAutoWhereItPays) {
  MF_REQUIRE_GPU();
#ifdef MOEFOLD_WITH_CUDA
  if (!cuda::cutlass_grouped_gemm_built()) GTEST_SKIP() << "built without CUTLASS's headers (MOEFOLD_WITH_CUTLASS)";
  constexpr int64_t e_n = 64, i_n = 4096, o_n = 1024;
  std::vector<int64_t> counts;
  for (int64_t e = 0; e < e_n; e += 2) {  // pairs summing to 512: 16384 rows in all
    counts.push_back(256 + 3 * e + 1);
    counts.push_back(256 - 3 * e - 1);
  }
  ASSERT_TRUE(large_auto_pays(16384, e_n, i_n, o_n));
  Pool pool;
  DevicePool dev;
  const Tensor offsets = dev.upload(offsets_of(pool, counts), DType::i64);
  const Tensor x = dev.upload(pool.randn({16384, i_n}), DType::bf16),
               w = dev.upload(pool.randn({e_n, o_n, i_n}), DType::bf16);
  const Tensor dy = dev.upload(pool.randn({16384, o_n}), DType::bf16);
  std::vector<std::vector<double>> ys, dxs;
  for (const char* tile : {"auto", "large_auto", "large"}) {
    SCOPED_TRACE(tile);
    const ExecContext ctx(Device::cuda, with_tiles(tile));
    const Tensor y = dev.poisoned({16384, o_n}, DType::bf16), dx = dev.poisoned({16384, i_n}, DType::bf16);
    ASSERT_TRUE(cuda::cutlass_grouped_linear_forward(ctx, x, w, offsets, y));
    ASSERT_TRUE(cuda::cutlass_grouped_linear_backward(ctx, x, w, offsets, dy, dx, Tensor(), false));
    ys.push_back(testing::download(y));
    dxs.push_back(testing::download(dx));
  }
  EXPECT_EQ(ys[0], ys[1]) << "auto and large_auto: forward";
  EXPECT_EQ(dxs[0], dxs[1]) << "auto and large_auto: dgrad";
  EXPECT_LE(testing::rel_error(ys[0], ys[2]), 8e-3) << "auto against large: forward";
  EXPECT_LE(testing::rel_error(dxs[0], dxs[2]), 8e-3) << "auto against large: dgrad";
#endif
}

// ---- grouped linear fused with SwiGLU (gate and up interleaved: GateUp::pairs) -------------------

// The routed experts' first layer with SwiGLU (grouped_linear_swiglu_forward) and the second
// layer's input gradient through SwiGLU (grouped_linear_swiglu_backward_data) against the CPU ops
// in float64 on the GPU's inputs; gu is the plain grouped GEMM's output (bf16: 4e-3), h and dgu
// come from the rounded gu / dh and are rounded once more (8e-3). `cutlass`: CUTLASS must serve
// the call (its fused epilogues; asserted), else the unfused ops must.
#ifdef MOEFOLD_WITH_CUDA  // used only by the CUDA build's test below
void check_grouped_swiglu(const std::vector<int64_t>& counts, int64_t h_n, int64_t f_n, bool cutlass,
                          const ExecContext& ctx = testing::exec()) {
  SCOPED_TRACE(::testing::Message() << "experts " << counts.size() << " H " << h_n << " F " << f_n);
  Pool pool;
  DevicePool dev;
  const int64_t e_n = static_cast<int64_t>(counts.size());
  const Tensor offsets = offsets_of(pool, counts);
  const int64_t r = offsets.ptr<int64_t>()[e_n];
  const Tensor offd = dev.upload(offsets, DType::i64);
  const DType bf = DType::bf16;
  // Forward: x [R, H] through gate_up [E, 2F, H].
  const Tensor x = pool.randn({r, h_n}), w1 = pool.randn({e_n, 2 * f_n, h_n});
  const Tensor xd = dev.upload(x, bf), w1d = dev.upload(w1, bf);
  const Tensor gud = dev.poisoned({r, 2 * f_n}, bf), hd = dev.poisoned({r, f_n}, bf);
#ifdef MOEFOLD_WITH_CUDA
  if (cutlass) {
    EXPECT_TRUE(cuda::cutlass_grouped_linear_swiglu_forward(ctx, xd, w1d, offd, gud, hd)) << "CUTLASS declined";
  } else {
    grouped_linear_swiglu_forward(ctx, xd, w1d, offd, gud, hd);
  }
#endif
  const Tensor gu_ref = pool.zeros({r, 2 * f_n}), h_ref = pool.zeros({r, f_n});
  grouped_linear_forward(ctx, testing::rounded(pool, x, bf), testing::rounded(pool, w1, bf), offsets, gu_ref);
  const std::vector<double> gu_got = testing::download(gud);
  EXPECT_LE(testing::rel_error(gu_got, gu_ref), 4e-3) << "gu";
  // h from the GPU's own gu: the swiglu of the stored pairs.
  Tensor gu_gpu = pool.zeros({r, 2 * f_n});
  for (int64_t i = 0; i < gu_gpu.numel(); ++i) testing::set_value_at(gu_gpu, i, gu_got[static_cast<size_t>(i)]);
  swiglu_forward(ctx, gu_gpu, h_ref, GateUp::pairs);
  EXPECT_LE(testing::rel_error(testing::download(hd), h_ref), 8e-3) << "h";
  // Backward data: dy [R, H] through down [E, H, F], with saved gu [R, 2F].
  const Tensor dy = pool.randn({r, h_n}), w2 = pool.randn({e_n, h_n, f_n}), gu = pool.randn({r, 2 * f_n});
  const Tensor dyd = dev.upload(dy, bf), w2d = dev.upload(w2, bf), gu2d = dev.upload(gu, bf);
  const Tensor dhd = dev.poisoned({r, f_n}, bf), dgud = dev.poisoned({r, 2 * f_n}, bf);
#ifdef MOEFOLD_WITH_CUDA
  if (cutlass) {
    EXPECT_TRUE(cuda::cutlass_grouped_linear_swiglu_backward_data(ctx, dyd, w2d, offd, gu2d, dgud))
        << "CUTLASS declined";
  } else {
    grouped_linear_swiglu_backward_data(ctx, dyd, w2d, offd, gu2d, dhd, dgud);
  }
#endif
  const Tensor dh_ref = pool.zeros({r, f_n}), dgu_ref = pool.zeros({r, 2 * f_n});
  grouped_linear_backward(ctx, dh_ref, testing::rounded(pool, w2, bf), offsets, testing::rounded(pool, dy, bf), dh_ref,
                          Tensor());
  swiglu_backward(ctx, testing::rounded(pool, gu, bf), testing::rounded(pool, dh_ref, bf), dgu_ref, GateUp::pairs);
  EXPECT_LE(testing::rel_error(testing::download(dgud), dgu_ref), 8e-3) << "dgu";
}
#endif

TEST(CudaGroupedLinear, SwigluFusedMatchesCpu) {
  MF_REQUIRE_GPU();
#ifdef MOEFOLD_WITH_CUDA
  const bool built = cuda::cutlass_grouped_gemm_built();
  // "": the defaults (ping-pong forward, large backward); "swiglu_forward=large" the other
  // pairing through the per-kind syntax.
  for (const char* tile : {"", "large", "pingpong", "swiglu_forward=large,swiglu_dgrad=pingpong", "large_n2",
                           "pingpong_n2", "swiglu_forward=large_n2,swiglu_dgrad=pingpong_n2", "large_auto", "small"}) {
    SCOPED_TRACE(tile);
    const ExecContext ctx(Device::cuda, with_tiles(tile));
    const bool fused = built && std::strcmp(tile, "small") != 0;  // small: the unfused ops
    check_grouped_swiglu({0, 37, 1, 0, 91, 5, 0}, 64, 40, fused, ctx);
    check_grouped_swiglu({300, 0, 129, 1000, 3, 64}, 256, 128, fused, ctx);
    check_grouped_swiglu({0, 0, 0}, 16, 8, fused, ctx);  // no rows at all
    if (built && !fused) {  // the small tiles have no fused kernels: CUTLASS declines, runs nothing
      DevicePool dev;
      Pool pool;
      Tensor off = pool.zeros({2}, DType::i64);
      off.ptr<int64_t>()[1] = 16;
      const Tensor offd = dev.upload(off, DType::i64), x = dev.poisoned({16, 16}, DType::bf16),
                   w = dev.poisoned({1, 16, 16}, DType::bf16), gu = dev.poisoned({16, 16}, DType::bf16);
      EXPECT_FALSE(
          cuda::cutlass_grouped_linear_swiglu_forward(ctx, x, w, offd, gu, dev.poisoned({16, 8}, DType::bf16)));
      EXPECT_FALSE(cuda::cutlass_grouped_linear_swiglu_backward_data(ctx, x, dev.poisoned({1, 16, 8}, DType::bf16),
                                                                     offd, gu, dev.poisoned({16, 16}, DType::bf16)));
    }
  }
  if (built) {
    // Inputs wider than 2048 columns: the forward declines unless forced (kernels.fused_swiglu = on).
    DevicePool dev;
    Pool pool;
    Tensor off = pool.zeros({2}, DType::i64);
    off.ptr<int64_t>()[1] = 16;
    const Tensor offd = dev.upload(off, DType::i64), x = dev.poisoned({16, 2056}, DType::bf16),
                 w = dev.poisoned({1, 16, 2056}, DType::bf16);
    EXPECT_FALSE(cuda::cutlass_grouped_linear_swiglu_forward(
        testing::exec(), x, w, offd, dev.poisoned({16, 16}, DType::bf16), dev.poisoned({16, 8}, DType::bf16)));
    KernelOptions fused, unfused;
    fused.fused_swiglu = SwigluFusion::on;
    unfused.fused_swiglu = SwigluFusion::off;  // the unfused ops
    check_grouped_swiglu({3, 0, 17}, 2056, 16, true, ExecContext(Device::cuda, fused));
    check_grouped_swiglu({3, 0, 17}, 64, 16, false, ExecContext(Device::cuda, unfused));
  }
  // The unfused ops on cuBLASLt.
  check_grouped_swiglu({0, 37, 1, 0, 91, 5, 0}, 64, 40, false,
                       ExecContext(Device::cuda, with_grouped_gemm(GroupedGemmImpl::cublaslt)));
#endif
}

// ---- matmul: the call patterns of model/mlp.cpp and moe/router.cpp --------------------------------

// MLP: gate and up written into the halves of gu_N2F (ldc = 2F, F odd so the up half starts
// unaligned); backward reads the halves of dgu (lda = 2F) for dgate, dup (accumulated) and dx
// (written by the gate product, accumulated by the up product).
TEST(CudaMatmul, FusedGateUpHalves) {
  MF_REQUIRE_GPU();
  for (DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    Pool pool;
    DevicePool dev;
    const int64_t n = 133, h = 64, f = 45;
    const Tensor x = pool.randn({n, h}), gate = pool.randn({f, h}), up = pool.randn({f, h}),
                 dgu = pool.randn({n, 2 * f}), dg0 = pool.randn({f, h}), du0 = pool.randn({f, h});
    const DType grad = DType::f32;  // fp32 parameter gradients
    Tensor xr = testing::rounded(pool, x, dt), gr = testing::rounded(pool, gate, dt),
           ur = testing::rounded(pool, up, dt), dgur = testing::rounded(pool, dgu, dt),
           dgr = testing::rounded(pool, dg0, grad), dur = testing::rounded(pool, du0, grad);
    Tensor gur = pool.zeros({n, 2 * f}), dxr = pool.zeros({n, h});
    Tensor xd = dev.upload(x, dt), gd = dev.upload(gate, dt), ud = dev.upload(up, dt), dgud = dev.upload(dgu, dt),
           dgd = dev.upload(dg0, grad), dud = dev.upload(du0, grad);
    Tensor gud = dev.poisoned({n, 2 * f}, dt), dxd = dev.poisoned({n, h}, dt);
    for (int side = 0; side < 2; ++side) {
      const bool gpu = side == 0;
      const Tensor& xs = gpu ? xd : xr;
      const Tensor& gs = gpu ? gd : gr;
      const Tensor& us = gpu ? ud : ur;
      const Tensor& gus = gpu ? gud : gur;
      const Tensor& dgus = gpu ? dgud : dgur;
      const Tensor& dgs = gpu ? dgd : dgr;
      const Tensor& dus = gpu ? dud : dur;
      const Tensor& dxs = gpu ? dxd : dxr;
      matmul(testing::exec(), as_matrix(xs), false, as_matrix(gs), true, column_block(gus, 0, f), 1.0, 0.0);
      matmul(testing::exec(), as_matrix(xs), false, as_matrix(us), true, column_block(gus, f, 2 * f), 1.0, 0.0);
      matmul(testing::exec(), column_block(dgus, 0, f), true, as_matrix(xs), false, as_matrix(dgs), 1.0, 1.0);
      matmul(testing::exec(), column_block(dgus, f, 2 * f), true, as_matrix(xs), false, as_matrix(dus), 1.0, 1.0);
      matmul(testing::exec(), column_block(dgus, 0, f), false, as_matrix(gs), false, as_matrix(dxs), 1.0, 0.0);
      matmul(testing::exec(), column_block(dgus, f, 2 * f), false, as_matrix(us), false, as_matrix(dxs), 1.0, 1.0);
    }
    EXPECT_LE(testing::rel_error(testing::download(gud), gur), tolerance(dt, dt, h)) << "gu";
    EXPECT_LE(testing::rel_error(testing::download(dgd), dgr), tolerance(dt, grad, n)) << "dgate";
    EXPECT_LE(testing::rel_error(testing::download(dud), dur), tolerance(dt, grad, n)) << "dup";
    // dx is rounded after the gate product and read back by the up product: two roundings in bf16.
    EXPECT_LE(testing::rel_error(testing::download(dxd), dxr), 2 * tolerance(dt, dt, f)) << "dx";
  }
}

// Router: bf16 activations and gate weight into fp32 logits.
TEST(CudaMatmul, RouterLogitsInF32) {
  MF_REQUIRE_GPU();
  Pool pool;
  DevicePool dev;
  const int64_t t = 301, h = 96, e = 24;
  const Tensor x = pool.randn({t, h}), gate = pool.randn({e, h});
  Tensor xr = testing::rounded(pool, x, DType::bf16), gr = testing::rounded(pool, gate, DType::bf16);
  Tensor lr = pool.zeros({t, e});
  Tensor xd = dev.upload(x, DType::bf16), gd = dev.upload(gate, DType::bf16), ld = dev.poisoned({t, e}, DType::f32);
  matmul(testing::exec(), as_matrix(xd), false, as_matrix(gd), true, as_matrix(ld), 1.0, 0.0);
  matmul(testing::exec(), as_matrix(xr), false, as_matrix(gr), true, as_matrix(lr), 1.0, 0.0);
  EXPECT_LE(testing::rel_error(testing::download(ld), lr), tolerance(DType::bf16, DType::f32, h));
}

}  // namespace
}  // namespace moefold

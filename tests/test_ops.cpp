// CPU reference ops (elementwise, embedding, RMSNorm, linear, RoPE, SwiGLU, cross-entropy):
// forward against naive formulas, backward against float64 finite differences, float32 against
// float64, and the gradient rule (activation grads written, parameter grads accumulated).
// Tolerances: float64 forwards 1e-12 (same formula, different order); float32 vs float64 1e-5
// relative to the output's magnitude (a few float32 roundings per element).
#include <cmath>
#include <complex>
#include <cstring>
#include <vector>

#include "moefold/core/host_threads.h"
#include "moefold/ops/ops.h"
#include "testing.h"

namespace moefold {
namespace {

using testing::check_gradient;
using testing::dot;
using testing::max_abs;
using testing::max_abs_diff;
using testing::Pool;

constexpr double kF64Tol = 1e-12;
constexpr double kF32Rel = 1e-5;

Tensor cast(Pool& pool, const Tensor& t, DType dtype) {
  Tensor c = pool.zeros(t.shape(), dtype);
  for (int64_t i = 0; i < t.numel(); ++i) testing::set_value_at(c, i, testing::value_at(t, i));
  return c;
}
// float32 result against the float64 one, relative to the float64 magnitude.
void expect_f32_close(const char* what, const Tensor& got32, const Tensor& want64) {
  EXPECT_LE(max_abs_diff(got32, want64), kF32Rel * std::max(1.0, max_abs(want64))) << what;
}
// a + k * b, elementwise, into a new f64 tensor.
Tensor axpy(Pool& pool, const Tensor& a, double k, const Tensor& b) {
  Tensor c = pool.zeros(a.shape());
  for (int64_t i = 0; i < a.numel(); ++i)
    testing::set_value_at(c, i, testing::value_at(a, i) + k * testing::value_at(b, i));
  return c;
}

// ---- elementwise -----------------------------------------------------------------------------

TEST(Elementwise, AddInplace) {
  Pool pool;
  for (DType dt : {DType::f64, DType::f32}) {
    Tensor y = pool.randn({5, 7}, dt), x = pool.randn({5, 7}, dt);
    Tensor y0 = pool.clone(y);
    add_inplace(testing::exec(), y, x);
    for (int64_t i = 0; i < y.numel(); ++i) {
      const double want = dt == DType::f32 ? static_cast<double>(static_cast<float>(testing::value_at(y0, i)) +
                                                                 static_cast<float>(testing::value_at(x, i)))
                                           : testing::value_at(y0, i) + testing::value_at(x, i);
      ASSERT_EQ(testing::value_at(y, i), want) << i;
    }
  }
}

// add_two_inplace: y += a, then y += b, each rounded: two add_inplace's bits.
TEST(Elementwise, AddTwoInplaceIsTwoAdds) {
  Pool pool;
  for (DType dt : {DType::f64, DType::f32}) {
    Tensor y = pool.randn({5, 7}, dt), a = pool.randn({5, 7}, dt), b = pool.randn({5, 7}, dt);
    Tensor want = pool.clone(y);
    add_inplace(testing::exec(), want, a);
    add_inplace(testing::exec(), want, b);
    add_two_inplace(testing::exec(), y, a, b);
    for (int64_t i = 0; i < y.numel(); ++i) ASSERT_EQ(testing::value_at(y, i), testing::value_at(want, i)) << i;
  }
}

TEST(Elementwise, SumSquaresAndScale) {
  Pool pool;
  for (DType dt : {DType::f64, DType::f32}) {
    Tensor x = pool.randn({5, 7}, dt);
    double want = 0;
    for (int64_t i = 0; i < x.numel(); ++i) want += testing::value_at(x, i) * testing::value_at(x, i);
    EXPECT_NEAR(sum_squares(testing::exec(), x), want, 1e-12 * want);
    Tensor y = pool.randn({3}, dt);
    const Tensor xs[] = {x, Tensor(nullptr, dt, {0}), y};
    double each[3];
    sum_squares_each(testing::exec(), xs, each);
    EXPECT_EQ(each[0], sum_squares(testing::exec(), x));
    EXPECT_EQ(each[1], 0.0);
    EXPECT_EQ(each[2], sum_squares(testing::exec(), y));
    Tensor x0 = pool.clone(x);
    scale_inplace(testing::exec(), x, -0.37);
    for (int64_t i = 0; i < x.numel(); ++i)
      EXPECT_NEAR(testing::value_at(x, i), -0.37 * testing::value_at(x0, i), 1e-6 * std::abs(testing::value_at(x0, i)));
  }
}

// ---- embedding -------------------------------------------------------------------------------

// The host AdamW of optimizer offload against the CPU op (f32 everything: the same update, the
// order of its roundings aside), on one thread and on a pool; with bf16 gradients the CPU op on the
// widened gradient, with bf16 moments within one bf16 step.
TEST(AdamW, HostUpdateMatchesTheCpuOp) {
  HostThreads pool(3);
  const int64_t n = 150001;
  for (const DType gt : {DType::f32, DType::bf16})
    for (const DType mt : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(cat("g ", dtype_name(gt), ", moments ", dtype_name(mt)));
      Pool p;
      Tensor w = p.randn({n}, DType::f32), g = p.zeros({n}, gt), g32 = p.zeros({n}, DType::f32);
      cast(testing::exec(), p.randn({n}, DType::f32, 0.1), g);
      cast(testing::exec(), g, g32);
      Tensor m = p.zeros({n}, mt), v = p.zeros({n}, mt);
      cast(testing::exec(), p.randn({n}, DType::f32, 0.01), m);
      cast(testing::exec(), p.uniform({n}, 0.0, 0.01, DType::f32), v);
      Tensor w2 = p.clone(w), m2 = p.clone(m), v2 = p.clone(v), wc = p.zeros({n}, DType::bf16);
      const AdamWStep s{3e-3, 0.9, 0.95, 1e-8, 0.1, 1 - std::pow(0.9, 7), 1 - std::pow(0.95, 7), 0.25};
      adamw_update(testing::exec(), w, g32, m, v, s);
      adamw_update_host(w2, g, m2, v2, s, wc, mt == DType::f32 ? &pool : nullptr);
      auto rel = [&p](const Tensor& a, const Tensor& b) {  // bf16 widened first
        auto wide = [&p](const Tensor& t) {
          Tensor f = p.zeros(t.shape(), DType::f32);
          cast(testing::exec(), t, f);
          return f;
        };
        const Tensor fa = wide(a), fb = wide(b);
        return testing::max_abs_diff(fa, fb) / testing::max_abs(fb);
      };
      EXPECT_LE(rel(w2, w), 1e-6);
      EXPECT_LE(rel(m2, m), mt == DType::f32 ? 1e-6 : 8e-3);
      EXPECT_LE(rel(v2, v), mt == DType::f32 ? 1e-6 : 8e-3);
      EXPECT_LE(rel(wc, w), 4e-3);  // the bf16 compute copy
    }
}

TEST(Embedding, ForwardGathersRows) {
  Pool pool;
  const int64_t n = 11, v = 5, c = 7;  // n > v: repeated ids
  Tensor ids = pool.ints({n}, 0, v);
  for (DType dt : {DType::f64, DType::f32}) {
    Tensor table = pool.randn({v, c}, dt), out = pool.randn({n, c}, dt);
    embedding_forward(testing::exec(), ids, table, out);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < c; ++j)
        ASSERT_EQ(testing::value_at(out, i * c + j), testing::value_at(table, ids.ptr<int32_t>()[i] * c + j));
  }
}

TEST(Embedding, BackwardMatchesFiniteDifferencesAndAccumulates) {
  Pool pool;
  const int64_t n = 11, v = 5, c = 7;
  Tensor ids = pool.ints({n}, 0, v);
  Tensor table = pool.randn({v, c}), out = pool.zeros({n, c}), w = pool.randn({n, c});
  Tensor g = pool.zeros({v, c});
  embedding_backward(testing::exec(), ids, w, g);
  check_gradient("embedding dtable", table, g, [&] {
    embedding_forward(testing::exec(), ids, table, out);
    return dot(out, w);
  });
  // Parameter gradient: ACCUMULATED on top of what is there.
  Tensor r = pool.randn({v, c}), dtable = pool.clone(r);
  embedding_backward(testing::exec(), ids, w, dtable);
  embedding_backward(testing::exec(), ids, w, dtable);
  EXPECT_LE(max_abs_diff(dtable, axpy(pool, r, 2.0, g)), kF64Tol);
  // float32 agrees.
  Tensor g32 = pool.zeros({v, c}, DType::f32);
  embedding_backward(testing::exec(), ids, cast(pool, w, DType::f32), g32);
  expect_f32_close("embedding dtable f32", g32, g);
}

// ---- RMSNorm ---------------------------------------------------------------------------------

TEST(RMSNorm, ForwardMatchesFormula) {
  Pool pool;
  const int64_t n = 5, c = 7;
  const double eps = 1e-5;
  Tensor x = pool.randn({n, c}), w = pool.randn({c}), y = pool.randn({n, c}), rstd = pool.randn({n});
  rmsnorm_forward(testing::exec(), x, w, eps, y, rstd);
  for (int64_t i = 0; i < n; ++i) {
    double ms = 0;
    for (int64_t j = 0; j < c; ++j) ms += testing::value_at(x, i * c + j) * testing::value_at(x, i * c + j) / c;
    EXPECT_NEAR(testing::value_at(rstd, i), 1 / std::sqrt(ms + eps), kF64Tol);
    for (int64_t j = 0; j < c; ++j)
      EXPECT_NEAR(testing::value_at(y, i * c + j),
                  testing::value_at(w, j) * testing::value_at(x, i * c + j) / std::sqrt(ms + eps), kF64Tol);
  }
  Tensor y32 = pool.zeros({n, c}, DType::f32), rstd32 = pool.zeros({n}, DType::f32);
  rmsnorm_forward(testing::exec(), cast(pool, x, DType::f32), cast(pool, w, DType::f32), eps, y32, rstd32);
  expect_f32_close("rmsnorm y f32", y32, y);
  expect_f32_close("rmsnorm rstd f32", rstd32, rstd);
}

TEST(RMSNorm, BackwardMatchesFiniteDifferences) {
  Pool pool;
  const int64_t n = 5, c = 7;
  const double eps = 1e-5;
  Tensor x = pool.randn({n, c}), w = pool.randn({c}), y = pool.zeros({n, c}), rstd = pool.zeros({n});
  Tensor dy = pool.randn({n, c});
  rmsnorm_forward(testing::exec(), x, w, eps, y, rstd);
  Tensor dx = pool.randn({n, c}, DType::f64, 100.0);  // garbage: dx is WRITTEN
  Tensor dw = pool.zeros({c});
  rmsnorm_backward(testing::exec(), x, w, rstd, dy, dx, dw);
  auto loss = [&] {
    rmsnorm_forward(testing::exec(), x, w, eps, y, rstd);
    return dot(y, dy);
  };
  check_gradient("rmsnorm dx", x, dx, loss);
  check_gradient("rmsnorm dw", w, dw, loss);

  // dw ACCUMULATES, dx is overwritten.
  rmsnorm_forward(testing::exec(), x, w, eps, y, rstd);
  Tensor r = pool.randn({c}), dw2 = pool.clone(r), dx2 = pool.randn({n, c}, DType::f64, 100.0);
  rmsnorm_backward(testing::exec(), x, w, rstd, dy, dx2, dw2);
  rmsnorm_backward(testing::exec(), x, w, rstd, dy, dx2, dw2);
  EXPECT_LE(max_abs_diff(dw2, axpy(pool, r, 2.0, dw)), kF64Tol);
  EXPECT_LE(max_abs_diff(dx2, dx), kF64Tol);

  // float32 agrees.
  Tensor x32 = cast(pool, x, DType::f32), w32 = cast(pool, w, DType::f32);
  Tensor y32 = pool.zeros({n, c}, DType::f32), rstd32 = pool.zeros({n}, DType::f32);
  Tensor dx32 = pool.zeros({n, c}, DType::f32), dw32 = pool.zeros({c}, DType::f32);
  rmsnorm_forward(testing::exec(), x32, w32, eps, y32, rstd32);
  rmsnorm_backward(testing::exec(), x32, w32, rstd32, cast(pool, dy, DType::f32), dx32, dw32);
  expect_f32_close("rmsnorm dx f32", dx32, dx);
  expect_f32_close("rmsnorm dw f32", dw32, dw);
}

// The residual stream's fused forms give their compositions' bits (f64 and f32).
TEST(RMSNorm, FusedResidualFormsAreTheirCompositions) {
  Pool pool;
  const int64_t n = 6, c = 9;
  const double eps = 1e-5;
  auto same_bits = [](const Tensor& a, const Tensor& b) {
    return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
  };
  for (DType dt : {DType::f64, DType::f32}) {
    SCOPED_TRACE(dtype_name(dt));
    Tensor x = pool.randn({n, c}, dt), a = pool.randn({n, c}, dt);
    Tensor w = pool.randn({c}, dt), dy = pool.randn({n, c}, dt);
    // copy, add, norm, copy
    Tensor h = pool.clone(x), y = pool.zeros({n, c}, dt), rstd = pool.zeros({n}, dt);
    add_inplace(testing::exec(), h, a);
    rmsnorm_forward(testing::exec(), h, w, eps, y, rstd);
    Tensor hf = pool.randn({n, c}, dt), h2f = pool.randn({n, c}, dt), yf = pool.randn({n, c}, dt);
    Tensor rstdf = pool.randn({n}, dt);
    add_rmsnorm_forward(testing::exec(), x, a, w, eps, hf, yf, rstdf, h2f);
    EXPECT_TRUE(same_bits(hf, h)) << "hf";
    EXPECT_TRUE(same_bits(h2f, h)) << "h2f";
    EXPECT_TRUE(same_bits(yf, y)) << "yf";
    EXPECT_TRUE(same_bits(rstdf, rstd)) << "rstdf";
    Tensor h3 = pool.randn({n, c}, dt);  // without the second copy
    add_rmsnorm_forward(testing::exec(), x, a, w, eps, h3, yf, rstdf);
    EXPECT_TRUE(same_bits(h3, h)) << "h3";

    // backward into a temporary, then added
    Tensor res = pool.randn({n, c}, dt), dw0 = pool.randn({c}, dt);
    Tensor tmp = pool.zeros({n, c}, dt), dres = pool.clone(res), dw = pool.clone(dw0);
    rmsnorm_backward(testing::exec(), h, w, rstd, dy, tmp, dw);
    add_inplace(testing::exec(), dres, tmp);
    Tensor dresf = pool.clone(res), dwf = pool.clone(dw0);
    rmsnorm_backward_add(testing::exec(), h, w, rstd, dy, dresf, dwf);
    EXPECT_TRUE(same_bits(dresf, dres)) << "dresf";
    EXPECT_TRUE(same_bits(dwf, dw)) << "dwf";
  }
}

// ---- linear ----------------------------------------------------------------------------------

TEST(Linear, ForwardMatchesTripleLoop) {
  Pool pool;
  const int64_t n = 5, in = 7, out = 3;
  Tensor x = pool.randn({n, in}), w = pool.randn({out, in}), y = pool.randn({n, out});
  linear_forward(testing::exec(), x, w, y);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t o = 0; o < out; ++o) {
      double s = 0;
      for (int64_t k = 0; k < in; ++k) s += testing::value_at(x, i * in + k) * testing::value_at(w, o * in + k);
      EXPECT_NEAR(testing::value_at(y, i * out + o), s, kF64Tol);
    }
  Tensor y32 = pool.zeros({n, out}, DType::f32);
  linear_forward(testing::exec(), cast(pool, x, DType::f32), cast(pool, w, DType::f32), y32);
  expect_f32_close("linear y f32", y32, y);
}

TEST(Linear, BackwardMatchesFiniteDifferences) {
  Pool pool;
  const int64_t n = 5, in = 7, out = 3;
  Tensor x = pool.randn({n, in}), w = pool.randn({out, in}), y = pool.zeros({n, out}), dy = pool.randn({n, out});
  Tensor dx = pool.randn({n, in}, DType::f64, 100.0);  // garbage: dx is WRITTEN
  Tensor dw = pool.zeros({out, in});
  linear_backward(testing::exec(), x, w, dy, dx, dw);
  auto loss = [&] {
    linear_forward(testing::exec(), x, w, y);
    return dot(y, dy);
  };
  check_gradient("linear dx", x, dx, loss);
  check_gradient("linear dw", w, dw, loss);

  // dw ACCUMULATES; an undefined dx skips the input gradient.
  Tensor r = pool.randn({out, in}), dw2 = pool.clone(r);
  linear_backward(testing::exec(), x, w, dy, Tensor{}, dw2);
  linear_backward(testing::exec(), x, w, dy, Tensor{}, dw2);
  EXPECT_LE(max_abs_diff(dw2, axpy(pool, r, 2.0, dw)), kF64Tol);

  Tensor dx32 = pool.zeros({n, in}, DType::f32), dw32 = pool.zeros({out, in}, DType::f32);
  linear_backward(testing::exec(), cast(pool, x, DType::f32), cast(pool, w, DType::f32), cast(pool, dy, DType::f32),
                  dx32, dw32);
  expect_f32_close("linear dx f32", dx32, dx);
  expect_f32_close("linear dw f32", dw32, dw);
}

// ---- RoPE ------------------------------------------------------------------------------------

// Independent angle: position s times theta^(-2j/D), written as exp(-(2j/D) ln theta).
double rope_angle(double theta, int64_t s, int64_t j, int64_t d) {
  return static_cast<double>(s) * std::exp(-(2.0 * static_cast<double>(j) / static_cast<double>(d)) * std::log(theta));
}

TEST(RoPE, TableMatchesFormula) {
  Pool pool;
  const int64_t s = 5, d = 6;
  const double theta = 10000.0;
  Tensor cos = pool.randn({s, d}), sin = pool.randn({s, d});
  rope_table(theta, cos, sin);
  for (int64_t si = 0; si < s; ++si)
    for (int64_t j = 0; j < d / 2; ++j) {
      const double a = rope_angle(theta, si, j, d);
      for (int64_t jj : {j, j + d / 2}) {
        EXPECT_NEAR(testing::value_at(cos, si * d + jj), std::cos(a), kF64Tol);
        EXPECT_NEAR(testing::value_at(sin, si * d + jj), std::sin(a), kF64Tol);
      }
    }
  EXPECT_EQ(testing::value_at(cos, 0), 1.0);
  EXPECT_EQ(testing::value_at(sin, d - 1), 0.0);
}

TEST(RoPE, ForwardIsComplexRotation) {
  Pool pool;
  const int64_t b = 2, s = 5, h = 3, d = 6, half = d / 2;
  const double theta = 100.0;
  Tensor cos = pool.zeros({s, d}), sin = pool.zeros({s, d});
  rope_table(theta, cos, sin);
  Tensor x0 = pool.randn({b, s, h, d}), x = pool.clone(x0);
  rope_forward(testing::exec(), x, cos, sin);
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t si = 0; si < s; ++si)
      for (int64_t hi = 0; hi < h; ++hi)
        for (int64_t j = 0; j < half; ++j) {
          const int64_t base = ((bi * s + si) * h + hi) * d;
          // HF rotate_half pairs x[j] with x[j + D/2]: z = x[j] + i x[j + D/2], z *= e^{i angle}.
          const std::complex<double> z =
              std::complex<double>(testing::value_at(x0, base + j), testing::value_at(x0, base + j + half)) *
              std::polar(1.0, rope_angle(theta, si, j, d));
          EXPECT_NEAR(testing::value_at(x, base + j), z.real(), kF64Tol);
          EXPECT_NEAR(testing::value_at(x, base + j + half), z.imag(), kF64Tol);
        }
  Tensor cos32 = cast(pool, cos, DType::f32), sin32 = cast(pool, sin, DType::f32);
  Tensor x32 = cast(pool, x0, DType::f32);
  rope_forward(testing::exec(), x32, cos32, sin32);
  expect_f32_close("rope f32", x32, x);
  // The rotation is orthogonal: backward (the transpose) undoes forward.
  rope_backward(testing::exec(), x, cos, sin);
  EXPECT_LE(max_abs_diff(x, x0), kF64Tol);
}

TEST(RoPE, BackwardMatchesFiniteDifferences) {
  Pool pool;
  const int64_t b = 2, s = 5, h = 3, d = 6;
  Tensor cos = pool.zeros({s, d}), sin = pool.zeros({s, d});
  rope_table(100.0, cos, sin);
  Tensor x = pool.randn({b, s, h, d}), w = pool.randn({b, s, h, d}), y = pool.zeros({b, s, h, d});
  Tensor dx = pool.clone(w);
  rope_backward(testing::exec(), dx, cos, sin);
  check_gradient("rope dx", x, dx, [&] {
    y.copy_from(x);
    rope_forward(testing::exec(), y, cos, sin);
    return dot(y, w);
  });
  Tensor dx32 = cast(pool, w, DType::f32);
  rope_backward(testing::exec(), dx32, cast(pool, cos, DType::f32), cast(pool, sin, DType::f32));
  expect_f32_close("rope dx f32", dx32, dx);
}

// ---- SwiGLU ----------------------------------------------------------------------------------

// Column of g_j (u: false) or u_j (u: true) in a gu row of width 2F under `layout`.
int64_t gate_up_column(GateUp layout, int64_t f, int64_t j, bool u) {
  return layout == GateUp::pairs ? 2 * j + (u ? 1 : 0) : j + (u ? f : 0);
}

TEST(SwiGLU, ForwardAndBackward) {
  for (GateUp layout : {GateUp::halves, GateUp::pairs}) {
    SCOPED_TRACE(layout == GateUp::pairs ? "pairs" : "halves");
    Pool pool;
    const int64_t n = 5, f = 7;
    Tensor gu = pool.randn({n, 2 * f}), h = pool.zeros({n, f}), dh = pool.randn({n, f});
    swiglu_forward(testing::exec(), gu, h, layout);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < f; ++j) {
        const double g = testing::value_at(gu, i * 2 * f + gate_up_column(layout, f, j, false)),
                     u = testing::value_at(gu, i * 2 * f + gate_up_column(layout, f, j, true));
        EXPECT_NEAR(testing::value_at(h, i * f + j), g / (1 + std::exp(-g)) * u, kF64Tol);
      }
    Tensor dgu = pool.randn({n, 2 * f}, DType::f64, 100.0);
    swiglu_backward(testing::exec(), gu, dh, dgu, layout);
    check_gradient("swiglu dgu", gu, dgu, [&] {
      swiglu_forward(testing::exec(), gu, h, layout);
      return dot(h, dh);
    });
    Tensor gu32 = cast(pool, gu, DType::f32), h32 = pool.zeros({n, f}, DType::f32);
    Tensor dgu32 = pool.zeros({n, 2 * f}, DType::f32);
    swiglu_forward(testing::exec(), gu32, h32, layout);
    swiglu_backward(testing::exec(), gu32, cast(pool, dh, DType::f32), dgu32, layout);
    swiglu_forward(testing::exec(), gu, h, layout);
    expect_f32_close("swiglu h f32", h32, h);
    expect_f32_close("swiglu dgu f32", dgu32, dgu);
  }
}

// pairs is halves with gu's columns permuted (halves column j -> pairs 2j, F + j -> 2j + 1):
// the same h, and dgu permuted alike, to the bit (same formula on the same values).
TEST(SwiGLU, PairsAreHalvesWithColumnsInterleaved) {
  Pool pool;
  for (DType dt : {DType::f64, DType::f32}) {
    const int64_t n = 6, f = 9;
    Tensor gu_halves = pool.randn({n, 2 * f}, dt, 3.0), gu_pairs = pool.zeros({n, 2 * f}, dt);
    Tensor dh = pool.randn({n, f}, dt);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < f; ++j)
        for (bool u : {false, true})
          testing::set_value_at(gu_pairs, i * 2 * f + gate_up_column(GateUp::pairs, f, j, u),
                                testing::value_at(gu_halves, i * 2 * f + gate_up_column(GateUp::halves, f, j, u)));
    Tensor h_halves = pool.zeros({n, f}, dt), h_pairs = pool.zeros({n, f}, dt);
    Tensor dgu_halves = pool.zeros({n, 2 * f}, dt), dgu_pairs = pool.zeros({n, 2 * f}, dt);
    swiglu_forward(testing::exec(), gu_halves, h_halves, GateUp::halves);
    swiglu_forward(testing::exec(), gu_pairs, h_pairs, GateUp::pairs);
    swiglu_backward(testing::exec(), gu_halves, dh, dgu_halves, GateUp::halves);
    swiglu_backward(testing::exec(), gu_pairs, dh, dgu_pairs, GateUp::pairs);
    EXPECT_EQ(max_abs_diff(h_pairs, h_halves), 0.0);
    EXPECT_GT(max_abs(h_pairs), 0.0);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < f; ++j)
        for (bool u : {false, true})
          ASSERT_EQ(testing::value_at(dgu_pairs, i * 2 * f + gate_up_column(GateUp::pairs, f, j, u)),
                    testing::value_at(dgu_halves, i * 2 * f + gate_up_column(GateUp::halves, f, j, u)))
              << i << ", " << j << (u ? " u" : " g");
  }
}

// ---- cross-entropy ---------------------------------------------------------------------------

// Multi-token prediction's loss from the depths' sums: Model::mtp_loss's formula, added to out.
TEST(MtpLoss, AccumulatesTheWeightedMeanOfTheDepths) {
  Pool pool;
  Tensor losses = pool.zeros({3}), out = pool.zeros({1});
  const double l[] = {10.5, 7.25, 3.0};
  for (int k = 0; k < 3; ++k) losses.ptr<double>()[k] = l[k];
  out.ptr<double>()[0] = 1.0;
  mtp_loss_accumulate(testing::exec(), losses, 16, 0.3, out);
  double s = 0;
  for (int k = 1; k <= 3; ++k) s += l[k - 1] * 16.0 / (16.0 - k);
  EXPECT_EQ(out.ptr<double>()[0], 1.0 + s * 0.3 / 3.0);
  mtp_loss_accumulate(testing::exec(), losses.slice(0, 0), 16, 0.3, out);  // no depths: nothing added
  EXPECT_EQ(out.ptr<double>()[0], 1.0 + s * 0.3 / 3.0);
}

TEST(CrossEntropy, ForwardMatchesNaiveSoftmax) {
  Pool pool;
  const int64_t n = 5, v = 7;
  Tensor logits = pool.randn({n, v}, DType::f64, 3.0), targets = pool.ints({n}, 0, v), lse = pool.zeros({n});
  const double loss = cross_entropy_forward(testing::exec(), logits, targets, lse);
  double want = 0;
  for (int64_t i = 0; i < n; ++i) {
    double z = 0;
    for (int64_t j = 0; j < v; ++j) z += std::exp(testing::value_at(logits, i * v + j));
    EXPECT_NEAR(testing::value_at(lse, i), std::log(z), kF64Tol);
    want += -std::log(std::exp(testing::value_at(logits, i * v + targets.ptr<int32_t>()[i])) / z);
  }
  EXPECT_NEAR(loss, want, kF64Tol * n);
  Tensor loss_1 = pool.zeros({1});  // the sum written out instead of returned: the same bits
  EXPECT_TRUE(std::isnan(cross_entropy_forward(testing::exec(), logits, targets, lse, loss_1)));
  EXPECT_EQ(loss_1.ptr<double>()[0], loss);

  Tensor lse32 = pool.zeros({n}, DType::f32);
  const double loss32 = cross_entropy_forward(testing::exec(), cast(pool, logits, DType::f32), targets, lse32);
  EXPECT_NEAR(loss32, loss, kF32Rel * std::max(1.0, std::abs(loss)));
  expect_f32_close("cross-entropy lse f32", lse32, lse);
}

TEST(CrossEntropy, StableForLargeLogits) {
  Pool pool;
  const int64_t n = 5, v = 7;
  Tensor logits = pool.randn({n, v}, DType::f64, 3.0), targets = pool.ints({n}, 0, v), lse = pool.zeros({n});
  const double loss = cross_entropy_forward(testing::exec(), logits, targets, lse);
  for (DType dt : {DType::f64, DType::f32}) {
    Tensor shifted = cast(pool, logits, dt);
    // Row r shifted by 1000 (r + 1): exp overflows in both dtypes unless the max is taken out.
    for (int64_t i = 0; i < shifted.numel(); ++i)
      testing::set_value_at(shifted, i, testing::value_at(shifted, i) + 1000.0 * static_cast<double>(i / v + 1));
    Tensor lse_s = pool.zeros({n}, dt), d = pool.zeros({n, v}, dt);
    const double loss_s = cross_entropy_forward(testing::exec(), shifted, targets, lse_s);
    ASSERT_TRUE(std::isfinite(loss_s));
    // f32 logits near 5000 carry up to 2.5e-4 rounding each.
    EXPECT_NEAR(loss_s, loss, dt == DType::f32 ? 1e-3 * n : 1e-9) << dtype_name(dt);
    cross_entropy_backward(testing::exec(), shifted, targets, lse_s, 1.0, d);
    for (int64_t i = 0; i < d.numel(); ++i) ASSERT_TRUE(std::isfinite(testing::value_at(d, i)));
  }
}

TEST(CrossEntropy, BackwardMatchesFiniteDifferences) {
  Pool pool;
  const int64_t n = 5, v = 7;
  const double grad_scale = 0.3;
  Tensor logits = pool.randn({n, v}, DType::f64, 3.0), targets = pool.ints({n}, 0, v), lse = pool.zeros({n});
  cross_entropy_forward(testing::exec(), logits, targets, lse);
  Tensor d = pool.randn({n, v}, DType::f64, 100.0);  // garbage: dlogits is WRITTEN
  cross_entropy_backward(testing::exec(), logits, targets, lse, grad_scale, d);
  check_gradient("cross-entropy dlogits", logits, d,
                 [&] { return grad_scale * cross_entropy_forward(testing::exec(), logits, targets, lse); });

  cross_entropy_forward(testing::exec(), logits, targets, lse);
  Tensor logits32 = cast(pool, logits, DType::f32), lse32 = pool.zeros({n}, DType::f32);
  Tensor d32 = pool.zeros({n, v}, DType::f32);
  cross_entropy_forward(testing::exec(), logits32, targets, lse32);
  cross_entropy_backward(testing::exec(), logits32, targets, lse32, grad_scale, d32);
  expect_f32_close("cross-entropy dlogits f32", d32, d);
}

// kIgnoreTarget rows add no loss and get a zero gradient row; the rest is the plain loss.
TEST(CrossEntropy, IgnoredTargetsAddNothing) {
  Pool pool;
  const int64_t n = 6, v = 7;
  Tensor logits = pool.randn({n, v}, DType::f64, 3.0), targets = pool.ints({n}, 0, v), lse = pool.zeros({n});
  Tensor kept = pool.ints({3}, 0, v), kept_logits = pool.zeros({3, v}), kept_lse = pool.zeros({3});
  for (int64_t i = 0, r = 0; i < n; ++i) {
    if (i % 2 == 1) {
      targets.ptr<int32_t>()[i] = kIgnoreTarget;
      continue;
    }
    kept.ptr<int32_t>()[r] = targets.ptr<int32_t>()[i];
    for (int64_t j = 0; j < v; ++j) testing::set_value_at(kept_logits, r * v + j, testing::value_at(logits, i * v + j));
    ++r;
  }
  EXPECT_EQ(cross_entropy_forward(testing::exec(), logits, targets, lse),
            cross_entropy_forward(testing::exec(), kept_logits, kept, kept_lse));
  Tensor d = pool.randn({n, v}, DType::f64, 100.0);  // garbage: dlogits is WRITTEN
  cross_entropy_backward(testing::exec(), logits, targets, lse, 0.5, d);
  for (int64_t i = 1; i < n; i += 2)
    for (int64_t j = 0; j < v; ++j) EXPECT_EQ(testing::value_at(d, i * v + j), 0.0);
  check_gradient("cross-entropy with ignored rows", logits, d,
                 [&] { return 0.5 * cross_entropy_forward(testing::exec(), logits, targets, lse); });
}

// ---- matmul on matrix views -------------------------------------------------------------------

// c = alpha * op(a) @ op(b) + beta * c on views with leading dimensions and offsets (the gate|up
// halves of a fused [N, 2F] buffer), against a triple loop; elements outside c's view untouched;
// beta = 0 ignores NaN in c; K = 0 scales c; float32 against float64.
TEST(Matmul, ViewsMatchTripleLoop) {
  const int64_t m = 5, n = 4, k = 3;
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb)
      for (double beta : {0.0, 0.75}) {
        SCOPED_TRACE(::testing::Message() << "trans_a " << ta << " trans_b " << tb << " beta " << beta);
        Pool pool;
        // a: stored (ta ? k x m : m x k) inside [.., 9] at offset 2; b: (tb ? n x k : k x n) whole;
        // c: columns [3, 3 + n) of an [m, 11] tensor.
        const int64_t a_rows = ta ? k : m, a_cols = ta ? m : k, b_rows = tb ? n : k, b_cols = tb ? k : n;
        Tensor a_st = pool.randn({a_rows + 1, 9}), b = pool.randn({b_rows, b_cols}), c_st = pool.randn({m, 11});
        if (beta == 0.0)
          for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < n; ++j) testing::set_value_at(c_st, i * 11 + 3 + j, std::nan(""));
        const Tensor c0 = pool.clone(c_st);
        const MatrixView a{a_st, a_rows, a_cols, 9, 2};
        const double alpha = -1.5;
        matmul(testing::exec(), a, ta, as_matrix(b), tb, column_block(c_st, 3, 3 + n), alpha, beta);
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = 0; j < 11; ++j) {
            const double got = testing::value_at(c_st, i * 11 + j);
            if (j < 3 || j >= 3 + n) {
              EXPECT_EQ(got, testing::value_at(c0, i * 11 + j)) << "outside the view at " << i << ", " << j;
              continue;
            }
            double s = 0;
            for (int64_t l = 0; l < k; ++l) {
              const double av = ta ? testing::value_at(a_st, 2 + l * 9 + i) : testing::value_at(a_st, 2 + i * 9 + l);
              const double bv = tb ? testing::value_at(b, (j - 3) * k + l) : testing::value_at(b, l * n + j - 3);
              s += av * bv;
            }
            const double want = alpha * s + (beta == 0.0 ? 0.0 : beta * testing::value_at(c0, i * 11 + j));
            EXPECT_NEAR(got, want, kF64Tol) << i << ", " << j;
          }
      }

  // float32 against float64 on the same views.
  Pool pool;
  Tensor a = pool.randn({m, k}), b = pool.randn({n, k}), c = pool.randn({m, 2 * n});
  Tensor a32 = cast(pool, a, DType::f32), b32 = cast(pool, b, DType::f32), c32 = cast(pool, c, DType::f32);
  matmul(testing::exec(), as_matrix(a), false, as_matrix(b), true, column_block(c, n, 2 * n), 0.5, 1.0);
  matmul(testing::exec(), as_matrix(a32), false, as_matrix(b32), true, column_block(c32, n, 2 * n), 0.5, 1.0);
  expect_f32_close("matmul f32", c32, c);

  // K = 0: c = beta * c.
  Tensor e = pool.zeros({m, 0}), f = pool.zeros({0, n}), g = pool.randn({m, n}), g0 = pool.clone(g);
  matmul(testing::exec(), as_matrix(e), false, as_matrix(f), false, as_matrix(g), 1.0, -2.0);
  for (int64_t i = 0; i < m * n; ++i) EXPECT_EQ(testing::value_at(g, i), -2.0 * testing::value_at(g0, i));
}

}  // namespace
// cast: f64 -> f32 -> bf16 -> f32 round to nearest even, exactly as f32_to_bf16 does.
TEST(Cast, RoundsToNearestEvenAndBack) {
  Pool pool;
  const int64_t n = 1000;
  Tensor x = pool.randn({n}, DType::f64, 3.0), f = pool.zeros({n}, DType::f32), b = pool.zeros({n}, DType::bf16),
         back = pool.zeros({n}, DType::f32);
  cast(testing::exec(), x, f);
  cast(testing::exec(), f, b);
  cast(testing::exec(), b, back);
  for (int64_t i = 0; i < n; ++i) {
    const float fi = static_cast<float>(x.ptr<double>()[i]);
    ASSERT_EQ(f.ptr<float>()[i], fi);
    ASSERT_EQ(static_cast<uint16_t*>(b.data())[i], f32_to_bf16(fi));
    ASSERT_EQ(back.ptr<float>()[i], bf16_to_f32(f32_to_bf16(fi)));
  }
}

// copy/add/fill on matrix views touch exactly the view's elements.
TEST(MatrixViews, CopyAddFillTouchOnlyTheView) {
  Pool pool;
  Tensor src = pool.randn({5, 7}), dst = pool.randn({6, 9}), before = pool.clone(dst);
  const MatrixView s{src, 4, 3, 7, 2}, d{dst, 4, 3, 9, 13};  // rows 0-3 cols 2-4 -> rows 1-4 cols 4-6
  copy_matrix(testing::exec(), s, d);
  for (int64_t i = 0; i < 6 * 9; ++i) {
    const int64_t r = i / 9, c = i % 9;
    const bool inside = r >= 1 && r <= 4 && c >= 4 && c <= 6;
    EXPECT_EQ(dst.ptr<double>()[i], inside ? src.ptr<double>()[(r - 1) * 7 + c - 2] : before.ptr<double>()[i]);
  }
  add_matrix(testing::exec(), s, d);
  fill_matrix(testing::exec(), MatrixView{dst, 1, 2, 9, 0}, -3.5);
  for (int64_t i = 0; i < 6 * 9; ++i) {
    const int64_t r = i / 9, c = i % 9;
    const bool inside = r >= 1 && r <= 4 && c >= 4 && c <= 6;
    const double want = r == 0 && c < 2 ? -3.5
                        : inside        ? 2 * src.ptr<double>()[(r - 1) * 7 + c - 2]
                                        : before.ptr<double>()[i];
    EXPECT_EQ(dst.ptr<double>()[i], want) << r << " " << c;
  }
  Tensor ids = pool.ints({2, 5}, 0, 9);
  fill_matrix(testing::exec(), MatrixView{ids, 2, 2, 5, 3}, kIgnoreTarget);
  EXPECT_EQ(ids.ptr<int32_t>()[3], kIgnoreTarget);
  EXPECT_EQ(ids.ptr<int32_t>()[9], kIgnoreTarget);
}

}  // namespace moefold

// Causal grouped-query attention (CPU reference): forward and lse against a triple loop with an
// explicit mask, backward against float64 finite differences for q, k and v (all WRITTEN),
// float32 against float64 within 1e-5 relative to the magnitude, over GQA/MHA/MQA shapes and S=1.
#include <cmath>
#include <limits>
#include <vector>

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

struct Case {
  int64_t b, s, q, g, d;
};
// GQA with 3 and 2 query heads per group, MHA (G == Q), S = 1, MQA (G = 1).
const Case kCases[] = {{2, 5, 6, 2, 4}, {2, 5, 6, 3, 4}, {2, 5, 6, 6, 4}, {2, 1, 6, 2, 4}, {1, 7, 4, 1, 3}};

std::string name(const Case& c) {
  return "B=" + std::to_string(c.b) + " S=" + std::to_string(c.s) + " Q=" + std::to_string(c.q) +
         " G=" + std::to_string(c.g) + " D=" + std::to_string(c.d);
}

Tensor cast(Pool& pool, const Tensor& t, DType dtype) {
  Tensor c = pool.zeros(t.shape(), dtype);
  for (int64_t i = 0; i < t.numel(); ++i)
    dispatch_float(dtype, [&]<class T>() { c.ptr<T>()[i] = static_cast<T>(testing::value_at(t, i)); });
  return c;
}
void expect_f32_close(const char* what, const Tensor& got32, const Tensor& want64) {
  EXPECT_LE(max_abs_diff(got32, want64), kF32Rel * std::max(1.0, max_abs(want64))) << what;
}

// Everything one attention call needs, float64 unless cast.
struct Inputs {
  Tensor q, k, v;
  double scale;
};
Inputs make_inputs(Pool& pool, const Case& c) {
  return {pool.randn({c.b, c.s, c.q, c.d}), pool.randn({c.b, c.s, c.g, c.d}), pool.randn({c.b, c.s, c.g, c.d}),
          1.0 / std::sqrt(static_cast<double>(c.d))};
}

TEST(Attention, ForwardMatchesMaskedTripleLoop) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(name(c));
    Pool pool;
    Inputs in = make_inputs(pool, c);
    Tensor out = pool.randn({c.b, c.s, c.q, c.d}), lse = pool.randn({c.b, c.q, c.s});
    Tensor work = pool.randn({c.s, c.s});
    attention_forward(testing::exec(), in.q, in.k, in.v, in.scale, out, lse, work);

    const double inf = std::numeric_limits<double>::infinity();
    std::vector<double> p(c.s);
    for (int64_t b = 0; b < c.b; ++b)
      for (int64_t h = 0; h < c.q; ++h) {
        const int64_t g = h * c.g / c.q;  // kv head of query head h
        for (int64_t i = 0; i < c.s; ++i) {
          double m = -inf;
          for (int64_t j = 0; j < c.s; ++j) {
            double sc = 0;
            for (int64_t e = 0; e < c.d; ++e)
              sc += testing::value_at(in.q, ((b * c.s + i) * c.q + h) * c.d + e) *
                    testing::value_at(in.k, ((b * c.s + j) * c.g + g) * c.d + e);
            p[j] = j <= i ? sc * in.scale : -inf;  // causal mask
            m = std::max(m, p[j]);
          }
          double z = 0;
          for (int64_t j = 0; j < c.s; ++j) z += std::exp(p[j] - m);
          EXPECT_NEAR(testing::value_at(lse, (b * c.q + h) * c.s + i), m + std::log(z), kF64Tol);
          for (int64_t e = 0; e < c.d; ++e) {
            double o = 0;
            for (int64_t j = 0; j < c.s; ++j)
              o += std::exp(p[j] - m) / z * testing::value_at(in.v, ((b * c.s + j) * c.g + g) * c.d + e);
            EXPECT_NEAR(testing::value_at(out, ((b * c.s + i) * c.q + h) * c.d + e), o, kF64Tol);
          }
        }
      }

    Tensor out32 = pool.zeros(out.shape(), DType::f32), lse32 = pool.zeros(lse.shape(), DType::f32);
    attention_forward(testing::exec(), cast(pool, in.q, DType::f32), cast(pool, in.k, DType::f32),
                      cast(pool, in.v, DType::f32), in.scale, out32, lse32, pool.zeros({c.s, c.s}, DType::f32));
    expect_f32_close("attention out f32", out32, out);
    expect_f32_close("attention lse f32", lse32, lse);
  }
}

TEST(Attention, BackwardMatchesFiniteDifferences) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(name(c));
    Pool pool;
    Inputs in = make_inputs(pool, c);
    Tensor out = pool.zeros({c.b, c.s, c.q, c.d}), lse = pool.zeros({c.b, c.q, c.s});
    Tensor work = pool.zeros({2, c.s, c.s}), dout = pool.randn(out.shape());
    attention_forward(testing::exec(), in.q, in.k, in.v, in.scale, out, lse, work);
    // Garbage in every gradient: all three are WRITTEN.
    Tensor dq = pool.randn(in.q.shape(), DType::f64, 100.0), dk = pool.randn(in.k.shape(), DType::f64, 100.0),
           dv = pool.randn(in.v.shape(), DType::f64, 100.0);
    attention_backward(testing::exec(), in.q, in.k, in.v, out, lse, dout, in.scale, dq, dk, dv, work);
    auto loss = [&] {
      attention_forward(testing::exec(), in.q, in.k, in.v, in.scale, out, lse, work);
      return dot(out, dout);
    };
    check_gradient("attention dq", in.q, dq, loss);
    check_gradient("attention dk", in.k, dk, loss);
    check_gradient("attention dv", in.v, dv, loss);

    // float32 agrees with float64.
    attention_forward(testing::exec(), in.q, in.k, in.v, in.scale, out, lse, work);
    Tensor q32 = cast(pool, in.q, DType::f32), k32 = cast(pool, in.k, DType::f32), v32 = cast(pool, in.v, DType::f32);
    Tensor out32 = pool.zeros(out.shape(), DType::f32), lse32 = pool.zeros(lse.shape(), DType::f32);
    Tensor work32 = pool.zeros({2, c.s, c.s}, DType::f32);
    Tensor dq32 = pool.randn(in.q.shape(), DType::f32, 100.0), dk32 = pool.randn(in.k.shape(), DType::f32, 100.0),
           dv32 = pool.randn(in.v.shape(), DType::f32, 100.0);
    attention_forward(testing::exec(), q32, k32, v32, in.scale, out32, lse32, work32);
    attention_backward(testing::exec(), q32, k32, v32, out32, lse32, cast(pool, dout, DType::f32), in.scale, dq32, dk32,
                       dv32, work32);
    expect_f32_close("attention dq f32", dq32, dq);
    expect_f32_close("attention dk f32", dk32, dk);
    expect_f32_close("attention dv f32", dv32, dv);
  }
}

}  // namespace
}  // namespace moefold

// Ops with explicit positions (context parallelism): rope_*_at and attention_*_at against the
// plain ops with positions 0..S-1 (bit-identical), against float64 finite differences, and a CP
// run simulated in one process (each rank's front/back chunk queries against every key, in the
// gathered rank-major key order) reproducing the full attention's rows and gradients (1e-12).
#include <cmath>
#include <vector>

#include "moefold/ops/ops.h"
#include "testing.h"

namespace moefold {
namespace {

using testing::check_gradient;
using testing::dot;
using testing::max_abs_diff;
using testing::Pool;

constexpr double kF64Tol = 1e-12;

Tensor positions(Pool& pool, const std::vector<int32_t>& p) {
  Tensor t = pool.zeros({static_cast<int64_t>(p.size())}, DType::i32);
  for (size_t i = 0; i < p.size(); ++i) t.ptr<int32_t>()[i] = p[i];
  return t;
}
std::vector<int32_t> iota(int64_t n) {
  std::vector<int32_t> p(n);
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<int32_t>(i);
  return p;
}
// CP rank r of c over S tokens: chunk r then chunk 2c-1-r of S/(2c) (the load-balanced layout).
std::vector<int32_t> cp_pos(int64_t s, int c, int r) {
  const int64_t chunk = s / (2 * c);
  std::vector<int32_t> p;
  for (int64_t i = 0; i < chunk; ++i) p.push_back(static_cast<int32_t>(r * chunk + i));
  for (int64_t i = 0; i < chunk; ++i) p.push_back(static_cast<int32_t>((2 * c - 1 - r) * chunk + i));
  return p;
}

// Rows pos[i] of dim 1 of a [B, S, H, D] tensor into a [B, n, H, D] tensor, and the reverse.
Tensor gather_rows(Pool& pool, const Tensor& x, const std::vector<int32_t>& pos) {
  const int64_t b = x.size(0), s = x.size(1), row = x.size(2) * x.size(3), n = static_cast<int64_t>(pos.size());
  Tensor y = pool.zeros({b, n, x.size(2), x.size(3)});
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t e = 0; e < row; ++e)
        y.ptr<double>()[(bi * n + i) * row + e] = x.ptr<double>()[(bi * s + pos[i]) * row + e];
  return y;
}
// lse_BQS rows pos into [B, Q, n].
Tensor gather_lse(Pool& pool, const Tensor& lse, const std::vector<int32_t>& pos) {
  const int64_t b = lse.size(0), q = lse.size(1), s = lse.size(2), n = static_cast<int64_t>(pos.size());
  Tensor y = pool.zeros({b, q, n});
  for (int64_t i = 0; i < b * q; ++i)
    for (int64_t j = 0; j < n; ++j) y.ptr<double>()[i * n + j] = lse.ptr<double>()[i * s + pos[j]];
  return y;
}

TEST(RopeAt, IotaIsPlainRopeAndEachTokenReadsItsRow) {
  Pool pool;
  const int64_t b = 2, s = 5, h = 3, d = 6, p = 11;
  Tensor cos = pool.zeros({p, d}), sin = pool.zeros({p, d});
  rope_table(100.0, cos, sin);
  Tensor x0 = pool.randn({b, s, h, d});
  // Positions 0..S-1 on a table of exactly S rows: bit-identical to the plain op.
  Tensor cos_s = cos.slice(0, s), sin_s = sin.slice(0, s);
  Tensor a = pool.clone(x0), c = pool.clone(x0);
  rope_forward(testing::exec(), a, cos_s, sin_s);
  rope_forward_at(testing::exec(), c, positions(pool, iota(s)), cos, sin);
  EXPECT_EQ(max_abs_diff(a, c), 0.0);
  rope_backward(testing::exec(), a, cos_s, sin_s);
  rope_backward_at(testing::exec(), c, positions(pool, iota(s)), cos, sin);
  EXPECT_EQ(max_abs_diff(a, c), 0.0);
  // Arbitrary positions: token i equals the plain op on a one-row table slice at pos[i].
  const std::vector<int32_t> pos = {7, 0, 10, 3, 3};
  Tensor y = pool.clone(x0);
  rope_forward_at(testing::exec(), y, positions(pool, pos), cos, sin);
  for (int64_t i = 0; i < s; ++i) {
    Tensor one = gather_rows(pool, x0, {static_cast<int32_t>(i)});
    rope_forward(testing::exec(), one, cos.slice(pos[i], pos[i] + 1), sin.slice(pos[i], pos[i] + 1));
    EXPECT_EQ(max_abs_diff(one, gather_rows(pool, y, {static_cast<int32_t>(i)})), 0.0) << "token " << i;
  }
}

TEST(RopeAt, BackwardMatchesFiniteDifferences) {
  Pool pool;
  const int64_t b = 2, s = 4, h = 2, d = 6, p = 9;
  Tensor cos = pool.zeros({p, d}), sin = pool.zeros({p, d});
  rope_table(100.0, cos, sin);
  Tensor pos = positions(pool, {8, 2, 5, 1});
  Tensor x = pool.randn({b, s, h, d}), w = pool.randn({b, s, h, d}), y = pool.zeros({b, s, h, d});
  Tensor dx = pool.clone(w);
  rope_backward_at(testing::exec(), dx, pos, cos, sin);
  check_gradient("rope_at dx", x, dx, [&] {
    y.copy_from(x);
    rope_forward_at(testing::exec(), y, pos, cos, sin);
    return dot(y, w);
  });
}

struct Case {
  int64_t b, s, q, g, d;
};
const Case kCases[] = {{2, 6, 6, 2, 4}, {2, 12, 6, 2, 3}, {1, 6, 4, 1, 3}, {2, 6, 3, 3, 4}};

TEST(AttentionAt, IotaIsBitIdenticalToPlain) {
  for (const Case& c : kCases) {
    Pool pool;
    Tensor q = pool.randn({c.b, c.s, c.q, c.d}), k = pool.randn({c.b, c.s, c.g, c.d}), v = pool.randn(k.shape());
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
    Tensor pos = positions(pool, iota(c.s)), work = pool.zeros({2, c.s, c.s}), dout = pool.randn(q.shape());
    Tensor out1 = pool.zeros(q.shape()), lse1 = pool.zeros({c.b, c.q, c.s});
    Tensor out2 = pool.zeros(q.shape()), lse2 = pool.zeros({c.b, c.q, c.s});
    attention_forward(testing::exec(), q, k, v, scale, out1, lse1, work);
    attention_forward_at(testing::exec(), q, k, v, pos, pos, scale, out2, lse2, work);
    EXPECT_EQ(max_abs_diff(out1, out2), 0.0);
    EXPECT_EQ(max_abs_diff(lse1, lse2), 0.0);
    Tensor dq1 = pool.zeros(q.shape()), dk1 = pool.zeros(k.shape()), dv1 = pool.zeros(k.shape());
    Tensor dq2 = pool.randn(q.shape()), dk2 = pool.randn(k.shape()), dv2 = pool.randn(k.shape());
    attention_backward(testing::exec(), q, k, v, out1, lse1, dout, scale, dq1, dk1, dv1, work);
    attention_backward_at(testing::exec(), q, k, v, pos, pos, out2, lse2, dout, scale, dq2, dk2, dv2, work);
    EXPECT_EQ(max_abs_diff(dq1, dq2), 0.0);
    EXPECT_EQ(max_abs_diff(dk1, dk2), 0.0);
    EXPECT_EQ(max_abs_diff(dv1, dv2), 0.0);
  }
}

TEST(AttentionAt, BackwardMatchesFiniteDifferences) {
  // Queries of CP rank 1 of 2 (positions 3..5 and 6..8 of S = 12) against all keys, keys listed
  // in a shuffled order: the mask follows positions, not indices.
  Pool pool;
  const int64_t b = 2, sq = 6, sk = 12, nq = 6, g = 2, d = 3;
  Tensor q_pos = positions(pool, cp_pos(sk, 2, 1));
  Tensor k_pos = positions(pool, {11, 0, 5, 2, 9, 7, 1, 3, 10, 4, 8, 6});
  Tensor q = pool.randn({b, sq, nq, d}), k = pool.randn({b, sk, g, d}), v = pool.randn({b, sk, g, d});
  const double scale = 0.7;
  Tensor out = pool.zeros(q.shape()), lse = pool.zeros({b, nq, sq}), work = pool.zeros({2, sq, sk});
  Tensor dout = pool.randn(q.shape());
  attention_forward_at(testing::exec(), q, k, v, q_pos, k_pos, scale, out, lse, work);
  Tensor dq = pool.randn(q.shape(), DType::f64, 100.0), dk = pool.randn(k.shape(), DType::f64, 100.0),
         dv = pool.randn(v.shape(), DType::f64, 100.0);
  attention_backward_at(testing::exec(), q, k, v, q_pos, k_pos, out, lse, dout, scale, dq, dk, dv, work);
  auto loss = [&] {
    attention_forward_at(testing::exec(), q, k, v, q_pos, k_pos, scale, out, lse, work);
    return dot(out, dout);
  };
  check_gradient("attention_at dq", q, dq, loss);
  check_gradient("attention_at dk", k, dk, loss);
  check_gradient("attention_at dv", v, dv, loss);
}

TEST(AttentionAt, SimulatedContextParallelReproducesFullAttention) {
  const int64_t b = 2, s = 12, nq = 6, g = 2, d = 4;
  for (int c : {1, 2, 3}) {
    SCOPED_TRACE("cp = " + std::to_string(c));
    Pool pool;
    Tensor q = pool.randn({b, s, nq, d}), k = pool.randn({b, s, g, d}), v = pool.randn({b, s, g, d});
    Tensor dout = pool.randn(q.shape());
    const double scale = 0.5;
    Tensor out = pool.zeros(q.shape()), lse = pool.zeros({b, nq, s}), work = pool.zeros({2, s, s});
    Tensor dq = pool.zeros(q.shape()), dk = pool.zeros(k.shape()), dv = pool.zeros(v.shape());
    attention_forward(testing::exec(), q, k, v, scale, out, lse, work);
    attention_backward(testing::exec(), q, k, v, out, lse, dout, scale, dq, dk, dv, work);

    // Gathered keys in rank-major order, as the CP module lays them out.
    std::vector<int32_t> key_order;
    for (int r = 0; r < c; ++r)
      for (int32_t p : cp_pos(s, c, r)) key_order.push_back(p);
    Tensor k_pos = positions(pool, key_order);
    Tensor k_all = gather_rows(pool, k, key_order), v_all = gather_rows(pool, v, key_order);
    Tensor dk_sum = pool.zeros(k.shape()), dv_sum = pool.zeros(v.shape());
    for (int r = 0; r < c; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      const std::vector<int32_t> mine = cp_pos(s, c, r);
      const int64_t len = static_cast<int64_t>(mine.size());
      Tensor q_pos = positions(pool, mine), q_r = gather_rows(pool, q, mine), dout_r = gather_rows(pool, dout, mine);
      Tensor out_r = pool.zeros(q_r.shape()), lse_r = pool.zeros({b, nq, len}), work_r = pool.zeros({2, len, s});
      attention_forward_at(testing::exec(), q_r, k_all, v_all, q_pos, k_pos, scale, out_r, lse_r, work_r);
      EXPECT_LE(max_abs_diff(out_r, gather_rows(pool, out, mine)), kF64Tol);
      EXPECT_LE(max_abs_diff(lse_r, gather_lse(pool, lse, mine)), kF64Tol);
      Tensor dq_r = pool.zeros(q_r.shape()), dk_r = pool.zeros(k_all.shape()), dv_r = pool.zeros(v_all.shape());
      attention_backward_at(testing::exec(), q_r, k_all, v_all, q_pos, k_pos, out_r, lse_r, dout_r, scale, dq_r, dk_r,
                            dv_r, work_r);
      EXPECT_LE(max_abs_diff(dq_r, gather_rows(pool, dq, mine)), kF64Tol);
      // Scatter this rank's contribution back to key positions (the reduce-scatter's sum).
      const int64_t row = g * d;
      for (int64_t bi = 0; bi < b; ++bi)
        for (int64_t j = 0; j < s; ++j)
          for (int64_t e = 0; e < row; ++e) {
            dk_sum.ptr<double>()[(bi * s + key_order[j]) * row + e] += dk_r.ptr<double>()[(bi * s + j) * row + e];
            dv_sum.ptr<double>()[(bi * s + key_order[j]) * row + e] += dv_r.ptr<double>()[(bi * s + j) * row + e];
          }
    }
    EXPECT_LE(max_abs_diff(dk_sum, dk), kF64Tol);
    EXPECT_LE(max_abs_diff(dv_sum, dv), kF64Tol);
  }
}

TEST(AttentionAtDeathTest, QueryWithoutVisibleKeyAborts) {
  Pool pool;
  Tensor q = pool.randn({1, 1, 2, 2}), k = pool.randn({1, 2, 1, 2}), v = pool.randn({1, 2, 1, 2});
  Tensor out = pool.zeros(q.shape()), lse = pool.zeros({1, 2, 1}), work = pool.zeros({2, 1, 2});
  Tensor q_pos = positions(pool, {2}), k_pos = positions(pool, {3, 4});
  EXPECT_DEATH(attention_forward_at(testing::exec(), q, k, v, q_pos, k_pos, 1.0, out, lse, work), "sees no key");
}

}  // namespace
}  // namespace moefold

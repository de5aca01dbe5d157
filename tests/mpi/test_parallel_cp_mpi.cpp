// Context-parallel attention over CP = all ranks (run with 1, 2, 4 ranks) against the full
// sequence's attention computed on every rank from one shared seed: this rank's output rows, lse,
// dq, dk and dv at its positions agree within 1e-10 (float64). Also checks the load-balanced
// positions and that sharding a sequence and gathering it back is the identity.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "moefold/ops/ops.h"
#include "moefold/parallel/context_parallel.h"
#include "mpi_testing.h"
#include "testing.h"

namespace moefold {
namespace {

using moefold::testing::max_abs_diff;
using moefold::testing::Pool;
using moefold::testing::shared_seed;
using moefold::testing::test_world;

constexpr double kTol = 1e-10;  // float64; the CP sum over ranks reorders additions only

// The same normal values on every rank.
Tensor shared_randn(Pool& pool, Shape shape, std::mt19937_64& rng) {
  Tensor t = pool.zeros(shape);
  std::normal_distribution<double> n(0.0, 1.0);
  for (int64_t i = 0; i < t.numel(); ++i) t.ptr<double>()[i] = n(rng);
  return t;
}

TEST(ContextParallel, PositionsAreFrontAndBackChunks) {
  Communicator& w = test_world();
  const int c = w.size();
  const int64_t s = 8 * c, chunk = s / (2 * c);
  std::vector<int> seen(s, 0);
  for (int r = 0; r < c; ++r) {
    std::vector<int32_t> pos(s / c);
    cp_positions(s, c, r, pos.data());
    for (int64_t i = 0; i < chunk; ++i) {
      EXPECT_EQ(pos[i], r * chunk + i);
      EXPECT_EQ(pos[chunk + i], (2 * c - 1 - r) * chunk + i);
    }
    for (int32_t p : pos) ++seen[p];
  }
  for (int64_t p = 0; p < s; ++p) EXPECT_EQ(seen[p], 1) << "position " << p;
}

TEST(ContextParallel, ShardThenGatherIsIdentity) {
  Communicator& w = test_world();
  const int c = w.size();
  const int64_t b = 2, s = 4 * c;
  std::vector<int32_t> full(b * s), local(b * s / c), scratch(b * s), back(b * s, -1);
  for (int64_t i = 0; i < b * s; ++i) full[i] = static_cast<int32_t>(1000 + i);
  cp_shard_sequence(Tensor(full.data(), DType::i32, {b, s}), c, w.rank(), Tensor(local.data(), DType::i32, {b, s / c}));
  std::vector<int32_t> pos(s / c);
  cp_positions(s, c, w.rank(), pos.data());
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t l = 0; l < s / c; ++l) ASSERT_EQ(local[bi * (s / c) + l], full[bi * s + pos[l]]);
  cp_gather_sequence(w, Tensor(local.data(), DType::i32, {b, s / c}), Tensor(scratch.data(), DType::i32, {b * s}),
                     Tensor(back.data(), DType::i32, {b, s}));
  EXPECT_EQ(back, full);
}

TEST(ContextParallel, AttentionMatchesFullSequence) {
  Communicator& w = test_world();
  const int c = w.size(), rank = w.rank();
  const int64_t b = 2, s = 24, nq = 6, g = 2, d = 4, len = s / c;  // GQA, Q/G = 3
  ASSERT_EQ(s % (2 * c), 0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::mt19937_64 rng(shared_seed(w));
  Pool pool;
  Tensor q = shared_randn(pool, {b, s, nq, d}, rng), k = shared_randn(pool, {b, s, g, d}, rng),
         v = shared_randn(pool, {b, s, g, d}, rng), dout = shared_randn(pool, {b, s, nq, d}, rng);

  // Reference: the whole sequence on this rank.
  Tensor out = pool.zeros(q.shape()), lse = pool.zeros({b, nq, s}), work = pool.zeros({2, s, s});
  Tensor dq = pool.zeros(q.shape()), dk = pool.zeros(k.shape()), dv = pool.zeros(v.shape());
  attention_forward(testing::exec(), q, k, v, scale, out, lse, work);
  attention_backward(testing::exec(), q, k, v, out, lse, dout, scale, dq, dk, dv, work);

  // Context parallel: this rank's tokens only.
  Memory mem(DType::f64);
  ContextParallelAttention cpa(w, {b, s, nq, g, d});
  mem.bind_twice([&] { cpa.bind(mem); });
  auto local = [&](const Tensor& full) {
    Tensor t = pool.zeros({b, len, full.size(2), full.size(3)});
    cp_shard_sequence(full, c, rank, t);
    return t;
  };
  Tensor q_l = local(q), k_l = local(k), v_l = local(v), dout_l = local(dout);
  Tensor out_l = pool.zeros(q_l.shape()), lse_l = pool.zeros({b, nq, len});
  cpa.forward(q_l, k_l, v_l, scale, out_l, lse_l);
  // Garbage in every gradient: all are WRITTEN.
  Tensor dq_l = pool.randn(q_l.shape(), DType::f64, 100.0), dk_l = pool.randn(k_l.shape(), DType::f64, 100.0),
         dv_l = pool.randn(v_l.shape(), DType::f64, 100.0);
  cpa.backward(q_l, k_l, v_l, out_l, lse_l, dout_l, scale, dq_l, dk_l, dv_l);

  EXPECT_LE(max_abs_diff(out_l, local(out)), kTol);
  EXPECT_LE(max_abs_diff(dq_l, local(dq)), kTol);
  EXPECT_LE(max_abs_diff(dk_l, local(dk)), kTol);
  EXPECT_LE(max_abs_diff(dv_l, local(dv)), kTol);
  const int32_t* pos = cpa.positions().ptr<int32_t>();
  for (int64_t i = 0; i < b * nq; ++i)
    for (int64_t l = 0; l < len; ++l)
      EXPECT_NEAR(lse_l.ptr<double>()[i * len + l], lse.ptr<double>()[i * s + pos[l]], kTol);
}

}  // namespace
}  // namespace moefold

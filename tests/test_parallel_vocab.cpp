// Vocabulary-parallel embedding and cross-entropy in one process: with a size-1 group the
// cross-entropy equals the plain op bit for bit; embedding shards (uneven, simulated) summed equal
// the plain embedding; both backwards agree with float64 finite differences.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "moefold/comm/communicator.h"
#include "moefold/ops/ops.h"
#include "moefold/parallel/vocab_parallel.h"
#include "testing.h"

namespace moefold {
namespace {

using moefold::testing::check_gradient;
using moefold::testing::dot;
using moefold::testing::max_abs_diff;
using moefold::testing::Pool;

// Scratch bound through a Memory of its own (measuring pass, then the real one).
struct BoundScratch {
  Memory mem{DType::f64};
  VocabParallelScratch scratch;
  explicit BoundScratch(int64_t rows) {
    mem.bind_twice([&] { scratch.bind(mem, rows); });
  }
};

// Logits with large per-row offsets (+5000, -3000, 0): an unshifted exp would overflow/underflow.
Tensor offset_logits(Pool& pool, int64_t n, int64_t v, DType dtype) {
  Tensor t = pool.randn({n, v}, dtype, 2.0);
  dispatch_float(dtype, [&]<class T>() {
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < v; ++j)
        t.ptr<T>()[i * v + j] += static_cast<T>(i % 3 == 0 ? 5000 : i % 3 == 1 ? -3000 : 0);
  });
  return t;
}

void expect_ce_matches_plain(DType dtype) {
  Pool pool;
  const int64_t n = 9, v = 13;
  Tensor logits = offset_logits(pool, n, v, dtype);
  Tensor targets = pool.ints({n}, 0, static_cast<int32_t>(v));
  targets.ptr<int32_t>()[0] = 0;
  targets.ptr<int32_t>()[1] = static_cast<int32_t>(v - 1);
  targets.ptr<int32_t>()[2] = kIgnoreTarget;
  auto self = make_self_communicator("tp");
  BoundScratch s(16);
  Tensor lse_ref = pool.zeros({n}, dtype), lse = pool.zeros({n}, dtype);
  const double loss_ref = cross_entropy_forward(testing::exec(), logits, targets, lse_ref);
  const double loss = vocab_parallel_cross_entropy_forward(testing::exec(), *self, logits, 0, targets, lse, s.scratch);
  EXPECT_EQ(loss, loss_ref);
  EXPECT_EQ(max_abs_diff(lse, lse_ref), 0.0);
  Tensor d_ref = pool.zeros({n, v}, dtype), d = pool.randn({n, v}, dtype);  // d is WRITTEN: garbage first
  cross_entropy_backward(testing::exec(), logits, targets, lse_ref, 0.125, d_ref);
  vocab_parallel_cross_entropy_backward(testing::exec(), logits, 0, targets, lse, 0.125, d);
  EXPECT_EQ(max_abs_diff(d, d_ref), 0.0);
}

TEST(VocabParallel, CrossEntropySelfGroupEqualsPlainF64) { expect_ce_matches_plain(DType::f64); }
TEST(VocabParallel, CrossEntropySelfGroupEqualsPlainF32) { expect_ce_matches_plain(DType::f32); }

// Uneven shards [0, 3), [3, 7), [7, 10): the partial outputs summed equal the plain embedding
// (exactly: one non-zero per element), rows outside a shard are zero, and the shard backwards
// applied to slices of one table equal the plain (accumulating) backward.
void expect_embedding_shards_match_plain(DType dtype) {
  Pool pool;
  const int64_t v = 10, c = 5, n = 8;
  const std::vector<int64_t> bounds = {0, 3, 7, 10};
  Tensor table = pool.randn({v, c}, dtype);
  Tensor ids = pool.zeros({n}, DType::i32);
  const std::vector<int32_t> id_values = {0, 2, 3, 6, 7, 9, 3, 6};  // shard edges, repeats
  for (int64_t i = 0; i < n; ++i) ids.ptr<int32_t>()[i] = id_values[i];
  Tensor ref = pool.zeros({n, c}, dtype), sum = pool.zeros({n, c}, dtype);
  embedding_forward(testing::exec(), ids, table, ref);
  for (size_t s = 0; s + 1 < bounds.size(); ++s) {
    Tensor part = pool.randn({n, c}, dtype);  // fully WRITTEN, zeros included
    vocab_parallel_embedding_forward(testing::exec(), ids, table.slice(bounds[s], bounds[s + 1]), bounds[s], part);
    dispatch_float(dtype, [&]<class T>() {
      for (int64_t i = 0; i < n; ++i) {
        const bool inside = id_values[i] >= bounds[s] && id_values[i] < bounds[s + 1];
        for (int64_t j = 0; j < c; ++j) {
          if (!inside) {
            EXPECT_EQ(part.ptr<T>()[i * c + j], T(0)) << "shard " << s << " row " << i;
          }
          sum.ptr<T>()[i * c + j] += part.ptr<T>()[i * c + j];
        }
      }
    });
  }
  EXPECT_EQ(max_abs_diff(sum, ref), 0.0);

  Tensor dout = pool.randn({n, c}, dtype);
  Tensor dtable_ref = pool.randn({v, c}, dtype);  // accumulated onto existing values
  Tensor dtable = pool.clone(dtable_ref);
  embedding_backward(testing::exec(), ids, dout, dtable_ref);
  for (size_t s = 0; s + 1 < bounds.size(); ++s)
    vocab_parallel_embedding_backward(testing::exec(), ids, dout, bounds[s], dtable.slice(bounds[s], bounds[s + 1]));
  EXPECT_EQ(max_abs_diff(dtable, dtable_ref), 0.0);
}

TEST(VocabParallel, EmbeddingShardsSumToPlainF64) { expect_embedding_shards_match_plain(DType::f64); }
TEST(VocabParallel, EmbeddingShardsSumToPlainF32) { expect_embedding_shards_match_plain(DType::f32); }

TEST(VocabParallel, EmbeddingBackwardMatchesFiniteDifferences) {
  Pool pool;
  const int64_t vl = 4, c = 3, n = 7, offset = 3;
  Tensor table = pool.randn({vl, c});
  Tensor ids = pool.zeros({n}, DType::i32);
  const std::vector<int32_t> id_values = {2, 3, 4, 6, 7, 4, 0};  // outside, edges, repeat
  for (int64_t i = 0; i < n; ++i) ids.ptr<int32_t>()[i] = id_values[i];
  Tensor w = pool.randn({n, c}), out = pool.zeros({n, c});
  Tensor analytic = pool.zeros({vl, c});
  vocab_parallel_embedding_backward(testing::exec(), ids, w, offset, analytic);
  check_gradient("vocab_parallel_embedding dtable", table, analytic, [&] {
    vocab_parallel_embedding_forward(testing::exec(), ids, table, offset, out);
    return dot(out, w);
  });
}

TEST(VocabParallel, CrossEntropyBackwardMatchesFiniteDifferences) {
  Pool pool;
  const int64_t n = 5, v = 7;
  const double grad_scale = 0.37;
  Tensor logits = pool.randn({n, v});
  Tensor targets = pool.ints({n}, 0, static_cast<int32_t>(v));
  targets.ptr<int32_t>()[0] = static_cast<int32_t>(v - 1);
  auto self = make_self_communicator("tp");
  BoundScratch s(n);
  Tensor lse = pool.zeros({n}), analytic = pool.zeros({n, v});
  vocab_parallel_cross_entropy_forward(testing::exec(), *self, logits, 0, targets, lse, s.scratch);
  vocab_parallel_cross_entropy_backward(testing::exec(), logits, 0, targets, lse, grad_scale, analytic);
  check_gradient("vocab_parallel_cross_entropy dlogits", logits, analytic, [&] {
    return grad_scale *
           vocab_parallel_cross_entropy_forward(testing::exec(), *self, logits, 0, targets, lse, s.scratch);
  });
}

TEST(VocabParallelDeathTest, TargetOutsideEveryShardAborts) {
  Pool pool;
  Tensor logits = pool.randn({3, 4}), lse = pool.zeros({3});
  Tensor targets = pool.zeros({3}, DType::i32);
  targets.ptr<int32_t>()[1] = 4;  // V = 4 on the only rank
  auto self = make_self_communicator("tp");
  BoundScratch s(3);
  EXPECT_DEATH(vocab_parallel_cross_entropy_forward(testing::exec(), *self, logits, 0, targets, lse, s.scratch),
               "2 of 3 targets fell inside a vocabulary shard");
}

}  // namespace
}  // namespace moefold

// Vocabulary parallelism over TP = all ranks (run with 1, 2, 4 ranks): V = 12 split in equal
// shards, N = 7 rows. Every rank builds the full problem from one shared seed, runs the plain ops
// as the reference and compares its shard: the loss (identical on every rank, 1e-12 relative in
// float64), the saved lse, its dlogits columns, the embedding after an all_reduce over the group,
// and its dtable rows. Targets and ids sit on shard boundaries; some rows carry large offsets.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "moefold/core/memory.h"
#include "moefold/ops/ops.h"
#include "moefold/parallel/vocab_parallel.h"
#include "mpi_testing.h"
#include "testing.h"

namespace moefold {
namespace {

using moefold::testing::max_abs_diff;
using moefold::testing::Pool;
using moefold::testing::shared_seed;
using moefold::testing::test_world;

constexpr int64_t kVocab = 12, kRows = 7, kChannels = 5;

// The same normal values on every rank (drawn in double, stored in `dtype`).
Tensor shared_randn(Pool& pool, Shape shape, DType dtype, std::mt19937_64& rng) {
  Tensor t = pool.zeros(shape, dtype);
  std::normal_distribution<double> nd(0.0, 1.0);
  dispatch_float(dtype, [&]<class T>() {
    for (int64_t i = 0; i < t.numel(); ++i) t.ptr<T>()[i] = static_cast<T>(nd(rng));
  });
  return t;
}

// Global ids on the shard boundaries of every rank plus one random id: 0, vl-1, vl, 2vl-1, V-vl, V-1.
Tensor boundary_ids(Pool& pool, int64_t vl, std::mt19937_64& rng) {
  Tensor t = pool.zeros({kRows}, DType::i32);
  const int64_t picks[kRows] = {
      0, vl - 1, vl % kVocab, (2 * vl - 1) % kVocab, kVocab - vl, kVocab - 1, static_cast<int64_t>(rng() % kVocab)};
  for (int64_t i = 0; i < kRows; ++i) t.ptr<int32_t>()[i] = static_cast<int32_t>(picks[i]);
  return t;
}

// Columns [offset, offset + vl) of a [N, V] tensor, as a contiguous [N, vl] one.
Tensor column_shard(Pool& pool, const Tensor& full_NV, int64_t offset, int64_t vl) {
  Tensor s = pool.zeros({full_NV.size(0), vl}, full_NV.dtype());
  const size_t es = dtype_size(full_NV.dtype());
  for (int64_t i = 0; i < full_NV.size(0); ++i)
    std::memcpy(static_cast<char*>(s.data()) + i * vl * es,
                static_cast<const char*>(full_NV.data()) + (i * full_NV.size(1) + offset) * es, vl * es);
  return s;
}

// rel_tol: loss and lse (relative); abs_tol: dlogits. `row_offset` is added to rows 0, 3, 6 and
// subtracted (x0.6) from rows 1, 4: an unshifted exp would overflow or underflow.
void expect_cross_entropy_matches(DType dtype, double row_offset, double rel_tol, double abs_tol) {
  Communicator& tp = test_world();
  const int64_t vl = kVocab / tp.size(), offset = tp.rank() * vl;
  ASSERT_EQ(kVocab % tp.size(), 0);
  std::mt19937_64 rng(shared_seed(tp));
  Pool pool;
  Tensor logits = shared_randn(pool, {kRows, kVocab}, dtype, rng);
  dispatch_float(dtype, [&]<class T>() {
    for (int64_t i = 0; i < kRows; ++i)
      for (int64_t j = 0; j < kVocab; ++j)
        logits.ptr<T>()[i * kVocab + j] += static_cast<T>(i % 3 == 0   ? row_offset
                                                          : i % 3 == 1 ? -0.6 * row_offset
                                                                       : 0.0);
  });
  Tensor targets = boundary_ids(pool, vl, rng);
  targets.ptr<int32_t>()[kRows - 1] = kIgnoreTarget;  // a position without a target: no loss, zero gradient
  const double grad_scale = 1.0 / kRows;

  Tensor lse_ref = pool.zeros({kRows}, dtype), dlogits_ref = pool.zeros({kRows, kVocab}, dtype);
  const double loss_ref = cross_entropy_forward(testing::exec(), logits, targets, lse_ref);
  cross_entropy_backward(testing::exec(), logits, targets, lse_ref, grad_scale, dlogits_ref);

  Memory mem(dtype);
  VocabParallelScratch scratch;
  mem.bind_twice([&] { scratch.bind(mem, kRows); });
  Tensor shard = column_shard(pool, logits, offset, vl);
  Tensor lse = pool.zeros({kRows}, dtype), dlogits = pool.zeros({kRows, vl}, dtype);
  double loss = vocab_parallel_cross_entropy_forward(testing::exec(), tp, shard, offset, targets, lse, scratch);
  vocab_parallel_cross_entropy_backward(testing::exec(), shard, offset, targets, lse, grad_scale, dlogits);

  EXPECT_LE(std::abs(loss - loss_ref), rel_tol * std::abs(loss_ref)) << loss << " vs " << loss_ref;
  // The same value on every rank, bit for bit: max(loss) == -max(-loss).
  double hi = loss, neg_lo = -loss;
  tp.all_reduce(Tensor(&hi, DType::f64, {1}), ReduceOp::max);
  tp.all_reduce(Tensor(&neg_lo, DType::f64, {1}), ReduceOp::max);
  EXPECT_EQ(hi, loss);
  EXPECT_EQ(-neg_lo, loss);
  dispatch_float(dtype, [&]<class T>() {
    for (int64_t i = 0; i < kRows; ++i)
      EXPECT_LE(std::abs(static_cast<double>(lse.ptr<T>()[i]) - static_cast<double>(lse_ref.ptr<T>()[i])),
                rel_tol * std::abs(static_cast<double>(lse_ref.ptr<T>()[i])))
          << "row " << i;
  });
  EXPECT_LE(max_abs_diff(dlogits, column_shard(pool, dlogits_ref, offset, vl)), abs_tol);
}

// float64: the only difference from the reference is the order of the exp sums over ranks.
TEST(VocabParallelMpi, CrossEntropyMatchesFullVocabularyF64) {
  expect_cross_entropy_matches(DType::f64, 5000.0, 1e-12, 1e-11);
}
// float32: rows are reduced in double; lse is stored in f32 (ulp(60) ~ 4e-6 relative to exp's input).
TEST(VocabParallelMpi, CrossEntropyMatchesFullVocabularyF32) {
  expect_cross_entropy_matches(DType::f32, 60.0, 1e-6, 2e-5);
}

TEST(VocabParallelMpi, EmbeddingMatchesFullTable) {
  Communicator& tp = test_world();
  const int64_t vl = kVocab / tp.size(), offset = tp.rank() * vl;
  std::mt19937_64 rng(shared_seed(tp));
  Pool pool;
  Tensor table = shared_randn(pool, {kVocab, kChannels}, DType::f64, rng);
  Tensor ids = boundary_ids(pool, vl, rng);
  Tensor dout = shared_randn(pool, {kRows, kChannels}, DType::f64, rng);
  Tensor dtable_ref = shared_randn(pool, {kVocab, kChannels}, DType::f64, rng);  // accumulated onto
  Tensor dtable = pool.clone(dtable_ref.slice(offset, offset + vl));

  Tensor out_ref = pool.zeros({kRows, kChannels});
  embedding_forward(testing::exec(), ids, table, out_ref);
  embedding_backward(testing::exec(), ids, dout, dtable_ref);

  Tensor out = pool.randn({kRows, kChannels});  // WRITTEN, zeros included
  vocab_parallel_embedding_forward(testing::exec(), ids, pool.clone(table.slice(offset, offset + vl)), offset, out);
  tp.all_reduce(out, ReduceOp::sum);
  EXPECT_EQ(max_abs_diff(out, out_ref), 0.0);  // one non-zero per element: the sum is exact

  vocab_parallel_embedding_backward(testing::exec(), ids, dout, offset, dtable);
  EXPECT_EQ(max_abs_diff(dtable, dtable_ref.slice(offset, offset + vl)), 0.0);
}

}  // namespace
}  // namespace moefold

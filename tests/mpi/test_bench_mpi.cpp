// `moefold bench moe-layer` with expert parallelism over the ranks of an MPI job (CPU, small
// shape): every rank runs its layer, the experts split over the ranks, and the rows the ranks
// receive add up to every token's K assignments (dropless), balanced or routed by the router.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "moefold/bench/moe_layer_bench.h"
#include "moefold/bench/train_bench.h"
#include "moefold/model/config.h"
#include "mpi_testing.h"

namespace moefold {
namespace {

// The tiny shape with 64 tokens per rank, 8 experts of which each token takes 2, EP over `world`.
MoeBenchOptions small_ep(Communicator& world, std::vector<std::string> more = {}) {
  MoeBenchOptions o;
  o.shapes = {"tiny"};
  o.tokens = 64;
  o.reps = 2;
  o.warmup = 1;
  o.device = Device::cpu;
  o.overrides = {"moe.num_experts=8", "moe.num_experts_per_tok=2"};
  o.overrides.insert(o.overrides.end(), more.begin(), more.end());
  o.ep = &world;
  return o;
}

TEST(BenchMoeLayerEp, RowsOfAllRanksAreEveryAssignment) {
  Communicator& world = testing::test_world();
  const std::vector<MoeBenchResult> r = bench_moe_layer(small_ep(world));
  ASSERT_EQ(r.size(), 2u);
  for (const MoeBenchResult& x : r) {
    SCOPED_TRACE(x.routing);
    int64_t rows = x.rows;
    world.all_reduce(Tensor(&rows, DType::i64, {1}), ReduceOp::sum);
    EXPECT_EQ(rows, 64 * 2 * world.size());
    EXPECT_EQ(x.local_experts, 8 / world.size());  // the experts are split, not replicated
    if (x.routing == "balanced") {
      EXPECT_EQ(x.rows, 64 * 2);  // every rank's tokens spread evenly over the experts
    }
    EXPECT_GT(x.total.ms, 0);
    ASSERT_EQ(x.gemms.size(), 8u);
  }
}

// The same with moe.dispatcher = "hierarchical" over emulated nodes of one rank: the rows still add
// up to every assignment, and the layer runs.
TEST(BenchMoeLayerEp, HierarchicalDispatcherOverEmulatedNodes) {
  Communicator& world = testing::test_world();
  if (world.size() == 1) GTEST_SKIP() << "one rank: no expert parallelism";
  for (const MoeBenchResult& x :
       bench_moe_layer(small_ep(world, {"moe.dispatcher=hierarchical", "parallel.ranks_per_node=1"}))) {
    SCOPED_TRACE(x.routing);
    int64_t rows = x.rows;
    world.all_reduce(Tensor(&rows, DType::i64, {1}), ReduceOp::sum);
    EXPECT_EQ(rows, 64 * 2 * world.size());
    EXPECT_GT(x.total.ms, 0);
  }
}

// moe.dispatcher = "slots": the layer runs, the experts get the fixed R rows (the worst case:
// every rank's 64 x 2 assignments could come here, P x 64 x min(2, 8 / P)).
TEST(BenchMoeLayerEp, SlotDispatcherHandsTheExpertsItsFixedRows) {
  Communicator& world = testing::test_world();
  if (world.size() == 1) GTEST_SKIP() << "one rank: no expert parallelism";
  const int64_t p = world.size();
  for (const MoeBenchResult& x : bench_moe_layer(small_ep(world, {"moe.dispatcher=slots"}))) {
    SCOPED_TRACE(x.routing);
    EXPECT_EQ(x.rows, p * 64 * std::min<int64_t>(2, 8 / p));
    EXPECT_GT(x.total.ms, 0);
  }
}

// `moefold bench train` with pipeline stages over the ranks: every rank's share of the step in the
// stage exchanges, beside 1F1B's bubble in theory: (pp - 1) / (m + pp - 1), m = 4 micro-batches.
TEST(BenchTrainPipeline, ReportsEachRanksBubble) {
  Communicator& world = testing::test_world();
  if (world.size() == 1 || 4 % world.size() != 0) GTEST_SKIP() << "needs 2 or 4 ranks: one layer per stage";
  const Config cfg =
      load_config("tiny", {"model.num_hidden_layers=4", "train.global_batch_size=4", "train.micro_batch_size=1",
                           "train.seq_len=32", cat("parallel.pp=", world.size())});
  TrainBenchOptions o;
  o.steps = 2;
  o.warmup = 1;
  o.device = Device::cpu;
  const TrainBenchResult r = bench_train(cfg, world, o);
  ASSERT_EQ(r.bubble.size(), static_cast<size_t>(world.size()));
  const double pp = world.size();
  EXPECT_DOUBLE_EQ(r.bubble_theory, (pp - 1) / (4 + pp - 1));
  for (const double b : r.bubble) {
    EXPECT_GT(b, 0);
    EXPECT_LT(b, 1);
  }
  EXPECT_NE(format_train_bench(cfg, r, "header").find("Pipeline bubble"), std::string::npos);
  if (world.size() == 2) {  // interleaved, 2 chunks of one layer per rank: the bubble halves
    Config c = cfg;
    c.parallel.vpp = 2;
    EXPECT_DOUBLE_EQ(bench_train(c, world, o).bubble_theory, (pp - 1) / (4 + pp - 1) / 2);
  }
}

// With expert parallelism over the ranks, the report says how long the compute stream waited on
// the all-to-all, with parallel.overlap_moe_a2a off and on (the same losses either way).
TEST(BenchTrainEp, ReportsTheExposedAllToAll) {
  Communicator& world = testing::test_world();
  if (world.size() == 1) GTEST_SKIP() << "one rank: no expert parallelism";
  double loss[2] = {0, 0};
  for (const bool overlap : {false, true}) {
    const Config cfg =
        load_config("tiny", {"model.num_hidden_layers=2", "train.global_batch_size=" + std::to_string(4 * world.size()),
                             "train.micro_batch_size=1", "train.seq_len=32", cat("parallel.ep=", world.size()),
                             cat("parallel.overlap_moe_a2a=", overlap ? "true" : "false")});
    TrainBenchOptions o;
    o.steps = 2;
    o.warmup = 1;
    o.device = Device::cpu;
    const TrainBenchResult r = bench_train(cfg, world, o);
    EXPECT_GT(r.exposed_a2a_ms, 0);
    EXPECT_NE(format_train_bench(cfg, r, "header").find("Exposed expert all-to-all"), std::string::npos);
    loss[overlap ? 1 : 0] = r.last_loss;
  }
  EXPECT_EQ(loss[0], loss[1]);
}

}  // namespace
}  // namespace moefold

// `moefold bench moe-layer` with expert parallelism over the ranks of an MPI job (CPU, small
// shape): every rank runs its layer, the experts split over the ranks, and the rows the ranks
// receive add up to every token's K assignments (dropless), balanced or routed by the router.
#include <gtest/gtest.h>

#include "moefold/bench/moe_layer_bench.h"
#include "mpi_testing.h"

namespace moefold {
namespace {

TEST(BenchMoeLayerEp, RowsOfAllRanksAreEveryAssignment) {
  Communicator& world = testing::test_world();
  MoeBenchOptions o;
  o.shapes = {"tiny"};
  o.tokens = 64;
  o.reps = 2;
  o.warmup = 1;
  o.device = Device::cpu;
  o.overrides = {"moe.num_experts=8", "moe.num_experts_per_tok=2"};
  o.ep = &world;
  const std::vector<MoeBenchResult> r = bench_moe_layer(o);
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

}  // namespace
}  // namespace moefold

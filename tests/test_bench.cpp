// The benchmarks on the CPU at small shapes. `moefold bench moe-layer`: every (shape, routing) runs, the FLOP
// count follows BENCHMARKS.md's formula, balanced routing is balanced, stages and GEMMs are all
// timed, and the report names them. (Speed itself is never asserted: benchmarks measure it.)
#include <gtest/gtest.h>

#include <cmath>

#include "moefold/bench/moe_layer_bench.h"
#include "moefold/bench/train_bench.h"
#include "moefold/core/error.h"

namespace moefold {
namespace {

TEST(BenchMoeLayer, RunsEveryRoutingAndCountsFlops) {
  MoeBenchOptions o;
  o.shapes = {"tiny"};
  o.tokens = 96;
  o.reps = 2;
  o.warmup = 1;
  o.device = Device::cpu;
  o.overrides = {"moe.num_experts=6", "moe.num_experts_per_tok=3", "moe.moe_intermediate_size=40"};
  const std::vector<MoeBenchResult> r = bench_moe_layer(o);
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].routing, "balanced");
  EXPECT_EQ(r[1].routing, "real");
  const double h = 128, e = 6, k = 3, f = 40, t = 96;  // tiny's hidden size is 128
  for (const MoeBenchResult& x : r) {
    SCOPED_TRACE(x.routing);
    EXPECT_EQ(x.tokens, 96);
    EXPECT_EQ(x.rows, 96 * 3);  // dropless: every assignment is a row
    EXPECT_EQ(x.local_experts, 6);
    EXPECT_DOUBLE_EQ(x.flops, 3 * (2 * t * h * e + 6 * k * t * h * f));
    EXPECT_GT(x.total.ms, 0);
    EXPECT_NEAR(x.total.tflops, x.flops / (x.total.ms * 1e9), 1e-12 * x.total.tflops);
    ASSERT_EQ(x.stages.size(), 8u);
    ASSERT_EQ(x.gemms.size(), 4u);
    for (const BenchTime& b : x.stages) EXPECT_GE(b.ms, 0) << b.name;
    for (const BenchTime& b : x.gemms) EXPECT_GT(b.tflops, 0) << b.name;
    EXPECT_GE(x.load_max, x.load_mean);
    EXPECT_DOUBLE_EQ(x.load_mean, t * k / e);
  }
  EXPECT_DOUBLE_EQ(r[0].load_max, r[0].load_mean);  // balanced: 48 rows on every expert
  const std::string report = format_moe_bench(r, "header");
  EXPECT_NE(report.find("| tiny | balanced | 96 | 288 |"), std::string::npos) << report;
  EXPECT_NE(report.find("| experts backward |"), std::string::npos) << report;
  EXPECT_NE(report.find("| fc1 forward+backward |"), std::string::npos) << report;
}

// DeepSeek-V3's shared experts run beside the routed ones: two more stages, their FLOPs counted
// (BENCHMARKS.md: + 6*T*H*F_shared).
TEST(BenchMoeLayer, SharedExpertsAreTimedAndCounted) {
  MoeBenchOptions o;
  o.shapes = {"tiny"};
  o.routings = {"real"};
  o.tokens = 32;
  o.reps = 1;
  o.warmup = 0;
  o.device = Device::cpu;
  o.overrides = {"moe.num_experts=4", "moe.num_experts_per_tok=2", "moe.moe_intermediate_size=16",
                 "moe.n_shared_experts=2"};
  const std::vector<MoeBenchResult> r = bench_moe_layer(o);
  ASSERT_EQ(r.size(), 1u);
  const double h = 128, e = 4, k = 2, f = 16, t = 32;
  EXPECT_DOUBLE_EQ(r[0].flops, 3 * (2 * t * h * e + 6 * k * t * h * f + 6 * t * h * 2 * f));
  ASSERT_EQ(r[0].stages.size(), 10u);
  EXPECT_EQ(r[0].stages[4].name, "shared expert");
  EXPECT_EQ(r[0].stages[9].name, "shared expert backward");
  EXPECT_GT(r[0].stages[4].tflops, 0);
}

TEST(BenchMoeLayer, BadOptionsFailWithOneLine) {
  MoeBenchOptions o;
  o.device = Device::cpu;
  o.shapes = {"tiny"};
  o.routings = {"skewed"};
  EXPECT_THROW(bench_moe_layer(o), Error);
  o.routings = {"real"};
  o.shapes = {"no-such-model"};
  EXPECT_THROW(bench_moe_layer(o), Error);
  o.shapes = {"tiny"};
  o.reps = 0;
  EXPECT_THROW(bench_moe_layer(o), Error);
}

}  // namespace
}  // namespace moefold

namespace moefold {
namespace {

// `moefold bench train` on the CPU: the step's numbers follow from its median and the model's
// FLOPs per token; random tokens start near ln(vocab).
TEST(BenchTrain, ReportsThroughputOfFullSteps) {
  const Config cfg = load_config("tiny", {"model.num_hidden_layers=2", "train.global_batch_size=4",
                                          "train.micro_batch_size=2", "train.seq_len=32"});
  std::unique_ptr<Communicator> world = make_self_communicator();
  TrainBenchOptions o;
  o.steps = 3;
  o.warmup = 1;
  o.device = Device::cpu;
  const TrainBenchResult r = bench_train(cfg, *world, o);
  EXPECT_EQ(r.ranks, 1);
  EXPECT_EQ(r.tokens_per_step, 4 * 32);
  EXPECT_GT(r.step_ms, 0);
  EXPECT_NEAR(r.tokens_per_s, 128 / (r.step_ms * 1e-3), 1e-9 * r.tokens_per_s);
  EXPECT_DOUBLE_EQ(r.flops_per_token, model_size(cfg.model, cfg.moe, 32).train_flops_per_token);
  EXPECT_NEAR(r.tflops_per_gpu, r.tokens_per_s * r.flops_per_token / 1e12, 1e-12);
  EXPECT_NEAR(r.first_loss, std::log(320.0), 0.3);  // uniform random tokens over tiny's 320
  EXPECT_TRUE(std::isfinite(r.last_loss));
  EXPECT_EQ(r.peak_memory_mib, 0);  // the CPU reports none
  const std::string report = format_train_bench(cfg, r, "header");
  EXPECT_NE(report.find("| tiny | 2 | 128 | 1 |"), std::string::npos) << report;
  o.steps = 0;
  EXPECT_THROW(bench_train(cfg, *world, o), Error);
}

}  // namespace
}  // namespace moefold

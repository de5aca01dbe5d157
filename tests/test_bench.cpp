// The benchmarks on the CPU at small shapes. `moefold bench moe-layer`: every (shape, routing) runs, the FLOP
// count follows docs/benchmarks.md's formula, balanced routing is balanced, stages and GEMMs are all
// timed, and the report names them. (Speed itself is never asserted: benchmarks measure it.)
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "moefold/bench/moe_layer_bench.h"
#include "moefold/bench/train_bench.h"
#include "moefold/core/error.h"
#include "moefold/core/profile.h"

namespace moefold {
namespace {

// The tiny preset's MoE layer on the CPU with these tokens, repetitions and overrides.
MoeBenchOptions tiny_bench(int64_t tokens, int reps, int warmup, std::vector<std::string> overrides) {
  MoeBenchOptions o;
  o.shapes = {"tiny"};
  o.tokens = tokens;
  o.reps = reps;
  o.warmup = warmup;
  o.device = Device::cpu;
  o.overrides = std::move(overrides);
  return o;
}

TEST(BenchMoeLayer, RunsEveryRoutingAndCountsFlops) {
  const MoeBenchOptions o =
      tiny_bench(96, 2, 1, {"moe.num_experts=6", "moe.num_experts_per_tok=3", "moe.moe_intermediate_size=40"});
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
    ASSERT_EQ(x.gemms.size(), 8u);
    for (const BenchTime& b : x.stages) EXPECT_GE(b.ms, 0) << b.name;
    for (const BenchTime& b : x.gemms) EXPECT_GT(b.tflops, 0) << b.name;
    EXPECT_GE(x.load_max, x.load_mean);
    EXPECT_DOUBLE_EQ(x.load_mean, t * k / e);
    // The experts' pieces, timed in the untimed profiled repetitions: one piece each way here.
    int pieces = 0;
    for (const BenchTime& b : x.phases)
      if (b.name == "moe experts piece forward" || b.name == "moe experts piece backward") {
        EXPECT_GT(b.ms, 0) << b.name;
        ++pieces;
      }
    EXPECT_EQ(pieces, 2);
  }
  EXPECT_FALSE(profile_enabled());                  // the bench leaves the profiler off
  EXPECT_DOUBLE_EQ(r[0].load_max, r[0].load_mean);  // balanced: 48 rows on every expert
  const std::string report = format_moe_bench(r, "header");
  EXPECT_NE(report.find("| tiny | balanced | 96 | 288 |"), std::string::npos) << report;
  EXPECT_NE(report.find("| experts backward |"), std::string::npos) << report;
  EXPECT_NE(report.find("| fc1 forward+backward |"), std::string::npos) << report;
  EXPECT_NE(report.find("| fc1 wgrad (grouped, f32 gradient written) |"), std::string::npos) << report;
}

// DeepSeek-V3's shared experts run beside the routed ones: two more stages, their FLOPs counted
// (docs/benchmarks.md: + 6*T*H*F_shared).
TEST(BenchMoeLayer, SharedExpertsAreTimedAndCounted) {
  MoeBenchOptions o = tiny_bench(
      32, 1, 0,
      {"moe.num_experts=4", "moe.num_experts_per_tok=2", "moe.moe_intermediate_size=16", "moe.n_shared_experts=2"});
  o.routings = {"real"};
  const std::vector<MoeBenchResult> r = bench_moe_layer(o);
  ASSERT_EQ(r.size(), 1u);
  const double h = 128, e = 4, k = 2, f = 16, t = 32;
  EXPECT_DOUBLE_EQ(r[0].flops, 3 * (2 * t * h * e + 6 * k * t * h * f + 6 * t * h * 2 * f));
  ASSERT_EQ(r[0].stages.size(), 10u);
  EXPECT_EQ(r[0].stages[4].name, "shared expert");
  EXPECT_EQ(r[0].stages[9].name, "shared expert backward");
  EXPECT_GT(r[0].stages[4].tflops, 0);
}

// Every repetition is a step's first micro-batch (the experts' weight gradients written), or with
// accumulate_grads a later one (added to): with balanced routing every repetition computes the
// same gradient, so after 3 repetitions the accumulated one is 3x the written one (9x its squares).
TEST(BenchMoeLayer, WritesOrAccumulatesTheExpertGradients) {
  MoeBenchOptions o =
      tiny_bench(32, 2, 1, {"moe.num_experts=4", "moe.num_experts_per_tok=2", "moe.moe_intermediate_size=16"});
  o.routings = {"balanced"};
  const double written = bench_moe_layer(o).at(0).expert_grad_sq;
  o.accumulate_grads = true;
  const double added = bench_moe_layer(o).at(0).expert_grad_sq;
  EXPECT_GT(written, 0);
  EXPECT_NEAR(added, 9 * written, 1e-6 * added);  // fp32 sums in another order
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

// The tiny preset cut to 2 layers, 4 sequences of 32 tokens per step in micro-batches of 2, and
// 3 timed steps after 1 warm-up on the CPU.
Config small_train() {
  return load_config("tiny", {"model.num_hidden_layers=2", "train.global_batch_size=4", "train.micro_batch_size=2",
                              "train.seq_len=32"});
}
TrainBenchOptions cpu_bench() {
  TrainBenchOptions o;
  o.steps = 3;
  o.warmup = 1;
  o.device = Device::cpu;
  return o;
}

// `moefold bench train` on the CPU: the step's numbers follow from its median and the model's
// FLOPs per token; random tokens start near ln(vocab).
TEST(BenchTrain, ReportsThroughputOfFullSteps) {
  const Config cfg = small_train();
  std::unique_ptr<Communicator> world = make_self_communicator();
  TrainBenchOptions o = cpu_bench();
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

const StepPhase* find_phase(const TrainBenchResult& r, const std::string& name) {
  for (const StepPhase& p : r.phases)
    if (p.name == name) return &p;
  return nullptr;
}

// The breakdown: the timed steps' phases, whose top-level ones fit in the mean step (on the
// CPU every scope runs inside the step's own clock), cover the LM head, attention, the MoE
// layer's parts and the optimizer, with the calls a step makes: 2 micro-batches (global 4 /
// micro 2) through 2 MoE layers.
TEST(BenchTrain, BreaksTheStepIntoPhases) {
  const Config cfg = small_train();
  std::unique_ptr<Communicator> world = make_self_communicator();
  TrainBenchOptions o = cpu_bench();
  const TrainBenchResult r = bench_train(cfg, *world, o);
  EXPECT_FALSE(profile_enabled());  // on for the benchmark only
  ASSERT_FALSE(r.phases.empty());
  EXPECT_GT(r.mean_step_ms, 0);
  double top = 0;
  for (const StepPhase& p : r.phases) {
    SCOPED_TRACE(p.name);
    EXPECT_GT(p.calls, 0);
    EXPECT_GE(p.self_ms, -1e-9);
    EXPECT_LE(p.self_ms, p.ms + 1e-9);
    EXPECT_LE(p.top_level_ms, p.ms + 1e-9);
    top += p.top_level_ms;
  }
  EXPECT_LE(top, r.mean_step_ms * (1 + 1e-12));
  EXPECT_GE(top, 0.5 * r.mean_step_ms);  // the scopes cover the work of a step
  EXPECT_NEAR(r.untimed_ms, r.mean_step_ms - top, 1e-9 * r.mean_step_ms);
  struct Expect {
    const char* name;
    int depth;
    double calls;
  };
  for (const Expect& e :
       {Expect{"model forward", 0, 2}, Expect{"model backward", 0, 2}, Expect{"optimizer step", 0, 1},
        Expect{"embedding forward", 1, 2}, Expect{"lm head + loss forward", 1, 2},
        Expect{"lm head + loss backward", 1, 2}, Expect{"decoder layer forward", 1, 4},
        Expect{"attention forward", 2, 4}, Expect{"attention backward", 2, 4}, Expect{"moe forward", 2, 4},
        Expect{"moe backward", 2, 4}, Expect{"moe router forward", 3, 4}, Expect{"moe dispatch forward", 3, 4},
        Expect{"moe experts forward", 3, 4}, Expect{"moe combine forward", 3, 4}, Expect{"moe experts backward", 3, 4},
        Expect{"moe router backward", 3, 4}, Expect{"rmsnorm forward", 2, 8}}) {
    const StepPhase* p = find_phase(r, e.name);
    ASSERT_NE(p, nullptr) << e.name;
    EXPECT_EQ(p->depth, e.depth) << e.name;
    EXPECT_DOUBLE_EQ(p->calls, e.calls) << e.name;
  }
  // Order first seen: the forward's parts before the backward's.
  EXPECT_LT(find_phase(r, "moe experts forward"), find_phase(r, "moe experts backward"));
  const std::string report = format_train_bench(cfg, r, "header");
  EXPECT_NE(report.find("| phase | ms per step | share of step | calls per step |"), std::string::npos) << report;
  EXPECT_NE(report.find("moe experts forward | "), std::string::npos) << report;
  EXPECT_NE(report.find("| untimed (outside every top-level scope) | "), std::string::npos) << report;

  o.breakdown = false;  // and without: no phases, no second table
  o.steps = 1;
  const TrainBenchResult plain = bench_train(cfg, *world, o);
  EXPECT_TRUE(plain.phases.empty());
  EXPECT_EQ(format_train_bench(cfg, plain, "header").find("| phase |"), std::string::npos);
}

}  // namespace
}  // namespace moefold

// The benchmarks on the CPU at small shapes. `moefold bench moe-layer`: every (shape, routing) runs, the FLOP
// count follows docs/benchmarks.md's formula, balanced routing is balanced, stages and GEMMs are all
// timed, and the report names them. (Speed itself is never asserted: benchmarks measure it.)
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "moefold/bench/fp8_error_bench.h"
#include "moefold/bench/moe_layer_bench.h"
#include "moefold/bench/train_bench.h"
#include "moefold/core/error.h"
#include "moefold/core/profile.h"
#include "moefold/data/token_dataset.h"
#include "moefold/parallel/mesh.h"
#include "moefold/train/trainer.h"
#include "testing.h"
#include "train_fixture.h"

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

// The GPU timeline's report (recorded with CUPTI on a GPU only; here a made-up timeline): the span,
// the idle time between operations, per stage the operations' time and the idle before them, and
// every operation with its stage.
TEST(BenchMoeLayer, TimelineReportsIdleTimePerStageAndEveryOperation) {
  MoeBenchResult r;
  r.shape = "tiny";
  r.routing = "balanced";
  r.total = {"layer forward+backward", 1.0, 0, 0};
  r.stages = {{"router", 0.1, 0, 0}, {"dispatch", 0.2, 0, 0}};
  r.activity_reps = 2;
  r.timeline = {{"memset", 0, 1000, 5},
                {"moefold::(anonymous namespace)::topk_kernel<8>", 3000, 10000, 20},
                {"moefold::permute_kernel", 12000, 20000, 40},
                {"side", 13000, 14000, 41}};
  r.timeline_stage = {-1, 0, 1, 1};
  const std::string report = format_moe_bench({r}, "header");
  EXPECT_NE(report.find("0.020 ms from the first operation's start to the last's end, the GPU idle 0.004 ms of it "
                        "(20.0%) in 2 gaps of 1 us or more, the longest 2.0 us; 4 operations"),
            std::string::npos)
      << report;
  EXPECT_NE(report.find("| (before the layer) | 1 | 0.001 | 0.000 |"), std::string::npos) << report;
  EXPECT_NE(report.find("| router | 1 | 0.007 | 0.002 |"), std::string::npos) << report;
  EXPECT_NE(report.find("| dispatch | 2 | 0.009 | 0.002 |"), std::string::npos) << report;
  EXPECT_NE(report.find("| 2 | router | `topk_kernel<8>` | 0.003 | 0.007 | 2.0 |"), std::string::npos) << report;
  EXPECT_NE(report.find("| 4 | dispatch | `side` | 0.013 | 0.001 | 0.0 |"), std::string::npos) << report;
  r.timeline.clear();
  r.activity_unavailable = "built without CUDA";
  EXPECT_NE(format_moe_bench({r}, "header").find("GPU timeline: not recorded (built without CUDA)"), std::string::npos);
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

namespace moefold {
namespace {

// `moefold bench fp8-error` on the CPU: a small DeepSeek-V3-shaped model (MLA, a dense first
// layer, a shared expert, multi-token prediction) so that every FP8 module kind is there.
Config fp8_error_config(const std::string& data, std::vector<std::string> extra = {}) {
  std::vector<std::string> ov = {"model.architecture=deepseek_v3",
                                 "model.q_lora_rank=16",
                                 "model.kv_lora_rank=16",
                                 "model.qk_nope_head_dim=8",
                                 "model.qk_rope_head_dim=4",
                                 "model.v_head_dim=8",
                                 "model.head_dim=4",
                                 "model.num_key_value_heads=2",
                                 "model.first_k_dense_replace=1",
                                 "model.intermediate_size=24",
                                 "moe.n_shared_experts=1",
                                 "model.num_nextn_predict_layers=1",
                                 "moe.scoring_func=sigmoid"};
  ov.insert(ov.end(), extra.begin(), extra.end());
  return testing::small_train_config(data, ov);
}

Fp8ErrorOptions cpu_fp8_error() {
  Fp8ErrorOptions o;
  o.device = Device::cpu;
  return o;
}

const Fp8ErrorRow& row(const Fp8ErrorResult& r, const std::string& name) {
  for (const Fp8ErrorRow& x : r.rows)
    if (x.name == name) return x;
  ADD_FAILURE() << "no row " << name;
  static const Fp8ErrorRow none;
  return none;
}

// Every module kept in bf16 by train.fp8_exclude: the two arms compute the same step from the same
// weights and batches, so every gradient and loss agrees exactly (a tool that compared different
// batches or weights would show errors here).
TEST(BenchFp8Error, NoFp8ModuleChangesNothing) {
  testing::TempDir dir("bench_fp8_error_none");
  const Config cfg = fp8_error_config(
      testing::make_train_data(dir.path()),
      {"train.fp8=blockwise", R"(train.fp8_exclude=["qkv", "attn_proj", "mlp", "experts", "shared_experts", "mtp"])"});
  std::unique_ptr<Communicator> world = make_self_communicator();
  Fp8ErrorOptions o = cpu_fp8_error();
  o.batches = 2;
  const Fp8ErrorResult r = bench_fp8_error(cfg, *world, o);
  EXPECT_EQ(r.fp8_modules, "");
  ASSERT_EQ(r.lm_loss_ref.size(), 2u);
  EXPECT_NE(r.lm_loss_ref[0], r.lm_loss_ref[1]);  // two different batches
  for (size_t b = 0; b < 2; ++b) {
    EXPECT_EQ(r.lm_loss_fp8[b], r.lm_loss_ref[b]);
    EXPECT_EQ(r.mtp_loss_fp8[b], r.mtp_loss_ref[b]);
    EXPECT_EQ(r.grad_norm_fp8[b], r.grad_norm_ref[b]);
  }
  for (const Fp8ErrorRow& x : r.rows) {
    EXPECT_FALSE(x.fp8) << x.name;
    EXPECT_EQ(x.diff_sq, 0) << x.name;
    EXPECT_EQ(x.relative_error(), 0) << x.name;
  }
}

// With FP8 on: the FP8 linears' weights are flagged, their gradients (and those upstream of them)
// differ by E4M3's rounding, a few percent to tens of percent, and still point the same way; the
// layers are pooled per parameter (model.layers.*), multi-token prediction's layer apart, unless
// per_layer. train.fp8_exclude takes a module's weights out of the flagged ones.
TEST(BenchFp8Error, MeasuresEveryGradientAgainstTheStepWithoutFp8) {
  testing::TempDir dir("bench_fp8_error");
  const std::string data = testing::make_train_data(dir.path());
  std::unique_ptr<Communicator> world = make_self_communicator();
  const Fp8ErrorResult r = bench_fp8_error(fp8_error_config(data), *world, cpu_fp8_error());
  EXPECT_EQ(r.fp8_modules, "qkv, attn_proj, mlp, experts, shared_experts, mtp");
  for (const char* name : {"model.layers.*.self_attn.q_a_proj.weight", "model.layers.*.self_attn.kv_b_proj.weight",
                           "model.layers.*.self_attn.o_proj.weight", "model.layers.*.mlp.down_proj.weight",
                           "model.layers.*.mlp.experts.gate_up_proj",
                           "model.layers.*.mlp.shared_experts.up_proj.weight", "model.layers.2.eh_proj.weight"}) {
    const Fp8ErrorRow& x = row(r, name);
    EXPECT_TRUE(x.fp8) << name;
    EXPECT_GT(x.relative_error(), 1e-3) << name;
    EXPECT_LT(x.relative_error(), 0.5) << name;
    EXPECT_GT(x.cosine(), 0.85) << name;
  }
  EXPECT_FALSE(row(r, "lm_head.weight").fp8);
  EXPECT_GT(row(r, "lm_head.weight").relative_error(), 0);  // the hidden states reaching it changed
  EXPECT_FALSE(row(r, "model.layers.*.mlp.gate.weight").fp8);
  // Layer 0 (dense) and 1 (MoE) pooled: the attention's weights of both.
  EXPECT_EQ(row(r, "model.layers.*.self_attn.o_proj.weight").elements, 2 * 16 * 2 * 8);
  EXPECT_NE(format_fp8_error(r, "t").find("| model.layers.*.mlp.experts.down_proj | yes | "), std::string::npos);

  Fp8ErrorOptions o = cpu_fp8_error();
  o.per_layer = true;
  const Fp8ErrorResult each = bench_fp8_error(fp8_error_config(data, {R"(train.fp8_exclude=["experts"])"}), *world, o);
  EXPECT_EQ(each.fp8_modules, "qkv, attn_proj, mlp, shared_experts, mtp");
  EXPECT_EQ(row(each, "model.layers.1.self_attn.o_proj.weight").elements, 16 * 2 * 8);
  EXPECT_FALSE(row(each, "model.layers.1.mlp.experts.gate_up_proj").fp8);
  EXPECT_TRUE(row(each, "model.layers.1.mlp.shared_experts.up_proj.weight").fp8);
}

// From a checkpoint: its weights and data position, not a fresh init's; bad options fail.
TEST(BenchFp8Error, StartsFromACheckpointAndRejectsBadOptions) {
  testing::TempDir dir("bench_fp8_error_ckpt");
  const Config cfg = fp8_error_config(testing::make_train_data(dir.path()));
  std::unique_ptr<Communicator> world = make_self_communicator();
  std::string ckpt;
  {
    testing::OneRank m(cfg);
    const TokenDataset data = open_token_dataset(cfg.data.path);
    Trainer t(cfg, data, m.mesh, Device::cpu);
    t.init_fresh();
    for (int i = 0; i < 3; ++i) t.train_step();
    ckpt = t.save((dir.path() / "checkpoints").string());
  }
  const Fp8ErrorResult fresh = bench_fp8_error(cfg, *world, cpu_fp8_error());
  Fp8ErrorOptions o = cpu_fp8_error();
  o.checkpoint = ckpt;
  const Fp8ErrorResult later = bench_fp8_error(cfg, *world, o);
  EXPECT_LT(later.lm_loss_ref[0], fresh.lm_loss_ref[0]);  // three steps trained
  o.batches = 0;
  EXPECT_THROW(bench_fp8_error(cfg, *world, o), Error);
}

}  // namespace
}  // namespace moefold

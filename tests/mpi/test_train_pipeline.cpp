// Pipeline parallelism against one rank (CPU ranks over MPI, fp32): for each pipeline layout that
// fits the world (pp 2 and 4, with TP, CP, DP, EP and ETP inside the stages, uneven first / last
// stages, the distributed optimizer), one step's losses, gradient norm, expert loads and every
// gradient match a one-rank run (1e-5 relative), 20 steps' losses and the evaluation match within
// 1e-4, for the default family and for DeepSeek-V3's layers (a dense first layer, multi-token
// prediction on the last stage with its copy of the embedding, expert-bias updates); checkpoints
// saved under pp = 2 resume under pp = 1, pp = 4 and on one rank.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "layout_testing.h"
#include "moefold/comm/communicator.h"
#include "moefold/train/memory_plan.h"
#include "moefold/train/run.h"
#include "moefold/train/trainer.h"
#include "mpi_testing.h"
#include "recompute_check.h"
#include "testing.h"
#include "train_fixture.h"

namespace moefold {
namespace {

using testing::find_param;
using testing::LayoutRun;
using testing::rel_err;

struct PipeLayout {
  int64_t pp, tp, cp, ep, etp;
  int64_t first_stage_layers = 0, last_stage_layers = 0;
  bool distributed_optimizer = false;
  int64_t vpp = 1;
};

std::string name_of(const PipeLayout& l, int world) {
  return cat("(pp, tp, cp, dp, ep, etp) = (", l.pp, ", ", l.tp, ", ", l.cp, ", ", world / (l.pp * l.tp * l.cp), ", ",
             l.ep, ", ", l.etp, "), stage layers first ", l.first_stage_layers, " last ", l.last_stage_layers,
             l.distributed_optimizer ? ", distributed optimizer" : "", l.vpp > 1 ? cat(", vpp ", l.vpp) : "", " on ",
             world, " ranks");
}

Config with_pipe(Config c, const PipeLayout& l) {
  c.parallel.pp = l.pp;
  c.parallel.tp = l.tp;
  c.parallel.cp = l.cp;
  c.parallel.ep = l.ep;
  c.parallel.etp = l.etp;
  c.parallel.first_stage_layers = l.first_stage_layers;
  c.parallel.last_stage_layers = l.last_stage_layers;
  c.parallel.distributed_optimizer = l.distributed_optimizer;
  c.parallel.vpp = l.vpp;
  c.validate();
  return c;
}

// 4 decoder layers, 4 sequences per step in micro-batches of 1: pp 4 with dp 1 runs 4 micro-batches
// (warm-up, steady and cool-down phases on every stage), pp 2 with dp 2 two; vpp 2: two chunks of
// one layer per rank (the interleaved schedule; with 2 micro-batches on 2 stages all forwards first).
std::vector<PipeLayout> pipe_layouts(int world) {
  switch (world) {
    case 2:
      return {{2, 1, 1, 1, 1}, {2, 1, 1, 1, 1, 1, 0}, {2, 1, 1, 1, 1, 0, 0, true}, {2, 1, 1, 1, 1, 0, 0, false, 2}};
    case 4:
      return {{2, 2, 1, 1, 1},
              {2, 1, 1, 2, 1, 0, 0, true},
              {2, 1, 2, 1, 1},
              {4, 1, 1, 1, 1},
              {2, 1, 1, 1, 1, 3, 0},
              {2, 1, 1, 2, 1, 1, 0},
              {2, 1, 1, 2, 1, 0, 0, false, 2},
              {2, 2, 1, 1, 1, 0, 0, true, 2}};
    case 8:
      return {{2, 2, 1, 2, 2}, {4, 1, 1, 2, 1, 0, 0, true}, {2, 2, 2, 4, 1}, {2, 2, 1, 2, 2, 0, 0, false, 2}};
    default:
      return {};
  }
}

class Pipeline : public ::testing::Test {
 protected:
  void SetUp() override {
    Communicator& w = testing::test_world();
    if (w.size() == 1) GTEST_SKIP() << "one rank: no pipeline";
    dir_ = std::make_unique<testing::TempDir>(cat("pipeline_rank", w.rank()));
    const std::vector<std::string> common = {"model.num_hidden_layers=4",   "train.micro_batch_size=1",
                                             "model.num_attention_heads=8", "model.head_dim=4",
                                             "moe.num_experts=8",           "moe.router_aux_loss_coef=0.05"};
    std::vector<std::string> base = common;
    base.push_back("model.num_key_value_heads=4");
    base_ = testing::small_train_config(testing::make_train_data(dir_->path()), base);
    std::vector<std::string> ds = common;
    for (const char* s :
         {"model.architecture=deepseek_v3", "model.num_key_value_heads=8", "model.qk_rope_head_dim=4",
          "model.qk_nope_head_dim=2", "model.v_head_dim=8", "model.kv_lora_rank=8", "model.q_lora_rank=6",
          "model.first_k_dense_replace=1", "model.intermediate_size=24", "model.num_nextn_predict_layers=1",
          "moe.n_shared_experts=1", "moe.scoring_func=sigmoid", "moe.n_group=4", "moe.topk_group=2",
          "moe.expert_bias=true", "moe.expert_bias_update_rate=0.01", "moe.seq_aux_loss_coef=0.05",
          "moe.router_aux_loss_coef=0"})
      ds.push_back(s);
    deepseek_ = testing::small_train_config(base_.data.path, ds);
  }
  std::unique_ptr<testing::TempDir> dir_;
  Config base_, deepseek_;
};

// mtp: multi-token prediction refuses context parallelism (those layouts are skipped).
void one_step_matches_one_rank(const Config& base, bool mtp) {
  Communicator& world = testing::test_world();
  std::unique_ptr<Communicator> self = make_self_communicator();
  LayoutRun ref(base, *self);
  ref.trainer->accumulate_gradients();
  const StepMetrics want = ref.trainer->metrics();
  double worst = 0;
  for (const PipeLayout& l : pipe_layouts(world.size())) {
    if (mtp && l.cp > 1) continue;
    SCOPED_TRACE(name_of(l, world.size()));
    LayoutRun run(with_pipe(base, l), world);
    for (Param& p : run.trainer->params()) {
      const Param& r = find_param(ref.trainer->params(), p.name);
      ASSERT_EQ(p.global_shape(), r.value.shape()) << p.name;
      if (!l.distributed_optimizer) {
        EXPECT_EQ(rel_err(p, p.value, r.value), 0.0) << p.name;
      }
    }
    run.trainer->accumulate_gradients();
    const StepMetrics& got = run.trainer->metrics();
    testing::expect_step_matches(got, want);
    if (!l.distributed_optimizer)  // sharded, a rank's gradients are final in its slots only
      for (Param& p : run.trainer->params()) {
        const double e = rel_err(p, p.grad, find_param(ref.trainer->params(), p.name).grad);
        worst = std::max(worst, e);
        EXPECT_LE(e, 1e-5) << p.name;
      }
    if (world.rank() == 0) std::printf("verified %s\n", name_of(l, world.size()).c_str());
  }
  if (world.rank() == 0) std::printf("largest relative gradient error: %.3g\n", worst);
}

TEST_F(Pipeline, OneStepMatchesOneRank) { one_step_matches_one_rank(base_, false); }
TEST_F(Pipeline, DeepSeekV3OneStepMatchesOneRank) { one_step_matches_one_rank(deepseek_, true); }

void twenty_steps_match_one_rank(Config cfg, bool mtp) {
  Communicator& world = testing::test_world();
  cfg.train.steps = 20;
  std::unique_ptr<Communicator> self = make_self_communicator();
  LayoutRun ref(cfg, *self);
  std::vector<double> want;
  for (int i = 0; i < 20; ++i) want.push_back(ref.trainer->train_step().loss);
  const double eval_want = ref.trainer->evaluate();
  double worst = 0;
  for (const PipeLayout& l : pipe_layouts(world.size())) {
    if (mtp && l.cp > 1) continue;
    SCOPED_TRACE(name_of(l, world.size()));
    LayoutRun run(with_pipe(cfg, l), world);
    for (int i = 0; i < 20; ++i) {
      const double got = run.trainer->train_step().loss;
      worst = std::max(worst, std::abs(got - want[i]) / want[i]);
      EXPECT_NEAR(got, want[i], 1e-4 * want[i]) << "step " << i + 1;
    }
    const int64_t dp = world.size() / (l.pp * l.tp * l.cp);
    if (2 % dp == 0) {  // eval_batches = 2 split evenly over the data-parallel ranks
      EXPECT_NEAR(run.trainer->evaluate(), eval_want, 1e-4 * eval_want);
    }
  }
  if (world.rank() == 0) std::printf("largest relative loss error over 20 steps: %.3g\n", worst);
}

TEST_F(Pipeline, TwentyStepsMatchOneRank) { twenty_steps_match_one_rank(base_, false); }
TEST_F(Pipeline, DeepSeekV3TwentyStepsMatchOneRank) { twenty_steps_match_one_rank(deepseek_, true); }

// moefold plan binds what each rank's trainer binds (its stage's layers, and one set of activations
// per micro-batch in flight: more on the first stage than the last), and Mesh::plan's pipeline groups
// are the ones Mesh::build splits.
TEST_F(Pipeline, PlanMatchesEveryRanksTrainer) {
  Communicator& world = testing::test_world();
  for (const PipeLayout& l : pipe_layouts(world.size())) {
    if (l.cp > 1) continue;
    SCOPED_TRACE(name_of(l, world.size()));
    const Config c = with_pipe(deepseek_, l);
    LayoutRun run(c, world);
    const MemoryPlan p = plan_memory(c, world.size(), world.rank(), Device::cpu);
    const Memory& mem = run.trainer->memory();
    EXPECT_EQ(p.device_total(), run.trainer->planned_bytes());
    EXPECT_EQ(p.gradients, mem.grad_bytes());
    EXPECT_EQ(p.optimizer, run.trainer->optimizer_bytes());
    EXPECT_EQ(p.activations, mem.act_bytes());
    if (l.vpp == 1) {
      EXPECT_EQ(micro_batches_in_flight(c, run.mesh),
                std::vector<int64_t>{
                    std::min<int64_t>(l.pp - run.mesh.pp_rank, c.train.global_batch_size / run.mesh.dims.dp)});
    }
    const Mesh planned = Mesh::plan(run.mesh.dims, world.rank());
    EXPECT_EQ(planned.pp_rank, run.mesh.pp_rank);
    for (const auto& [a, b] : {std::pair{run.mesh.pp.get(), planned.pp.get()},
                               {run.mesh.pp_ends.get(), planned.pp_ends.get()},
                               {run.mesh.pp_link_f0.get(), planned.pp_link_f0.get()},
                               {run.mesh.pp_link_f1.get(), planned.pp_link_f1.get()},
                               {run.mesh.pp_link_f2.get(), planned.pp_link_f2.get()},
                               {run.mesh.pp_link_b0.get(), planned.pp_link_b0.get()},
                               {run.mesh.pp_link_b1.get(), planned.pp_link_b1.get()},
                               {run.mesh.pp_link_b2.get(), planned.pp_link_b2.get()}}) {
      EXPECT_EQ(b->size(), a->size()) << a->name();
      EXPECT_EQ(b->rank(), a->rank()) << a->name();
    }
    // The links: two ranks each, this stage first where it sends activations; the first and the last
    // stage together.
    EXPECT_EQ(run.mesh.pp->size(), l.pp);
    EXPECT_EQ(run.mesh.pp->rank(), run.mesh.pp_rank);
    for (const Communicator* link :
         {run.mesh.activations_out(), run.mesh.activations_in(), run.mesh.grads_out(), run.mesh.grads_in()})
      EXPECT_EQ(link->size(), 2);
    EXPECT_EQ(run.mesh.activations_out()->rank(), 0);
    EXPECT_EQ(run.mesh.grads_in()->rank(), 0);
    EXPECT_EQ(run.mesh.activations_in()->rank(), 1);
    EXPECT_EQ(run.mesh.grads_out()->rank(), 1);
    EXPECT_EQ(run.mesh.pp_ends->size(), run.mesh.first_stage() || run.mesh.last_stage() ? 2 : 1);
  }
}

// Recompute on pipeline stages (whole layers per stage, Megatron-Core's meaning; modules): bit for
// bit the run that keeps everything, with 1F1B and interleaved.
TEST_F(Pipeline, RecomputeChangesNothing) {
  Communicator& world = testing::test_world();
  const int64_t tp = world.size() == 8 ? 2 : 1;  // at least 2 micro-batches per step for interleaving
  for (const PipeLayout& l : {PipeLayout{world.size(), 1, 1, 1, 1}, PipeLayout{2, tp, 1, 1, 1, 0, 0, false, 2}}) {
    if (l.pp * l.vpp > 4 || world.size() % l.pp != 0) continue;
    SCOPED_TRACE(name_of(l, world.size()));
    testing::expect_layout_recompute_changes_nothing(with_pipe(deepseek_, l), world);
  }
}

// Saved under pp = 2 (DeepSeek-V3's layers: the embedding's copy on the last stage is not saved
// twice), resumed under pp = 1 on every rank, under pp = 4 (4 ranks or more), and on one rank.
TEST_F(Pipeline, CheckpointsResumeAcrossStages) {
  namespace fs = std::filesystem;
  Communicator& world = testing::test_world();
  const int n = world.size();
  const fs::path dir = testing::fresh_shared_dir(world, "pipeline");
  const Config cfg = testing::resume_config(deepseek_);
  run_training(with_pipe(cfg, {2, 1, 1, 1, 1}), RunOptions{(dir / "full").string(), 8, false, true}, world);
  const std::vector<double> want = testing::metric_losses(dir / "full");
  ASSERT_EQ(want.size(), 8u);
  // pp 1: every rank data-parallel (TP 2 on 8 ranks: 4 sequences per step), experts over 2 ranks.
  std::vector<std::pair<std::string, PipeLayout>> resumes = {{"pp1", {1, n == 8 ? 2 : 1, 1, n >= 4 ? 2 : 1, 1}}};
  if (n >= 4) resumes.push_back({"pp4", {4, 1, 1, 1, 1}});
  for (const auto& [name, l] : resumes) {
    SCOPED_TRACE(cat("resumed under ", name_of(l, n)));
    const fs::path run = dir / name;
    if (world.rank() == 0) testing::copy_step4(dir / "full", run);
    world.barrier();
    run_training(with_pipe(cfg, l), RunOptions{run.string(), 8, true, true}, world);
    testing::expect_resumed_steps(run, want);
  }
  if (world.rank() == 0) {
    const fs::path run = dir / "one";
    testing::copy_step4(dir / "full", run);
    std::unique_ptr<Communicator> self = make_self_communicator();
    run_training(cfg, RunOptions{run.string(), 8, true, true}, *self);
    SCOPED_TRACE("one rank");
    testing::expect_resumed_steps(run, want);
  }
  world.barrier();
  if (world.rank() == 0) fs::remove_all(dir);
}

}  // namespace
}  // namespace moefold

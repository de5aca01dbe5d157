// Parallel folding parity: for every layout that fits the world, the loss and every gradient of
// one step match a one-rank run (fp32, relative error <= 1e-5), the initial weights are the
// same values, and a 20-step loss curve matches within 1e-4 relative. Each rank runs the
// one-rank reference itself (the model is tiny), so the comparison needs no extra messages.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>

#include "layout_testing.h"
#include "moefold/comm/communicator.h"
#include "moefold/io/tensorboard.h"
#include "moefold/ops/fp8.h"
#include "moefold/train/memory_plan.h"
#include "moefold/train/run.h"
#include "moefold/train/trainer.h"
#include "mpi_testing.h"
#include "recompute_check.h"
#include "testing.h"
#include "train_fixture.h"

namespace moefold {
namespace {

using testing::copy_step4;
using testing::expect_resumed_steps;
using testing::find_param;
using testing::fresh_shared_dir;
using testing::Layout;
using testing::layout_name;
using testing::LayoutRun;
using testing::metric_losses;
using testing::Pool;
using testing::rel_err;
using testing::resume_config;
using testing::with_layout;

// Layouts for the world size: pure DP; context parallelism (cp = 2, or the whole world); and EP
// over the data- and context-parallel ranks (parallel folding: EP up to the whole world,
// independent of DP for attention), e.g. (tp, cp, dp, ep, etp) = (1, 2, 2, 4, 1) on 4 ranks.
std::vector<Layout> layouts(int world) {
  // 8 ranks: the seed's headline example (attention TP = 2 x DP = 4, experts EP = 8) and two
  // relatives; every combination would take too long on CI's 2 cores.
  if (world == 8) return {{2, 1, 8, 1}, {2, 1, 4, 2}, {1, 2, 8, 1}};
  std::vector<Layout> out;
  for (int64_t tp = 1; tp <= world; tp *= 2)
    for (int64_t cp = 1; tp * cp <= world; cp *= 2) {
      if (world % (tp * cp) != 0 || 16 % (2 * cp) != 0) continue;
      for (int64_t ep = 1; ep <= world; ep *= 2)
        for (int64_t etp = 1; ep * etp <= world; etp *= 2)
          if (world % (ep * etp) == 0 && 8 % ep == 0 && 12 % etp == 0) out.push_back({tp, cp, ep, etp});
    }
  return out;
}

class Layouts : public ::testing::Test {
 protected:
  void SetUp() override {
    Communicator& w = testing::test_world();
    dir_ = std::make_unique<testing::TempDir>(cat("layouts_rank", w.rank()));
    // 4 sequences per step over up to 4 data-parallel ranks: micro-batch 1.
    // 8 query / 4 kv heads so that up to 4 TP ranks each hold a grouped-query slice.
    base_ = testing::small_train_config(
        testing::make_train_data(dir_->path()),
        {"train.micro_batch_size=1", "moe.router_aux_loss_coef=0.05", "model.num_attention_heads=8",
         "model.num_key_value_heads=4", "model.head_dim=4", "moe.num_experts=8"});
    // DeepSeek-V3's layers: MLA (q-LoRA, YaRN, interleaved RoPE, v wider than q/k) split by
    // heads over TP and by chunks over CP, a dense first layer and shared experts (column/row
    // parallel), sigmoid routing with groups, a selection bias updated every step from the loads
    // of every rank, and the sequence-level aux loss over split sequences.
    deepseek_ = testing::small_train_config(base_.data.path, {"train.micro_batch_size=1",
                                                              "model.architecture=deepseek_v3",
                                                              "model.num_attention_heads=8",
                                                              "model.num_key_value_heads=8",
                                                              "model.head_dim=4",
                                                              "model.qk_rope_head_dim=4",
                                                              "model.qk_nope_head_dim=2",
                                                              "model.v_head_dim=8",
                                                              "model.kv_lora_rank=8",
                                                              "model.q_lora_rank=6",
                                                              "model.rope_interleave=true",
                                                              "model.rope_type=yarn",
                                                              "model.rope_factor=2",
                                                              "model.rope_original_max_position_embeddings=8",
                                                              "model.rope_mscale=1",
                                                              "model.rope_mscale_all_dim=1",
                                                              "model.first_k_dense_replace=1",
                                                              "model.intermediate_size=24",
                                                              "moe.n_shared_experts=1",
                                                              "moe.num_experts=8",
                                                              "moe.scoring_func=sigmoid",
                                                              "moe.n_group=4",
                                                              "moe.topk_group=2",
                                                              "moe.expert_bias=true",
                                                              "moe.expert_bias_update_rate=0.01",
                                                              "moe.seq_aux_loss_coef=0.05",
                                                              "moe.router_aux_loss_coef=0",
                                                              "moe.routed_scaling_factor=2.5"});
  }
  std::unique_ptr<testing::TempDir> dir_;
  Config base_, deepseek_;
};

// cp_too: also the context-parallel layouts (multi-token prediction refuses them).
void one_step_matches_one_rank(const Config& base_, bool cp_too = true) {
  Communicator& world = testing::test_world();
  std::unique_ptr<Communicator> self = make_self_communicator();
  LayoutRun ref(base_, *self);
  ref.trainer->accumulate_gradients();
  const StepMetrics want = ref.trainer->metrics();
  double worst = 0;
  for (const Layout& l : layouts(world.size())) {
    if (l.cp > 1 && !cp_too) continue;
    SCOPED_TRACE(layout_name(l, world.size()));
    LayoutRun run(with_layout(base_, l), world);
    // The same initial values, whatever the sharding.
    for (Param& p : run.trainer->params()) {
      const Param& r = find_param(ref.trainer->params(), p.name);
      ASSERT_EQ(p.global_shape(), r.value.shape()) << p.name;
      EXPECT_EQ(rel_err(p, p.value, r.value), 0.0) << p.name;
    }
    run.trainer->accumulate_gradients();
    const StepMetrics& got = run.trainer->metrics();
    testing::expect_step_matches(got, want);
    for (Param& p : run.trainer->params()) {
      const double e = rel_err(p, p.grad, find_param(ref.trainer->params(), p.name).grad);
      worst = std::max(worst, e);
      EXPECT_LE(e, 1e-5) << p.name;
    }
    if (world.rank() == 0) std::printf("verified %s\n", layout_name(l, world.size()).c_str());
  }
  if (world.rank() == 0) std::printf("largest relative gradient error: %.3g\n", worst);
}

TEST_F(Layouts, OneStepLossAndEveryGradientMatchOneRank) { one_step_matches_one_rank(base_); }

// train.fp8 = blockwise under every layout against one FP8 rank. Pure data parallelism keeps every
// FP8 tile (each rank quantizes its own micro-batch, as one rank does micro-batch after micro-batch):
// the usual bounds. The others move tile boundaries (TP splits the reduction dims, CP and EP regroup
// the tokens of a weight gradient's reduction), so they agree only to FP8's precision: the loss
// within 1%, every gradient within 15% relative (max-norm; E4M3 keeps 3 mantissa bits), the loads
// exactly.
void fp8_step_matches_one_rank(Config base) {
  base.train.fp8 = "blockwise";
  Communicator& world = testing::test_world();
  std::unique_ptr<Communicator> self = make_self_communicator();
  LayoutRun ref(base, *self);
  ref.trainer->accumulate_gradients();
  const StepMetrics want = ref.trainer->metrics();
  for (const Layout& l : layouts(world.size())) {
    SCOPED_TRACE(layout_name(l, world.size()));
    const bool same_tiles = l.tp == 1 && l.cp == 1 && l.ep == 1 && l.etp == 1 && l.pp == 1;
    LayoutRun run(with_layout(base, l), world);
    run.trainer->accumulate_gradients();
    const StepMetrics& got = run.trainer->metrics();
    double worst = 0;
    for (Param& p : run.trainer->params())
      worst = std::max(worst, rel_err(p, p.grad, find_param(ref.trainer->params(), p.name).grad));
    if (same_tiles) {
      testing::expect_step_matches(got, want);
      EXPECT_LE(worst, 1e-5);
    } else {
      EXPECT_NEAR(got.lm_loss, want.lm_loss, 0.01 * want.lm_loss);
      EXPECT_EQ(got.expert_load_max, want.expert_load_max);
      EXPECT_LE(worst, 0.15);
    }
    if (world.rank() == 0)
      std::printf("FP8 %s: largest relative gradient difference %.3g\n", layout_name(l, world.size()).c_str(), worst);
  }
}

TEST_F(Layouts, Fp8OneStepMatchesOneRank) {
  fp8_step_matches_one_rank(base_);
  // The DeepSeek-V3-shaped model with moe.fp8_dispatch: packed FP8 rows through the all-to-all and
  // all-gather dispatchers (their byte-row views of the exchange buffers).
  Config c = deepseek_;
  c.moe.fp8_dispatch = true;
  fp8_step_matches_one_rank(c);
}
TEST_F(Layouts, DeepSeekV3OneStepLossAndEveryGradientMatchOneRank) { one_step_matches_one_rank(deepseek_); }
TEST_F(Layouts, DeepSeekV3WithMultiTokenPredictionMatchesOneRank) {
  Config c = deepseek_;
  c.model.num_nextn_predict_layers = 2;
  one_step_matches_one_rank(c, false);
}

// The gradient reduction overlapped with backward (per-layer buckets started in the last
// micro-batch, parallel.overlap_grad_reduce, the default) sums what one reduction per group after
// backward sums: same losses, every gradient within fp32 reassociation (2 micro-batches per
// data-parallel rank, so only the last one's layers start buckets).
TEST_F(Layouts, OverlappedGradientReductionMatchesOneReductionAfterBackward) {
  Communicator& world = testing::test_world();
  for (const Layout& l : layouts(world.size())) {
    SCOPED_TRACE(layout_name(l, world.size()));
    Config on = with_layout(base_, l), off = on;
    ASSERT_TRUE(on.parallel.overlap_grad_reduce);
    off.parallel.overlap_grad_reduce = false;
    LayoutRun a(on, world), b(off, world);
    a.trainer->accumulate_gradients();
    b.trainer->accumulate_gradients();
    EXPECT_EQ(a.trainer->metrics().lm_loss, b.trainer->metrics().lm_loss);
    EXPECT_NEAR(a.trainer->metrics().grad_norm, b.trainer->metrics().grad_norm, 1e-6 * b.trainer->metrics().grad_norm);
    for (Param& p : a.trainer->params()) {
      const Tensor& want = find_param(b.trainer->params(), p.name).grad;
      EXPECT_LE(testing::max_abs_diff(p.grad, want), 1e-6 * std::max(testing::max_abs(want), 1e-30)) << p.name;
    }
  }
}

void twenty_steps_match_one_rank(const Config& base_) {
  Communicator& world = testing::test_world();
  Config cfg = base_;
  cfg.train.steps = 20;
  std::unique_ptr<Communicator> self = make_self_communicator();
  LayoutRun ref(cfg, *self);
  std::vector<double> want;
  for (int i = 0; i < 20; ++i) want.push_back(ref.trainer->train_step().loss);
  double worst = 0;
  for (const Layout& l : layouts(world.size())) {
    const int64_t dp = world.size() / (l.tp * l.cp);
    SCOPED_TRACE(layout_name(l, world.size()));
    Config c = with_layout(cfg, l);
    LayoutRun run(c, world);
    for (int i = 0; i < 20; ++i) {
      const double got = run.trainer->train_step().loss;
      worst = std::max(worst, std::abs(got - want[i]) / want[i]);
      EXPECT_NEAR(got, want[i], 1e-4 * want[i]) << "step " << i + 1;
    }
    const double eval_want = ref.trainer->evaluate(), eval_got = run.trainer->evaluate();
    if (2 % dp == 0) {  // eval_batches = 2 split evenly over the data-parallel ranks
      EXPECT_NEAR(eval_got, eval_want, 1e-4 * eval_want);
    }
  }
  if (world.rank() == 0) std::printf("largest relative loss error over 20 steps: %.3g\n", worst);
}

TEST_F(Layouts, TwentyStepLossCurveMatchesOneRank) { twenty_steps_match_one_rank(base_); }
TEST_F(Layouts, DeepSeekV3TwentyStepLossCurveMatchesOneRank) { twenty_steps_match_one_rank(deepseek_); }

// parallel.ep_transport changes how the expert rows travel, never what is computed: the peer
// copies (MPI's PeerMemory on CPU ranks) put every row where the exchange does, so three steps
// with EP over the whole world give identical losses and gradient norms.
TEST_F(Layouts, EpTransportsGiveIdenticalSteps) {
  Communicator& world = testing::test_world();
  if (world.size() == 1 || 8 % world.size() != 0) GTEST_SKIP() << "needs EP over 2, 4 or 8 ranks";
  std::vector<std::vector<double>> losses;
  for (const char* transport : {"nccl", "ipc"}) {
    // 4 sequences per step: at most DP = 4 (TP = 2 on 8 ranks).
    Config c = with_layout(base_, {world.size() == 8 ? 2 : 1, 1, world.size(), 1});
    c.parallel.ep_transport = transport;
    LayoutRun run(c, world);
    std::vector<double>& got = losses.emplace_back();
    for (int i = 0; i < 3; ++i) {
      const StepMetrics m = run.trainer->train_step();
      got.push_back(m.loss);
      got.push_back(m.grad_norm);
    }
  }
  EXPECT_EQ(losses[0], losses[1]) << "losses and gradient norms of steps 1-3, nccl then ipc";
}

// moe.dispatcher = "hierarchical" over emulated nodes (parallel.ranks_per_node: 1, 2, ... ranks
// per node): three steps give the flat dispatcher's losses, gradient norms and expert loads (the
// experts' weight gradients sum their rows in another order: within rounding), the inter-node
// bytes are counted (none on one node), and moefold plan's memory and Mesh::plan's node groups
// are the trainer's and Mesh::build's.
TEST_F(Layouts, HierarchicalDispatchMatchesTheFlatOne) {
  Communicator& world = testing::test_world();
  const int n = world.size();
  if (n == 1 || 8 % n != 0) GTEST_SKIP() << "needs EP over 2, 4 or 8 ranks";
  for (const Config* base : {&base_, &deepseek_}) {
    // 4 sequences per step: at most DP = 4 (TP = 2 on 8 ranks).
    const Config flat_cfg = with_layout(*base, {n == 8 ? 2 : 1, 1, n, 1});
    std::vector<StepMetrics> want;
    {
      LayoutRun flat(flat_cfg, world);
      for (int i = 0; i < 3; ++i) want.push_back(flat.trainer->train_step());
    }
    for (int per_node = 1; per_node <= n; per_node *= 2) {
      SCOPED_TRACE(cat(base == &base_ ? "qwen3-like" : "deepseek-v3-like", ", ", n / per_node, " nodes x ", per_node));
      Config c = flat_cfg;
      c.moe.dispatcher = "hierarchical";
      c.parallel.ranks_per_node = per_node;
      LayoutRun run(c, world);
      ASSERT_EQ(run.mesh.num_nodes, n / per_node);
      ASSERT_EQ(run.mesh.ep_node->size() * run.mesh.ep_rail->size(), run.mesh.ep->size());
      for (int i = 0; i < 3; ++i) {
        const StepMetrics got = run.trainer->train_step();
        testing::expect_step_matches(got, want[static_cast<size_t>(i)]);
        if (per_node == n) {
          EXPECT_EQ(got.inter_node_bytes, 0.0);
        } else {
          EXPECT_GT(got.inter_node_bytes, 0.0);
        }
      }
      const MemoryPlan p = plan_memory(c, n, world.rank(), Device::cpu);
      EXPECT_EQ(p.device_total(), run.trainer->planned_bytes());
      const Mesh planned = Mesh::plan(run.mesh.dims, world.rank(), true);
      EXPECT_EQ(planned.node, run.mesh.node);
      for (const auto& [built, plan] : {std::pair{run.mesh.ep_node.get(), planned.ep_node.get()},
                                        std::pair{run.mesh.ep_rail.get(), planned.ep_rail.get()}}) {
        EXPECT_EQ(plan->size(), built->size()) << built->name();
        EXPECT_EQ(plan->rank(), built->rank()) << built->name();
      }
    }
  }
}

// train.cuda_graphs on several GPUs (the decision alone: on CPU ranks the meshes as GPU ranks would
// build them): "layers" where a layer's ranks meet only in NCCL calls on device buffers (DP, TP, CP,
// EP in fixed slots, pipeline stages); refused, naming the reason, where something reads the host
// inside a layer (EP's other dispatchers, ETP) or runs between the captured layers ("step",
// overlap_moe_a2a). test_train_layouts_cuda.cpp replays the allowed ones on two GPUs.
TEST_F(Layouts, CudaGraphsOnSeveralRanksRefuseOnlyWhatReadsTheHost) {
  Communicator& world = testing::test_world();
  const int n = world.size();
  if (n == 1) GTEST_SKIP() << "needs several ranks";
  const int64_t t = n == 8 ? 2 : 1;  // 4 sequences a step: at most 4 data-parallel ranks
  const auto refusal = [&](Config c, const Layout& l) {
    c = with_layout(c, l);
    c.validate();
    const Mesh mesh = Mesh::build(world, c.resolve_layout(n), false);
    return cuda_graphs_refusal(c, mesh, Device::cuda);
  };
  Config layers = base_, slots = base_, sharded = base_, step = base_, overlap = base_, pipeline = deepseek_;
  for (Config* c : {&layers, &slots, &sharded, &step, &overlap, &pipeline}) c->train.cuda_graphs = "layers";
  slots.moe.dispatcher = "slots";
  sharded.parallel.distributed_optimizer = true;
  step.moe.dispatcher = "slots";
  step.train.cuda_graphs = "step";
  overlap.moe.dispatcher = "slots";
  overlap.parallel.overlap_moe_a2a = true;
  EXPECT_EQ(refusal(layers, {t, 1, 1, 1}), "");               // DP (TP x DP at 8 ranks)
  EXPECT_EQ(refusal(layers, {n == 8 ? 4 : n, 1, 1, 1}), "");  // TP
  EXPECT_EQ(refusal(layers, {t, 2, 1, 1}), "");               // CP
  EXPECT_EQ(refusal(slots, {t, 1, n, 1}), "");                // EP in slots
  EXPECT_EQ(refusal(pipeline, {t, 1, 1, 1, 2}), "");          // two pipeline stages
  EXPECT_EQ(refusal(sharded, {t, 1, 1, 1}), "");              // the distributed optimizer
  EXPECT_NE(refusal(layers, {t, 1, n, 1}).find("moe.dispatcher = \"alltoall\""), std::string::npos);
  EXPECT_NE(refusal(layers, {t, 1, 1, 2}).find("parallel.etp = 2"), std::string::npos);
  EXPECT_NE(refusal(step, {t, 1, n, 1}).find("\"step\" with several ranks"), std::string::npos);
  EXPECT_NE(refusal(overlap, {t, 1, n, 1}).find("parallel.overlap_moe_a2a"), std::string::npos);
  EXPECT_EQ(refusal(base_, {t, 1, n, 1}), "");  // train.cuda_graphs = "none": nothing to refuse
  // A CPU run says so first.
  const Config on_cpu = with_layout(slots, {t, 1, n, 1});
  EXPECT_EQ(cuda_graphs_refusal(on_cpu, Mesh::build(world, on_cpu.resolve_layout(n), false), Device::cpu),
            "a CPU run (nothing to capture)");
}

// moe.dispatcher = "slots" (the exchange in fixed slots, the counts on the device): three steps
// give the all-to-all dispatcher's losses, gradient norms and expert loads (the experts' rows sit
// in another order: within rounding) with slots of the worst case and of less, moefold plan's
// memory is the trainer's; with two micro-batches interleaved and FP8 rows too; slots of exactly
// the average share (moe.ep_recv_factor = 1) cannot hold random routing: the first step fails
// on every rank with one line naming the key, before the optimizer runs, and so does an evaluation.
TEST_F(Layouts, SlotDispatchMatchesTheAllToAllOne) {
  Communicator& world = testing::test_world();
  const int n = world.size();
  if (n == 1 || 8 % n != 0) GTEST_SKIP() << "needs EP over 2, 4 or 8 ranks";
  for (const Config* base : {&base_, &deepseek_}) {
    SCOPED_TRACE(base == &base_ ? "qwen3-like" : "deepseek-v3-like");
    const Config flat_cfg = with_layout(*base, {n == 8 ? 2 : 1, 1, n, 1});
    std::vector<StepMetrics> want;
    double want_eval = 0;
    {
      LayoutRun flat(flat_cfg, world);
      for (int i = 0; i < 3; ++i) want.push_back(flat.trainer->train_step());
      want_eval = flat.trainer->evaluate();
    }
    ASSERT_GT(want_eval, 0);
    // 0: the worst case; 0.75 P: slots of 3/4 of it where that is below the worst case (EP 2, 4).
    for (const double factor : {0.0, 0.75 * n}) {
      SCOPED_TRACE(cat("moe.ep_recv_factor = ", factor));
      Config c = flat_cfg;
      c.moe.dispatcher = "slots";
      c.moe.ep_recv_factor = factor;
      LayoutRun run(c, world);
      for (int i = 0; i < 3; ++i) {
        const StepMetrics got = run.trainer->train_step();
        testing::expect_step_matches(got, want[static_cast<size_t>(i)]);
        // What the routing asked of the slots: something, and no more than they hold.
        EXPECT_GT(got.ep_slot_fill, 0.0);
        EXPECT_LE(got.ep_slot_fill, 1.0);
        EXPECT_EQ(want[static_cast<size_t>(i)].ep_slot_fill, 0.0) << "the all-to-all dispatcher has no slots";
      }
      EXPECT_NEAR(run.trainer->evaluate(), want_eval, 1e-6 * want_eval);
      const MemoryPlan p = plan_memory(c, n, world.rank(), Device::cpu);
      EXPECT_EQ(p.device_total(), run.trainer->planned_bytes());
    }
    {  // two micro-batches interleaved (parallel.overlap_moe_a2a): each has its own slots
      Config c = flat_cfg;
      c.moe.dispatcher = "slots";
      c.parallel.overlap_moe_a2a = true;
      LayoutRun run(c, world);
      for (int i = 0; i < 3; ++i) testing::expect_step_matches(run.trainer->train_step(), want[static_cast<size_t>(i)]);
    }
    // FP8 with packed FP8 rows through the slots (their byte-row views): the first step's forward
    // quantizes each row alone, so its loss is the all-to-all's; the gradients then group the rows
    // into other 128-row tiles (the weight gradients' quantization): within FP8's bounds.
    Config fp8 = flat_cfg;
    fp8.train.fp8 = "blockwise";
    fp8.moe.fp8_dispatch = true;
    StepMetrics fp8_want;
    {
      LayoutRun flat(fp8, world);
      fp8_want = flat.trainer->train_step();
    }
    fp8.moe.dispatcher = "slots";
    {
      LayoutRun run(fp8, world);
      const StepMetrics got = run.trainer->train_step();
      EXPECT_NEAR(got.lm_loss, fp8_want.lm_loss, 1e-6 * fp8_want.lm_loss) << "FP8 dispatch";
      EXPECT_NEAR(got.grad_norm, fp8_want.grad_norm, 0.05 * fp8_want.grad_norm) << "FP8 dispatch";
    }
    Config tight = flat_cfg;
    tight.moe.dispatcher = "slots";
    tight.moe.ep_recv_factor = 1.0;
    LayoutRun run(tight, world);
    auto weights = [&run] {  // every master weight's bytes (CPU ranks: host memory)
      std::vector<std::vector<uint8_t>> w;
      for (const Param& p : run.trainer->params()) {
        const auto* at = static_cast<const uint8_t*>(p.value.data());
        w.emplace_back(at, at + p.value.nbytes());
      }
      return w;
    };
    const std::vector<std::vector<uint8_t>> before = weights();
    try {
      run.trainer->train_step();
      ADD_FAILURE() << "the step did not fail";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("step 1: "), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("did not fit its fixed slots (moe.dispatcher = \"slots\", "
                                           "moe.ep_recv_factor = 1); raise moe.ep_recv_factor (this routing asked "
                                           "for up to "),
                std::string::npos)
          << e.what();
    }
    EXPECT_EQ(weights(), before) << "the failed step changed the weights";
    try {  // an evaluation counts its own
      run.trainer->evaluate();
      ADD_FAILURE() << "the evaluation did not fail";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()).rfind("evaluation: ", 0), 0u) << e.what();
    }
  }
}

// Recomputation under every layout (recompute_check.h: the combined variants, 2 steps): the
// recomputed forwards gather over TP, pass the CP ring and exchange the expert rows over EP again,
// and change no bit of the losses, the gradient norms or the weights (DeepSeek-V3's layers).
TEST_F(Layouts, RecomputeChangesNothing) {
  Communicator& world = testing::test_world();
  for (const Layout& l : layouts(world.size())) {
    SCOPED_TRACE(layout_name(l, world.size()));
    testing::expect_layout_recompute_changes_nothing(with_layout(deepseek_, l), world);
  }
}

// parallel.distributed_optimizer = true against false on every layout with a shard group of more
// than one rank (DP x CP x TP for the dense parameters, DP x CP for TP shards, EDP for experts):
// 20 steps of losses and then every master weight within 1e-6 (f32; only the gradient norm adds
// its squares in another order), and the optimizer's bytes per rank those of one rank divided
// by each group's shard count, up to each bucket's padding.
void distributed_optimizer_matches(const Config& base_) {
  Communicator& world = testing::test_world();
  if (world.size() == 1) GTEST_SKIP() << "one rank: every shard group has one rank";
  Config cfg = base_;
  cfg.train.steps = 20;
  int checked = 0;
  for (const Layout& l : layouts(world.size())) {
    SCOPED_TRACE(layout_name(l, world.size()));
    Config off = with_layout(cfg, l), on = off;
    on.parallel.distributed_optimizer = true;
    LayoutRun a(off, world), b(on, world);
    const Mesh& mesh = b.mesh;
    if (mesh.dense->size() == 1 && mesh.edp->size() == 1) continue;
    ++checked;
    // The first layout also without the overlapped gathers: the same bits.
    Config late = on;
    late.parallel.overlap_param_gather = false;
    std::unique_ptr<LayoutRun> c = checked == 1 ? std::make_unique<LayoutRun>(late, world) : nullptr;
    for (int i = 0; i < 20; ++i) {
      const double want = a.trainer->train_step().loss, got = b.trainer->train_step().loss;
      ASSERT_NEAR(got, want, 1e-6 * want) << "step " << i + 1;
      if (c) {
        ASSERT_EQ(c->trainer->train_step().loss, got) << "overlap_param_gather = false, step " << i + 1;
      }
    }
    b.trainer->gather_master_weights();
    for (Param& p : b.trainer->params()) {
      const Param& r = find_param(a.trainer->params(), p.name);
      EXPECT_LE(testing::max_abs_diff(p.value, r.value), 1e-6 * std::max(testing::max_abs(r.value), 1e-30)) << p.name;
    }
    // Optimizer bytes: unsharded, master + two moments of every parameter; sharded, the slots'
    // (and the full_master parameters' whole state, their master among the parameters).
    const Memory& mem = b.trainer->memory();
    const size_t sharded = AdamW::state_bytes(mem, on.train);
    double want = 0, padding = 0;
    for (int g = 0; g < kNumParamGroups; ++g) {
      const ParamGroup group = static_cast<ParamGroup>(g);
      const double n = static_cast<double>(mem.shards(group));
      for (const Param& p : mem.params())
        if (p.group == group) want += 12.0 * static_cast<double>(p.grad.numel()) / (p.full_master ? 1.0 : n);
      for (const Param& p : mem.params())
        if (p.group == group && p.full_master) want -= 4.0 * static_cast<double>(p.grad.numel());  // its value
      // Per bucket: its start (a multiple of 64 bytes and n elements), its end (n elements) and
      // the arena's rounding of three tensors; per parameter: the 64-byte alignment of its gradient.
      padding += static_cast<double>(mem.grad_buckets(group).size()) * (3 * 64 + 12 * 2 * (16 + n));
      for (const Param& p : mem.params())
        if (p.group == group) padding += 12.0 * 16 / n;
    }
    EXPECT_GE(static_cast<double>(sharded), want);
    EXPECT_LE(static_cast<double>(sharded), want + padding);
  }
  EXPECT_GT(checked, 0);
}

TEST_F(Layouts, DistributedOptimizerMatchesUnsharded) { distributed_optimizer_matches(base_); }
TEST_F(Layouts, DeepSeekV3DistributedOptimizerMatchesUnsharded) { distributed_optimizer_matches(deepseek_); }

// train.fp8_param with the distributed optimizer (AdamW::gather_copies): each rank quantizes its
// slots (its part of every 128 x 128 block's amax, one max over the shard group, the codes) and the
// FP8 codes are gathered instead of compute copies. On every layout with a shard group of more
// than one rank, against the same sharded run with compute copies: after each of 4 steps every
// FP8-only weight's codes and scales are exactly fp8_quantize_blocks's of its whole (gathered)
// master; the losses stay within 1e-6 (the FP8-only weights' buckets of their own move the slot
// boundaries, so the gradient norm adds its squares in another order); the first layout also
// without the overlapped gathers (the same bits). The compute copies shrink by the FP8 weights'
// 4 bytes an element (f32 on the CPU), the FP8 copies stay as large (the codes moved into the
// code block). Then a checkpoint saved at step 4 resumes (codes from the loaded masters) with the
// uninterrupted run's losses.
void fp8_param_sharded_changes_nothing(const Config& base_, bool resume) {
  namespace fs = std::filesystem;
  Communicator& world = testing::test_world();
  if (world.size() == 1) GTEST_SKIP() << "one rank: every shard group has one rank";
  Config cfg = base_;
  cfg.train.fp8 = "blockwise";
  cfg.parallel.distributed_optimizer = true;
  int checked = 0;
  for (const Layout& l : layouts(world.size())) {
    SCOPED_TRACE(layout_name(l, world.size()));
    Config off = with_layout(cfg, l), on = off;
    on.train.fp8_param = true;
    LayoutRun a(off, world), b(on, world);
    if (b.mesh.dense->size() == 1 && b.mesh.edp->size() == 1) continue;
    ++checked;
    Config late = on;
    late.parallel.overlap_param_gather = false;
    std::unique_ptr<LayoutRun> c = checked == 1 ? std::make_unique<LayoutRun>(late, world) : nullptr;
    const Memory &ma = a.trainer->memory(), &mb = b.trainer->memory();
    double worst = 0;
    for (int i = 0; i < 4; ++i) {
      const double want = a.trainer->train_step().loss, got = b.trainer->train_step().loss;
      ASSERT_NEAR(got, want, 1e-6 * want) << "step " << i + 1;
      worst = std::max(worst, std::abs(got - want) / want);
      if (c) {
        ASSERT_EQ(c->trainer->train_step().loss, got) << "overlap_param_gather = false, step " << i + 1;
      }
      b.trainer->gather_master_weights();  // Param::value: the whole masters until the next step
      for (const Param& p : mb.params()) {
        if (!p.fp8_gathered) continue;
        Pool pool;
        const Tensor q = pool.zeros(p.grad.shape(), DType::u8);
        const Tensor s = pool.zeros(fp8_block_scale_shape(p.grad.shape(), false), DType::f32);
        fp8_quantize_blocks(ExecContext::standard(Device::cpu), p.value, q, s, Tensor(), Tensor());
        ASSERT_EQ(std::memcmp(q.data(), p.fp8.q.data(), q.nbytes()), 0) << p.name << ", step " << i + 1;
        ASSERT_EQ(std::memcmp(s.data(), p.fp8.s.data(), s.nbytes()), 0) << p.name << ", step " << i + 1;
      }
    }
    size_t fp8_elems = 0, fp8_params = 0, slack = 0;
    for (const Param& p : mb.params())
      if (p.fp8_gathered) {
        fp8_elems += static_cast<size_t>(p.grad.numel());
        ++fp8_params;
        EXPECT_FALSE(p.has_compute_copy()) << p.name;
      }
    for (int g = 0; g < kNumParamGroups; ++g)
      for (const GradBucket& bk : mb.grad_buckets(static_cast<ParamGroup>(g)))
        if (bk.fp8) slack += 4 * static_cast<size_t>(std::lcm(int64_t{64}, mb.shards(static_cast<ParamGroup>(g))));
    EXPECT_GT(fp8_elems, 0u);
    EXPECT_GE(ma.compute_bytes() + slack, mb.compute_bytes() + 4 * fp8_elems);
    EXPECT_NEAR(static_cast<double>(mb.fp8_bytes()), static_cast<double>(ma.fp8_bytes()),
                static_cast<double>(slack + 64 * fp8_params));
    if (world.rank() == 0)
      std::printf("fp8_param sharded, %s: %zu FP8-only elements, largest relative loss difference %.3g\n",
                  layout_name(l, world.size()).c_str(), fp8_elems, worst);
  }
  EXPECT_GT(checked, 0);
  if (!resume) return;
  // A checkpoint of it resumes with the uninterrupted run's losses (data-parallel ranks only, TP 2
  // on 8: the codes come from the loaded masters through the slots).
  const fs::path dir = fresh_shared_dir(world, "fp8_param");
  Config r = resume_config(cfg);
  r.train.fp8_param = true;
  r = with_layout(r, {world.size() == 8 ? 2 : 1, 1, 1, 1});  // at most 4 data-parallel ranks (4 sequences)
  run_training(r, RunOptions{(dir / "full").string(), 8, false, true}, world);
  const std::vector<double> want = metric_losses(dir / "full");
  ASSERT_EQ(want.size(), 8u);
  if (world.rank() == 0) copy_step4(dir / "full", dir / "resumed");
  world.barrier();
  run_training(r, RunOptions{(dir / "resumed").string(), 8, true, true}, world);
  expect_resumed_steps(dir / "resumed", want);
  world.barrier();
  if (world.rank() == 0) fs::remove_all(dir);
}

TEST_F(Layouts, Fp8ParamWithDistributedOptimizerChangesNothing) {
  fp8_param_sharded_changes_nothing(base_, true);
  Config c = deepseek_;
  c.moe.fp8_dispatch = true;
  fp8_param_sharded_changes_nothing(c, false);
}

// moefold plan's numbers are the trainer's: for every layout (distributed optimizer on and off; on
// with FP8-only weights too, whose codes and scales live in the groups' code and scale blocks),
// plan_memory for this rank (a shape-only mesh, nothing allocated) gives exactly the bytes the
// rank's Trainer planned, part by part, and Mesh::plan gives every group the size and rank that
// Mesh::build's splits gave.
TEST_F(Layouts, PlanMatchesEveryRanksTrainer) {
  Communicator& world = testing::test_world();
  for (const Layout& l : layouts(world.size()))
    for (const int variant : {0, 1, 2}) {
      const bool sharded = variant > 0;
      SCOPED_TRACE(cat(layout_name(l, world.size()), sharded ? ", distributed optimizer" : "",
                       variant == 2 ? ", FP8-only weights" : ""));
      Config c = with_layout(deepseek_, l);
      c.parallel.distributed_optimizer = sharded;
      if (variant == 2) {
        c.train.fp8 = "blockwise";
        c.train.fp8_param = true;
      }
      LayoutRun run(c, world);
      const MemoryPlan p = plan_memory(c, world.size(), world.rank(), Device::cpu);
      const Memory& mem = run.trainer->memory();
      EXPECT_EQ(p.device_total(), run.trainer->planned_bytes());
      EXPECT_EQ(p.master, mem.master_bytes());
      EXPECT_EQ(p.compute_copies, mem.compute_bytes());
      EXPECT_EQ(p.fp8_copies, mem.fp8_bytes());
      EXPECT_EQ(p.gradients, mem.grad_bytes());
      EXPECT_EQ(p.optimizer, run.trainer->optimizer_bytes());
      EXPECT_EQ(p.activations, mem.act_bytes());
      const Mesh planned = Mesh::plan(run.mesh.dims, world.rank());
      const std::pair<const char*, const Communicator*> groups[][2] = {
          {{"tp", run.mesh.tp.get()}, {"tp", planned.tp.get()}},
          {{"cp", run.mesh.cp.get()}, {"cp", planned.cp.get()}},
          {{"dp", run.mesh.dp.get()}, {"dp", planned.dp.get()}},
          {{"dp_cp", run.mesh.dp_cp.get()}, {"dp_cp", planned.dp_cp.get()}},
          {{"tp_cp", run.mesh.tp_cp.get()}, {"tp_cp", planned.tp_cp.get()}},
          {{"dense", run.mesh.dense.get()}, {"dense", planned.dense.get()}},
          {{"etp", run.mesh.etp.get()}, {"etp", planned.etp.get()}},
          {{"ep", run.mesh.ep.get()}, {"ep", planned.ep.get()}},
          {{"edp", run.mesh.edp.get()}, {"edp", planned.edp.get()}},
          {{"ep_etp", run.mesh.ep_etp.get()}, {"ep_etp", planned.ep_etp.get()}}};
      for (const auto& g : groups) {
        EXPECT_EQ(g[1].second->size(), g[0].second->size()) << g[0].first;
        EXPECT_EQ(g[1].second->rank(), g[0].second->rank()) << g[0].first;
        EXPECT_EQ(g[1].second->name(), g[0].second->name()) << g[0].first;
      }
    }
}

// An empty directory every rank sees under the same name (rank 0's pid); the test removes it.

TEST_F(Layouts, CheckpointSavedUnderOneLayoutResumesUnderAnother) {
  namespace fs = std::filesystem;
  Communicator& world = testing::test_world();
  const fs::path dir = fresh_shared_dir(world, "reshard");
  Config cfg = resume_config(base_);
  // Saved with the experts split both ways where the world allows (ep x etp = world) and TP = 2,
  // e.g. (tp, ep, etp) = (2, 2, 2) on 4 ranks; resumed with every EP, no ETP, TP 2 or 1, and on
  // one rank.
  const int64_t save_etp = world.size() >= 2 ? 2 : 1, max_ep = world.size() / save_etp;
  cfg.parallel.ep = max_ep;
  cfg.parallel.etp = save_etp;
  cfg.parallel.tp = save_etp;  // and the attention heads over TP
  // The uninterrupted run, saving at step 4.
  run_training(cfg, RunOptions{(dir / "full").string(), 8, false, true}, world);
  const std::vector<double> want = metric_losses(dir / "full");
  ASSERT_EQ(want.size(), 8u);
  if (world.rank() == 0) {  // rank 0 alone writes TensorBoard events, of the values reduced over ranks
    const std::vector<std::string> files = tb_event_files((dir / "full" / "tensorboard").string());
    ASSERT_EQ(files.size(), 1u);
    std::vector<double> tb;
    for (const TbEvent& e : read_tb_events(files[0]))
      for (const TbValue& v : e.values)
        if (v.tag == "loss/total") tb.push_back(v.scalar);
    ASSERT_EQ(tb.size(), 8u);
    for (size_t i = 0; i < 8; ++i) EXPECT_EQ(tb[i], static_cast<float>(want[i])) << "step " << i + 1;
  }
  // Resume from its step-4 checkpoint under every other EP on this world, and on one rank.
  for (int64_t ep = 1; ep <= max_ep; ep *= 2) {
    SCOPED_TRACE(
        cat("saved with ep=", max_ep, " etp=", save_etp, ", resumed with ep=", ep, " on ", world.size(), " ranks"));
    const fs::path run = dir / cat("ep", ep);
    if (world.rank() == 0) copy_step4(dir / "full", run);
    world.barrier();
    Config c = cfg;
    c.parallel.ep = ep;
    c.parallel.etp = 1;
    // e.g. EP=2, TP=2 from EP=2 x ETP=2; at least TP=2 on 8 ranks (4 sequences per step: dp <= 4)
    c.parallel.tp = world.size() >= 2 && (ep <= world.size() / 2 || world.size() == 8) ? 2 : 1;
    SCOPED_TRACE(cat("tp=", c.parallel.tp));
    run_training(c, RunOptions{run.string(), 8, true, true}, world);
    expect_resumed_steps(run, want);
  }
  if (world.rank() == 0) {
    const fs::path run = dir / "one";
    copy_step4(dir / "full", run);
    std::unique_ptr<Communicator> self = make_self_communicator();
    Config c = cfg;
    c.parallel.ep = 1;
    c.parallel.etp = 1;
    c.parallel.tp = 1;
    run_training(c, RunOptions{run.string(), 8, true, true}, *self);
    SCOPED_TRACE("one rank");
    expect_resumed_steps(run, want);
  }
  world.barrier();
  if (world.rank() == 0) fs::remove_all(dir);
}

// Checkpoints stay layout-independent with the distributed optimizer: saved sharded under
// (dp 4, edp 2) on 4 ranks (dp 2, edp 1 on 2; dp 8, edp 4 on 8), resumed sharded under dp 2 and
// dp 1 (TP takes the rest), unsharded, and sharded from an unsharded save; steps 5-8 match the
// uninterrupted run. The moments travel too: a resume that lost them would drift.
TEST_F(Layouts, DistributedOptimizerCheckpointsResumeUnderOtherLayouts) {
  namespace fs = std::filesystem;
  Communicator& world = testing::test_world();
  const int n = world.size();
  if (n == 1 || (n != 2 && n != 4 && n != 8)) GTEST_SKIP() << "needs 2, 4 or 8 ranks";
  const fs::path dir = fresh_shared_dir(world, "dist_opt");
  Config cfg = resume_config(base_);
  // At most DP = 4 (4 sequences per step): TP 2 on 8 ranks.
  const Layout saved{n == 8 ? 2 : 1, 1, 2, 1};
  Config sharded = with_layout(cfg, saved);
  sharded.parallel.distributed_optimizer = true;
  run_training(sharded, RunOptions{(dir / "full").string(), 8, false, true}, world);
  Config plain = with_layout(cfg, saved);
  run_training(plain, RunOptions{(dir / "plain").string(), 4, false, true}, world);
  const std::vector<double> want = metric_losses(dir / "full");
  ASSERT_EQ(want.size(), 8u);
  struct Resume {
    std::string name, from;
    int64_t tp, cp;
    bool distributed;
  };
  // dp 1 on 8 ranks: TP 4 x CP 2 (4 key-value heads).
  const std::vector<Resume> resumes = {{"dp2", "full", n / 2, 1, true},
                                       {"dp1", "full", n == 8 ? 4 : n, n == 8 ? 2 : 1, true},
                                       {"unsharded", "full", n == 8 ? 2 : 1, 1, false},
                                       {"from_unsharded", "plain", n == 8 ? 2 : 1, 1, true}};
  for (const Resume& r : resumes) {
    SCOPED_TRACE(cat("resume ", r.name, " on ", n, " ranks"));
    const fs::path run = dir / r.name;
    if (world.rank() == 0) copy_step4(dir / r.from, run);
    world.barrier();
    Config c = with_layout(cfg, {r.tp, r.cp, 2, 1});
    c.parallel.distributed_optimizer = r.distributed;
    run_training(c, RunOptions{run.string(), 8, true, true}, world);
    expect_resumed_steps(run, want);
  }
  world.barrier();
  if (world.rank() == 0) fs::remove_all(dir);
}

}  // namespace
}  // namespace moefold

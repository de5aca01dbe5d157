// Parallel layouts on GPUs: one GPU per rank, ranks joined by NCCL (bootstrapped over MPI). For
// every two-rank layout (DP, TP with sequence parallelism, CP, EP, ETP, TP x EP, PP) the loss and
// every gradient of one fp32 step, and a 20-step bf16 mixed-precision loss curve, match a one-GPU
// run that each rank computes itself on its own GPU. A checkpoint saved under TP = EP = 2
// resumes under DP = 2. CUDA graphs of the layers replay the eager steps' bits. Skipped unless
// every rank has a GPU of its own.
//
// Tolerances (bf16: 8 significant bits, a rounding error of up to 2^-9 = 2.0e-3 per op): a layout
// changes which bf16 roundings happen (TP rounds partial row-parallel sums before the reduction,
// EP/ETP reorder rows, CP splits the softmax), so results agree to a few bf16 roundings, not bit
// for bit. Losses over 20 bf16 steps: 1e-2 relative (the same bound as GPU vs CPU in
// test_train_cuda.cpp, where the CPU is fp32). One fp32 step: see one_step_matches_one_gpu;
// gradients as max |difference| / max |one-GPU gradient| per tensor (a wrong shard, a missing
// or doubled reduction is off by O(1)).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "layout_testing.h"
#include "moefold/comm/nccl.h"
#include "moefold/core/device.h"
#include "moefold/train/run.h"
#include "moefold/train/trainer.h"
#include "mpi_testing.h"
#include "testing.h"
#include "train_fixture.h"

namespace moefold {
namespace {

using testing::find_param;
using testing::Layout;
using testing::layout_name;
using testing::LayoutRun;
using testing::metric_losses;
using testing::with_layout;

// Every layout of two ranks: DP, TP (+ SP), CP, EP, ETP, attention TP with experts over EP, and two
// pipeline stages (1F1B; the stages' activations and gradients over NCCL).
std::vector<Layout> layouts() {
  return {{1, 1, 1, 1}, {2, 1, 1, 1}, {1, 2, 1, 1}, {1, 1, 2, 1}, {1, 1, 1, 2}, {2, 1, 2, 1}, {1, 1, 1, 1, 2}};
}

std::vector<float> to_host(const Tensor& t) {
  EXPECT_EQ(t.dtype(), DType::f32);
  std::vector<float> v(static_cast<size_t>(t.numel()));
  device_copy(v.data(), Device::cpu, t.data(), t.device(), v.size() * sizeof(float));
  return v;
}

// max |a_i - b[p.global_index(i)]| / max |b| over the local elements of shard `a` of p.
double rel_err(const Param& p, const std::vector<float>& a, const std::vector<float>& b_full) {
  double diff = 0, scale = 0;
  for (float y : b_full) scale = std::max(scale, std::abs(static_cast<double>(y)));
  for (size_t i = 0; i < a.size(); ++i)
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) -
                                   b_full[static_cast<size_t>(p.global_index(static_cast<int64_t>(i)))]));
  return diff / std::max(scale, 1e-30);
}

class CudaLayouts : public ::testing::Test {
 protected:
  void SetUp() override {
    Communicator& w = testing::test_world();
    // Every rank must agree to skip (a lone skipper would leave the others in a collective).
    int64_t gpus = cuda_device_count(), fewest = gpus;
    w.all_reduce(Tensor(&gpus, DType::i64, {1}), ReduceOp::max);
    fewest = -fewest;
    w.all_reduce(Tensor(&fewest, DType::i64, {1}), ReduceOp::max);
    if (-fewest < 1 || gpus < w.size() || w.size() != 2)
      GTEST_SKIP() << "needs 2 ranks with one GPU each (" << gpus << " GPUs, " << w.size() << " ranks)";
    nccl_ = make_nccl_world(&w, testing::kMpiTestTimeoutS);
    dir_ = std::make_unique<testing::TempDir>(cat("cuda_layouts_rank", w.rank()));
    // As test_train_layouts.cpp: 4 sequences per step, heads and experts divisible by 2; widths
    // whose halves stay multiples of 8 bf16 elements (16-byte aligned GEMM operands).
    base_ = testing::small_train_config(
        testing::make_train_data(dir_->path()),
        {"train.micro_batch_size=1", "moe.router_aux_loss_coef=0.05", "model.num_attention_heads=8",
         "model.num_key_value_heads=4", "model.head_dim=8", "moe.num_experts=8", "moe.moe_intermediate_size=16"});
    deepseek_ = testing::small_train_config(base_.data.path, {"train.micro_batch_size=1",
                                                              "model.architecture=deepseek_v3",
                                                              "model.num_attention_heads=8",
                                                              "model.num_key_value_heads=8",
                                                              "model.head_dim=8",
                                                              "model.qk_rope_head_dim=8",
                                                              "model.qk_nope_head_dim=8",
                                                              "model.v_head_dim=16",
                                                              "model.kv_lora_rank=16",
                                                              "model.q_lora_rank=12",
                                                              "model.rope_interleave=true",
                                                              "model.rope_type=yarn",
                                                              "model.rope_factor=2",
                                                              "model.rope_original_max_position_embeddings=8",
                                                              "model.rope_mscale=1",
                                                              "model.rope_mscale_all_dim=1",
                                                              "model.first_k_dense_replace=1",
                                                              "model.intermediate_size=48",
                                                              "moe.n_shared_experts=1",
                                                              "moe.num_experts=8",
                                                              "moe.scoring_func=sigmoid",
                                                              "moe.moe_intermediate_size=16",
                                                              "moe.n_group=4",
                                                              "moe.topk_group=2",
                                                              "moe.expert_bias=true",
                                                              "moe.expert_bias_update_rate=0.01",
                                                              "moe.seq_aux_loss_coef=0.05",
                                                              "moe.router_aux_loss_coef=0",
                                                              "moe.routed_scaling_factor=2.5"});
  }
  std::unique_ptr<Communicator> nccl_;
  std::unique_ptr<testing::TempDir> dir_;
  Config base_, deepseek_;
};

// One step in fp32 on the GPUs (the layouts' arithmetic, without bf16's rounding: a bf16 run
// can flip a near-tied top-k choice of one token between layouts, which moves one token's share
// of its experts' and router's gradients, ~10% of their largest element in models this small).
// fp32 GEMMs (no TF32) and reductions in another order agree to ~1e-6; bound 1e-4.
void one_step_matches_one_gpu(const Config& cfg, Communicator& world) {
  std::unique_ptr<Communicator> self = make_self_communicator();
  LayoutRun ref(cfg, *self, Device::cuda, DType::f32);
  ref.trainer->accumulate_gradients();
  const StepMetrics want = ref.trainer->metrics();
  double worst_grad = 0, worst_loss = 0;
  for (const Layout& l : layouts()) {
    SCOPED_TRACE(layout_name(l, world.size(), "GPUs"));
    LayoutRun run(with_layout(cfg, l), world, Device::cuda, DType::f32);
    for (Param& p : run.trainer->params()) {  // the same initial values, whatever the sharding
      const Param& r = find_param(ref.trainer->params(), p.name);
      ASSERT_EQ(p.global_shape(), r.value.shape()) << p.name;
      EXPECT_EQ(rel_err(p, to_host(p.value), to_host(r.value)), 0.0) << p.name;
    }
    run.trainer->accumulate_gradients();
    const StepMetrics& got = run.trainer->metrics();
    EXPECT_NEAR(got.lm_loss, want.lm_loss, 1e-5 * want.lm_loss);
    EXPECT_NEAR(got.aux_loss, want.aux_loss, 1e-5 * want.aux_loss);
    EXPECT_NEAR(got.mtp_loss, want.mtp_loss, 1e-5 * want.mtp_loss);
    EXPECT_NEAR(got.grad_norm, want.grad_norm, 1e-4 * want.grad_norm);
    EXPECT_EQ(got.expert_load_max, want.expert_load_max);
    worst_loss = std::max(worst_loss, std::abs(got.loss - want.loss) / want.loss);
    for (Param& p : run.trainer->params()) {
      const double e = rel_err(p, to_host(p.grad), to_host(find_param(ref.trainer->params(), p.name).grad));
      worst_grad = std::max(worst_grad, e);
      EXPECT_LE(e, 1e-4) << p.name;
    }
    if (world.rank() == 0) std::printf("verified one fp32 step, %s\n", layout_name(l, world.size(), "GPUs").c_str());
  }
  if (world.rank() == 0)
    std::printf("fp32 one step: largest relative loss error %.3g, largest relative gradient error %.3g\n", worst_loss,
                worst_grad);
}

TEST_F(CudaLayouts, OneStepLossAndEveryGradientMatchOneGpu) { one_step_matches_one_gpu(base_, *nccl_); }
TEST_F(CudaLayouts, DeepSeekV3OneStepLossAndEveryGradientMatchOneGpu) { one_step_matches_one_gpu(deepseek_, *nccl_); }

void twenty_steps_match_one_gpu(Config cfg, Communicator& world) {
  cfg.train.steps = 20;
  std::unique_ptr<Communicator> self = make_self_communicator();
  LayoutRun ref(cfg, *self, Device::cuda);
  std::vector<double> want;
  for (int i = 0; i < 20; ++i) want.push_back(ref.trainer->train_step().loss);
  const double eval_want = ref.trainer->evaluate();
  double worst = 0;
  for (const Layout& l : layouts()) {
    SCOPED_TRACE(layout_name(l, world.size(), "GPUs"));
    LayoutRun run(with_layout(cfg, l), world, Device::cuda);
    for (int i = 0; i < 20; ++i) {
      const double got = run.trainer->train_step().loss;
      worst = std::max(worst, std::abs(got - want[i]) / want[i]);
      EXPECT_NEAR(got, want[i], 1e-2 * want[i]) << "step " << i + 1;
    }
    EXPECT_NEAR(run.trainer->evaluate(), eval_want, 1e-2 * eval_want);
    if (world.rank() == 0) std::printf("verified 20 steps, %s\n", layout_name(l, world.size(), "GPUs").c_str());
  }
  if (world.rank() == 0) std::printf("largest relative loss error over 20 steps: %.3g\n", worst);
}

TEST_F(CudaLayouts, TwentyStepLossCurveMatchesOneGpu) { twenty_steps_match_one_gpu(base_, *nccl_); }
TEST_F(CudaLayouts, DeepSeekV3TwentyStepLossCurveMatchesOneGpu) { twenty_steps_match_one_gpu(deepseek_, *nccl_); }

// train.cuda_graphs = "layers" on two GPUs, where a layer's ranks meet only in NCCL calls on device
// buffers (DP, the distributed optimizer, TP, CP, EP in fixed slots, TP x EP, two pipeline
// stages): five steps and an evaluation give the eager run's bits (two ranks: every reduction is
// one addition, the same in either order), with graphs replayed and nothing refused.
void layer_graphs_change_nothing(Config cfg, Communicator& world) {
  cfg.moe.dispatcher = "slots";
  struct Case {
    Layout layout;
    bool sharded;
  };
  const Case cases[] = {{{1, 1, 1, 1}, false}, {{1, 1, 1, 1}, true},  {{2, 1, 1, 1}, false},   {{1, 2, 1, 1}, false},
                        {{1, 1, 2, 1}, false}, {{2, 1, 2, 1}, false}, {{1, 1, 1, 1, 2}, false}};
  for (const Case& c : cases) {
    Config lc = with_layout(cfg, c.layout);
    lc.parallel.distributed_optimizer = c.sharded;
    SCOPED_TRACE(cat(layout_name(c.layout, world.size(), "GPUs"), c.sharded ? ", distributed optimizer" : ""));
    std::vector<double> runs[2];
    for (int g = 0; g < 2; ++g) {
      lc.train.cuda_graphs = g == 0 ? "none" : "layers";
      LayoutRun run(lc, world, Device::cuda);
      for (int i = 0; i < 5; ++i) {
        const StepMetrics& m = run.trainer->train_step();
        runs[g].insert(runs[g].end(), {m.loss, m.lm_loss, m.aux_loss, m.grad_norm});
      }
      runs[g].push_back(run.trainer->evaluate());
      if (g == 1) {
        EXPECT_EQ(run.trainer->cuda_graphs_note(), "");
        EXPECT_GT(run.trainer->cuda_graph_replays(), 0) << "nothing replayed";
      }
    }
    EXPECT_EQ(runs[0], runs[1]) << "losses, gradient norms and an evaluation, eager and from graphs";
    if (world.rank() == 0)
      std::printf("verified layer graphs, %s\n", layout_name(c.layout, world.size(), "GPUs").c_str());
  }
}

TEST_F(CudaLayouts, LayerGraphsChangeNothing) { layer_graphs_change_nothing(base_, *nccl_); }
TEST_F(CudaLayouts, DeepSeekV3LayerGraphsChangeNothing) { layer_graphs_change_nothing(deepseek_, *nccl_); }

// Saved under TP = EP = 2 (sharded weights gathered through the host for the checkpoint),
// resumed under DP = 2: the resumed steps follow the uninterrupted run.
TEST_F(CudaLayouts, CheckpointSavedUnderTpEpResumesUnderDp) {
  namespace fs = std::filesystem;
  Communicator& world = *nccl_;
  int64_t id = ::getpid();
  world.broadcast(Tensor(&id, DType::i64, {1}), 0);
  const fs::path dir = fs::temp_directory_path() / cat("moefold_cuda_reshard_", id);
  if (world.rank() == 0) fs::remove_all(dir);
  world.barrier();
  Config cfg = base_;
  cfg.train.steps = 8;
  cfg.train.checkpoint_interval = 4;
  cfg.train.eval_interval = 0;
  cfg.parallel.tp = 2;
  cfg.parallel.ep = 2;
  RunOptions opts{(dir / "full").string(), 8, false, true};
  opts.device = Device::cuda;
  run_training(cfg, opts, world);
  world.barrier();  // rank 0 writes the metrics after the last step: read them once it is done
  const std::vector<double> want = metric_losses(dir / "full");
  ASSERT_EQ(want.size(), 8u);
  if (world.rank() == 0) {
    fs::create_directories(dir / "dp" / "checkpoints");
    fs::copy(dir / "full" / "checkpoints" / "step_00000004", dir / "dp" / "checkpoints" / "step_00000004",
             fs::copy_options::recursive);
  }
  world.barrier();
  Config c = cfg;
  c.parallel.tp = 1;
  c.parallel.ep = 1;
  RunOptions resume{(dir / "dp").string(), 8, true, true};
  resume.device = Device::cuda;
  EXPECT_EQ(run_training(c, resume, world), 8);
  world.barrier();
  const std::vector<double> got = metric_losses(dir / "dp");  // steps 5..8 (the metrics were not copied)
  ASSERT_EQ(got.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_NEAR(got[i], want[i + 4], 1e-2 * want[i + 4]) << "step " << i + 5;
  world.barrier();
  if (world.rank() == 0) fs::remove_all(dir);
}

}  // namespace
}  // namespace moefold

// The model trained on the GPU (bf16 compute, f32 master weights and optimizer state) against the
// same model on the CPU (f32): from the same initial weights and the same batches, the first 20
// losses agree within bf16 tolerance, and a checkpoint written from the GPU resumes on the CPU.
// Skipped without a GPU. Tolerance: bf16 activations carry a relative rounding of 2^-9 per
// stored value; through 2-3 layers and the softmax the loss moves by about 1e-3 relative at
// step 1, and 20 steps of AdamW on a tiny model keep the curves within a few 1e-3 (2e-2 bound,
// far below the loss's own fall over 20 steps).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "cuda_testing.h"
#include "moefold/core/device.h"
#include "moefold/train/trainer.h"
#include "recompute_check.h"
#include "sharding_check.h"
#include "testing.h"
#include "train_fixture.h"

namespace moefold {
namespace {

namespace fs = std::filesystem;

using testing::OneRank;

void expect_gpu_curve_matches_cpu(const std::vector<std::string>& extra) {
  testing::TempDir dir("train_cuda");
  const Config cfg = testing::small_train_config(testing::make_train_data(dir.path()), extra);
  const TokenDataset data = open_token_dataset(cfg.data.path);
  OneRank a(cfg), b(cfg);
  Trainer cpu(cfg, data, a.mesh, Device::cpu), gpu(cfg, data, b.mesh, Device::cuda);
  cpu.init_fresh();
  gpu.init_fresh();
  double worst = 0, first = 0, last = 0;
  for (int i = 0; i < 20; ++i) {
    const double want = cpu.train_step().loss, got = gpu.train_step().loss;
    ASSERT_TRUE(std::isfinite(got)) << "step " << i + 1;
    worst = std::max(worst, std::abs(got - want) / want);
    EXPECT_NEAR(got, want, 2e-2 * want) << "step " << i + 1;
    if (i == 0) first = got;
    last = got;
  }
  EXPECT_LT(last, first) << "the GPU run does not learn";
  std::printf("largest relative loss difference GPU (bf16) vs CPU (f32) over 20 steps: %.3g\n", worst);
  EXPECT_NEAR(gpu.evaluate(), cpu.evaluate(), 2e-2 * cpu.evaluate());
  // A GPU checkpoint resumes on the CPU: the next step's loss is the GPU's next one within tolerance.
  const std::string ckpt = gpu.save((dir.path() / "ckpt").string());
  Trainer resumed(cfg, data, a.mesh, Device::cpu);
  resumed.load(ckpt);
  EXPECT_EQ(resumed.step(), 20);
  const double on_cpu = resumed.train_step().loss, on_gpu = gpu.train_step().loss;
  EXPECT_NEAR(on_cpu, on_gpu, 2e-2 * on_gpu);
}

const std::vector<std::string> kDeepSeek = {"model.architecture=deepseek_v3",
                                            "model.num_attention_heads=4",
                                            "model.num_key_value_heads=4",
                                            "model.head_dim=4",
                                            "model.qk_rope_head_dim=4",
                                            "model.qk_nope_head_dim=4",
                                            "model.v_head_dim=8",
                                            "model.kv_lora_rank=8",
                                            "model.q_lora_rank=8",
                                            "model.rope_interleave=true",
                                            "model.first_k_dense_replace=1",
                                            "model.intermediate_size=32",
                                            "moe.n_shared_experts=1",
                                            "moe.scoring_func=sigmoid",
                                            "moe.n_group=2",
                                            "moe.topk_group=1",
                                            "moe.expert_bias=true",
                                            "moe.seq_aux_loss_coef=0.01",
                                            "model.num_nextn_predict_layers=1"};

TEST(TrainCuda, Qwen3MoeCurveMatchesCpu) {
  MF_REQUIRE_GPU();
  expect_gpu_curve_matches_cpu({});
}

TEST(TrainCuda, DeepSeekV3CurveMatchesCpu) {
  MF_REQUIRE_GPU();
  expect_gpu_curve_matches_cpu(kDeepSeek);
}

std::vector<float> to_host(const Tensor& t) {
  EXPECT_EQ(t.dtype(), DType::f32);
  std::vector<float> v(static_cast<size_t>(t.numel()));
  device_copy(v.data(), Device::cpu, t.data(), t.device(), v.size() * sizeof(float));
  return v;
}

// The GPU computing in fp32 (Trainer's `compute` dtype: cuBLASLt in fp32 without TF32, the own
// attention kernel in fp32) against the CPU: one step's losses and every gradient. Without bf16's
// roundings the two differ only in the order of fp32 sums (~1e-6 relative); bound 1e-4 of each
// tensor's largest gradient (a wrong kernel is off by O(1)). The multi-GPU layout test
// (tests/mpi/test_train_layouts_cuda.cpp) compares its layouts against this fp32 GPU path.
void expect_gpu_fp32_step_matches_cpu(const std::vector<std::string>& extra) {
  testing::TempDir dir("train_cuda_fp32");
  const Config cfg = testing::small_train_config(testing::make_train_data(dir.path()), extra);
  const TokenDataset data = open_token_dataset(cfg.data.path);
  OneRank a(cfg), b(cfg);
  Trainer cpu(cfg, data, a.mesh, Device::cpu), gpu(cfg, data, b.mesh, Device::cuda, DType::f32);
  cpu.init_fresh();
  gpu.init_fresh();
  cpu.accumulate_gradients();
  gpu.accumulate_gradients();
  const StepMetrics &want = cpu.metrics(), &got = gpu.metrics();
  EXPECT_NEAR(got.lm_loss, want.lm_loss, 1e-5 * want.lm_loss);
  EXPECT_NEAR(got.aux_loss, want.aux_loss, 1e-5 * std::abs(want.aux_loss) + 1e-12);
  EXPECT_NEAR(got.mtp_loss, want.mtp_loss, 1e-5 * std::abs(want.mtp_loss) + 1e-12);
  EXPECT_NEAR(got.grad_norm, want.grad_norm, 1e-4 * want.grad_norm);
  EXPECT_EQ(got.expert_load_max, want.expert_load_max);
  ASSERT_EQ(gpu.params().size(), cpu.params().size());
  double worst = 0;
  for (size_t i = 0; i < gpu.params().size(); ++i) {
    const Param &g = gpu.params()[i], &c = cpu.params()[i];
    ASSERT_EQ(g.name, c.name);
    const std::vector<float> x = to_host(g.grad), y = to_host(c.grad);
    ASSERT_EQ(x.size(), y.size()) << g.name;
    double diff = 0, scale = 0;
    for (size_t j = 0; j < x.size(); ++j) {
      diff = std::max(diff, std::abs(static_cast<double>(x[j]) - y[j]));
      scale = std::max(scale, std::abs(static_cast<double>(y[j])));
    }
    const double e = diff / std::max(scale, 1e-30);
    worst = std::max(worst, e);
    EXPECT_LE(e, 1e-4) << g.name;
  }
  std::printf("fp32 one step GPU vs CPU: largest relative gradient error %.3g\n", worst);
}

TEST(TrainCuda, Qwen3MoeFp32StepMatchesCpu) {
  MF_REQUIRE_GPU();
  expect_gpu_fp32_step_matches_cpu({});
}

TEST(TrainCuda, DeepSeekV3Fp32StepMatchesCpu) {
  MF_REQUIRE_GPU();
  expect_gpu_fp32_step_matches_cpu(kDeepSeek);
}

// The distributed optimizer on one GPU (bf16 compute copies written by the sharded update, f32
// master shards): bit-identical to the unsharded run (sharding_check.h).
TEST(TrainCuda, DistributedOptimizerOnOneGpuChangesNothing) {
  MF_REQUIRE_GPU();
  testing::expect_one_rank_sharding_changes_nothing(Device::cuda, {});
  testing::expect_one_rank_sharding_changes_nothing(Device::cuda, kDeepSeek);
  // bf16 gradients: the sharded masters stage through host memory (Memory::master_staging).
  testing::expect_one_rank_sharding_changes_nothing(Device::cuda, {"train.main_grads_dtype=bf16"});
  testing::expect_one_rank_sharding_changes_nothing(
      Device::cuda, {"train.main_grads_dtype=bf16", "train.exp_avg_dtype=bf16", "train.exp_avg_sq_dtype=bf16"});
}

// An asynchronous checkpoint of a GPU run (the state copied into pinned host memory, written by a
// background thread while two more steps train) holds the bytes of a synchronous one: plain, and
// with the distributed optimizer's bf16 moments gathered through host memory.
TEST(TrainCuda, AsyncCheckpointEqualsSyncWhileTrainingGoesOn) {
  MF_REQUIRE_GPU();
  testing::TempDir dir("train_cuda_async");
  const std::string path = testing::make_train_data(dir.path());
  const TokenDataset data = open_token_dataset(path);
  const std::vector<std::string> sharded = {"parallel.distributed_optimizer=true", "train.exp_avg_dtype=bf16",
                                            "train.exp_avg_sq_dtype=bf16"};
  for (const std::vector<std::string>& extra : {std::vector<std::string>{}, sharded, kDeepSeek}) {
    SCOPED_TRACE(extra.empty() ? "plain" : extra[0]);
    const Config cfg = testing::small_train_config(path, extra);
    OneRank r(cfg);
    Trainer gpu(cfg, data, r.mesh, Device::cuda);
    gpu.init_fresh();
    for (int i = 0; i < 3; ++i) gpu.train_step();
    const fs::path sync = gpu.save((dir.path() / "sync" / std::to_string(extra.size())).string());
    CheckpointWriter writer((dir.path() / "async" / std::to_string(extra.size())).string(), r.mesh,
                            {true, 0, Device::cuda});
    const fs::path async = gpu.save(writer);
    EXPECT_TRUE(writer.in_flight());
    gpu.train_step();
    gpu.train_step();
    EXPECT_EQ(writer.finish(true), 3);
    for (const char* f : {"model.safetensors", "optimizer.safetensors", "trainer.json"})
      EXPECT_TRUE(testing::read_bytes((sync / f).string()) == testing::read_bytes((async / f).string())) << f;
  }
}

// recompute_check.h's variants on one GPU, for the default family and DeepSeek-V3's layers with
// `layers` decoder layers: each gives the bits of the run that keeps everything.
void expect_gpu_variants_change_nothing(int layers, const std::vector<testing::RecomputeVariant>& variants) {
  testing::TempDir dir("train_cuda_variants");
  const std::string path = testing::make_train_data(dir.path());
  const TokenDataset data = open_token_dataset(path);
  for (std::vector<std::string> extra : {std::vector<std::string>{}, kDeepSeek}) {
    SCOPED_TRACE(extra.empty() ? "qwen3_moe" : "deepseek_v3");
    extra.push_back(cat("model.num_hidden_layers=", layers));
    std::vector<std::unique_ptr<OneRank>> ranks;
    testing::expect_recompute_changes_nothing(
        testing::small_train_config(path, extra),
        [&](const Config& c) {
          ranks.push_back(std::make_unique<OneRank>(c));
          auto t = std::make_unique<Trainer>(c, data, ranks.back()->mesh, Device::cuda);
          t->init_fresh();
          return t;
        },
        variants);
  }
}

// Recomputation on one GPU (bf16 compute, deterministic kernels: the default): every variant, three
// layers (uniform chunks of 2 end with a chunk of one).
TEST(TrainCuda, RecomputeChangesNothing) {
  MF_REQUIRE_GPU();
  expect_gpu_variants_change_nothing(3, testing::recompute_variants());
}

// Activation offload on one GPU: each module's kept input through pinned host memory and back, over
// five layers (the three offload slots wrap around).
TEST(TrainCuda, ActivationOffloadChangesNothing) {
  MF_REQUIRE_GPU();
  expect_gpu_variants_change_nothing(5, testing::offload_variants());
}

// train.main_grads_dtype = bf16: the expert and tensor-parallel gradients in bf16 (the replicated
// ones f32); 8 steps stay within 2% of the f32-gradient run's losses (the accumulation rounds),
// and a checkpoint of it (bf16 moments too: the state passes through the bf16 gradient blocks)
// resumes with the uninterrupted run's next losses bit for bit.
TEST(TrainCuda, Bf16MainGradsTrainAndResume) {
  MF_REQUIRE_GPU();
  testing::TempDir dir("train_cuda_bf16_grads");
  const std::string path = testing::make_train_data(dir.path());
  const TokenDataset data = open_token_dataset(path);
  const Config f32 = testing::small_train_config(path, {"train.exp_avg_dtype=bf16", "train.exp_avg_sq_dtype=bf16"});
  Config bf = f32;
  bf.train.main_grads_dtype = "bf16";
  OneRank ra(f32), rb(bf), rc(bf);
  Trainer a(f32, data, ra.mesh, Device::cuda), b(bf, data, rb.mesh, Device::cuda);
  a.init_fresh();
  b.init_fresh();
  EXPECT_EQ(b.memory().grad_dtype(ParamGroup::expert), DType::bf16);
  EXPECT_EQ(b.memory().grad_dtype(ParamGroup::tensor_parallel), DType::bf16);
  EXPECT_EQ(b.memory().grad_dtype(ParamGroup::dense), DType::f32);
  EXPECT_LT(b.memory().grad_bytes(), a.memory().grad_bytes());
  for (int i = 0; i < 8; ++i) {
    const double want = a.train_step().loss, got = b.train_step().loss;
    EXPECT_NEAR(got, want, 0.02 * want) << "step " << i + 1;
  }
  const std::string ckpt = b.save((dir.path() / "ckpt").string());
  Trainer c(bf, data, rc.mesh, Device::cuda);
  c.load(ckpt);
  for (int i = 0; i < 2; ++i) EXPECT_EQ(c.train_step().loss, b.train_step().loss) << "resumed, step " << i + 1;
}

// train.fp8_param on one GPU: the FP8 linears' weights have no bf16 copies (compute_bytes shrink by
// 2 bytes per element of them); their FP8 copies, quantized from the f32 masters rounded to bf16,
// hold the codes the bf16 copies would give, so 3 steps give the plain FP8 run's losses, gradient
// norms and master weights bit for bit (both families, every kind of FP8 linear: widths multiples
// of 16), and a checkpoint of it resumes with the uninterrupted run's next losses. The same with
// the distributed optimizer (one rank, bf16 main gradients: the masters staged on the host): the
// FP8-only weights' codes are quantized from the optimizer's slots on the GPU (fp8_block_amax, ...)
// and gathered, the compute block shrinks by their 2 bytes an element (up to a bucket's rounding),
// the same losses (the gradient norm within 1e-6: the FP8-only buckets move the slot boundaries).
TEST(TrainCuda, Fp8ParamChangesNothing) {
  MF_REQUIRE_GPU();
  testing::TempDir dir("train_cuda_fp8_param");
  const std::string path = testing::make_train_data(dir.path());
  const TokenDataset data = open_token_dataset(path);
  const std::vector<std::string> widths = {"model.hidden_size=32",         "model.num_attention_heads=2",
                                           "model.num_key_value_heads=2",  "model.head_dim=16",
                                           "moe.moe_intermediate_size=16", "train.fp8=blockwise"};
  std::vector<std::string> deepseek = kDeepSeek;
  deepseek.insert(deepseek.end(), {"model.num_attention_heads=2", "model.num_key_value_heads=2",
                                   "model.qk_rope_head_dim=16", "model.head_dim=16", "model.qk_nope_head_dim=16",
                                   "model.v_head_dim=16", "model.kv_lora_rank=16", "model.q_lora_rank=16"});
  for (const bool sharded : {false, true})
    for (const std::vector<std::string>& family : {std::vector<std::string>{}, deepseek}) {
      SCOPED_TRACE(cat(family.empty() ? "qwen3_moe" : "deepseek_v3", sharded ? ", distributed optimizer" : ""));
      std::vector<std::string> extra = widths;
      extra.insert(extra.end(), family.begin(), family.end());
      extra.push_back("moe.fp8_dispatch=true");
      if (sharded) extra.insert(extra.end(), {"parallel.distributed_optimizer=true", "train.main_grads_dtype=bf16"});
      const Config plain = testing::small_train_config(path, extra);
      Config only = plain;
      only.train.fp8_param = true;
      OneRank ra(plain), rb(only), rc(only);
      Trainer a(plain, data, ra.mesh, Device::cuda), b(only, data, rb.mesh, Device::cuda);
      a.init_fresh();
      b.init_fresh();
      size_t fp8_elems = 0, slack = 0;
      for (const Param& p : b.params())
        if (p.fp8.defined()) {
          fp8_elems += static_cast<size_t>(p.value.numel());
          EXPECT_FALSE(p.has_compute_copy()) << p.name;
          EXPECT_EQ(p.fp8_gathered, sharded) << p.name;
        }
      for (int g = 0; g < kNumParamGroups && sharded; ++g)
        for (const GradBucket& bk : b.memory().grad_buckets(static_cast<ParamGroup>(g)))
          if (bk.fp8) slack += 2 * 64 + 128;  // the compute block's rounding, the codes' and scales' alignment
      EXPECT_GT(fp8_elems, 0u);
      EXPECT_GE(a.memory().compute_bytes() + slack, b.memory().compute_bytes() + 2 * fp8_elems);
      EXPECT_NEAR(static_cast<double>(a.memory().fp8_bytes()), static_cast<double>(b.memory().fp8_bytes()),
                  static_cast<double>(slack));
      for (int i = 0; i < 3; ++i) {
        const StepMetrics ma = a.train_step(), mb = b.train_step();
        EXPECT_EQ(mb.loss, ma.loss) << "step " << i + 1;
        if (sharded)
          EXPECT_NEAR(mb.grad_norm, ma.grad_norm, 1e-6 * ma.grad_norm) << "step " << i + 1;
        else
          EXPECT_EQ(mb.grad_norm, ma.grad_norm) << "step " << i + 1;
      }
      if (sharded) {  // Param::value: the whole masters until the next step
        a.gather_master_weights();
        b.gather_master_weights();
      }
      for (const Param& p : b.params()) {
        const Param* r = a.memory().find(p.name);
        ASSERT_NE(r, nullptr) << p.name;
        EXPECT_TRUE(testing::value_bytes(p.value) == testing::value_bytes(r->value)) << p.name;
      }
      const std::string ckpt =
          b.save((dir.path() / cat(family.empty() ? "q" : "d", sharded ? "_sharded" : "")).string());
      Trainer c(only, data, rc.mesh, Device::cuda);
      c.load(ckpt);
      for (int i = 0; i < 2; ++i) EXPECT_EQ(c.train_step().loss, b.train_step().loss) << "resumed, step " << i + 1;
    }
}

// Optimizer offload (train.optimizer_offload_fraction) with the distributed optimizer on one GPU:
// the host update gives the kernel's bits, so with 40% and with all of the state offloaded the
// losses and master weights equal the run that keeps it on the GPU, bit for bit (f32 and bf16
// moments, f32 and bf16 gradients: those stage to the host as bf16); a checkpoint of the offloaded
// run resumes with and without offload with the uninterrupted run's next losses. The same with
// FP8-only weights (train.fp8_param, f32 and bf16 gradients): their offloaded slots' new bf16
// values land in their gradients' bytes and the GPU quantizes the codes from them.
TEST(TrainCuda, OptimizerOffloadChangesNothing) {
  MF_REQUIRE_GPU();
  testing::TempDir dir("train_cuda_offload");
  const std::string path = testing::make_train_data(dir.path());
  const TokenDataset data = open_token_dataset(path);
  const std::vector<std::string> fp8 = {"model.hidden_size=32",         "model.num_attention_heads=2",
                                        "model.num_key_value_heads=2",  "model.head_dim=16",
                                        "moe.moe_intermediate_size=16", "train.fp8=blockwise",
                                        "moe.fp8_dispatch=true",        "train.fp8_param=true"};
  struct Case {
    const char *moments, *grads;
    bool fp8;
  };
  for (const auto& [moments, grads, fp8_only] :
       {Case{"f32", "f32", false}, Case{"bf16", "f32", false}, Case{"f32", "bf16", false}, Case{"bf16", "bf16", false},
        Case{"f32", "f32", true}, Case{"bf16", "bf16", true}}) {
    SCOPED_TRACE(cat("moments ", moments, ", gradients ", grads, fp8_only ? ", FP8-only weights" : ""));
    std::vector<std::string> extra = {"parallel.distributed_optimizer=true", cat("train.exp_avg_dtype=", moments),
                                      cat("train.exp_avg_sq_dtype=", moments), cat("train.main_grads_dtype=", grads)};
    if (fp8_only) extra.insert(extra.end(), fp8.begin(), fp8.end());
    const Config base = testing::small_train_config(path, extra);
    std::vector<std::unique_ptr<OneRank>> ranks;
    auto make = [&](double fraction) {
      Config c = base;
      c.train.optimizer_offload_fraction = fraction;
      ranks.push_back(std::make_unique<OneRank>(c));
      return std::make_unique<Trainer>(c, data, ranks.back()->mesh, Device::cuda);
    };
    std::unique_ptr<Trainer> ref = make(0), part = make(0.4), all = make(1.0);
    for (Trainer* t : {ref.get(), part.get(), all.get()}) t->init_fresh();
    EXPECT_LT(part->optimizer_bytes(), ref->optimizer_bytes());
    for (int i = 0; i < 4; ++i) {
      const double want = ref->train_step().loss;
      EXPECT_EQ(part->train_step().loss, want) << "0.4 offloaded, step " << i + 1;
      EXPECT_EQ(all->train_step().loss, want) << "all offloaded, step " << i + 1;
    }
    for (Trainer* t : {ref.get(), part.get(), all.get()}) t->gather_master_weights();
    for (const Param& p : ref->params())
      for (Trainer* t : {part.get(), all.get()})
        EXPECT_TRUE(testing::value_bytes(t->memory().find(p.name)->value) == testing::value_bytes(p.value)) << p.name;
    const std::string ckpt =
        part->save((dir.path() / cat("ckpt_", moments, "_", grads, fp8_only ? "_fp8" : "")).string());
    std::unique_ptr<Trainer> on = make(0.4), off = make(0);
    on->load(ckpt);
    off->load(ckpt);
    for (int i = 0; i < 2; ++i) {
      const double want = ref->train_step().loss;
      EXPECT_EQ(on->train_step().loss, want) << "resumed offloaded, step " << i + 1;
      EXPECT_EQ(off->train_step().loss, want) << "resumed on the GPU, step " << i + 1;
    }
  }
}

// Requirement of the CUDA backend: no device allocation in the step loop. The first step sizes
// the ops' grow-only scratch (core/device.h, device_scratch); from then on training steps and
// evaluations call device_malloc no more and hold no more device memory.
TEST(TrainCuda, StepLoopAllocatesNoDeviceMemory) {
  MF_REQUIRE_GPU();
  testing::TempDir dir("train_cuda_alloc");
  const Config cfg = testing::small_train_config(testing::make_train_data(dir.path()),
                                                 {"moe.capacity_factor=1.5", "model.num_hidden_layers=3"});
  const TokenDataset data = open_token_dataset(cfg.data.path);
  OneRank a(cfg);
  Trainer gpu(cfg, data, a.mesh, Device::cuda);
  gpu.init_fresh();
  gpu.train_step();
  gpu.evaluate();
  const int64_t mallocs = device_malloc_count();
  const size_t in_use = device_bytes_in_use();
  for (int i = 0; i < 4; ++i) gpu.train_step();
  gpu.evaluate();
  EXPECT_EQ(device_malloc_count(), mallocs);
  EXPECT_EQ(device_bytes_in_use(), in_use);
}

// train.cuda_graphs = "layers" and "step" change nothing: the same losses (router and multi-token
// prediction losses included: they stay on the device until the step's end), gradient norms,
// expert loads, drops and weights, bit for bit, over steps of two micro-batches (the backward's two
// graphs: writing and adding to the gradients), with evaluations between them; something is
// replayed, nothing falls back. Qwen3-like with z-loss; DeepSeek-V3-like (MLA, shared experts,
// sequence aux loss, expert bias) without and with multi-token prediction; padded capacity, and
// capacity without padding (the plan padded to its bound under graphs).
TEST(TrainCuda, CudaGraphsChangeNothing) {
  MF_REQUIRE_GPU();
  testing::TempDir dir("train_cuda_graphs");
  const std::string data = testing::make_train_data(dir.path());
  std::vector<std::string> deepseek = kDeepSeek;
  deepseek.push_back("model.num_nextn_predict_layers=0");
  const std::pair<const char*, std::vector<std::string>> cases[] = {
      {"qwen3-like", {}},
      {"deepseek-v3-like", deepseek},
      {"deepseek-v3-like with multi-token prediction", kDeepSeek},
      {"deepseek-v3-like, shared experts on their own stream",
       [&] {
         std::vector<std::string> v = kDeepSeek;
         v.push_back("moe.shared_expert_overlap=true");
         return v;
       }()},
      // FP8 (the weights quantized before the graphs, Trainer::quantize_fp8_weights_before_graphs):
      // tokens dispatched in FP8, and DeepSeek-V3-like with the weights kept only in FP8.
      {"fp8",
       {"model.hidden_size=32", "model.num_attention_heads=2", "model.num_key_value_heads=2", "model.head_dim=16",
        "train.fp8=blockwise", "moe.fp8_dispatch=true"}},
      {"fp8, deepseek-v3-like, fp8_param",
       [&] {
         std::vector<std::string> v = deepseek;
         v.insert(v.end(),
                  {"model.hidden_size=32", "model.num_attention_heads=2", "model.num_key_value_heads=2",
                   "model.qk_rope_head_dim=16", "model.head_dim=16", "model.qk_nope_head_dim=16", "model.v_head_dim=16",
                   "model.kv_lora_rank=16", "model.q_lora_rank=16", "train.fp8=blockwise", "train.fp8_param=true"});
         return v;
       }()},
      // Recomputed forwards inside the backward's graphs: every module, and whole layers.
      {"deepseek-v3-like, every module recomputed",
       [&] {
         std::vector<std::string> v = kDeepSeek;
         v.push_back(
             "train.recompute_modules=[\"layernorm\", \"core_attn\", \"mla_up_proj\", \"moe_act\", "
             "\"shared_experts\", \"moe\", \"mlp\"]");
         return v;
       }()},
      {"qwen3-like, the first layer recomputed whole", {"train.recompute_num_layers=1"}},
      {"padded capacity", {"moe.capacity_factor=1.25", "moe.pad_to_capacity=true"}},
      {"capacity without padding", {"moe.capacity_factor=0.75"}}};
  for (auto [what, extra] : cases) {
    extra.push_back("moe.moe_intermediate_size=16");  // CUTLASS's grouped GEMMs (widths of 8s): no waits
    SCOPED_TRACE(what);
    std::vector<std::vector<double>> runs;
    std::vector<std::vector<float>> weights;
    for (const char* graphs : {"none", "layers", "step"}) {
      std::vector<std::string> ov = extra;
      ov.push_back(std::string("train.cuda_graphs=") + graphs);
      const Config cfg = testing::small_train_config(data, ov);
      const TokenDataset tokens = open_token_dataset(cfg.data.path);
      OneRank a(cfg);
      Trainer gpu(cfg, tokens, a.mesh, Device::cuda);
      gpu.init_fresh();
      std::vector<double>& got = runs.emplace_back();
      for (int i = 0; i < 6; ++i) {
        const StepMetrics& m = gpu.train_step();
        got.insert(got.end(), {m.loss, m.lm_loss, m.aux_loss, m.z_loss, m.mtp_loss, m.grad_norm});
        got.insert(got.end(), m.expert_load_dropped_fraction.begin(), m.expert_load_dropped_fraction.end());
        const Tensor& loads = gpu.expert_loads();
        got.insert(got.end(), loads.ptr<double>(), loads.ptr<double>() + loads.numel());
        if (i == 2) got.push_back(gpu.evaluate());
      }
      EXPECT_EQ(gpu.cuda_graphs_note(), "") << graphs;
      if (std::string(graphs) != "none") {
        EXPECT_GT(gpu.cuda_graph_replays(), 0) << graphs << ": nothing replayed";
      }
      std::vector<float>& w = weights.emplace_back();
      for (const Param& p : gpu.memory().params())
        if (p.value.dtype() == DType::f32) {
          const std::vector<float> v = to_host(p.value);
          w.insert(w.end(), v.begin(), v.end());
        }
    }
    for (size_t k = 1; k < runs.size(); ++k) {
      EXPECT_EQ(runs[0], runs[k]) << "losses, router losses, gradient norms, expert loads, drops and an evaluation, "
                                     "without graphs and with "
                                  << (k == 1 ? "layers" : "step");
      EXPECT_TRUE(weights[0] == weights[k]) << "the weights after 6 steps, " << (k == 1 ? "layers" : "step");
    }
  }
}

// Where a feature prevents capture, the run says why and trains as without graphs.
TEST(TrainCuda, CudaGraphsSayWhyTheyAreNotUsed) {
  MF_REQUIRE_GPU();
  testing::TempDir dir("train_cuda_graphs_refused");
  const std::string data = testing::make_train_data(dir.path());
  const std::pair<std::vector<std::string>, const char*> cases[] = {
      {{"train.cuda_graphs=layers", "train.offload_modules=[\"moe_act\"]"},
       "train.offload_modules (copies between the layers)"},
      {{"train.cuda_graphs=step", "parallel.overlap_moe_a2a=true"},
       "parallel.overlap_moe_a2a (two micro-batches interleaved)"}};
  for (const auto& [ov, why] : cases) {
    SCOPED_TRACE(ov.front());
    const Config cfg = testing::small_train_config(data, ov);
    const TokenDataset tokens = open_token_dataset(cfg.data.path);
    OneRank a(cfg);
    Trainer gpu(cfg, tokens, a.mesh, Device::cuda);
    gpu.init_fresh();
    EXPECT_TRUE(std::isfinite(gpu.train_step().loss));
    EXPECT_EQ(gpu.cuda_graphs_note(), cat("train.cuda_graphs = \"", cfg.train.cuda_graphs, "\" not used: ", why));
    EXPECT_EQ(gpu.cuda_graph_replays(), 0);
  }
}

}  // namespace
}  // namespace moefold

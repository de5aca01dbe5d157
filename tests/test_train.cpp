// Training: schedule, AdamW against its formula, clipping, a step loop that does not
// allocate, bit-identical resume, and checkpoints that refuse to load when corrupt or mismatched.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <map>
#include <new>
#include <nlohmann/json.hpp>
#include <sstream>
#include <tuple>
#include <vector>

#include "moefold/core/rng.h"
#include "moefold/data/npy.h"
#include "moefold/data/token_dataset.h"
#include "moefold/io/tensorboard.h"
#include "moefold/train/hf_import.h"
#include "moefold/train/pipeline_schedule.h"
#include "moefold/train/run.h"
#include "moefold/train/trainer.h"
#include "recompute_check.h"
#include "sharding_check.h"
#include "testing.h"
#include "train_fixture.h"

// GCC cannot see that these replace the global operators and flags new/free pairs.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
// Counts heap allocations while g_counting is set (the step loop must not allocate).
static std::atomic<bool> g_counting{false};
static std::atomic<int64_t> g_allocs{0};
void* operator new(std::size_t n) {
  if (g_counting.load(std::memory_order_relaxed)) g_allocs.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace moefold {
namespace {

namespace fs = std::filesystem;

using testing::error_of;

using testing::OneRank;

int64_t run_training(const Config& cfg, const RunOptions& opts) {
  auto world = make_self_communicator();
  return moefold::run_training(cfg, opts, *world);
}

std::string make_data(const fs::path& dir) { return testing::make_train_data(dir); }
Config small_config(const std::string& data, std::vector<std::string> extra = {}) {
  return testing::small_train_config(data, std::move(extra));
}

std::vector<nlohmann::json> read_metrics(const fs::path& run) {
  std::vector<nlohmann::json> out;
  std::ifstream f(run / "metrics.jsonl");
  std::string line;
  while (std::getline(f, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

// (pp, vpp, micro-batches) the schedule tests run: 1F1B with fewer, as many and more micro-batches
// than stages (an odd pp too), and interleaved ones.
const std::vector<std::tuple<int64_t, int64_t, int64_t>> kPipelineShapes = {
    {2, 1, 1}, {2, 1, 4}, {4, 1, 2}, {4, 1, 8},  {3, 1, 5}, {2, 2, 2},
    {2, 2, 4}, {4, 2, 4}, {4, 2, 8}, {4, 3, 12}, {3, 2, 6}, {8, 4, 16}};

// Every rank of a pipeline runs its pipeline_actions with the real dependencies (a forward needs
// the previous virtual stage's forward of its micro-batch, a backward the next virtual stage's
// backward), forwards taking 1 / vpp and backwards 2 / vpp time units (a chunk is 1 / vpp of the
// stage): the step must finish (no rank waits forever), every link direction must carry its
// messages in the order the receiver consumes them, and the makespan must be the schedule's:
// (m + pp - 1) x 3 units for 1F1B, (m + (pp - 1) / vpp) x 3 for the interleaved one.
struct PipelineRun {
  double makespan = 0;
  bool fifo = true;
};
PipelineRun simulate_pipeline(int64_t pp, int64_t vpp, int64_t m, bool overlap = false) {
  const int64_t stages = pp * vpp;  // virtual stages
  std::vector<std::vector<PipelineAction>> acts;
  for (int64_t s = 0; s < pp; ++s) acts.push_back(pipeline_actions(pp, vpp, s, m, overlap));
  // done[virtual stage][micro]: finish time of its forward / backward (-1: not yet).
  std::vector<std::vector<double>> fdone(stages, std::vector<double>(m, -1)), bdone = fdone;
  std::vector<size_t> next(pp, 0);
  std::vector<double> clock(pp, 0);
  // Per link direction: the virtual stages' (micro, sender order) as sent, and as consumed.
  std::map<std::pair<int64_t, bool>, std::vector<std::pair<int64_t, int64_t>>> sent, consumed;
  PipelineRun r;
  for (bool progress = true; progress;) {
    progress = false;
    for (int64_t s = 0; s < pp; ++s) {
      if (next[s] == acts[s].size()) continue;
      const PipelineAction& a = acts[s][next[s]];
      const int64_t v = a.chunk * pp + s;
      double ready = clock[s];
      if (a.forward && v > 0) {
        if (fdone[v - 1][a.micro] < 0) continue;
        ready = std::max(ready, fdone[v - 1][a.micro]);
        consumed[{(s + pp - 1) % pp, true}].push_back({v - 1, a.micro});
      }
      if (!a.forward && v + 1 < stages) {
        if (bdone[v + 1][a.micro] < 0) continue;
        ready = std::max(ready, bdone[v + 1][a.micro]);
        consumed[{s, false}].push_back({v + 1, a.micro});
      }
      clock[s] = ready + (a.forward ? 1.0 : 2.0) / static_cast<double>(vpp);
      (a.forward ? fdone : bdone)[v][a.micro] = clock[s];
      if (a.forward && v + 1 < stages) sent[{s, true}].push_back({v, a.micro});
      if (!a.forward && v > 0) sent[{(s + pp - 1) % pp, false}].push_back({v, a.micro});
      ++next[s];
      progress = true;
    }
  }
  for (int64_t s = 0; s < pp; ++s) EXPECT_EQ(next[s], acts[s].size()) << "stage " << s << " waits forever";
  for (const auto& [link, order] : sent) r.fifo = r.fifo && consumed[link] == order;
  r.makespan = *std::max_element(clock.begin(), clock.end());
  return r;
}

TEST(PipelineSchedule, EveryStageFinishesInOrderWithTheTheoreticalBubble) {
  for (const auto& [pp, vpp, m] : kPipelineShapes) {
    SCOPED_TRACE(cat("pp ", pp, ", vpp ", vpp, ", ", m, " micro-batches"));
    for (int64_t s = 0; s < pp; ++s) {  // every (chunk, micro-batch) once each way, forward first
      std::map<std::pair<int64_t, int64_t>, int> seen;
      for (const PipelineAction& a : pipeline_actions(pp, vpp, s, m)) {
        int& n = seen[{a.chunk, a.micro}];
        EXPECT_EQ(n, a.forward ? 0 : 1);
        n += 1;
      }
      EXPECT_EQ(seen.size(), static_cast<size_t>(vpp * m));
      if (vpp == 1) {
        EXPECT_EQ(micro_batches_in_flight(pipeline_actions(pp, 1, s, m), 1), std::vector<int64_t>{std::min(pp - s, m)});
      }
    }
    const PipelineRun r = simulate_pipeline(pp, vpp, m);
    EXPECT_TRUE(r.fifo);
    if (vpp == 1) {  // with overlap (one more warm-up forward): still finishes, in order
      EXPECT_TRUE(simulate_pipeline(pp, 1, m, true).fifo);
    }
    const double want = vpp == 1
                            ? 3.0 * static_cast<double>(m + pp - 1)
                            : 3.0 * (static_cast<double>(m) + static_cast<double>(pp - 1) / static_cast<double>(vpp));
    EXPECT_NEAR(r.makespan, want, 1e-9);
  }
}

// Every rank runs its pipeline_ops with rendezvous messages (a send completes only once its
// receive is posted, a receive once its send is): the step finishes on every rank, and each
// receive gets the (virtual stage, micro-batch) it expects.
TEST(PipelineSchedule, OpsFinishWithRendezvousMessages) {
  using K = PipelineOpKind;
  for (const auto& [pp, vpp, m] : kPipelineShapes) {
    for (const bool overlap : {false, true}) {
      if (overlap && vpp > 1) continue;
      SCOPED_TRACE(cat("pp ", pp, ", vpp ", vpp, ", ", m, " micro-batches", overlap ? ", overlap" : ""));
      std::vector<std::vector<PipelineOp>> ops;
      for (int64_t s = 0; s < pp; ++s) ops.push_back(pipeline_ops(pp, vpp, s, m, overlap));
      // Channels by (activations?, sending stage): what was sent and what each receive expects.
      using Msg = std::pair<int64_t, int64_t>;  // (virtual stage, micro-batch)
      std::map<std::pair<bool, int64_t>, std::vector<Msg>> sends, recvs;
      std::vector<std::map<std::tuple<bool, int64_t, int64_t>, size_t>> recv_at(pp),
          send_at(pp);  // by (act, chunk, j|model)
      std::vector<size_t> next(pp, 0);
      int64_t forwards = 0, backwards = 0;
      for (bool progress = true; progress;) {
        progress = false;
        for (int64_t s = 0; s < pp; ++s) {
          if (next[s] == ops[s].size()) continue;
          const PipelineOp& o = ops[s][next[s]];
          const int64_t v = o.chunk * pp + s;
          const bool act = o.kind == K::post_recv_activations || o.kind == K::wait_recv_activations ||
                           o.kind == K::wait_send_activations || o.kind == K::send_activations;
          const std::pair<bool, int64_t> in{act, act ? (s + pp - 1) % pp : (s + 1) % pp}, out{act, s};
          switch (o.kind) {
            case K::post_recv_activations:
            case K::post_recv_grads:
              recv_at[s][{act, o.chunk, o.micro}] = recvs[in].size();
              recvs[in].push_back({act ? v - 1 : v + 1, o.micro});
              break;
            case K::wait_recv_activations:
            case K::wait_recv_grads: {
              const size_t n = recv_at[s].at({act, o.chunk, o.micro});
              if (sends[in].size() <= n) continue;  // not sent yet
              EXPECT_EQ(sends[in][n], recvs[in][n]);
              break;
            }
            case K::send_activations:
            case K::send_grads:
              send_at[s][{act, o.chunk, o.model}] = sends[out].size();
              sends[out].push_back({v, o.micro});
              break;
            case K::wait_send_activations:
            case K::wait_send_grads:
              if (recvs[out].size() <= send_at[s].at({act, o.chunk, o.model})) continue;  // not received yet
              break;
            case K::forward:
              ++forwards;
              break;
            case K::backward:
              ++backwards;
              break;
            case K::forward_backward:  // two micro-batches of one chunk, one of them forward
              EXPECT_NE(o.micro, o.micro2);
              EXPECT_NE(o.model, o.model2);
              ++forwards;
              ++backwards;
              break;
          }
          ++next[s];
          progress = true;
        }
      }
      for (int64_t s = 0; s < pp; ++s) EXPECT_EQ(next[s], ops[s].size()) << "stage " << s << " waits forever";
      EXPECT_EQ(forwards, pp * vpp * m);
      EXPECT_EQ(backwards, pp * vpp * m);
      for (const auto& [link, sent] : sends) EXPECT_EQ(recvs[link].size(), sent.size());
    }
  }
  // pp = 1 with overlap: after the first forward, each forward with the previous micro-batch's backward.
  const std::vector<PipelineOp> one = pipeline_ops(1, 1, 0, 4, true);
  std::vector<PipelineOpKind> kinds;
  for (const PipelineOp& o : one) kinds.push_back(o.kind);
  EXPECT_EQ(kinds, (std::vector<PipelineOpKind>{K::forward, K::forward_backward, K::forward_backward,
                                                K::forward_backward, K::backward}));
}

TEST(Schedule, WarmupThenCosine) {
  TrainConfig c;
  c.lr = 1.0;
  c.min_lr = 0.1;
  c.warmup_steps = 4;
  c.steps = 14;
  EXPECT_DOUBLE_EQ(learning_rate(c, 0), 0.25);
  EXPECT_DOUBLE_EQ(learning_rate(c, 3), 1.0);
  EXPECT_DOUBLE_EQ(learning_rate(c, 4), 1.0);
  EXPECT_NEAR(learning_rate(c, 9), 0.55, 1e-12);  // halfway: (lr + min_lr) / 2
  EXPECT_DOUBLE_EQ(learning_rate(c, 14), 0.1);
  EXPECT_DOUBLE_EQ(learning_rate(c, 100), 0.1);
  for (int64_t s = 4; s < 14; ++s) EXPECT_GT(learning_rate(c, s), learning_rate(c, s + 1));
}

TEST(AdamW, MatchesReferenceFormulaAndSkipsDecayOnNorms) {
  testing::Pool pool;
  TrainConfig c;
  c.weight_decay = 0.1;
  std::vector<Param> params(2);
  for (int i = 0; i < 2; ++i) {
    params[i].name = cat("p", i);
    params[i].value = pool.randn({7});
    params[i].grad = pool.randn({7});
    params[i].decay = i == 0;
  }
  std::vector<Tensor> w0 = {pool.clone(params[0].value), pool.clone(params[1].value)};
  AdamW opt(c);
  opt.bind(testing::exec(), params);
  std::vector<std::vector<double>> m(2, std::vector<double>(7)), v = m;
  for (int t = 1; t <= 3; ++t) {
    const double lr = 0.01 * t;
    opt.step(params, lr);
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 7; ++j) {
        double g = params[i].grad.ptr<double>()[j], &w = w0[i].ptr<double>()[j];
        m[i][j] = c.adam_beta1 * m[i][j] + (1 - c.adam_beta1) * g;
        v[i][j] = c.adam_beta2 * v[i][j] + (1 - c.adam_beta2) * g * g;
        double mh = m[i][j] / (1 - std::pow(c.adam_beta1, t)), vh = v[i][j] / (1 - std::pow(c.adam_beta2, t));
        w = w * (1 - lr * (i == 0 ? c.weight_decay : 0.0)) - lr * mh / (std::sqrt(vh) + c.adam_eps);
      }
  }
  for (int i = 0; i < 2; ++i) EXPECT_LT(testing::max_abs_diff(params[i].value, w0[i]), 1e-12);
  EXPECT_EQ(opt.num_steps(), 3);
}

// bf16 moments (train.exp_avg_dtype / exp_avg_sq_dtype): each update reads the stored moments,
// updates them in f32, stores them rounded to bf16 and moves the weight with the unrounded
// values; the reference does the same in double with the same roundings.
TEST(AdamW, Bf16MomentsAreRoundedAfterEachUpdate) {
  testing::Pool pool;
  TrainConfig c;
  c.weight_decay = 0.1;
  c.exp_avg_dtype = c.exp_avg_sq_dtype = "bf16";
  std::vector<Param> params(1);
  params[0].name = "p";
  params[0].value = pool.randn({9}, DType::f32);
  params[0].grad = pool.randn({9}, DType::f32);
  std::vector<double> w(9), m(9, 0.0), v(9, 0.0);
  for (int j = 0; j < 9; ++j) w[j] = testing::value_at(params[0].value, j);
  AdamW opt(c);
  opt.bind(testing::exec(), params);
  EXPECT_EQ(opt.exp_avg(0).dtype(), DType::bf16);
  EXPECT_EQ(opt.exp_avg_sq(0).dtype(), DType::bf16);
  auto bf16 = [](double x) { return static_cast<double>(bf16_to_f32(f32_to_bf16(static_cast<float>(x)))); };
  for (int t = 1; t <= 3; ++t) {
    const double lr = 0.01 * t;
    opt.step(params, lr);
    for (int j = 0; j < 9; ++j) {
      // The moments in f32, each operation rounded as the update rounds it (in double, a sum
      // close to a bf16 rounding boundary can round the other way: the inputs are fresh each run).
      const float g = static_cast<float>(testing::value_at(params[0].grad, j));
      const float b1 = static_cast<float>(c.adam_beta1), b2 = static_cast<float>(c.adam_beta2);
      const double mj = b1 * static_cast<float>(m[j]) + (1.0f - b1) * g,
                   vj = b2 * static_cast<float>(v[j]) + (1.0f - b2) * g * g;
      w[j] = w[j] * (1 - lr * c.weight_decay) -
             lr / (1 - std::pow(c.adam_beta1, t)) * mj / (std::sqrt(vj / (1 - std::pow(c.adam_beta2, t))) + c.adam_eps);
      m[j] = bf16(mj);
      v[j] = bf16(vj);
      EXPECT_EQ(testing::value_at(opt.exp_avg(0), j), m[j]) << "step " << t << " element " << j;
      EXPECT_EQ(testing::value_at(opt.exp_avg_sq(0), j), v[j]) << "step " << t << " element " << j;
      EXPECT_NEAR(testing::value_at(params[0].value, j), w[j], 1e-6 * std::max(1.0, std::abs(w[j])));
    }
  }
}

TEST(Clip, ScalesToMaxNorm) {
  testing::Pool pool;
  std::vector<Param> params(2);
  for (auto& p : params) p.grad = pool.randn({5});
  auto norm = [&] {
    return std::sqrt(testing::dot(params[0].grad, params[0].grad) + testing::dot(params[1].grad, params[1].grad));
  };
  const double n = norm();
  EXPECT_DOUBLE_EQ(clip_grad_norm(testing::exec(), params, n, 2 * n), 1.0);
  clip_grad_norm(testing::exec(), params, n, n / 4);
  EXPECT_NEAR(norm(), n / 4, 1e-5 * n);
}

// Clipping fused into the optimizer (what the Trainer does): the same update as clipping the
// gradients first, and the gradients are left as they were.
TEST(Clip, FusedIntoAdamWMatchesClippingFirst) {
  testing::Pool pool;
  TrainConfig c;
  c.weight_decay = 0.1;
  std::vector<Param> fused(1), first(1);
  fused[0].name = first[0].name = "p";
  fused[0].value = pool.randn({9});
  fused[0].grad = pool.randn({9});
  first[0].value = pool.clone(fused[0].value);
  first[0].grad = pool.clone(fused[0].grad);
  const Tensor g0 = pool.clone(fused[0].grad);
  const double n = std::sqrt(testing::dot(g0, g0)), f = clip_factor(n, n / 3);
  EXPECT_NEAR(f, 1.0 / 3, 1e-6);
  EXPECT_DOUBLE_EQ(clip_factor(n, 0), 1.0);
  EXPECT_DOUBLE_EQ(clip_factor(n, 2 * n), 1.0);
  AdamW a(c), b(c);
  a.bind(testing::exec(), fused);
  b.bind(testing::exec(), first);
  a.step(fused, 1e-2, f);
  clip_grad_norm(testing::exec(), first, n, n / 3);
  b.step(first, 1e-2);
  EXPECT_LT(testing::max_abs_diff(fused[0].value, first[0].value), 1e-15);
  EXPECT_EQ(testing::max_abs_diff(fused[0].grad, g0), 0.0);
}

// DeepSeek-V3's layers at test size: MLA with q-LoRA, a dense first layer, shared experts, sigmoid
// routing with a selection bias, multi-token prediction.
const std::vector<std::string> kDeepSeek = {"model.architecture=deepseek_v3",
                                            "model.num_attention_heads=2",
                                            "model.num_key_value_heads=2",
                                            "model.head_dim=4",
                                            "model.qk_rope_head_dim=4",
                                            "model.qk_nope_head_dim=4",
                                            "model.v_head_dim=8",
                                            "model.kv_lora_rank=8",
                                            "model.q_lora_rank=8",
                                            "model.first_k_dense_replace=1",
                                            "model.intermediate_size=32",
                                            "moe.n_shared_experts=1",
                                            "moe.scoring_func=sigmoid",
                                            "moe.expert_bias=true",
                                            "model.num_nextn_predict_layers=1"};

// The distributed optimizer on one rank (its whole path, shard groups of one): see sharding_check.h.
// With bf16 moments too: both runs keep them in bf16, checkpoints in f32, and every resume
// continues with the same bits.
// train.cuda_graphs on a CPU run: one line says why it is not used, and training is as without
// (CPU ranks run every op themselves); an unknown value is refused naming the key.
TEST(Trainer, CudaGraphsOnTheCpuSayWhy) {
  testing::TempDir dir("trainer_graphs");
  const std::string data = testing::make_train_data(dir.path());
  std::vector<double> losses[3];
  const char* modes[] = {"none", "layers", "step"};
  for (int g = 0; g < 3; ++g) {
    const Config cfg = testing::small_train_config(data, {std::string("train.cuda_graphs=") + modes[g]});
    const TokenDataset tokens = open_token_dataset(cfg.data.path);
    OneRank r(cfg);
    Trainer t(cfg, tokens, r.mesh, Device::cpu);
    t.init_fresh();
    for (int i = 0; i < 2; ++i) losses[g].push_back(t.train_step().loss);
    EXPECT_EQ(t.cuda_graphs_note(),
              g ? cat("train.cuda_graphs = \"", modes[g], "\" not used: a CPU run (nothing to capture)") : "");
  }
  EXPECT_EQ(losses[0], losses[1]);
  EXPECT_EQ(losses[0], losses[2]);
  EXPECT_THROW(
      {
        try {
          testing::small_train_config(data, {"train.cuda_graphs=micro"}).validate();
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("train.cuda_graphs = 'micro' is not supported (none, layers, step)"),
                    std::string::npos)
              << e.what();
          throw;
        }
      },
      Error);
}

TEST(Trainer, DistributedOptimizerOnOneRankChangesNothing) {
  testing::expect_one_rank_sharding_changes_nothing(Device::cpu, {});
  testing::expect_one_rank_sharding_changes_nothing(Device::cpu,
                                                    {"train.exp_avg_dtype=bf16", "train.exp_avg_sq_dtype=bf16"});
  testing::expect_one_rank_sharding_changes_nothing(Device::cpu, kDeepSeek);
}

// Recomputation (recompute_check.h) on one CPU rank, in f64 (exactly) and f32: the default
// family (GQA with per-head q/k norms), DeepSeek-V3's (MLA with q-LoRA, a dense first layer, shared
// experts, multi-token prediction) and OLMoE's (whole-projection q/k norms); three layers, so that
// uniform chunks of 2 end with a chunk of one.
TEST(Trainer, RecomputeChangesNothing) {
  testing::TempDir dir("recompute");
  const std::string path = testing::make_train_data(dir.path());
  const TokenDataset data = open_token_dataset(path);
  const std::vector<std::vector<std::string>> families = {{}, kDeepSeek, {"model.architecture=olmoe"}};
  for (const std::vector<std::string>& family : families)
    for (const DType dtype : {DType::f64, DType::f32}) {
      SCOPED_TRACE(cat(family.empty() ? "qwen3_moe" : family[0], ", ", dtype_name(dtype)));
      std::vector<std::string> extra = family;
      extra.push_back("model.num_hidden_layers=3");
      const Config base = testing::small_train_config(path, extra);
      std::vector<std::unique_ptr<OneRank>> ranks;
      testing::expect_recompute_changes_nothing(
          base,
          [&](const Config& c) {
            ranks.push_back(std::make_unique<OneRank>(c));
            auto t = std::make_unique<Trainer>(c, data, ranks.back()->mesh, Device::cpu, dtype);
            t->init_fresh();
            return t;
          },
          testing::recompute_variants(dtype == DType::f64));
    }
}

// With the distributed optimizer too (its path on shard groups of one rank), with every module
// and then every layer recomputed (the recomputed forwards allocate nothing either), and with the
// all-to-all overlap (the schedule's ops are decided once).
TEST(Trainer, StepLoopDoesNotAllocateAndLearns) {
  const std::vector<std::string> variants = {
      "parallel.distributed_optimizer=false", "parallel.distributed_optimizer=true",
      R"(train.recompute_modules=["layernorm","core_attn","moe_act","moe","mlp"])", "train.recompute_num_layers=1",
      "parallel.overlap_moe_a2a=true"};
  for (const std::string& variant : variants) {
    SCOPED_TRACE(variant);
    testing::TempDir tmp("test_train");
    const fs::path& dir = tmp.path();
    Config cfg = small_config(make_data(dir), {"train.lr=1e-2", variant});
    TokenDataset data = open_token_dataset(cfg.data.path);
    OneRank one(cfg);
    Trainer t(cfg, data, one.mesh);
    t.init_fresh();
    double first = t.train_step().lm_loss;  // warm-up (OpenBLAS buffers, first touches)
    g_allocs = 0;
    g_counting = true;
    double last = 0;
    for (int i = 0; i < 10; ++i) last = t.train_step().lm_loss;
    g_counting = false;
    EXPECT_EQ(g_allocs.load(), 0) << "heap allocations inside train_step";
    EXPECT_NEAR(first, std::log(32.0), 0.3);
    EXPECT_LT(last, first - 0.5);
  }
}

// train.fp8 = blockwise on the CPU (the emulation: ops/fp8.h): the LM losses of a few f32 steps,
// per variant of the DeepSeek-V3-shaped model (every kind of linear layer: MLA, a dense first layer,
// shared experts, multi-token prediction) and the default family.
std::vector<double> step_losses(const Config& cfg, int steps) {
  const TokenDataset data = open_token_dataset(cfg.data.path);
  OneRank one(cfg);
  Trainer t(cfg, data, one.mesh, Device::cpu, DType::f32);
  t.init_fresh();
  std::vector<double> out;
  for (int i = 0; i < steps; ++i) out.push_back(t.train_step().lm_loss);
  return out;
}

// Every module excluded is exactly fp8 = none; each module alone in FP8 changes the losses (so each
// is wired), by little; all of them in FP8 learn as the f32 model does (within 2% per step).
TEST(Trainer, Fp8BlockwiseChangesLittleAndEveryModuleIsWired) {
  testing::TempDir tmp("test_train_fp8");
  const std::string path = make_data(tmp.path());
  const std::vector<std::string> modules = {"qkv", "attn_proj", "mlp", "experts", "shared_experts", "mtp"};
  const auto exclude = [&](const std::string& keep) {
    std::string list;
    for (const std::string& m : modules)
      if (m != keep) list += cat(list.empty() ? "" : ",", "\"", m, "\"");
    return cat("train.fp8_exclude=[", list, "]");
  };
  for (const std::vector<std::string>& family : {kDeepSeek, std::vector<std::string>{}}) {
    SCOPED_TRACE(family.empty() ? "qwen3_moe" : "deepseek_v3");
    std::vector<std::string> base = family;
    base.push_back("train.lr=1e-2");
    const auto with = [&](std::vector<std::string> more) {
      std::vector<std::string> all = base;
      all.insert(all.end(), more.begin(), more.end());
      return testing::small_train_config(path, all);
    };
    const std::vector<double> plain = step_losses(with({}), 8);
    EXPECT_EQ(step_losses(with({"train.fp8=blockwise", exclude("")}), 8), plain);
    for (const std::string& m : modules) {
      if (family.empty() && (m == "mlp" || m == "shared_experts" || m == "mtp")) continue;  // not in this family
      SCOPED_TRACE(m);
      const std::vector<double> one = step_losses(with({"train.fp8=blockwise", exclude(m)}), 3);
      EXPECT_NE(one[2], plain[2]);
      EXPECT_NEAR(one[2], plain[2], 0.02 * plain[2]);
    }
    const std::vector<double> fp8 = step_losses(with({"train.fp8=blockwise"}), 8);
    for (size_t i = 0; i < fp8.size(); ++i) EXPECT_NEAR(fp8[i], plain[i], 0.02 * plain[i]) << i;
    EXPECT_LT(fp8.back(), fp8.front() - 0.3);
  }
}

// FP8 with the experts' SwiGLU recomputed (its packed FP8 output rebuilt from the kept gate|up
// output) or the whole MoE layer recomputed, with and without FP8 dispatch: the same losses.
TEST(Trainer, Fp8RecomputeChangesNothing) {
  testing::TempDir tmp("test_train_fp8_recompute");
  const std::string path = make_data(tmp.path());
  for (const char* dispatch : {"moe.fp8_dispatch=false", "moe.fp8_dispatch=true"}) {
    SCOPED_TRACE(dispatch);
    std::vector<std::string> base = kDeepSeek;
    base.insert(base.end(), {"train.fp8=blockwise", dispatch});
    const std::vector<double> plain = step_losses(testing::small_train_config(path, base), 3);
    for (const char* r : {"train.recompute_modules=[\"moe_act\"]", "train.recompute_modules=[\"moe\"]"}) {
      std::vector<std::string> with = base;
      with.push_back(r);
      EXPECT_EQ(step_losses(testing::small_train_config(path, with), 3), plain) << r;
    }
  }
}

// moe.fp8_dispatch: the tokens travel to the experts as packed FP8 rows. The forward is the FP8
// run's bit for bit (each token's 1 x 128 tiles are the fc1 operand's tiles wherever it is
// quantized), and so is every gradient but the experts' fc1 weight gradient, which requantizes the
// dispatched values along the tokens. With power-of-two scales both quantizations round to E4M3's
// 3-bit mantissa grid, so requantizing changes only values that fall into one tiling's subnormal
// range: that gradient stays within 1e-3 of the FP8 run's (here it is equal). Without FP8 experts
// the key is refused in one line.
TEST(Trainer, Fp8DispatchChangesAtMostTheExpertsInputWeightGradient) {
  testing::TempDir tmp("test_train_fp8_dispatch");
  const std::string path = make_data(tmp.path());
  for (const std::vector<std::string>& family : {kDeepSeek, std::vector<std::string>{}}) {
    SCOPED_TRACE(family.empty() ? "qwen3_moe" : "deepseek_v3");
    std::vector<std::string> base = family;
    base.push_back("train.fp8=blockwise");
    const Config fp8 = testing::small_train_config(path, base);
    base.push_back("moe.fp8_dispatch=true");
    const Config dispatch = testing::small_train_config(path, base);
    const TokenDataset data = open_token_dataset(path);
    OneRank one_a(fp8), one_b(dispatch);
    Trainer a(fp8, data, one_a.mesh, Device::cpu, DType::f32), b(dispatch, data, one_b.mesh, Device::cpu, DType::f32);
    a.init_fresh();
    b.init_fresh();
    a.accumulate_gradients();
    b.accumulate_gradients();
    EXPECT_EQ(b.metrics().lm_loss, a.metrics().lm_loss);
    // The dispatched rows are packed FP8 (W = 32 bytes a row here) instead of f32 (64): less memory,
    // the evidence that the dispatch path ran at all (the results alone could not tell).
    EXPECT_LT(b.planned_bytes(), a.planned_bytes());
    std::map<std::string, Tensor> grads_a;
    for (Param& p : a.params()) grads_a[p.name] = p.grad;
    int fc1 = 0;
    for (Param& p : b.params()) {
      ASSERT_TRUE(grads_a.contains(p.name)) << p.name;
      const Tensor& want = grads_a[p.name];
      if (p.name.ends_with(".experts.gate_up_proj")) {
        ++fc1;
        EXPECT_GT(testing::max_abs(want), 0.0) << p.name;
        EXPECT_LE(testing::max_abs_diff(p.grad, want), 1e-3 * testing::max_abs(want)) << p.name;
      } else {
        EXPECT_EQ(testing::max_abs_diff(p.grad, want), 0.0) << p.name;
      }
    }
    EXPECT_GE(fc1, 2);
  }
  Config bad = testing::small_train_config(path, {});
  bad.moe.fp8_dispatch = true;
  EXPECT_NE(testing::error_of([&] { bad.validate(); }).find("moe.fp8_dispatch = true needs the experts in FP8"),
            std::string::npos);
}

// Aux-loss-free balancing: each step moves every router's selection bias by exactly
// rate * sign(mean load - load) per expert, the loads of the whole step (both micro-batches: the
// trainer's expert_loads, which the metrics' max and mean agree with); nothing else moves it.
TEST(Trainer, ExpertBiasFollowsTheStepLoads) {
  testing::TempDir tmp("test_train");
  Config cfg = small_config(make_data(tmp.path()),
                            {"moe.scoring_func=sigmoid", "moe.expert_bias=true", "moe.expert_bias_update_rate=0.125"});
  TokenDataset data = open_token_dataset(cfg.data.path);
  OneRank one(cfg);
  Trainer t(cfg, data, one.mesh);
  t.init_fresh();
  std::vector<const Param*> biases;
  for (const Param& p : t.params())
    if (p.name.ends_with("e_score_correction_bias")) biases.push_back(&p);
  ASSERT_EQ(biases.size(), 2u);  // one per MoE layer
  std::vector<std::vector<float>> before(biases.size(), std::vector<float>(4, 0.0f));
  ASSERT_EQ(cfg.train.global_batch_size, 2 * cfg.train.micro_batch_size);
  for (int step = 1; step <= 3; ++step) {
    const StepMetrics& m = t.train_step();
    const Tensor& loads = t.expert_loads();
    ASSERT_EQ(loads.shape(), (Shape{2, 4}));
    for (size_t i = 0; i < biases.size(); ++i) {
      const double* load = loads.ptr<double>() + i * 4;
      double total = 0, most = 0;
      for (int64_t e = 0; e < 4; ++e) {
        total += load[e];
        most = std::max(most, load[e]);
      }
      // Every token of both micro-batches (2 x 2 sequences x 16 tokens) routed to K = 2 experts.
      EXPECT_EQ(total, 4.0 * 16 * 2) << biases[i]->name;
      EXPECT_EQ(most, m.expert_load_max[i]);
      EXPECT_EQ(total / 4, m.expert_load_mean[i]);
      int moved = 0;
      for (int64_t e = 0; e < 4; ++e) {
        const float now = biases[i]->value.ptr<float>()[e];
        const double delta = (now - before[i][e]) / 0.125;
        const double gap = total / 4 - load[e];
        EXPECT_EQ(delta, (gap > 0) - (gap < 0)) << biases[i]->name << " expert " << e << " at step " << step;
        moved += delta != 0;
        before[i][e] = now;
      }
      EXPECT_GT(moved, 0) << biases[i]->name << ": the bias did not move at step " << step;
    }
  }
}

// Under `dir`: "straight", 6 steps of a small run with expert_load_interval 2, and "resumed", the
// same stopped at step 4 and resumed to 6. Returns its config.
Config run_straight_and_resumed(const fs::path& dir) {
  Config cfg = small_config(make_data(dir), {"train.expert_load_interval=2", "train.checkpoint_interval=0"});
  run_training(cfg, RunOptions{(dir / "straight").string(), 6, false, true});
  run_training(cfg, RunOptions{(dir / "resumed").string(), 4, false, true});
  run_training(cfg, RunOptions{(dir / "resumed").string(), 6, true, true});
  return cfg;
}

// Expert-load statistics: metrics.jsonl has each MoE layer's p50 <= p90 <= p99 <= max load as
// multiples of the mean (the max = expert_load_max / expert_load_mean); expert_load.npy grows by
// one [MoE layers, experts] slice of tokens per expert every train.expert_load_interval steps
// (each layer's slice summing to tokens x K), and a run stopped at step 4 and resumed ends with
// the same file as one run straight through.
TEST(Trainer, ExpertLoadStatisticsAndTheirFileSurviveAResume) {
  testing::TempDir tmp("test_train");
  const fs::path& dir = tmp.path();
  const Config cfg = run_straight_and_resumed(dir);
  const NpyFloats loads = read_npy_f32((dir / "straight" / "expert_load.npy").string());
  ASSERT_EQ(loads.shape, (std::vector<int64_t>{3, 2, 4}));
  for (int64_t s = 0; s < 3; ++s)
    for (int64_t l = 0; l < 2; ++l) {
      float sum = 0;
      for (int64_t e = 0; e < 4; ++e) sum += loads.values[static_cast<size_t>((s * 2 + l) * 4 + e)];
      EXPECT_EQ(sum, 4.0f * 16 * 2) << "slice " << s << " layer " << l;
    }
  EXPECT_EQ(testing::read_bytes((dir / "resumed" / "expert_load.npy").string()),
            testing::read_bytes((dir / "straight" / "expert_load.npy").string()));
  const std::vector<nlohmann::json> rows = read_metrics(dir / "straight");
  ASSERT_EQ(rows.size(), 6u);
  for (const nlohmann::json& r : rows)
    for (size_t l = 0; l < 2; ++l) {
      const double p50 = r["expert_load_p50"][l], p90 = r["expert_load_p90"][l], p99 = r["expert_load_p99"][l];
      const double top = r["expert_load_max_over_mean"][l];
      EXPECT_LE(p50, p90);
      EXPECT_LE(p90, p99);
      EXPECT_LE(p99, top);
      EXPECT_DOUBLE_EQ(top, r["expert_load_max"][l].get<double>() / r["expert_load_mean"][l].get<double>());
    }
  Config bad = cfg;
  bad.train.expert_load_interval = -1;
  EXPECT_NE(error_of([&] { bad.validate(); }).find("train.expert_load_interval = -1 must be >= 0"), std::string::npos);
}

// train.log: a start line, then every train.log_interval steps (and the last) one line with the
// step, loss, lr, tokens/s, TFLOP/s, memory and ETA, and the evaluations; --quiet still writes it
// (it silences the terminal only); a resumed run appends.
TEST(Trainer, TrainLogHasALineEveryIntervalAndTheEvaluations) {
  testing::TempDir tmp("test_train");
  const fs::path& dir = tmp.path();
  Config cfg = small_config(make_data(dir), {"train.log_interval=2", "train.checkpoint_interval=0"});
  run_training(cfg, RunOptions{(dir / "run").string(), 3, false, true});
  run_training(cfg, RunOptions{(dir / "run").string(), 6, true, true});
  std::vector<std::string> lines;
  std::istringstream in(testing::read_bytes((dir / "run" / "train.log").string()));
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  const std::vector<std::string> starts = {"moefold: started at step 0, until step 3",
                                           "step 2/3 | loss ",
                                           "step 3/3 | loss ",
                                           "eval loss ",  // the last step's
                                           "moefold: resumed at step 3, until step 6",
                                           "step 4/6 | loss ",
                                           "eval loss ",  // train.eval_interval = 4
                                           "step 6/6 | loss ",
                                           "eval loss "};
  ASSERT_EQ(lines.size(), starts.size()) << testing::read_bytes((dir / "run" / "train.log").string());
  for (size_t i = 0; i < lines.size(); ++i) {
    EXPECT_TRUE(lines[i].starts_with(starts[i])) << lines[i];
    if (!starts[i].starts_with("step")) continue;
    for (const char* field : {" | lr ", " tokens/s | ", " TFLOP/s | peak RSS ", " MiB | ETA "})
      EXPECT_NE(lines[i].find(field), std::string::npos) << lines[i];
  }
  Config bad = cfg;
  bad.train.log_interval = -1;
  EXPECT_NE(error_of([&] { bad.validate(); }).find("train.log_interval = -1 must be >= 0"), std::string::npos);
}

// The TensorBoard events of a run (rank 0): every step's metrics equal to metrics.jsonl's, per
// layer the expert-load scalars and a tokens-per-expert histogram every train.expert_load_interval
// steps, the config as text; a resumed run cuts the events after its step and continues in a new
// file, so that every step is there once and equal to the straight run's; tensorboard = false
// writes none.
TEST(Trainer, TensorBoardEventsMatchTheMetricsAndSurviveAResume) {
  testing::TempDir tmp("test_train");
  const fs::path& dir = tmp.path();
  const Config cfg = run_straight_and_resumed(dir);
  // tag -> step -> values (a step seen twice would show as two values)
  using Seen = std::map<std::string, std::map<int64_t, std::vector<TbValue>>>;
  auto events = [](const fs::path& run, size_t files) {
    Seen out;
    const std::vector<std::string> paths = tb_event_files((run / "tensorboard").string());
    EXPECT_EQ(paths.size(), files) << run;
    for (const std::string& p : paths)
      for (const TbEvent& e : read_tb_events(p))
        for (const TbValue& v : e.values) out[v.tag][e.step].push_back(v);
    return out;
  };
  const Seen straight = events(dir / "straight", 1), resumed = events(dir / "resumed", 2);
  const std::vector<nlohmann::json> rows = read_metrics(dir / "straight");
  ASSERT_EQ(rows.size(), 6u);
  for (const auto& [tag, key] :
       std::vector<std::pair<std::string, std::string>>{{"loss/total", "loss"},
                                                        {"loss/lm", "lm_loss"},
                                                        {"optimizer/lr", "lr"},
                                                        {"optimizer/grad_norm", "grad_norm"},
                                                        {"throughput/tflops", "tflops"},
                                                        {"memory/host_peak_mib", "host_memory_peak_mib"}}) {
    ASSERT_EQ(straight.count(tag), 1u) << tag;
    ASSERT_EQ(straight.at(tag).size(), 6u) << tag;
    for (const nlohmann::json& r : rows) {
      const std::vector<TbValue>& v = straight.at(tag).at(r["step"].get<int64_t>());
      ASSERT_EQ(v.size(), 1u);
      EXPECT_EQ(v[0].scalar, static_cast<float>(r[key].get<double>())) << tag << " step " << r["step"];
    }
  }
  for (int64_t s : {4, 6})
    EXPECT_EQ(straight.at("loss/eval").at(s)[0].scalar, static_cast<float>(rows[s - 1]["eval_loss"].get<double>()));
  for (const char* layer : {"layer_00", "layer_01"}) {
    const auto& h = straight.at(std::string("tokens_per_expert/") + layer);
    ASSERT_EQ(h.size(), 3u);
    for (int64_t s : {2, 4, 6}) {
      const TbHistogram& g = h.at(s)[0].histogram;
      EXPECT_EQ(g.num, 4);           // experts
      EXPECT_EQ(g.sum, 4 * 16 * 2);  // tokens x top-k
      double counted = 0;
      for (double c : g.bucket) counted += c;
      EXPECT_EQ(counted, 4);
    }
    const std::string p = std::string("expert_load_") + layer + "/";
    for (const char* stat : {"max_over_mean", "min_over_mean", "p50_over_mean", "p90_over_mean", "p99_over_mean",
                             "max_tokens", "mean_tokens", "min_tokens", "dropped_fraction"})
      EXPECT_EQ(straight.at(p + stat).size(), 3u) << p + stat;
    EXPECT_EQ(straight.at(p + "mean_tokens").at(2)[0].scalar, 32.0f);
    EXPECT_EQ(straight.at(p + "dropped_fraction").at(4)[0].scalar, 0.0f);  // dropless
  }
  ASSERT_EQ(straight.at("config").size(), 1u);
  EXPECT_NE(straight.at("config").at(0)[0].text.find("    [model]"), std::string::npos);
  EXPECT_EQ(resumed.at("config").size(), 2u);  // at the start and at the resume
  for (const auto& [tag, steps] : straight) {
    if (tag == "config" || tag.starts_with("throughput/") || tag.starts_with("memory/")) continue;  // timings differ
    ASSERT_EQ(resumed.count(tag), 1u) << tag;
    ASSERT_EQ(resumed.at(tag).size(), steps.size()) << tag;
    for (const auto& [step, values] : steps) {
      const std::vector<TbValue>& r = resumed.at(tag).at(step);
      ASSERT_EQ(r.size(), 1u) << tag << " step " << step;
      EXPECT_EQ(r[0].scalar, values[0].scalar) << tag << " step " << step;
      EXPECT_EQ(r[0].histogram.bucket, values[0].histogram.bucket) << tag << " step " << step;
    }
  }
  Config off = cfg;
  off.train.tensorboard = false;
  run_training(off, RunOptions{(dir / "off").string(), 2, false, true});
  EXPECT_TRUE(tb_event_files((dir / "off" / "tensorboard").string()).empty());
}

// expert_load_dropped_fraction: the share of the token-to-expert assignments the dispatcher did
// not keep (those its plan gave no row, one micro-batch per step here) under
// moe.capacity_factor; 0 when dropless; expert_load_min is the least loaded expert.
TEST(Trainer, DroppedFractionIsWhatTheDispatcherDropped) {
  testing::TempDir tmp("test_train");
  const std::string data = make_data(tmp.path());
  for (const char* factor : {"0.5", "1.0", "0"}) {
    Config cfg = small_config(data, {"train.micro_batch_size=4", cat("moe.capacity_factor=", factor)});
    TokenDataset ds = open_token_dataset(cfg.data.path);
    OneRank one(cfg);
    Trainer t(cfg, ds, one.mesh);
    t.init_fresh();
    for (int step = 0; step < 3; ++step) {
      const StepMetrics& m = t.train_step();
      for (int64_t l = 0; l < t.model().num_moe_layers(); ++l) {
        const double assignments = 4 * 16 * 2;
        const Tensor& rows = t.model().moe(l).plan().row_TK;
        double kept = 0;
        for (int64_t a = 0; a < rows.numel(); ++a) kept += rows.ptr<int64_t>()[a] >= 0 ? 1 : 0;
        EXPECT_DOUBLE_EQ(m.expert_load_dropped_fraction[static_cast<size_t>(l)], 1 - kept / assignments)
            << "capacity_factor " << factor << " layer " << l;
        const double* loads = t.expert_loads().ptr<double>() + l * 4;
        EXPECT_EQ(m.expert_load_min[static_cast<size_t>(l)], *std::min_element(loads, loads + 4));
      }
      if (std::string(factor) == "0.5") {
        EXPECT_GE(m.expert_load_dropped_fraction[0], 0.4);
      }
    }
  }
}

// moe.router_init_std sets the standard deviation of the routers' initial weights alone (0: the
// model's initializer_range, as every other matrix); a negative value is one line naming it.
TEST(Trainer, RouterInitStdSetsTheGatesAlone) {
  testing::TempDir tmp("test_train");
  const std::string data = make_data(tmp.path());
  auto stds = [&](const std::vector<std::string>& extra) {
    Config cfg = small_config(data, extra);
    TokenDataset ds = open_token_dataset(cfg.data.path);
    OneRank one(cfg);
    Trainer t(cfg, ds, one.mesh);
    t.init_fresh();
    std::map<std::string, double> out;  // "gate" and "other": the largest |value| seen
    for (const Param& p : t.params()) {
      if (p.value.ndim() != 2) continue;
      const std::string kind = p.name.ends_with("mlp.gate.weight") ? "gate" : "other";
      out[kind] = std::max(out[kind], testing::max_abs(p.value));
    }
    return out;
  };
  const auto plain = stds({}), wide = stds({"moe.router_init_std=0.5"});
  EXPECT_LT(plain.at("gate"), 0.02 * 6);
  EXPECT_GT(wide.at("gate"), 0.5 * 2);  // 128 draws of N(0, 0.5^2): the largest is > 1 (p ~ 0.997)
  EXPECT_LT(wide.at("gate"), 0.5 * 6);
  EXPECT_EQ(wide.at("other"), plain.at("other"));
  Config bad = small_config(data, {});
  bad.moe.router_init_std = -1;
  EXPECT_NE(error_of([&] { bad.validate(); }).find("moe.router_init_std = -1 must be finite and >= 0"),
            std::string::npos);
}

TEST(GradReducer, LayerOfAParameterName) {
  EXPECT_EQ(grad_ready_point("model.layers.0.self_attn.q_proj.weight", 2), 0);
  EXPECT_EQ(grad_ready_point("model.layers.1.mlp.experts.gate_up_proj", 2), 1);
  EXPECT_EQ(grad_ready_point("model.layers.12.input_layernorm.weight", 20), 12);
  // The top: multi-token prediction (named after the last layers), the final norm, the head.
  EXPECT_EQ(grad_ready_point("model.layers.2.eh_proj.weight", 2), 2);
  EXPECT_EQ(grad_ready_point("model.layers.3.mlp.gate.weight", 2), 2);
  EXPECT_EQ(grad_ready_point("model.norm.weight", 2), 2);
  EXPECT_EQ(grad_ready_point("lm_head.weight", 2), 2);
  // The rest, when backward returns.
  EXPECT_EQ(grad_ready_point("model.embed_tokens.weight", 2), -1);
  EXPECT_EQ(grad_ready_point("model.layers.x.weight", 2), -1);
  EXPECT_EQ(grad_ready_point("model.layers.1", 2), -1);
  EXPECT_EQ(grad_ready_point("model.normal.weight", 2), -1);
}

// A two-rank group that records which elements each reduction covers (and sums nothing).
class RecordingGroup final : public Communicator {
 public:
  struct Call {
    const void* data;
    int64_t numel;
  };
  std::vector<Call> calls;
  std::vector<int64_t> waited;
  int64_t tickets = 0;

  int rank() const override { return 0; }
  int size() const override { return 2; }
  int world_rank() const override { return 0; }
  const std::string& name() const override { return name_; }
  double timeout_s() const override { return 1; }
  void all_reduce(const Tensor& buf, ReduceOp) override { calls.push_back({buf.data(), buf.numel()}); }
  int64_t start_all_reduce(const Tensor& buf, ReduceOp op) override {
    all_reduce(buf, op);
    return tickets++;
  }
  void wait(int64_t ticket) override { waited.push_back(ticket); }
  void all_gather(const Tensor&, const Tensor&) override { MF_FAIL("unused"); }
  void reduce_scatter(const Tensor&, const Tensor&, ReduceOp) override { MF_FAIL("unused"); }
  void all_to_all_v(const Tensor&, const int64_t*, const Tensor&, const int64_t*) override { MF_FAIL("unused"); }
  void all_to_all(const Tensor&, const Tensor&) override { MF_FAIL("unused"); }
  void broadcast(const Tensor&, int) override { MF_FAIL("unused"); }
  void send(const Tensor&, int, int) override { MF_FAIL("unused"); }
  void recv(const Tensor&, int, int) override { MF_FAIL("unused"); }
  void barrier() override {}
  std::unique_ptr<Communicator> split(int, int, const std::string&) override { MF_FAIL("unused"); }

 private:
  std::string name_ = "recording";
};

// The buckets of every gradient group tile its block exactly; each parameter lies in a bucket of
// its ready point; a point's buckets are reduced when it is done (the top, then each layer from
// the last), the rest (the embedding) at finish(), then the compute stream waits for the last;
// without overlap one reduction per block.
TEST(GradReducer, BucketsTileTheBlocksAndStartWithTheirLayers) {
  testing::TempDir tmp("test_train");
  Config cfg = small_config(make_data(tmp.path()), {"model.num_hidden_layers=3", "model.num_nextn_predict_layers=1"});
  TokenDataset data = open_token_dataset(cfg.data.path);
  OneRank one(cfg);
  Trainer t(cfg, data, one.mesh);
  Memory& mem = t.memory();
  RecordingGroup dense, tp, expert;
  GradReducer r(mem, 3,
                {{ParamGroup::dense, &dense}, {ParamGroup::tensor_parallel, &tp}, {ParamGroup::expert, &expert}});
  const size_t esize = dtype_size(mem.master_dtype());
  for (ParamGroup g : {ParamGroup::dense, ParamGroup::tensor_parallel, ParamGroup::expert}) {
    const Tensor block = mem.grad_block(g);
    std::vector<GradReducer::Bucket> b = r.buckets(g);
    ASSERT_FALSE(b.empty());
    std::sort(b.begin(), b.end(), [](const auto& x, const auto& y) { return x.begin < y.begin; });
    int64_t at = 0;
    for (const auto& x : b) {
      EXPECT_EQ(x.begin, at);
      EXPECT_LT(x.begin, x.end);
      at = x.end;
    }
    EXPECT_EQ(at, block.numel());
    for (const Param& p : mem.params()) {
      if (p.group != g) continue;
      const int64_t begin = (static_cast<const char*>(p.grad.data()) - static_cast<const char*>(block.data())) /
                            static_cast<int64_t>(esize);
      const auto in =
          std::find_if(b.begin(), b.end(), [&](const auto& x) { return begin >= x.begin && begin < x.end; });
      ASSERT_NE(in, b.end()) << p.name;
      EXPECT_LE(begin + p.grad.numel(), in->end) << p.name;
      EXPECT_EQ(in->point, grad_ready_point(p.name, 3)) << p.name;
    }
  }
  for (int64_t l = 3; l >= 0; --l) {  // the top (3), then the layers
    dense.calls.clear();
    tp.calls.clear();
    r.ready(l);
    for (RecordingGroup* g : {&dense, &tp}) {
      const ParamGroup group = g == &dense ? ParamGroup::dense : ParamGroup::tensor_parallel;
      const std::vector<GradReducer::Bucket> all = r.buckets(group);
      const size_t want =
          static_cast<size_t>(std::count_if(all.begin(), all.end(), [&](const auto& x) { return x.point == l; }));
      EXPECT_GE(want, 1u) << "point " << l;  // every layer has norms (dense) and projections (tp)
      ASSERT_EQ(g->calls.size(), want) << "point " << l;
      for (size_t i = 0; i < want; ++i) {
        const auto it = std::find_if(all.begin(), all.end(), [&](const auto& x) {
          return x.point == l && static_cast<const char*>(mem.grad_block(group).data()) + x.begin * esize ==
                                     static_cast<const char*>(g->calls[i].data);
        });
        EXPECT_NE(it, all.end()) << "point " << l << ": a reduction that is not one of its buckets";
      }
    }
  }
  EXPECT_TRUE(dense.waited.empty());
  tp.calls.clear();
  r.finish();
  ASSERT_EQ(dense.waited.size(), 1u);
  EXPECT_EQ(dense.waited[0], dense.tickets - 1);
  ASSERT_EQ(tp.calls.size(), 1u);  // the embedding
  EXPECT_EQ(tp.calls[0].data, mem.grad("model.embed_tokens.weight").data());
  int64_t covered = 0;
  for (const auto& x : r.buckets(ParamGroup::dense)) covered += x.end - x.begin;
  EXPECT_EQ(covered, mem.grad_block(ParamGroup::dense).numel());  // every element once
  ASSERT_EQ(expert.waited.size(), 1u);
  tp.calls.clear();
  r.reduce_all();
  ASSERT_EQ(tp.calls.size(), 1u);
  EXPECT_EQ(tp.calls[0].data, mem.grad_block(ParamGroup::tensor_parallel).data());
  EXPECT_EQ(tp.calls[0].numel, mem.grad_block(ParamGroup::tensor_parallel).numel());
}

TEST(Trainer, ResumeIsBitIdentical) {
  testing::TempDir tmp("test_train");
  const fs::path& dir = tmp.path();
  Config cfg = small_config(make_data(dir));
  RunOptions full{(dir / "full").string(), 12, false, true};
  run_training(cfg, full);
  RunOptions part{(dir / "part").string(), 7, false, true};
  run_training(cfg, part);  // checkpoints at 5 and 7
  // Simulate a crash after step 7's metrics but before a later checkpoint: resume from 7.
  RunOptions rest{(dir / "part").string(), 12, true, true};
  run_training(cfg, rest);
  auto a = read_metrics(dir / "full"), b = read_metrics(dir / "part");
  ASSERT_EQ(a.size(), 12u);
  ASSERT_EQ(b.size(), 12u);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i]["step"], b[i]["step"]);
    for (const char* k : {"loss", "lm_loss", "aux_loss", "z_loss", "grad_norm", "lr"})
      EXPECT_EQ(a[i][k].get<double>(), b[i][k].get<double>()) << k << " at step " << i + 1;
    EXPECT_EQ(a[i]["expert_load_max"], b[i]["expert_load_max"]);
    // Every evaluation of the uninterrupted run is also in the resumed one (which also
    // evaluated at its interruption, step 7, as every run does at its end).
    EXPECT_TRUE(!a[i].contains("eval_loss") || b[i].contains("eval_loss")) << "step " << i + 1;
    if (a[i].contains("eval_loss") && b[i].contains("eval_loss")) {
      EXPECT_EQ(a[i]["eval_loss"].get<double>(), b[i]["eval_loss"].get<double>());
    }
  }
  EXPECT_TRUE(a[3].contains("eval_loss"));
  // Resuming again from step 5 (an older checkpoint, by deleting the newer ones) also matches.
  fs::remove_all(dir / "part" / "checkpoints" / "step_00000012");
  fs::remove_all(dir / "part" / "checkpoints" / "step_00000010");
  fs::remove_all(dir / "part" / "checkpoints" / "step_00000007");
  run_training(cfg, rest);
  auto c = read_metrics(dir / "part");
  ASSERT_EQ(c.size(), 12u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i]["loss"].get<double>(), c[i]["loss"].get<double>());
  // No temporary directories are left behind.
  for (const auto& e : fs::directory_iterator(dir / "part" / "checkpoints"))
    EXPECT_TRUE(e.path().filename().string().starts_with("step_")) << e.path();
}

// FP8 too: the resumed run quantizes its loaded weights afresh, so the uninterrupted one matches it
// only if every step quantizes the weights the optimizer just wrote (Fp8Param is keyed on
// Memory::weights_version, which the trainer must move before each step's forwards); with
// train.fp8_param too (the FP8 copies then come from the loaded masters).
TEST(Trainer, Fp8ResumeIsBitIdentical) {
  for (const char* param : {"train.fp8_param=false", "train.fp8_param=true"}) {
    SCOPED_TRACE(param);
    testing::TempDir tmp("test_train");
    const fs::path& dir = tmp.path();
    Config cfg = small_config(make_data(dir), {"train.fp8=blockwise", "train.eval_interval=0", param});
    run_training(cfg, RunOptions{(dir / "full").string(), 6, false, true});
    run_training(cfg, RunOptions{(dir / "part").string(), 3, false, true});
    run_training(cfg, RunOptions{(dir / "part").string(), 6, true, true});
    auto a = read_metrics(dir / "full"), b = read_metrics(dir / "part");
    ASSERT_EQ(a.size(), 6u);
    ASSERT_EQ(b.size(), 6u);
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_EQ(a[i]["loss"].get<double>(), b[i]["loss"].get<double>()) << "step " << i + 1;
  }
}

// train.fp8_param: the FP8 linears read only their FP8 copies (on the CPU, f32 compute, the copies
// come from the masters themselves; the bf16 case is TrainCuda.Fp8ParamChangesNothing): the same
// losses as plain FP8, for every kind of linear layer, with and without FP8 dispatch (with the
// distributed optimizer: Layouts.Fp8ParamWithDistributedOptimizerChangesNothing; with optimizer
// offload: TrainCuda.OptimizerOffloadChangesNothing). Refused in one line without FP8.
TEST(Trainer, Fp8ParamChangesNothing) {
  testing::TempDir tmp("test_train_fp8_param");
  const std::string path = make_data(tmp.path());
  for (const std::vector<std::string>& family : {kDeepSeek, std::vector<std::string>{}})
    for (const char* dispatch : {"moe.fp8_dispatch=false", "moe.fp8_dispatch=true"}) {
      SCOPED_TRACE(cat(family.empty() ? "qwen3_moe " : "deepseek_v3 ", dispatch));
      std::vector<std::string> base = family;
      base.insert(base.end(), {"train.fp8=blockwise", dispatch});
      const std::vector<double> plain = step_losses(testing::small_train_config(path, base), 3);
      base.push_back("train.fp8_param=true");
      EXPECT_EQ(step_losses(testing::small_train_config(path, base), 3), plain);
    }
  const auto refusal = [&](const std::vector<std::string>& extra) {
    return testing::error_of([&] { testing::small_train_config(path, extra); });
  };
  EXPECT_NE(refusal({"train.fp8_param=true"}).find("train.fp8_param = true needs train.fp8"), std::string::npos);
}

// train.on_nonfinite: a NaN planted in a weight makes step 3's loss and gradients NaN. "stop"
// throws naming the step and the first parameter with a non-finite gradient; "skip" leaves every
// weight as it was and moves the data on: with the NaN taken out again, step 4 computes exactly what
// a run that only accumulated (no update) over step 3's batch computes next.
TEST(Trainer, NonFiniteStepStopsOrIsSkipped) {
  testing::TempDir tmp("test_train_nonfinite");
  const std::string path = make_data(tmp.path());
  const TokenDataset data = open_token_dataset(path);
  const auto weight = [](Trainer& t, const std::string& name) -> float& {
    for (Param& p : t.params())
      if (p.name == name) return p.value.ptr<float>()[0];
    throw Error("no parameter " + name);
  };
  const std::string planted = "model.norm.weight";
  {
    const Config cfg = small_config(path);  // stop: the default
    OneRank one(cfg);
    Trainer t(cfg, data, one.mesh, Device::cpu, DType::f32);
    t.init_fresh();
    t.train_step();
    t.train_step();
    weight(t, planted) = std::nanf("");
    const std::string e = error_of([&] { t.train_step(); });
    EXPECT_NE(e.find("step 3: loss nan"), std::string::npos) << e;
    EXPECT_NE(e.find("first non-finite gradient on rank 0: model.embed_tokens.weight"), std::string::npos) << e;
  }
  const Config cfg = small_config(path, {"train.on_nonfinite=skip"});
  double skip_next_loss = 0, skip_next_norm = 0;
  {
    OneRank one(cfg);
    Trainer t(cfg, data, one.mesh, Device::cpu, DType::f32);
    t.init_fresh();
    t.train_step();
    EXPECT_FALSE(t.train_step().skipped);
    std::vector<std::vector<float>> before;
    for (const Param& p : t.params()) before.emplace_back(p.value.ptr<float>(), p.value.ptr<float>() + p.value.numel());
    const float kept = weight(t, planted);
    weight(t, planted) = std::nanf("");
    const StepMetrics& m = t.train_step();
    EXPECT_TRUE(m.skipped);
    EXPECT_FALSE(std::isfinite(m.loss));
    EXPECT_EQ(t.step(), 3);
    weight(t, planted) = kept;
    for (size_t i = 0; i < t.params().size(); ++i) {
      const Param& p = t.params()[i];
      EXPECT_EQ(std::vector<float>(p.value.ptr<float>(), p.value.ptr<float>() + p.value.numel()), before[i])
          << p.name << " changed in a skipped step";
    }
    const StepMetrics& next = t.train_step();
    EXPECT_FALSE(next.skipped);
    EXPECT_TRUE(std::isfinite(next.loss));
    skip_next_loss = next.loss, skip_next_norm = next.grad_norm;
  }
  OneRank one(cfg);
  Trainer t(cfg, data, one.mesh, Device::cpu, DType::f32);
  t.init_fresh();
  t.train_step();
  t.train_step();
  t.accumulate_gradients();  // step 3's batch consumed, no update
  const StepMetrics& m = t.train_step();
  EXPECT_EQ(m.loss, skip_next_loss);
  EXPECT_EQ(m.grad_norm, skip_next_norm);
}

TEST(Checkpoint, CorruptOrMismatchedCheckpointsFailClearly) {
  testing::TempDir tmp("test_train");
  const fs::path& dir = tmp.path();
  Config cfg = small_config(make_data(dir), {"train.checkpoint_interval=0"});
  run_training(cfg, RunOptions{(dir / "run").string(), 2, false, true});
  fs::path ck = dir / "run" / "checkpoints" / "step_00000002";
  ASSERT_TRUE(fs::exists(ck / "model.safetensors"));
  TokenDataset data = open_token_dataset(cfg.data.path);
  auto load_err = [&](const Config& c, const fs::path& p) {
    OneRank one(c);
    Trainer t(c, data, one.mesh);
    return error_of([&] { t.load(p.string()); });
  };
  EXPECT_EQ(load_err(cfg, ck), "");
  // A model of another shape: the error names the tensor and both shapes.
  Config other = small_config(cfg.data.path, {"moe.moe_intermediate_size=8"});
  std::string e = load_err(other, ck);
  EXPECT_NE(e.find("model.safetensors"), std::string::npos) << e;
  EXPECT_NE(e.find("experts.0.gate_proj.weight"), std::string::npos) << e;
  Config fewer = small_config(cfg.data.path, {"model.num_hidden_layers=1"});
  EXPECT_NE(load_err(fewer, ck).find("holds"), std::string::npos);
  // One flipped byte anywhere in the weights.
  fs::path bad = dir / "bad";
  fs::copy(ck, bad, fs::copy_options::recursive);
  {
    std::fstream f(bad / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-5, std::ios::end);
    f.put('\x7f');
  }
  EXPECT_NE(load_err(cfg, bad).find("checksum mismatch"), std::string::npos);
  // Truncated optimizer state.
  fs::remove_all(bad);
  fs::copy(ck, bad, fs::copy_options::recursive);
  fs::resize_file(bad / "optimizer.safetensors", 100);
  EXPECT_NE(load_err(cfg, bad).find("optimizer.safetensors"), std::string::npos);
  // Garbage metadata; missing directory.
  std::ofstream(bad / "trainer.json") << "{ not json";
  EXPECT_NE(load_err(cfg, bad).find("trainer.json: not valid JSON"), std::string::npos);
  EXPECT_NE(load_err(cfg, dir / "nothing").find("cannot open"), std::string::npos);
  // Hostile metadata (the audit, docs/faults.md): numbers that are not integers below 2^63 or are
  // negative, a checksum that is not a string, an index naming a file outside the checkpoint.
  const std::string meta = testing::read_bytes((ck / "trainer.json").string());
  auto edited = [&](const std::string& from, const std::string& to) {
    fs::remove_all(bad);
    fs::copy(ck, bad, fs::copy_options::recursive);
    std::string text = meta;
    const size_t at = text.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    if (at != std::string::npos) text.replace(at, from.size(), to);
    testing::write_bytes((bad / "trainer.json").string(), text);
    return load_err(cfg, bad);
  };
  EXPECT_NE(edited("\"step\": 2", "\"step\": 1e300").find("trainer.json: 'step' must be an integer below 2^63"),
            std::string::npos);
  EXPECT_NE(edited("\"data_position\": ", "\"data_position\": -").find("'data_position' must be >= 0"),
            std::string::npos);
  EXPECT_NE(edited("\"seed\": ", "\"seed\": -").find("'seed' must be an unsigned integer"), std::string::npos);
  EXPECT_NE(edited("\"model.safetensors.index.json\": \"", "\"model.safetensors.index.json\": 7, \"x\": \"")
                .find("model.safetensors.index.json: checksum mismatch"),
            std::string::npos);
  edited("\"step\"", "\"step\"");  // a fresh copy, with trainer.json naming a file outside it
  {
    std::string text = testing::read_bytes((bad / "trainer.json").string());
    text.replace(text.find("\"checksums\": {") + 14, 0, "\n    \"../run/config.toml\": \"0\",");
    testing::write_bytes((bad / "trainer.json").string(), text);
  }
  EXPECT_NE(error_of([&] {
              verify_checkpoint(bad.string());
            }).find("names '../run/config.toml', which is not a file of the checkpoint directory"),
            std::string::npos);
  // A run directory with checkpoints is never overwritten by a fresh run.
  EXPECT_NE(error_of([&] {
              run_training(cfg, RunOptions{(dir / "run").string(), 2, false, true});
            }).find("already holds checkpoints"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              run_training(cfg, RunOptions{(dir / "empty").string(), 2, true, true});
            }).find("no checkpoint"),
            std::string::npos);
}

// Checkpoints written before trainer.json named its checksum algorithm hold FNV-1a 64 checksums:
// they still load; an unknown algorithm is one line.
TEST(Checkpoint, OlderChecksumsStillLoad) {
  testing::TempDir tmp("test_train");
  const fs::path& dir = tmp.path();
  Config cfg = small_config(make_data(dir), {"train.checkpoint_interval=0"});
  run_training(cfg, RunOptions{(dir / "run").string(), 2, false, true});
  const fs::path ck = dir / "run" / "checkpoints" / "step_00000002";
  nlohmann::json meta = nlohmann::json::parse(testing::read_bytes((ck / "trainer.json").string()));
  ASSERT_EQ(meta["checksum"], "xxh3-64");
  meta.erase("checksum");
  for (auto& [file, sum] : meta["checksums"].items()) {
    uint64_t h = 1469598103934665603ull;
    for (unsigned char c : testing::read_bytes((ck / file).string())) h = (h ^ c) * 1099511628211ull;
    sum = cat(std::hex, std::setw(16), std::setfill('0'), h);
  }
  testing::write_bytes((ck / "trainer.json").string(), meta.dump(2));
  TokenDataset data = open_token_dataset(cfg.data.path);
  OneRank one(cfg);
  Trainer t(cfg, data, one.mesh);
  EXPECT_EQ(error_of([&] { t.load(ck.string()); }), "");
  EXPECT_EQ(t.step(), 2);
  meta["checksum"] = "md5";
  testing::write_bytes((ck / "trainer.json").string(), meta.dump(2));
  EXPECT_NE(error_of([&] { t.load(ck.string()); }).find("trainer.json: checksum \"md5\" is not xxh3-64 or fnv1a-64"),
            std::string::npos);
}

// checkpoint_bytes (what `moefold plan` prints and a save checks against the free space) bounds
// the files a save writes, from above and within 50 % for these small models (headers are a large
// share of them; at real sizes the tensors are all of it): both families, MTP and the selection
// bias included.
TEST(Checkpoint, SizeIsKnownBeforeTheSave) {
  testing::TempDir tmp("test_train");
  const fs::path& dir = tmp.path();
  std::vector<std::string> deepseek = kDeepSeek;
  deepseek.insert(deepseek.end(), {"model.num_nextn_predict_layers=1", "train.checkpoint_interval=0"});
  for (const std::vector<std::string>& family : {deepseek, std::vector<std::string>{"train.checkpoint_interval=0"}}) {
    Config cfg = small_config(make_data(dir), family);
    SCOPED_TRACE(cfg.model.architecture);
    const fs::path run = dir / cfg.model.architecture;
    run_training(cfg, RunOptions{run.string(), 1, false, true});
    int64_t written = 0;
    for (const auto& f : fs::recursive_directory_iterator(run / "checkpoints" / "step_00000001"))
      if (f.is_regular_file()) written += static_cast<int64_t>(f.file_size());
    const int64_t planned = checkpoint_bytes(cfg);
    // train.save_checkpoints = false: the same run writes none, not even at the end.
    Config none = cfg;
    none.train.save_checkpoints = false;
    run_training(none, RunOptions{(run / "none").string(), 1, false, true});
    EXPECT_TRUE(latest_checkpoint((run / "none" / "checkpoints").string()).empty());
    EXPECT_EQ(read_metrics(run / "none").size(), 1u);
    const ModelSize size = model_size(cfg.model, cfg.moe, cfg.train.seq_len);
    EXPECT_LE(12 * (size.total_params + size.mtp_params), written);  // the counts are the tensors written
    EXPECT_GE(planned, written);
    EXPECT_LE(static_cast<double>(planned), 1.5 * static_cast<double>(written));
  }
}

// Hugging Face directories from elsewhere (the audit of the readers, docs/faults.md "Untrusted
// files"): rope_parameters nested 100,000 deep (config_from_hf copies it, and copies recurse), a
// size given as a float (get<int64_t>() of 1e300 is undefined behaviour), num_hidden_layers far too
// large for the loop over the layers that ran before validation, and an index naming a shard
// outside its directory.
TEST(HfImport, HostileFilesNameTheFileAndKey) {
  testing::TempDir tmp("test_train");
  const fs::path d = tmp.path() / "hf";
  fs::copy(fs::path(MOEFOLD_SOURCE_DIR) / "tests" / "fixtures" / "hf" / "qwen3_moe_a", d, fs::copy_options::recursive);
  const std::string cfg_path = (d / "config.json").string(), cfg = testing::read_bytes(cfg_path);
  ASSERT_EQ(error_of([&] { config_from_hf(d.string()); }), "");
  auto config_error = [&](const std::vector<std::pair<std::string, std::string>>& edits) {
    std::string text = cfg;
    for (const auto& [from, to] : edits) {
      const size_t at = text.find(from);
      EXPECT_NE(at, std::string::npos) << from;
      if (at != std::string::npos) text.replace(at, from.size(), to);
    }
    testing::write_bytes(cfg_path, text);
    return error_of([&] { config_from_hf(d.string()); });
  };
  const std::pair<std::vector<std::pair<std::string, std::string>>, std::string> cases[] = {
      {{{"\"rope_type\": \"default\"",
         "\"rope_type\": \"default\", \"deep\": " + std::string(100000, '[') + std::string(100000, ']')}},
       "config.json: JSON nested deeper than 64 levels"},
      {{{"\"vocab_size\": 61", "\"vocab_size\": 1e300"}},
       "config.json: 'vocab_size' must be an integer below 2^63, got 1e+300"},
      {{{"\"num_hidden_layers\": 2", "\"num_hidden_layers\": 68888888888"},
        {"\"decoder_sparse_step\": 1", "\"decoder_sparse_step\": 2"}},
       "config.json: num_hidden_layers = 68888888888 is more than 16384 layers"},
      {{{"\"mlp_only_layers\": []", "\"mlp_only_layers\": [1.5]"}},
       "config.json: 'mlp_only_layers' must be an integer"},
      {{{"\"head_dim\": 8", "\"head_dim\": 18446744073709551615"}},
       "config.json: 'head_dim' must be an integer below 2^63"},
  };
  for (const auto& [edits, needle] : cases) {
    const std::string e = config_error(edits);
    EXPECT_NE(e.find(needle), std::string::npos) << needle << " gave: " << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
  testing::write_bytes(cfg_path, cfg);
  const std::string index = (d / "model.safetensors.index.json").string();
  for (const char* file : {"../elsewhere.safetensors", "/dev/zero", ".."}) {
    testing::write_bytes(index, nlohmann::json{{"weight_map", {{"model.norm.weight", file}}}}.dump());
    const std::string e = error_of([&] { hf_mtp_depth(d.string(), 2); });
    EXPECT_NE(
        e.find(cat(index, ": weight_map['model.norm.weight'] = '", file, "' is not a file name beside the index")),
        std::string::npos)
        << e;
  }
}

}  // namespace
}  // namespace moefold

// Upcycling (train/upcycle.h): the upcycled model's step-0 logits equal the dense model's for
// several (experts, top-k, granularity), softmax and sigmoid scores; the G experts of a copy tie
// exactly, so every token selects whole copies; training continues from the upcycled run with the
// dense model's first loss; bad input fails in one line naming the key.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "moefold/core/rng.h"
#include "moefold/data/token_dataset.h"
#include "moefold/model/model.h"
#include "moefold/train/bound_model.h"
#include "moefold/train/checkpoint.h"
#include "moefold/train/evaluate.h"
#include "moefold/train/run.h"
#include "moefold/train/trainer.h"
#include "moefold/train/upcycle.h"
#include "testing.h"
#include "train_fixture.h"

namespace moefold {
namespace {

namespace fs = std::filesystem;

using testing::error_of;

// A small model whose layers are all dense (or, with `extra`, some), with weights of std 0.3
// instead of 0.02 so that the MLPs move the logits (a wrong expert would show).
Config dense_config(const std::string& data, std::vector<std::string> extra = {}) {
  std::vector<std::string> ov = {"model.vocab_size=32",
                                 "model.hidden_size=32",
                                 "model.num_hidden_layers=2",
                                 "model.num_attention_heads=2",
                                 "model.num_key_value_heads=1",
                                 "model.head_dim=16",
                                 "model.intermediate_size=24",
                                 "model.first_k_dense_replace=2",
                                 "model.initializer_range=0.3",
                                 "moe.num_experts=4",
                                 "moe.num_experts_per_tok=2",
                                 "moe.moe_intermediate_size=12",
                                 "train.seq_len=16",
                                 "train.micro_batch_size=2",
                                 "train.global_batch_size=4",
                                 "train.steps=4",
                                 "train.warmup_steps=1",
                                 "train.eval_interval=0",
                                 "train.checkpoint_interval=0",
                                 "data.valid_fraction=0.05",
                                 cat("data.path=", data)};
  ov.insert(ov.end(), extra.begin(), extra.end());
  return load_config("tiny", ov);
}

// Fresh weights of `cfg` saved as a step-0 checkpoint under DIR/checkpoints; returns its path.
std::string save_fresh(const Config& cfg, const fs::path& dir) {
  TokenDataset data = open_token_dataset(cfg.data.path);
  auto world = make_self_communicator();
  Mesh mesh = Mesh::build(*world, cfg.resolve_layout(1));
  Trainer t(cfg, data, mesh);
  t.init_fresh();
  return t.save((dir / "checkpoints").string());
}

// rows x cols random tokens (fresh each run).
std::vector<int32_t> random_tokens(int64_t rows, int64_t cols, int64_t vocab) {
  const uint64_t seed = testing::fresh_seed();
  std::vector<int32_t> t(static_cast<size_t>(rows * cols));
  for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<int32_t>(rng_below(seed, 77, i, vocab));
  return t;
}

struct LogitDiff {
  double max_diff = 0, max_logit = 0;
};

LogitDiff compare_logits(const std::string& dense_ckpt, const std::string& moe_ckpt, const std::vector<int32_t>& tokens,
                         int64_t rows, int64_t cols) {
  std::vector<float> a, b;
  evaluate_checkpoint(dense_ckpt, tokens, rows, cols, "random tokens", &a);
  evaluate_checkpoint(moe_ckpt, tokens, rows, cols, "random tokens", &b);
  EXPECT_EQ(a.size(), b.size());
  LogitDiff d;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    d.max_diff = std::max(d.max_diff, static_cast<double>(std::fabs(a[i] - b[i])));
    d.max_logit = std::max(d.max_logit, static_cast<double>(std::fabs(a[i])));
  }
  return d;
}

// A broken tie changes the logits only when it flips a selection (two copies scoring within an
// ulp), which random tokens rarely hit; so the ties themselves are checked. (With OpenBLAS's
// Prescott kernels, E = 6 gives experts 3 and 4 of one copy logits an ulp apart unless the router
// equalises them.)
// Runs the upcycled model on `tokens` (one sequence per row) and checks, in every MoE layer,
// that the G router logits of each copy are bit-identical and that each token selects whole
// copies. `copied` is an MoE layer (index among the MoE layers) that was copied, not upcycled
// (-1: none). Returns the number of MoE layers.
int64_t check_whole_copies(const std::string& ckpt, int64_t granularity, const std::vector<int32_t>& tokens,
                           int64_t rows, int64_t cols, int64_t copied = -1) {
  const Config cfg = load_config(ckpt + "/config.toml", {});
  const int64_t s = cols - 1, e_n = cfg.moe.num_experts, k_n = cfg.moe.num_experts_per_tok;
  BoundModel bound(cfg, s);
  Model& model = bound.model;
  const Tensor &ids = bound.ids, &targets = bound.targets;
  load_checkpoint(ckpt, bound.mem.params(), nullptr);
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t* seq = tokens.data() + r * cols;
    std::copy(seq, seq + s, ids.ptr<int32_t>());
    std::copy(seq + 1, seq + cols, targets.ptr<int32_t>());
    model.forward(ids, targets);
    for (int64_t i = 0; i < model.num_moe_layers(); ++i) {
      if (i == copied) continue;
      const Router& router = model.moe(i).router();
      const float* logits = router.logits().ptr<float>();
      const int32_t* idx = router.topk_idx().ptr<int32_t>();
      for (int64_t t = 0; t < s; ++t) {
        for (int64_t e = 0; e < e_n; ++e)
          if (logits[t * e_n + e] != logits[t * e_n + e / granularity * granularity]) {
            ADD_FAILURE() << "MoE layer " << i << ", token " << t << ", expert " << e
                          << ": the router logits of one copy differ";
            return -1;
          }
        std::vector<int64_t> per_copy(static_cast<size_t>(e_n / granularity));
        for (int64_t k = 0; k < k_n; ++k) ++per_copy[idx[t * k_n + k] / granularity];
        for (int64_t c : per_copy)
          if (c != 0 && c != granularity) {
            ADD_FAILURE() << "MoE layer " << i << ", token " << t << " selects part of a copy";
            return -1;
          }
      }
    }
  }
  return model.num_moe_layers();
}

struct Case {
  int64_t experts, topk, granularity;
  std::vector<std::string> extra;  // more overrides of the upcycled config
};

TEST(Upcycle, StepZeroLogitsMatchTheDenseModel) {
  testing::TempDir tmp("test_upcycle");
  const fs::path& dir = tmp.path();
  const std::string data = testing::make_train_data(dir);
  // Every layer dense; and layers 0 and 2 dense around an MoE layer 1 (experts of width 12, as
  // the upcycled ones with G = 2), which is copied as it is.
  const std::string all_dense = save_fresh(dense_config(data), dir / "dense");
  const std::string some_dense = save_fresh(
      dense_config(data,
                   {"model.num_hidden_layers=3", "model.first_k_dense_replace=0", "model.mlp_only_layers=[0, 2]"}),
      dir / "some_dense");
  const std::vector<Case> cases = {
      {4, 2, 1, {}},
      {4, 2, 2, {}},
      {8, 4, 2, {}},
      {6, 3, 3, {}},
      {4, 2, 1, {"moe.scoring_func=sigmoid"}},
      {4, 2, 2, {"moe.scoring_func=sigmoid"}},
      {8, 4, 2, {"moe.scoring_func=sigmoid"}},
      {6, 3, 3, {"moe.scoring_func=sigmoid"}},
      // DeepSeek-V3-style routing: selection bias, group-limited top-k, a routed scaling factor.
      {8,
       4,
       2,
       {"moe.scoring_func=sigmoid", "moe.expert_bias=true", "moe.n_group=2", "moe.topk_group=1",
        "moe.routed_scaling_factor=2.5"}},
      {16, 8, 4, {}},
  };
  const int64_t rows = 4, cols = 17;
  const std::vector<int32_t> tokens = random_tokens(rows, cols, 32);
  int n = 0;
  for (const Case& c : cases) {
    std::vector<std::string> ov = {cat("moe.num_experts=", c.experts), cat("moe.num_experts_per_tok=", c.topk),
                                   "moe.norm_topk_prob=true"};
    ov.insert(ov.end(), c.extra.begin(), c.extra.end());
    for (const std::string& src : {all_dense, some_dense}) {
      // Layer 1 of some_dense keeps its 4 experts of width 12 and its softmax router.
      if (src == some_dense && (c.experts != 4 || c.granularity != 2 || !c.extra.empty())) continue;
      std::string what = cat("E ", c.experts, ", K ", c.topk, ", G ", c.granularity);
      for (const std::string& x : c.extra) what += " " + x;
      what += src == some_dense ? " (layers 0 and 2 dense)" : " (every layer dense)";
      SCOPED_TRACE(what);
      const fs::path run = dir / cat("run", n++);
      const std::string ckpt = upcycle(src, run.string(), ov, c.granularity);
      EXPECT_EQ(ckpt, (run / "checkpoints" / "step_00000000").string());
      const Config up = load_config((run / "config.toml").string(), {});
      EXPECT_EQ(up.moe.moe_intermediate_size, 24 / c.granularity);
      EXPECT_TRUE(up.model.mlp_only_layers.empty());
      EXPECT_EQ(up.model.first_k_dense_replace, 0);
      const LogitDiff d = compare_logits(src, ckpt, tokens, rows, cols);
      EXPECT_GT(d.max_logit, 1.0);  // the weights are not negligible
      EXPECT_LE(d.max_diff, 1e-5 * d.max_logit) << "max |logit| " << d.max_logit;
      std::printf("[ upcycle ] %s: max |dense - upcycled| logit %.3g, max |logit| %.3g\n", what.c_str(), d.max_diff,
                  d.max_logit);
      if (src == some_dense)
        EXPECT_EQ(check_whole_copies(ckpt, c.granularity, tokens, rows, cols, 1), 3);
      else
        EXPECT_EQ(check_whole_copies(ckpt, c.granularity, tokens, rows, cols), 2);
    }
  }
}

TEST(Upcycle, LayersTheOverridesKeepDenseAreCopied) {
  testing::TempDir tmp("test_upcycle");
  const fs::path& dir = tmp.path();
  const std::string src = save_fresh(dense_config(testing::make_train_data(dir)), dir / "dense");
  const std::string ckpt = upcycle(src, (dir / "run").string(), {"model.first_k_dense_replace=1"}, 1);
  const Config up = load_config((dir / "run" / "config.toml").string(), {});
  EXPECT_TRUE(up.model.is_dense_layer(0));
  EXPECT_FALSE(up.model.is_dense_layer(1));
  const std::vector<int32_t> tokens = random_tokens(2, 17, 32);
  const LogitDiff d = compare_logits(src, ckpt, tokens, 2, 17);
  EXPECT_LE(d.max_diff, 1e-5 * d.max_logit);
  EXPECT_EQ(check_whole_copies(ckpt, 1, tokens, 2, 17), 1);
}

std::vector<nlohmann::json> read_metrics(const fs::path& run) {
  std::vector<nlohmann::json> out;
  std::ifstream f(run / "metrics.jsonl");
  std::string line;
  while (std::getline(f, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

TEST(Upcycle, TrainingContinuesFromTheDenseModelsLoss) {
  testing::TempDir tmp("test_upcycle");
  const fs::path& dir = tmp.path();
  const Config dense = dense_config(testing::make_train_data(dir));
  const std::string src = save_fresh(dense, dir / "dense");
  auto world = make_self_communicator();
  // The dense model trained from the same fresh weights (same seed): its first loss is that of
  // the checkpoint on the first batch.
  run_training(dense, RunOptions{(dir / "dense_run").string(), 2, false, true}, *world);
  const fs::path run = dir / "run";
  upcycle(src, run.string(), {"moe.num_experts=8", "moe.num_experts_per_tok=4"}, 2);
  const Config up = load_config((run / "config.toml").string(), {});
  EXPECT_EQ(run_training(up, RunOptions{run.string(), 3, true, true}, *world), 3);
  const auto a = read_metrics(dir / "dense_run"), b = read_metrics(run);
  ASSERT_EQ(a.size(), 2u);
  ASSERT_EQ(b.size(), 3u);
  const double la = a[0]["lm_loss"].get<double>(), lb = b[0]["lm_loss"].get<double>();
  EXPECT_NEAR(lb, la, 1e-5 * la);
  EXPECT_GT(b[0]["aux_loss"].get<double>(), 0.0);
  for (const auto& m : b) EXPECT_TRUE(std::isfinite(m["loss"].get<double>())) << m.dump();
  EXPECT_LT(b[2]["lm_loss"].get<double>(), lb);  // it learns
  EXPECT_FALSE(latest_checkpoint((run / "checkpoints").string()).empty());
}

TEST(Upcycle, BadInputFailsInOneLineNamingTheKey) {
  testing::TempDir tmp("test_upcycle");
  const fs::path& dir = tmp.path();
  const std::string src = save_fresh(dense_config(testing::make_train_data(dir)), dir / "dense");
  int n = 0;
  auto expect_error = [&](const std::string& from, const std::vector<std::string>& ov, int64_t g,
                          const std::vector<std::string>& needles) {
    const fs::path run = dir / cat("bad", n++);
    const std::string e = error_of([&] { upcycle(from, run.string(), ov, g); });
    SCOPED_TRACE(e);
    EXPECT_FALSE(e.empty());
    EXPECT_EQ(e.find('\n'), std::string::npos);
    for (const std::string& s : needles) EXPECT_NE(e.find(s), std::string::npos) << s;
    EXPECT_FALSE(fs::exists(run / "checkpoints"));
  };
  expect_error(src, {"moe.norm_topk_prob=false"}, 1, {"moe.norm_topk_prob = false"});
  expect_error(src, {"moe.num_experts=6", "moe.num_experts_per_tok=2"}, 4, {"moe.num_experts = 6", "granularity 4"});
  expect_error(src, {"moe.num_experts=8", "moe.num_experts_per_tok=3"}, 2, {"moe.num_experts_per_tok = 3"});
  expect_error(src, {}, 5, {"model.intermediate_size = 24", "granularity 5"});
  expect_error(src, {}, 0, {"granularity", "0"});
  expect_error(src, {"moe.n_shared_experts=1"}, 1, {"moe.n_shared_experts = 1"});
  expect_error(src, {"moe.capacity_factor=1.25"}, 1, {"moe.capacity_factor = 1.25"});
  expect_error(src, {"moe.num_experts=8", "moe.num_experts_per_tok=4", "moe.n_group=4", "moe.topk_group=2"}, 4,
               {"moe.n_group = 4"});
  expect_error(src, {"moe.moe_intermediate_size=8"}, 2, {"moe.moe_intermediate_size", "12"});
  expect_error(src, {"model.intermediate_size=48"}, 1, {"model.intermediate_size"});
  expect_error(src, {"model.hidden_size=64"}, 1, {"model.embed_tokens.weight", "[32, 32]", "[32, 64]"});
  expect_error(src, {"model.num_hidden_layers=3"}, 1, {"model.num_hidden_layers = 3"});
  expect_error(src, {"model.first_k_dense_replace=2"}, 1, {"no layer becomes MoE"});
  expect_error(src, {"moe.num_experts=x"}, 1, {"moe.num_experts"});
  expect_error((dir / "nowhere").string(), {}, 1, {"nowhere/config.toml"});
  // An MoE checkpoint has nothing to upcycle; a run directory with checkpoints is not overwritten.
  const std::string moe = upcycle(src, (dir / "run").string(), {}, 1);
  expect_error(moe, {}, 1, {"no dense layer"});
  const std::string e = error_of([&] { upcycle(src, (dir / "run").string(), {}, 1); });
  EXPECT_NE(e.find("already holds checkpoints"), std::string::npos) << e;
  EXPECT_EQ(latest_checkpoint((dir / "run" / "checkpoints").string()), moe);
}

}  // namespace
}  // namespace moefold

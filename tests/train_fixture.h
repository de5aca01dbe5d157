// A small learnable dataset and a small config for training tests (one rank and multi-rank).
#pragma once

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "moefold/comm/communicator.h"
#include "moefold/core/rng.h"
#include "moefold/data/token_dataset.h"
#include "moefold/model/config.h"
#include "moefold/parallel/mesh.h"

namespace moefold::testing {

// A repeating pattern with 10% noise, vocabulary 32, written as DIR/data.tokens.
inline std::string make_train_data(const std::filesystem::path& dir, size_t tokens = 20000) {
  std::vector<uint32_t> toks(tokens);
  for (size_t i = 0; i < toks.size(); ++i)
    toks[i] =
        rng_uniform(9, 0, i) < 0.1 ? static_cast<uint32_t>(rng_below(9, 1, i, 32)) : static_cast<uint32_t>(i % 17);
  std::string p = (dir / "data.tokens").string();
  write_token_file(p, toks, 2);
  return p;
}

// 2 layers, hidden 16, 4 experts top-2, 4 sequences of 16 tokens per step.
inline Config small_train_config(const std::string& data, std::vector<std::string> extra = {}) {
  std::vector<std::string> ov = {
      "model.vocab_size=32",         "model.hidden_size=16",         "model.num_hidden_layers=2",
      "model.num_attention_heads=2", "model.num_key_value_heads=1",  "model.head_dim=8",
      "moe.num_experts=4",           "moe.moe_intermediate_size=12", "train.seq_len=16",
      "train.micro_batch_size=2",    "train.global_batch_size=4",    "train.steps=12",
      "train.warmup_steps=2",        "train.eval_interval=4",        "train.eval_batches=2",
      "train.checkpoint_interval=5", "moe.router_z_loss_coef=0.001", "data.valid_fraction=0.05",
      cat("data.path=", data)};
  ov.insert(ov.end(), extra.begin(), extra.end());
  return load_config("tiny", ov);
}

// One rank, no MPI: the communicator and the mesh a Trainer of `cfg` needs.
struct OneRank {
  std::unique_ptr<Communicator> world = make_self_communicator();
  Mesh mesh;
  explicit OneRank(const Config& cfg) : mesh(Mesh::build(*world, cfg.resolve_layout(1))) {}
};

}  // namespace moefold::testing

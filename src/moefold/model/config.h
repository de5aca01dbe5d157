// Run configuration: the [model], [moe], [train] and [data] sections of a TOML file, built-in
// presets, and `--set section.key=value` overrides. Keys are named as Hugging Face names them
// where a name exists. Every mistake is a moefold::Error naming the file/flag, key and value.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moefold/moe/moe_config.h"
#include "moefold/parallel/parallel_config.h"

namespace moefold {

struct ModelConfig {
  std::string architecture = "qwen3_moe";  // only Qwen3-MoE for now
  int64_t vocab_size = 320;                // rows of the embedding and LM head (>= tokenizer vocab)
  int64_t hidden_size = 128;               // H
  int64_t num_hidden_layers = 4;           // decoder layers, each attention + MoE
  int64_t num_attention_heads = 4;         // query heads
  int64_t num_key_value_heads = 2;         // kv heads (grouped-query attention)
  int64_t head_dim = 32;                   // D
  int64_t max_position_embeddings = 4096;  // longest sequence the RoPE table is built for
  double rms_norm_eps = 1e-6;              // RMSNorm epsilon (layer norms and q/k norms)
  double rope_theta = 1e6;                 // RoPE base
  double initializer_range = 0.02;         // std of the normal init of every matrix

  void validate() const;
};

struct TrainConfig {
  int64_t seq_len = 128;           // tokens per sequence
  int64_t micro_batch_size = 8;    // sequences per forward/backward
  int64_t global_batch_size = 16;  // sequences per optimizer step (multiple of micro_batch_size)
  int64_t steps = 600;             // default number of optimizer steps (--steps overrides)
  double lr = 3e-3;                // peak learning rate
  double min_lr = 3e-4;            // cosine floor
  int64_t warmup_steps = 30;       // linear warmup from 0
  double weight_decay = 0.1;       // AdamW decoupled decay (not applied to norms)
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.95;
  double adam_eps = 1e-8;
  double grad_clip = 1.0;             // global-norm clipping threshold (<= 0: off)
  int64_t eval_interval = 100;        // evaluate every N steps (0: never, except at the end)
  int64_t eval_batches = 4;           // held-out micro-batches per evaluation
  int64_t checkpoint_interval = 200;  // checkpoint every N steps (0: only at the end)
  uint64_t seed = 1234;               // init, data order

  void validate() const;
};

struct DataConfig {
  std::string path;                // .tokens file or Megatron .bin/.idx prefix; empty: default corpus
  double valid_fraction = 0.01;    // tail of the token stream held out for evaluation
  std::string default_corpus_dir;  // where the default corpus is read from (empty: built-in choice)

  void validate() const;
};

struct Config {
  ModelConfig model;
  MoeConfig moe;
  TrainConfig train;
  DataConfig data;
  ParallelConfig parallel;
  std::string preset = "tiny";  // the preset this config derives from

  // Cross-section checks (top-k <= experts is in MoeConfig; heads dividing, etc.).
  void validate() const;
  // The layout for `world` ranks (parallel.dp derived when 0), with every constraint between the
  // layout, the model and the batch checked. Throws Error naming the numbers that do not divide.
  ParallelConfig resolve_layout(int64_t world) const;
};

// Names of the built-in presets: "tiny" (default), "qwen3-30b-a3b", "qwen3-235b-a22b".
std::vector<std::string> preset_names();
// REQUIRES: a known name (else Error listing the known ones).
Config preset_config(const std::string& name);

// `spec` is a preset name or a TOML file; the file may start with `preset = "NAME"` to derive
// from a preset (default "tiny"). `overrides` are "section.key=value" strings (TOML values; a
// bare word is taken as a string). The result is validated.
Config load_config(const std::string& spec, const std::vector<std::string>& overrides);

// The config as TOML (every key), for run directories and checkpoints.
std::string config_to_toml(const Config& c);

// Parameter counts and model FLOPs (formulas in ../shared/BENCHMARKS.md).
struct ModelSize {
  int64_t total_params = 0;
  int64_t active_params = 0;           // with K of E experts
  double train_flops_per_token = 0.0;  // 3 x forward, at the given sequence length
};
ModelSize model_size(const ModelConfig& m, const MoeConfig& e, int64_t seq_len);

}  // namespace moefold

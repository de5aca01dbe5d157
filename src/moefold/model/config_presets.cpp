// The built-in presets (config.h: preset_names, preset_config): "tiny" is Config's defaults; the
// full-size presets are the published models' shapes (their Hugging Face config.json) on one
// shared pre-training base.
#include "moefold/core/error.h"
#include "moefold/model/config.h"

namespace moefold {

namespace {

// The training settings of every full-size preset: 4096-token sequences, 1024 per step (4M
// tokens), cosine from 3e-4 to 3e-5 after 2000 warmup steps, over 100k steps (~420B tokens),
// evaluated and checkpointed every 1000. Model sections: tiny's until the preset sets them.
Config full_size_base(const std::string& name) {
  Config c;
  c.preset = name;
  TrainConfig& t = c.train;
  t.seq_len = 4096;
  t.micro_batch_size = 1;
  t.global_batch_size = 1024;
  t.lr = 3e-4;
  t.min_lr = 3e-5;
  t.warmup_steps = 2000;
  t.steps = 100000;
  t.eval_interval = 1000;
  t.checkpoint_interval = 1000;
  t.expert_load_interval = 100;
  return c;
}

// What every full-size preset states, from its model's published config.json: the transformer's
// shape and the MoE layer's basics. The rest: Config's defaults, unless the preset sets it.
struct Shape {
  std::string architecture;
  int64_t vocab_size, hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim;
  int64_t max_position_embeddings;
  double rope_theta;
  double rms_norm_eps = ModelConfig{}.rms_norm_eps;
  int64_t num_experts, num_experts_per_tok, moe_intermediate_size;
  double aux_loss_coeff;  // moe.router_aux_loss_coef
};

Config full_size(const std::string& name, const Shape& s) {
  Config c = full_size_base(name);
  ModelConfig& m = c.model;
  m.architecture = s.architecture;
  m.vocab_size = s.vocab_size;
  m.hidden_size = s.hidden_size;
  m.num_hidden_layers = s.num_hidden_layers;
  m.num_attention_heads = s.num_attention_heads;
  m.num_key_value_heads = s.num_key_value_heads;
  m.head_dim = s.head_dim;
  m.max_position_embeddings = s.max_position_embeddings;
  m.rope_theta = s.rope_theta;
  m.rms_norm_eps = s.rms_norm_eps;
  c.moe.num_experts = s.num_experts;
  c.moe.num_experts_per_tok = s.num_experts_per_tok;
  c.moe.moe_intermediate_size = s.moe_intermediate_size;
  c.moe.aux_loss_coeff = s.aux_loss_coeff;
  return c;
}

// Qwen3-30B-A3B and Qwen3-235B-A22B (Qwen/Qwen3-*/config.json).
Config qwen3(const std::string& name, bool big) {
  Config c = full_size(name, {.architecture = "qwen3_moe",
                              .vocab_size = 151936,
                              .hidden_size = big ? 4096 : 2048,
                              .num_hidden_layers = big ? 94 : 48,
                              .num_attention_heads = big ? 64 : 32,
                              .num_key_value_heads = 4,
                              .head_dim = 128,
                              .max_position_embeddings = 40960,
                              .rope_theta = 1e6,
                              .num_experts = 128,
                              .num_experts_per_tok = 8,
                              .moe_intermediate_size = big ? 1536 : 768,
                              .aux_loss_coeff = 1e-3});
  c.moe.norm_topk_prob = true;
  // Training from scratch: the published 0.001 leaves the busiest expert at 3.6-5.4 x the mean
  // after 300 steps (4 layers, 32k tokens per step); 0.02 brings it to <= 1.8 x with a lower
  // LM loss (docs/expert-load.md). Imported checkpoints keep their config.json's coefficient.
  c.moe.aux_loss_coeff = 2e-2;
  return c;
}

// DeepSeek-V3 (deepseek-ai/DeepSeek-V3/config.json): MLA, YaRN, 3 dense layers, a shared expert,
// sigmoid routing with group limits and a selection bias (no auxiliary loss but a small
// sequence-level one), one MTP depth.
Config deepseek_v3() {
  Config c = full_size("deepseek-v3", {.architecture = "deepseek_v3",
                                       .vocab_size = 129280,
                                       .hidden_size = 7168,
                                       .num_hidden_layers = 61,
                                       .num_attention_heads = 128,
                                       .num_key_value_heads = 128,
                                       .head_dim = 64,  // the rotary part: qk_rope_head_dim
                                       .max_position_embeddings = 163840,
                                       .rope_theta = 10000,
                                       .num_experts = 256,
                                       .num_experts_per_tok = 8,
                                       .moe_intermediate_size = 2048,
                                       .aux_loss_coeff = 0});
  ModelConfig& m = c.model;
  m.qk_rope_head_dim = 64;
  m.qk_nope_head_dim = 128;
  m.v_head_dim = 128;
  m.q_lora_rank = 1536;
  m.kv_lora_rank = 512;
  m.rope_interleave = true;
  m.rope_type = "yarn";
  m.rope_factor = 40;
  m.rope_original_max_position_embeddings = 4096;
  m.rope_mscale = m.rope_mscale_all_dim = 1.0;
  m.intermediate_size = 18432;
  m.first_k_dense_replace = 3;
  m.num_nextn_predict_layers = 1;
  m.mtp_loss_scaling_factor = 0.1;
  MoeConfig& e = c.moe;
  e.n_shared_experts = 1;
  e.scoring_func = ScoreFunc::sigmoid;
  e.routed_scaling_factor = 2.5;
  e.n_group = 8;
  e.topk_group = 4;
  e.expert_bias = true;
  // DeepSeek's 0.001 cannot keep up at this initialisation: every token of a layer ends on one
  // expert within 100 steps (transformers' DeepSeek-V3 with the same rule too); 0.01 keeps the
  // busiest expert <= 2 x the mean (docs/expert-load.md).
  e.expert_bias_update_rate = 1e-2;
  e.seq_aux_loss_coeff = 1e-4;
  return c;
}

// Mixtral-8x7B (mistralai/Mixtral-8x7B-v0.1/config.json).
Config mixtral_8x7b() {
  return full_size("mixtral-8x7b", {.architecture = "mixtral",
                                    .vocab_size = 32000,
                                    .hidden_size = 4096,
                                    .num_hidden_layers = 32,
                                    .num_attention_heads = 32,
                                    .num_key_value_heads = 8,
                                    .head_dim = 128,
                                    .max_position_embeddings = 32768,
                                    .rope_theta = 1e6,
                                    .rms_norm_eps = 1e-5,
                                    .num_experts = 8,
                                    .num_experts_per_tok = 2,
                                    .moe_intermediate_size = 14336,
                                    .aux_loss_coeff = 2e-2});
}

// OLMoE-1B-7B (allenai/OLMoE-1B-7B-0924/config.json): no renormalisation of the top-K
// probabilities, a router z-loss.
Config olmoe_1b_7b() {
  Config c = full_size("olmoe-1b-7b", {.architecture = "olmoe",
                                       .vocab_size = 50304,
                                       .hidden_size = 2048,
                                       .num_hidden_layers = 16,
                                       .num_attention_heads = 16,
                                       .num_key_value_heads = 16,
                                       .head_dim = 128,
                                       .max_position_embeddings = 4096,
                                       .rope_theta = 10000,
                                       .rms_norm_eps = 1e-5,
                                       .num_experts = 64,
                                       .num_experts_per_tok = 8,
                                       .moe_intermediate_size = 1024,
                                       .aux_loss_coeff = 1e-2});
  c.moe.norm_topk_prob = false;
  c.moe.z_loss_coeff = 1e-3;
  return c;
}

}  // namespace

std::vector<std::string> preset_names() {
  return {"tiny", "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "mixtral-8x7b", "olmoe-1b-7b"};
}

Config preset_config(const std::string& name) {
  if (name == "tiny") return Config{};  // the defaults are the tiny preset
  if (name == "qwen3-30b-a3b") return qwen3(name, false);
  if (name == "qwen3-235b-a22b") return qwen3(name, true);
  if (name == "deepseek-v3") return deepseek_v3();
  if (name == "mixtral-8x7b") return mixtral_8x7b();
  if (name == "olmoe-1b-7b") return olmoe_1b_7b();
  std::string known;
  for (const auto& n : preset_names()) known += (known.empty() ? "" : ", ") + n;
  MF_FAIL("unknown preset '", name, "' (known: ", known, ")");
}

}  // namespace moefold

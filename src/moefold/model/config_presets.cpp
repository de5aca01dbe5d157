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
  return c;
}

// Qwen3-30B-A3B and Qwen3-235B-A22B (Qwen/Qwen3-*/config.json).
Config qwen3(const std::string& name, bool big) {
  Config c = full_size_base(name);
  ModelConfig& m = c.model;
  m.vocab_size = 151936;
  m.hidden_size = big ? 4096 : 2048;
  m.num_hidden_layers = big ? 94 : 48;
  m.num_attention_heads = big ? 64 : 32;
  m.num_key_value_heads = 4;
  m.head_dim = 128;
  m.max_position_embeddings = 40960;
  m.rope_theta = 1e6;
  MoeConfig& e = c.moe;
  e.num_experts = 128;
  e.num_experts_per_tok = 8;
  e.moe_intermediate_size = big ? 1536 : 768;
  e.norm_topk_prob = true;
  e.aux_loss_coeff = 1e-3;
  return c;
}

// DeepSeek-V3 (deepseek-ai/DeepSeek-V3/config.json): MLA, YaRN, 3 dense layers, a shared expert,
// sigmoid routing with group limits and a selection bias, one MTP depth.
Config deepseek_v3() {
  Config c = full_size_base("deepseek-v3");
  ModelConfig& m = c.model;
  m.architecture = "deepseek_v3";
  m.vocab_size = 129280;
  m.hidden_size = 7168;
  m.num_hidden_layers = 61;
  m.num_attention_heads = m.num_key_value_heads = 128;
  m.head_dim = m.qk_rope_head_dim = 64;
  m.qk_nope_head_dim = 128;
  m.v_head_dim = 128;
  m.q_lora_rank = 1536;
  m.kv_lora_rank = 512;
  m.rope_interleave = true;
  m.rope_theta = 10000;
  m.rope_type = "yarn";
  m.rope_factor = 40;
  m.rope_original_max_position_embeddings = 4096;
  m.rope_mscale = m.rope_mscale_all_dim = 1.0;
  m.max_position_embeddings = 163840;
  m.intermediate_size = 18432;
  m.first_k_dense_replace = 3;
  m.num_nextn_predict_layers = 1;
  m.mtp_loss_scaling_factor = 0.1;
  MoeConfig& e = c.moe;
  e.num_experts = 256;
  e.num_experts_per_tok = 8;
  e.moe_intermediate_size = 2048;
  e.n_shared_experts = 1;
  e.scoring_func = ScoreFunc::sigmoid;
  e.routed_scaling_factor = 2.5;
  e.n_group = 8;
  e.topk_group = 4;
  e.expert_bias = true;
  e.aux_loss_coeff = 0;
  e.seq_aux_loss_coeff = 1e-4;
  return c;
}

// Mixtral-8x7B (mistralai/Mixtral-8x7B-v0.1/config.json).
Config mixtral_8x7b() {
  Config c = full_size_base("mixtral-8x7b");
  ModelConfig& m = c.model;
  m.architecture = "mixtral";
  m.vocab_size = 32000;
  m.hidden_size = 4096;
  m.num_hidden_layers = 32;
  m.num_attention_heads = 32;
  m.num_key_value_heads = 8;
  m.head_dim = 128;
  m.rope_theta = 1e6;
  m.max_position_embeddings = 32768;
  m.rms_norm_eps = 1e-5;
  MoeConfig& e = c.moe;
  e.num_experts = 8;
  e.num_experts_per_tok = 2;
  e.moe_intermediate_size = 14336;
  e.aux_loss_coeff = 2e-2;
  return c;
}

// OLMoE-1B-7B (allenai/OLMoE-1B-7B-0924/config.json).
Config olmoe_1b_7b() {
  Config c = full_size_base("olmoe-1b-7b");
  ModelConfig& m = c.model;
  m.architecture = "olmoe";
  m.vocab_size = 50304;
  m.hidden_size = 2048;
  m.num_hidden_layers = 16;
  m.num_attention_heads = m.num_key_value_heads = 16;
  m.head_dim = 128;
  m.rope_theta = 10000;
  m.max_position_embeddings = 4096;
  m.rms_norm_eps = 1e-5;
  MoeConfig& e = c.moe;
  e.num_experts = 64;
  e.num_experts_per_tok = 8;
  e.moe_intermediate_size = 1024;
  e.norm_topk_prob = false;
  e.aux_loss_coeff = 1e-2;
  e.z_loss_coeff = 1e-3;
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

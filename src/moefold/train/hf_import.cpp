#include "moefold/train/hf_import.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>
#include <vector>

#include "moefold/comm/communicator.h"
#include "moefold/io/json_limits.h"
#include "moefold/io/safetensors.h"
#include "moefold/model/hf_names.h"
#include "moefold/model/model.h"
#include "moefold/train/bound_model.h"
#include "moefold/train/checkpoint.h"
#include "moefold/train/optimizer.h"

namespace moefold {

namespace fs = std::filesystem;

namespace {

nlohmann::json read_json_file(const std::string& path) {
  std::ifstream f(path);
  if (!f) MF_FAIL(path, ": cannot open");
  try {
    return parse_json_limited<nlohmann::json>(path, f);
  } catch (const nlohmann::json::exception& e) {
    MF_FAIL(path, ": not valid JSON (", e.what(), ")");
  }
}

}  // namespace

namespace {

// Hugging Face architecture name <-> model.architecture.
const std::vector<std::pair<std::string, std::string>>& families() {
  static const std::vector<std::pair<std::string, std::string>> f = {{"Qwen3MoeForCausalLM", "qwen3_moe"},
                                                                     {"MixtralForCausalLM", "mixtral"},
                                                                     {"OlmoeForCausalLM", "olmoe"},
                                                                     {"DeepseekV3ForCausalLM", "deepseek_v3"}};
  return f;
}

// "model.layers.12.mlp.gate.weight" -> "mlp.gate.weight"; other names unchanged.
std::string layer_free_name(const std::string& name) {
  const std::string prefix = "model.layers.";
  if (!name.starts_with(prefix)) return name;
  const size_t dot = name.find('.', prefix.size());
  return dot == std::string::npos ? name : name.substr(dot + 1);
}

}  // namespace

Config config_from_hf(const std::string& hf_dir) {
  const std::string path = hf_dir + "/config.json";
  const nlohmann::json j = read_json_file(path);
  Config c = preset_config("tiny");
  ModelConfig& m = c.model;
  MoeConfig& e = c.moe;
  auto req = [&](const char* key) -> const nlohmann::json& {
    if (!j.contains(key) || j[key].is_null()) MF_FAIL(path, ": missing key '", key, "'");
    return j.at(key);
  };
  auto req_int = [&](const char* key) { return json_int64(req(key), path, key); };
  auto int_or = [&](const char* key, int64_t dflt) {
    return j.contains(key) && !j[key].is_null() ? json_int64(j[key], path, key) : dflt;
  };
  auto refuse_if = [&](bool cond, const std::string& what) {
    if (cond) MF_FAIL(path, ": ", what, " is not supported");
  };
  try {
    const std::string arch = j.contains("architectures") && !j["architectures"].empty()
                                 ? j["architectures"][0].get<std::string>()
                                 : std::string("(none)");
    std::string known;
    for (const auto& [hf, ours] : families()) {
      if (hf == arch) m.architecture = ours;
      known += (known.empty() ? "" : ", ") + hf;
    }
    if (std::none_of(families().begin(), families().end(), [&](const auto& f) { return f.first == arch; }))
      MF_FAIL(path, ": architecture '", arch, "' is not supported (supported: ", known, ")");
    const std::string& a = m.architecture;
    m.vocab_size = req_int("vocab_size");
    m.hidden_size = req_int("hidden_size");
    m.num_hidden_layers = req_int("num_hidden_layers");
    m.num_attention_heads = req_int("num_attention_heads");
    m.num_key_value_heads = int_or("num_key_value_heads", m.num_attention_heads);
    m.head_dim = int_or("head_dim", m.hidden_size / std::max<int64_t>(1, m.num_attention_heads));
    m.max_position_embeddings = req_int("max_position_embeddings");
    m.rms_norm_eps = req("rms_norm_eps").get<double>();
    m.initializer_range = j.value("initializer_range", m.initializer_range);
    const std::string dtype = j.contains("dtype") && !j["dtype"].is_null() ? j["dtype"].get<std::string>()
                              : j.contains("torch_dtype") && !j["torch_dtype"].is_null()
                                  ? j["torch_dtype"].get<std::string>()
                                  : std::string("float32");
    refuse_if(dtype != "float32" && dtype != "bfloat16", cat("dtype '", dtype, "' (float32, bfloat16)"));
    m.torch_dtype = dtype;
    // RoPE: transformers >= 5 writes rope_parameters; older files rope_theta and rope_scaling.
    nlohmann::json rope = j.contains("rope_parameters") && !j["rope_parameters"].is_null()
                              ? j["rope_parameters"]
                              : (j.contains("rope_scaling") && !j["rope_scaling"].is_null() ? j["rope_scaling"]
                                                                                            : nlohmann::json::object());
    m.rope_theta = rope.contains("rope_theta") ? rope["rope_theta"].get<double>() : req("rope_theta").get<double>();
    const std::string rope_type = rope.value("rope_type", rope.value("type", std::string("default")));
    if (rope_type == "yarn") {
      m.rope_type = "yarn";
      m.rope_factor = rope.at("factor").get<double>();
      m.rope_original_max_position_embeddings =
          json_int64(rope.at("original_max_position_embeddings"), path, "original_max_position_embeddings");
      auto num = [&](const char* k, double d) {
        return rope.contains(k) && !rope[k].is_null() ? rope[k].get<double>() : d;
      };
      m.rope_beta_fast = num("beta_fast", 32.0);
      m.rope_beta_slow = num("beta_slow", 1.0);
      m.rope_mscale = num("mscale", 0.0);
      m.rope_mscale_all_dim = num("mscale_all_dim", 0.0);
      refuse_if(rope.contains("attention_factor") && !rope["attention_factor"].is_null(),
                "rope_parameters.attention_factor");
      refuse_if(!rope.value("truncate", true), "rope_parameters.truncate = false");
    } else if (rope_type != "default") {
      MF_FAIL(path, ": rope type '", rope_type, "' is not supported (default, yarn)");
    }
    refuse_if(j.value("attention_bias", false), "attention_bias = true");
    refuse_if(j.value("tie_word_embeddings", false), "tie_word_embeddings = true");
    refuse_if(j.value("hidden_act", std::string("silu")) != "silu",
              cat("hidden_act '", j.value("hidden_act", std::string()), "' (silu)"));
    refuse_if(j.value("use_sliding_window", false) ||
                  (a == "mixtral" && j.contains("sliding_window") && !j["sliding_window"].is_null()),
              "sliding-window attention");
    m.num_nextn_predict_layers = 0;  // set by import_hf from the tensors present
    e.num_experts_per_tok = req_int("num_experts_per_tok");
    e.aux_loss_coeff = j.value("router_aux_loss_coef", 0.0);
    e.scoring_func = ScoreFunc::softmax;
    if (a == "qwen3_moe") {
      e.num_experts =
          j.contains("num_experts") ? json_int64(j["num_experts"], path, "num_experts") : req_int("num_local_experts");
      e.moe_intermediate_size = req_int("moe_intermediate_size");
      e.norm_topk_prob = j.value("norm_topk_prob", false);
      m.intermediate_size = int_or("intermediate_size", 0);
      // HF: layer l is sparse iff l is not in mlp_only_layers and (l + 1) % decoder_sparse_step == 0.
      const int64_t step = int_or("decoder_sparse_step", 1);
      refuse_if(step < 1, "decoder_sparse_step < 1");
      std::vector<int64_t> only;
      if (j.contains("mlp_only_layers") && !j["mlp_only_layers"].is_null()) {
        if (!j["mlp_only_layers"].is_array()) MF_FAIL(path, ": 'mlp_only_layers' must be an array of integers");
        for (const auto& l : j["mlp_only_layers"]) only.push_back(json_int64(l, path, "mlp_only_layers"));
      }
      // Bounded before this loop (validate() bounds it too, but last).
      if (m.num_hidden_layers > ModelConfig::kMaxLayers)
        MF_FAIL(path, ": num_hidden_layers = ", m.num_hidden_layers, " is more than ", ModelConfig::kMaxLayers,
                " layers");
      for (int64_t l = 0; l < m.num_hidden_layers; ++l)
        if ((l + 1) % step != 0 && std::find(only.begin(), only.end(), l) == only.end()) only.push_back(l);
      std::sort(only.begin(), only.end());
      m.mlp_only_layers = only;
    } else if (a == "mixtral") {
      e.num_experts = req_int("num_local_experts");
      e.moe_intermediate_size = req_int("intermediate_size");  // Mixtral's experts' width
      e.norm_topk_prob = true;  // softmax over the top-k logits = renormalised top-k of the softmax
      refuse_if(j.value("router_jitter_noise", 0.0) != 0.0, "router_jitter_noise != 0");
    } else if (a == "olmoe") {
      e.num_experts = req_int("num_experts");
      e.moe_intermediate_size = req_int("intermediate_size");
      e.norm_topk_prob = j.value("norm_topk_prob", false);
      refuse_if(j.contains("clip_qkv") && !j["clip_qkv"].is_null(), "clip_qkv");
    } else {  // deepseek_v3
      e.num_experts = req_int("n_routed_experts");
      e.moe_intermediate_size = req_int("moe_intermediate_size");
      e.norm_topk_prob = j.value("norm_topk_prob", true);
      e.scoring_func = ScoreFunc::sigmoid;
      refuse_if(j.value("scoring_func", std::string("sigmoid")) != "sigmoid", "scoring_func other than sigmoid");
      refuse_if(j.value("topk_method", std::string("noaux_tc")) != "noaux_tc", "topk_method other than noaux_tc");
      e.expert_bias = true;
      e.routed_scaling_factor = j.value("routed_scaling_factor", 1.0);
      e.n_group = int_or("n_group", 1);
      e.topk_group = int_or("topk_group", 1);
      e.n_shared_experts = int_or("n_shared_experts", 0);
      e.aux_loss_coeff = 0.0;
      e.seq_aux_loss_coeff = j.value("seq_aux", false) ? j.value("aux_loss_alpha", 0.0) : 0.0;
      m.intermediate_size = req_int("intermediate_size");
      m.first_k_dense_replace = int_or("first_k_dense_replace", 0);
      m.q_lora_rank = int_or("q_lora_rank", 0);
      m.kv_lora_rank = req_int("kv_lora_rank");
      m.qk_nope_head_dim = req_int("qk_nope_head_dim");
      m.qk_rope_head_dim = req_int("qk_rope_head_dim");
      m.v_head_dim = req_int("v_head_dim");
      m.head_dim = m.qk_rope_head_dim;
      m.rope_interleave = j.value("rope_interleave", true);
    }
  } catch (const nlohmann::json::exception& ex) {
    MF_FAIL(path, ": wrong value type (", ex.what(), ")");
  }
  c.train.seq_len = std::min<int64_t>(c.train.seq_len, c.model.max_position_embeddings);
  try {
    c.validate();
  } catch (const Error& ex) {
    MF_FAIL(path, ": ", ex.what());
  }
  return c;
}

nlohmann::json config_to_hf(const Config& cfg) {
  const ModelConfig& m = cfg.model;
  const MoeConfig& e = cfg.moe;
  std::string arch;
  for (const auto& [hf, ours] : families())
    if (ours == m.architecture) arch = hf;
  nlohmann::json rope = {{"rope_type", m.rope_type}, {"rope_theta", m.rope_theta}};
  if (m.rope_type == "yarn") {
    rope["factor"] = m.rope_factor;
    rope["original_max_position_embeddings"] = m.rope_original_max_position_embeddings;
    rope["beta_fast"] = m.rope_beta_fast;
    rope["beta_slow"] = m.rope_beta_slow;
    if (m.rope_mscale > 0) rope["mscale"] = m.rope_mscale;
    if (m.rope_mscale_all_dim > 0) rope["mscale_all_dim"] = m.rope_mscale_all_dim;
  }
  nlohmann::json j = {{"architectures", {arch}},
                      {"model_type", m.architecture},
                      {"vocab_size", m.vocab_size},
                      {"hidden_size", m.hidden_size},
                      {"num_hidden_layers", m.num_hidden_layers},
                      {"num_attention_heads", m.num_attention_heads},
                      {"num_key_value_heads", m.num_key_value_heads},
                      {"head_dim", m.head_dim},
                      {"max_position_embeddings", m.max_position_embeddings},
                      {"rms_norm_eps", m.rms_norm_eps},
                      {"rope_parameters", rope},
                      {"initializer_range", m.initializer_range},
                      {"num_experts_per_tok", e.num_experts_per_tok},
                      {"router_aux_loss_coef", e.aux_loss_coeff},
                      {"hidden_act", "silu"},
                      {"attention_bias", false},
                      {"tie_word_embeddings", false},
                      {"dtype", m.torch_dtype}};
  const auto& a = m.architecture;
  auto need = [&](bool ok, const std::string& what) {
    if (!ok) MF_FAIL(arch, " cannot express ", what);
  };
  need(e.n_group == 1 || a == "deepseek_v3", "group-limited routing (moe.n_group)");
  need(!e.expert_bias || a == "deepseek_v3", "a selection bias (moe.expert_bias)");
  need(e.n_shared_experts == 0 || a == "deepseek_v3", "shared experts (moe.n_shared_experts)");
  need(m.first_k_dense_replace == 0 || a == "deepseek_v3", "model.first_k_dense_replace");
  need(m.mlp_only_layers.empty() || a == "qwen3_moe", "model.mlp_only_layers");
  need((e.scoring_func == ScoreFunc::sigmoid) == (a == "deepseek_v3"), "this moe.scoring_func");
  need(e.routed_scaling_factor == 1.0 || a == "deepseek_v3", "moe.routed_scaling_factor != 1");
  need(m.num_nextn_predict_layers == 0 || a == "deepseek_v3", "multi-token prediction");
  if (a == "qwen3_moe") {
    j["num_experts"] = e.num_experts;
    j["moe_intermediate_size"] = e.moe_intermediate_size;
    j["norm_topk_prob"] = e.norm_topk_prob;
    j["decoder_sparse_step"] = 1;
    j["mlp_only_layers"] = m.mlp_only_layers;
    if (m.intermediate_size > 0) j["intermediate_size"] = m.intermediate_size;
  } else if (a == "mixtral") {
    need(e.norm_topk_prob, "top-k probabilities without renormalisation");
    j["num_local_experts"] = e.num_experts;
    j["intermediate_size"] = e.moe_intermediate_size;
    j["sliding_window"] = nullptr;
  } else if (a == "olmoe") {
    j["num_experts"] = e.num_experts;
    j["intermediate_size"] = e.moe_intermediate_size;
    j["norm_topk_prob"] = e.norm_topk_prob;
    j["clip_qkv"] = nullptr;
  } else {
    need(e.expert_bias, "routing without the selection bias");
    j["n_routed_experts"] = e.num_experts;
    j["moe_intermediate_size"] = e.moe_intermediate_size;
    j["intermediate_size"] = m.intermediate_size;
    j["norm_topk_prob"] = e.norm_topk_prob;
    j["routed_scaling_factor"] = e.routed_scaling_factor;
    j["n_group"] = e.n_group;
    j["topk_group"] = e.topk_group;
    j["n_shared_experts"] = e.n_shared_experts;
    j["first_k_dense_replace"] = m.first_k_dense_replace;
    j["q_lora_rank"] = m.q_lora_rank > 0 ? nlohmann::json(m.q_lora_rank) : nlohmann::json(nullptr);
    j["kv_lora_rank"] = m.kv_lora_rank;
    j["qk_nope_head_dim"] = m.qk_nope_head_dim;
    j["qk_rope_head_dim"] = m.qk_rope_head_dim;
    j["v_head_dim"] = m.v_head_dim;
    j["rope_interleave"] = m.rope_interleave;
    j["num_nextn_predict_layers"] = m.num_nextn_predict_layers;
    j["scoring_func"] = "sigmoid";
    j["topk_method"] = "noaux_tc";
    j["seq_aux"] = e.seq_aux_loss_coeff > 0;
    j["aux_loss_alpha"] = e.seq_aux_loss_coeff;
  }
  return j;
}

namespace {

// Tensor name -> file, from the index when sharded.
std::map<std::string, std::string> hf_tensor_files(const std::string& hf_dir) {
  std::map<std::string, std::string> where;
  const std::string index = hf_dir + "/model.safetensors.index.json";
  if (fs::exists(index)) {
    const nlohmann::json j = read_json_file(index);
    try {
      for (const auto& [t, f] : j.at("weight_map").items()) where[t] = f.get<std::string>();
    } catch (const nlohmann::json::exception& e) {
      MF_FAIL(index, ": malformed index (", e.what(), ")");
    }
    // Shards lie beside the index: a name with a directory ("../x", "/dev/...") would read elsewhere.
    for (const auto& [t, f] : where)
      if (f.empty() || f == "." || f == ".." || f.find('/') != std::string::npos)
        MF_FAIL(index, ": weight_map['", t, "'] = '", f, "' is not a file name beside the index");
  } else if (fs::exists(hf_dir + "/model.safetensors")) {
    SafetensorsReader r(hf_dir + "/model.safetensors");
    for (const SafetensorsTensor& t : r.tensors()) where[t.name] = "model.safetensors";
  } else {
    MF_FAIL(hf_dir, ": no model.safetensors nor model.safetensors.index.json");
  }
  return where;
}

// DeepSeek-V3 stores, for each multi-token-prediction layer, copies of the embedding and the LM
// head ("model.layers.{L+k-1}.embed_tokens.weight", ".shared_head.head.weight"); moefold shares
// the main ones. The main tensor a copy's name stands for ("" when the name is not a copy).
std::string shared_copy_of(const std::string& name) {
  if (!name.starts_with("model.layers.")) return "";
  if (name.ends_with(".embed_tokens.weight")) return "model.embed_tokens.weight";
  if (name.ends_with(".shared_head.head.weight")) return "lm_head.weight";
  return "";
}

}  // namespace

int64_t hf_mtp_depth(const std::string& hf_dir, int64_t num_hidden_layers) {
  const std::map<std::string, std::string> where = hf_tensor_files(hf_dir);
  int64_t d = 0;
  while (where.count(cat("model.layers.", num_hidden_layers + d, ".eh_proj.weight"))) ++d;
  return d;
}

void load_hf_weights(const std::string& hf_dir, std::vector<Param>& params, std::vector<std::string>* float32_names) {
  const std::map<std::string, std::string> where = hf_tensor_files(hf_dir);
  std::map<std::string, std::unique_ptr<SafetensorsReader>> readers;
  std::set<std::string> used;
  for (Param& p : params)
    for (const NamedView& v : hf_views(p)) {
      auto it = where.find(v.name);
      if (it == where.end()) MF_FAIL(hf_dir, ": tensor '", v.name, "' is missing");
      auto& r = readers[it->second];
      if (!r) r = std::make_unique<SafetensorsReader>(hf_dir + "/" + it->second);
      write_through_host(v.value, [&](const Tensor& host) { r->load_into(v.name, host); });  // v may be row-strided
      used.insert(v.name);
      const std::string short_name = layer_free_name(v.name);
      if (float32_names && r->tensor(v.name).dtype == DType::f32 &&
          std::find(float32_names->begin(), float32_names->end(), short_name) == float32_names->end())
        float32_names->push_back(short_name);
    }
  for (const auto& [name, file] : where) {
    if (used.count(name)) continue;
    const std::string main = shared_copy_of(name);
    const Param* p = nullptr;
    for (const Param& q : params)
      if (q.name == main) p = &q;
    if (!p) MF_FAIL(hf_dir, "/", file, ": tensor '", name, "' has no place in the model");
    auto& r = readers[file];
    if (!r) r = std::make_unique<SafetensorsReader>(hf_dir + "/" + file);
    std::vector<float> copy(static_cast<size_t>(p->value.numel()));
    r->load_into(name, Tensor(copy.data(), DType::f32, p->value.shape()));
    if (std::memcmp(copy.data(), p->value.data(), copy.size() * sizeof(float)) != 0)
      MF_FAIL(hf_dir, "/", file, ": tensor '", name, "' differs from '", main,
              "' (moefold shares the embedding and the LM head with the multi-token-prediction layers)");
  }
}

std::string import_hf(const std::string& hf_dir, const std::string& run_dir) {
  Config cfg = config_from_hf(hf_dir);
  cfg.model.num_nextn_predict_layers = hf_mtp_depth(hf_dir, cfg.model.num_hidden_layers);
  cfg.validate();
  BoundModel bound(cfg);
  Memory& mem = bound.mem;
  std::vector<std::string> float32_names;
  load_hf_weights(hf_dir, mem.params(), &float32_names);
  if (cfg.model.torch_dtype != "float32") {
    std::sort(float32_names.begin(), float32_names.end());
    cfg.model.float32_tensors = float32_names;
  }
  AdamW opt(cfg.train);
  opt.bind(mem.exec(), mem.params());
  std::unique_ptr<Communicator> self = make_self_communicator();
  Mesh mesh = Mesh::build(*self, cfg.resolve_layout(1));
  std::error_code ec;
  fs::create_directories(run_dir, ec);
  if (ec) MF_FAIL(run_dir, ": cannot create: ", ec.message());
  const std::string toml = config_to_toml(cfg);
  std::ofstream(fs::path(run_dir) / "config.toml", std::ios::trunc) << toml;
  return save_checkpoint((fs::path(run_dir) / "checkpoints").string(), mem.params(), opt,
                         TrainerState{0, 0, cfg.train.seed}, toml, mesh);
}

void export_hf(const std::string& ckpt_dir, const std::string& hf_dir) {
  const std::string config_path = ckpt_dir + "/config.toml";
  if (!fs::is_regular_file(config_path)) MF_FAIL(config_path, ": missing (not a moefold checkpoint?)");
  const Config cfg = load_config(config_path, {});
  BoundModel bound(cfg);
  Memory& mem = bound.mem;
  load_checkpoint(ckpt_dir, mem.params(), nullptr);
  const nlohmann::json j = config_to_hf(cfg);
  const DType dtype = cfg.model.torch_dtype == "bfloat16" ? DType::bf16 : DType::f32;
  std::error_code ec;
  fs::create_directories(hf_dir, ec);
  if (ec) MF_FAIL(hf_dir, ": cannot create: ", ec.message());
  std::vector<SafetensorsEntry> entries;
  std::vector<std::vector<float>> storage;                           // contiguous copies of row-strided views
  for (int64_t k = 1; k <= cfg.model.num_nextn_predict_layers; ++k)  // DeepSeek-V3's copies of the shared tensors
    for (const Param& p : mem.params())
      if (p.name == "model.embed_tokens.weight" || p.name == "lm_head.weight")
        entries.push_back({cat("model.layers.", cfg.model.num_hidden_layers + k - 1,
                               p.name == "lm_head.weight" ? ".shared_head.head.weight" : ".embed_tokens.weight"),
                           p.value, dtype});
  for (const Param& p : mem.params())
    for (const NamedView& v : hf_views(p)) {
      const auto& keep = cfg.model.float32_tensors;
      const bool f32 = std::find(keep.begin(), keep.end(), layer_free_name(v.name)) != keep.end();
      entries.push_back({v.name, contiguous_host(v.value, storage), f32 ? DType::f32 : dtype});
    }
  // Written under temporary names and renamed, so a failure leaves no half-written model.
  const std::string tmp_model = hf_dir + "/.model.safetensors.tmp", tmp_config = hf_dir + "/.config.json.tmp";
  write_safetensors(tmp_model, entries, {{"format", "pt"}});
  std::ofstream(tmp_config, std::ios::trunc) << j.dump(2) << "\n";
  fs::rename(tmp_model, hf_dir + "/model.safetensors", ec);
  if (!ec) fs::rename(tmp_config, hf_dir + "/config.json", ec);
  if (ec) MF_FAIL(hf_dir, ": cannot write: ", ec.message());
}

}  // namespace moefold

#include "moefold/train/hf_import.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include "moefold/comm/communicator.h"
#include "moefold/io/safetensors.h"
#include "moefold/model/hf_names.h"
#include "moefold/model/model.h"
#include "moefold/train/checkpoint.h"
#include "moefold/train/optimizer.h"

namespace moefold {

namespace fs = std::filesystem;

namespace {

nlohmann::json read_json_file(const std::string& path) {
  std::ifstream f(path);
  if (!f) MF_FAIL(path, ": cannot open");
  try {
    return nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    MF_FAIL(path, ": not valid JSON (", e.what(), ")");
  }
}

}  // namespace

Config config_from_hf(const std::string& hf_dir) {
  const std::string path = hf_dir + "/config.json";
  const nlohmann::json j = read_json_file(path);
  Config c = preset_config("tiny");
  auto req = [&](const char* key) -> const nlohmann::json& {
    if (!j.contains(key)) MF_FAIL(path, ": missing key '", key, "'");
    return j.at(key);
  };
  try {
    const std::string arch = j.contains("architectures") && !j["architectures"].empty()
                                 ? j["architectures"][0].get<std::string>()
                                 : std::string("(none)");
    if (arch != "Qwen3MoeForCausalLM")
      MF_FAIL(path, ": architecture '", arch, "' is not supported (supported: Qwen3MoeForCausalLM)");
    c.model.vocab_size = req("vocab_size").get<int64_t>();
    c.model.hidden_size = req("hidden_size").get<int64_t>();
    c.model.num_hidden_layers = req("num_hidden_layers").get<int64_t>();
    c.model.num_attention_heads = req("num_attention_heads").get<int64_t>();
    c.model.num_key_value_heads = j.value("num_key_value_heads", c.model.num_attention_heads);
    c.model.head_dim = j.value("head_dim", c.model.hidden_size / c.model.num_attention_heads);
    c.model.max_position_embeddings = req("max_position_embeddings").get<int64_t>();
    c.model.rms_norm_eps = req("rms_norm_eps").get<double>();
    c.model.initializer_range = j.value("initializer_range", c.model.initializer_range);
    if (j.contains("rope_parameters")) {  // transformers >= 5
      const auto& rp = j["rope_parameters"];
      if (rp.value("rope_type", std::string("default")) != "default")
        MF_FAIL(path, ": rope_parameters.rope_type '", rp["rope_type"].get<std::string>(), "' is not supported");
      c.model.rope_theta = rp.at("rope_theta").get<double>();
    } else {
      c.model.rope_theta = req("rope_theta").get<double>();
      if (j.contains("rope_scaling") && !j["rope_scaling"].is_null())
        MF_FAIL(path, ": rope_scaling is not supported yet");
    }
    c.moe.num_experts =
        j.contains("num_experts") ? j["num_experts"].get<int64_t>() : req("num_local_experts").get<int64_t>();
    c.moe.num_experts_per_tok = req("num_experts_per_tok").get<int64_t>();
    c.moe.moe_intermediate_size = req("moe_intermediate_size").get<int64_t>();
    c.moe.norm_topk_prob = j.value("norm_topk_prob", false);
    c.moe.aux_loss_coeff = j.value("router_aux_loss_coef", c.moe.aux_loss_coeff);
    c.moe.scoring_func = ScoreFunc::softmax;
    if (j.value("decoder_sparse_step", 1) != 1 || (j.contains("mlp_only_layers") && !j["mlp_only_layers"].empty()))
      MF_FAIL(path, ": dense MLP layers (decoder_sparse_step != 1 or mlp_only_layers) are not supported yet");
    if (j.value("attention_bias", false)) MF_FAIL(path, ": attention_bias = true is not supported");
    if (j.value("tie_word_embeddings", false)) MF_FAIL(path, ": tie_word_embeddings = true is not supported");
    if (j.value("hidden_act", std::string("silu")) != "silu")
      MF_FAIL(path, ": hidden_act '", j["hidden_act"].get<std::string>(), "' is not supported (silu)");
  } catch (const nlohmann::json::exception& e) {
    MF_FAIL(path, ": wrong value type (", e.what(), ")");
  }
  c.train.seq_len = std::min<int64_t>(c.train.seq_len, c.model.max_position_embeddings);
  try {
    c.validate();
  } catch (const Error& e) {
    MF_FAIL(path, ": ", e.what());
  }
  return c;
}

void load_hf_weights(const std::string& hf_dir, std::vector<Param>& params) {
  // tensor name -> file, from the index when sharded
  std::map<std::string, std::string> where;
  const std::string index = hf_dir + "/model.safetensors.index.json";
  std::vector<std::string> files;
  if (fs::exists(index)) {
    const nlohmann::json j = read_json_file(index);
    try {
      for (const auto& [t, f] : j.at("weight_map").items()) where[t] = f.get<std::string>();
    } catch (const nlohmann::json::exception& e) {
      MF_FAIL(index, ": malformed index (", e.what(), ")");
    }
  } else if (fs::exists(hf_dir + "/model.safetensors")) {
    SafetensorsReader r(hf_dir + "/model.safetensors");
    for (const SafetensorsTensor& t : r.tensors()) where[t.name] = "model.safetensors";
  } else {
    MF_FAIL(hf_dir, ": no model.safetensors nor model.safetensors.index.json");
  }
  std::map<std::string, std::unique_ptr<SafetensorsReader>> readers;
  std::set<std::string> used;
  for (Param& p : params)
    for (const NamedView& v : hf_views(p)) {
      auto it = where.find(v.name);
      if (it == where.end()) MF_FAIL(hf_dir, ": tensor '", v.name, "' is missing");
      auto& r = readers[it->second];
      if (!r) r = std::make_unique<SafetensorsReader>(hf_dir + "/" + it->second);
      r->load_into(v.name, v.value);
      used.insert(v.name);
    }
  for (const auto& [name, file] : where)
    if (!used.count(name)) MF_FAIL(hf_dir, "/", file, ": tensor '", name, "' has no place in the model");
}

std::string import_hf(const std::string& hf_dir, const std::string& run_dir) {
  const Config cfg = config_from_hf(hf_dir);
  Model model(cfg.model, cfg.moe, 1, 1);
  Memory mem(DType::f32);
  model.bind(mem);
  mem.allocate();
  model.bind(mem);
  mem.finish_binding();
  load_hf_weights(hf_dir, mem.params());
  AdamW opt(cfg.train);
  opt.bind(mem.params());
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
  Model model(cfg.model, cfg.moe, 1, 1);
  Memory mem(DType::f32);
  model.bind(mem);
  mem.allocate();
  model.bind(mem);
  mem.finish_binding();
  load_checkpoint(ckpt_dir, mem.params(), nullptr);
  const ModelConfig& m = cfg.model;
  const MoeConfig& e = cfg.moe;
  if (e.scoring_func != ScoreFunc::softmax || e.routed_scaling_factor != 1.0)
    MF_FAIL(config_path, ": Qwen3MoeForCausalLM needs softmax routing without a scaling factor");
  const nlohmann::json j = {{"architectures", {"Qwen3MoeForCausalLM"}},
                            {"model_type", "qwen3_moe"},
                            {"vocab_size", m.vocab_size},
                            {"hidden_size", m.hidden_size},
                            {"num_hidden_layers", m.num_hidden_layers},
                            {"num_attention_heads", m.num_attention_heads},
                            {"num_key_value_heads", m.num_key_value_heads},
                            {"head_dim", m.head_dim},
                            {"max_position_embeddings", m.max_position_embeddings},
                            {"rms_norm_eps", m.rms_norm_eps},
                            {"rope_theta", m.rope_theta},
                            {"initializer_range", m.initializer_range},
                            {"num_experts", e.num_experts},
                            {"num_experts_per_tok", e.num_experts_per_tok},
                            {"moe_intermediate_size", e.moe_intermediate_size},
                            {"norm_topk_prob", e.norm_topk_prob},
                            {"router_aux_loss_coef", e.aux_loss_coeff},
                            {"decoder_sparse_step", 1},
                            {"mlp_only_layers", nlohmann::json::array()},
                            {"hidden_act", "silu"},
                            {"attention_bias", false},
                            {"tie_word_embeddings", false},
                            {"torch_dtype", "float32"}};
  std::error_code ec;
  fs::create_directories(hf_dir, ec);
  if (ec) MF_FAIL(hf_dir, ": cannot create: ", ec.message());
  std::vector<SafetensorsEntry> entries;
  for (const Param& p : mem.params())
    for (const NamedView& v : hf_views(p)) entries.push_back({v.name, v.value, DType::f32});
  // Written under temporary names and renamed, so a failure leaves no half-written model.
  const std::string tmp_model = hf_dir + "/.model.safetensors.tmp", tmp_config = hf_dir + "/.config.json.tmp";
  write_safetensors(tmp_model, entries, {{"format", "pt"}});
  std::ofstream(tmp_config, std::ios::trunc) << j.dump(2) << "\n";
  fs::rename(tmp_model, hf_dir + "/model.safetensors", ec);
  if (!ec) fs::rename(tmp_config, hf_dir + "/config.json", ec);
  if (ec) MF_FAIL(hf_dir, ": cannot write: ", ec.message());
}

}  // namespace moefold

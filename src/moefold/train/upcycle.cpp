// Sparse upcycling (upcycle.h): the target config, the checks that make step 0 equal the dense
// model, and the tensor copies. Shape letters: H hidden, F the dense MLP's FFN width, f = F / G
// one expert's, E experts, C = E / G copies of the dense MLP.
#include "moefold/train/upcycle.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>

#include "moefold/comm/communicator.h"
#include "moefold/core/error.h"
#include "moefold/core/memory.h"
#include "moefold/model/config.h"
#include "moefold/model/model.h"
#include "moefold/parallel/mesh.h"
#include "moefold/train/bound_model.h"
#include "moefold/train/checkpoint.h"
#include "moefold/train/optimizer.h"

namespace moefold {

namespace fs = std::filesystem;

namespace {

// The "section.key" an override sets ("" when malformed: load_config reports it).
std::string override_key(const std::string& ov) {
  const size_t eq = ov.find('=');
  if (eq == std::string::npos) return "";
  std::string k = ov.substr(0, eq);
  while (!k.empty() && (k.back() == ' ' || k.back() == '\t')) k.pop_back();
  return k;
}

// The value the last override of `key` gives, if any.
bool find_override(const std::vector<std::string>& overrides, const std::string& key, std::string* value) {
  bool found = false;
  for (const std::string& ov : overrides)
    if (override_key(ov) == key) {
      *value = ov.substr(ov.find('=') + 1);
      found = true;
    }
  return found;
}

// The three MoE tensors of an upcycled layer, and the dense MLP they come from.
struct UpcycledLayer {
  std::string dense;  // "model.layers.L.mlp" (the source's DenseMlp prefix)
  std::string moe;    // "model.layers.L.mlp" or, for Mixtral, "model.layers.L.block_sparse_moe"
};

// Expert e = c * G + j holds chunk j (rows [j f, (j + 1) f) of gate and up, the same columns of
// down, the latter times down_scale) of the dense MLP; gate_up interleaves its gate and up rows
// (gate row i at 2i, up row i at 2i + 1: experts.h).
void split_mlp(const Tensor& gate_FH, const Tensor& up_FH, const Tensor& down_HF, int64_t granularity,
               double down_scale, const Tensor& gate_up_E2fH, const Tensor& down_EHf) {
  const int64_t f_n = gate_FH.size(0), h_n = gate_FH.size(1), e_n = gate_up_E2fH.size(0), f = f_n / granularity;
  MF_CHECK(up_FH.shape() == gate_FH.shape() && down_HF.shape() == Shape({h_n, f_n}) &&
               gate_up_E2fH.shape() == Shape({e_n, 2 * f, h_n}) && down_EHf.shape() == Shape({e_n, h_n, f}) &&
               f * granularity == f_n && e_n % granularity == 0,
           "split_mlp: gate ", gate_FH.str(), ", down ", down_HF.str(), " into ", gate_up_E2fH.str(), ", ",
           down_EHf.str(), " with granularity ", granularity);
  const float* gate = gate_FH.ptr<float>();
  const float* up = up_FH.ptr<float>();
  const float* down = down_HF.ptr<float>();
  for (int64_t e = 0; e < e_n; ++e) {
    const int64_t j = e % granularity;
    float* gu = gate_up_E2fH.ptr<float>() + e * 2 * f * h_n;
    for (int64_t i = 0; i < f; ++i) {
      std::copy_n(gate + (j * f + i) * h_n, h_n, gu + 2 * i * h_n);
      std::copy_n(up + (j * f + i) * h_n, h_n, gu + (2 * i + 1) * h_n);
    }
    float* d = down_EHf.ptr<float>() + e * h_n * f;
    for (int64_t h = 0; h < h_n; ++h)
      for (int64_t i = 0; i < f; ++i)
        d[h * f + i] = static_cast<float>(static_cast<double>(down[h * f_n + j * f + i]) * down_scale);
  }
}

// Rows c * G .. c * G + G - 1 of the router become row c of its fresh initialisation (normal,
// std model.initializer_range, from train.seed): the G experts of copy c score alike.
void tie_router_rows(const Tensor& gate_EH, int64_t granularity) {
  const int64_t e_n = gate_EH.size(0), h_n = gate_EH.size(1), c_n = e_n / granularity;
  float* w = gate_EH.ptr<float>();
  const std::vector<float> rows(w, w + c_n * h_n);
  for (int64_t e = 0; e < e_n; ++e)
    std::copy(rows.begin() + (e / granularity) * h_n, rows.begin() + (e / granularity + 1) * h_n, w + e * h_n);
}

}  // namespace

std::string upcycle(const std::string& dense_ckpt_dir, const std::string& run_dir,
                    const std::vector<std::string>& overrides, int64_t granularity) {
  const int64_t g = granularity;
  if (g < 1) MF_FAIL("upcycle: --granularity ", g, " must be >= 1");
  std::error_code ec;
  if (fs::exists(fs::path(run_dir) / "checkpoints", ec))
    MF_FAIL(run_dir, ": already holds checkpoints; choose another --to");
  const std::string config_path = (fs::path(dense_ckpt_dir) / "config.toml").string();
  if (!fs::is_regular_file(config_path, ec)) MF_FAIL(config_path, ": missing (not a moefold checkpoint?)");
  const Config src = load_config(config_path, {});
  const int64_t num_layers = src.model.num_hidden_layers;
  bool any_dense = false;
  for (int64_t l = 0; l < num_layers; ++l) any_dense = any_dense || src.model.is_dense_layer(l);
  if (!any_dense)
    MF_FAIL(config_path, ": no dense layer to upcycle (model.first_k_dense_replace = 0 and model.mlp_only_layers ",
            "is empty)");
  const int64_t f_dense = src.model.intermediate_size;
  if (f_dense % g != 0)
    MF_FAIL("upcycle: model.intermediate_size = ", f_dense, " is not divisible by --granularity ", g);

  // The target config: the source's with the overrides, every dense layer MoE unless the
  // overrides say which stay dense, and experts of F / G. Applied by load_config, so the config
  // is validated once, with its final values.
  std::vector<std::string> target_overrides = overrides;
  std::string value;
  if (find_override(overrides, "model.intermediate_size", &value) && value != std::to_string(f_dense))
    MF_FAIL("upcycle: --set model.intermediate_size=", value, ": the dense MLP's width comes from the checkpoint (",
            f_dense, ")");
  const int64_t f_expert = f_dense / g;
  if (find_override(overrides, "moe.moe_intermediate_size", &value) && value != std::to_string(f_expert))
    MF_FAIL("upcycle: --set moe.moe_intermediate_size=", value, ": upcycling sets it to model.intermediate_size / ",
            "granularity = ", f_dense, " / ", g, " = ", f_expert);
  target_overrides.push_back(cat("moe.moe_intermediate_size=", f_expert));
  if (!find_override(overrides, "model.mlp_only_layers", &value))
    target_overrides.push_back("model.mlp_only_layers=[]");
  if (!find_override(overrides, "model.first_k_dense_replace", &value))
    target_overrides.push_back("model.first_k_dense_replace=0");
  const Config tgt = load_config(config_path, target_overrides);

  if (tgt.model.num_hidden_layers != num_layers)
    MF_FAIL("upcycle: model.num_hidden_layers = ", tgt.model.num_hidden_layers, " differs from the checkpoint's ",
            num_layers);
  const bool mixtral = tgt.model.architecture == "mixtral";
  std::map<int64_t, UpcycledLayer> upcycled;
  for (int64_t l = 0; l < num_layers; ++l) {
    const bool was_dense = src.model.is_dense_layer(l), is_dense = tgt.model.is_dense_layer(l);
    if (!was_dense && is_dense)
      MF_FAIL("upcycle: layer ", l, " is an MoE layer in ", config_path,
              " and cannot become dense (model.first_k_dense_replace, model.mlp_only_layers)");
    if (was_dense && !is_dense)
      upcycled[l] = {cat("model.layers.", l, ".mlp"), cat("model.layers.", l, mixtral ? ".block_sparse_moe" : ".mlp")};
  }
  if (upcycled.empty())
    MF_FAIL("upcycle: no layer becomes MoE (model.first_k_dense_replace = ", tgt.model.first_k_dense_replace,
            " and model.mlp_only_layers keep every dense layer dense)");

  // What makes the top-K of the upcycled router pick whole copies and sum them back to the MLP.
  const MoeConfig& moe = tgt.moe;
  if (!moe.norm_topk_prob)
    MF_FAIL("upcycle: moe.norm_topk_prob = false: the MoE output would be the dense MLP's times the selected ",
            "probability mass; upcycling needs moe.norm_topk_prob = true");
  if (moe.num_experts % g != 0)
    MF_FAIL("upcycle: moe.num_experts = ", moe.num_experts, " is not divisible by --granularity ", g,
            " (every copy of the dense MLP is split into ", g, " experts)");
  if (moe.num_experts_per_tok % g != 0)
    MF_FAIL("upcycle: moe.num_experts_per_tok = ", moe.num_experts_per_tok, " is not divisible by --granularity ", g,
            " (a token must select whole copies of the dense MLP)");
  if (moe.n_shared_experts != 0)
    MF_FAIL("upcycle: moe.n_shared_experts = ", moe.n_shared_experts,
            ": shared experts would add to the dense MLP's output; upcycling needs 0");
  if (moe.capacity_factor > 0)
    MF_FAIL("upcycle: moe.capacity_factor = ", moe.capacity_factor,
            ": tokens over an expert's capacity would skip the MLP; upcycle dropless (<= 0) and set the capacity ",
            "in RUN_DIR/config.toml afterwards");
  if (moe.n_group > 1 && (moe.num_experts / moe.n_group) % g != 0)
    MF_FAIL("upcycle: moe.n_group = ", moe.n_group, " makes groups of ", moe.num_experts / moe.n_group,
            " experts, not a multiple of --granularity ", g, " (a group must hold whole copies)");

  BoundModel source(src);
  load_checkpoint(dense_ckpt_dir, source.mem.params(), nullptr);
  std::map<std::string, const Param*> by_name;
  for (const Param& p : source.mem.params()) by_name[p.name] = &p;
  auto source_tensor = [&](const std::string& name) -> const Tensor& {
    auto it = by_name.find(name);
    MF_CHECK(it != by_name.end(), "upcycle: the source model has no ", name);
    return it->second->value;
  };

  BoundModel target(tgt);
  Model::init_params(target.mem.exec(), target.mem.params(),
                     tgt.train.seed);  // the router rows (tied below), a bias's zeros
  std::set<std::string> used;
  // The down projections carry the copy's weight G (1 / G per expert, see upcycle.h) and undo the
  // routed scaling factor, which multiplies the renormalised probabilities.
  const double down_scale = static_cast<double>(g) / moe.routed_scaling_factor;
  for (Param& p : target.mem.params()) {
    auto it = by_name.find(p.name);
    if (it != by_name.end()) {
      if (!(it->second->value.shape() == p.value.shape()))
        MF_FAIL("upcycle: tensor '", p.name, "' is ", it->second->value.shape().str(), " in ", dense_ckpt_dir, " but ",
                p.value.shape().str(), " in the upcycled model (the overrides changed a kept tensor)");
      p.value.copy_from(it->second->value);
      used.insert(p.name);
      continue;
    }
    bool placed = false;
    for (const auto& [layer, names] : upcycled) {
      const std::string gate = names.dense + ".gate_proj.weight", up = names.dense + ".up_proj.weight",
                        down = names.dense + ".down_proj.weight";
      if (p.name == names.moe + ".gate.weight") {
        tie_router_rows(p.value, g);
      } else if (p.name == names.moe + ".gate.e_score_correction_bias") {
        // zeros from init_params: the selection bias starts neutral
      } else if (p.name == names.moe + ".experts.gate_up_proj") {
        const Param* dp = target.mem.find(names.moe + ".experts.down_proj");
        MF_CHECK(dp, "upcycle: ", names.moe, " has gate_up_proj but no down_proj");
        split_mlp(source_tensor(gate), source_tensor(up), source_tensor(down), g, down_scale, p.value, dp->value);
        used.insert({gate, up, down});
      } else if (p.name == names.moe + ".experts.down_proj") {
        // written with gate_up_proj
      } else {
        continue;
      }
      placed = true;
      break;
    }
    if (!placed)
      MF_FAIL("upcycle: tensor '", p.name, "' of the upcycled model has no counterpart in ", dense_ckpt_dir,
              " (an override added it?)");
  }
  for (const Param& p : source.mem.params())
    if (!used.count(p.name))
      MF_FAIL("upcycle: tensor '", p.name, "' of ", dense_ckpt_dir,
              " has no place in the upcycled model (an override removed it?)");

  AdamW opt(tgt.train);
  opt.bind(target.mem.exec(), target.mem.params());
  // Written on one rank; the checkpoint loads under any layout, so the target's [parallel]
  // section is kept for the training that follows.
  Config one_rank = tgt;
  one_rank.parallel = ParallelConfig{};
  one_rank.parallel.timeout_s = tgt.parallel.timeout_s;
  std::unique_ptr<Communicator> self = make_self_communicator();
  Mesh mesh = Mesh::build(*self, one_rank.resolve_layout(1));
  fs::create_directories(run_dir, ec);
  if (ec) MF_FAIL(run_dir, ": cannot create: ", ec.message());
  const std::string toml = config_to_toml(tgt);
  {
    std::ofstream out(fs::path(run_dir) / "config.toml", std::ios::trunc);
    out << toml;
    if (!out) MF_FAIL(run_dir, "/config.toml: cannot write");
  }
  return save_checkpoint((fs::path(run_dir) / "checkpoints").string(), target.mem.params(), opt,
                         TrainerState{0, 0, tgt.train.seed}, toml, mesh);
}

}  // namespace moefold

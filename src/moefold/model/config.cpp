// The invariants of a Config (config.h): each section's own checks and the checks across
// sections (heads, experts and the batch against the parallel layout). Every failure is an Error
// naming the keys and values; the TOML form is config_toml.cpp, the presets config_presets.cpp.
#include "moefold/model/config.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "moefold/core/error.h"

namespace moefold {

bool ModelConfig::is_dense_layer(int64_t layer) const {
  return layer < first_k_dense_replace ||
         std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end();
}

void ModelConfig::validate() const {
  if (architecture != "qwen3_moe" && architecture != "mixtral" && architecture != "olmoe" &&
      architecture != "deepseek_v3")
    MF_FAIL("model.architecture = '", architecture,
            "' is not supported (supported: qwen3_moe, mixtral, olmoe, deepseek_v3)");
  auto positive = [](const char* k, int64_t v) { require_positive("model", k, v); };
  positive("vocab_size", vocab_size);
  positive("hidden_size", hidden_size);
  positive("num_hidden_layers", num_hidden_layers);
  if (num_hidden_layers > kMaxLayers)
    MF_FAIL("model.num_hidden_layers = ", num_hidden_layers, " is more than ", kMaxLayers, " layers");
  positive("num_attention_heads", num_attention_heads);
  positive("num_key_value_heads", num_key_value_heads);
  positive("head_dim", head_dim);
  positive("max_position_embeddings", max_position_embeddings);
  if (num_attention_heads % num_key_value_heads != 0)
    MF_FAIL("model.num_key_value_heads = ", num_key_value_heads,
            " does not divide model.num_attention_heads = ", num_attention_heads);
  if (head_dim % 2 != 0) MF_FAIL("model.head_dim = ", head_dim, " must be even (rotary embedding)");
  if (!(rms_norm_eps > 0)) MF_FAIL("model.rms_norm_eps = ", rms_norm_eps, " must be > 0");
  if (!(rope_theta > 0)) MF_FAIL("model.rope_theta = ", rope_theta, " must be > 0");
  if (!(initializer_range > 0)) MF_FAIL("model.initializer_range = ", initializer_range, " must be > 0");
  if (first_k_dense_replace < 0 || first_k_dense_replace > num_hidden_layers)
    MF_FAIL("model.first_k_dense_replace = ", first_k_dense_replace,
            " must be in [0, model.num_hidden_layers = ", num_hidden_layers, "]");
  for (int64_t l : mlp_only_layers)
    if (l < 0 || l >= num_hidden_layers)
      MF_FAIL("model.mlp_only_layers holds ", l, ", not a layer index (model.num_hidden_layers = ", num_hidden_layers,
              ")");
  bool any_dense = false;
  for (int64_t l = 0; l < num_hidden_layers; ++l) any_dense = any_dense || is_dense_layer(l);
  if (any_dense) require_positive("model", "intermediate_size", intermediate_size);
  if (intermediate_size < 0) MF_FAIL("model.intermediate_size = ", intermediate_size, " must be >= 0");
  if (is_mla()) {
    require_positive("model", "kv_lora_rank", kv_lora_rank);
    require_positive("model", "qk_nope_head_dim", qk_nope_head_dim);
    require_positive("model", "qk_rope_head_dim", qk_rope_head_dim);
    require_positive("model", "v_head_dim", v_head_dim);
    if (q_lora_rank < 0) MF_FAIL("model.q_lora_rank = ", q_lora_rank, " must be >= 0 (0: no query compression)");
    if (head_dim != qk_rope_head_dim)
      MF_FAIL("model.head_dim = ", head_dim, " must equal model.qk_rope_head_dim = ", qk_rope_head_dim,
              " for deepseek_v3 (the rotary table's width)");
    if (num_key_value_heads != num_attention_heads)
      MF_FAIL("model.num_key_value_heads = ", num_key_value_heads,
              " must equal model.num_attention_heads = ", num_attention_heads,
              " for deepseek_v3 (MLA expands the latent to every head)");
  } else if (q_lora_rank != 0 || kv_lora_rank != 0) {
    MF_FAIL("model.q_lora_rank / model.kv_lora_rank are for deepseek_v3 only (architecture '", architecture, "')");
  }
  if (rope_type == "yarn") {
    if (!(rope_factor >= 1)) MF_FAIL("model.rope_factor = ", rope_factor, " must be >= 1 for YaRN");
    require_positive("model", "rope_original_max_position_embeddings", rope_original_max_position_embeddings);
    if (!(rope_beta_fast > 0 && rope_beta_slow > 0))
      MF_FAIL("model.rope_beta_fast = ", rope_beta_fast, " and model.rope_beta_slow = ", rope_beta_slow,
              " must be > 0");
  } else if (rope_type != "default") {
    MF_FAIL("model.rope_type = '", rope_type, "' is not supported (default, yarn)");
  }
  if (torch_dtype != "float32" && torch_dtype != "bfloat16")
    MF_FAIL("model.torch_dtype = '", torch_dtype, "' is not supported (float32, bfloat16)");
  if (num_nextn_predict_layers < 0)
    MF_FAIL("model.num_nextn_predict_layers = ", num_nextn_predict_layers, " must be >= 0");
  if (!(mtp_loss_scaling_factor >= 0) || !std::isfinite(mtp_loss_scaling_factor))
    MF_FAIL("model.mtp_loss_scaling_factor = ", mtp_loss_scaling_factor, " must be finite and >= 0");
}

namespace {

// Every buffer holds a product of the sizes (Shape::numel and the arenas' byte counts are plain
// int64/size_t arithmetic), so sizes that multiply past 2^63 (a config file from elsewhere, a
// checkpoint's config.toml) would plan buffers that wrap to a few bytes and are then written in
// full. Bounded here on an over-estimate of the parameters and of the values one micro-batch of
// max_position_embeddings tokens keeps, computed in double (these products cannot overflow it),
// by far more than any machine holds. REQUIRES: each section validated (sizes positive, factors
// finite).
void check_sizes(const Config& c) {
  const ModelConfig& m = c.model;
  const MoeConfig& e = c.moe;
  constexpr double kMaxValues = 0x1p50;
  const double h = m.hidden_size, v = m.vocab_size, p = m.max_position_embeddings, ne = e.num_experts;
  const double layers = static_cast<double>(m.num_hidden_layers) + m.num_nextn_predict_layers + 1;
  // One token's attention widths (q, k, v, output; MLA's latents) and its MoE rows' widths.
  const double attn = static_cast<double>(m.num_attention_heads) *
                          (m.head_dim + m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) +
                      2.0 * m.num_key_value_heads * m.head_dim + m.q_lora_rank + m.kv_lora_rank;
  const double ffn = 3.0 * e.moe_intermediate_size, dense = 3.0 * m.intermediate_size;
  const double tokens = static_cast<double>(c.train.micro_batch_size) * p;
  const double rows = tokens * e.num_experts_per_tok * std::max({1.0, e.capacity_factor, e.ep_recv_factor}) + ne;
  const double params = layers * (4.0 * (h + m.q_lora_rank + m.kv_lora_rank) * attn +
                                  h * ffn * (ne + e.n_shared_experts) + h * dense + ne * (h + 1) + 2.0 * h * h) +
                        2.0 * v * h;
  const double values =
      layers * (tokens * (4.0 * h + attn + ne + dense + ffn * e.n_shared_experts) + rows * (h + ffn) + 2.0 * p * p) +
      2.0 * tokens * v + static_cast<double>(c.train.global_batch_size) * c.train.seq_len;  // + a step's tokens
  if (!(params <= kMaxValues && values <= kMaxValues))
    MF_FAIL("the model's sizes multiply to ~", params, " parameters and ~", values,
            " activation values, more than 2^50 (model.vocab_size = ", m.vocab_size,
            ", model.hidden_size = ", m.hidden_size, ", model.max_position_embeddings = ", m.max_position_embeddings,
            ", moe.num_experts = ", e.num_experts, ", moe.moe_intermediate_size = ", e.moe_intermediate_size,
            ", train.micro_batch_size = ", c.train.micro_batch_size, ")");
}

// The module names of train.recompute_modules and train.offload_modules, and the flag each sets.
template <class S>
struct ModuleName {
  const char* name;
  bool S::*flag;
};
constexpr ModuleName<Recompute> kRecomputeModules[] = {{"layernorm", &Recompute::layernorm},
                                                       {"core_attn", &Recompute::core_attn},
                                                       {"mla_up_proj", &Recompute::mla_up_proj},
                                                       {"moe_act", &Recompute::moe_act},
                                                       {"shared_experts", &Recompute::shared_experts},
                                                       {"moe", &Recompute::moe},
                                                       {"mlp", &Recompute::mlp}};
constexpr ModuleName<Offload> kOffloadModules[] = {
    {"attn_norm", &Offload::attn_norm}, {"qkv_linear", &Offload::qkv_linear}, {"core_attn", &Offload::core_attn},
    {"attn_proj", &Offload::attn_proj}, {"mlp_norm", &Offload::mlp_norm},     {"expert_fc1", &Offload::expert_fc1},
    {"moe_act", &Offload::moe_act}};
constexpr ModuleName<Fp8Linears> kFp8Modules[] = {
    {"qkv", &Fp8Linears::qkv},         {"attn_proj", &Fp8Linears::attn_proj},           {"mlp", &Fp8Linears::mlp},
    {"experts", &Fp8Linears::experts}, {"shared_experts", &Fp8Linears::shared_experts}, {"mtp", &Fp8Linears::mtp}};

// One line naming the first unknown module and the known ones.
template <class S, size_t N>
void check_modules(const char* key, const std::vector<std::string>& modules, const ModuleName<S> (&known)[N]) {
  for (const std::string& m : modules) {
    std::string names;
    bool found = false;
    for (const ModuleName<S>& k : known) {
      found |= m == k.name;
      names += names.empty() ? k.name : cat(", ", k.name);
    }
    if (!found) MF_FAIL(key, ": unknown module '", m, "' (", names, ")");
  }
}

template <class S, size_t N>
void set_modules(const std::vector<std::string>& modules, const ModuleName<S> (&known)[N], S& out) {
  for (const std::string& m : modules)
    for (const ModuleName<S>& k : known)
      if (m == k.name) out.*k.flag = true;
}

}  // namespace

void TrainConfig::validate() const {
  auto positive = [](const char* k, int64_t v) { require_positive("train", k, v); };
  positive("seq_len", seq_len);
  positive("micro_batch_size", micro_batch_size);
  positive("global_batch_size", global_batch_size);
  positive("steps", steps);
  positive("eval_batches", eval_batches);
  if (global_batch_size % micro_batch_size != 0)
    MF_FAIL("train.micro_batch_size = ", micro_batch_size,
            " does not divide train.global_batch_size = ", global_batch_size);
  if (!(lr > 0) || !std::isfinite(lr)) MF_FAIL("train.lr = ", lr, " must be > 0");
  if (!(min_lr >= 0) || min_lr > lr) MF_FAIL("train.min_lr = ", min_lr, " must be in [0, train.lr = ", lr, "]");
  if (warmup_steps < 0) MF_FAIL("train.warmup_steps = ", warmup_steps, " must be >= 0");
  if (!(weight_decay >= 0)) MF_FAIL("train.weight_decay = ", weight_decay, " must be >= 0");
  if (!(adam_beta1 >= 0 && adam_beta1 < 1)) MF_FAIL("train.adam_beta1 = ", adam_beta1, " must be in [0, 1)");
  if (!(adam_beta2 >= 0 && adam_beta2 < 1)) MF_FAIL("train.adam_beta2 = ", adam_beta2, " must be in [0, 1)");
  if (!(adam_eps > 0)) MF_FAIL("train.adam_eps = ", adam_eps, " must be > 0");
  if (!std::isfinite(grad_clip)) MF_FAIL("train.grad_clip = ", grad_clip, " must be finite");
  if (on_nonfinite != "stop" && on_nonfinite != "skip")
    MF_FAIL("train.on_nonfinite = '", on_nonfinite, "' is not supported (stop, skip)");
  for (const auto& [key, value] : {std::pair<const char*, const std::string&>{"exp_avg_dtype", exp_avg_dtype},
                                   {"exp_avg_sq_dtype", exp_avg_sq_dtype},
                                   {"main_grads_dtype", main_grads_dtype}})
    if (value != "f32" && value != "bf16") MF_FAIL("train.", key, " = '", value, "' is not supported (f32, bf16)");
  check_modules("train.recompute_modules", recompute_modules, kRecomputeModules);
  if (!(optimizer_offload_fraction >= 0 && optimizer_offload_fraction <= 1))
    MF_FAIL("train.optimizer_offload_fraction = ", optimizer_offload_fraction, " must be in [0, 1]");
  check_modules("train.offload_modules", offload_modules, kOffloadModules);
  if (recompute_num_layers < 0) MF_FAIL("train.recompute_num_layers = ", recompute_num_layers, " must be >= 0");
  if (recompute_method != "uniform" && recompute_method != "block")
    MF_FAIL("train.recompute_method = '", recompute_method, "' is not supported (uniform, block)");
  if (fp8 != "none" && fp8 != "blockwise") MF_FAIL("train.fp8 = '", fp8, "' is not supported (none, blockwise)");
  if (cuda_graphs != "none" && cuda_graphs != "layers" && cuda_graphs != "step")
    MF_FAIL("train.cuda_graphs = '", cuda_graphs, "' is not supported (none, layers, step)");
  check_modules("train.fp8_exclude", fp8_exclude, kFp8Modules);
  if (eval_interval < 0) MF_FAIL("train.eval_interval = ", eval_interval, " must be >= 0");
  if (checkpoint_interval < 0) MF_FAIL("train.checkpoint_interval = ", checkpoint_interval, " must be >= 0");
  if (log_interval < 0) MF_FAIL("train.log_interval = ", log_interval, " must be >= 0 (0: the last step only)");
  if (expert_load_interval < 0)
    MF_FAIL("train.expert_load_interval = ", expert_load_interval, " must be >= 0 (0: never)");
  if (keep_checkpoints < 0) MF_FAIL("train.keep_checkpoints = ", keep_checkpoints, " must be >= 0");
  if (on_save_error != "stop" && on_save_error != "continue")
    MF_FAIL("train.on_save_error = '", on_save_error, "' is not supported (stop, continue)");
}

Recompute TrainConfig::recompute() const {
  Recompute r;
  r.num_layers = recompute_num_layers;
  r.block = recompute_method == "block";
  set_modules(recompute_modules, kRecomputeModules, r);
  return r;
}

Offload TrainConfig::offload() const {
  Offload o;
  set_modules(offload_modules, kOffloadModules, o);
  return o;
}

Fp8Linears TrainConfig::fp8_linears() const {
  Fp8Linears f;
  if (fp8 == "none") return f;
  Fp8Linears excluded;
  set_modules(fp8_exclude, kFp8Modules, excluded);
  for (const auto& m : kFp8Modules) f.*m.flag = !(excluded.*m.flag);
  return f;
}

std::string Fp8Linears::names() const {
  std::string out;
  for (const auto& m : kFp8Modules)
    if (this->*m.flag) out += cat(out.empty() ? "" : ", ", m.name);
  return out;
}

void DataConfig::validate() const {
  if (!(valid_fraction >= 0 && valid_fraction < 0.5))
    MF_FAIL("data.valid_fraction = ", valid_fraction, " must be in [0, 0.5)");
}

void Config::validate() const {
  model.validate();
  moe.validate();
  train.validate();
  data.validate();
  parallel.validate();
  check_sizes(*this);  // before the products below
  if (kernels.gemm_sms < 0) MF_FAIL("kernels.gemm_sms = ", kernels.gemm_sms, " must be >= 0 (0: every SM)");
  if (kernels.own_wgrad_units < 1 || kernels.own_wgrad_units > 64)
    MF_FAIL("kernels.own_wgrad_units = ", kernels.own_wgrad_units, " must be between 1 and 64");
  const ParallelConfig& p = parallel;
  if (moe.num_experts % p.ep != 0)
    MF_FAIL("moe.num_experts = ", moe.num_experts, " is not divisible by parallel.ep = ", p.ep);
  if (moe.moe_intermediate_size % p.etp != 0)
    MF_FAIL("moe.moe_intermediate_size = ", moe.moe_intermediate_size, " is not divisible by parallel.etp = ", p.etp);
  if (moe.dispatcher == "slots" && p.etp > 1)
    MF_FAIL("moe.dispatcher = \"slots\" needs parallel.etp = 1 (etp = ", p.etp, ")");
  if (moe.dispatcher == "slots" && p.ep_transport == "ipc")
    MF_FAIL(
        "moe.dispatcher = \"slots\" exchanges through the communicator: parallel.ep_transport = 'ipc' does not "
        "apply (auto or nccl)");
  if (moe.dispatcher == "hierarchical" && (p.ep == 1 || p.etp > 1))
    MF_FAIL("moe.dispatcher = \"hierarchical\" needs parallel.ep > 1 and parallel.etp = 1 (ep = ", p.ep,
            ", etp = ", p.etp, ")");
  if (model.num_attention_heads % p.tp != 0 || model.num_key_value_heads % p.tp != 0)
    MF_FAIL("model.num_attention_heads = ", model.num_attention_heads,
            " and model.num_key_value_heads = ", model.num_key_value_heads,
            " must both be divisible by parallel.tp = ", p.tp);
  if (p.cp > 1 && train.seq_len % (2 * p.cp) != 0)
    MF_FAIL("train.seq_len = ", train.seq_len, " is not divisible by 2 x parallel.cp = ", 2 * p.cp,
            " (causal load balancing gives each rank a front and a back chunk)");
  if (moe.n_shared_experts < 0) MF_FAIL("moe.n_shared_experts = ", moe.n_shared_experts, " must be >= 0");
  if (model.intermediate_size % p.tp != 0)
    MF_FAIL("model.intermediate_size = ", model.intermediate_size, " is not divisible by parallel.tp = ", p.tp);
  if (moe.n_shared_experts * moe.moe_intermediate_size % p.tp != 0)
    MF_FAIL("moe.n_shared_experts x moe.moe_intermediate_size = ", moe.n_shared_experts * moe.moe_intermediate_size,
            " is not divisible by parallel.tp = ", p.tp);
  if (model.num_nextn_predict_layers > 0 && p.cp > 1)
    MF_FAIL("model.num_nextn_predict_layers = ", model.num_nextn_predict_layers, " with parallel.cp = ", p.cp,
            ": multi-token prediction under context parallelism is not implemented");
  if (moe.fp8_dispatch && !train.fp8_linears().experts)
    MF_FAIL(
        "moe.fp8_dispatch = true needs the experts in FP8 (train.fp8 = \"blockwise\" without \"experts\" in "
        "train.fp8_exclude; train.fp8 = \"",
        train.fp8, "\")");
  if (train.fp8_param && train.fp8 != "blockwise")
    MF_FAIL("train.fp8_param = true needs train.fp8 = \"blockwise\" (train.fp8 = \"", train.fp8, "\")");
  p.stage_layers(model.num_hidden_layers);  // fails with one line where the layers do not split
  if (p.overlap_moe_a2a) {                  // what a layer keeps between its phases must not be shared workspace
    const Recompute r = train.recompute();
    if (r.num_layers > 0 || r.moe || r.layernorm || !train.offload_modules.empty())
      MF_FAIL(
          "parallel.overlap_moe_a2a with train.recompute_num_layers, train.recompute_modules 'moe' or "
          "'layernorm', or train.offload_modules is not supported yet");
  }
  if (moe.shared_expert_overlap && p.tp > 1)
    MF_FAIL("moe.shared_expert_overlap = true with parallel.tp = ", p.tp,
            " is not supported yet (the shared experts' tensor-parallel collectives order with the layer's stream)");
  if (p.pp > 1 && !train.offload_modules.empty())
    MF_FAIL("train.offload_modules with parallel.pp = ", p.pp,
            " is not supported yet (the micro-batches in flight would share the offload slots)");
  if (train.optimizer_offload_fraction > 0 && !parallel.distributed_optimizer)
    MF_FAIL("train.optimizer_offload_fraction = ", train.optimizer_offload_fraction,
            " needs parallel.distributed_optimizer = true (the offloaded state is the optimizer's shards)");
  if (train.recompute_num_layers > model.num_hidden_layers)
    MF_FAIL("train.recompute_num_layers = ", train.recompute_num_layers,
            " exceeds model.num_hidden_layers = ", model.num_hidden_layers);
  if (model.num_nextn_predict_layers >= train.seq_len)
    MF_FAIL("model.num_nextn_predict_layers = ", model.num_nextn_predict_layers,
            " must be < train.seq_len = ", train.seq_len);
  if (model.architecture == "olmoe" && p.tp > 1)
    MF_FAIL("parallel.tp = ", p.tp,
            ": olmoe's q/k norms span every head; tensor parallelism is not implemented for it");
  if (model.vocab_size % p.tp != 0)
    MF_FAIL("model.vocab_size = ", model.vocab_size, " is not divisible by parallel.tp = ", p.tp);
  // Not implemented yet: refuse rather than train something else than asked.
  if (p.tp > 1 && train.micro_batch_size * train.seq_len / p.cp % p.tp != 0)
    MF_FAIL("train.micro_batch_size x train.seq_len / parallel.cp = ", train.micro_batch_size * train.seq_len / p.cp,
            " tokens are not divisible by parallel.tp = ", p.tp, " (sequence parallelism splits them)");
  if (train.seq_len > model.max_position_embeddings)
    MF_FAIL("train.seq_len = ", train.seq_len,
            " exceeds model.max_position_embeddings = ", model.max_position_embeddings);
}

ParallelConfig Config::resolve_layout(int64_t world) const {
  ParallelConfig p = parallel.resolve(world);
  if (train.global_batch_size % (train.micro_batch_size * p.dp) != 0)
    MF_FAIL("train.global_batch_size = ", train.global_batch_size, " is not divisible by train.micro_batch_size x ",
            "parallel.dp = ", train.micro_batch_size, " x ", p.dp, " = ", train.micro_batch_size * p.dp);
  const int64_t micro = train.global_batch_size / (train.micro_batch_size * p.dp);
  if (p.vpp > 1 && micro % p.pp != 0)
    MF_FAIL("parallel.vpp = ", p.vpp, ": the interleaved schedule needs the micro-batches per step (",
            "train.global_batch_size / (train.micro_batch_size x parallel.dp) = ", micro,
            ") to be a multiple of parallel.pp = ", p.pp);
  return p;
}

}  // namespace moefold

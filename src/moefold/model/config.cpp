#include "moefold/model/config.h"

#include <toml++/toml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <functional>
#include <sstream>
#include <variant>

#include "moefold/core/error.h"

namespace moefold {

namespace {

using Ref = std::variant<int64_t*, uint64_t*, double*, bool*, std::string*, ScoreFunc*, std::vector<int64_t>*,
                         std::vector<std::string>*>;

struct Field {
  const char* section;
  const char* key;
  std::function<Ref(Config&)> ref;
  const char* doc;  // one line, written next to the key by config_to_toml
};

#define MF_FIELD(sec, key, member, doc)                             \
  Field {                                                           \
#sec, key, [](Config & c) -> Ref { return &c.sec.member; }, doc \
  }

const std::vector<Field>& fields() {
  static const std::vector<Field> f = {
      MF_FIELD(model, "architecture", architecture, "model family: qwen3_moe, mixtral, olmoe or deepseek_v3"),
      MF_FIELD(model, "vocab_size", vocab_size, "rows of the embedding and LM head (>= the tokenizer's vocabulary)"),
      MF_FIELD(model, "hidden_size", hidden_size, "H, width of the residual stream"),
      MF_FIELD(model, "num_hidden_layers", num_hidden_layers, "decoder layers, each attention + MoE"),
      MF_FIELD(model, "num_attention_heads", num_attention_heads, "query heads"),
      MF_FIELD(model, "num_key_value_heads", num_key_value_heads, "key/value heads (grouped-query attention)"),
      MF_FIELD(model, "head_dim", head_dim, "D, width of one head"),
      MF_FIELD(model, "max_position_embeddings", max_position_embeddings, "longest sequence allowed"),
      MF_FIELD(model, "rms_norm_eps", rms_norm_eps, "epsilon of every RMSNorm"),
      MF_FIELD(model, "rope_theta", rope_theta, "rotary embedding base"),
      MF_FIELD(model, "initializer_range", initializer_range, "std of the normal init of every matrix"),
      MF_FIELD(model, "intermediate_size", intermediate_size, "FFN width of the dense layers (0: none)"),
      MF_FIELD(model, "first_k_dense_replace", first_k_dense_replace, "the first k layers are dense (DeepSeek)"),
      MF_FIELD(model, "mlp_only_layers", mlp_only_layers, "indices of dense layers (Qwen3-MoE)"),
      MF_FIELD(model, "q_lora_rank", q_lora_rank, "MLA: rank of the query compression (0: plain q_proj)"),
      MF_FIELD(model, "kv_lora_rank", kv_lora_rank, "MLA: rank of the key/value latent"),
      MF_FIELD(model, "qk_nope_head_dim", qk_nope_head_dim, "MLA: per-head query/key width without RoPE"),
      MF_FIELD(model, "qk_rope_head_dim", qk_rope_head_dim, "MLA: per-head query/key width with RoPE"),
      MF_FIELD(model, "v_head_dim", v_head_dim, "MLA: per-head value width"),
      MF_FIELD(model, "rope_interleave", rope_interleave, "rotate interleaved pairs (DeepSeek) instead of halves"),
      MF_FIELD(model, "rope_type", rope_type, "\"default\" or \"yarn\" (YaRN context extension)"),
      MF_FIELD(model, "rope_factor", rope_factor, "YaRN: context extension factor"),
      MF_FIELD(model, "rope_original_max_position_embeddings", rope_original_max_position_embeddings,
               "YaRN: context length of pre-training"),
      MF_FIELD(model, "rope_beta_fast", rope_beta_fast, "YaRN: extrapolation boundary (rotations)"),
      MF_FIELD(model, "rope_beta_slow", rope_beta_slow, "YaRN: interpolation boundary (rotations)"),
      MF_FIELD(model, "rope_mscale", rope_mscale, "YaRN: mscale (0: not given)"),
      MF_FIELD(model, "rope_mscale_all_dim", rope_mscale_all_dim, "YaRN: mscale_all_dim (0: not given)"),
      MF_FIELD(model, "num_nextn_predict_layers", num_nextn_predict_layers, "multi-token prediction depth (0: off)"),
      MF_FIELD(model, "mtp_loss_scaling_factor", mtp_loss_scaling_factor,
               "weight of the mean multi-token-prediction loss"),
      MF_FIELD(model, "torch_dtype", torch_dtype, "dtype of exported Hugging Face weights: float32 or bfloat16"),
      MF_FIELD(model, "float32_tensors", float32_tensors,
               "with bfloat16: tensors exported in float32 (names without \"model.layers.N.\")"),
      MF_FIELD(moe, "num_experts", num_experts, "E, routed experts per MoE layer"),
      MF_FIELD(moe, "num_experts_per_tok", num_experts_per_tok, "K, experts each token is sent to"),
      MF_FIELD(moe, "moe_intermediate_size", moe_intermediate_size, "F, FFN width of one expert"),
      MF_FIELD(moe, "scoring_func", scoring_func, "router scores: \"softmax\" or \"sigmoid\""),
      MF_FIELD(moe, "norm_topk_prob", norm_topk_prob, "renormalise the K selected probabilities to sum 1"),
      MF_FIELD(moe, "routed_scaling_factor", routed_scaling_factor,
               "multiplies the (renormalised) top-K probabilities"),
      MF_FIELD(moe, "router_aux_loss_coef", aux_loss_coeff,
               "load-balancing loss weight (Switch/GShard; 1.0 = uniform routing)"),
      MF_FIELD(moe, "router_z_loss_coef", z_loss_coeff, "router z-loss weight (ST-MoE)"),
      MF_FIELD(moe, "router_fp32_gemm", router_fp32_gemm,
               "mixed precision: router logits from fp32 operands (else bf16 operands, fp32 accumulation)"),
      MF_FIELD(moe, "ep_overlap_chunks", ep_overlap_chunks,
               "expert parallelism: pieces each EP peer's rows travel in, so the all-to-all overlaps the experts"),
      MF_FIELD(moe, "capacity_factor", capacity_factor,
               "<= 0: dropless; else capacity = ceil(cf * T * K / E) rows per expert"),
      MF_FIELD(moe, "pad_to_capacity", pad_to_capacity, "with a capacity: pad every expert to exactly its capacity"),
      MF_FIELD(moe, "n_shared_experts", n_shared_experts,
               "shared experts every token passes (one MLP of n x moe_intermediate_size)"),
      MF_FIELD(moe, "n_group", n_group, "group-limited routing: experts in n_group contiguous groups (1: off)"),
      MF_FIELD(moe, "topk_group", topk_group, "groups a token may route into (best by sum of top-2 scores)"),
      MF_FIELD(moe, "expert_bias", expert_bias,
               "aux-loss-free balancing: a per-expert selection bias (gate.e_score_correction_bias)"),
      MF_FIELD(moe, "expert_bias_update_rate", expert_bias_update_rate,
               "bias += rate * sign(mean load - load) after every step"),
      MF_FIELD(moe, "seq_aux_loss_coef", seq_aux_loss_coeff, "sequence-level load-balancing loss weight (DeepSeek-V3)"),
      MF_FIELD(train, "seq_len", seq_len, "tokens per sequence"),
      MF_FIELD(train, "micro_batch_size", micro_batch_size, "sequences per forward/backward"),
      MF_FIELD(train, "global_batch_size", global_batch_size, "sequences per optimizer step (gradient accumulation)"),
      MF_FIELD(train, "steps", steps, "optimizer steps; the LR schedule spans them (--steps N stops early)"),
      MF_FIELD(train, "lr", lr, "peak learning rate"),
      MF_FIELD(train, "min_lr", min_lr, "learning rate at the end of the cosine decay"),
      MF_FIELD(train, "warmup_steps", warmup_steps, "linear warmup steps"),
      MF_FIELD(train, "weight_decay", weight_decay, "AdamW decoupled weight decay (not on norms)"),
      MF_FIELD(train, "adam_beta1", adam_beta1, "AdamW beta1"),
      MF_FIELD(train, "adam_beta2", adam_beta2, "AdamW beta2"),
      MF_FIELD(train, "adam_eps", adam_eps, "AdamW epsilon"),
      MF_FIELD(train, "grad_clip", grad_clip, "global gradient-norm clipping threshold (<= 0: off)"),
      MF_FIELD(train, "eval_interval", eval_interval, "evaluate every N steps (0: only at the end)"),
      MF_FIELD(train, "eval_batches", eval_batches, "held-out micro-batches per evaluation"),
      MF_FIELD(train, "checkpoint_interval", checkpoint_interval, "checkpoint every N steps (0: only at the end)"),
      MF_FIELD(train, "seed", seed, "seed of the init and the data order"),
      MF_FIELD(parallel, "tp", tp, "tensor-parallel size (attention and dense layers)"),
      MF_FIELD(parallel, "cp", cp, "context-parallel size (sequence split for attention)"),
      MF_FIELD(parallel, "dp", dp, "data-parallel size; 0: world / (tp * cp)"),
      MF_FIELD(parallel, "ep", ep, "expert-parallel size (experts split over ep ranks)"),
      MF_FIELD(parallel, "etp", etp, "expert tensor-parallel size"),
      MF_FIELD(parallel, "pp", pp, "pipeline-parallel size (1: not implemented yet)"),
      MF_FIELD(parallel, "timeout_s", timeout_s, "a rank waiting longer on another fails, naming both"),
      MF_FIELD(parallel, "overlap_grad_reduce", overlap_grad_reduce,
               "start each layer's data-parallel gradient all-reduce as its backward ends"),
      MF_FIELD(data, "path", path, ".tokens file or Megatron .bin/.idx prefix; empty: default corpus"),
      MF_FIELD(data, "valid_fraction", valid_fraction, "tail of the token stream held out for evaluation"),
      MF_FIELD(data, "default_corpus_dir", default_corpus_dir,
               "directory the default corpus is read from (empty: built-in)"),
  };
  return f;
}
#undef MF_FIELD

const Field* find_field(std::string_view section, std::string_view key) {
  for (const Field& f : fields())
    if (section == f.section && key == f.key) return &f;
  return nullptr;
}

std::string where_of(const std::string& origin, const toml::node& n) {
  const auto& src = n.source();
  if (src.begin.line == 0) return origin;
  return cat(origin, ":", src.begin.line);
}

// Assigns TOML value `n` to the field, checking its type. `what` names the place for errors.
void assign(Config& c, const Field& f, const toml::node& n, const std::string& what) {
  std::string name = cat(f.section, ".", f.key);
  std::visit(
      [&](auto* p) {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, uint64_t>) {
          auto v = n.value_exact<int64_t>();
          if (!v) MF_FAIL(what, ": ", name, " must be an integer");
          if (std::is_same_v<T, uint64_t> && *v < 0) MF_FAIL(what, ": ", name, " must be >= 0, got ", *v);
          *p = static_cast<T>(*v);
        } else if constexpr (std::is_same_v<T, double>) {
          auto v = n.value<double>();  // integers are accepted for floats
          if (!v || !(n.is_floating_point() || n.is_integer())) MF_FAIL(what, ": ", name, " must be a number");
          *p = *v;
        } else if constexpr (std::is_same_v<T, bool>) {
          auto v = n.value_exact<bool>();
          if (!v) MF_FAIL(what, ": ", name, " must be true or false");
          *p = *v;
        } else if constexpr (std::is_same_v<T, std::string>) {
          auto v = n.value_exact<std::string>();
          if (!v) MF_FAIL(what, ": ", name, " must be a string");
          *p = *v;
        } else if constexpr (std::is_same_v<T, std::vector<int64_t>> || std::is_same_v<T, std::vector<std::string>>) {
          using E = typename T::value_type;
          const char* kind = std::is_same_v<E, int64_t> ? "integers" : "strings";
          const toml::array* a = n.as_array();
          if (!a) MF_FAIL(what, ": ", name, " must be an array of ", kind);
          p->clear();
          for (const toml::node& e : *a) {
            auto v = e.value_exact<E>();
            if (!v) MF_FAIL(what, ": ", name, " must be an array of ", kind);
            p->push_back(*v);
          }
        } else if constexpr (std::is_same_v<T, ScoreFunc>) {
          auto v = n.value_exact<std::string>();
          if (v && *v == "softmax")
            *p = ScoreFunc::softmax;
          else if (v && *v == "sigmoid")
            *p = ScoreFunc::sigmoid;
          else
            MF_FAIL(what, ": ", name, " must be \"softmax\" or \"sigmoid\"");
        }
      },
      f.ref(c));
}

void apply_table(Config& c, const toml::table& root, const std::string& origin) {
  for (const auto& [key, node] : root) {
    std::string k(key.str());
    if (k == "preset") continue;  // consumed by load_config
    const toml::table* sec = node.as_table();
    if (!sec) {
      if (k == "model" || k == "moe" || k == "train" || k == "data" || k == "parallel")
        MF_FAIL(where_of(origin, node), ": '", k, "' must be a [", k, "] section");
      MF_FAIL(where_of(origin, node), ": unknown key '", k,
              "' (sections: [model], [moe], [train], [data], [parallel])");
    }
    for (const auto& [sk, sn] : *sec) {
      const Field* f = find_field(k, sk.str());
      if (!f) {
        if (k != "model" && k != "moe" && k != "train" && k != "data" && k != "parallel")
          MF_FAIL(where_of(origin, node), ": unknown section [", k, "]");
        MF_FAIL(where_of(origin, sn), ": unknown key '", k, ".", sk.str(), "'");
      }
      assign(c, *f, sn, where_of(origin, sn));
    }
  }
}

void apply_override(Config& c, const std::string& ov) {
  std::string what = cat("--set ", ov);
  auto eq = ov.find('=');
  auto dot = ov.find('.');
  if (eq == std::string::npos || dot == std::string::npos || dot > eq) MF_FAIL(what, ": expected section.key=value");
  std::string section = ov.substr(0, dot), key = ov.substr(dot + 1, eq - dot - 1), value = ov.substr(eq + 1);
  const Field* f = find_field(section, key);
  if (!f) MF_FAIL(what, ": unknown key '", section, ".", key, "'");
  toml::table t;
  try {
    t = toml::parse("v = " + value);
  } catch (const toml::parse_error&) {
    t = toml::table{{"v", value}};  // a bare word: a string
  }
  assign(c, *f, *t.get("v"), what);
}

// Shortest text that reads back as the same double, always a TOML float.
std::string format_double(double v) {
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  if (std::isnan(v)) return "nan";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, v);
  std::string s(buf, r.ptr);
  if (s.find_first_of(".en") == std::string::npos) s += ".0";
  return s;
}

}  // namespace

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
  if (eval_interval < 0) MF_FAIL("train.eval_interval = ", eval_interval, " must be >= 0");
  if (checkpoint_interval < 0) MF_FAIL("train.checkpoint_interval = ", checkpoint_interval, " must be >= 0");
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
  const ParallelConfig& p = parallel;
  if (moe.num_experts % p.ep != 0)
    MF_FAIL("moe.num_experts = ", moe.num_experts, " is not divisible by parallel.ep = ", p.ep);
  if (moe.moe_intermediate_size % p.etp != 0)
    MF_FAIL("moe.moe_intermediate_size = ", moe.moe_intermediate_size, " is not divisible by parallel.etp = ", p.etp);
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
  return p;
}

std::vector<std::string> preset_names() {
  return {"tiny", "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "mixtral-8x7b", "olmoe-1b-7b"};
}

Config preset_config(const std::string& name) {
  Config c;  // the defaults are the tiny preset
  c.preset = name;
  if (name == "tiny") return c;
  if (name == "qwen3-30b-a3b" || name == "qwen3-235b-a22b") {
    // Shapes from the models' published config.json (see ../shared/BENCHMARKS.md).
    bool big = name == "qwen3-235b-a22b";
    c.model.vocab_size = 151936;
    c.model.hidden_size = big ? 4096 : 2048;
    c.model.num_hidden_layers = big ? 94 : 48;
    c.model.num_attention_heads = big ? 64 : 32;
    c.model.num_key_value_heads = 4;
    c.model.head_dim = 128;
    c.model.max_position_embeddings = 40960;
    c.model.rope_theta = 1e6;
    c.moe.num_experts = 128;
    c.moe.num_experts_per_tok = 8;
    c.moe.moe_intermediate_size = big ? 1536 : 768;
    c.moe.norm_topk_prob = true;
    c.moe.aux_loss_coeff = 1e-3;
    c.train.seq_len = 4096;
    c.train.micro_batch_size = 1;
    c.train.global_batch_size = 1024;
    c.train.lr = 3e-4;
    c.train.min_lr = 3e-5;
    c.train.warmup_steps = 2000;
    c.train.steps = 100000;
    c.train.eval_interval = 1000;
    c.train.checkpoint_interval = 1000;
    return c;
  }
  if (name == "deepseek-v3" || name == "mixtral-8x7b" || name == "olmoe-1b-7b") {
    // Shapes from the models' published config.json (see ../shared/BENCHMARKS.md).
    ModelConfig& m = c.model;
    MoeConfig& e = c.moe;
    if (name == "deepseek-v3") {
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
    } else if (name == "mixtral-8x7b") {
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
      e.num_experts = 8;
      e.num_experts_per_tok = 2;
      e.moe_intermediate_size = 14336;
      e.aux_loss_coeff = 2e-2;
    } else {
      m.architecture = "olmoe";
      m.vocab_size = 50304;
      m.hidden_size = 2048;
      m.num_hidden_layers = 16;
      m.num_attention_heads = m.num_key_value_heads = 16;
      m.head_dim = 128;
      m.rope_theta = 10000;
      m.max_position_embeddings = 4096;
      m.rms_norm_eps = 1e-5;
      e.num_experts = 64;
      e.num_experts_per_tok = 8;
      e.moe_intermediate_size = 1024;
      e.norm_topk_prob = false;
      e.aux_loss_coeff = 1e-2;
      e.z_loss_coeff = 1e-3;
    }
    c.train.seq_len = 4096;
    c.train.micro_batch_size = 1;
    c.train.global_batch_size = 1024;
    c.train.lr = 3e-4;
    c.train.min_lr = 3e-5;
    c.train.warmup_steps = 2000;
    c.train.steps = 100000;
    c.train.eval_interval = 1000;
    c.train.checkpoint_interval = 1000;
    return c;
  }
  std::string known;
  for (const auto& n : preset_names()) known += (known.empty() ? "" : ", ") + n;
  MF_FAIL("unknown preset '", name, "' (known: ", known, ")");
}

Config load_config(const std::string& spec, const std::vector<std::string>& overrides) {
  Config c;
  bool is_file =
      spec.ends_with(".toml") || spec.find('/') != std::string::npos || std::filesystem::is_regular_file(spec);
  if (spec.empty()) {
    c = preset_config("tiny");
  } else if (!is_file) {
    c = preset_config(spec);
  } else {
    std::error_code ec;
    if (!std::filesystem::is_regular_file(spec, ec)) MF_FAIL(spec, ": config file not found");
    toml::table root;
    try {
      root = toml::parse_file(spec);
    } catch (const toml::parse_error& e) {
      MF_FAIL(spec, ":", e.source().begin.line, ": TOML syntax error: ", e.description());
    }
    std::string base = "tiny";
    if (const toml::node* p = root.get("preset")) {
      auto v = p->value_exact<std::string>();
      if (!v) MF_FAIL(where_of(spec, *p), ": preset must be a string");
      base = *v;
    }
    try {
      c = preset_config(base);
    } catch (const Error& e) {
      MF_FAIL(spec, ": ", e.what());
    }
    apply_table(c, root, spec);
  }
  for (const std::string& ov : overrides) apply_override(c, ov);
  try {
    c.validate();
  } catch (const Error& e) {
    if (is_file) MF_FAIL(spec, ": ", e.what());
    throw;
  }
  return c;
}

std::string config_to_toml(const Config& cc) {
  Config& c = const_cast<Config&>(cc);  // fields() hands out mutable refs; nothing is written here
  std::ostringstream os;
  os.precision(17);
  os << "preset = \"" << c.preset << "\"\n";
  std::string section;
  for (const Field& f : fields()) {
    if (section != f.section) {
      section = f.section;
      os << "\n[" << section << "]\n";
    }
    os << f.key << " = ";
    std::visit(
        [&](auto* p) {
          using T = std::remove_pointer_t<decltype(p)>;
          if constexpr (std::is_same_v<T, std::string>)
            os << toml::value<std::string>(*p);
          else if constexpr (std::is_same_v<T, bool>)
            os << (*p ? "true" : "false");
          else if constexpr (std::is_same_v<T, ScoreFunc>)
            os << (*p == ScoreFunc::softmax ? "\"softmax\"" : "\"sigmoid\"");
          else if constexpr (std::is_same_v<T, double>)
            os << format_double(*p);
          else if constexpr (std::is_same_v<T, std::vector<int64_t>> || std::is_same_v<T, std::vector<std::string>>) {
            os << "[";
            for (size_t i = 0; i < p->size(); ++i)
              os << (i ? ", " : "") << toml::value<typename T::value_type>((*p)[i]);
            os << "]";
          } else
            os << *p;
        },
        f.ref(c));
    os << "  # " << f.doc << "\n";
  }
  return os.str();
}

namespace {
double yarn_mscale(double factor, double mscale) { return factor <= 1 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0; }
}  // namespace

std::vector<double> rope_inv_freq(const ModelConfig& m, double* attention_factor) {
  const int64_t d = m.head_dim, half = d / 2;
  const double base = m.rope_theta;
  std::vector<double> inv(static_cast<size_t>(half));
  for (int64_t j = 0; j < half; ++j) inv[j] = std::pow(base, -2.0 * static_cast<double>(j) / static_cast<double>(d));
  *attention_factor = 1.0;
  if (m.rope_type != "yarn") return inv;
  const double factor = m.rope_factor;
  *attention_factor = m.rope_mscale > 0 && m.rope_mscale_all_dim > 0
                          ? yarn_mscale(factor, m.rope_mscale) / yarn_mscale(factor, m.rope_mscale_all_dim)
                          : yarn_mscale(factor, 1.0);
  const double orig = static_cast<double>(m.rope_original_max_position_embeddings), pi = std::acos(-1.0);
  auto correction_dim = [&](double rotations) {
    return static_cast<double>(d) * std::log(orig / (rotations * 2 * pi)) / (2 * std::log(base));
  };
  double low = std::max(std::floor(correction_dim(m.rope_beta_fast)), 0.0);
  double high = std::min(std::ceil(correction_dim(m.rope_beta_slow)), static_cast<double>(d - 1));
  if (low == high) high += 0.001;
  for (int64_t j = 0; j < half; ++j) {
    const double ramp = std::clamp((static_cast<double>(j) - low) / (high - low), 0.0, 1.0);
    const double extrapolation = 1.0 - ramp;  // weight of the original frequency
    inv[j] = inv[j] / factor * (1.0 - extrapolation) + inv[j] * extrapolation;
  }
  return inv;
}

double attention_softmax_scale(const ModelConfig& m) {
  double scale = 1.0 / std::sqrt(static_cast<double>(m.qk_head_dim()));
  if (m.is_mla() && m.rope_type != "default" && m.rope_mscale_all_dim > 0) {
    const double ms = yarn_mscale(m.rope_factor, m.rope_mscale_all_dim);
    scale *= ms * ms;
  }
  return scale;
}

ModelSize model_size(const ModelConfig& m, const MoeConfig& e, int64_t seq_len) {
  const int64_t h = m.hidden_size, q = m.num_attention_heads;
  // Attention parameters and forward FLOPs per token (projections 2 x params; the causal core
  // S * heads * (qk + v width), i.e. QK^T and PV each halved by the mask).
  int64_t attn = 0;
  double core = 0;
  if (m.is_mla()) {
    const int64_t dqk = m.qk_head_dim(), rq = m.q_lora_rank, rkv = m.kv_lora_rank;
    attn = (rq > 0 ? h * rq + rq + rq * q * dqk : h * q * dqk) + h * (rkv + m.qk_rope_head_dim) + rkv +
           rkv * q * (m.qk_nope_head_dim + m.v_head_dim) + q * m.v_head_dim * h;
    core = static_cast<double>(seq_len) * q * (dqk + m.v_head_dim);
  } else {
    const int64_t q_dim = q * m.head_dim, kv_dim = m.num_key_value_heads * m.head_dim;
    attn = h * (q_dim + 2 * kv_dim) + q_dim * h;
    core = 2.0 * seq_len * q_dim;
  }
  const int64_t qk_norms = m.architecture == "qwen3_moe" ? 2 * m.head_dim
                           : m.architecture == "olmoe"   ? (m.num_attention_heads + m.num_key_value_heads) * m.head_dim
                                                         : 0;
  const int64_t attn_params = attn + qk_norms, norms = 2 * h;
  const int64_t router = e.num_experts * h + (e.expert_bias ? e.num_experts : 0);
  const int64_t expert = 3 * h * e.moe_intermediate_size, shared = 3 * h * e.moe_intermediate_size * e.n_shared_experts;
  const int64_t dense_mlp = 3 * h * m.intermediate_size;
  const int64_t embed = m.vocab_size * h, head = m.vocab_size * h;
  ModelSize s;
  s.total_params = s.active_params = embed + head + h;
  const double attn_fwd = 2.0 * static_cast<double>(attn) + core;
  const double moe_fwd =
      2.0 * h * e.num_experts + 6.0 * static_cast<double>(e.num_experts_per_tok * expert / 3 + shared / 3);
  double fwd = 2.0 * h * m.vocab_size;
  auto add_layer = [&](bool dense, int64_t* total, int64_t* active, double* flops) {
    *total += attn_params + norms + (dense ? dense_mlp : router + e.num_experts * expert + shared);
    *active += attn_params + norms + (dense ? dense_mlp : router + e.num_experts_per_tok * expert + shared);
    *flops += attn_fwd + (dense ? 6.0 * h * m.intermediate_size : moe_fwd);
  };
  for (int64_t l = 0; l < m.num_hidden_layers; ++l)
    add_layer(m.is_dense_layer(l), &s.total_params, &s.active_params, &fwd);
  // Multi-token prediction: a decoder layer, two norms, eh_proj and a head norm per depth, and
  // the shared head once more (counted apart from the main model, as DeepSeek-V3 reports it).
  for (int64_t k = 0; k < m.num_nextn_predict_layers; ++k) {
    int64_t unused = 0;
    add_layer(false, &s.mtp_params, &unused, &fwd);
    s.mtp_params += 3 * h + 2 * h * h;
    fwd += 2.0 * 2 * h * h + 2.0 * h * m.vocab_size;
  }
  s.train_flops_per_token = 3.0 * fwd;
  return s;
}

}  // namespace moefold

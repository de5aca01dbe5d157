// Parameter counts (config.h: model_size) and model FLOPs per token by part (model_flops.h). Model
// FLOPs: 2 per multiply-add of every weight a token passes through (top-K experts of E), plus the
// causal attention core; training is 3 x the forward (the backward computes data and weight gradients).
#include "moefold/model/model_flops.h"

namespace moefold {

namespace {
// Attention parameters of one layer (projections only; the q/k norms apart).
int64_t attention_params(const ModelConfig& m) {
  const int64_t h = m.hidden_size, q = m.num_attention_heads;
  if (m.is_mla()) {
    const int64_t dqk = m.qk_head_dim(), rq = m.q_lora_rank, rkv = m.kv_lora_rank;
    return (rq > 0 ? h * rq + rq + rq * q * dqk : h * q * dqk) + h * (rkv + m.qk_rope_head_dim) + rkv +
           rkv * q * (m.qk_nope_head_dim + m.v_head_dim) + q * m.v_head_dim * h;
  }
  const int64_t q_dim = q * m.head_dim, kv_dim = m.num_key_value_heads * m.head_dim;
  return h * (q_dim + 2 * kv_dim) + q_dim * h;
}
}  // namespace

double ModelFlops::forward() const {
  const double depth = static_cast<double>(mtp_depth);
  return lm_head + static_cast<double>(moe_layers) * (attention() + moe()) +
         static_cast<double>(dense_layers) * (attention() + dense_mlp) +
         depth * (attention() + moe() + mtp_proj + lm_head);
}

ModelFlops model_flops(const ModelConfig& m, const MoeConfig& e, int64_t seq_len) {
  const int64_t h = m.hidden_size, q = m.num_attention_heads;
  ModelFlops f;
  f.attn_proj = 2.0 * static_cast<double>(attention_params(m));
  // The causal core: S * heads * (qk + v width), i.e. QK^T and PV each halved by the mask.
  f.attn_core =
      m.is_mla() ? static_cast<double>(seq_len) * q * (m.qk_head_dim() + m.v_head_dim) : 2.0 * seq_len * q * m.head_dim;
  f.router = 2.0 * h * e.num_experts;
  f.experts = 6.0 * static_cast<double>(e.num_experts_per_tok * h * e.moe_intermediate_size);
  f.shared_experts = 6.0 * static_cast<double>(h * e.moe_intermediate_size * e.n_shared_experts);
  f.dense_mlp = 6.0 * h * m.intermediate_size;
  f.lm_head = 2.0 * h * m.vocab_size;
  f.mtp_proj = 2.0 * 2 * h * h;
  for (int64_t l = 0; l < m.num_hidden_layers; ++l) ++(m.is_dense_layer(l) ? f.dense_layers : f.moe_layers);
  f.mtp_depth = m.num_nextn_predict_layers;
  return f;
}

ModelSize model_size(const ModelConfig& m, const MoeConfig& e, int64_t seq_len) {
  const int64_t h = m.hidden_size;
  const int64_t qk_norms = m.architecture == "qwen3_moe" ? 2 * m.head_dim
                           : m.architecture == "olmoe"   ? (m.num_attention_heads + m.num_key_value_heads) * m.head_dim
                                                         : 0;
  const int64_t attn_params = attention_params(m) + qk_norms, norms = 2 * h;
  const int64_t router = e.num_experts * h + (e.expert_bias ? e.num_experts : 0);
  const int64_t expert = 3 * h * e.moe_intermediate_size, shared = 3 * h * e.moe_intermediate_size * e.n_shared_experts;
  const int64_t dense_mlp = 3 * h * m.intermediate_size;
  const int64_t embed = m.vocab_size * h, head = m.vocab_size * h;
  ModelSize s;
  s.total_params = s.active_params = embed + head + h;
  auto add_layer = [&](bool dense, int64_t* total, int64_t* active) {
    *total += attn_params + norms + (dense ? dense_mlp : router + e.num_experts * expert + shared);
    *active += attn_params + norms + (dense ? dense_mlp : router + e.num_experts_per_tok * expert + shared);
  };
  for (int64_t l = 0; l < m.num_hidden_layers; ++l) add_layer(m.is_dense_layer(l), &s.total_params, &s.active_params);
  // Multi-token prediction: a decoder layer, two norms, eh_proj and a head norm per depth, and
  // the shared head once more (counted apart from the main model, as DeepSeek-V3 reports it).
  for (int64_t k = 0; k < m.num_nextn_predict_layers; ++k) {
    int64_t unused = 0;
    add_layer(false, &s.mtp_params, &unused);
    s.mtp_params += 3 * h + 2 * h * h;
  }
  s.train_flops_per_token = 3.0 * model_flops(m, e, seq_len).forward();
  return s;
}

}  // namespace moefold

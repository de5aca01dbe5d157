// MoeConfig's invariants and the capacity arithmetic every MoE buffer is sized from.
#include "moefold/moe/moe_config.h"

#include <algorithm>
#include <cmath>

#include "moefold/core/error.h"

namespace moefold {

void MoeConfig::validate() const {
  require_positive("moe", "num_experts", num_experts);
  require_positive("moe", "num_experts_per_tok", num_experts_per_tok);
  if (num_experts_per_tok > num_experts)
    MF_FAIL("moe.num_experts_per_tok = ", num_experts_per_tok, " must be <= moe.num_experts = ", num_experts);
  require_positive("moe", "moe_intermediate_size", moe_intermediate_size);
  if (!std::isfinite(capacity_factor)) MF_FAIL("moe.capacity_factor = ", capacity_factor, " must be finite");
  if (!(routed_scaling_factor > 0) || !std::isfinite(routed_scaling_factor))
    MF_FAIL("moe.routed_scaling_factor = ", routed_scaling_factor, " must be finite and > 0");
  if (!(aux_loss_coeff >= 0) || !std::isfinite(aux_loss_coeff))
    MF_FAIL("moe.aux_loss_coeff = ", aux_loss_coeff, " must be finite and >= 0");
  if (!(z_loss_coeff >= 0) || !std::isfinite(z_loss_coeff))
    MF_FAIL("moe.z_loss_coeff = ", z_loss_coeff, " must be finite and >= 0");
  require_positive("moe", "n_group", n_group);
  require_positive("moe", "ep_overlap_chunks", ep_overlap_chunks);
  if (!std::isfinite(ep_recv_factor) || (ep_recv_factor != 0 && ep_recv_factor < 1))
    MF_FAIL("moe.ep_recv_factor = ", ep_recv_factor, " must be 0 (the worst case) or >= 1 (times the average)");
  require_positive("moe", "topk_group", topk_group);
  if (dispatcher != "alltoall" && dispatcher != "hierarchical" && dispatcher != "slots")
    MF_FAIL("moe.dispatcher = '", dispatcher, "' is not supported (alltoall, hierarchical, slots)");
  if (dispatcher == "slots" && capacity_factor > 0 && !pad_to_capacity)
    MF_FAIL("moe.dispatcher = \"slots\" needs dropless routing or moe.pad_to_capacity = true (moe.capacity_factor = ",
            capacity_factor, " without padding leaves row counts only the host knows)");
  if (dispatcher == "slots" && num_experts > 1024)
    MF_FAIL("moe.dispatcher = \"slots\" takes at most 1024 experts (moe.num_experts = ", num_experts, ")");
  if (num_experts % n_group != 0) MF_FAIL("moe.n_group = ", n_group, " must divide moe.num_experts = ", num_experts);
  if (topk_group > n_group) MF_FAIL("moe.topk_group = ", topk_group, " must be <= moe.n_group = ", n_group);
  if (num_experts_per_tok > topk_group * (num_experts / n_group))
    MF_FAIL("moe.num_experts_per_tok = ", num_experts_per_tok,
            " must be <= moe.topk_group * moe.num_experts / moe.n_group = ", topk_group * (num_experts / n_group),
            " (the experts of the kept groups)");
  // As Megatron-Core's TransformerConfig, which accepts the bias with sigmoid scores only
  // (DeepSeek-V3 pairs them, section 2.1.2).
  if (expert_bias && scoring_func != ScoreFunc::sigmoid)
    MF_FAIL("moe.expert_bias = true requires moe.scoring_func = \"sigmoid\"");
  if (!(router_init_std >= 0) || !std::isfinite(router_init_std))
    MF_FAIL("moe.router_init_std = ", router_init_std, " must be finite and >= 0");
  if (!(expert_bias_update_rate >= 0) || !std::isfinite(expert_bias_update_rate))
    MF_FAIL("moe.expert_bias_update_rate = ", expert_bias_update_rate, " must be finite and >= 0");
  if (!(seq_aux_loss_coeff >= 0) || !std::isfinite(seq_aux_loss_coeff))
    MF_FAIL("moe.seq_aux_loss_coeff = ", seq_aux_loss_coeff, " must be finite and >= 0");
  if (shared_expert_overlap && n_shared_experts <= 0)
    MF_FAIL("moe.shared_expert_overlap = true needs moe.n_shared_experts > 0 (got ", n_shared_experts, ")");
  if (pad_to_capacity && !(capacity_factor > 0))
    MF_FAIL("moe.pad_to_capacity = true requires moe.capacity_factor > 0 (got ", capacity_factor, ")");
}

int64_t MoeConfig::capacity(int64_t num_tokens) const {
  if (!(capacity_factor > 0)) return 0;
  // GShard / Megatron-Core: ceil(capacity_factor * tokens * topk / experts).
  return static_cast<int64_t>(std::ceil(capacity_factor * static_cast<double>(num_tokens * num_experts_per_tok) /
                                        static_cast<double>(num_experts)));
}

int64_t MoeConfig::max_rows(int64_t num_tokens) const {
  const int64_t assignments = num_tokens * num_experts_per_tok;
  if (!(capacity_factor > 0)) return assignments;
  const int64_t capped = num_experts * capacity(num_tokens);
  return pad_to_capacity ? capped : std::min(assignments, capped);
}

}  // namespace moefold

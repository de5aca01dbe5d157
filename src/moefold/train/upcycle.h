// Sparse upcycling (Komatsuzaki et al., 2022, "Sparse Upcycling: Training Mixture-of-Experts from
// Dense Checkpoints"; with the fine-grained split of He et al., 2024, "Upcycling Large Language
// Models into Mixture of Experts"): an MoE run directory initialised from a dense checkpoint whose
// step-0 logits equal the dense model's (up to fp32 rounding).
//
// Every layer dense in the source and MoE in the target becomes E experts, E / G copies of the
// dense SwiGLU MLP each cut into G = granularity contiguous chunks of F / G along the FFN
// dimension: expert e = c * G + j holds chunk j (rows of gate_proj and up_proj, columns of
// down_proj, the latter times G / moe.routed_scaling_factor). The G router rows of a copy are equal
// (normal, std model.initializer_range, from train.seed), so the G experts of a copy get equal
// scores; with K a multiple of G, ties to the lower index and renormalised top-K probabilities,
// the K selected experts are K / G whole copies c with weights p_c / (G * sum p), and
// sum_c p_c / (G sum p) * sum_j G * chunk_j(x) = MLP(x). Every other tensor is copied.
// The ties must be exact: a GEMM computes its edge tiles in another order than its full tiles, so
// Router::forward gives bitwise-equal gate rows the same logits explicitly (moe/router.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moefold {

// `moefold convert --upcycle --from DENSE_CKPT_DIR --to RUN_DIR [--granularity G] [--set ...]`.
// The target config is DENSE_CKPT_DIR/config.toml with `overrides` ("section.key=value", as
// load_config takes them) applied, then model.mlp_only_layers = [] and
// model.first_k_dense_replace = 0 (unless an override sets them: layers dense in the target stay
// dense and are copied) and moe.moe_intermediate_size = model.intermediate_size / granularity.
// Writes RUN_DIR/config.toml and RUN_DIR/checkpoints/step_00000000 (zero optimizer state);
// returns the checkpoint path. Error (one line naming the key or file) unless the source has a
// dense layer, moe.norm_topk_prob is true, G divides moe.num_experts, moe.num_experts_per_tok
// and model.intermediate_size, moe.n_shared_experts is 0, routing is dropless
// (moe.capacity_factor <= 0), expert groups (moe.n_group) hold whole copies, and RUN_DIR holds
// no checkpoints.
std::string upcycle(const std::string& dense_ckpt_dir, const std::string& run_dir,
                    const std::vector<std::string>& overrides, int64_t granularity);

}  // namespace moefold

// The routing cases the multi-rank MoE dispatcher tests share (E = 8 experts of F = 5): balanced,
// imbalanced and idle ranks, capacity drops and padding, several rounds, planned receive buffers.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "moefold/moe/moe_config.h"

namespace moefold::testing {

inline constexpr int64_t kCaseExperts = 8, kCaseFfn = 5;

struct Case {
  std::string name;
  MoeConfig cfg;
  std::vector<double> bias_E;  // added to every element of gate row e; empty: unbiased router
};
inline void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }  // GoogleTest's failure lines

// The knobs the cases turn (everything else: E = 8 experts, F = 5, no aux / z loss).
struct Knobs {
  int64_t k = 2;           // num_experts_per_tok
  bool sigmoid = false;    // sigmoid scores, routed_scaling_factor 2.5 (DeepSeek-V3 style)
  bool norm = true;        // norm_topk_prob
  bool aux = false;        // aux_loss_coeff 0.1, z_loss_coeff 0.01
  double capacity = 0;     // capacity_factor
  bool pad = false;        // pad_to_capacity
  int64_t chunks = 2;      // ep_overlap_chunks: the rounds each peer's rows travel in
  double recv = 0;         // ep_recv_factor: receive buffers as a multiple of the average (0: worst case)
  int64_t ffn = kCaseFfn;  // moe_intermediate_size
};

inline Case make(std::string name, Knobs o, std::vector<double> bias_E = {}) {
  MoeConfig cfg{.num_experts = kCaseExperts,
                .num_experts_per_tok = o.k,
                .moe_intermediate_size = o.ffn,
                .scoring_func = o.sigmoid ? ScoreFunc::sigmoid : ScoreFunc::softmax,
                .norm_topk_prob = o.norm,
                .routed_scaling_factor = o.sigmoid ? 2.5 : 1.0,
                .aux_loss_coeff = o.aux ? 0.1 : 0.0,
                .z_loss_coeff = o.aux ? 0.01 : 0.0,
                .capacity_factor = o.capacity,
                .pad_to_capacity = o.pad,
                .ep_overlap_chunks = o.chunks,
                .ep_recv_factor = o.recv};
  return {std::move(name), cfg, std::move(bias_E)};
}

inline std::vector<Case> all_cases() {
  const std::vector<double> rank0 = {1.5, 1.5, 0, 0, 0, 0, 0, 0};  // experts 0, 1: rank 0 at any EP
  // Experts 1 and 4-7 never chosen: rank EP-1 is idle at EP 2 and 4 (and rank 2 at EP 4); at EP 4
  // rank 0 holds a busy and an idle expert.
  const std::vector<double> idle = {0, -5, 0, 0, -5, -5, -5, -5};
  const std::vector<double> one = {0, 0, 0, 0, 0, 0, 0, 5};  // every token to expert 7
  const std::vector<double> two = {0, 0, 0, 0, 0, 0, 5, 5};  // every token to 6 and 7 (one rank)
  // K = 1 with renormalisation gives every token probability 1 (no router gradient from the main
  // loss): such cases either have the aux loss or run Switch-style without renormalisation.
  return {
      make("balanced_softmax_k2", {}),
      make("balanced_softmax_k1", {.k = 1, .norm = false}),
      make("balanced_sigmoid_k2_aux", {.sigmoid = true, .aux = true}),
      make("balanced_sigmoid_k1_nonorm", {.k = 1, .sigmoid = true, .norm = false}),
      make("imbalanced_softmax_k2", {}, rank0),
      make("imbalanced_sigmoid_k1_aux", {.k = 1, .sigmoid = true, .aux = true}, rank0),
      make("idle_rank_softmax_k2", {}, idle),
      make("idle_rank_sigmoid_k1_aux", {.k = 1, .sigmoid = true, .aux = true}, idle),
      make("one_expert_softmax_k1", {.k = 1, .norm = false}, one),
      make("two_experts_one_rank_softmax_k2_aux", {.aux = true}, two),
      make("capacity_softmax_k2_aux", {.aux = true, .capacity = 0.6}),
      // Every probability is equal (sigmoid, K = 1, renormalised): capacity keeps the lowest tokens.
      make("capacity_imbalanced_sigmoid_k1_aux", {.k = 1, .sigmoid = true, .aux = true, .capacity = 1.0}, rank0),
      make("capacity_padded_softmax_k2", {.capacity = 0.75, .pad = true}),
      make("capacity_padded_idle_rank_sigmoid_k1_aux",
           {.k = 1, .sigmoid = true, .aux = true, .capacity = 1.5, .pad = true}, idle),
      // The rounds: one per peer (no pipelining), three, and more rounds than some peers have
      // rows (empty pieces).
      make("one_round_softmax_k2", {.chunks = 1}),
      make("three_rounds_imbalanced_softmax_k2_aux", {.aux = true, .chunks = 3}, rank0),
      make("seven_rounds_capacity_padded_softmax_k2", {.capacity = 0.75, .pad = true, .chunks = 7}),
      make("seven_rounds_idle_rank_sigmoid_k1", {.k = 1, .sigmoid = true, .norm = false, .chunks = 7}, idle),
      // Receive buffers planned at 2.5 x the average instead of the worst case (P x the average).
      make("recv_factor_balanced_softmax_k2", {.recv = 2.5}),
  };
}

}  // namespace moefold::testing

// MoE: config checks, every MoE op's backward against float64 finite differences, the permutation
// and capacity rules, and the whole MoeLayer (gradients, dense equivalence, zero-token experts,
// f32 vs f64). Shape letters: T tokens, H hidden, E experts, K top-k, F expert FFN, R rows.
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "moefold/core/memory.h"
#include "moefold/core/rng.h"
#include "moefold/moe/experts.h"
#include "moefold/moe/moe_layer.h"
#include "moefold/ops/moe_ops.h"
#include "testing.h"

namespace moefold {
namespace {

using testing::check_gradient;
using testing::dot;
using testing::max_abs;
using testing::max_abs_diff;
using testing::Pool;

const std::string kPrefix = "model.layers.0.mlp";

// Copies with dtype conversion (f32 <-> f64).
void convert(const Tensor& dst, const Tensor& src) {
  ASSERT_EQ(dst.numel(), src.numel());
  for (int64_t i = 0; i < src.numel(); ++i) testing::set_value_at(dst, i, testing::value_at(src, i));
}

// Smallest gap between the K-th and (K+1)-th score of any token: finite differences with
// eps = 1e-6 see a fixed top-k selection when this is well above 1e-6.
double topk_gap(const Tensor& scores_TE, int64_t k) {
  const int64_t t_n = scores_TE.size(0), e_n = scores_TE.size(1);
  double gap = 1e30;
  for (int64_t t = 0; t < t_n && k < e_n; ++t) {
    std::vector<double> s(e_n);
    for (int64_t e = 0; e < e_n; ++e) s[e] = testing::value_at(scores_TE, t * e_n + e);
    std::sort(s.rbegin(), s.rend());
    gap = std::min(gap, s[k - 1] - s[k]);
  }
  return gap;
}

// Smallest gap between two probabilities routed to the same expert (capacity ordering).
double capacity_gap(const Tensor& idx_TK, const Tensor& prob_TK) {
  double gap = 1e30;
  for (int64_t a = 0; a < idx_TK.numel(); ++a)
    for (int64_t b = a + 1; b < idx_TK.numel(); ++b)
      if (testing::value_at(idx_TK, a) == testing::value_at(idx_TK, b))
        gap = std::min(gap, std::abs(testing::value_at(prob_TK, a) - testing::value_at(prob_TK, b)));
  return gap;
}

// ---- config --------------------------------------------------------------------------------------

std::string validate_message(const MoeConfig& c) {
  try {
    c.validate();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(MoeConfig, ValidateNamesTheKey) {
  EXPECT_EQ(validate_message(MoeConfig{}), "");
  MoeConfig c;
  c.num_experts_per_tok = 9;
  EXPECT_EQ(validate_message(c), "moe.num_experts_per_tok = 9 must be <= moe.num_experts = 8");
  c = {};
  c.num_experts = 0;
  EXPECT_NE(validate_message(c).find("moe.num_experts = 0"), std::string::npos);
  c = {};
  c.num_experts_per_tok = 0;
  EXPECT_NE(validate_message(c).find("moe.num_experts_per_tok = 0"), std::string::npos);
  c = {};
  c.moe_intermediate_size = 0;
  EXPECT_NE(validate_message(c).find("moe.moe_intermediate_size = 0"), std::string::npos);
  c = {};
  c.capacity_factor = INFINITY;
  EXPECT_NE(validate_message(c).find("moe.capacity_factor"), std::string::npos);
  c = {};
  c.capacity_factor = NAN;
  EXPECT_NE(validate_message(c).find("moe.capacity_factor"), std::string::npos);
  c = {};
  c.routed_scaling_factor = 0;
  EXPECT_NE(validate_message(c).find("moe.routed_scaling_factor = 0"), std::string::npos);
  c = {};
  c.aux_loss_coeff = -1;
  EXPECT_NE(validate_message(c).find("moe.aux_loss_coeff = -1"), std::string::npos);
  c = {};
  c.z_loss_coeff = NAN;
  EXPECT_NE(validate_message(c).find("moe.z_loss_coeff"), std::string::npos);
  c = {};
  c.pad_to_capacity = true;
  EXPECT_NE(validate_message(c).find("moe.pad_to_capacity"), std::string::npos);
  c.capacity_factor = 1.0;
  EXPECT_EQ(validate_message(c), "");
  EXPECT_THROW(MoeLayer(MoeConfig{.num_experts = 2, .num_experts_per_tok = 3}, 4, 4, kPrefix), Error);
}

TEST(MoeConfig, CapacityAndMaxRows) {
  MoeConfig c;  // E = 8, K = 2, dropless
  EXPECT_EQ(c.capacity(100), 0);
  EXPECT_EQ(c.max_rows(100), 200);
  c.capacity_factor = 1.0;
  EXPECT_EQ(c.capacity(100), 25);  // ceil(1.0 * 100 * 2 / 8)
  EXPECT_EQ(c.max_rows(100), 200);
  c.capacity_factor = 1.1;
  EXPECT_EQ(c.capacity(100), 28);   // ceil(27.5)
  EXPECT_EQ(c.max_rows(100), 200);  // min(T*K, E*cap) = min(200, 224)
  c.pad_to_capacity = true;
  EXPECT_EQ(c.max_rows(100), 224);
  c.capacity_factor = 0.5;
  c.pad_to_capacity = false;
  EXPECT_EQ(c.capacity(100), 13);  // ceil(12.5)
  EXPECT_EQ(c.max_rows(100), 104);
}

// ---- router scores and top-k -----------------------------------------------------------------

TEST(RouterTopk, SelectsLargestTiesToLowerExpert) {
  Pool pool;
  Tensor logits = pool.zeros({2, 4});
  const double l[] = {0.5, 2.0, 2.0, -1.0,  // tie between experts 1 and 2
                      0.0, 0.0, 0.0, 0.0};  // all tied
  for (int i = 0; i < 8; ++i) testing::set_value_at(logits, i, l[i]);
  Tensor scores = pool.zeros({2, 4}), idx = pool.ints({2, 3}, 0, 1), prob = pool.zeros({2, 3});
  router_topk_forward(testing::exec(), logits, {ScoreFunc::softmax, true, 2.0}, scores, idx, prob);
  EXPECT_EQ(testing::value_at(idx, 0), 1);
  EXPECT_EQ(testing::value_at(idx, 1), 2);
  EXPECT_EQ(testing::value_at(idx, 2), 0);
  EXPECT_EQ(testing::value_at(idx, 3), 0);
  EXPECT_EQ(testing::value_at(idx, 4), 1);
  EXPECT_EQ(testing::value_at(idx, 5), 2);
  for (int t = 0; t < 2; ++t)  // renormalised then scaled: sums to the scaling factor
    EXPECT_NEAR(
        testing::value_at(prob, t * 3) + testing::value_at(prob, t * 3 + 1) + testing::value_at(prob, t * 3 + 2), 2.0,
        1e-12);
  EXPECT_NEAR(testing::value_at(prob, 3), 2.0 / 3, 1e-12);
  double se = 0;
  for (int e = 0; e < 4; ++e) se += std::exp(l[e]);
  router_topk_forward(testing::exec(), logits, {ScoreFunc::softmax, false, 1.0}, scores, idx, prob);
  EXPECT_NEAR(testing::value_at(prob, 0), std::exp(2.0) / se, 1e-12);
  router_topk_forward(testing::exec(), logits, {ScoreFunc::sigmoid, false, 1.5}, scores, idx, prob);
  EXPECT_NEAR(testing::value_at(prob, 2), 1.5 / (1 + std::exp(-0.5)), 1e-12);
}

TEST(RouterTopk, BackwardMatchesFiniteDifferences) {
  const int64_t t_n = 5, e_n = 6;
  for (ScoreFunc f : {ScoreFunc::softmax, ScoreFunc::sigmoid})
    for (bool norm : {false, true})
      for (double scaling : {1.0, 2.5})
        for (int64_t k_n : {1, 3}) {
          const TopkRouting routing{f, norm, scaling};
          const std::string what = std::string(f == ScoreFunc::softmax ? "softmax" : "sigmoid") +
                                   (norm ? " norm" : "") + " scaling " + std::to_string(scaling) + " k " +
                                   std::to_string(k_n);
          Pool pool;
          Tensor scores = pool.zeros({t_n, e_n}), idx = pool.ints({t_n, k_n}, 0, 1), prob = pool.zeros({t_n, k_n});
          Tensor logits;
          for (int tries = 0; tries < 50; ++tries) {
            logits = pool.randn({t_n, e_n});
            router_topk_forward(testing::exec(), logits, routing, scores, idx, prob);
            if (topk_gap(scores, k_n) > 1e-3) break;
          }
          ASSERT_GT(topk_gap(scores, k_n), 1e-3) << what;
          Tensor g = pool.randn({t_n, k_n}), dlogits = pool.zeros({t_n, e_n});
          router_topk_backward(testing::exec(), scores, idx, routing, g, dlogits);
          if (norm && k_n == 1) {
            EXPECT_LE(max_abs(dlogits), 1e-14) << what;  // the single probability is the constant `scaling`
          } else {
            EXPECT_GT(max_abs(dlogits), 0) << what;
          }
          check_gradient("router_topk " + what, logits, dlogits, [&] {
            router_topk_forward(testing::exec(), logits, routing, scores, idx, prob);
            return dot(g, prob);
          });
        }
}

// ---- aux loss and z-loss -------------------------------------------------------------------------

TEST(AuxLoss, BackwardMatchesFiniteDifferences) {
  const int64_t t_n = 7, e_n = 5, k_n = 2;
  for (ScoreFunc f : {ScoreFunc::softmax, ScoreFunc::sigmoid}) {
    Pool pool;
    Tensor logits = pool.randn({t_n, e_n}), scores = pool.zeros({t_n, e_n});
    Tensor idx = pool.ints({t_n, k_n}, 0, 1), prob = pool.zeros({t_n, k_n});
    Tensor counts = pool.zeros({e_n}, DType::i64);
    router_topk_forward(testing::exec(), logits, {f, true, 1.0}, scores, idx, prob);
    topk_expert_counts(testing::exec(), idx, counts);
    int64_t total = 0;
    for (int64_t e = 0; e < e_n; ++e) total += counts.ptr<int64_t>()[e];
    EXPECT_EQ(total, t_n * k_n);
    // The counts are constants of the loss (no gradient through the selection).
    const double grad_scale = 0.7;
    Tensor dlogits = pool.zeros({t_n, e_n});
    aux_loss_backward(testing::exec(), scores, f, counts, k_n, grad_scale, dlogits);
    EXPECT_GT(max_abs(dlogits), 0);
    check_gradient(std::string("aux_loss ") + (f == ScoreFunc::softmax ? "softmax" : "sigmoid"), logits, dlogits, [&] {
      router_topk_forward(testing::exec(), logits, {f, true, 1.0}, scores, idx, prob);
      return grad_scale * aux_loss_forward(testing::exec(), scores, f, counts, k_n);
    });
  }
}

TEST(AuxLoss, ExactlyOneForUniformRouting) {
  Pool pool;
  const int64_t e_n = 4, k_n = 2;
  // Uniform scores (zero logits) with uniform counts.
  Tensor scores = pool.zeros({8, e_n}), counts = pool.zeros({e_n}, DType::i64);
  for (int64_t i = 0; i < scores.numel(); ++i) testing::set_value_at(scores, i, 1.0 / e_n);
  for (int64_t e = 0; e < e_n; ++e) counts.ptr<int64_t>()[e] = 8 * k_n / e_n;
  EXPECT_NEAR(aux_loss_forward(testing::exec(), scores, ScoreFunc::softmax, counts, k_n), 1.0, 1e-14);
  // Through the router: each token's logits are a cyclic shift of one vector, so every expert
  // gets the same count and the same total probability.
  for (ScoreFunc f : {ScoreFunc::softmax, ScoreFunc::sigmoid}) {
    const int64_t t_n = 3 * e_n;
    Tensor v = pool.randn({e_n}), logits = pool.zeros({t_n, e_n}), s = pool.zeros({t_n, e_n});
    Tensor idx = pool.ints({t_n, k_n}, 0, 1), prob = pool.zeros({t_n, k_n});
    for (int64_t t = 0; t < t_n; ++t)
      for (int64_t e = 0; e < e_n; ++e) testing::set_value_at(logits, t * e_n + e, testing::value_at(v, (e + t) % e_n));
    router_topk_forward(testing::exec(), logits, {f, true, 1.0}, s, idx, prob);
    topk_expert_counts(testing::exec(), idx, counts);
    for (int64_t e = 0; e < e_n; ++e) EXPECT_EQ(counts.ptr<int64_t>()[e], t_n * k_n / e_n);
    EXPECT_NEAR(aux_loss_forward(testing::exec(), s, f, counts, k_n), 1.0, 1e-12);
  }
  // Everything on one expert with confident scores: the loss approaches E.
  Tensor s1 = pool.zeros({4, e_n}), c1 = pool.zeros({e_n}, DType::i64);
  for (int64_t t = 0; t < 4; ++t) testing::set_value_at(s1, t * e_n, 1.0);
  c1.ptr<int64_t>()[0] = 4;
  EXPECT_NEAR(aux_loss_forward(testing::exec(), s1, ScoreFunc::softmax, c1, 1), static_cast<double>(e_n), 1e-12);
}

TEST(ZLoss, ForwardAndBackward) {
  Pool pool;
  Tensor zeros = pool.zeros({3, 4});
  EXPECT_NEAR(z_loss_forward(testing::exec(), zeros), std::log(4.0) * std::log(4.0), 1e-12);
  Tensor logits = pool.randn({6, 5}, DType::f64, 2.0), dlogits = pool.zeros({6, 5});
  z_loss_backward(testing::exec(), logits, 1.3, dlogits);
  check_gradient("z_loss", logits, dlogits, [&] { return 1.3 * z_loss_forward(testing::exec(), logits); });
}

// ---- permutation, combine, capacity ---------------------------------------------------------------

// Random distinct top-k indices for each token.
Tensor random_topk(Pool& pool, int64_t t_n, int64_t e_n, int64_t k_n) {
  Tensor r = pool.uniform({t_n, e_n}, 0.0, 1.0), idx = pool.ints({t_n, k_n}, 0, 1);
  for (int64_t t = 0; t < t_n; ++t) {
    std::vector<int> order(e_n);
    for (int e = 0; e < e_n; ++e) order[e] = e;
    std::sort(order.begin(), order.end(),
              [&](int a, int b) { return testing::value_at(r, t * e_n + a) > testing::value_at(r, t * e_n + b); });
    for (int64_t k = 0; k < k_n; ++k) testing::set_value_at(idx, t * k_n + k, order[k]);
  }
  return idx;
}

struct Plan {
  Tensor counts, offsets, row, token;
  int64_t num_rows = 0;
  Plan(Pool& pool, const Tensor& idx, const Tensor& prob, int64_t e_n, int64_t capacity, bool pad, int64_t max_rows) {
    counts = pool.zeros({e_n}, DType::i64);
    offsets = pool.zeros({e_n + 1}, DType::i64);
    row = pool.zeros(idx.shape(), DType::i64);
    token = pool.zeros({max_rows}, DType::i64);
    num_rows = moe_permute_plan(testing::exec(), idx, prob, capacity, pad, {counts, offsets, row, token});
  }
  int64_t at(const Tensor& t, int64_t i) const { return t.ptr<int64_t>()[i]; }
};

TEST(Permute, PlanIsExpertContiguousAndStable) {
  Pool pool;
  const int64_t t_n = 9, e_n = 5, k_n = 2;
  Tensor idx = random_topk(pool, t_n, e_n, k_n), prob = pool.uniform({t_n, k_n}, 0.1, 1.0);
  Plan p(pool, idx, prob, e_n, 0, false, t_n * k_n);
  ASSERT_EQ(p.num_rows, t_n * k_n);
  EXPECT_EQ(p.at(p.offsets, 0), 0);
  EXPECT_EQ(p.at(p.offsets, e_n), t_n * k_n);
  for (int64_t e = 0; e < e_n; ++e) {
    EXPECT_EQ(p.at(p.offsets, e + 1) - p.at(p.offsets, e), p.at(p.counts, e));
    for (int64_t r = p.at(p.offsets, e); r < p.at(p.offsets, e + 1); ++r) {
      const int64_t t = p.at(p.token, r);
      bool routed = false;
      for (int64_t k = 0; k < k_n; ++k)
        if (testing::value_at(idx, t * k_n + k) == e) {
          routed = true;
          EXPECT_EQ(p.at(p.row, t * k_n + k), r);
        }
      EXPECT_TRUE(routed) << "row " << r << " of expert " << e << " holds token " << t;
      if (r > p.at(p.offsets, e)) {
        EXPECT_LT(p.at(p.token, r - 1), t) << "rows of expert " << e << " not in token order";
      }
    }
  }
}

// Negative indices are empty slots: no row, row_TK -1, the other slots planned as without them.
TEST(Permute, EmptySlotsGetNoRow) {
  Pool pool;
  const int64_t t_n = 10, e_n = 5, k_n = 3;
  for (int64_t capacity : {int64_t{0}, int64_t{3}}) {
    Tensor idx = random_topk(pool, t_n, e_n, k_n), prob = pool.uniform({t_n, k_n}, 0.1, 1.0);
    int64_t empty = 0;
    for (int64_t i = 0; i < t_n * k_n; ++i)
      if (i % 4 == 1 || i / k_n == 2) {  // token 2: no expert at all
        testing::set_value_at(idx, i, -1);
        ++empty;
      }
    Plan p(pool, idx, prob, e_n, capacity, false, t_n * k_n);
    int64_t kept = 0;
    for (int64_t i = 0; i < t_n * k_n; ++i) {
      if (testing::value_at(idx, i) < 0) {
        EXPECT_EQ(p.at(p.row, i), -1) << "empty slot " << i;
      } else if (p.at(p.row, i) >= 0) {
        ++kept;
        EXPECT_EQ(p.at(p.token, p.at(p.row, i)), i / k_n);
      }
    }
    EXPECT_EQ(p.num_rows, kept);
    if (capacity == 0) {
      EXPECT_EQ(kept, t_n * k_n - empty);
    }
  }
}

// moe_node_route / moe_node_meta / moe_node_meta_backward against their definitions, walked by
// brute force: each (token, node) pair with a kept assignment is one row on its node, carrying the
// token's kept experts there in k order.
TEST(NodeRoute, MatchesBruteForce) {
  Pool pool;
  const int64_t t_n = 13, e_n = 8, k_n = 4;
  for (int64_t nodes : {int64_t{1}, int64_t{2}, int64_t{4}, int64_t{8}})
    for (int64_t capacity : {int64_t{0}, int64_t{4}}) {
      SCOPED_TRACE("nodes " + std::to_string(nodes) + " capacity " + std::to_string(capacity));
      const int64_t per = e_n / nodes, s_n = std::min(k_n, per);
      Tensor idx = random_topk(pool, t_n, e_n, k_n), prob = pool.uniform({t_n, k_n}, 0.1, 1.0);
      Tensor keep;
      if (capacity > 0) keep = Plan(pool, idx, prob, e_n, capacity, false, t_n * k_n).row;
      Tensor node = pool.zeros({t_n, k_n}, DType::i32), slot = pool.zeros({t_n, k_n}, DType::i32);
      moe_node_route(testing::exec(), idx, keep, per, node, slot);
      const Plan np(pool, node, prob, nodes, 0, false, t_n * std::min(k_n, nodes));
      Tensor meta_idx = pool.zeros({np.num_rows, s_n}, DType::i32), meta_prob = pool.zeros({np.num_rows, s_n});
      Tensor assign = pool.zeros({t_n, k_n}, DType::i64);
      moe_node_meta(testing::exec(), idx, prob, node, slot, np.row, per, meta_idx, meta_prob, assign);
      Tensor dmeta = pool.randn({np.num_rows, s_n}), dprob = pool.randn({t_n, k_n});
      moe_node_meta_backward(testing::exec(), dmeta, assign, dprob);

      auto kept = [&](int64_t a) { return !keep.defined() || keep.ptr<int64_t>()[a] >= 0; };
      int64_t rows = 0;
      for (int64_t n = 0; n < nodes; ++n)
        for (int64_t t = 0; t < t_n; ++t) {
          std::vector<int64_t> ks;  // the token's kept assignments on node n, in k order
          for (int64_t k = 0; k < k_n; ++k)
            if (kept(t * k_n + k) && static_cast<int64_t>(testing::value_at(idx, t * k_n + k)) / per == n)
              ks.push_back(k);
          if (ks.empty()) continue;
          const int64_t r = rows++;  // node-major rows, tokens in order within a node
          ASSERT_EQ(np.at(np.token, r), t);
          EXPECT_EQ(testing::value_at(node, t * k_n + ks[0]), n) << "leader of token " << t;
          for (size_t j = 0; j < ks.size(); ++j) {
            const int64_t a = t * k_n + ks[j];
            EXPECT_EQ(testing::value_at(slot, a), static_cast<double>(j));
            if (j > 0) {
              EXPECT_EQ(testing::value_at(node, a), -1);
            }
            ASSERT_EQ(assign.ptr<int64_t>()[a], r * s_n + static_cast<int64_t>(j));
            EXPECT_EQ(testing::value_at(meta_idx, r * s_n + j),
                      testing::value_at(idx, a) - static_cast<double>(n * per));
            EXPECT_EQ(testing::value_at(meta_prob, r * s_n + j), testing::value_at(prob, a));
            EXPECT_EQ(testing::value_at(dprob, a), testing::value_at(dmeta, r * s_n + j));
          }
          for (int64_t j = static_cast<int64_t>(ks.size()); j < s_n; ++j) {
            EXPECT_EQ(testing::value_at(meta_idx, r * s_n + j), -1);
            EXPECT_EQ(testing::value_at(meta_prob, r * s_n + j), 0.0);
          }
        }
      EXPECT_EQ(np.num_rows, rows);
      for (int64_t a = 0; a < t_n * k_n; ++a)
        if (!kept(a)) {
          EXPECT_EQ(testing::value_at(slot, a), -1);
          EXPECT_EQ(assign.ptr<int64_t>()[a], -1);
          EXPECT_EQ(testing::value_at(dprob, a), 0.0);
        }
    }
}

// moe_ep_send_slots / moe_ep_recv_slots: P ranks' home plans emulated in one process, the
// fixed-size all_to_all done by hand (rank s's slot m becomes rank m's slot s), against the
// definition: rank m's expert l gets, in rank order and within a rank in home-row order, every
// (rank, token) routed to global expert m L + l that fit rank s's slot; the remaining rows pad the
// last expert; the two maps are each other's inverse; the overflow counts what did not fit; the
// fill is the largest share of a bound asked for (a peer's rows over B, the rows that came over R).
TEST(EpSlots, EmulatedExchangeGivesEveryRankItsExpertsRows) {
  Pool pool;
  const int64_t e_n = 8, k_n = 2;
  const int64_t tokens[] = {7, 3, 9, 5};  // rank s's tokens
  for (int64_t p_n : {int64_t{1}, int64_t{2}, int64_t{4}})
    for (int64_t b_n : {int64_t{0}, int64_t{3}, int64_t{9}, int64_t{18}})
      for (int64_t r_n : {int64_t{5}, int64_t{40}})
        for (int64_t capacity : {int64_t{0}, int64_t{2}}) {
          SCOPED_TRACE("P " + std::to_string(p_n) + " B " + std::to_string(b_n) + " R " + std::to_string(r_n) +
                       " capacity " + std::to_string(capacity));
          const int64_t l_n = e_n / p_n, x_n = p_n * b_n;
          std::vector<Plan> plans;
          std::vector<Tensor> token_x, slot_tk, send;
          double overflow_send = 0;
          for (int64_t s = 0; s < p_n; ++s) {
            const int64_t t_n = tokens[s];
            Tensor idx = random_topk(pool, t_n, e_n, k_n), prob = pool.uniform({t_n, k_n}, 0.1, 1.0);
            plans.emplace_back(pool, idx, prob, e_n, capacity, capacity > 0, t_n * k_n + e_n * capacity);
            token_x.push_back(pool.zeros({x_n}, DType::i64));
            slot_tk.push_back(pool.zeros({t_n, k_n}, DType::i64));
            send.push_back(pool.zeros({p_n, l_n}, DType::i64));
            Tensor over = pool.zeros({1}, DType::f64), fill = pool.zeros({1}, DType::f64);
            testing::set_value_at(over, 0, 0.5);   // added to, not written
            testing::set_value_at(fill, 0, 0.25);  // max-ed with, not written
            moe_ep_send_slots(testing::exec(), plans[s].offsets, plans[s].token, plans[s].row, b_n, token_x[s],
                              slot_tk[s], send[s], over, fill);
            overflow_send += testing::value_at(over, 0) - 0.5;
            // The sender's side against its plan.
            const Plan& pl = plans[s];
            double lost = 0, most = 0.25;
            for (int64_t m = 0; m < p_n; ++m) {
              const int64_t first = pl.at(pl.offsets, m * l_n), n = pl.at(pl.offsets, (m + 1) * l_n) - first;
              lost += static_cast<double>(std::max<int64_t>(0, n - b_n));
              most = std::max(most, static_cast<double>(n) / static_cast<double>(std::max<int64_t>(b_n, 1)));
              for (int64_t i = 0; i < b_n; ++i)
                ASSERT_EQ(token_x[s].ptr<int64_t>()[m * b_n + i], i < n ? pl.at(pl.token, first + i) : -1);
              int64_t in_slot = 0;
              for (int64_t l = 0; l < l_n; ++l) in_slot += send[s].ptr<int64_t>()[m * l_n + l];
              EXPECT_EQ(in_slot, std::min(n, b_n));
            }
            EXPECT_EQ(testing::value_at(over, 0) - 0.5, lost);
            EXPECT_EQ(testing::value_at(fill, 0), most);
            for (int64_t a = 0; a < t_n * k_n; ++a) {
              const int64_t r = pl.at(pl.row, a), x = slot_tk[s].ptr<int64_t>()[a];
              if (r < 0) {
                EXPECT_EQ(x, -1) << "dropped assignment " << a;
                continue;
              }
              if (x < 0) {  // only rows past their slot's B
                const auto m = static_cast<int64_t>(testing::value_at(idx, a)) / l_n;
                EXPECT_GE(r - pl.at(pl.offsets, m * l_n), b_n) << "assignment " << a << " lost a row that fits";
                continue;
              }
              EXPECT_EQ(token_x[s].ptr<int64_t>()[x], a / k_n) << "assignment " << a;
            }
          }
          double overflow_recv = 0;
          for (int64_t m = 0; m < p_n; ++m) {
            // Rank m's receive: slot s holds what rank s sent to m.
            Tensor recv = pool.zeros({p_n, l_n}, DType::i64);
            for (int64_t s = 0; s < p_n; ++s)
              for (int64_t l = 0; l < l_n; ++l) recv.ptr<int64_t>()[s * l_n + l] = send[s].ptr<int64_t>()[m * l_n + l];
            Tensor src = pool.zeros({r_n}, DType::i64), row = pool.zeros({x_n}, DType::i64);
            Tensor counts = pool.zeros({l_n}, DType::i64), offsets = pool.zeros({l_n + 1}, DType::i64);
            Tensor over = pool.zeros({1}, DType::f64), fill = pool.zeros({1}, DType::f64);
            moe_ep_recv_slots(testing::exec(), recv, b_n, src, row, counts, offsets, over, fill);
            overflow_recv += testing::value_at(over, 0);
            // The definition: expert l's rows, rank by rank, as (sending rank, token) pairs.
            std::vector<std::pair<int64_t, int64_t>> want;
            std::vector<int64_t> starts;
            for (int64_t l = 0; l < l_n; ++l) {
              starts.push_back(static_cast<int64_t>(want.size()));
              for (int64_t s = 0; s < p_n; ++s) {
                const Plan& pl = plans[s];
                const int64_t first = pl.at(pl.offsets, m * l_n);
                for (int64_t r = pl.at(pl.offsets, m * l_n + l); r < pl.at(pl.offsets, m * l_n + l + 1); ++r)
                  if (r - first < b_n) want.emplace_back(s, pl.at(pl.token, r));
              }
            }
            const auto got_n = static_cast<int64_t>(want.size());
            EXPECT_EQ(testing::value_at(over, 0), static_cast<double>(std::max<int64_t>(0, got_n - r_n)));
            EXPECT_EQ(testing::value_at(fill, 0), static_cast<double>(got_n) / static_cast<double>(r_n));
            EXPECT_EQ(offsets.ptr<int64_t>()[l_n], r_n);
            for (int64_t l = 0; l < l_n; ++l) {
              EXPECT_EQ(offsets.ptr<int64_t>()[l], std::min(starts[l], r_n)) << "expert " << l;
              EXPECT_EQ(counts.ptr<int64_t>()[l], offsets.ptr<int64_t>()[l + 1] - offsets.ptr<int64_t>()[l]);
            }
            for (int64_t r = 0; r < r_n; ++r) {
              const int64_t x = src.ptr<int64_t>()[r];
              if (r >= got_n) {
                EXPECT_EQ(x, -1) << "padding row " << r;
                continue;
              }
              ASSERT_GE(x, 0) << "row " << r;
              ASSERT_LT(x, x_n);
              EXPECT_EQ(x / b_n, want[r].first) << "row " << r;
              EXPECT_EQ(token_x[want[r].first].ptr<int64_t>()[m * b_n + x % b_n], want[r].second) << "row " << r;
              EXPECT_EQ(row.ptr<int64_t>()[x], r) << "slot row " << x;
            }
            int64_t mapped = 0;
            for (int64_t x = 0; x < x_n; ++x) {
              const int64_t r = row.ptr<int64_t>()[x];
              if (r < 0) continue;
              ++mapped;
              EXPECT_EQ(src.ptr<int64_t>()[r], x) << "slot row " << x;
            }
            EXPECT_EQ(mapped, std::min(got_n, r_n));
          }
          if (b_n == 18 && r_n == 40) {  // room for everything
            EXPECT_EQ(overflow_send, 0);
            EXPECT_EQ(overflow_recv, 0);
          }
          if (b_n == 0) {
            EXPECT_GT(overflow_send, 0);
          }
        }
}

TEST(Permute, ThenCombineWithProbabilityOneIsIdentity) {
  Pool pool;
  const int64_t t_n = 11, e_n = 4, h_n = 7, kGuard = 2;
  for (int64_t k_n : {1, 3}) {
    Tensor x = pool.randn({t_n, h_n}), idx = random_topk(pool, t_n, e_n, k_n), prob = pool.zeros({t_n, k_n});
    for (int64_t i = 0; i < prob.numel(); ++i) testing::set_value_at(prob, i, 1.0);
    Plan p(pool, idx, prob, e_n, 0, false, t_n * k_n);
    // Guard rows after the permute output (ggml-style sentinels) catch overruns.
    Tensor buf = pool.zeros({p.num_rows + kGuard, h_n});
    for (int64_t i = 0; i < buf.numel(); ++i) testing::set_value_at(buf, i, 12345.0);
    Tensor rows = buf.slice(0, p.num_rows), y = pool.zeros({t_n, h_n});
    moe_permute(testing::exec(), x, p.token.slice(0, p.num_rows), rows);
    for (int64_t i = p.num_rows * h_n; i < buf.numel(); ++i)
      ASSERT_EQ(testing::value_at(buf, i), 12345.0) << "guard overwritten";
    moe_combine(testing::exec(), rows, p.row, prob, y);
    for (int64_t i = 0; i < x.numel(); ++i)
      EXPECT_EQ(testing::value_at(y, i), static_cast<double>(k_n) * testing::value_at(x, i));
  }
}

TEST(Permute, BackwardsMatchFiniteDifferences) {
  const int64_t t_n = 8, e_n = 3, k_n = 2, h_n = 4;
  for (int64_t capacity : {int64_t{0}, int64_t{3}, int64_t{7}})  // 3: drops; 7 padded: padding rows
    for (bool pad : {false, true}) {
      if (pad && capacity == 0) continue;
      const std::string what = "capacity " + std::to_string(capacity) + (pad ? " pad" : "");
      Pool pool;
      Tensor idx = random_topk(pool, t_n, e_n, k_n), prob = pool.uniform({t_n, k_n}, 0.1, 1.0);
      Plan p(pool, idx, prob, e_n, capacity, pad, t_n * k_n + e_n * capacity);
      const int64_t r_n = p.num_rows;
      if (pad) {
        EXPECT_EQ(r_n, e_n * capacity) << what;
      }
      if (pad && capacity == 7) {
        EXPECT_GE(r_n - t_n * k_n, 5) << "padding rows expected";
      }
      Tensor token = p.token.slice(0, r_n);
      // permute: loss = <g_R, permute(x)>.
      Tensor x = pool.randn({t_n, h_n}), rows = pool.zeros({r_n, h_n}), grows = pool.randn({r_n, h_n});
      Tensor dx = pool.zeros({t_n, h_n});
      moe_permute_backward(testing::exec(), grows, p.row, dx);
      check_gradient("permute " + what, x, dx, [&] {
        moe_permute(testing::exec(), x, token, rows);
        return dot(grows, rows);
      });
      // combine: loss = <g_T, combine(out, prob)>.
      Tensor out = pool.randn({r_n, h_n}), g = pool.randn({t_n, h_n}), y = pool.zeros({t_n, h_n});
      Tensor dout = pool.randn({r_n, h_n}), dprob = pool.randn({t_n, k_n});  // garbage: must be overwritten
      moe_combine_backward(testing::exec(), out, p.row, prob, p.token, g, dout, dprob);
      auto loss = [&] {
        moe_combine(testing::exec(), out, p.row, prob, y);
        return dot(g, y);
      };
      check_gradient("combine dout " + what, out, dout, loss);
      check_gradient("combine dprob " + what, prob, dprob, loss);
      for (int64_t r = 0; r < r_n; ++r)
        if (p.at(token, r) < 0) {
          for (int64_t h = 0; h < h_n; ++h) EXPECT_EQ(testing::value_at(dout, r * h_n + h), 0.0) << "padding row " << r;
        }
    }
}

TEST(Capacity, KeepsHighestProbabilitiesAndDropsTheRest) {
  Pool pool;
  const int64_t t_n = 24, e_n = 4, k_n = 2;
  MoeConfig cfg{.num_experts = e_n, .num_experts_per_tok = k_n, .capacity_factor = 0.5};
  const int64_t cap = cfg.capacity(t_n);
  ASSERT_EQ(cap, 6);
  Tensor idx = random_topk(pool, t_n, e_n, k_n), prob = pool.uniform({t_n, k_n}, 0.0, 1.0);
  Tensor routed = pool.zeros({e_n}, DType::i64);
  topk_expert_counts(testing::exec(), idx, routed);
  Plan p(pool, idx, prob, e_n, cap, false, cfg.max_rows(t_n));
  int64_t dropped = 0, expected_dropped = 0;
  for (int64_t e = 0; e < e_n; ++e) {
    EXPECT_LE(p.at(p.counts, e), cap);
    EXPECT_EQ(p.at(p.counts, e), std::min(cap, routed.ptr<int64_t>()[e]));
    expected_dropped += std::max<int64_t>(0, routed.ptr<int64_t>()[e] - cap);
    // Every kept probability of e is >= every dropped one of e.
    double min_kept = 2, max_dropped = -1;
    for (int64_t a = 0; a < t_n * k_n; ++a) {
      if (testing::value_at(idx, a) != e) continue;
      if (p.at(p.row, a) >= 0)
        min_kept = std::min(min_kept, testing::value_at(prob, a));
      else
        max_dropped = std::max(max_dropped, testing::value_at(prob, a));
    }
    EXPECT_GE(min_kept, max_dropped) << "expert " << e;
  }
  for (int64_t a = 0; a < t_n * k_n; ++a) dropped += p.at(p.row, a) < 0;
  EXPECT_EQ(dropped, expected_dropped);
  EXPECT_GT(dropped, 0);  // 48 assignments into 4 x 6 slots
  EXPECT_EQ(p.num_rows, t_n * k_n - dropped);
}

// Without waiting (the host does not read R), a capacity without padding pads the last expert up
// to the bound min(T*K, E*capacity): the same rows for every assignment, the tail empty.
TEST(Capacity, WithoutWaitingTheLastExpertIsPaddedToTheBound) {
  Pool pool;
  const int64_t t_n = 24, e_n = 4, k_n = 2, capacity = 10;  // bound min(48, 40) = 40
  // Experts 0 and 1 get 16 assignments each (6 dropped each), 2 and 3 get 8: 36 rows kept.
  Tensor idx = pool.zeros({t_n, k_n}, DType::i32), prob = pool.uniform({t_n, k_n}, 0.1, 1.0);
  for (int64_t t = 0; t < t_n; ++t) {
    idx.ptr<int32_t>()[t * k_n] = t < 16 ? 0 : 2;
    idx.ptr<int32_t>()[t * k_n + 1] = t < 16 ? 1 : 3;
  }
  Plan waited(pool, idx, prob, e_n, capacity, false, e_n * capacity);
  Tensor counts = pool.zeros({e_n}, DType::i64), offsets = pool.zeros({e_n + 1}, DType::i64);
  Tensor row = pool.zeros(idx.shape(), DType::i64), token = pool.zeros({e_n * capacity}, DType::i64);
  const int64_t r = moe_permute_plan(testing::exec(), idx, prob, capacity, false, {counts, offsets, row, token}, false);
  ASSERT_EQ(r, 40);
  ASSERT_EQ(waited.num_rows, 36);
  EXPECT_EQ(offsets.ptr<int64_t>()[e_n], 40);
  for (int64_t e = 0; e < e_n; ++e) {
    EXPECT_EQ(offsets.ptr<int64_t>()[e], waited.at(waited.offsets, e)) << "expert " << e;
    EXPECT_EQ(counts.ptr<int64_t>()[e], waited.at(waited.counts, e) + (e + 1 == e_n ? 40 - waited.num_rows : 0));
  }
  for (int64_t a = 0; a < t_n * k_n; ++a) EXPECT_EQ(row.ptr<int64_t>()[a], waited.at(waited.row, a)) << a;
  for (int64_t i = 0; i < 40; ++i)
    EXPECT_EQ(token.ptr<int64_t>()[i], i < waited.num_rows ? waited.at(waited.token, i) : -1) << "row " << i;
}

TEST(Capacity, TiesDropTheHigherToken) {
  Pool pool;
  // Five tokens all on expert 1 with equal probabilities except token 3 (highest): capacity 2
  // keeps token 3 and then token 0 (lower index wins the tie); rows stay in token order.
  const int64_t t_n = 5;
  Tensor idx = pool.ints({t_n, 1}, 1, 2), prob = pool.zeros({t_n, 1});
  for (int64_t t = 0; t < t_n; ++t) testing::set_value_at(prob, t, t == 3 ? 0.9 : 0.5);
  Plan p(pool, idx, prob, 2, 2, false, 4);
  ASSERT_EQ(p.num_rows, 2);
  EXPECT_EQ(p.at(p.counts, 0), 0);
  EXPECT_EQ(p.at(p.counts, 1), 2);
  EXPECT_EQ(p.at(p.token, 0), 0);
  EXPECT_EQ(p.at(p.token, 1), 3);
  const int64_t want_row[] = {0, -1, -1, 1, -1};
  for (int64_t t = 0; t < t_n; ++t) EXPECT_EQ(p.at(p.row, t), want_row[t]) << "token " << t;
}

TEST(Capacity, PadGivesExactlyCapacityRowsPerExpert) {
  Pool pool;
  const int64_t t_n = 10, e_n = 4, k_n = 2, h_n = 3;
  MoeConfig cfg{.num_experts = e_n, .num_experts_per_tok = k_n, .capacity_factor = 0.75, .pad_to_capacity = true};
  const int64_t cap = cfg.capacity(t_n);  // ceil(3.75) = 4
  // Skewed routing: half the experts get almost nothing, so both padding and dropping happen.
  Tensor idx = pool.ints({t_n, k_n}, 0, 1), prob = pool.uniform({t_n, k_n}, 0.0, 1.0);
  for (int64_t t = 0; t < t_n; ++t) {
    testing::set_value_at(idx, t * k_n, t < 8 ? 0 : 2);
    testing::set_value_at(idx, t * k_n + 1, t < 8 ? 1 : 3);
  }
  Plan p(pool, idx, prob, e_n, cap, true, cfg.max_rows(t_n));
  ASSERT_EQ(p.num_rows, e_n * cap);
  ASSERT_EQ(p.num_rows, cfg.max_rows(t_n));
  for (int64_t e = 0; e < e_n; ++e) {
    EXPECT_EQ(p.at(p.counts, e), cap);
    EXPECT_EQ(p.at(p.offsets, e), e * cap);
  }
  int64_t padding = 0;
  for (int64_t r = 0; r < p.num_rows; ++r) padding += p.at(p.token, r) < 0;
  EXPECT_EQ(padding, 2 * (cap - 2));  // experts 2 and 3 hold 2 tokens each
  Tensor x = pool.randn({t_n, h_n}), rows = pool.randn({p.num_rows, h_n});
  moe_permute(testing::exec(), x, p.token.slice(0, p.num_rows), rows);
  for (int64_t r = 0; r < p.num_rows; ++r)
    for (int64_t h = 0; h < h_n; ++h)
      if (p.at(p.token, r) < 0) {
        EXPECT_EQ(testing::value_at(rows, r * h_n + h), 0.0) << "padding row " << r;
      }
}

TEST(GroupedLinear, BackwardMatchesFiniteDifferences) {
  Pool pool;
  const int64_t e_n = 3, o_n = 4, i_n = 5, r_n = 6;
  Tensor offsets = pool.zeros({e_n + 1}, DType::i64);
  const int64_t off[] = {0, 4, 4, 6};  // expert 1 gets no rows
  for (int i = 0; i <= e_n; ++i) offsets.ptr<int64_t>()[i] = off[i];
  Tensor x = pool.randn({r_n, i_n}), w = pool.randn({e_n, o_n, i_n}), y = pool.zeros({r_n, o_n});
  Tensor g = pool.randn({r_n, o_n}), dx = pool.zeros({r_n, i_n}), dw = pool.zeros({e_n, o_n, i_n});
  grouped_linear_backward(testing::exec(), x, w, offsets, g, dx, dw);
  Tensor dw_once = pool.clone(dw);
  auto loss = [&] {
    grouped_linear_forward(testing::exec(), x, w, offsets, y);
    return dot(g, y);
  };
  check_gradient("grouped_linear dx", x, dx, loss);
  check_gradient("grouped_linear dw", w, dw_once, loss);
  for (int64_t i = 0; i < o_n * i_n; ++i) EXPECT_EQ(testing::value_at(dw, o_n * i_n + i), 0.0) << "idle expert";
  grouped_linear_backward(testing::exec(), x, w, offsets, g, Tensor{}, dw);  // accumulates
  for (int64_t i = 0; i < dw.numel(); ++i)
    EXPECT_NEAR(testing::value_at(dw, i), 2 * testing::value_at(dw_once, i), 1e-12);
  // Written (accumulate = false): whatever dw held is gone, the idle expert's included.
  fill_constant(dw, 7.0);
  grouped_linear_backward(testing::exec(), x, w, offsets, g, Tensor{}, dw, /*accumulate=*/false);
  for (int64_t i = 0; i < dw.numel(); ++i) EXPECT_EQ(testing::value_at(dw, i), testing::value_at(dw_once, i)) << i;
}

// The expert weights' gradients are written by the first backward after zero_grads (which skips
// them) and accumulated by the next: two micro-batches of one step give the sum, and a new step
// starts afresh although zero_grads left the old values in place.
TEST(Experts, FirstBackwardOfAStepWritesTheWeightGradients) {
  Pool pool;
  const int64_t e_n = 3, h_n = 8, f_n = 4, r_n = 7;
  Experts experts({.num_experts = e_n, .hidden = h_n, .ffn = f_n, .max_rows = r_n}, "t", 0.5);
  Memory mem(DType::f64);
  mem.bind_twice([&] { experts.bind(mem); });
  for (const Param& p : mem.params()) {
    fill_normal(p.value, 1, p.id, 0.0, 0.5);
    EXPECT_TRUE(p.grad_written_by_backward) << p.name;
  }
  Tensor offsets = pool.zeros({e_n + 1}, DType::i64);
  const int64_t off[] = {0, 3, 3, 7};
  for (int i = 0; i <= e_n; ++i) offsets.ptr<int64_t>()[i] = off[i];
  Tensor x = pool.randn({r_n, h_n}), out = pool.zeros({r_n, h_n}), dout = pool.randn({r_n, h_n});
  Tensor dx = pool.zeros({r_n, h_n});
  std::vector<std::vector<double>> once;
  auto grads = [&] {
    std::vector<std::vector<double>> g;
    for (const Param& p : mem.params()) {
      g.emplace_back();
      for (int64_t i = 0; i < p.grad.numel(); ++i) g.back().push_back(testing::value_at(p.grad, i));
    }
    return g;
  };
  for (const Param& p : mem.params()) fill_constant(p.grad, 3.0);  // a previous step's values
  mem.zero_grads();
  for (const Param& p : mem.params()) EXPECT_EQ(testing::value_at(p.grad, 0), 3.0) << p.name << ": zero_grads skips it";
  experts.forward(x, offsets, out);
  experts.backward(x, offsets, dout, dx);
  once = grads();
  for (double v : once[0]) EXPECT_NE(v, 3.0);
  experts.forward(x, offsets, out);
  experts.backward(x, offsets, dout, dx);  // the step's second micro-batch: accumulates
  const std::vector<std::vector<double>> twice = grads();
  for (size_t p = 0; p < once.size(); ++p)
    for (size_t i = 0; i < once[p].size(); ++i) EXPECT_NEAR(twice[p][i], 2 * once[p][i], 1e-12);
  mem.zero_grads();  // a new step: written again
  experts.forward(x, offsets, out);
  experts.backward(x, offsets, dout, dx);
  EXPECT_EQ(grads(), once);
}

// ---- the whole layer ---------------------------------------------------------------------------

// A MoeLayer bound to its own Memory (both passes), with every parameter filled randn * std.
struct Rig {
  Memory mem;
  MoeLayer layer;
  Rig(const MoeConfig& cfg, int64_t h_n, int64_t max_t, DType dtype) : mem(dtype), layer(cfg, h_n, max_t, kPrefix) {
    mem.bind_twice([&] { layer.bind(mem); });
  }
  const Param& param(const std::string& suffix) const { return *mem.find(kPrefix + suffix); }
  void fill(Pool& pool, double std) {
    for (Param& p : mem.params()) p.value.copy_from(pool.randn(p.value.shape(), p.value.dtype(), std));
  }
  void zero_grads() { mem.zero_grads(); }
};

const char* const kParams[] = {".gate.weight", ".experts.gate_up_proj", ".experts.down_proj"};

// Redraws x until the top-k selection (and the capacity ordering) is far from a tie.
Tensor stable_input(Pool& pool, Rig& rig, int64_t t_n, int64_t h_n, DType dtype = DType::f64) {
  Tensor y = pool.zeros({t_n, h_n}, dtype);
  const MoeConfig& cfg = rig.layer.config();
  for (int tries = 0; tries < 100; ++tries) {
    Tensor x = pool.randn({t_n, h_n}, dtype);
    rig.layer.forward(x, y);
    const Router& r = rig.layer.router();
    bool ok = topk_gap(r.scores(), cfg.num_experts_per_tok) > 1e-3;
    if (cfg.capacity_factor > 0) ok = ok && capacity_gap(r.topk_idx(), r.topk_prob()) > 1e-3;
    if (ok) return x;
  }
  ADD_FAILURE() << "no input with a stable top-k selection";
  return pool.randn({t_n, h_n}, dtype);
}

struct LayerCase {
  std::string name;
  MoeConfig cfg;
};

TEST(MoeLayer, BackwardMatchesFiniteDifferences) {
  const int64_t h_n = 6, t_n = 7;  // T*K never divisible by E: unbalanced counts, so the aux gradient is non-zero
  const MoeConfig base{.num_experts = 4,
                       .num_experts_per_tok = 2,
                       .moe_intermediate_size = 5,
                       .aux_loss_coeff = 0.3,
                       .z_loss_coeff = 0.05};
  std::vector<LayerCase> cases = {{"softmax norm", base}};
  cases.push_back({"softmax no-norm", base});
  cases.back().cfg.norm_topk_prob = false;
  cases.push_back({"sigmoid norm scaled", base});
  cases.back().cfg.scoring_func = ScoreFunc::sigmoid;
  cases.back().cfg.routed_scaling_factor = 2.5;
  cases.push_back({"sigmoid no-norm k3", base});
  cases.back().cfg.scoring_func = ScoreFunc::sigmoid;
  cases.back().cfg.norm_topk_prob = false;
  cases.back().cfg.num_experts_per_tok = 3;
  cases.push_back({"capacity 0.5", base});
  cases.back().cfg.capacity_factor = 0.5;
  cases.push_back({"capacity 0.75 padded", base});
  cases.back().cfg.capacity_factor = 0.75;
  cases.back().cfg.pad_to_capacity = true;
  for (const LayerCase& c : cases) {
    SCOPED_TRACE(c.name);
    Pool pool;
    Rig rig(c.cfg, h_n, t_n + 2, DType::f64);  // max_tokens > T: views of the first T rows
    rig.fill(pool, 0.5);
    Tensor x = stable_input(pool, rig, t_n, h_n);
    Tensor g = pool.randn({t_n, h_n}), y = pool.zeros({t_n, h_n}), dx = pool.randn({t_n, h_n});
    const double loss_scale = 1.7;
    rig.zero_grads();
    rig.layer.forward(x, y);
    EXPECT_GT(rig.layer.aux_loss(), 0);
    EXPECT_GT(rig.layer.z_loss(), 0);
    rig.layer.backward(g, dx, loss_scale);
    auto loss = [&] {
      rig.layer.forward(x, y);
      return dot(g, y) + loss_scale * (rig.layer.aux_loss() + rig.layer.z_loss());
    };
    std::vector<Tensor> analytic;
    for (const char* name : kParams) analytic.push_back(pool.clone(rig.param(name).grad));
    Tensor dx_saved = pool.clone(dx);
    check_gradient(c.name + " dx", x, dx_saved, loss);
    for (int i = 0; i < 3; ++i) {
      EXPECT_GT(max_abs(analytic[i]), 0) << kParams[i];
      check_gradient(c.name + " " + kParams[i], rig.param(kParams[i]).value, analytic[i], loss);
    }
  }
}

TEST(MoeLayer, SingleExpertEqualsDenseSwiGLU) {
  const int64_t h_n = 5, f_n = 7, t_n = 6;
  MoeConfig cfg{.num_experts = 1, .num_experts_per_tok = 1, .moe_intermediate_size = f_n};
  Pool pool;
  Rig rig(cfg, h_n, t_n, DType::f64);
  rig.fill(pool, 0.5);
  Tensor x = pool.randn({t_n, h_n}), y = pool.zeros({t_n, h_n});
  rig.layer.forward(x, y);
  const double* w1 = rig.param(".experts.gate_up_proj").value.ptr<double>();  // [2F, H]: gate j at 2j, up at 2j + 1
  const double* w2 = rig.param(".experts.down_proj").value.ptr<double>();     // [H, F]
  for (int64_t t = 0; t < t_n; ++t) {
    std::vector<double> h(f_n);
    for (int64_t j = 0; j < f_n; ++j) {
      double g = 0, u = 0;
      for (int64_t i = 0; i < h_n; ++i) {
        g += w1[2 * j * h_n + i] * testing::value_at(x, t * h_n + i);
        u += w1[(2 * j + 1) * h_n + i] * testing::value_at(x, t * h_n + i);
      }
      h[j] = g / (1 + std::exp(-g)) * u;
    }
    for (int64_t o = 0; o < h_n; ++o) {
      double want = 0;
      for (int64_t j = 0; j < f_n; ++j) want += w2[o * f_n + j] * h[j];
      EXPECT_NEAR(testing::value_at(y, t * h_n + o), want, 1e-12) << "token " << t << " channel " << o;
    }
  }
  EXPECT_NEAR(rig.layer.aux_loss(), cfg.aux_loss_coeff * 1.0, 1e-15);  // one expert: perfectly balanced
  EXPECT_EQ(rig.layer.expert_counts()[0], t_n);
}

TEST(MoeLayer, AuxLossIsOneForUniformRouting) {
  // gate = identity (H = E), token t's input is a cyclic shift of one vector: every expert gets
  // the same count and the same total score.
  const int64_t e_n = 4, t_n = 8;
  MoeConfig cfg{.num_experts = e_n, .num_experts_per_tok = 2, .moe_intermediate_size = 3, .aux_loss_coeff = 0.25};
  Pool pool;
  Rig rig(cfg, e_n, t_n, DType::f64);
  rig.fill(pool, 0.5);
  const Tensor& gate = rig.param(".gate.weight").value;
  for (int64_t i = 0; i < e_n * e_n; ++i) testing::set_value_at(gate, i, i / e_n == i % e_n ? 1.0 : 0.0);
  Tensor v = pool.randn({e_n}), x = pool.zeros({t_n, e_n}), y = pool.zeros({t_n, e_n});
  for (int64_t t = 0; t < t_n; ++t)
    for (int64_t e = 0; e < e_n; ++e) testing::set_value_at(x, t * e_n + e, testing::value_at(v, (e + t) % e_n));
  rig.layer.forward(x, y);
  EXPECT_NEAR(rig.layer.aux_loss() / cfg.aux_loss_coeff, 1.0, 1e-12);
  for (int64_t e = 0; e < e_n; ++e) EXPECT_EQ(rig.layer.expert_counts()[e], t_n * 2 / e_n);
}

TEST(MoeLayer, AuxLossAloneGivesRouterGradient) {
  // T*K = 14 assignments over 4 experts can never be balanced; with balanced counts the softmax
  // form's gradient is exactly zero (c_e constant), so an unbalanced T keeps this test meaningful.
  const int64_t h_n = 6, t_n = 7;
  MoeConfig cfg{.num_experts = 4, .num_experts_per_tok = 2, .moe_intermediate_size = 5, .aux_loss_coeff = 0.1};
  Pool pool;
  Rig rig(cfg, h_n, t_n, DType::f64);
  rig.fill(pool, 0.5);
  Tensor x = pool.randn({t_n, h_n}), y = pool.zeros({t_n, h_n}), dy = pool.zeros({t_n, h_n});
  Tensor dx = pool.randn({t_n, h_n});
  rig.layer.forward(x, y);
  rig.zero_grads();
  rig.layer.backward(dy, dx, 1.0);
  EXPECT_GT(max_abs(rig.param(".gate.weight").grad), 1e-6);
  EXPECT_GT(max_abs(dx), 1e-6);  // through the router branch
  EXPECT_EQ(max_abs(rig.param(".experts.gate_up_proj").grad), 0.0);
  EXPECT_EQ(max_abs(rig.param(".experts.down_proj").grad), 0.0);
  // And with the coefficient at zero, nothing at all.
  MoeConfig off = cfg;
  off.aux_loss_coeff = 0;
  Rig rig0(off, h_n, t_n, DType::f64);
  rig0.fill(pool, 0.5);
  rig0.layer.forward(x, y);
  rig0.layer.backward(dy, dx, 1.0);
  EXPECT_EQ(max_abs(rig0.param(".gate.weight").grad), 0.0);
  EXPECT_EQ(max_abs(dx), 0.0);
}

TEST(MoeLayer, ZeroTokenExperts) {
  // Every token goes to expert 0 (K = 1) or experts {0, 1} (K = 2); the others get no rows.
  const int64_t h_n = 4, f_n = 3, t_n = 5, e_n = 4;
  for (int64_t k_n : {1, 2}) {
    SCOPED_TRACE("k " + std::to_string(k_n));
    MoeConfig cfg{.num_experts = e_n, .num_experts_per_tok = k_n, .moe_intermediate_size = f_n, .aux_loss_coeff = 0.2};
    Pool pool;
    Rig rig(cfg, h_n, t_n, DType::f64);
    rig.fill(pool, 0.5);
    const Tensor& gate = rig.param(".gate.weight").value;
    for (int64_t e = 0; e < e_n; ++e)
      for (int64_t i = 0; i < h_n; ++i) testing::set_value_at(gate, e * h_n + i, e == 0 ? 1.0 : e == 1 ? 0.5 : -1.0);
    Tensor x = pool.uniform({t_n, h_n}, 0.5, 1.5), y = pool.zeros({t_n, h_n}), g = pool.randn({t_n, h_n});
    Tensor dx = pool.zeros({t_n, h_n});
    rig.layer.forward(x, y);
    for (int64_t e = 0; e < e_n; ++e) EXPECT_EQ(rig.layer.expert_counts()[e], e < k_n ? t_n : 0);
    const DispatchPlan& plan = rig.layer.plan();
    EXPECT_EQ(plan.num_rows, t_n * k_n);
    // y_t = sum_k prob_tk * expert_k(x_t), each expert written out with loops.
    const double* w1 = rig.param(".experts.gate_up_proj").value.ptr<double>();  // gate j at row 2j, up at 2j + 1
    const double* w2 = rig.param(".experts.down_proj").value.ptr<double>();
    const Tensor& prob = rig.layer.router().topk_prob();
    for (int64_t t = 0; t < t_n; ++t)
      for (int64_t o = 0; o < h_n; ++o) {
        double want = 0;
        for (int64_t k = 0; k < k_n; ++k) {
          const double* a = w1 + k * 2 * f_n * h_n;
          const double* b = w2 + k * h_n * f_n;
          double acc = 0;
          for (int64_t j = 0; j < f_n; ++j) {
            double gg = 0, uu = 0;
            for (int64_t i = 0; i < h_n; ++i) {
              gg += a[2 * j * h_n + i] * testing::value_at(x, t * h_n + i);
              uu += a[(2 * j + 1) * h_n + i] * testing::value_at(x, t * h_n + i);
            }
            acc += b[o * f_n + j] * gg / (1 + std::exp(-gg)) * uu;
          }
          want += testing::value_at(prob, t * k_n + k) * acc;
        }
        EXPECT_NEAR(testing::value_at(y, t * h_n + o), want, 1e-12);
      }
    rig.zero_grads();
    rig.layer.backward(g, dx, 1.0);
    const Tensor& dgu = rig.param(".experts.gate_up_proj").grad;
    const Tensor& ddown = rig.param(".experts.down_proj").grad;
    for (int64_t e = 0; e < e_n; ++e) {
      double m1 = max_abs(dgu.view({e_n, 2 * f_n * h_n}).slice(e, e + 1));
      double m2 = max_abs(ddown.view({e_n, h_n * f_n}).slice(e, e + 1));
      if (e < k_n) {
        EXPECT_GT(m1, 0) << "expert " << e;
        EXPECT_GT(m2, 0) << "expert " << e;
      } else {
        EXPECT_EQ(m1, 0.0) << "idle expert " << e;
        EXPECT_EQ(m2, 0.0) << "idle expert " << e;
      }
    }
    Tensor dx_saved = pool.clone(dx), dgu_saved = pool.clone(dgu);
    auto loss = [&] {
      rig.layer.forward(x, y);
      return dot(g, y) + rig.layer.aux_loss() + rig.layer.z_loss();
    };
    check_gradient("zero-token dx", x, dx_saved, loss);
    check_gradient("zero-token gate_up_proj", rig.param(".experts.gate_up_proj").value, dgu_saved, loss);
  }
}

TEST(MoeLayer, PaddingDoesNotChangeTheResult) {
  const int64_t h_n = 5, t_n = 9;
  MoeConfig cfg{.num_experts = 3, .num_experts_per_tok = 2, .moe_intermediate_size = 4, .capacity_factor = 0.8};
  MoeConfig padded = cfg;
  padded.pad_to_capacity = true;
  Pool pool;
  Rig a(cfg, h_n, t_n, DType::f64), b(padded, h_n, t_n, DType::f64);
  a.fill(pool, 0.5);
  for (const char* name : kParams) b.param(name).value.copy_from(a.param(name).value);
  Tensor x = pool.randn({t_n, h_n}), ya = pool.zeros({t_n, h_n}), yb = pool.zeros({t_n, h_n});
  Tensor g = pool.randn({t_n, h_n}), dxa = pool.zeros({t_n, h_n}), dxb = pool.zeros({t_n, h_n});
  a.layer.forward(x, ya);
  b.layer.forward(x, yb);
  EXPECT_EQ(b.layer.plan().num_rows, 3 * cfg.capacity(t_n));
  EXPECT_LE(a.layer.plan().num_rows, b.layer.plan().num_rows);
  EXPECT_LE(max_abs_diff(ya, yb), 1e-13);
  a.layer.backward(g, dxa, 1.0);
  b.layer.backward(g, dxb, 1.0);
  EXPECT_LE(max_abs_diff(dxa, dxb), 1e-13);
  for (const char* name : kParams) EXPECT_LE(max_abs_diff(a.param(name).grad, b.param(name).grad), 1e-13) << name;
}

TEST(MoeLayer, Float32MatchesFloat64) {
  const int64_t h_n = 16, t_n = 12;
  MoeConfig cfg{.num_experts = 6,
                .num_experts_per_tok = 2,
                .moe_intermediate_size = 8,
                .aux_loss_coeff = 0.1,
                .z_loss_coeff = 0.01,
                .capacity_factor = 1.0};
  Pool pool;
  Rig r64(cfg, h_n, t_n, DType::f64), r32(cfg, h_n, t_n, DType::f32);
  r64.fill(pool, 0.3);
  Tensor x64 = stable_input(pool, r64, t_n, h_n);
  for (const char* name : kParams) convert(r32.param(name).value, r64.param(name).value);
  Tensor x32 = pool.zeros({t_n, h_n}, DType::f32), g64 = pool.randn({t_n, h_n});
  Tensor g32 = pool.zeros({t_n, h_n}, DType::f32);
  convert(x32, x64);
  convert(g32, g64);
  Tensor y64 = pool.zeros({t_n, h_n}), y32 = pool.zeros({t_n, h_n}, DType::f32);
  Tensor dx64 = pool.zeros({t_n, h_n}), dx32 = pool.zeros({t_n, h_n}, DType::f32);
  r64.layer.forward(x64, y64);
  r32.layer.forward(x32, y32);
  for (int64_t i = 0; i < t_n * 2; ++i)
    ASSERT_EQ(testing::value_at(r64.layer.router().topk_idx(), i), testing::value_at(r32.layer.router().topk_idx(), i))
        << "selection differs";
  r64.layer.backward(g64, dx64, 1.0);
  r32.layer.backward(g32, dx32, 1.0);
  // fp32 rounding (~6e-8) accumulated over sums of <= 16 terms: 1e-5 relative to the largest.
  const double rtol = 1e-5;
  EXPECT_LE(max_abs_diff(y32, y64), rtol * max_abs(y64));
  EXPECT_LE(max_abs_diff(dx32, dx64), rtol * max_abs(dx64));
  EXPECT_NEAR(r32.layer.aux_loss(), r64.layer.aux_loss(), rtol * r64.layer.aux_loss());
  EXPECT_NEAR(r32.layer.z_loss(), r64.layer.z_loss(), rtol * r64.layer.z_loss());
  for (const char* name : kParams)
    EXPECT_LE(max_abs_diff(r32.param(name).grad, r64.param(name).grad), rtol * max_abs(r64.param(name).grad)) << name;
}

}  // namespace
}  // namespace moefold

// Expert tensor parallelism, layout parity (run with 1, 2 and 4 ranks): a MoeLayer over an
// AllGatherDispatcher (ETP x EP: world = etp, world = ep with etp 1, and on 4 ranks ep 2 x etp 2)
// against one-process LocalDispatcher references that every rank computes itself from the shared
// seed. Every rank routes its own tokens (capacity from its own T), so the exact reference is the
// LocalDispatcher layer run block by block over the ranks' token blocks, gradients accumulated:
// this rank's y and dx must equal its block's, its expert shard's gradients the matching slice
// (experts [ep_rank*L, +L), F columns [etp_rank*F/G, +F/G)) of the accumulated ones, and the
// router gradient summed over the world the accumulated one. Also checks that fill_normal_shard
// gives every shard the values of the whole tensor.
// Shape letters: T tokens, H hidden, E experts, L local experts, F expert FFN, K top-k, G ETP.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "moe_cases.h"
#include "moe_rig.h"
#include "moefold/comm/communicator.h"
#include "moefold/core/memory.h"
#include "moefold/core/rng.h"
#include "moefold/moe/all_gather_dispatcher.h"
#include "moefold/moe/moe_layer.h"
#include "mpi_testing.h"
#include "testing.h"

namespace moefold {
namespace {

using testing::max_abs;
using testing::max_abs_diff;
using testing::Pool;
using testing::shared_seed;
using testing::test_world;

using testing::Rig;
constexpr int64_t kE = testing::kCaseExperts, kH = testing::kRigHidden, kF = 8;  // F splits over 1, 2, 4, 8 ETP ranks
// f64 throughout; the ETP layer and the references add the same terms in different orders only.
constexpr double kTol = 1e-10;

// This rank's shard of the expert weights: experts [e0, e0 + l_n), F columns [f0, f0 + fl). Gate
// and up rows interleave (gate j at 2j, up j at 2j + 1), so the shard of gate_up is each expert's
// contiguous rows [2 f0, 2 (f0 + fl)).
Tensor cut_gate_up(Pool& pool, const Tensor& full_E2FH, int64_t e0, int64_t l_n, int64_t f0, int64_t fl) {
  Tensor out = pool.zeros({l_n, 2 * fl, kH});
  const double* src = full_E2FH.ptr<double>();
  double* dst = out.ptr<double>();
  for (int64_t l = 0; l < l_n; ++l)
    for (int64_t r = 0; r < 2 * fl; ++r)
      for (int64_t h = 0; h < kH; ++h) dst[(l * 2 * fl + r) * kH + h] = src[((e0 + l) * 2 * kF + 2 * f0 + r) * kH + h];
  return out;
}
Tensor cut_down(Pool& pool, const Tensor& full_EHF, int64_t e0, int64_t l_n, int64_t f0, int64_t fl) {
  Tensor out = pool.zeros({l_n, kH, fl});
  const double* src = full_EHF.ptr<double>();
  double* dst = out.ptr<double>();
  for (int64_t l = 0; l < l_n; ++l)
    for (int64_t h = 0; h < kH; ++h)
      for (int64_t f = 0; f < fl; ++f) dst[(l * kH + h) * fl + f] = src[((e0 + l) * kH + h) * kF + f0 + f];
  return out;
}

using testing::Case;

Case make(std::string name, testing::Knobs o, std::vector<double> bias_E = {}) {
  o.ffn = kF;
  return testing::make(std::move(name), o, std::move(bias_E));
}

std::vector<Case> all_cases() {
  const std::vector<double> rank0 = {1.5, 1.5, 0, 0, 0, 0, 0, 0};
  const std::vector<double> idle = {0, -5, 0, 0, -5, -5, -5, -5};  // zero-token experts 1, 4-7
  const std::vector<double> one = {0, 0, 0, 0, 0, 0, 0, 5};        // every token to expert 7
  return {
      make("balanced_softmax_k2", {}),
      make("balanced_softmax_k1", {.k = 1, .norm = false}),
      make("balanced_sigmoid_k2_aux", {.sigmoid = true, .aux = true}),
      make("imbalanced_softmax_k2", {}, rank0),
      make("imbalanced_sigmoid_k1_aux", {.k = 1, .sigmoid = true, .aux = true}, rank0),
      make("zero_token_experts_softmax_k2", {}, idle),
      make("zero_token_experts_sigmoid_k1_aux", {.k = 1, .sigmoid = true, .aux = true}, idle),
      make("one_expert_softmax_k1", {.k = 1, .norm = false}, one),
      make("capacity_softmax_k2_aux", {.aux = true, .capacity = 0.6}),
      // Experts 0 and 1 take (nearly) every token, one row each: drops whatever the draw.
      make("capacity_imbalanced_softmax_k1", {.k = 1, .norm = false, .capacity = 0.8}, rank0),
      make("capacity_imbalanced_sigmoid_k1_aux", {.k = 1, .sigmoid = true, .aux = true, .capacity = 1.0}, rank0),
      make("capacity_padded_softmax_k2", {.capacity = 0.75, .pad = true}),
      make("capacity_padded_idle_sigmoid_k1_aux", {.k = 1, .sigmoid = true, .aux = true, .capacity = 1.5, .pad = true},
           idle),
  };
}

using testing::Block;
using testing::block_tokens;
using testing::draw_block;
using testing::rel_err;
using testing::sum_all;

// The MoE layouts of `world` ranks tried here: (etp, ep) with etp * ep = world.
std::vector<std::pair<int, int>> layouts(int world) {
  std::vector<std::pair<int, int>> out = {{world, 1}};
  if (world > 1) out.push_back({1, world});
  if (world == 4) out.push_back({2, 2});
  return out;
}

void run_case(const Case& c, int etp_n, int ep_n) {
  Communicator& world = test_world();
  const int rank = world.rank(), w_n = world.size();
  ASSERT_EQ(etp_n * ep_n, w_n);
  // MoE rank order: r = etp_rank + etp * ep_rank (mesh.h).
  const int g = rank % etp_n, q = rank / etp_n;
  auto etp = world.split(rank / etp_n, rank, "etp");
  auto ep = world.split(rank % etp_n, rank, "ep");
  ASSERT_EQ(etp->rank(), g);
  ASSERT_EQ(ep->rank(), q);
  const uint64_t seed = shared_seed(world);
  SCOPED_TRACE("MOEFOLD_TEST_SEED=" + std::to_string(seed) + " rank " + std::to_string(rank) + " of " +
               std::to_string(w_n) + ", etp " + std::to_string(etp_n) + " x ep " + std::to_string(ep_n));
  const MoeConfig& cfg = c.cfg;
  const int64_t l_n = kE / ep_n, fl = kF / etp_n, e0 = q * l_n, f0 = g * fl, k_n = cfg.num_experts_per_tok;
  const int64_t max_t = block_tokens(w_n - 1);
  const double loss_scale = 1.3;
  const bool biased = !c.bias_E.empty();
  Pool pool;

  Rig ref(cfg, max_t, nullptr);
  int64_t stream = 1;
  for (Param& p : ref.mem.params()) fill_normal(p.value, seed, stream++, 0.0, 0.5);
  if (biased) {
    double* gw = ref.param(".gate.weight").value.ptr<double>();
    for (int64_t e = 0; e < kE; ++e)
      for (int64_t i = 0; i < kH; ++i) gw[e * kH + i] += c.bias_E[e];
  }

  auto disp_owned = std::make_unique<AllGatherDispatcher>(cfg, kH, max_t, *etp, ep.get());
  const AllGatherDispatcher& disp = *disp_owned;
  Rig mine(cfg, max_t, std::move(disp_owned));
  ASSERT_EQ(disp.num_local_experts(), l_n);
  ASSERT_EQ(disp.first_local_expert(), e0);
  ASSERT_EQ(disp.ffn_first(), f0);
  ASSERT_EQ(mine.layer.experts().ffn(), fl);
  const Param& gu = mine.param(".experts.gate_up_proj");
  const Param& dn = mine.param(".experts.down_proj");
  check_shape(gu.value, {l_n, 2 * fl, kH}, "gate_up shard");
  check_shape(dn.value, {l_n, kH, fl}, "down shard");
  const Param& ref_gu = ref.param(".experts.gate_up_proj");
  const Param& ref_dn = ref.param(".experts.down_proj");

  // Initialisation: every shard draws the whole tensor's values.
  fill_normal_shard(gu, seed, 77, 0.0, 0.02);
  fill_normal_shard(dn, seed, 78, 0.0, 0.02);
  {
    Tensor full_gu = pool.zeros(ref_gu.value.shape()), full_dn = pool.zeros(ref_dn.value.shape());
    fill_normal(full_gu, seed, 77, 0.0, 0.02);
    fill_normal(full_dn, seed, 78, 0.0, 0.02);
    EXPECT_EQ(max_abs_diff(gu.value, cut_gate_up(pool, full_gu, e0, l_n, f0, fl)), 0.0) << "gate_up init";
    EXPECT_EQ(max_abs_diff(dn.value, cut_down(pool, full_dn, e0, l_n, f0, fl)), 0.0) << "down init";
    ASSERT_TRUE(gu.global_shape() == ref_gu.value.shape());
    ASSERT_TRUE(dn.global_shape() == ref_dn.value.shape());
  }

  mine.param(".gate.weight").value.copy_from(ref.param(".gate.weight").value);
  gu.value.copy_from(cut_gate_up(pool, ref_gu.value, e0, l_n, f0, fl));
  dn.value.copy_from(cut_down(pool, ref_dn.value, e0, l_n, f0, fl));

  // A throw-away step with other token counts first: the real step must not see its plan.
  {
    Block warm = draw_block(pool, seed, rank, kH, biased, 2);
    Tensor y = pool.zeros(warm.x.shape()), dx = pool.zeros(warm.x.shape());
    mine.layer.forward(warm.x, y);
    mine.layer.backward(warm.dy, dx, loss_scale);
  }

  const Block own = draw_block(pool, seed, rank, kH, biased, 0);
  const int64_t t_n = own.x.size(0);
  Tensor y = pool.randn({t_n, kH}), dx = pool.randn({t_n, kH});
  mine.mem.zero_grads();
  mine.layer.forward(own.x, y);
  mine.layer.backward(own.dy, dx, loss_scale);
  const AllGatherPlan& plan = disp.plan();
  Tensor dgate = pool.clone(mine.param(".gate.weight").grad);
  world.all_reduce(dgate, ReduceOp::sum);

  ref.mem.zero_grads();
  for (int b = 0; b < w_n; ++b) {
    const Block blk = draw_block(pool, seed, b, kH, biased, 0);
    Tensor yb = pool.zeros(blk.x.shape()), dxb = pool.zeros(blk.x.shape());
    ref.layer.forward(blk.x, yb);
    ref.layer.backward(blk.dy, dxb, loss_scale);
    if (b != rank) continue;
    EXPECT_LE(rel_err(y, yb), kTol) << "y";
    EXPECT_LE(rel_err(dx, dxb), kTol) << "dx";
    EXPECT_NEAR(mine.layer.aux_loss(), ref.layer.aux_loss(), kTol * std::max(1.0, ref.layer.aux_loss()));
    EXPECT_NEAR(mine.layer.z_loss(), ref.layer.z_loss(), kTol * std::max(1.0, ref.layer.z_loss()));
    EXPECT_EQ(plan.capacity, ref.layer.plan().capacity);
    EXPECT_EQ(plan.num_home_rows, ref.layer.plan().num_rows);
  }
  EXPECT_LE(rel_err(dgate, ref.param(".gate.weight").grad), kTol) << "router gradient summed over the world";
  EXPECT_GT(max_abs(dgate), 0);
  EXPECT_LE(rel_err(gu.grad, cut_gate_up(pool, ref_gu.grad, e0, l_n, f0, fl)), kTol) << "gate_up_proj grad";
  EXPECT_LE(rel_err(dn.grad, cut_down(pool, ref_dn.grad, e0, l_n, f0, fl)), kTol) << "down_proj grad";

  // The regime each case is about actually happened.
  EXPECT_LE(plan.num_rows, disp.max_rows());
  int64_t dropped = 0;
  for (int64_t i = 0; i < plan.row_TK.numel(); ++i) dropped += plan.row_TK.ptr<int64_t>()[i] < 0;
  const int64_t all_dropped = sum_all(world, dropped);
  int64_t total_t = 0;
  for (int b = 0; b < w_n; ++b) total_t += block_tokens(b);
  // Every ETP rank of an EP rank holds the same rows: over the world, each row is counted etp times.
  const int64_t all_rows = sum_all(world, plan.num_rows);
  if (!(cfg.capacity_factor > 0)) {
    EXPECT_EQ(all_dropped, 0);
    EXPECT_EQ(all_rows, etp_n * total_t * k_n);
  } else if (!cfg.pad_to_capacity) {
    EXPECT_GT(all_dropped, 0) << "no assignment dropped";
  } else {
    int64_t want = 0;
    for (int b = 0; b < w_n; ++b) want += l_n * cfg.capacity(block_tokens(b));
    EXPECT_EQ(plan.num_rows, want) << "padded rows received";
  }
  for (int64_t l = 0; l < l_n; ++l) {
    const int64_t e = e0 + l, n = plan.counts_E.ptr<int64_t>()[l];
    const bool never = biased && c.bias_E[e] < 0, always = biased && c.bias_E[e] >= 5;
    if (never && !cfg.pad_to_capacity) {
      EXPECT_EQ(n, 0) << "expert " << e;
    }
    if (always && !(cfg.capacity_factor > 0)) {
      EXPECT_EQ(n, total_t) << "expert " << e;
    }
    if (never) {
      EXPECT_EQ(max_abs(gu.grad.slice(l, l + 1)), 0.0) << "zero-token expert " << e;
      EXPECT_EQ(max_abs(dn.grad.slice(l, l + 1)), 0.0) << "zero-token expert " << e;
    }
  }
}

class Etp : public ::testing::TestWithParam<Case> {};

TEST_P(Etp, MatchesOneRankReference) {
  for (const auto& [etp_n, ep_n] : layouts(test_world().size())) {
    if (kE % ep_n != 0 || kF % etp_n != 0) continue;
    run_case(GetParam(), etp_n, ep_n);
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, Etp, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

}  // namespace
}  // namespace moefold

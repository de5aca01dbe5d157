// Hierarchical dispatch (run with 2, 4 and 8 ranks): every split of the ranks into emulated nodes
// (1 x P, 2 x P/2, ..., P x 1), a MoeLayer over a HierarchicalDispatcher against the same layer
// over the flat AllToAllDispatcher on the same ranks, tokens and weights, for every routing case
// of the dispatcher suite (moe_cases.h).
//
// What must hold: f64 throughout. With K <= 2 the sums over a token's experts run in the same
// order on both paths (a token's node sums are added in the order of their first expert), so y,
// dx and the router gradient are bit-identical; with more experts per token they differ by the
// order of the additions only. The experts' weight gradients sum their rows in another order
// (rows arrive grouped by relay), so they agree to rounding. The bytes counted across nodes equal
// the count from the routing: each (token, remote node) pair with a kept assignment once.
// Shape letters: T tokens, H hidden, E experts, L local experts, K top-k, S slots of a node row.
#include <gtest/gtest.h>

#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "moe_cases.h"
#include "moe_rig.h"
#include "moefold/comm/communicator.h"
#include "moefold/core/rng.h"
#include "moefold/moe/all_to_all_dispatcher.h"
#include "moefold/moe/hierarchical_dispatcher.h"
#include "mpi_testing.h"
#include "testing.h"

namespace moefold {
namespace {

using testing::all_cases;
using testing::Block;
using testing::block_tokens;
using testing::Case;
using testing::draw_block;
using testing::max_abs_diff;
using testing::Pool;
using testing::rel_err;
using testing::sum_all;

using testing::Rig;
const auto& kExpertParams = testing::kRigExpertParams;
constexpr int64_t kE = testing::kCaseExperts, kH = testing::kRigHidden;
constexpr double kTol = 1e-12;

// One forward and backward on this rank's block; the dx and y written.
struct Step {
  Tensor y, dx, dgate;
};
Step run_step(Rig& rig, Pool& pool, const Block& blk, Communicator& world) {
  Step s{pool.randn(blk.x.shape()), pool.randn(blk.x.shape()), Tensor()};
  rig.mem.zero_grads();
  rig.layer.forward(blk.x, s.y);
  rig.layer.backward(blk.dy, s.dx, 1.3);
  s.dgate = pool.clone(rig.param(".gate.weight").grad);
  world.all_reduce(s.dgate, ReduceOp::sum);
  return s;
}

class Hierarchical : public ::testing::TestWithParam<Case> {};

TEST_P(Hierarchical, MatchesTheFlatDispatcherOnEveryNodeSplit) {
  const Case& c = GetParam();
  Communicator& world = testing::test_world();
  const int p_n = world.size(), rank = world.rank();
  if (kE % p_n != 0) GTEST_SKIP() << kE << " experts over " << p_n << " ranks";
  const uint64_t seed = testing::shared_seed(world);
  const MoeConfig& cfg = c.cfg;
  const int64_t l_n = kE / p_n, k_n = cfg.num_experts_per_tok, max_t = block_tokens(p_n - 1);
  const bool biased = !c.bias_E.empty();
  for (int per_node = 1; per_node <= p_n; per_node *= 2) {
    if (p_n % per_node != 0) continue;
    const int nodes = p_n / per_node, my_node = rank / per_node;
    SCOPED_TRACE("MOEFOLD_TEST_SEED=" + std::to_string(seed) + " rank " + std::to_string(rank) + ", " +
                 std::to_string(nodes) + " nodes x " + std::to_string(per_node));
    std::unique_ptr<Communicator> node = world.split(my_node, rank, "ep_node");
    std::unique_ptr<Communicator> rail = world.split(rank % per_node, rank, "ep_rail");
    Pool pool;
    Rig flat(cfg, max_t, std::make_unique<AllToAllDispatcher>(cfg, kH, max_t, world));
    auto hier_owned = std::make_unique<HierarchicalDispatcher>(cfg, kH, max_t, world, *node, *rail);
    HierarchicalDispatcher& hier = *hier_owned;
    Rig mine(cfg, max_t, std::move(hier_owned));
    ASSERT_EQ(hier.num_local_experts(), l_n);
    ASSERT_EQ(hier.first_local_expert(), rank * l_n);
    int64_t stream = 1;
    for (Param& p : flat.mem.params()) fill_normal(p.value, seed, stream++, 0.0, 0.5);
    if (biased) {
      double* g = flat.param(".gate.weight").value.ptr<double>();
      for (int64_t e = 0; e < kE; ++e)
        for (int64_t i = 0; i < kH; ++i) g[e * kH + i] += c.bias_E[e];
    }
    for (size_t i = 0; i < flat.mem.params().size(); ++i)
      mine.mem.params()[i].value.copy_from(flat.mem.params()[i].value);

    // A throw-away step with other token counts first: the real step must not see its plan.
    const Block warm = draw_block(pool, seed, rank, kH, biased, 2);
    run_step(mine, pool, warm, world);
    hier.reset_inter_node();

    const Block own = draw_block(pool, seed, rank, kH, biased, 0);
    const Step want = run_step(flat, pool, own, world);
    const Step got = run_step(mine, pool, own, world);
    if (k_n <= 2) {  // the same additions in the same order
      EXPECT_EQ(max_abs_diff(got.y, want.y), 0.0) << "y";
      EXPECT_EQ(max_abs_diff(got.dx, want.dx), 0.0) << "dx";
      EXPECT_EQ(max_abs_diff(got.dgate, want.dgate), 0.0) << "router gradient";
    } else {
      EXPECT_LE(rel_err(got.y, want.y), kTol) << "y";
      EXPECT_LE(rel_err(got.dx, want.dx), kTol) << "dx";
      EXPECT_LE(rel_err(got.dgate, want.dgate), kTol) << "router gradient";
    }
    EXPECT_EQ(mine.layer.aux_loss(), flat.layer.aux_loss());
    for (const char* name : kExpertParams)
      EXPECT_LE(rel_err(mine.param(name).grad, flat.param(name).grad), kTol) << name;

    // The bytes across nodes, from the routing: the (token, remote node) pairs whose assignment
    // the capacity kept (the flat dispatcher's home plan says which).
    const Tensor& idx = flat.layer.router().topk_idx();
    const Tensor& home_row = dynamic_cast<const AllToAllDispatcher&>(flat.layer.dispatcher()).plan().row_TK;
    std::set<std::pair<int64_t, int64_t>> pairs;
    for (int64_t t = 0; t < own.x.size(0); ++t)
      for (int64_t k = 0; k < k_n; ++k) {
        const int64_t a = t * k_n + k, n = idx.ptr<int32_t>()[a] / (l_n * per_node);
        if (home_row.ptr<int64_t>()[a] >= 0 && n != my_node) pairs.emplace(t, n);
      }
    const auto remote = static_cast<int64_t>(pairs.size());
    const int64_t s_n = std::min(k_n, l_n * per_node), f64 = 8;
    EXPECT_EQ(hier.inter_node_rows(), remote);
    EXPECT_EQ(hier.inter_node().dispatch, remote * (kH * f64 + s_n * 4 + s_n * f64));
    // The other legs are sent by whoever holds the rows: over all ranks, each pair once per leg.
    const int64_t all_remote = sum_all(world, remote);
    EXPECT_EQ(sum_all(world, hier.inter_node().combine), all_remote * kH * f64);
    EXPECT_EQ(sum_all(world, hier.inter_node().dout), all_remote * (kH + s_n) * f64);
    EXPECT_EQ(sum_all(world, hier.inter_node().drows), all_remote * kH * f64);
    if (nodes == 1) {
      EXPECT_EQ(hier.inter_node().total(), 0);
    }
    if (nodes > 1 && !biased && k_n > 1) {  // random routing reaches other nodes
      EXPECT_GT(all_remote, 0);
    }
  }
}

// The dispatcher suite's cases, and tokens with four experts (their node sums add in another
// order than the flat sum over k).
std::vector<Case> hierarchical_cases() {
  std::vector<Case> cases = all_cases();
  cases.push_back(testing::make("four_experts_softmax_k4", {.k = 4}));
  cases.push_back(
      testing::make("four_experts_capacity_sigmoid_k4_aux", {.k = 4, .sigmoid = true, .aux = true, .capacity = 0.8}));
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, Hierarchical, ::testing::ValuesIn(hierarchical_cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

}  // namespace
}  // namespace moefold

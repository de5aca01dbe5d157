// Expert parallelism, layout parity (run with 1, 2 and 4 ranks): a MoeLayer over an
// AllToAllDispatcher on the world group against one-process LocalDispatcher references that every
// rank computes itself from the shared seed (every rank can draw every rank's tokens).
//
// What the references equal: each rank routes, drops (capacity from its own T) and computes its
// aux / z losses on its own tokens, so the exact reference is the LocalDispatcher layer run block
// by block over the ranks' token blocks, its gradients accumulated over the blocks (the loss is
// the sum over all tokens plus every rank's own aux / z terms). This rank's y, dx, aux and z must
// equal its block's; its local experts' gradients the matching rows of the accumulated ones; the
// router gradient summed over EP ranks (each router saw only its tokens) the accumulated one.
// Dropless with no aux / z loss, the same holds against ONE layer over all tokens concatenated.
// Shape letters: T tokens, H hidden, E experts, L local experts, K top-k.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "moe_cases.h"
#include "moe_rig.h"
#include "moefold/comm/communicator.h"
#include "moefold/core/memory.h"
#include "moefold/core/rng.h"
#include "moefold/moe/all_to_all_dispatcher.h"
#include "moefold/moe/moe_layer.h"
#include "moefold/moe/slot_dispatcher.h"
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
const auto& kExpertParams = testing::kRigExpertParams;
constexpr int64_t kE = testing::kCaseExperts, kH = testing::kRigHidden;
// f64 throughout; the EP layer and the references add the same terms in different orders only.
constexpr double kTol = 1e-10;

using testing::all_cases;
using testing::Case;
using testing::make;

using testing::Block;
using testing::block_tokens;
using testing::draw_block;
using testing::rel_err;
using testing::sum_all;

// Every parameter drawn from `seed`, and the case's bias (if any) added to every element of gate row e.
void fill_params(Rig& rig, const Case& c, uint64_t seed) {
  int64_t stream = 1;
  for (Param& p : rig.mem.params()) fill_normal(p.value, seed, stream++, 0.0, 0.5);
  if (c.bias_E.empty()) return;
  double* g = rig.param(".gate.weight").value.ptr<double>();
  for (int64_t e = 0; e < kE; ++e)
    for (int64_t i = 0; i < kH; ++i) g[e * kH + i] += c.bias_E[e];
}

// Every token to expert 7 (one rank's), K = 1, receive buffers at 1.5 x the average: more than fits.
Case overflow_case() { return make("overflow", {.k = 1, .norm = false, .recv = 1.5}, {0, 0, 0, 0, 0, 0, 0, 5}); }

// moe.ep_recv_factor too small for the routing (every token to expert 7, one rank's): every rank
// of the group fails the dispatch with one message naming the key, none hangs.
TEST(AllToAllDispatcher, RecvFactorOverflowFailsOnEveryRank) {
  Communicator& world = testing::test_world();
  const int ep = world.size();
  if (ep == 1 || kE % ep != 0) GTEST_SKIP() << "needs EP > 1 dividing " << kE;
  const uint64_t seed = shared_seed(world);
  const Case c = overflow_case();
  const int64_t max_t = testing::block_tokens(ep - 1);
  Pool pool;
  Rig rig(c.cfg, max_t, std::make_unique<AllToAllDispatcher>(c.cfg, kH, max_t, world));
  fill_params(rig, c, seed);
  const testing::Block own = testing::draw_block(pool, seed, world.rank(), kH, true, 0);
  Tensor y = pool.zeros(own.x.shape());
  try {
    rig.layer.forward(own.x, y);
    ADD_FAILURE() << "the dispatch did not fail";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("moe.ep_recv_factor = 1.5"), std::string::npos) << e.what();
  }
}

// This rank's EP layer over `disp` (the whole router, experts [rank L, (rank + 1) L)) runs a
// throw-away step with other token counts (after_warmup runs then), then the real step, whose y,
// dx, router gradient (summed over EP) and expert gradients must equal the references'. Returns
// A biased router's never-chosen experts get no gradient. after_step runs last, while the
// dispatcher still lives (its checks of the regime the case is about).
struct StepFacts {
  int64_t total_tokens = 0;  // T of all ranks' blocks
  int64_t home_rows = 0;     // this rank's rows as one process routes its block (LocalDispatcher's R)
};
void expect_references(const Case& c, uint64_t seed, std::unique_ptr<Dispatcher> disp,
                       const std::function<void()>& after_warmup,
                       const std::function<void(const StepFacts&)>& after_step) {
  Communicator& world = test_world();
  const int ep = world.size(), rank = world.rank();
  const MoeConfig& cfg = c.cfg;
  const int64_t l_n = kE / ep, max_t = block_tokens(ep - 1);
  const double loss_scale = 1.3;
  const bool biased = !c.bias_E.empty();
  Pool pool;

  // The full layer, identical on every rank.
  Rig ref(cfg, max_t, nullptr);
  fill_params(ref, c, seed);

  const Dispatcher& d = *disp;
  Rig mine(cfg, max_t, std::move(disp));
  EXPECT_EQ(d.num_local_experts(), l_n);
  EXPECT_EQ(d.first_local_expert(), rank * l_n);
  mine.param(".gate.weight").value.copy_from(ref.param(".gate.weight").value);
  for (const char* name : kExpertParams)
    mine.param(name).value.copy_from(ref.param(name).value.slice(rank * l_n, (rank + 1) * l_n));

  // A throw-away step with other token counts first: the real step must not see its plan.
  {
    Block warm = draw_block(pool, seed, rank, kH, biased, 2);
    Tensor y = pool.zeros(warm.x.shape()), dx = pool.zeros(warm.x.shape());
    mine.layer.forward(warm.x, y);
    mine.layer.backward(warm.dy, dx, loss_scale);
  }
  after_warmup();

  // The EP step on this rank's block (outputs pre-filled with garbage: they must be written).
  const Block own = draw_block(pool, seed, rank, kH, biased, 0);
  const int64_t t_n = own.x.size(0);
  Tensor y = pool.randn({t_n, kH}), dx = pool.randn({t_n, kH});
  mine.mem.zero_grads();
  mine.layer.forward(own.x, y);
  mine.layer.backward(own.dy, dx, loss_scale);
  Tensor dgate = pool.clone(mine.param(".gate.weight").grad);
  world.all_reduce(dgate, ReduceOp::sum);

  // Reference 1 (always exact): the LocalDispatcher layer block by block, gradients accumulated.
  ref.mem.zero_grads();
  int64_t total_t = 0, home_rows = 0;
  for (int b = 0; b < ep; ++b) {
    const Block blk = draw_block(pool, seed, b, kH, biased, 0);
    total_t += blk.x.size(0);
    Tensor yb = pool.zeros(blk.x.shape()), dxb = pool.zeros(blk.x.shape());
    ref.layer.forward(blk.x, yb);
    ref.layer.backward(blk.dy, dxb, loss_scale);
    if (b != rank) continue;
    EXPECT_LE(rel_err(y, yb), kTol) << "y";
    EXPECT_LE(rel_err(dx, dxb), kTol) << "dx";
    EXPECT_NEAR(mine.layer.aux_loss(), ref.layer.aux_loss(), kTol * std::max(1.0, ref.layer.aux_loss()));
    EXPECT_NEAR(mine.layer.z_loss(), ref.layer.z_loss(), kTol * std::max(1.0, ref.layer.z_loss()));
    EXPECT_EQ(mine.layer.plan().capacity, ref.layer.plan().capacity);
    home_rows = ref.layer.plan().num_rows;
  }
  EXPECT_LE(rel_err(dgate, ref.param(".gate.weight").grad), kTol) << "router gradient summed over EP";
  EXPECT_GT(max_abs(dgate), 0);
  for (const char* name : kExpertParams)
    EXPECT_LE(rel_err(mine.param(name).grad, ref.param(name).grad.slice(rank * l_n, (rank + 1) * l_n)), kTol) << name;

  // Reference 2 (dropless, no aux / z): one layer over all ranks' tokens concatenated.
  const bool concat = !(cfg.capacity_factor > 0) && cfg.aux_loss_coeff == 0 && cfg.z_loss_coeff == 0;
  if (concat) {
    Rig cat(cfg, total_t, nullptr);
    for (size_t i = 0; i < cat.mem.params().size(); ++i) cat.mem.params()[i].value.copy_from(ref.mem.params()[i].value);
    Tensor x_all = pool.zeros({total_t, kH}), dy_all = pool.zeros({total_t, kH});
    int64_t first = 0, mine_first = 0;
    for (int b = 0; b < ep; ++b) {
      const Block blk = draw_block(pool, seed, b, kH, biased, 0);
      const int64_t n = blk.x.size(0);
      if (b == rank) mine_first = first;
      x_all.slice(first, first + n).copy_from(blk.x);
      dy_all.slice(first, first + n).copy_from(blk.dy);
      first += n;
    }
    Tensor y_all = pool.zeros({total_t, kH}), dx_all = pool.zeros({total_t, kH});
    cat.mem.zero_grads();
    cat.layer.forward(x_all, y_all);
    cat.layer.backward(dy_all, dx_all, loss_scale);
    EXPECT_LE(rel_err(y, y_all.slice(mine_first, mine_first + t_n)), kTol) << "y vs concatenated";
    EXPECT_LE(rel_err(dx, dx_all.slice(mine_first, mine_first + t_n)), kTol) << "dx vs concatenated";
    EXPECT_LE(rel_err(dgate, cat.param(".gate.weight").grad), kTol) << "router gradient vs concatenated";
    for (const char* name : kExpertParams)
      EXPECT_LE(rel_err(mine.param(name).grad, cat.param(name).grad.slice(rank * l_n, (rank + 1) * l_n)), kTol)
          << name << " vs concatenated";
  }
  for (int64_t l = 0; l < l_n; ++l) {
    const int64_t e = rank * l_n + l;
    if (biased && c.bias_E[e] < 0) {  // no real rows (padding rows carry no gradient)
      EXPECT_EQ(max_abs(mine.param(".experts.gate_up_proj").grad.slice(l, l + 1)), 0.0) << "idle expert " << e;
      EXPECT_EQ(max_abs(mine.param(".experts.down_proj").grad.slice(l, l + 1)), 0.0) << "idle expert " << e;
    }
  }
  after_step(StepFacts{total_t, home_rows});
}

void expect_all_to_all_regime(const Case& c, const AllToAllDispatcher& disp, const StepFacts& f);

// Every case by both transports: the exchange (MPI messages) and the peer copies (MPI's
// PeerMemory: the same offsets a GPU's direct copies write to, as messages).
class AllToAll : public ::testing::TestWithParam<std::tuple<Case, EpTransportChoice>> {};

TEST_P(AllToAll, MatchesOneRankReference) {
  const Case& c = std::get<0>(GetParam());
  const EpTransportChoice transport = std::get<1>(GetParam());
  Communicator& world = test_world();
  const int ep = world.size(), rank = world.rank();
  if (kE % ep != 0) GTEST_SKIP() << kE << " experts over " << ep << " ranks";
  const uint64_t seed = shared_seed(world);
  SCOPED_TRACE("MOEFOLD_TEST_SEED=" + std::to_string(seed) + " rank " + std::to_string(rank) + " of " +
               std::to_string(ep));
  auto disp_owned = std::make_unique<AllToAllDispatcher>(c.cfg, kH, block_tokens(ep - 1), world, transport);
  const AllToAllDispatcher& disp = *disp_owned;
  expect_references(
      c, seed, std::move(disp_owned),
      [&] {
        ASSERT_STREQ(disp.transport().name(), transport == EpTransportChoice::ipc && ep > 1 ? "peer" : "exchange");
      },
      [&](const StepFacts& f) { expect_all_to_all_regime(c, disp, f); });
}

// The regime each case is about actually happened (AllToAllDispatcher's plan of the step).
void expect_all_to_all_regime(const Case& c, const AllToAllDispatcher& disp, const StepFacts& f) {
  Communicator& world = test_world();
  const int ep = world.size(), rank = world.rank();
  const MoeConfig& cfg = c.cfg;
  const int64_t l_n = kE / ep, k_n = cfg.num_experts_per_tok, total_t = f.total_tokens;
  const bool biased = !c.bias_E.empty();
  const AllToAllPlan& plan = disp.plan();
  EXPECT_EQ(plan.num_home_rows, f.home_rows);
  const int64_t rows = plan.num_rows;
  EXPECT_LE(rows, disp.max_rows());
  int64_t dropped = 0;
  for (int64_t i = 0; i < plan.row_TK.numel(); ++i) dropped += plan.row_TK.ptr<int64_t>()[i] < 0;
  const int64_t all_dropped = sum_all(world, dropped), all_rows = sum_all(world, rows);
  if (!(cfg.capacity_factor > 0)) {
    EXPECT_EQ(all_dropped, 0);
    EXPECT_EQ(all_rows, total_t * k_n);
  } else if (!cfg.pad_to_capacity) {
    EXPECT_GT(all_dropped, 0) << "no assignment dropped";
  } else {
    int64_t want = 0;
    for (int b = 0; b < ep; ++b) want += l_n * cfg.capacity(block_tokens(b));
    EXPECT_EQ(rows, want) << "padded rows received";
  }
  bool idle_rank = biased;
  for (int64_t l = 0; l < l_n; ++l) {
    const int64_t e = rank * l_n + l, n = plan.counts_E.ptr<int64_t>()[l];
    const bool never = biased && c.bias_E[e] < 0, always = biased && c.bias_E[e] >= 5;
    idle_rank = idle_rank && never;
    if (never && !cfg.pad_to_capacity) {
      EXPECT_EQ(n, 0) << "expert " << e;
    }
    if (always && !(cfg.capacity_factor > 0)) {
      EXPECT_EQ(n, total_t) << "expert " << e;
    }
  }
  if (idle_rank && !cfg.pad_to_capacity) {
    EXPECT_EQ(rows, 0) << "the idle rank received rows";
  }
  if (biased && c.bias_E[0] > 0 && !(cfg.capacity_factor > 0)) {  // imbalanced toward rank 0
    int64_t most = rows;
    world.all_reduce(Tensor(&most, DType::i64, {1}), ReduceOp::max);
    if (rank == 0) {
      EXPECT_EQ(rows, most) << "rank 0 should receive the most rows";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, AllToAll,
                         ::testing::Combine(::testing::ValuesIn(all_cases()),
                                            ::testing::Values(EpTransportChoice::nccl, EpTransportChoice::ipc)),
                         [](const ::testing::TestParamInfo<std::tuple<Case, EpTransportChoice>>& i) {
                           return std::get<0>(i.param).name +
                                  (std::get<1>(i.param) == EpTransportChoice::ipc ? "_peer" : "_exchange");
                         });

// SlotDispatcher (moe.dispatcher = "slots"): every case it takes (dropless or padded) against the
// same references, then what its device-side plan received.
class Slots : public ::testing::TestWithParam<Case> {};

TEST_P(Slots, MatchesOneRankReference) {
  const Case& c = GetParam();
  Communicator& world = test_world();
  const int ep = world.size(), rank = world.rank();
  if (kE % ep != 0) GTEST_SKIP() << kE << " experts over " << ep << " ranks";
  if (c.cfg.capacity_factor > 0 && !c.cfg.pad_to_capacity) GTEST_SKIP() << "a capacity without padding";
  const uint64_t seed = shared_seed(world);
  SCOPED_TRACE("MOEFOLD_TEST_SEED=" + std::to_string(seed) + " rank " + std::to_string(rank) + " of " +
               std::to_string(ep));
  const MoeConfig& cfg = c.cfg;
  const int64_t l_n = kE / ep, k_n = cfg.num_experts_per_tok;
  auto disp_owned = std::make_unique<SlotDispatcher>(cfg, kH, block_tokens(ep - 1), world);
  const SlotDispatcher& disp = *disp_owned;
  expect_references(
      c, seed, std::move(disp_owned), [] {},
      [&](const StepFacts& f) {
        EXPECT_EQ(disp.overflow().ptr<double>()[0], 0.0) << "rows that did not fit";
        EXPECT_EQ(disp.slot_rows(), SlotDispatcher::slot_rows(cfg, block_tokens(ep - 1), ep));
        const int64_t* recv = disp.recv_counts().ptr<int64_t>();
        std::vector<int64_t> per_expert(static_cast<size_t>(l_n), 0);
        int64_t rows = 0;
        for (int64_t p = 0; p < ep; ++p)
          for (int64_t l = 0; l < l_n; ++l) {
            per_expert[static_cast<size_t>(l)] += recv[p * l_n + l];
            rows += recv[p * l_n + l];
          }
        const int64_t all_rows = sum_all(world, rows);
        if (!(cfg.capacity_factor > 0)) {
          EXPECT_EQ(all_rows, f.total_tokens * k_n);
        } else {
          int64_t want = 0;
          for (int b = 0; b < ep; ++b) want += l_n * cfg.capacity(block_tokens(b));
          EXPECT_EQ(rows, want) << "padded rows received";
        }
        EXPECT_LE(rows, disp.max_rows());
        // The fill: at most 1 where everything fit, at least what the experts' rows took of R.
        const double fill = disp.fill().ptr<double>()[0];
        EXPECT_LE(fill, 1.0);
        EXPECT_GE(fill, static_cast<double>(rows) / static_cast<double>(std::max<int64_t>(disp.max_rows(), 1)));
        for (int64_t l = 0; l < l_n; ++l) {
          const int64_t e = rank * l_n + l;
          if (!c.bias_E.empty() && c.bias_E[e] >= 5 && !(cfg.capacity_factor > 0)) {
            EXPECT_EQ(per_expert[static_cast<size_t>(l)], f.total_tokens) << "expert " << e;
          }
          if (!c.bias_E.empty() && c.bias_E[e] < 0 && !cfg.pad_to_capacity) {
            EXPECT_EQ(per_expert[static_cast<size_t>(l)], 0) << "expert " << e;
          }
        }
      });
}

INSTANTIATE_TEST_SUITE_P(Cases, Slots, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

// Slots too small for the routing (every token to expert 7, slots of 1.5 x the average share): the
// step runs to its end without touching memory outside its buffers (run it from the ASan build), leaves
// the rows that did not fit out, and counts them on the device; nothing is read by the host.
TEST(Slots, RowsThatDoNotFitAreCountedNotWritten) {
  Communicator& world = testing::test_world();
  const int ep = world.size();
  if (ep == 1 || kE % ep != 0) GTEST_SKIP() << "needs EP > 1 dividing " << kE;
  const uint64_t seed = shared_seed(world);
  const Case c = overflow_case();
  const int64_t max_t = testing::block_tokens(ep - 1);
  Pool pool;
  auto owned = std::make_unique<SlotDispatcher>(c.cfg, kH, max_t, world);
  SlotDispatcher& disp = *owned;
  Rig rig(c.cfg, max_t, std::move(owned));
  fill_params(rig, c, seed);
  const testing::Block own = testing::draw_block(pool, seed, world.rank(), kH, true, 0);
  Tensor y = pool.zeros(own.x.shape()), dx = pool.zeros(own.x.shape());
  rig.layer.forward(own.x, y);
  rig.layer.backward(own.dy, dx, 1.0);
  const int64_t t_n = own.x.size(0), b_n = disp.slot_rows();
  // Rank r's tokens all go to the last rank's expert 7: t_n - B of them cannot travel.
  EXPECT_EQ(disp.overflow().ptr<double>()[0] >= static_cast<double>(std::max<int64_t>(0, t_n - b_n)), true);
  EXPECT_GE(disp.fill().ptr<double>()[0], static_cast<double>(t_n) / static_cast<double>(std::max<int64_t>(b_n, 1)))
      << "the fill of the slot to the last rank";
  double all = disp.overflow().ptr<double>()[0];
  world.all_reduce(Tensor(&all, DType::f64, {1}), ReduceOp::sum);
  EXPECT_GT(all, 0) << "nothing overflowed: the case does not test what it says";
  for (int64_t i = 0; i < y.numel(); ++i) ASSERT_TRUE(std::isfinite(y.ptr<double>()[i]));
  for (int64_t i = 0; i < dx.numel(); ++i) ASSERT_TRUE(std::isfinite(dx.ptr<double>()[i]));
  // Sinks given by the owner (the trainer's step sums) are added to and max-ed into instead.
  double sink = 0.25, fill = 0;
  disp.set_overflow_sinks(Tensor(&sink, DType::f64, {1}), Tensor(&fill, DType::f64, {1}));
  rig.layer.forward(own.x, y);
  world.all_reduce(Tensor(&sink, DType::f64, {1}), ReduceOp::sum);
  world.all_reduce(Tensor(&fill, DType::f64, {1}), ReduceOp::max);
  EXPECT_GT(sink, 0.25 * ep);
  EXPECT_GT(fill, 1.0) << "rows did not fit";
}

}  // namespace
}  // namespace moefold

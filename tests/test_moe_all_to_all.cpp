// AllToAllDispatcher on one rank (the self communicator): with EP = 1 the exchange is a copy and
// the reorder the identity, so a MoeLayer over it must equal the LocalDispatcher layer EXACTLY
// (same rows in the same order, same sums) in every routing regime. Multi-rank parity lives in
// tests/mpi/test_moe_all_to_all.cpp. Shape letters: T tokens, H hidden, E experts, K top-k.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "moefold/comm/communicator.h"
#include "moefold/core/memory.h"
#include "moefold/moe/all_to_all_dispatcher.h"
#include "moefold/moe/moe_layer.h"
#include "testing.h"

namespace moefold {
namespace {

using testing::max_abs;
using testing::max_abs_diff;
using testing::Pool;

const std::string kPrefix = "model.layers.0.mlp";
const char* const kParams[] = {".gate.weight", ".experts.gate_up_proj", ".experts.down_proj"};

// A MoeLayer bound to its own Memory (both passes).
struct Rig {
  Memory mem{DType::f64};
  MoeLayer layer;
  Rig(const MoeConfig& cfg, int64_t h_n, int64_t max_t, std::unique_ptr<Dispatcher> d)
      : layer(d ? MoeLayer(cfg, h_n, max_t, kPrefix, std::move(d)) : MoeLayer(cfg, h_n, max_t, kPrefix)) {
    mem.bind_twice([&] { layer.bind(mem); });
  }
  const Param& param(const std::string& suffix) const { return *mem.find(kPrefix + suffix); }
};

// Bit-for-bit equality of two tensors of any dtype (same shape).
void expect_identical(const Tensor& a, const Tensor& b, const std::string& what) {
  ASSERT_EQ(a.shape(), b.shape()) << what;
  ASSERT_EQ(a.dtype(), b.dtype()) << what;
  ASSERT_TRUE(a.contiguous() && b.contiguous()) << what;
  const auto* pa = static_cast<const unsigned char*>(a.data());
  const auto* pb = static_cast<const unsigned char*>(b.data());
  EXPECT_TRUE(std::equal(pa, pa + a.nbytes(), pb)) << what << " differs";
}

// Adds bias_E[e] to every element of gate row e: with inputs of positive mean, expert e's logit
// moves by about bias * H * mean(x) (how the tests force imbalance and idle experts).
void bias_gate(const Tensor& gate_EH, const std::vector<double>& bias_E) {
  const int64_t e_n = gate_EH.size(0), h_n = gate_EH.size(1);
  double* g = gate_EH.ptr<double>();
  for (int64_t e = 0; e < e_n; ++e)
    for (int64_t i = 0; i < h_n; ++i) g[e * h_n + i] += bias_E[e];
}

struct Case {
  std::string name;
  MoeConfig cfg;
  std::vector<double> bias_E;  // empty: unbiased router
};

std::vector<Case> cases() {
  const MoeConfig base{.num_experts = 8,
                       .num_experts_per_tok = 2,
                       .moe_intermediate_size = 5,
                       .aux_loss_coeff = 0.1,
                       .z_loss_coeff = 0.01};
  std::vector<Case> c;
  c.push_back({"softmax k2 dropless", base, {}});
  c.push_back({"sigmoid k1 scaled", base, {}});
  c.back().cfg.scoring_func = ScoreFunc::sigmoid;
  c.back().cfg.num_experts_per_tok = 1;
  c.back().cfg.routed_scaling_factor = 2.5;
  c.push_back({"imbalanced toward experts 0-3", base, {1, 1, 1, 1, 0, 0, 0, 0}});
  c.push_back({"zero-token experts 1, 6, 7", base, {0, -5, 0, 0, 0, 0, -5, -5}});
  c.push_back({"all tokens to expert 7 (k1)", base, {0, 0, 0, 0, 0, 0, 0, 5}});
  c.back().cfg.num_experts_per_tok = 1;
  c.push_back({"all tokens to experts 6, 7 (k2)", base, {0, 0, 0, 0, 0, 0, 5, 5}});
  c.push_back({"capacity 0.6 dropping", base, {}});
  c.back().cfg.capacity_factor = 0.6;
  c.push_back({"capacity 1.0 imbalanced", base, {2, 2, 0, 0, 0, 0, 0, 0}});
  c.back().cfg.capacity_factor = 1.0;
  c.push_back({"capacity 0.75 padded sigmoid k1", base, {}});
  c.back().cfg.capacity_factor = 0.75;
  c.back().cfg.pad_to_capacity = true;
  c.back().cfg.scoring_func = ScoreFunc::sigmoid;
  c.back().cfg.num_experts_per_tok = 1;
  c.push_back({"capacity 1.5 padded", base, {}});
  c.back().cfg.capacity_factor = 1.5;
  c.back().cfg.pad_to_capacity = true;
  return c;
}

// Both rigs' layers, forward then backward, on the same random x and d(y) of T tokens (inputs of
// positive mean for a case with a gate bias); y and dx of each.
struct Outputs {
  Tensor y[2], dx[2];
};
Outputs run_both(Pool& pool, const Case& c, Rig& a, Rig& b, int64_t t_n, int64_t h_n) {
  Tensor x = c.bias_E.empty() ? pool.randn({t_n, h_n}) : pool.uniform({t_n, h_n}, 0.5, 1.5);
  Tensor g = pool.randn({t_n, h_n});
  Outputs o;
  Rig* rigs[2] = {&a, &b};
  for (int i = 0; i < 2; ++i) {  // garbage first: outputs are written
    o.y[i] = pool.randn({t_n, h_n});
    o.dx[i] = pool.randn({t_n, h_n});
    rigs[i]->mem.zero_grads();
  }
  for (int i = 0; i < 2; ++i) rigs[i]->layer.forward(x, o.y[i]);
  for (int i = 0; i < 2; ++i) rigs[i]->layer.backward(g, o.dx[i], 1.3);
  return o;
}

TEST(AllToAllDispatcher, OneRankEqualsLocalDispatcherExactly) {
  const int64_t h_n = 6, max_t = 11;
  auto self = make_self_communicator("ep");
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    Pool pool;
    Rig local(c.cfg, h_n, max_t, nullptr);
    auto a2a_owned = std::make_unique<AllToAllDispatcher>(c.cfg, h_n, max_t, *self);
    const AllToAllDispatcher& a2a_disp = *a2a_owned;
    Rig a2a(c.cfg, h_n, max_t, std::move(a2a_owned));
    ASSERT_EQ(a2a_disp.num_local_experts(), c.cfg.num_experts);
    ASSERT_EQ(a2a_disp.max_rows(), local.layer.dispatcher().max_rows());
    for (const char* name : kParams) {
      const Tensor& v = local.param(name).value;
      v.copy_from(pool.randn(v.shape(), DType::f64, 0.5));
      if (!c.bias_E.empty() && std::string(name) == ".gate.weight") bias_gate(v, c.bias_E);
      a2a.param(name).value.copy_from(v);
    }
    // Two steps with different T: the second plan must not see the first one's leftovers.
    for (int64_t t_n : {max_t, int64_t{7}}) {
      SCOPED_TRACE("T " + std::to_string(t_n));
      const Outputs o = run_both(pool, c, local, a2a, t_n, h_n);
      const Tensor &y0 = o.y[0], &y1 = o.y[1], &dx0 = o.dx[0], &dx1 = o.dx[1];

      const DispatchPlan& p0 = local.layer.plan();
      const AllToAllPlan& p1 = a2a_disp.plan();
      ASSERT_EQ(&a2a.layer.plan(), static_cast<const DispatchPlan*>(&p1));
      EXPECT_EQ(p1.num_tokens, t_n);
      EXPECT_EQ(p1.capacity, p0.capacity);
      ASSERT_EQ(p1.num_rows, p0.num_rows);
      EXPECT_EQ(p1.num_home_rows, p0.num_rows);
      expect_identical(p1.counts_E, p0.counts_E, "counts_E");
      // One rank: the rows are the local dispatcher's, in one piece with its offsets.
      EXPECT_FALSE(p1.offsets_E1.defined());
      ASSERT_EQ(p1.pieces.size(), 1u);
      EXPECT_EQ(p1.pieces[0].begin, 0);
      EXPECT_EQ(p1.pieces[0].end, p0.num_rows);
      expect_identical(p1.pieces[0].offsets_E1, p0.offsets_E1, "piece offsets_E1");
      expect_identical(p1.row_TK, p0.row_TK, "row_TK");
      expect_identical(p1.token_R, p0.token_R, "token_R");
      expect_identical(p1.rows_RH, p0.rows_RH, "rows_RH");
      EXPECT_EQ(p1.send_counts_P.ptr<int64_t>()[0], p0.num_rows);
      EXPECT_EQ(p1.recv_counts_P.ptr<int64_t>()[0], p0.num_rows);
      // The regime the case is about happened (so the equality above covers it).
      for (int64_t e = 0; e < c.cfg.num_experts && !c.bias_E.empty(); ++e) {
        const int64_t n = p0.counts_E.ptr<int64_t>()[e];
        if (c.bias_E[e] < 0 && !c.cfg.pad_to_capacity) {
          EXPECT_EQ(n, 0) << "expert " << e;
        }
        if (c.bias_E[e] >= 5) {
          EXPECT_EQ(n, t_n) << "expert " << e;
        }
      }
      if (c.cfg.capacity_factor > 0 && !c.cfg.pad_to_capacity && t_n == max_t) {
        const int64_t* row = p0.row_TK.ptr<int64_t>();
        EXPECT_TRUE(std::any_of(row, row + p0.row_TK.numel(), [](int64_t r) { return r < 0; })) << "no drops";
      }
      expect_identical(y1, y0, "y");
      expect_identical(dx1, dx0, "dx");
      EXPECT_EQ(a2a.layer.aux_loss(), local.layer.aux_loss());
      EXPECT_EQ(a2a.layer.z_loss(), local.layer.z_loss());
      for (const char* name : kParams) {
        expect_identical(a2a.param(name).grad, local.param(name).grad, name);
      }
      EXPECT_GT(max_abs(local.param(".gate.weight").grad), 0);
      EXPECT_GT(max_abs(y0), 0);
      EXPECT_GT(max_abs(dx0), 0);
    }
  }
}

// CUDA graphs plan the rows without reading R back: with a capacity and no padding the last
// expert is padded up to the bound. The padding rows are zero: outputs and gradients are the bits
// of the waited plan, the rows [0, R) the same.
TEST(LocalDispatcher, RowsWithoutWaitingChangeNothing) {
  const int64_t h_n = 6, max_t = 11;
  int padded = 0;  // cases whose bound exceeded R (so the comparison covers padding rows)
  for (const Case& c : cases()) {
    if (!(c.cfg.capacity_factor > 0) || c.cfg.pad_to_capacity) continue;
    SCOPED_TRACE(c.name);
    Pool pool;
    Rig waited(c.cfg, h_n, max_t, nullptr), bound(c.cfg, h_n, max_t, nullptr);
    bound.layer.dispatcher().set_rows_without_waiting(true);
    for (const char* name : kParams) {
      const Tensor& v = waited.param(name).value;
      v.copy_from(pool.randn(v.shape(), DType::f64, 0.5));
      if (!c.bias_E.empty() && std::string(name) == ".gate.weight") bias_gate(v, c.bias_E);
      bound.param(name).value.copy_from(v);
    }
    const Outputs o = run_both(pool, c, waited, bound, max_t, h_n);
    const DispatchPlan& p0 = waited.layer.plan();
    const DispatchPlan& p1 = bound.layer.plan();
    EXPECT_EQ(p1.num_rows, std::min(max_t * c.cfg.num_experts_per_tok, c.cfg.num_experts * p0.capacity));
    EXPECT_GE(p1.num_rows, p0.num_rows);
    padded += p1.num_rows > p0.num_rows ? 1 : 0;
    expect_identical(p1.row_TK, p0.row_TK, "row_TK");
    expect_identical(p1.token_R.slice(0, p0.num_rows), p0.token_R, "token_R");
    for (int64_t r = p0.num_rows; r < p1.num_rows; ++r) EXPECT_EQ(p1.token_R.ptr<int64_t>()[r], -1) << "row " << r;
    expect_identical(o.y[1], o.y[0], "y");
    expect_identical(o.dx[1], o.dx[0], "dx");
    for (const char* name : kParams) expect_identical(bound.param(name).grad, waited.param(name).grad, name);
  }
  EXPECT_GT(padded, 0);
}

TEST(AllToAllDispatcher, ReceiveBufferBoundIsTheWorstCase) {
  MoeConfig cfg{.num_experts = 8, .num_experts_per_tok = 2};
  // Dropless: every peer sends all T*K rows to one rank (K <= L), or T*L when K > L.
  EXPECT_EQ(AllToAllDispatcher::max_recv_rows(cfg, 10, 1), 20);
  EXPECT_EQ(AllToAllDispatcher::max_recv_rows(cfg, 10, 4), 4 * 10 * 2);
  cfg.num_experts_per_tok = 4;
  EXPECT_EQ(AllToAllDispatcher::max_recv_rows(cfg, 10, 4), 4 * 10 * 2);  // L = 2 distinct experts per token
  EXPECT_EQ(AllToAllDispatcher::max_recv_rows(cfg, 10, 8), 8 * 10 * 1);
  // Capacity: capacity(10) = ceil(1.0 * 10 * 4 / 8) = 5 rows per expert and peer.
  cfg.capacity_factor = 1.0;
  EXPECT_EQ(AllToAllDispatcher::max_recv_rows(cfg, 10, 4), 4 * std::min<int64_t>(10 * 2, 2 * 5));
  cfg.capacity_factor = 0.2;  // capacity 1
  EXPECT_EQ(AllToAllDispatcher::max_recv_rows(cfg, 10, 2), 2 * 4 * 1);
  cfg.pad_to_capacity = true;
  EXPECT_EQ(AllToAllDispatcher::max_recv_rows(cfg, 10, 2), 2 * 4 * 1);
  cfg.capacity_factor = 4.0;  // capacity 20 > T: padding still gives L * capacity rows per peer
  EXPECT_EQ(AllToAllDispatcher::max_recv_rows(cfg, 10, 2), 2 * 4 * 20);
}

// A group that only reports its size (the constructor must refuse before any collective).
class SizeOnlyGroup final : public Communicator {
 public:
  explicit SizeOnlyGroup(int n) : n_(n) {}
  int rank() const override { return 0; }
  int size() const override { return n_; }
  int world_rank() const override { return 0; }
  const std::string& name() const override { return name_; }
  double timeout_s() const override { return 1; }
  void all_reduce(const Tensor&, ReduceOp) override { std::abort(); }
  void all_gather(const Tensor&, const Tensor&) override { std::abort(); }
  void reduce_scatter(const Tensor&, const Tensor&, ReduceOp) override { std::abort(); }
  void all_to_all_v(const Tensor&, const int64_t*, const Tensor&, const int64_t*) override { std::abort(); }
  void all_to_all(const Tensor&, const Tensor&) override { std::abort(); }
  void broadcast(const Tensor&, int) override { std::abort(); }
  void send(const Tensor&, int, int) override { std::abort(); }
  void recv(const Tensor&, int, int) override { std::abort(); }
  void barrier() override { std::abort(); }
  std::unique_ptr<Communicator> split(int, int, const std::string&) override { std::abort(); }

 private:
  int n_;
  std::string name_ = "ep";
};

TEST(AllToAllDispatcherDeathTest, ExpertsMustSplitEvenlyOverTheGroup) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  MoeConfig cfg{.num_experts = 8, .num_experts_per_tok = 2};
  SizeOnlyGroup three(3), four(4);
  EXPECT_DEATH(AllToAllDispatcher(cfg, 4, 8, three), "moe.num_experts = 8 not divisible by the 3 ranks of group 'ep'");
  AllToAllDispatcher ok(cfg, 4, 8, four);
  EXPECT_EQ(ok.num_local_experts(), 2);
  EXPECT_EQ(ok.max_rows(), 4 * 8 * 2);
}

}  // namespace
}  // namespace moefold

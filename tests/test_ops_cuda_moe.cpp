// GPU parity, MoE ops (ops/moe_ops.h on CUDA tensors): every CUDA op against its CPU op on fresh
// random inputs (tests/cuda_testing.h). Integer results (expert selection, counts, permutation
// plans) must be identical to the CPU op's; values are compared with the CPU op run in f64 on
// exactly the GPU's inputs, with the tolerances below.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cuda_testing.h"
#include "moefold/ops/moe_ops.h"

namespace moefold {
namespace {

using testing::DevicePool;
using testing::Pool;

// Tolerances (Frobenius relative error against the f64 CPU op on the same inputs):
// - kF32: f32 outputs. The router backward, the losses' backward and the combine's dout compute in
//   f64 (or one f32 product) and round once (2^-24 = 6e-8 relative per element); the router's
//   scores take a correctly rounded exp, IEEE f32 add and divide and, for softmax, an f32 sum of E
//   terms (<= ~40 roundings for E = 1024, a common factor of the token's scores); the combine and
//   the permute backward sum K <= 8 f32 terms. All land well under 1e-6.
// - kDot: dprob of the combine is an f32 dot product over H (<= 1024) terms: the rounding error
//   grows like sqrt(H) * 2^-24 relative to the sum of |terms| (~1e-6 here); 1e-5 leaves room for
//   the cancellation of random signs.
// - kBf16: bf16 outputs are one bf16 rounding of an f32 result: 2^-9 relative each, 4e-3 bound.
// - kLoss: the loss forwards sum in f64 on both sides, in different orders: ~1e-15; 1e-12.
constexpr double kF32 = 1e-6;
constexpr double kDot = 1e-5;
constexpr double kBf16 = 4e-3;
constexpr double kLoss = 1e-12;

constexpr int64_t kSentinel = 0x5a5a5a5a5a5a5a5a;  // integer outputs start as this: must be written

// Raw integer contents of an i32 or i64 tensor (host or device).
std::vector<int64_t> ints(const Tensor& t) {
  const auto n = static_cast<size_t>(t.numel());
  std::vector<int64_t> out(n);
  if (t.dtype() == DType::i64) {
    device_copy(out.data(), Device::cpu, t.data(), t.device(), t.nbytes());
  } else {
    MF_CHECK(t.dtype() == DType::i32, t.str());
    std::vector<int32_t> v(n);
    device_copy(v.data(), Device::cpu, t.data(), t.device(), t.nbytes());
    std::copy(v.begin(), v.end(), out.begin());
  }
  return out;
}

// A device i64 tensor with every element set to `v`.
Tensor filled_i64(DevicePool& dev, Shape shape, int64_t v) {
  Tensor d = dev.empty(shape, DType::i64);
  std::vector<int64_t> host(static_cast<size_t>(shape.numel()), v);
  device_copy(d.data(), Device::cuda, host.data(), Device::cpu, host.size() * sizeof(int64_t));
  return d;
}

// A host i64 tensor with every element set to `v`.
Tensor host_filled_i64(Pool& pool, Shape shape, int64_t v) {
  Tensor h = pool.zeros(shape, DType::i64);
  std::fill(h.ptr<int64_t>(), h.ptr<int64_t>() + h.numel(), v);
  return h;
}

// Host f64 tensor of the given values.
Tensor host_f64(Pool& pool, Shape shape, const std::vector<double>& v) {
  Tensor h = pool.zeros(shape, DType::f64);
  MF_CHECK(static_cast<size_t>(h.numel()) == v.size());
  std::copy(v.begin(), v.end(), h.ptr<double>());
  return h;
}

// Exact equality of integer results, reporting the number of differences and the first one.
void expect_same(const std::vector<int64_t>& got, const std::vector<int64_t>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t diffs = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i] && diffs++ == 0) first = i;
  EXPECT_EQ(diffs, 0u) << what << ": " << diffs << " of " << got.size() << " differ; first at " << first << ": GPU "
                       << got[first] << ", CPU " << want[first];
}

std::string seed_trace() { return "MOEFOLD_TEST_SEED=" + std::to_string(testing::fresh_seed()); }

// topk_idx [T, K] (i32, host) with K distinct experts per token among the first `used`, drawn with
// weights 1 / (1 + skew * e) (skew 0: uniform). hot: every token's first choice is expert 0.
Tensor random_topk(Pool& pool, std::mt19937_64& rng, int64_t t_n, int64_t k_n, int64_t used, double skew, bool hot) {
  std::vector<double> w(static_cast<size_t>(used));
  for (int64_t e = 0; e < used; ++e) w[static_cast<size_t>(e)] = 1.0 / (1.0 + skew * static_cast<double>(e));
  std::discrete_distribution<int32_t> pick(w.begin(), w.end());
  Tensor idx = pool.zeros({t_n, k_n}, DType::i32);
  int32_t* p = idx.ptr<int32_t>();
  for (int64_t t = 0; t < t_n; ++t) {
    for (int64_t k = 0; k < k_n; ++k) {
      int32_t e;
      bool again;
      do {
        e = hot && k == 0 ? 0 : pick(rng);
        again = std::find(p + t * k_n, p + t * k_n + k, e) != p + t * k_n + k;
      } while (again);
      p[t * k_n + k] = e;
    }
  }
  return idx;
}

// ---- router scores and top-k -------------------------------------------------------------------

enum class Ties { none, pairs, same_groups };

struct RouteCase {
  const char* name;
  int64_t t_n, e_n, k_n;
  ScoreFunc score_func;
  bool norm;
  double scaling;
  int64_t n_group, topk_group;
  bool bias;
  Ties ties;
};

// Qwen3-MoE, DeepSeek-V3, Mixtral and OLMoE shapes, odd and degenerate group sizes, every
// experts-per-lane width of the kernel (E up to 1024), and inputs built with exact ties.
const RouteCase kRouteCases[] = {
    {"qwen3", 1031, 128, 8, ScoreFunc::softmax, true, 1.0, 1, 1, false, Ties::none},
    {"deepseek_v3", 1031, 256, 8, ScoreFunc::sigmoid, true, 2.5, 8, 4, true, Ties::none},
    {"mixtral", 517, 8, 2, ScoreFunc::softmax, true, 1.0, 1, 1, false, Ties::none},
    {"olmoe_no_norm", 517, 64, 8, ScoreFunc::softmax, false, 1.0, 1, 1, false, Ties::none},
    {"softmax_bias_groups", 300, 96, 6, ScoreFunc::softmax, false, 1.5, 12, 3, true, Ties::none},
    {"groups_of_two", 300, 72, 7, ScoreFunc::sigmoid, true, 1.0, 36, 5, true, Ties::none},
    {"groups_of_one", 300, 40, 9, ScoreFunc::sigmoid, false, 0.5, 40, 9, false, Ties::none},
    {"e300_groups", 300, 300, 3, ScoreFunc::sigmoid, true, 1.0, 4, 2, true, Ties::none},
    {"e1000_k32", 129, 1000, 32, ScoreFunc::softmax, true, 1.0, 1, 1, false, Ties::none},
    {"e33_k1", 257, 33, 1, ScoreFunc::sigmoid, false, 1.0, 1, 1, true, Ties::none},
    {"ties_pairs_softmax", 300, 128, 5, ScoreFunc::softmax, true, 1.0, 1, 1, false, Ties::pairs},
    {"ties_pairs_bias", 300, 64, 7, ScoreFunc::sigmoid, true, 1.0, 4, 3, true, Ties::pairs},
    {"ties_same_groups", 300, 256, 8, ScoreFunc::sigmoid, true, 2.5, 8, 4, true, Ties::same_groups},
};

TopkRouting routing_of(const RouteCase& c) {
  TopkRouting r;
  r.score_func = c.score_func;
  r.norm_topk_prob = c.norm;
  r.scaling = c.scaling;
  r.n_group = c.n_group;
  r.topk_group = c.topk_group;
  return r;
}

TEST(CudaRouterTopk, SelectionMatchesCpuF32AndValuesMatchF64) {
  MF_REQUIRE_GPU();
  for (const RouteCase& c : kRouteCases) {
    SCOPED_TRACE(std::string(c.name) + " " + seed_trace());
    Pool pool;
    DevicePool dev;
    const int64_t t_n = c.t_n, e_n = c.e_n, k_n = c.k_n, g_size = e_n / c.n_group;
    Tensor logits = pool.randn({t_n, e_n}, DType::f32, 1.5);
    Tensor bias = pool.randn({e_n}, DType::f32, 0.05);
    float* l = logits.ptr<float>();
    float* b = bias.ptr<float>();
    for (int64_t t = 0; t < t_n; ++t) {
      for (int64_t e = 0; e < e_n; ++e) {
        if (c.ties == Ties::pairs && e % 2 == 1) l[t * e_n + e] = l[t * e_n + e - 1];
        if (c.ties == Ties::same_groups) l[t * e_n + e] = l[t * e_n + e % g_size];
      }
    }
    for (int64_t e = 0; e < e_n; ++e) {
      if (c.ties == Ties::pairs && e % 2 == 1) b[e] = b[e - 1];
      if (c.ties == Ties::same_groups) b[e] = b[e % g_size];
    }

    // GPU.
    TopkRouting rd = routing_of(c);
    if (c.bias) rd.bias_E = dev.upload(bias, DType::f32);
    Tensor logits_d = dev.upload(logits, DType::f32);
    Tensor scores_d = dev.poisoned({t_n, e_n}, DType::f32), prob_d = dev.poisoned({t_n, k_n}, DType::f32);
    Tensor idx_d = dev.poisoned({t_n, k_n}, DType::i32);
    router_topk_forward(testing::exec(), logits_d, rd, scores_d, idx_d, prob_d);

    // CPU in f32: the selection must be the same.
    TopkRouting rh = routing_of(c);
    if (c.bias) rh.bias_E = bias;
    Tensor scores32 = pool.zeros({t_n, e_n}, DType::f32), prob32 = pool.zeros({t_n, k_n}, DType::f32);
    Tensor idx32 = pool.zeros({t_n, k_n}, DType::i32);
    router_topk_forward(testing::exec(), logits, rh, scores32, idx32, prob32);
    const std::vector<int64_t> idx = ints(idx_d);
    expect_same(idx, ints(idx32), "topk_idx");

    // CPU in f64 on the same inputs: the scores, and the probabilities of the selected experts.
    Tensor scores64 = pool.zeros({t_n, e_n}, DType::f64), prob64 = pool.zeros({t_n, k_n}, DType::f64);
    Tensor idx64 = pool.zeros({t_n, k_n}, DType::i32);
    router_topk_forward(testing::exec(), testing::rounded(pool, logits, DType::f32), rh, scores64, idx64, prob64);
    EXPECT_LE(testing::rel_error(testing::download(scores_d), scores64), kF32) << "scores";
    std::vector<double> want(static_cast<size_t>(t_n * k_n));
    const double* s64 = scores64.ptr<double>();
    for (int64_t t = 0; t < t_n; ++t) {
      double sum = 0;
      for (int64_t k = 0; k < k_n; ++k) sum += s64[t * e_n + idx[static_cast<size_t>(t * k_n + k)]];
      for (int64_t k = 0; k < k_n; ++k) {
        const double s = s64[t * e_n + idx[static_cast<size_t>(t * k_n + k)]];
        want[static_cast<size_t>(t * k_n + k)] = (c.norm ? s / sum : s) * c.scaling;
      }
    }
    EXPECT_LE(testing::rel_error(testing::download(prob_d), host_f64(pool, {t_n, k_n}, want)), kF32) << "topk_prob";

    // Backward through the GPU's own forward (its scores and selection), against f64.
    Tensor dprob = pool.randn({t_n, k_n}, DType::f32);
    Tensor dlogits_d = dev.poisoned({t_n, e_n}, DType::f32);
    router_topk_backward(testing::exec(), scores_d, idx_d, rd, dev.upload(dprob, DType::f32), dlogits_d);
    Tensor dlogits64 = pool.zeros({t_n, e_n}, DType::f64);
    router_topk_backward(testing::exec(), host_f64(pool, {t_n, e_n}, testing::download(scores_d)), idx32, rh,
                         testing::rounded(pool, dprob, DType::f32), dlogits64);
    EXPECT_LE(testing::rel_error(testing::download(dlogits_d), dlogits64), kF32) << "dlogits";
  }
}

// The tie rules on their own: with every logit equal, the first K experts of the first groups win.
TEST(CudaRouterTopk, AllEqualLogitsPickTheLowestIndices) {
  MF_REQUIRE_GPU();
  Pool pool;
  DevicePool dev;
  const int64_t t_n = 33, e_n = 256, k_n = 8;
  Tensor logits = pool.zeros({t_n, e_n}, DType::f32);
  for (ScoreFunc f : {ScoreFunc::softmax, ScoreFunc::sigmoid}) {
    for (int64_t n_group : {1, 8}) {
      TopkRouting r;
      r.score_func = f;
      r.n_group = n_group;
      r.topk_group = n_group == 1 ? 1 : 4;
      Tensor idx_d = dev.poisoned({t_n, k_n}, DType::i32);
      router_topk_forward(testing::exec(), dev.upload(logits, DType::f32), r, dev.poisoned({t_n, e_n}, DType::f32),
                          idx_d, dev.poisoned({t_n, k_n}, DType::f32));
      const std::vector<int64_t> idx = ints(idx_d);
      for (int64_t i = 0; i < t_n * k_n; ++i) ASSERT_EQ(idx[static_cast<size_t>(i)], i % k_n) << i;
    }
  }
}

// ---- expert counts -----------------------------------------------------------------------------

TEST(CudaExpertCounts, TopkAndSequenceCountsMatchCpuExactly) {
  MF_REQUIRE_GPU();
  SCOPED_TRACE(seed_trace());
  // E 20000 takes the global-atomics path (no shared-memory histogram); the last experts of every
  // case are never chosen (zero-token experts must be written as 0).
  for (int64_t e_n : {int64_t{8}, int64_t{256}, int64_t{20000}}) {
    SCOPED_TRACE("E " + std::to_string(e_n));
    Pool pool;
    DevicePool dev;
    const int64_t t_n = 40001, k_n = 8;
    Tensor idx = pool.ints({t_n, k_n}, 0, static_cast<int32_t>(e_n - 3));
    Tensor idx_d = dev.upload(idx, DType::i32);
    Tensor counts_d = filled_i64(dev, {e_n}, kSentinel), counts = pool.zeros({e_n}, DType::i64);
    topk_expert_counts(testing::exec(), idx_d, counts_d);
    topk_expert_counts(testing::exec(), idx, counts);
    expect_same(ints(counts_d), ints(counts), "counts_E");

    // Rows 100.. of sequences of 333 local rows: sequences 0..120 hold rows, sequence 121 none.
    const SeqLayout layout{333, 100, 666};
    const int64_t b_n = (layout.row_offset + t_n - 1) / layout.local_seq_len + 2;
    Tensor seq_d = filled_i64(dev, {b_n, e_n}, kSentinel), seq = pool.zeros({b_n, e_n}, DType::i64);
    seq_expert_counts(testing::exec(), idx_d, layout, seq_d);
    seq_expert_counts(testing::exec(), idx, layout, seq);
    expect_same(ints(seq_d), ints(seq), "counts_BE");
  }
}

// ---- load-balancing and z losses ---------------------------------------------------------------

TEST(CudaLosses, AuxSeqAuxAndZLossMatchCpu) {
  MF_REQUIRE_GPU();
  SCOPED_TRACE(seed_trace());
  for (ScoreFunc f : {ScoreFunc::softmax, ScoreFunc::sigmoid}) {
    for (int64_t e_n : {int64_t{60}, int64_t{256}}) {
      SCOPED_TRACE(std::string(f == ScoreFunc::softmax ? "softmax" : "sigmoid") + " E " + std::to_string(e_n));
      Pool pool;
      DevicePool dev;
      const int64_t t_n = 1003, k_n = 6;
      // Scores and selections of a real router (CPU, f32); the GPU gets exactly these values.
      Tensor logits = pool.randn({t_n, e_n}, DType::f32, 2.0);
      TopkRouting r;
      r.score_func = f;
      Tensor scores = pool.zeros({t_n, e_n}, DType::f32), idx = pool.zeros({t_n, k_n}, DType::i32);
      router_topk_forward(testing::exec(), logits, r, scores, idx, pool.zeros({t_n, k_n}, DType::f32));
      Tensor counts = pool.zeros({e_n}, DType::i64);
      topk_expert_counts(testing::exec(), idx, counts);
      Tensor scores_d = dev.upload(scores, DType::f32), counts_d = dev.upload(counts, DType::i64);
      Tensor scores64 = testing::rounded(pool, scores, DType::f32);

      // Written to the device (no wait, loss_1) or returned: the same bits.
      Tensor loss_d = dev.poisoned({1}, DType::f64);
      auto on_device = [&] { return testing::download(loss_d)[0]; };
      for (int64_t total : {int64_t{0}, 3 * t_n}) {
        const double want = aux_loss_forward(testing::exec(), scores64, f, counts, k_n, total);
        const double got = aux_loss_forward(testing::exec(), scores_d, f, counts_d, k_n, total);
        EXPECT_NEAR(got, want, kLoss * std::abs(want)) << total;
        EXPECT_TRUE(std::isnan(aux_loss_forward(testing::exec(), scores_d, f, counts_d, k_n, total, loss_d)));
        EXPECT_EQ(on_device(), got) << "aux written to the device, total " << total;
        Tensor dl_d = dev.poisoned({t_n, e_n}, DType::f32), dl = pool.zeros({t_n, e_n}, DType::f64);
        aux_loss_backward(testing::exec(), scores_d, f, counts_d, k_n, 0.37, dl_d, total);
        aux_loss_backward(testing::exec(), scores64, f, counts, k_n, 0.37, dl, total);
        EXPECT_LE(testing::rel_error(testing::download(dl_d), dl), kF32) << "aux dlogits, total " << total;
      }

      // Sequence aux loss: rows 50.. of sequences of 128 local rows (of 256), 9 sequences.
      const SeqLayout layout{128, 50, 256};
      const int64_t b_n = (layout.row_offset + t_n - 1) / layout.local_seq_len + 1;
      Tensor seq_counts = pool.zeros({b_n, e_n}, DType::i64);
      seq_expert_counts(testing::exec(), idx, layout, seq_counts);
      Tensor seq_counts_d = dev.upload(seq_counts, DType::i64);
      const double want = seq_aux_loss_forward(testing::exec(), scores64, f, seq_counts, k_n, layout);
      const double got = seq_aux_loss_forward(testing::exec(), scores_d, f, seq_counts_d, k_n, layout);
      EXPECT_NEAR(got, want, kLoss * std::abs(want));
      seq_aux_loss_forward(testing::exec(), scores_d, f, seq_counts_d, k_n, layout, loss_d);
      EXPECT_EQ(on_device(), got) << "seq aux written to the device";
      Tensor dl_d = dev.poisoned({t_n, e_n}, DType::f32), dl = pool.zeros({t_n, e_n}, DType::f64);
      seq_aux_loss_backward(testing::exec(), scores_d, f, seq_counts_d, k_n, layout, 1.7, dl_d);
      seq_aux_loss_backward(testing::exec(), scores64, f, seq_counts, k_n, layout, 1.7, dl);
      EXPECT_LE(testing::rel_error(testing::download(dl_d), dl), kF32) << "seq aux dlogits";

      // z-loss on the logits.
      Tensor logits_d = dev.upload(logits, DType::f32), logits64 = testing::rounded(pool, logits, DType::f32);
      for (int64_t total : {int64_t{0}, 2 * t_n + 1}) {
        const double z = z_loss_forward(testing::exec(), logits64, total);
        const double got_z = z_loss_forward(testing::exec(), logits_d, total);
        EXPECT_NEAR(got_z, z, kLoss * z) << total;
        z_loss_forward(testing::exec(), logits_d, total, loss_d);
        EXPECT_EQ(on_device(), got_z) << "z written to the device, total " << total;
        Tensor dz_d = dev.poisoned({t_n, e_n}, DType::f32), dz = pool.zeros({t_n, e_n}, DType::f64);
        z_loss_backward(testing::exec(), logits_d, 0.01, dz_d, total);
        z_loss_backward(testing::exec(), logits64, 0.01, dz, total);
        EXPECT_LE(testing::rel_error(testing::download(dz_d), dz), kF32) << "z dlogits, total " << total;
      }
    }
  }
}

TEST(CudaExpertBias, UpdateMatchesCpuBitForBit) {
  MF_REQUIRE_GPU();
  SCOPED_TRACE(seed_trace());
  Pool pool;
  DevicePool dev;
  // Loads 0, 2, 4 on 20 experts each: the mean is exactly 2, so a third of the experts get sign 0.
  const int64_t e_n = 60;
  Tensor counts = pool.zeros({e_n}, DType::i64);
  for (int64_t e = 0; e < e_n; ++e) counts.ptr<int64_t>()[e] = 2 * (e % 3);
  // 1500 experts with random loads: the block loops over experts and sums the loads.
  const int64_t e_big = 1500;
  Tensor counts_big = pool.zeros({e_big}, DType::i64);
  std::mt19937_64 rng(testing::fresh_seed());
  for (int64_t e = 0; e < e_big; ++e) counts_big.ptr<int64_t>()[e] = static_cast<int64_t>(rng() % 1000);
  for (DType dt : {DType::f32, DType::f64}) {
    for (const Tensor* c : {&counts, &counts_big}) {
      const int64_t n = c->numel();
      Tensor bias = pool.randn({n}, dt, 0.01);
      Tensor bias_d = dev.empty({n}, dt);
      bias_d.copy_from(bias);
      expert_bias_update(testing::exec(), bias_d, dev.upload(*c, DType::i64), 1e-3);
      expert_bias_update(testing::exec(), bias, *c, 1e-3);
      Tensor got = pool.zeros({n}, dt);
      got.copy_from(bias_d);
      EXPECT_EQ(std::memcmp(got.data(), bias.data(), bias.nbytes()), 0) << dtype_name(dt) << " E " << n;
    }
  }
}

TEST(CudaStepStats, MatchCpuBitForBit) {
  MF_REQUIRE_GPU();
  SCOPED_TRACE(seed_trace());
  Pool pool;
  DevicePool dev;
  std::mt19937_64 rng(testing::fresh_seed());
  for (const int64_t e_n : {8, 256, 1500}) {
    for (const int64_t capacity : {0, 40, 130}) {
      SCOPED_TRACE(::testing::Message() << "E " << e_n << " capacity " << capacity);
      Tensor counts = pool.zeros({e_n}, DType::i64);
      int64_t* c = counts.ptr<int64_t>();
      for (int64_t e = 0; e < e_n; ++e) c[e] = static_cast<int64_t>(rng() % 97) * (e % 5 == 0 ? 9 : 1);
      Tensor losses = pool.randn({3}, DType::f64, 1.0), sums = pool.randn({2}, DType::f64, 1.0);
      Tensor load = pool.randn({e_n}, DType::f64, 100.0), dropped = pool.randn({1}, DType::f64, 10.0);
      Tensor sums_d = dev.upload(sums, DType::f64), load_d = dev.upload(load, DType::f64),
             dropped_d = dev.upload(dropped, DType::f64);
      const Tensor losses_d = dev.upload(losses, DType::f64), counts_d = dev.upload(counts, DType::i64);
      for (int rep = 0; rep < 2; ++rep) {  // twice: it adds
        moe_step_stats(testing::exec(), losses_d, 0.01, 3e-4, 1e-3, counts_d, capacity, sums_d, load_d, dropped_d);
        moe_step_stats(testing::exec(), losses, 0.01, 3e-4, 1e-3, counts, capacity, sums, load, dropped);
      }
      const Tensor* pairs[3][2] = {{&sums, &sums_d}, {&load, &load_d}, {&dropped, &dropped_d}};
      for (const auto& pr : pairs) {
        Tensor got = pool.zeros(pr[0]->shape(), DType::f64);
        got.copy_from(*pr[1]);
        EXPECT_EQ(std::memcmp(got.data(), pr[0]->data(), pr[0]->nbytes()), 0) << pr[0]->str();
      }
    }
  }
}

// ---- permutation plan --------------------------------------------------------------------------

struct PlanCase {
  const char* name;
  int64_t t_n, e_n, k_n;
  int64_t used;            // tokens choose among experts [0, used): the others get zero tokens
  double skew;             // routing weights 1 / (1 + skew * e)
  double capacity_factor;  // 0: dropless; else capacity = ceil(factor * T*K / E)
  bool pad;
  bool tied_probs;           // probabilities from {0.25, 0.5, 0.75, 1}: many exact ties at the capacity cut
  bool hot;                  // every token's first choice is expert 0 (a segment spanning many tiles)
  int drops;                 // whether the case drops assignments: 1 surely, 0 never, -1 by chance
  bool empty_slots = false;  // about a third of the slots -1 (HierarchicalDispatcher's relayed rows)
};

const PlanCase kPlanCases[] = {
    {"dropless", 3001, 128, 8, 128, 0.05, 0, false, false, false, 0},
    {"dropless_zero_token_experts", 2000, 64, 6, 40, 0.1, 0, false, false, false, 0},
    {"dropless_hot_expert", 2500, 32, 4, 32, 0.0, 0, false, false, true, 0},
    {"capacity_drops", 3001, 128, 8, 128, 0.05, 0.6, false, false, false, 1},
    {"capacity_pad", 3001, 128, 8, 128, 0.05, 1.3, true, false, false, 1},
    {"capacity_pad_zero_token_experts", 1500, 64, 4, 48, 0.2, 1.0, true, false, false, 1},
    {"capacity_tied_probs", 2000, 16, 4, 16, 0.3, 0.7, false, true, false, 1},
    {"capacity_pad_tied_hot", 2500, 32, 4, 32, 0.0, 0.9, true, true, true, 1},
    {"tiny", 5, 4, 2, 4, 0.0, 0, false, false, false, 0},
    {"tiny_pad", 5, 4, 2, 4, 0.0, 1.0, true, false, false, -1},
    {"no_tokens_pad", 0, 8, 2, 8, 0.0, 1.0, true, false, false, 0},
    {"dropless_empty_slots", 3001, 64, 6, 64, 0.05, 0, false, false, false, 0, true},
    {"capacity_empty_slots", 3001, 64, 6, 64, 0.05, 0.5, false, true, false, 1, true},
};

// About a third of the slots of `idx` emptied (-1), whole tokens among them.
void empty_some_slots(Tensor& idx, std::mt19937_64& rng) {
  int32_t* p = idx.ptr<int32_t>();
  for (int64_t i = 0; i < idx.numel(); ++i)
    if (rng() % 3 == 0) p[i] = -1;
  if (idx.size(0) > 2)
    for (int64_t k = 0; k < idx.size(1); ++k) p[idx.size(1) + k] = -1;  // token 1: no expert at all
}

// The CPU plan of a case (host tensors), for the permute and combine tests.
struct HostPlan {
  Tensor topk_idx, topk_prob, counts, offsets, row, token;
  int64_t num_rows = 0;
};

TEST(CudaPermutePlan, MatchesCpuBitForBit) {
  MF_REQUIRE_GPU();
  std::mt19937_64 rng(testing::fresh_seed());
  for (const PlanCase& c : kPlanCases) {
    SCOPED_TRACE(std::string(c.name) + " " + seed_trace());
    Pool pool;
    DevicePool dev;
    const int64_t t_n = c.t_n, e_n = c.e_n, k_n = c.k_n;
    Tensor idx = random_topk(pool, rng, t_n, k_n, c.used, c.skew, c.hot);
    if (c.empty_slots) empty_some_slots(idx, rng);
    Tensor prob = pool.uniform({t_n, k_n}, 0.0, 1.0, DType::f32);
    if (c.tied_probs)
      for (int64_t i = 0; i < t_n * k_n; ++i) prob.ptr<float>()[i] = static_cast<float>(1 + rng() % 4) / 4.0f;
    const int64_t capacity =
        c.capacity_factor > 0
            ? std::max<int64_t>(1, static_cast<int64_t>(std::ceil(c.capacity_factor * static_cast<double>(t_n * k_n) /
                                                                  static_cast<double>(e_n))))
            : 0;
    const int64_t max_rows = std::max(t_n * k_n, e_n * capacity) + 5;  // 5 guard entries at least

    PermutePlanOut gpu{filled_i64(dev, {e_n}, kSentinel), filled_i64(dev, {e_n + 1}, kSentinel),
                       filled_i64(dev, {t_n, k_n}, kSentinel), filled_i64(dev, {max_rows}, kSentinel)};
    const int64_t r_gpu = moe_permute_plan(testing::exec(), dev.upload(idx, DType::i32), dev.upload(prob, DType::f32),
                                           capacity, c.pad, gpu);
    PermutePlanOut cpu{host_filled_i64(pool, {e_n}, kSentinel), host_filled_i64(pool, {e_n + 1}, kSentinel),
                       host_filled_i64(pool, {t_n, k_n}, kSentinel), host_filled_i64(pool, {max_rows}, kSentinel)};
    const int64_t r_cpu = moe_permute_plan(testing::exec(), idx, prob, capacity, c.pad, cpu);

    EXPECT_EQ(r_gpu, r_cpu);
    expect_same(ints(gpu.counts_E), ints(cpu.counts_E), "counts_E");
    expect_same(ints(gpu.offsets_E1), ints(cpu.offsets_E1), "offsets_E1");
    expect_same(ints(gpu.row_TK), ints(cpu.row_TK), "row_TK");
    // The whole of token_R: [0, R) must match, and the entries past R must stay untouched.
    expect_same(ints(gpu.token_R), ints(cpu.token_R), "token_R");
    if (!c.empty_slots) {  // without waiting (the capacity without padding: the last expert padded to the bound)
      PermutePlanOut nw{filled_i64(dev, {e_n}, kSentinel), filled_i64(dev, {e_n + 1}, kSentinel),
                        filled_i64(dev, {t_n, k_n}, kSentinel), filled_i64(dev, {max_rows}, kSentinel)};
      const int64_t r_nw = moe_permute_plan(testing::exec(), dev.upload(idx, DType::i32), dev.upload(prob, DType::f32),
                                            capacity, c.pad, nw, false);
      PermutePlanOut cnw{host_filled_i64(pool, {e_n}, kSentinel), host_filled_i64(pool, {e_n + 1}, kSentinel),
                         host_filled_i64(pool, {t_n, k_n}, kSentinel), host_filled_i64(pool, {max_rows}, kSentinel)};
      EXPECT_EQ(r_nw, moe_permute_plan(testing::exec(), idx, prob, capacity, c.pad, cnw, false)) << "without waiting";
      EXPECT_EQ(r_nw, c.pad || capacity <= 0 ? r_cpu : std::min(t_n * k_n, e_n * capacity)) << "without waiting";
      expect_same(ints(nw.counts_E), ints(cnw.counts_E), "counts_E without waiting");
      expect_same(ints(nw.offsets_E1), ints(cnw.offsets_E1), "offsets_E1 without waiting");
      expect_same(ints(nw.row_TK), ints(cpu.row_TK), "row_TK without waiting");
      expect_same(ints(nw.token_R), ints(cnw.token_R), "token_R without waiting");
    }
    // The case does what it says (so that the comparison covers drops and padding).
    const std::vector<int64_t> row = ints(cpu.row_TK), token = ints(cpu.token_R);
    int64_t empty = 0;
    for (int64_t i = 0; i < t_n * k_n; ++i) {
      if (idx.ptr<int32_t>()[i] >= 0) continue;
      ++empty;
      EXPECT_EQ(row[static_cast<size_t>(i)], -1) << "empty slot " << i;
    }
    EXPECT_EQ(empty > 0, c.empty_slots);
    bool dropped = false;
    for (int64_t i = 0; i < t_n * k_n; ++i) dropped = dropped || (idx.ptr<int32_t>()[i] >= 0 && row[i] < 0);
    const bool padded = std::find(token.begin(), token.begin() + r_cpu, -1) != token.begin() + r_cpu;
    if (c.drops >= 0) {
      EXPECT_EQ(dropped, c.drops == 1) << "drops";
    }
    EXPECT_EQ(padded, c.pad) << "padding";
  }
}

// Wrong plans fail with the CPU op's messages (the GPU plan reads its flags after its one wait).
TEST(CudaPermutePlanDeathTest, BadTopkAndShortTokenBufferFailLikeTheCpu) {
  MF_REQUIRE_GPU();
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // the child starts its own CUDA context
  Pool pool;
  DevicePool dev;
  const int64_t t_n = 6, k_n = 3, e_n = 8;
  Tensor idx = pool.zeros({t_n, k_n}, DType::i32);
  for (int64_t i = 0; i < t_n * k_n; ++i) idx.ptr<int32_t>()[i] = static_cast<int32_t>(i % e_n);
  Tensor prob = pool.uniform({t_n, k_n}, 0.0, 1.0, DType::f32);
  auto plan = [&](const Tensor& topk, int64_t max_rows) {
    PermutePlanOut out{dev.empty({e_n}, DType::i64), dev.empty({e_n + 1}, DType::i64),
                       dev.empty({t_n, k_n}, DType::i64), dev.empty({max_rows}, DType::i64)};
    return moe_permute_plan(testing::exec(), dev.upload(topk, DType::i32), dev.upload(prob, DType::f32), 0, false, out);
  };
  EXPECT_EQ(plan(idx, t_n * k_n), t_n * k_n);
  Tensor dup = pool.clone(idx);
  dup.ptr<int32_t>()[3 * k_n + 2] = dup.ptr<int32_t>()[3 * k_n];
  EXPECT_DEATH(plan(dup, t_n * k_n), "token 3 routed twice to expert");
  Tensor bad = pool.clone(idx);
  bad.ptr<int32_t>()[7] = static_cast<int32_t>(e_n + 1);
  EXPECT_DEATH(plan(bad, t_n * k_n), "expert index 9 out of \\[0, 8\\)");
  EXPECT_DEATH(plan(idx, t_n * k_n - 1), "permute plan needs more than 17 rows");
}

// ---- node routing (HierarchicalDispatcher) -------------------------------------------------------

// Bytes of a float tensor (host or device), for bit-for-bit comparisons.
std::vector<uint8_t> bytes_of(const Tensor& t) {
  std::vector<uint8_t> out(static_cast<size_t>(t.nbytes()));
  device_copy(out.data(), Device::cpu, t.data(), t.device(), t.nbytes());
  return out;
}

// Node routing, its plan, the travelling experts and probabilities, and the probabilities'
// gradient: the GPU's equal the CPU's bit for bit, with and without a capacity's drops.
TEST(CudaNodeRoute, MatchesCpuBitForBit) {
  MF_REQUIRE_GPU();
  std::mt19937_64 rng(testing::fresh_seed());
  struct Case {
    int64_t t_n, e_n, k_n, nodes;
    double capacity_factor;
  };
  for (const Case c : {Case{3001, 64, 8, 4, 0}, Case{2000, 256, 8, 8, 0}, Case{1500, 32, 6, 2, 0.6},
                       Case{700, 16, 4, 16, 0}, Case{5, 8, 2, 2, 0.5}, Case{0, 8, 2, 2, 0}}) {
    SCOPED_TRACE("T " + std::to_string(c.t_n) + " E " + std::to_string(c.e_n) + " nodes " + std::to_string(c.nodes) +
                 " " + seed_trace());
    Pool pool;
    DevicePool dev;
    const int64_t t_n = c.t_n, k_n = c.k_n, per_node = c.e_n / c.nodes, s_n = std::min(k_n, per_node);
    Tensor idx = random_topk(pool, rng, t_n, k_n, c.e_n, 0.02, false);
    Tensor prob = pool.uniform({t_n, k_n}, 0.0, 1.0, DType::f32);
    Tensor keep;
    if (c.capacity_factor > 0) {
      const auto cap = static_cast<int64_t>(
          std::ceil(c.capacity_factor * static_cast<double>(t_n * k_n) / static_cast<double>(c.e_n)));
      keep = pool.zeros({t_n, k_n}, DType::i64);
      moe_permute_plan(testing::exec(), idx, prob, cap, false,
                       {pool.zeros({c.e_n}, DType::i64), pool.zeros({c.e_n + 1}, DType::i64), keep,
                        pool.zeros({t_n * k_n}, DType::i64)});
    }
    const int64_t r_max = t_n * std::min(k_n, c.nodes) + 3;
    struct Side {
      Tensor idx, prob, keep, node, slot, counts, offsets, row, token, meta_idx, meta_prob, assign, dmeta, dprob;
      int64_t rows = 0;
    };
    auto run = [&](Side& d) {
      moe_node_route(testing::exec(), d.idx, d.keep, per_node, d.node, d.slot);
      d.rows = moe_permute_plan(testing::exec(), d.node, d.prob, 0, false, {d.counts, d.offsets, d.row, d.token});
      moe_node_meta(testing::exec(), d.idx, d.prob, d.node, d.slot, d.row, per_node, d.meta_idx.slice(0, d.rows),
                    d.meta_prob.slice(0, d.rows), d.assign);
      moe_node_meta_backward(testing::exec(), d.dmeta.slice(0, d.rows), d.assign, d.dprob);
    };
    Tensor dmeta = pool.uniform({r_max, s_n}, -1.0, 1.0, DType::f32);
    Side h{idx,
           prob,
           keep,
           pool.zeros({t_n, k_n}, DType::i32),
           pool.zeros({t_n, k_n}, DType::i32),
           host_filled_i64(pool, {c.nodes}, kSentinel),
           host_filled_i64(pool, {c.nodes + 1}, kSentinel),
           host_filled_i64(pool, {t_n, k_n}, kSentinel),
           host_filled_i64(pool, {r_max}, kSentinel),
           pool.zeros({r_max, s_n}, DType::i32),
           pool.zeros({r_max, s_n}, DType::f32),
           host_filled_i64(pool, {t_n, k_n}, kSentinel),
           dmeta,
           pool.zeros({t_n, k_n}, DType::f32)};
    Side g{dev.upload(idx, DType::i32),
           dev.upload(prob, DType::f32),
           keep.defined() ? dev.upload(keep, DType::i64) : Tensor(),
           dev.poisoned({t_n, k_n}, DType::i32),
           dev.poisoned({t_n, k_n}, DType::i32),
           filled_i64(dev, {c.nodes}, kSentinel),
           filled_i64(dev, {c.nodes + 1}, kSentinel),
           filled_i64(dev, {t_n, k_n}, kSentinel),
           filled_i64(dev, {r_max}, kSentinel),
           dev.poisoned({r_max, s_n}, DType::i32),
           dev.poisoned({r_max, s_n}, DType::f32),
           filled_i64(dev, {t_n, k_n}, kSentinel),
           dev.upload(dmeta, DType::f32),
           dev.poisoned({t_n, k_n}, DType::f32)};
    run(h);
    run(g);
    ASSERT_EQ(g.rows, h.rows);
    for (const auto& [what, a, b] : {std::tuple{"node_idx", g.node, h.node}, std::tuple{"slot", g.slot, h.slot},
                                     std::tuple{"counts", g.counts, h.counts}, std::tuple{"row", g.row, h.row},
                                     std::tuple{"token", g.token.slice(0, h.rows), h.token.slice(0, h.rows)},
                                     std::tuple{"meta_idx", g.meta_idx.slice(0, h.rows), h.meta_idx.slice(0, h.rows)},
                                     std::tuple{"assign", g.assign, h.assign}})
      expect_same(ints(a), ints(b), what);
    EXPECT_EQ(bytes_of(g.meta_prob.slice(0, h.rows)), bytes_of(h.meta_prob.slice(0, h.rows))) << "meta_prob";
    EXPECT_EQ(bytes_of(g.dprob), bytes_of(h.dprob)) << "dprob";
    // Every kept assignment travels in exactly one slot; the case drops what it says.
    int64_t kept = 0, placed = 0;
    const std::vector<int64_t> assign = ints(h.assign), meta = ints(h.meta_idx.slice(0, h.rows));
    for (const int64_t a : assign) kept += a >= 0;
    for (const int64_t m : meta) placed += m >= 0;
    EXPECT_EQ(kept, placed);
    EXPECT_EQ(kept<t_n * k_n, c.capacity_factor> 0 && t_n > 0);
  }
}

// ---- expert-parallel slots (SlotDispatcher) ------------------------------------------------------

// The slot plans of both sides: the GPU's equal the CPU's integer for integer, with slots that
// hold everything, slots that overflow, and experts' rows that overflow; padded plans too. The
// overflow and the fill (both sides max-ed into one) bit for bit.
TEST(CudaEpSlots, SendAndReceivePlansMatchCpu) {
  MF_REQUIRE_GPU();
  std::mt19937_64 rng(testing::fresh_seed());
  struct Case {
    int64_t t_n, e_n, k_n, peers, slot_rows, rows, capacity;
  };
  for (const Case c : {Case{4096, 256, 8, 8, 4096, 32768, 0}, Case{4096, 256, 8, 8, 3000, 30000, 0},
                       Case{3001, 64, 6, 4, 2000, 4000, 0}, Case{1500, 16, 2, 2, 1200, 3000, 200},
                       Case{5, 8, 2, 8, 1, 3, 0}, Case{0, 8, 2, 2, 4, 8, 0}, Case{100, 1024, 8, 1, 800, 800, 0}}) {
    SCOPED_TRACE("T " + std::to_string(c.t_n) + " E " + std::to_string(c.e_n) + " P " + std::to_string(c.peers) +
                 " B " + std::to_string(c.slot_rows) + " R " + std::to_string(c.rows) + " " + seed_trace());
    Pool pool;
    DevicePool dev;
    const int64_t t_n = c.t_n, k_n = c.k_n, p_n = c.peers, l_n = c.e_n / p_n, x_n = p_n * c.slot_rows;
    const int64_t s_max = c.capacity > 0 ? c.e_n * c.capacity : t_n * k_n;
    Tensor idx = random_topk(pool, rng, t_n, k_n, c.e_n, 0.02, false);
    Tensor prob = pool.uniform({t_n, k_n}, 0.0, 1.0, DType::f32);
    Tensor offsets = pool.zeros({c.e_n + 1}, DType::i64), row = pool.zeros({t_n, k_n}, DType::i64);
    Tensor token = pool.zeros({s_max}, DType::i64);
    moe_permute_plan(testing::exec(), idx, prob, c.capacity, c.capacity > 0,
                     {pool.zeros({c.e_n}, DType::i64), offsets, row, token});
    // A receiver's counts: slot p brings a random share of at most B rows, skewed over experts.
    Tensor recv = pool.zeros({p_n, l_n}, DType::i64);
    for (int64_t p = 0; p < p_n; ++p) {
      int64_t left = std::uniform_int_distribution<int64_t>(0, c.slot_rows)(rng);
      for (int64_t l = 0; l < l_n && left > 0; ++l) {
        const int64_t n = l + 1 == l_n ? left : std::uniform_int_distribution<int64_t>(0, left)(rng);
        recv.ptr<int64_t>()[p * l_n + l] = n;
        left -= n;
      }
    }
    struct Side {
      Tensor offsets, token, row, recv, token_x, slot_tk, send, src, row_x, counts, offsets_l, over, fill;
    };
    auto run = [&](const Side& d) {
      moe_ep_send_slots(testing::exec(), d.offsets, d.token, d.row, c.slot_rows, d.token_x, d.slot_tk, d.send, d.over,
                        d.fill);
      moe_ep_recv_slots(testing::exec(), d.recv, c.slot_rows, d.src, d.row_x, d.counts, d.offsets_l, d.over, d.fill);
    };
    Tensor over_h = pool.zeros({1}, DType::f64), fill_h = pool.zeros({1}, DType::f64);
    over_h.ptr<double>()[0] = 3;      // added to
    fill_h.ptr<double>()[0] = 0.125;  // max-ed with
    const Side h{offsets,
                 token,
                 row,
                 recv,
                 host_filled_i64(pool, {x_n}, kSentinel),
                 host_filled_i64(pool, {t_n, k_n}, kSentinel),
                 host_filled_i64(pool, {p_n, l_n}, kSentinel),
                 host_filled_i64(pool, {c.rows}, kSentinel),
                 host_filled_i64(pool, {x_n}, kSentinel),
                 host_filled_i64(pool, {l_n}, kSentinel),
                 host_filled_i64(pool, {l_n + 1}, kSentinel),
                 over_h,
                 fill_h};
    const Side g{dev.upload(offsets, DType::i64),
                 dev.upload(token, DType::i64),
                 dev.upload(row, DType::i64),
                 dev.upload(recv, DType::i64),
                 filled_i64(dev, {x_n}, kSentinel),
                 filled_i64(dev, {t_n, k_n}, kSentinel),
                 filled_i64(dev, {p_n, l_n}, kSentinel),
                 filled_i64(dev, {c.rows}, kSentinel),
                 filled_i64(dev, {x_n}, kSentinel),
                 filled_i64(dev, {l_n}, kSentinel),
                 filled_i64(dev, {l_n + 1}, kSentinel),
                 dev.upload(over_h, DType::f64),
                 dev.upload(fill_h, DType::f64)};
    run(g);
    run(h);
    for (const auto& [what, a, b] :
         {std::tuple{"token_X", g.token_x, h.token_x}, std::tuple{"slot_TK", g.slot_tk, h.slot_tk},
          std::tuple{"send_counts", g.send, h.send}, std::tuple{"src_R", g.src, h.src},
          std::tuple{"row_X", g.row_x, h.row_x}, std::tuple{"counts", g.counts, h.counts},
          std::tuple{"offsets", g.offsets_l, h.offsets_l}})
      expect_same(ints(a), ints(b), what);
    EXPECT_EQ(bytes_of(g.over), bytes_of(h.over)) << "overflow";
    EXPECT_EQ(bytes_of(g.fill), bytes_of(h.fill)) << "fill " << h.fill.ptr<double>()[0];
  }
}

// ---- permute and combine -----------------------------------------------------------------------

// A CPU plan with drops and padding rows (capacity 60 for ~75 assignments per expert, skewed),
// plus experts that get no token.
HostPlan padded_plan(Pool& pool, std::mt19937_64& rng, int64_t t_n, int64_t k_n) {
  const int64_t e_n = 16, capacity = 60;
  HostPlan p;
  p.topk_idx = random_topk(pool, rng, t_n, k_n, 14, 0.15, false);
  p.topk_prob = pool.uniform({t_n, k_n}, 0.0, 1.0, DType::f32);
  p.counts = pool.zeros({e_n}, DType::i64);
  p.offsets = pool.zeros({e_n + 1}, DType::i64);
  p.row = pool.zeros({t_n, k_n}, DType::i64);
  p.token = pool.zeros({e_n * capacity}, DType::i64);
  p.num_rows =
      moe_permute_plan(testing::exec(), p.topk_idx, p.topk_prob, capacity, true, {p.counts, p.offsets, p.row, p.token});
  return p;
}

// Rows [n, end) of a downloaded [*, H] buffer are all NaN (the poison of DevicePool::poisoned).
bool untouched_from(const std::vector<double>& v, int64_t n, int64_t h_n) {
  for (size_t i = static_cast<size_t>(n * h_n); i < v.size(); ++i)
    if (!std::isnan(v[i])) return false;
  return true;
}

// The CUDA permute, combine and their backward against the CPU's, K assignments per token.
void check_permute_combine(std::mt19937_64& rng, int64_t k_n) {
  SCOPED_TRACE("K " + std::to_string(k_n));
  const int64_t t_n = 301, guard = 3;
  Pool plan_pool;
  const HostPlan plan = padded_plan(plan_pool, rng, t_n, k_n);
  const int64_t r_n = plan.num_rows;
  const std::vector<int64_t> row = ints(plan.row), token = ints(plan.token);
  ASSERT_NE(std::find(row.begin(), row.end(), -1), row.end()) << "the plan drops assignments";
  ASSERT_NE(std::find(token.begin(), token.begin() + r_n, -1), token.begin() + r_n) << "the plan pads";

  // H 1003: scalar accesses; 1024: 16-byte accesses; 6: 2 or 4 bytes wide, fewer columns than threads.
  for (int64_t h_n : {int64_t{1003}, int64_t{1024}, int64_t{6}}) {
    for (DType dt : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " H " + std::to_string(h_n));
      const double tol = dt == DType::f32 ? kF32 : kBf16;
      Pool pool;
      DevicePool dev;
      Tensor row_d = dev.upload(plan.row, DType::i64), token_d = dev.upload(plan.token, DType::i64);
      Tensor prob_d = dev.upload(plan.topk_prob, DType::f32);
      Tensor prob64 = testing::rounded(pool, plan.topk_prob, DType::f32);

      // Permute: an exact copy (padding rows zero); the guard rows after R stay untouched.
      Tensor x = pool.randn({t_n, h_n});
      Tensor rows_buf = dev.poisoned({r_n + guard, h_n}, dt);
      moe_permute(testing::exec(), dev.upload(x, dt), token_d, rows_buf.slice(0, r_n));
      Tensor rows64 = pool.zeros({r_n, h_n}, DType::f64);
      moe_permute(testing::exec(), testing::rounded(pool, x, dt), plan.token, rows64);
      const std::vector<double> rows = testing::download(rows_buf);
      EXPECT_EQ(testing::rel_error(std::vector<double>(rows.begin(), rows.begin() + r_n * h_n), rows64), 0.0);
      EXPECT_TRUE(untouched_from(rows, r_n, h_n)) << "moe_permute wrote past R";

      // Permute backward: the K rows of each token summed (dropped ones skipped).
      Tensor drows = pool.randn({r_n, h_n});
      Tensor dx_d = dev.poisoned({t_n, h_n}, dt), dx64 = pool.zeros({t_n, h_n}, DType::f64);
      moe_permute_backward(testing::exec(), dev.upload(drows, dt), row_d, dx_d);
      moe_permute_backward(testing::exec(), testing::rounded(pool, drows, dt), plan.row, dx64);
      EXPECT_LE(testing::rel_error(testing::download(dx_d), dx64), tol) << "permute backward";

      // Combine (padding rows hold random values: no token reads them).
      Tensor out = pool.randn({r_n, h_n});
      Tensor out_d = dev.upload(out, dt), out64 = testing::rounded(pool, out, dt);
      Tensor y_d = dev.poisoned({t_n, h_n}, dt), y64 = pool.zeros({t_n, h_n}, DType::f64);
      moe_combine(testing::exec(), out_d, row_d, prob_d, y_d);
      moe_combine(testing::exec(), out64, plan.row, prob64, y64);
      EXPECT_LE(testing::rel_error(testing::download(y_d), y64), tol) << "combine";

      // Combine backward: dout rows of kept assignments, zero padding rows, nothing past R.
      Tensor dy = pool.randn({t_n, h_n});
      Tensor dout_buf = dev.poisoned({r_n + guard, h_n}, dt), dprob_d = dev.poisoned({t_n, k_n}, DType::f32);
      moe_combine_backward(testing::exec(), out_d, row_d, prob_d, token_d, dev.upload(dy, dt), dout_buf.slice(0, r_n),
                           dprob_d);
      Tensor dout64 = pool.zeros({r_n, h_n}, DType::f64), dprob64 = pool.zeros({t_n, k_n}, DType::f64);
      moe_combine_backward(testing::exec(), out64, plan.row, prob64, plan.token, testing::rounded(pool, dy, dt), dout64,
                           dprob64);
      const std::vector<double> dout = testing::download(dout_buf);
      EXPECT_LE(testing::rel_error(std::vector<double>(dout.begin(), dout.begin() + r_n * h_n), dout64), tol)
          << "combine backward dout";
      EXPECT_TRUE(untouched_from(dout, r_n, h_n)) << "moe_combine_backward wrote past R";
      for (int64_t r = 0; r < r_n; ++r) {
        if (token[static_cast<size_t>(r)] >= 0) continue;
        for (int64_t h = 0; h < h_n; ++h) ASSERT_EQ(dout[static_cast<size_t>(r * h_n + h)], 0.0) << "padding row " << r;
      }
      const std::vector<double> dprob = testing::download(dprob_d);
      EXPECT_LE(testing::rel_error(dprob, dprob64), kDot) << "combine backward dprob";
      for (size_t i = 0; i < row.size(); ++i)
        if (row[i] < 0) {
          EXPECT_EQ(dprob[i], 0.0) << "dropped assignment " << i;
        }
    }
  }
}

TEST(CudaPermuteCombine, ForwardAndBackwardMatchCpu) {
  MF_REQUIRE_GPU();
  std::mt19937_64 rng(testing::fresh_seed());
  SCOPED_TRACE(seed_trace());
  // K 10: the sums over k load their rows in chunks of 4 or 8 (permute.cu): full and partial ones.
  for (int64_t k_n : {int64_t{4}, int64_t{10}}) check_permute_combine(rng, k_n);
}

}  // namespace
}  // namespace moefold

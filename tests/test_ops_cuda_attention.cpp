// GPU parity, causal grouped-query attention (ops/cuda/attention.cu): forward, backward and the
// explicit-positions variants against the CPU ops run in float64 on exactly the GPU's inputs
// (rounded through the storage dtype; tests/cuda_testing.h). Every output starts poisoned (NaN),
// the GPU gets no work_* scratch at all (an undefined tensor), and backward is run twice to check
// that it is deterministic (bit-identical).
// Tolerances (relative Frobenius error; measured on an H200 in brackets):
// - f32: 1e-5. The GPU computes in float (inputs exact), summing in another order than the
//   reference (online softmax over key tiles, tile-wise dS): a few float roundings per output
//   (out <= 5e-7, dq/dk/dv <= 9e-7); 1e-5 leaves room for the dS = P (dP - delta) cancellation.
// - bf16: 5e-3. Scores, P and dS stay in float on the GPU (P is NOT rounded to bf16 before P V),
//   so each output is one bf16 rounding of a float result: at most 2^-9 = 2e-3 relative per
//   element (out, dq, dk, dv all ~1.6e-3, <= 1.8e-3).
// - lse is f32 on the GPU whatever the activations: 1e-5 in both cases (<= 2e-7).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda_testing.h"
#include "moefold/ops/ops.h"

namespace moefold {
namespace {

using testing::DevicePool;
using testing::download;
using testing::Pool;
using testing::rel_error;
using testing::rounded;

constexpr double kF32Tol = 1e-5;
constexpr double kBf16Tol = 5e-3;
constexpr double kLseTol = 1e-5;

// These are the own kernels' tests: the plain causal ops would go to cuDNN's fused attention when
// the build has it (ops/cuda/attention_cudnn.h; tested in test_ops_cuda_attention_cudnn.cpp), so
// they run on a context whose kernels.attention is "own" (made on first use: REQUIRES a GPU).
const ExecContext& own() {
  static const ExecContext* ctx = [] {
    KernelOptions k;
    k.attention = AttentionKernel::own;
    return new ExecContext(Device::cuda, k);
  }();
  return *ctx;
}

double tol(DType dt) { return dt == DType::f32 ? kF32Tol : kBf16Tol; }

// One attention problem. Empty positions: the plain causal ops (Sq == Sk).
struct AttnCase {
  int64_t b, sq, sk, nq, ng, d;
  double scale;
  std::vector<int32_t> q_pos, k_pos;

  bool at() const { return !q_pos.empty(); }
  std::string name() const {
    return std::string(at() ? "at" : "causal") + " B=" + std::to_string(b) + " Sq=" + std::to_string(sq) +
           " Sk=" + std::to_string(sk) + " Q=" + std::to_string(nq) + " G=" + std::to_string(ng) +
           " D=" + std::to_string(d) + " scale=" + std::to_string(scale);
  }
};

AttnCase causal(int64_t s, int64_t nq, int64_t ng, int64_t d, double scale = 0) {
  return {2, s, s, nq, ng, d, scale != 0 ? scale : 1.0 / std::sqrt(static_cast<double>(d)), {}, {}};
}

// Context parallelism's load-balanced chunking (parallel/context_parallel.h cp_positions, which
// lives in a module this test does not link): rank r of c holds chunks r and 2c-1-r of S/(2c).
std::vector<int32_t> cp_positions(int64_t s, int c, int r) {
  const int64_t chunk = s / (2 * c);
  std::vector<int32_t> pos;
  for (int64_t l = 0; l < chunk; ++l) pos.push_back(static_cast<int32_t>(r * chunk + l));
  for (int64_t l = 0; l < chunk; ++l) pos.push_back(static_cast<int32_t>((2 * c - 1 - r) * chunk + l));
  return pos;
}

// Queries of CP rank `rank` against the keys of `key_ranks` (in that order), as CP attention runs
// them after gathering K and V. `shuffle`: keys (and queries) in a random order.
AttnCase cp_case(int64_t s, int c, int rank, const std::vector<int>& key_ranks, int64_t nq, int64_t ng, int64_t d,
                 bool shuffle = false) {
  AttnCase st{2, 0, 0, nq, ng, d, 1.0 / std::sqrt(static_cast<double>(d)), cp_positions(s, c, rank), {}};
  for (int r : key_ranks) {
    const std::vector<int32_t> p = cp_positions(s, c, r);
    st.k_pos.insert(st.k_pos.end(), p.begin(), p.end());
  }
  if (shuffle) {
    std::mt19937_64 rng(testing::fresh_seed());
    std::shuffle(st.k_pos.begin(), st.k_pos.end(), rng);
    std::shuffle(st.q_pos.begin(), st.q_pos.end(), rng);
  }
  st.sq = static_cast<int64_t>(st.q_pos.size());
  st.sk = static_cast<int64_t>(st.k_pos.size());
  return st;
}

// rel_error with ||ref|| replaced by floor_per_element * sqrt(n) when that is larger.
double grad_error(const std::vector<double>& got, const Tensor& ref, double floor_per_element) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < ref.numel(); ++i) {
    const double g = got[static_cast<size_t>(i)], r = testing::value_at(ref, i);
    if (!std::isfinite(g)) return INFINITY;
    num += (g - r) * (g - r);
    den += r * r;
  }
  den = std::max(den, floor_per_element * floor_per_element * static_cast<double>(ref.numel()));
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

Tensor host_i32(std::vector<int32_t>& v) {
  return Tensor(v.data(), DType::i32, {static_cast<int64_t>(v.size())}, Device::cpu);
}

// Runs forward and backward of `st` on the GPU in `dt` and on the CPU in f64, and compares.
void check_parity(AttnCase st, DType dt) {
  SCOPED_TRACE(st.name() + " " + std::string(dtype_name(dt)));
  Pool pool;
  DevicePool dev;
  const Shape q_shape{st.b, st.sq, st.nq, st.d}, kv_shape{st.b, st.sk, st.ng, st.d}, lse_shape{st.b, st.nq, st.sq};
  Tensor q = pool.randn(q_shape), k = pool.randn(kv_shape), v = pool.randn(kv_shape), dout = pool.randn(q_shape);
  Tensor qr = rounded(pool, q, dt), kr = rounded(pool, k, dt), vr = rounded(pool, v, dt),
         doutr = rounded(pool, dout, dt);
  Tensor work = pool.zeros({std::max<int64_t>(1, 2 * st.sq * st.sk)});
  Tensor qpos_h, kpos_h, qpos_d, kpos_d;
  if (st.at()) {
    qpos_h = host_i32(st.q_pos);
    kpos_h = host_i32(st.k_pos);
    qpos_d = dev.upload(qpos_h, DType::i32);
    kpos_d = dev.upload(kpos_h, DType::i32);
  }
  const Tensor no_work;  // the GPU path needs (and reads) no scratch

  // ---- forward
  Tensor out = pool.zeros(q_shape), lse = pool.zeros(lse_shape);
  if (st.at())
    attention_forward_at(own(), qr, kr, vr, qpos_h, kpos_h, st.scale, out, lse, work);
  else
    attention_forward(own(), qr, kr, vr, st.scale, out, lse, work);
  Tensor qd = dev.upload(q, dt), kd = dev.upload(k, dt), vd = dev.upload(v, dt), doutd = dev.upload(dout, dt);
  Tensor outd = dev.poisoned(q_shape, dt), lsed = dev.poisoned(lse_shape, DType::f32);
  if (st.at())
    attention_forward_at(own(), qd, kd, vd, qpos_d, kpos_d, st.scale, outd, lsed, no_work);
  else
    attention_forward(own(), qd, kd, vd, st.scale, outd, lsed, no_work);
  EXPECT_LE(rel_error(download(outd), out), tol(dt)) << "out";
  EXPECT_LE(rel_error(download(lsed), lse), kLseTol) << "lse";

  // ---- backward, on the reference's out and lse (rounded as the GPU stores them)
  Tensor outr = rounded(pool, out, dt), lser = rounded(pool, lse, DType::f32);
  Tensor dq = pool.zeros(q_shape), dk = pool.zeros(kv_shape), dv = pool.zeros(kv_shape);
  if (st.at())
    attention_backward_at(own(), qr, kr, vr, qpos_h, kpos_h, outr, lser, doutr, st.scale, dq, dk, dv, work);
  else
    attention_backward(own(), qr, kr, vr, outr, lser, doutr, st.scale, dq, dk, dv, work);
  // S = 1: the only key is the query's own, so P = 1, dP = delta and dq = dk = 0 exactly; the
  // reference holds only f64 rounding noise there, and the GPU's float noise is measured against
  // the natural size of a dq/dk element for unit-normal inputs, scale * sqrt(D), instead.
  const double dqdk_floor = st.sq == 1 && !st.at() ? st.scale * std::sqrt(static_cast<double>(st.d)) : 0.0;
  Tensor outd2 = dev.upload(out, dt), lsed2 = dev.upload(lse, DType::f32);
  std::vector<double> first[3];
  for (int rep = 0; rep < 2; ++rep) {
    Tensor dqd = dev.poisoned(q_shape, dt), dkd = dev.poisoned(kv_shape, dt), dvd = dev.poisoned(kv_shape, dt);
    if (st.at())
      attention_backward_at(own(), qd, kd, vd, qpos_d, kpos_d, outd2, lsed2, doutd, st.scale, dqd, dkd, dvd, no_work);
    else
      attention_backward(own(), qd, kd, vd, outd2, lsed2, doutd, st.scale, dqd, dkd, dvd, no_work);
    const std::vector<double> got[3] = {download(dqd), download(dkd), download(dvd)};
    if (rep == 0) {
      EXPECT_LE(grad_error(got[0], dq, dqdk_floor), tol(dt)) << "dq";
      EXPECT_LE(grad_error(got[1], dk, dqdk_floor), tol(dt)) << "dk";
      EXPECT_LE(rel_error(got[2], dv), tol(dt)) << "dv";
      for (int i = 0; i < 3; ++i) first[i] = got[i];
    } else {
      for (int i = 0; i < 3; ++i) EXPECT_TRUE(got[i] == first[i]) << "backward output " << i << " not deterministic";
    }
  }
}

// S in {1, 7, 64, 130, 257} (one tile, partial tiles, several tiles with a ragged end), Q/G in
// {4/4, 6/2, 8/1, 3/3} (MHA, GQA, MQA, odd head counts), D over every head-dim bucket of the
// kernels (16, 32, 64, 128, 192, 256), small odd D included; one sharper softmax (scale 0.45,
// about twice 1/sqrt(24)).
const AttnCase kCausal[] = {
    causal(1, 4, 4, 4),     causal(7, 6, 2, 8),          causal(64, 8, 1, 24),  causal(130, 3, 3, 64),
    causal(257, 4, 4, 128), causal(130, 6, 2, 192),      causal(257, 8, 1, 64), causal(64, 4, 4, 192),
    causal(7, 3, 3, 128),   causal(257, 6, 2, 24, 0.45), causal(130, 8, 1, 8),  causal(1, 6, 2, 192),
    causal(64, 3, 3, 4),    causal(130, 4, 4, 12),       causal(7, 8, 1, 6),    causal(70, 4, 2, 256),
    causal(257, 3, 3, 192), causal(200, 6, 2, 40),
};

TEST(CudaAttention, CausalMatchesCpu) {
  MF_REQUIRE_GPU();
  for (DType dt : {DType::f32, DType::bf16})
    for (const AttnCase& st : kCausal) check_parity(st, dt);
}

// Explicit positions as context parallelism produces them: a rank's queries (two chunks) against
// the keys gathered from every rank, from a subset of ranks, or in a random order.
TEST(CudaAttention, ExplicitPositionsMatchCpu) {
  MF_REQUIRE_GPU();
  for (DType dt : {DType::f32, DType::bf16}) {
    check_parity(cp_case(260, 2, 0, {0, 1}, 6, 2, 64), dt);
    check_parity(cp_case(260, 2, 1, {0, 1}, 4, 4, 128), dt);
    check_parity(cp_case(192, 3, 1, {2, 1}, 8, 1, 24), dt);
    check_parity(cp_case(400, 4, 3, {0, 1, 2, 3}, 3, 3, 192), dt);
    check_parity(cp_case(100, 5, 3, {0, 1, 2, 3, 4}, 6, 2, 12, /*shuffle=*/true), dt);
    check_parity(cp_case(520, 2, 0, {1, 0}, 4, 2, 256, /*shuffle=*/true), dt);
  }
}

// The _at ops with positions 0..S-1 are the plain causal ops (the CPU's contract; on the GPU the
// two take different tile-skipping paths): bit-identical out and lse.
TEST(CudaAttention, IdentityPositionsMatchPlainCausal) {
  MF_REQUIRE_GPU();
  for (DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    Pool pool;
    DevicePool dev;
    const int64_t b = 2, s = 150, nq = 4, ng = 2, d = 64;
    std::vector<int32_t> pos(s);
    std::iota(pos.begin(), pos.end(), 0);
    Tensor pos_d = dev.upload(host_i32(pos), DType::i32);
    Tensor q = dev.upload(pool.randn({b, s, nq, d}), dt), k = dev.upload(pool.randn({b, s, ng, d}), dt),
           v = dev.upload(pool.randn({b, s, ng, d}), dt);
    Tensor out1 = dev.poisoned({b, s, nq, d}, dt), lse1 = dev.poisoned({b, nq, s}, DType::f32);
    Tensor out2 = dev.poisoned({b, s, nq, d}, dt), lse2 = dev.poisoned({b, nq, s}, DType::f32);
    attention_forward(own(), q, k, v, 0.125, out1, lse1, Tensor());
    attention_forward_at(own(), q, k, v, pos_d, pos_d, 0.125, out2, lse2, Tensor());
    EXPECT_TRUE(download(out1) == download(out2));
    EXPECT_TRUE(download(lse1) == download(lse2));
  }
}

}  // namespace
}  // namespace moefold

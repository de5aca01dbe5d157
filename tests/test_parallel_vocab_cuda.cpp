// GPU parity of the vocabulary-parallel ops (parallel/vocab_parallel.h): every CUDA function
// against the CPU one on fresh random inputs (tests/cuda_testing.h), f32 and bf16, one rank (the
// self communicator). Shards of several widths and offsets, ids and targets inside and outside
// them, ignored targets; the forward cross-entropy with a full-vocabulary shard at offset 0 (with
// one rank every target must fall in the one shard). Outputs are poisoned (NaN bytes) and followed
// by NaN guard elements that must survive; dtable starts from random values (ACCUMULATED).
//
// Tolerances (the CPU reference runs in f64, or f32 where stated, on the GPU's exact inputs):
//  - embedding forward: exact (a copy or a zero).
//  - embedding backward, f32 dtable: exact. Both devices add the (exact) f32 values of dout into
//    the old f32 value in token order, one f32 rounding per add: the same operations.
//  - embedding backward, bf16 dtable: kBf16 (one bf16 rounding of the f32 sum, 2^-9 relative,
//    plus the f32 sum's error; 2x margin).
//  - cross-entropy lse: kLseAbs + kF32Store * |lse| per element. The GPU sums f32 exps in f64:
//    expf is within 2 ulp (2.4e-7 relative) and x - max is rounded in f32 (2^-24 * |x - max|,
//    at most ~1e-6 relative on the terms that matter for these spreads), so log(sum) is off by
//    ~1e-6: kLseAbs 1e-5 gives a 10x margin; storing lse in f32 adds half an ulp (kF32Store).
//  - cross-entropy loss: kLseAbs per counted row (each row loss is l - x[target] in f64, with the
//    error of l above).
//  - cross-entropy dlogits, element by element (softmax entries are tiny next to the target's):
//    f32 kF32Grad 1e-5 relative (x - lse rounded in f32, |x - lse| <= 50 here: 3e-6, expf's
//    2 ulp and the product's rounding: < 4e-6, 2.5x margin) plus 1e-6 * grad_scale at the target,
//    where p - 1 cancels; bf16 kBf16 (one rounding). Ignored rows exactly zero.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "cuda_testing.h"
#include "moefold/comm/communicator.h"
#include "moefold/core/memory.h"
#include "moefold/ops/ops.h"
#include "moefold/parallel/vocab_parallel.h"

namespace moefold {
namespace {

using testing::DevicePool;
using testing::download;
using testing::Pool;
using testing::rounded;
using testing::value_at;

constexpr double kBf16 = 4e-3;
constexpr double kLseAbs = 1e-5;
constexpr double kF32Store = 1.2e-7;  // 2^-23: twice f32's half ulp
constexpr double kF32Grad = 1e-5;
constexpr int64_t kGuard = 67;  // NaN elements after each output

std::string seed_note() { return "MOEFOLD_TEST_SEED=" + std::to_string(testing::fresh_seed()); }

// A device output: NaN bytes (or `init`, stored as `dtype`) followed by kGuard NaN elements.
struct Guarded {
  Tensor t;
  Tensor guard;
};
Guarded guarded(DevicePool& dev, Shape shape, DType dtype, const Tensor* init = nullptr) {
  Tensor all = dev.poisoned({shape.numel() + kGuard}, dtype);
  Tensor t(all.data(), dtype, shape, Device::cuda);
  if (init != nullptr) {
    Tensor up = dev.upload(*init, dtype);
    device_copy(t.data(), Device::cuda, up.data(), Device::cuda, t.nbytes());
  }
  return {t, Tensor(static_cast<char*>(all.data()) + t.nbytes(), dtype, {kGuard}, Device::cuda)};
}
void expect_guard_intact(const Guarded& g, const std::string& what) {
  const std::vector<double> tail = download(g.guard);
  for (size_t i = 0; i < tail.size(); ++i)
    if (!std::isnan(tail[i])) ADD_FAILURE() << what << ": write past the end, guard element " << i << " = " << tail[i];
}

// max |gpu - ref| <= tol * max |ref| (and finite everywhere); tol 0: bit for bit.
void expect_close(const std::vector<double>& gpu, const Tensor& ref, double tol, const std::string& what) {
  ASSERT_EQ(static_cast<int64_t>(gpu.size()), ref.numel()) << what;
  double ref_max = 0, worst = 0;
  int64_t worst_i = -1;
  for (int64_t i = 0; i < ref.numel(); ++i) {
    const double r = value_at(ref, i), g = gpu[static_cast<size_t>(i)];
    ref_max = std::max(ref_max, std::abs(r));
    const double d = std::isfinite(g) ? std::abs(g - r) : INFINITY;
    if (d > worst || worst_i < 0) {
      worst = d;
      worst_i = i;
    }
  }
  EXPECT_LE(worst, tol * ref_max) << what << ": element " << worst_i << " (max |ref| " << ref_max << ")";
}

// A host f32 tensor holding the values of `h` (already representable: rounded through f32 or bf16).
Tensor as_f32(Pool& pool, const Tensor& h) {
  Tensor t = pool.zeros(h.shape(), DType::f32);
  for (int64_t i = 0; i < h.numel(); ++i) testing::set_value_at(t, i, value_at(h, i));
  return t;
}

// Scratch bound through a Memory on the GPU (measuring pass, then the real one), as the model does.
struct DeviceScratch {
  Memory mem{DType::f32, Device::cuda};
  VocabParallelScratch scratch;
  explicit DeviceScratch(int64_t rows) {
    mem.bind_twice([&] { scratch.bind(mem, rows); });
  }
};

// A shard [offset, offset + vl) of a global vocabulary of v entries.
struct ShardCase {
  int64_t n, vl, offset, v;
};

std::string describe(const ShardCase& s, const std::string& dtypes) {
  return "N=" + std::to_string(s.n) + " Vl=" + std::to_string(s.vl) + " offset=" + std::to_string(s.offset) +
         " V=" + std::to_string(s.v) + " " + dtypes + " " + seed_note();
}

// Global indices in [0, v), with the shard's first and last entry and its two outside neighbours
// (where they exist) among the first rows, and kIgnoreTarget at rows 1 and n - 1 when `ignore`.
Tensor indices(Pool& pool, const ShardCase& s, bool ignore) {
  Tensor t = pool.ints({s.n}, 0, static_cast<int32_t>(s.v));
  int32_t* p = t.ptr<int32_t>();
  std::vector<int64_t> picks = {s.offset, s.offset + s.vl - 1};
  if (s.offset > 0) picks.push_back(s.offset - 1);
  if (s.offset + s.vl < s.v) picks.push_back(s.offset + s.vl);
  for (size_t i = 0; i < picks.size() && static_cast<int64_t>(2 * i) < s.n; ++i)
    p[2 * i] = static_cast<int32_t>(picks[i]);  // even rows: the odd ones stay free for kIgnoreTarget
  if (ignore && s.n > 1) p[1] = kIgnoreTarget;
  if (ignore && s.n > 7) p[s.n - 1] = kIgnoreTarget;
  return t;
}

// ---- embedding -------------------------------------------------------------------------------

// A table shard [vl, c] at `offset` of a vocabulary of v ids. N > V (repeats everywhere, one- and
// two-row shards), N > 2048 and > 4096 (several passes over the ids for the later matches and for
// the earlier duplicates), C > 1024 (several column passes); shards at offset 0, inside and at
// the end of the vocabulary.
struct EmbeddingCase {
  int64_t n, vl, c, offset, v;
};
const EmbeddingCase kEmbeddingCases[] = {{37, 23, 129, 0, 40},  {2051, 61, 1037, 30, 200}, {3000, 2, 33, 1, 4},
                                         {5000, 7, 65, 3, 14},  {50, 1, 8, 9, 10},         {1, 3, 1, 2, 6},
                                         {300, 5, 4096, 15, 20}};

TEST(CudaVocabParallel, EmbeddingForwardMatchesCpu) {
  MF_REQUIRE_GPU();
  for (const EmbeddingCase& e : kEmbeddingCases) {
    const ShardCase s{e.n, e.vl, e.offset, e.v};
    for (DType dt : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(describe(s, "C=" + std::to_string(e.c) + " " + std::string(dtype_name(dt))));
      Pool pool;
      DevicePool dev;
      Tensor ids = indices(pool, s, false);
      Tensor table = pool.randn({s.vl, e.c});
      Tensor out_ref = pool.randn({s.n, e.c});  // WRITTEN, zero rows included
      vocab_parallel_embedding_forward(testing::exec(), ids, rounded(pool, table, dt), s.offset, out_ref);
      Guarded out = guarded(dev, {s.n, e.c}, dt);
      vocab_parallel_embedding_forward(testing::exec(), dev.upload(ids, DType::i32), dev.upload(table, dt), s.offset,
                                       out.t);
      expect_close(download(out.t), out_ref, 0.0, "embedding out");
      expect_guard_intact(out, "embedding out");
    }
  }
}

TEST(CudaVocabParallel, EmbeddingBackwardMatchesCpu) {
  MF_REQUIRE_GPU();
  struct Dtypes {
    DType dout, dtable;
  };
  for (const EmbeddingCase& e : kEmbeddingCases) {
    const ShardCase s{e.n, e.vl, e.offset, e.v};
    // bf16 rows into the f32 master gradient: the mixed-precision model's call.
    for (const Dtypes ty :
         {Dtypes{DType::f32, DType::f32}, Dtypes{DType::bf16, DType::f32}, Dtypes{DType::bf16, DType::bf16}}) {
      SCOPED_TRACE(describe(s, "C=" + std::to_string(e.c) + " " + std::string(dtype_name(ty.dout)) + "/" +
                                   std::string(dtype_name(ty.dtable))));
      Pool pool;
      DevicePool dev;
      Tensor ids = indices(pool, s, false);
      Tensor ids_d = dev.upload(ids, DType::i32);
      Tensor dout = pool.randn({s.n, e.c}), dtable0 = pool.randn({s.vl, e.c});
      Tensor dout_d = dev.upload(dout, ty.dout);
      Guarded dtable = guarded(dev, {s.vl, e.c}, ty.dtable, &dtable0);
      vocab_parallel_embedding_backward(testing::exec(), ids_d, dout_d, s.offset, dtable.t);
      if (ty.dtable == DType::f32) {  // the CPU op in f32 on the same values: bit for bit
        Tensor dtable_ref = as_f32(pool, rounded(pool, dtable0, DType::f32));
        vocab_parallel_embedding_backward(testing::exec(), ids, as_f32(pool, rounded(pool, dout, ty.dout)), s.offset,
                                          dtable_ref);
        expect_close(download(dtable.t), dtable_ref, 0.0, "embedding dtable");
      } else {
        Tensor dtable_ref = rounded(pool, dtable0, ty.dtable);
        vocab_parallel_embedding_backward(testing::exec(), ids, rounded(pool, dout, ty.dout), s.offset, dtable_ref);
        expect_close(download(dtable.t), dtable_ref, kBf16, "embedding dtable");
      }
      expect_guard_intact(dtable, "embedding dtable");
      Guarded again = guarded(dev, {s.vl, e.c}, ty.dtable, &dtable0);
      vocab_parallel_embedding_backward(testing::exec(), ids_d, dout_d, s.offset, again.t);
      EXPECT_EQ(download(again.t), download(dtable.t)) << "embedding dtable is not deterministic";
    }
  }
}

// ---- cross-entropy ---------------------------------------------------------------------------

// Logits randn * 3 with per-row offsets (+200, -150, 0): an unshifted f32 exp would overflow or
// underflow; rows stay exact in bf16 relative terms (the reference sees the same rounded values).
Tensor offset_logits(Pool& pool, int64_t n, int64_t v) {
  Tensor t = pool.randn({n, v}, DType::f64, 3.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < v; ++j) t.ptr<double>()[i * v + j] += i % 3 == 0 ? 200.0 : i % 3 == 1 ? -150.0 : 0.0;
  return t;
}

void check_forward(int64_t n, int64_t v, DType dt) {
  const ShardCase s{n, v, 0, v};
  SCOPED_TRACE(describe(s, std::string(dtype_name(dt))));
  Pool pool;
  DevicePool dev;
  auto self = make_self_communicator("tp");
  Tensor logits = offset_logits(pool, n, v);
  Tensor targets = indices(pool, s, true);
  Tensor lr = rounded(pool, logits, dt);
  // The CPU reference: one rank, host scratch.
  Memory host_mem{DType::f64};
  VocabParallelScratch host_scratch;
  host_mem.bind_twice([&] { host_scratch.bind(host_mem, n); });
  Tensor lse_ref = pool.zeros({n});
  const double loss_ref =
      vocab_parallel_cross_entropy_forward(testing::exec(), *self, lr, 0, targets, lse_ref, host_scratch);

  DeviceScratch ds(n + 3);  // more rows bound than used
  Tensor ld = dev.upload(logits, dt), td = dev.upload(targets, DType::i32);
  Guarded lse = guarded(dev, {n}, DType::f32);
  const double loss = vocab_parallel_cross_entropy_forward(testing::exec(), *self, ld, 0, td, lse.t, ds.scratch);
  int64_t counted = 0;
  for (int64_t i = 0; i < n; ++i) counted += targets.ptr<int32_t>()[i] != kIgnoreTarget;
  EXPECT_NEAR(loss, loss_ref, kLseAbs * static_cast<double>(counted)) << "loss";
  EXPECT_EQ(vocab_parallel_cross_entropy_forward(testing::exec(), *self, ld, 0, td, lse.t, ds.scratch), loss)
      << "loss is not deterministic";
  const std::vector<double> got = download(lse.t);
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double g = got[static_cast<size_t>(i)], r = value_at(lse_ref, i);
    const bool ok =
        targets.ptr<int32_t>()[i] == kIgnoreTarget ? g == 0.0 : std::abs(g - r) <= kLseAbs + kF32Store * std::abs(r);
    if (!ok && bad++ < 5) ADD_FAILURE() << "lse[" << i << "] = " << g << ", want " << r;
  }
  EXPECT_EQ(bad, 0) << "wrong lse elements";
  expect_guard_intact(lse, "lse");
}

TEST(CudaVocabParallel, CrossEntropyForwardFullShardMatchesCpu) {
  MF_REQUIRE_GPU();
  // Rows read element by element (V = 1001, 37; V = 1: the loss is 0) and in 16-byte packs
  // (V = 1000, 8); N > 1024 rows for the finishing block's loop.
  for (DType dt : {DType::f32, DType::bf16}) {
    check_forward(13, 1001, dt);
    check_forward(7, 1000, dt);
    check_forward(3, 8, dt);
    check_forward(3, 1, dt);
    check_forward(1100, 37, dt);
    check_forward(4, 151936, dt);  // Qwen's vocabulary
  }
}

// dlogits element by element (see the tolerances at the top); ignored rows exactly zero.
void expect_dlogits_close(const std::vector<double>& gpu, const Tensor& ref, const Tensor& targets,
                          int64_t vocab_offset, double grad_scale, double tol) {
  const int64_t n = ref.size(0), vl = ref.size(1);
  const int32_t* t = targets.ptr<int32_t>();
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < vl; ++j) {
      const double g = gpu[static_cast<size_t>(i * vl + j)], r = value_at(ref, i * vl + j);
      const bool at_target = t[i] == vocab_offset + j;
      const bool ok = t[i] == kIgnoreTarget
                          ? g == 0.0
                          : std::abs(g - r) <= tol * std::abs(r) + (at_target ? 1e-6 * grad_scale : 0.0);
      if (!ok && bad++ < 5) ADD_FAILURE() << "dlogits[" << i << ", " << j << "] = " << g << ", want " << r;
    }
  EXPECT_EQ(bad, 0) << "wrong dlogits elements";
}

TEST(CudaVocabParallel, CrossEntropyBackwardMatchesCpu) {
  MF_REQUIRE_GPU();
  // Shards at offset 0, in the middle and at the end; widths read element by element (1001, 37,
  // 1) and in packs (1000, 8, half of Qwen's vocabulary).
  const ShardCase cases[] = {{13, 1001, 0, 3000}, {7, 1000, 1000, 3000}, {3, 8, 8, 24},
                             {1100, 37, 74, 150}, {9, 1, 5, 10},         {4, 75968, 75968, 151936}};
  for (const ShardCase& s : cases) {
    for (DType dt : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(describe(s, std::string(dtype_name(dt))));
      Pool pool;
      DevicePool dev;
      Tensor logits = pool.randn({s.n, s.vl}, DType::f64, 3.0);
      Tensor targets = indices(pool, s, true);
      Tensor lr = rounded(pool, logits, dt);
      // The saved lse (f32): this shard's log-sum-exp plus up to log(8) for the other shards.
      Tensor lse_host = pool.zeros({s.n}, DType::f32);
      Tensor extra = pool.uniform({s.n}, 0.0, std::log(8.0));
      for (int64_t i = 0; i < s.n; ++i) {
        double m = -INFINITY, sum = 0;
        for (int64_t j = 0; j < s.vl; ++j) m = std::max(m, value_at(lr, i * s.vl + j));
        for (int64_t j = 0; j < s.vl; ++j) sum += std::exp(value_at(lr, i * s.vl + j) - m);
        testing::set_value_at(lse_host, i, m + std::log(sum) + value_at(extra, i));
      }
      Tensor lse_ref = rounded(pool, lse_host, DType::f32);
      const double grad_scale = 0.37 / static_cast<double>(s.n);
      Tensor dl_ref = pool.zeros({s.n, s.vl});
      vocab_parallel_cross_entropy_backward(testing::exec(), lr, s.offset, targets, lse_ref, grad_scale, dl_ref);

      Tensor ld = dev.upload(logits, dt), td = dev.upload(targets, DType::i32);
      Tensor lse_d = dev.upload(lse_host, DType::f32);
      Guarded dl = guarded(dev, {s.n, s.vl}, dt);
      vocab_parallel_cross_entropy_backward(testing::exec(), ld, s.offset, td, lse_d, grad_scale, dl.t);
      const std::vector<double> got = download(dl.t);
      expect_dlogits_close(got, dl_ref, targets, s.offset, grad_scale, dt == DType::f32 ? kF32Grad : kBf16);
      expect_guard_intact(dl, "dlogits");
      // In place (dlogits = logits): the same bits.
      vocab_parallel_cross_entropy_backward(testing::exec(), ld, s.offset, td, lse_d, grad_scale, ld);
      EXPECT_EQ(download(ld), got) << "backward in place";
    }
  }
}

// The forward's lse feeds the backward, and together (one rank, full shard) they give the plain
// CUDA cross-entropy's results within the tolerances above: the path the model takes.
TEST(CudaVocabParallel, ForwardBackwardAgreeWithPlainCudaCrossEntropy) {
  MF_REQUIRE_GPU();
  const int64_t n = 64, v = 4099;
  for (DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(std::string(dtype_name(dt)) + " " + seed_note());
    Pool pool;
    DevicePool dev;
    auto self = make_self_communicator("tp");
    const ShardCase s{n, v, 0, v};
    Tensor logits = offset_logits(pool, n, v), targets = indices(pool, s, true);
    Tensor ld = dev.upload(logits, dt), td = dev.upload(targets, DType::i32);
    DeviceScratch ds(n);
    Tensor lse_vp = dev.empty({n}, DType::f32), lse_plain = dev.empty({n}, DType::f32);
    const double loss_vp = vocab_parallel_cross_entropy_forward(testing::exec(), *self, ld, 0, td, lse_vp, ds.scratch);
    const double loss_plain = cross_entropy_forward(testing::exec(), ld, td, lse_plain);
    EXPECT_NEAR(loss_vp, loss_plain, 2 * kLseAbs * static_cast<double>(n));
    const std::vector<double> a = download(lse_vp), b = download(lse_plain);
    for (int64_t i = 0; i < n; ++i)
      EXPECT_LE(std::abs(a[i] - b[i]), 2 * (kLseAbs + kF32Store * std::abs(b[i]))) << "lse row " << i;
    Tensor d_vp = dev.empty({n, v}, dt), d_plain = dev.empty({n, v}, dt);
    vocab_parallel_cross_entropy_backward(testing::exec(), ld, 0, td, lse_vp, 0.5, d_vp);
    cross_entropy_backward(testing::exec(), ld, td, lse_plain, 0.5, d_plain);
    // Both are softmax - onehot from slightly different lse (|diff| <= 2e-5 + f32 rounding of
    // lse ~ 200): relative differences of that size, plus one bf16 rounding each.
    const std::vector<double> x = download(d_vp), y = download(d_plain);
    double worst = 0;
    for (size_t i = 0; i < x.size(); ++i) worst = std::max(worst, std::abs(x[i] - y[i]));
    EXPECT_LE(worst, (dt == DType::f32 ? 1e-4 : 2 * kBf16) * 0.5);
  }
}

// The device-agnostic checks: one device per call, lse in f32 on the GPU.
TEST(CudaVocabParallelDeathTest, MixedDevicesAndBf16LseAbort) {
  MF_REQUIRE_GPU();
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // a fresh process: no CUDA context forked
  Pool pool;
  DevicePool dev;
  Tensor ids = pool.ints({4}, 0, 3), table = pool.randn({3, 5}, DType::f32);
  Tensor out_d = dev.empty({4, 5}, DType::f32), table_d = dev.upload(table, DType::f32);
  EXPECT_DEATH(vocab_parallel_embedding_forward(testing::exec(), ids, table_d, 0, out_d), "on different devices");
  Tensor logits_d = dev.upload(pool.randn({4, 3}), DType::bf16), targets_d = dev.upload(ids, DType::i32);
  Tensor lse_bf16 = dev.empty({4}, DType::bf16), dl = dev.empty({4, 3}, DType::bf16);
  EXPECT_DEATH(vocab_parallel_cross_entropy_backward(testing::exec(), logits_d, 0, targets_d, lse_bf16, 1.0, dl),
               "CUDA: f32");
}

}  // namespace
}  // namespace moefold

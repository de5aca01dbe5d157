// GPU parity, elementwise helpers: every CUDA op against its CPU op on fresh random inputs
// (tests/cuda_testing.h). Tolerances: f32 ops must agree to float rounding (1e-6 relative);
// bf16 outputs are one bf16 rounding of an f32 result (relative 2^-9 = 2e-3 each, 4e-3 bound).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

#include "cuda_testing.h"
#include "moefold/core/device.h"
#include "moefold/core/host_threads.h"
#include "moefold/ops/ops.h"

namespace moefold {
namespace {

using testing::DevicePool;
using testing::Pool;

// add_inplace and add_two_inplace on the GPU: one f32 sum, rounded to the dtype, per add (the
// CPU's arithmetic), in 16-byte vectors where the tensors are aligned and element by element where
// they start off a 16-byte boundary or the length leaves a tail.
TEST(CudaElementwise, AddsRoundEachSumAlignedOrNot) {
  MF_REQUIRE_GPU();
  for (DType dt : {DType::f32, DType::bf16}) {
    const auto round = [&](float v) { return dt == DType::bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; };
    for (const int64_t offset : {0, 1}) {  // elements: 1 puts every tensor off its 16-byte boundary
      for (const int64_t n : {int64_t{7}, int64_t{8}, int64_t{100003}, int64_t{1} << 20}) {
        SCOPED_TRACE(cat(dtype_name(dt), ", offset ", offset, ", n ", n));
        Pool pool;
        DevicePool dev;
        const Tensor y = testing::rounded(pool, pool.randn({n + 1}), dt),
                     a = testing::rounded(pool, pool.randn({n + 1}), dt),
                     b = testing::rounded(pool, pool.randn({n + 1}), dt);
        const Tensor yd = dev.upload(y, dt), ad = dev.upload(a, dt), bd = dev.upload(b, dt), y2d = dev.upload(y, dt);
        const auto part = [&](const Tensor& t) { return t.slice(offset, offset + n); };
        add_inplace(testing::exec(), part(yd), part(ad));
        add_two_inplace(testing::exec(), part(y2d), part(ad), part(bd));
        const std::vector<double> got = testing::download(yd), got2 = testing::download(y2d);
        for (int64_t i = 0; i <= n; ++i) {
          const bool in = i >= offset && i < offset + n;
          const auto at = [&](const Tensor& t) { return static_cast<float>(testing::value_at(t, i)); };
          const float once = in ? round(at(y) + at(a)) : at(y), twice = in ? round(once + at(b)) : at(y);
          ASSERT_EQ(got[static_cast<size_t>(i)], static_cast<double>(once)) << "add_inplace, element " << i;
          ASSERT_EQ(got2[static_cast<size_t>(i)], static_cast<double>(twice)) << "add_two_inplace, element " << i;
        }
      }
    }
  }
}

TEST(CudaElementwise, AddScaleSumSquaresMatchCpu) {
  MF_REQUIRE_GPU();
  for (DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    Pool pool;
    DevicePool dev;
    const int64_t n = 100003;  // not a multiple of any block size
    Tensor y = pool.randn({n}), x = pool.randn({n});
    Tensor yr = testing::rounded(pool, y, dt), xr = testing::rounded(pool, x, dt);
    Tensor yd = dev.upload(y, dt), xd = dev.upload(x, dt);
    add_inplace(testing::exec(), yd, xd);
    scale_inplace(testing::exec(), yd, -0.75);
    add_inplace(testing::exec(), yr, xr);
    scale_inplace(testing::exec(), yr, -0.75);
    const double tol = dt == DType::f32 ? 1e-6 : 4e-3;
    EXPECT_LE(testing::rel_error(testing::download(yd), yr), tol);
    const double want = sum_squares(testing::exec(), xr), got = sum_squares(testing::exec(), xd);
    EXPECT_NEAR(got, want, 1e-9 * want);  // the same inputs, summed in double either way
    // Several with one wait (an empty one and one of over 1024 blocks among them): each one's bits.
    Tensor big = dev.upload(pool.randn({300001}), dt);
    const Tensor xs[] = {xd, Tensor(nullptr, dt, {0}, Device::cuda), big, yd};
    double each[4];
    sum_squares_each(testing::exec(), xs, each);
    EXPECT_EQ(each[0], got);
    EXPECT_EQ(each[1], 0.0);
    EXPECT_EQ(each[2], sum_squares(testing::exec(), big));
    EXPECT_EQ(each[3], sum_squares(testing::exec(), yd));
  }
}

// AdamW: f32 master weights and moments, the same float arithmetic as the CPU op (which runs in
// f32 here too); sqrt and division may differ in the last ulp, so 1e-6 relative. The bf16
// compute copy is the updated weight rounded once.
TEST(CudaAdamW, MatchesCpuAndWritesTheComputeCopy) {
  MF_REQUIRE_GPU();
  // 70001: the one-element kernel; 70000: the four-element (16-byte) kernel. A clip factor too.
  for (const int64_t n : {int64_t{70001}, int64_t{70000}}) {
    SCOPED_TRACE(n);
    Pool pool;
    DevicePool dev;
    Tensor w = pool.randn({n}, DType::f32), g = pool.randn({n}, DType::f32, 0.1), m = pool.randn({n}, DType::f32, 0.01),
           v = pool.uniform({n}, 0.0, 0.01, DType::f32);
    Tensor wd = dev.upload(w, DType::f32), gd = dev.upload(g, DType::f32), md = dev.upload(m, DType::f32),
           vd = dev.upload(v, DType::f32), wc = dev.poisoned({n}, DType::bf16);
    const AdamWStep s{3e-3, 0.9, 0.95, 1e-8, 0.1, 1 - std::pow(0.9, 7), 1 - std::pow(0.95, 7), 0.25};
    adamw_update(testing::exec(), w, g, m, v, s);
    adamw_update(testing::exec(), wd, gd, md, vd, s, wc);
    EXPECT_LE(testing::rel_error(testing::download(wd), w), 1e-6);
    EXPECT_LE(testing::rel_error(testing::download(md), m), 1e-6);
    EXPECT_LE(testing::rel_error(testing::download(vd), v), 1e-6);
    EXPECT_LE(testing::rel_error(testing::download(wc), w), 4e-3);
    const std::vector<double> g_after = testing::download(gd);
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(g_after[static_cast<size_t>(i)], testing::value_at(g, i)) << "the gradient is read, not scaled";
  }
}

// bf16 moments (train.exp_avg_dtype / exp_avg_sq_dtype): the moments stored rounded, the weight
// updated from the unrounded values, as the CPU op does; each mix of moment dtypes.
TEST(CudaAdamW, Bf16MomentsMatchCpu) {
  MF_REQUIRE_GPU();
  const int64_t n = 70000;
  for (const auto& [mt, vt] :
       {std::pair{DType::bf16, DType::bf16}, std::pair{DType::bf16, DType::f32}, std::pair{DType::f32, DType::bf16}}) {
    SCOPED_TRACE(std::string(dtype_name(mt)) + " / " + std::string(dtype_name(vt)));
    Pool pool;
    DevicePool dev;
    Tensor w = pool.randn({n}, DType::f32), g = pool.randn({n}, DType::f32, 0.1);
    Tensor m = pool.zeros({n}, mt), v = pool.zeros({n}, vt);
    cast(testing::exec(), pool.randn({n}, DType::f32, 0.01), m);
    cast(testing::exec(), pool.uniform({n}, 0.0, 0.01, DType::f32), v);
    Tensor wd = dev.upload(w, DType::f32), gd = dev.upload(g, DType::f32), md = dev.upload(m, mt),
           vd = dev.upload(v, vt), wc = dev.poisoned({n}, DType::bf16);
    const AdamWStep s{3e-3, 0.9, 0.95, 1e-8, 0.1, 1 - std::pow(0.9, 7), 1 - std::pow(0.95, 7), 0.25};
    adamw_update(testing::exec(), w, g, m, v, s);
    adamw_update(testing::exec(), wd, gd, md, vd, s, wc);
    EXPECT_LE(testing::rel_error(testing::download(wd), w), 1e-6);
    // A moment rounded to bf16 from values 1e-6 apart can land one bf16 step apart.
    EXPECT_LE(testing::rel_error(testing::download(md), m), 8e-3);
    EXPECT_LE(testing::rel_error(testing::download(vd), v), 8e-3);
  }
}

// bf16 gradients (train.main_grads_dtype): the update reads them widened to f32, so it equals the
// CPU op on the widened gradient (f32 and bf16 moments).
TEST(CudaAdamW, Bf16GradientsMatchCpuOnTheWidenedGradient) {
  MF_REQUIRE_GPU();
  const int64_t n = 70000;
  for (const DType mt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(mt));
    Pool pool;
    DevicePool dev;
    Tensor w = pool.randn({n}, DType::f32), g16 = pool.zeros({n}, DType::bf16), g = pool.zeros({n}, DType::f32);
    cast(testing::exec(), pool.randn({n}, DType::f32, 0.1), g16);
    cast(testing::exec(), g16, g);  // exact
    Tensor m = pool.zeros({n}, mt), v = pool.zeros({n}, mt);
    cast(testing::exec(), pool.randn({n}, DType::f32, 0.01), m);
    cast(testing::exec(), pool.uniform({n}, 0.0, 0.01, DType::f32), v);
    Tensor wd = dev.upload(w, DType::f32), gd = dev.upload(g16, DType::bf16), md = dev.upload(m, mt),
           vd = dev.upload(v, mt), wc = dev.poisoned({n}, DType::bf16);
    const AdamWStep s{3e-3, 0.9, 0.95, 1e-8, 0.1, 1 - std::pow(0.9, 7), 1 - std::pow(0.95, 7), 0.25};
    adamw_update(testing::exec(), w, g, m, v, s);
    adamw_update(testing::exec(), wd, gd, md, vd, s, wc);
    EXPECT_LE(testing::rel_error(testing::download(wd), w), 1e-6);
    EXPECT_LE(testing::rel_error(testing::download(md), m), mt == DType::f32 ? 1e-6 : 8e-3);
    EXPECT_LE(testing::rel_error(testing::download(vd), v), mt == DType::f32 ? 1e-6 : 8e-3);
    EXPECT_LE(testing::rel_error(testing::download(wc), w), 4e-3);
  }
}

// The host AdamW of optimizer offload (adamw_update_host) gives the CUDA kernel's bits for the
// same inputs: every mix of gradient and moment dtypes, with and without the compute copy, on the
// calling thread and on a pool of threads (the vectorised and the scalar kernel both).
TEST(CudaAdamW, HostUpdateGivesTheKernelsBits) {
  MF_REQUIRE_GPU();
  HostThreads pool(4);
  for (const int64_t n : {int64_t{200001}, int64_t{200000}})
    for (const DType gt : {DType::f32, DType::bf16})
      for (const DType mt : {DType::f32, DType::bf16}) {
        SCOPED_TRACE(cat("n ", n, ", g ", dtype_name(gt), ", moments ", dtype_name(mt)));
        Pool host;
        DevicePool dev;
        Tensor w = host.randn({n}, DType::f32), g = host.zeros({n}, gt), m = host.zeros({n}, mt),
               v = host.zeros({n}, mt), wc = host.zeros({n}, DType::bf16);
        cast(testing::exec(), host.randn({n}, DType::f32, 0.1), g);
        cast(testing::exec(), host.randn({n}, DType::f32, 0.01), m);
        cast(testing::exec(), host.uniform({n}, 0.0, 0.01, DType::f32), v);
        Tensor wd = dev.upload(w, DType::f32), gd = dev.upload(g, gt), md = dev.upload(m, mt), vd = dev.upload(v, mt),
               wcd = dev.poisoned({n}, DType::bf16);
        const AdamWStep s{3e-3, 0.9, 0.95, 1e-8, 0.1, 1 - std::pow(0.9, 7), 1 - std::pow(0.95, 7), 0.25};
        adamw_update(testing::exec(), wd, gd, md, vd, s, wcd);
        adamw_update_host(w, g, m, v, s, wc, n % 2 ? nullptr : &pool);
        for (const auto& [got, want, what] : {std::tuple{&wd, &w, "w"}, std::tuple{&md, &m, "m"},
                                              std::tuple{&vd, &v, "v"}, std::tuple{&wcd, &wc, "compute copy"}}) {
          std::vector<uint8_t> a(got->nbytes()), b(want->nbytes());
          device_copy(a.data(), Device::cpu, got->data(), Device::cuda, a.size());
          std::memcpy(b.data(), want->data(), b.size());
          EXPECT_TRUE(a == b) << what << " differs from the kernel's";
        }
      }
}

TEST(CudaMtpLoss, MatchesCpuBitForBit) {
  MF_REQUIRE_GPU();
  Pool host;
  DevicePool dev;
  for (const int64_t d : {1, 2, 5}) {
    Tensor l = host.uniform({d}, 100.0, 5000.0), out = host.randn({1});
    Tensor ld = dev.upload(l, DType::f64), outd = dev.upload(out, DType::f64);
    for (int rep = 0; rep < 3; ++rep) {
      mtp_loss_accumulate(testing::exec(), l, 4096, 0.1, out);
      mtp_loss_accumulate(testing::exec(), ld, 4096, 0.1, outd);
    }
    double got = 0;
    device_copy(&got, Device::cpu, outd.data(), Device::cuda, sizeof(got));
    EXPECT_EQ(got, out.ptr<double>()[0]) << d << " depths";
  }
}

// AdamWBatch: one launch over many tensors of odd sizes (one element, less than a block, many
// blocks), with and without decay, gives each the bits of its own adamw_update.
TEST(CudaAdamW, BatchGivesEachTensorItsOwnUpdatesBits) {
  MF_REQUIRE_GPU();
  for (const DType gt : {DType::f32, DType::bf16})
    for (const DType mt : {DType::f32, DType::bf16})
      for (const bool compute : {true, false}) {
        SCOPED_TRACE(cat("g ", dtype_name(gt), ", moments ", dtype_name(mt), compute ? ", compute copy" : ""));
        Pool host;
        DevicePool dev;
        const int64_t sizes[] = {1, 3, 4096, 4097, 20000, 131, 8};
        std::vector<AdamWEntry> batch, single;
        for (size_t i = 0; i < std::size(sizes); ++i) {
          const int64_t n = sizes[i];
          Tensor w = host.randn({n}, DType::f32), g = host.zeros({n}, gt), m = host.zeros({n}, mt),
                 v = host.zeros({n}, mt);
          cast(testing::exec(), host.randn({n}, DType::f32, 0.1), g);
          cast(testing::exec(), host.randn({n}, DType::f32, 0.01), m);
          cast(testing::exec(), host.uniform({n}, 0.0, 0.01, DType::f32), v);
          for (std::vector<AdamWEntry>* into : {&batch, &single})
            into->push_back({dev.upload(w, DType::f32), dev.upload(g, gt), dev.upload(m, mt), dev.upload(v, mt),
                             compute ? dev.poisoned({n}, DType::bf16) : Tensor(), i % 3 != 1});
        }
        const AdamWStep s{3e-3, 0.9, 0.95, 1e-8, 0.1, 1 - std::pow(0.9, 7), 1 - std::pow(0.95, 7), 0.25};
        const AdamWBatch b(batch);
        b.update(testing::exec(), s);
        b.update(testing::exec(), s);  // twice: the state carries over
        for (int rep = 0; rep < 2; ++rep)
          for (const AdamWEntry& e : single) {
            AdamWStep each = s;
            if (!e.decay) each.weight_decay = 0;
            adamw_update(testing::exec(), e.w, e.g, e.m, e.v, each, e.compute);
          }
        for (size_t i = 0; i < batch.size(); ++i)
          for (const auto& [got, want, what] :
               {std::tuple{&batch[i].w, &single[i].w, "w"}, std::tuple{&batch[i].m, &single[i].m, "m"},
                std::tuple{&batch[i].v, &single[i].v, "v"},
                std::tuple{&batch[i].compute, &single[i].compute, "copy"}}) {
            if (!got->defined()) continue;
            std::vector<uint8_t> a(got->nbytes()), c(want->nbytes());
            device_copy(a.data(), Device::cpu, got->data(), Device::cuda, a.size());
            device_copy(c.data(), Device::cpu, want->data(), Device::cuda, c.size());
            EXPECT_TRUE(a == c) << what << " of entry " << i << " (" << sizes[i] << " elements)";
          }
      }
}

}  // namespace
// cast on the GPU: the same bits as the CPU cast (one rounding to nearest even).
TEST(CudaCast, MatchesCpuBitForBit) {
  MF_REQUIRE_GPU();
  Pool pool;
  DevicePool dev;
  const int64_t n = 65537;
  Tensor x = pool.randn({n}, DType::f32, 3.0), b = pool.zeros({n}, DType::bf16);
  cast(testing::exec(), x, b);
  Tensor xd = dev.upload(x, DType::f32), bd = dev.poisoned({n}, DType::bf16), back = dev.poisoned({n}, DType::f32);
  cast(testing::exec(), xd, bd);
  cast(testing::exec(), bd, back);
  const std::vector<double> got = testing::download(bd), round = testing::download(back);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(got[i], bf16_to_f32(static_cast<uint16_t*>(b.data())[i])) << i;
    ASSERT_EQ(round[i], got[i]) << i;
  }
}

// Parameter init on the GPU: the CPU's values (the same Philox bits and double Box-Muller; CUDA's
// log/cos can differ from the host's in a double's last bit, which moves at most a rare f32 by
// one ulp), including from a global offset (a shard's first element).
TEST(CudaFillNormal, MatchesCpu) {
  MF_REQUIRE_GPU();
  Pool pool;
  DevicePool dev;
  const int64_t n = 100003;
  for (const uint64_t first : {uint64_t{0}, uint64_t{5} << 33}) {
    Tensor want = pool.zeros({n}, DType::f32);
    fill_normal_any(testing::exec(), want, 2026, 17, 0.5, 0.02, first);
    Tensor got = dev.poisoned({n}, DType::f32);
    fill_normal_any(testing::exec(), got, 2026, 17, 0.5, 0.02, first);
    const std::vector<double> g = testing::download(got);
    int64_t differ = 0;
    for (int64_t i = 0; i < n; ++i) {
      const double w = want.ptr<float>()[i];
      ASSERT_NEAR(g[static_cast<size_t>(i)], w, 1e-7 * std::abs(w)) << i;
      differ += g[static_cast<size_t>(i)] != w;
    }
    EXPECT_LE(differ, n / 1000) << "elements off by an ulp";
  }
}

// Matrix-view copy (2-D memcpy), add and fill on the GPU: exactly the CPU's elements.
TEST(CudaMatrixViews, CopyAddFillMatchCpu) {
  MF_REQUIRE_GPU();
  for (DType dt : {DType::f32, DType::bf16}) {
    Pool pool;
    DevicePool dev;
    Tensor src = pool.randn({50, 70}), dst = pool.randn({60, 90});
    Tensor sr = testing::rounded(pool, src, dt), dr = testing::rounded(pool, dst, dt);
    Tensor sd = dev.upload(src, dt), dd = dev.upload(dst, dt);
    const MatrixView s{sr, 40, 33, 70, 21}, d{dr, 40, 33, 90, 95}, sdv{sd, 40, 33, 70, 21}, ddv{dd, 40, 33, 90, 95};
    copy_matrix(testing::exec(), s, d);
    copy_matrix(testing::exec(), sdv, ddv);
    add_matrix(testing::exec(), s, d);
    add_matrix(testing::exec(), sdv, ddv);
    fill_matrix(testing::exec(), MatrixView{dr, 3, 5, 90, 7}, 0.25);
    fill_matrix(testing::exec(), MatrixView{dd, 3, 5, 90, 7}, 0.25);
    // one bf16 rounding of x + x is exact (a doubling): equality holds in both dtypes
    EXPECT_EQ(testing::rel_error(testing::download(dd), dr), 0.0) << dtype_name(dt);
  }
}

// Tensor::copy_from between host and device with row-strided views on either side
// (cudaMemcpy2DAsync; the experts' gate and up weights are every other row of gate_up_proj):
// exactly the rows named, nothing else touched.
TEST(CudaTensor, RowStridedCopiesMatchCpu) {
  MF_REQUIRE_GPU();
  Pool pool;
  DevicePool dev;
  const int64_t rows = 6, cols = 5;
  Tensor a = pool.randn({rows, cols}, DType::f32), b = pool.randn({2 * rows, cols}, DType::f32);
  // b with its rows parity, parity + 2, ... replaced by a's rows.
  const auto b_with_a_at = [&](int64_t parity) {
    std::vector<double> v(static_cast<size_t>(2 * rows * cols));
    for (int64_t i = 0; i < 2 * rows * cols; ++i) {
      const int64_t r = i / cols;
      v[static_cast<size_t>(i)] =
          testing::value_at(r % 2 == parity ? a : b, r % 2 == parity ? r / 2 * cols + i % cols : i);
    }
    return v;
  };
  Tensor d = dev.upload(b, DType::f32);
  d.step_rows(1, 2).copy_from(a);  // host contiguous -> device strided
  EXPECT_EQ(testing::download(d), b_with_a_at(1));
  Tensor back = pool.zeros({rows * cols}, DType::f32);
  back.copy_from(d.step_rows(1, 2));  // device strided -> host contiguous
  EXPECT_EQ(testing::max_abs_diff(back.view({rows, cols}), a), 0.0);
  Tensor e = dev.upload(b, DType::f32);
  e.step_rows(0, 2).copy_from(d.step_rows(1, 2));  // device strided -> device strided
  EXPECT_EQ(testing::download(e), b_with_a_at(0));
  Tensor f = dev.upload(pool.zeros({rows, cols}, DType::f32), DType::f32);
  f.copy_from(d.step_rows(1, 2));  // device strided -> device contiguous
  EXPECT_EQ(testing::download(f), testing::download(a));
  Tensor host = pool.zeros({2 * rows, cols}, DType::f32);
  host.copy_from(b);
  host.step_rows(1, 2).copy_from(d.step_rows(1, 2));  // device strided -> host strided
  EXPECT_EQ(testing::download(host), b_with_a_at(1));
}

}  // namespace moefold

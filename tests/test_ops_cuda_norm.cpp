// GPU parity of the row-wise ops: embedding, RMSNorm (and its fused residual forms), RoPE, SwiGLU and
// cross-entropy (ops/cuda/embedding.h, rmsnorm.h, rope.h, swiglu.h, cross_entropy.h), forward and
// backward, f32 and bf16, against the CPU ops run in f64 on the same (bf16-rounded) inputs
// (tests/cuda_testing.h). Every output is poisoned (NaN bytes) and followed by NaN guard elements
// that must survive; parameter gradients start from random values (ACCUMULATED), and the
// deterministic reductions must repeat bit for bit.
//
// Tolerances (relative: Frobenius error <= tol, and no element off by more than tol * max|ref|,
// since one wrong element hides in the Frobenius norm of a large tensor):
//  - kExact: embedding forward is a copy.
//  - kF32Elem 1e-6: f32 elementwise (RoPE, SwiGLU): a few float roundings and expf's 2 ulp.
//  - kF32Sum 1e-5: f32 results of float32 reductions (RMSNorm over C <= 4099 and dw over
//    N <= 5000 rows, embedding sums of <= 60 repeats, lse over V = 152k): the float sums' rounding
//    grows with sqrt(length) * 2^-24, 1e-6 at most for these sizes; 10x margin.
//  - kBf16 4e-3: a bf16 output is one rounding of a float result, at most 2^-9 = 1.95e-3
//    relative per element, plus the float error above; 2x margin.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
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

constexpr double kExact = 0.0;
constexpr double kF32Elem = 1e-6;
constexpr double kF32Sum = 1e-5;
constexpr double kBf16 = 4e-3;
constexpr int64_t kGuard = 67;  // NaN elements after each output

double sum_tol(DType dt) { return dt == DType::f32 ? kF32Sum : kBf16; }
double elem_tol(DType dt) { return dt == DType::f32 ? kF32Elem : kBf16; }

// A device output: NaN bytes (or `init`, stored as `dtype`) followed by kGuard NaN elements.
struct Guarded {
  Tensor t;
  Tensor guard;
};
Guarded guarded(DevicePool& dev, Shape shape, DType dtype, const Tensor* init = nullptr, size_t byte_offset = 0) {
  const auto pad = static_cast<int64_t>((byte_offset + dtype_size(dtype) - 1) / dtype_size(dtype));
  Tensor all = dev.poisoned({shape.numel() + pad + kGuard}, dtype);
  char* base = static_cast<char*>(all.data()) + byte_offset;
  Tensor t(base, dtype, shape, Device::cuda);
  if (init != nullptr) {
    Tensor up = dev.upload(*init, dtype);
    device_copy(t.data(), Device::cuda, up.data(), Device::cuda, t.nbytes());
  }
  return {t, Tensor(base + t.nbytes(), dtype, {kGuard}, Device::cuda)};
}
void expect_guard_intact(const Guarded& g, const std::string& what) {
  const std::vector<double> tail = download(g.guard);
  for (size_t i = 0; i < tail.size(); ++i)
    if (!std::isnan(tail[i])) ADD_FAILURE() << what << ": write past the end, guard element " << i << " = " << tail[i];
}

void expect_close(const std::vector<double>& gpu, const Tensor& ref, double tol, const std::string& what) {
  ASSERT_EQ(static_cast<int64_t>(gpu.size()), ref.numel()) << what;
  EXPECT_LE(rel_error(gpu, ref), tol) << what;
  double ref_max = 0, worst = 0;
  int64_t worst_i = -1;
  for (int64_t i = 0; i < ref.numel(); ++i) {
    const double r = testing::value_at(ref, i), g = gpu[static_cast<size_t>(i)];
    ref_max = std::max(ref_max, std::abs(r));
    const double d = std::isfinite(g) ? std::abs(g - r) : INFINITY;
    if (d > worst || worst_i < 0) {
      worst = d;
      worst_i = i;
    }
  }
  EXPECT_LE(worst, tol * ref_max) << what << ": element " << worst_i << " (max |ref| " << ref_max << ")";
}

std::string name(DType a) { return std::string(dtype_name(a)); }
std::string name(DType a, DType b) { return name(a) + "/" + name(b); }

// ---- embedding -------------------------------------------------------------------------------

TEST(CudaNorm, EmbeddingMatchesCpu) {
  MF_REQUIRE_GPU();
  struct Case {
    int64_t n, v, c;
  };
  // Repeated ids everywhere (N > V); V = 1, 2: every token one of one or two rows; N > 2048 and
  // C > 1024, 2048: several passes over the ids and over the columns of the backward kernel; C a
  // multiple of 8 (16-byte loads of dout) and not.
  const Case cases[] = {{37, 23, 129}, {2051, 61, 1037}, {2053, 61, 2056}, {3000, 2, 33},
                        {3000, 2, 32}, {5, 1, 7},        {1, 3, 1},        {1, 3, 8}};
  for (const Case cs : cases) {
    for (DType dt : {DType::f32, DType::bf16}) {
      for (DType gdt : {dt, DType::f32}) {
        if (dt == DType::f32 && gdt != dt) continue;
        SCOPED_TRACE(::testing::Message() << "N=" << cs.n << " V=" << cs.v << " C=" << cs.c << " " << name(dt, gdt));
        Pool pool;
        DevicePool dev;
        Tensor ids = pool.ints({cs.n}, 0, static_cast<int32_t>(cs.v));
        int32_t* idp = ids.ptr<int32_t>();
        idp[0] = static_cast<int32_t>(cs.v - 1);  // the last row, also at the last token
        if (cs.n > 2) {
          idp[cs.n - 1] = idp[0];
          idp[1] = 0;
        }
        Tensor ids_d = dev.upload(ids, DType::i32);

        Tensor table = pool.randn({cs.v, cs.c});
        Tensor out_ref = pool.zeros({cs.n, cs.c});
        embedding_forward(testing::exec(), ids, rounded(pool, table, dt), out_ref);
        Guarded out = guarded(dev, {cs.n, cs.c}, dt);
        embedding_forward(testing::exec(), ids_d, dev.upload(table, dt), out.t);
        expect_close(download(out.t), out_ref, kExact, "embedding out");
        expect_guard_intact(out, "embedding out");

        Tensor dout = pool.randn({cs.n, cs.c}), dtable0 = pool.randn({cs.v, cs.c});
        Tensor dtable_ref = rounded(pool, dtable0, gdt);
        embedding_backward(testing::exec(), ids, rounded(pool, dout, dt), dtable_ref);
        Tensor dout_d = dev.upload(dout, dt);
        Guarded dtable = guarded(dev, {cs.v, cs.c}, gdt, &dtable0);
        embedding_backward(testing::exec(), ids_d, dout_d, dtable.t);
        expect_close(download(dtable.t), dtable_ref, sum_tol(gdt), "embedding dtable");
        expect_guard_intact(dtable, "embedding dtable");
        Guarded again = guarded(dev, {cs.v, cs.c}, gdt, &dtable0);
        embedding_backward(testing::exec(), ids_d, dout_d, again.t);
        EXPECT_EQ(download(again.t), download(dtable.t)) << "embedding dtable is not deterministic";
      }
    }
  }
}

// ---- RMSNorm ---------------------------------------------------------------------------------

TEST(CudaNorm, RmsNormMatchesCpu) {
  MF_REQUIRE_GPU();
  struct Case {
    int64_t n, c;
  };
  struct Types {
    DType x, w, dw;
  };
  // Warp-per-row (C <= 1024) and block-per-row kernels; dw over one chunk (N <= 64) and over many
  // (N = 3000, 5000: partials and arrival counters, reset for the next case); N = 1.
  const Case cases[] = {{5, 37}, {67, 1500}, {3000, 37}, {5000, 128}, {1, 4099}, {129, 2048}};
  const Types types[] = {{DType::f32, DType::f32, DType::f32},
                         {DType::bf16, DType::bf16, DType::bf16},
                         {DType::bf16, DType::f32, DType::f32},
                         {DType::bf16, DType::bf16, DType::f32}};
  const double eps = 1e-6;
  for (const Case cs : cases) {
    for (const Types ty : types) {
      SCOPED_TRACE(::testing::Message() << "N=" << cs.n << " C=" << cs.c << " x " << name(ty.x) << " w " << name(ty.w)
                                        << " dw " << name(ty.dw));
      Pool pool;
      DevicePool dev;
      Tensor x = pool.randn({cs.n, cs.c}, DType::f64, 2.0), w = pool.uniform({cs.c}, 0.25, 1.75);
      Tensor xr = rounded(pool, x, ty.x), wr = rounded(pool, w, ty.w);
      Tensor y_ref = pool.zeros({cs.n, cs.c}), rstd_ref = pool.zeros({cs.n});
      rmsnorm_forward(testing::exec(), xr, wr, eps, y_ref, rstd_ref);
      Tensor xd = dev.upload(x, ty.x), wd = dev.upload(w, ty.w);
      Guarded y = guarded(dev, {cs.n, cs.c}, ty.x), rstd = guarded(dev, {cs.n}, DType::f32);
      rmsnorm_forward(testing::exec(), xd, wd, eps, y.t, rstd.t);
      expect_close(download(y.t), y_ref, sum_tol(ty.x), "rmsnorm y");
      expect_close(download(rstd.t), rstd_ref, kF32Sum, "rmsnorm rstd");
      expect_guard_intact(y, "rmsnorm y");
      expect_guard_intact(rstd, "rmsnorm rstd");

      Tensor dy = pool.randn({cs.n, cs.c}), dw0 = pool.randn({cs.c});
      Tensor dx_ref = pool.zeros({cs.n, cs.c}), dw_ref = rounded(pool, dw0, ty.dw);
      rmsnorm_backward(testing::exec(), xr, wr, rstd_ref, rounded(pool, dy, ty.x), dx_ref, dw_ref);
      Tensor dyd = dev.upload(dy, ty.x);
      Guarded dx = guarded(dev, {cs.n, cs.c}, ty.x), dw = guarded(dev, {cs.c}, ty.dw, &dw0);
      rmsnorm_backward(testing::exec(), xd, wd, rstd.t, dyd, dx.t, dw.t);
      expect_close(download(dx.t), dx_ref, sum_tol(ty.x), "rmsnorm dx");
      expect_close(download(dw.t), dw_ref, sum_tol(ty.dw), "rmsnorm dw");
      expect_guard_intact(dx, "rmsnorm dx");
      expect_guard_intact(dw, "rmsnorm dw");

      Guarded dx2 = guarded(dev, {cs.n, cs.c}, ty.x), dw2 = guarded(dev, {cs.c}, ty.dw, &dw0);
      rmsnorm_backward(testing::exec(), xd, wd, rstd.t, dyd, dx2.t, dw2.t);
      EXPECT_EQ(download(dx2.t), download(dx.t)) << "rmsnorm dx is not deterministic";
      EXPECT_EQ(download(dw2.t), download(dw.t)) << "rmsnorm dw is not deterministic";

      if (ty.x == DType::bf16) {  // dx not 4-byte aligned: the same bits
        Guarded dx3 = guarded(dev, {cs.n, cs.c}, ty.x, nullptr, 2), dw3 = guarded(dev, {cs.c}, ty.dw, &dw0);
        rmsnorm_backward(testing::exec(), xd, wd, rstd.t, dyd, dx3.t, dw3.t);
        EXPECT_EQ(download(dx3.t), download(dx.t)) << "rmsnorm dx at a 2-byte offset";
        EXPECT_EQ(download(dw3.t), download(dw.t)) << "rmsnorm dw (dx at a 2-byte offset)";
        expect_guard_intact(dx3, "rmsnorm dx at a 2-byte offset");
      }

      // The residual stream's fused forms: bit for bit their compositions of CUDA ops.
      Tensor res0 = pool.randn({cs.n, cs.c});
      Guarded dres = guarded(dev, {cs.n, cs.c}, ty.x, &res0), dw4 = guarded(dev, {cs.c}, ty.dw, &dw0);
      rmsnorm_backward_add(testing::exec(), xd, wd, rstd.t, dyd, dres.t, dw4.t);
      Tensor dres_composed = dev.upload(res0, ty.x);
      add_inplace(testing::exec(), dres_composed, dx.t);
      EXPECT_EQ(download(dres.t), download(dres_composed)) << "rmsnorm_backward_add dx";
      EXPECT_EQ(download(dw4.t), download(dw.t)) << "rmsnorm_backward_add dw";
      expect_guard_intact(dres, "rmsnorm_backward_add dx");
      expect_guard_intact(dw4, "rmsnorm_backward_add dw");

      Tensor ad = dev.upload(pool.randn({cs.n, cs.c}), ty.x);
      Tensor h_composed = dev.upload(x, ty.x);
      add_inplace(testing::exec(), h_composed, ad);
      Guarded y_composed = guarded(dev, {cs.n, cs.c}, ty.x), rstd_composed = guarded(dev, {cs.n}, DType::f32);
      rmsnorm_forward(testing::exec(), h_composed, wd, eps, y_composed.t, rstd_composed.t);
      Guarded h5 = guarded(dev, {cs.n, cs.c}, ty.x), h25 = guarded(dev, {cs.n, cs.c}, ty.x);
      Guarded y5 = guarded(dev, {cs.n, cs.c}, ty.x), rstd5 = guarded(dev, {cs.n}, DType::f32);
      add_rmsnorm_forward(testing::exec(), xd, ad, wd, eps, h5.t, y5.t, rstd5.t, h25.t);
      const std::vector<double> h_want = download(h_composed);
      EXPECT_EQ(download(h5.t), h_want) << "add_rmsnorm_forward h";
      EXPECT_EQ(download(h25.t), h_want) << "add_rmsnorm_forward h2";
      EXPECT_EQ(download(y5.t), download(y_composed.t)) << "add_rmsnorm_forward y";
      EXPECT_EQ(download(rstd5.t), download(rstd_composed.t)) << "add_rmsnorm_forward rstd";
      for (const Guarded* g : {&h5, &h25, &y5, &rstd5}) expect_guard_intact(*g, "add_rmsnorm_forward");
    }
  }
}

// ---- RoPE ------------------------------------------------------------------------------------

TEST(CudaNorm, RopeMatchesCpu) {
  MF_REQUIRE_GPU();
  struct Case {
    int64_t b, s, h, d;
  };
  // D 128 and 24: 8 (bf16) or 4 pairs a thread, and 4; D 10 and 2: one (rope.cu's rope_width).
  for (const Case cs : {Case{2, 7, 3, 10}, Case{1, 33, 5, 128}, Case{2, 5, 3, 24}, Case{3, 1, 1, 2}}) {
    for (DType dt : {DType::f32, DType::bf16}) {
      for (DType tdt : {dt, DType::f32}) {
        if (dt == DType::f32 && tdt != dt) continue;
        SCOPED_TRACE(::testing::Message() << "B=" << cs.b << " S=" << cs.s << " H=" << cs.h << " D=" << cs.d << " x "
                                          << name(dt) << " table " << name(tdt));
        Pool pool;
        DevicePool dev;
        const double tol = elem_tol(dt);
        const Shape shape{cs.b, cs.s, cs.h, cs.d};
        // Tables of S rows (plain) and P > S rows (explicit positions, any order, repeats).
        const int64_t p = cs.s + 11;
        Tensor cos = pool.zeros({cs.s, cs.d}), sin = pool.zeros({cs.s, cs.d});
        Tensor cos_p = pool.zeros({p, cs.d}), sin_p = pool.zeros({p, cs.d});
        rope_table(10000.0, cos, sin);
        rope_table(500.0, cos_p, sin_p);
        Tensor cr = rounded(pool, cos, tdt), sr = rounded(pool, sin, tdt);
        Tensor cpr = rounded(pool, cos_p, tdt), spr = rounded(pool, sin_p, tdt);
        Tensor cd = dev.upload(cos, tdt), sd = dev.upload(sin, tdt);
        Tensor cpd = dev.upload(cos_p, tdt), spd = dev.upload(sin_p, tdt);
        Tensor pos = pool.ints({cs.s}, 0, static_cast<int32_t>(p));
        pos.ptr<int32_t>()[0] = static_cast<int32_t>(p - 1);
        Tensor pos_d = dev.upload(pos, DType::i32);

        // x `skew` elements past an aligned address: narrower vectors (2 pairs a thread, or 1; an
        // interleaved pair one element off is read element by element).
        const auto skewed = [&](const Tensor& host, int64_t skew) {
          const Tensor buf = dev.empty({host.numel() + skew}, dt);
          const Tensor view(static_cast<char*>(buf.data()) + skew * dtype_size(dt), dt, host.shape(), Device::cuda);
          view.copy_from(dev.upload(host, dt));
          return view;
        };

        // forward, backward, forward_at, backward_at; pairs split in halves or interleaved; x
        // aligned, or skewed by 2 (halves) or 1 (interleaved) elements
        for (int variant = 0; variant < 16; ++variant) {
          SCOPED_TRACE(variant);
          const bool il = variant % 8 >= 4;
          Tensor x = pool.randn(shape);
          Tensor ref = rounded(pool, x, dt);
          Tensor xd = variant >= 8 ? skewed(x, il ? 1 : 2) : dev.upload(x, dt);
          switch (variant % 4) {
            case 0:
              rope_forward(testing::exec(), ref, cr, sr, il);
              rope_forward(testing::exec(), xd, cd, sd, il);
              break;
            case 1:
              rope_backward(testing::exec(), ref, cr, sr, il);
              rope_backward(testing::exec(), xd, cd, sd, il);
              break;
            case 2:
              rope_forward_at(testing::exec(), ref, pos, cpr, spr, il);
              rope_forward_at(testing::exec(), xd, pos_d, cpd, spd, il);
              break;
            default:
              rope_backward_at(testing::exec(), ref, pos, cpr, spr, il);
              rope_backward_at(testing::exec(), xd, pos_d, cpd, spd, il);
              break;
          }
          expect_close(download(xd), ref, tol, "rope");
        }
      }
    }
  }
}

// ---- SwiGLU ----------------------------------------------------------------------------------

TEST(CudaNorm, SwiGluMatchesCpu) {
  MF_REQUIRE_GPU();
  struct Case {
    int64_t n, f;
    size_t h_offset;  // bytes past a 256-byte boundary where h and dh start
  };
  // 16-byte vectors: halves for F % 8 == 0 with every buffer 16-byte aligned ({33, 768, 0});
  // pairs for N * F % 4 == 0 with h 8-byte aligned ({33, 768, *}, {6, 130, 0}); the rest scalar.
  for (const Case cs :
       {Case{37, 131, 0}, Case{2, 4097, 0}, Case{1, 1, 0}, Case{33, 768, 0}, Case{33, 768, 8}, Case{6, 130, 0}}) {
    for (GateUp layout : {GateUp::halves, GateUp::pairs}) {
      for (DType dt : {DType::f32, DType::bf16}) {
        SCOPED_TRACE(::testing::Message() << "N=" << cs.n << " F=" << cs.f << " h at +" << cs.h_offset << " "
                                          << (layout == GateUp::pairs ? "pairs " : "halves ") << name(dt));
        Pool pool;
        DevicePool dev;
        Tensor gu = pool.randn({cs.n, 2 * cs.f}, DType::f64, 3.0), dh = pool.randn({cs.n, cs.f});
        Tensor gur = rounded(pool, gu, dt);
        Tensor h_ref = pool.zeros({cs.n, cs.f}), dgu_ref = pool.zeros({cs.n, 2 * cs.f});
        swiglu_forward(testing::exec(), gur, h_ref, layout);
        swiglu_backward(testing::exec(), gur, rounded(pool, dh, dt), dgu_ref, layout);
        Tensor gud = dev.upload(gu, dt);
        Guarded h = guarded(dev, {cs.n, cs.f}, dt, nullptr, cs.h_offset), dgu = guarded(dev, {cs.n, 2 * cs.f}, dt);
        Guarded dhd = guarded(dev, {cs.n, cs.f}, dt, &dh, cs.h_offset);
        swiglu_forward(testing::exec(), gud, h.t, layout);
        swiglu_backward(testing::exec(), gud, dhd.t, dgu.t, layout);
        expect_close(download(h.t), h_ref, elem_tol(dt), "swiglu h");
        expect_close(download(dgu.t), dgu_ref, elem_tol(dt), "swiglu dgu");
        expect_guard_intact(h, "swiglu h");
        expect_guard_intact(dgu, "swiglu dgu");
      }
    }
  }
}

// ---- cross-entropy ---------------------------------------------------------------------------

// dlogits element by element: relative to each element (the softmax entries are tiny next to the
// target entries and would hide in a Frobenius norm), plus 1e-6 * grad_scale at the target, where
// p - 1 cancels; ignored rows exactly zero.
void expect_dlogits_close(const std::vector<double>& gpu, const Tensor& ref, const Tensor& targets, double grad_scale,
                          double tol) {
  const int64_t n = ref.size(0), v = ref.size(1);
  const int32_t* t = targets.ptr<int32_t>();
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < v; ++j) {
      const double g = gpu[static_cast<size_t>(i * v + j)], r = testing::value_at(ref, i * v + j);
      const bool ok =
          t[i] == kIgnoreTarget ? g == 0.0 : std::abs(g - r) <= tol * std::abs(r) + (j == t[i] ? 1e-6 * grad_scale : 0);
      if (!ok && bad++ < 5) ADD_FAILURE() << "dlogits[" << i << ", " << j << "] = " << g << ", want " << r;
    }
  EXPECT_EQ(bad, 0) << "wrong dlogits elements";
}

void check_cross_entropy(int64_t n, int64_t v, DType dt) {
  SCOPED_TRACE(::testing::Message() << "N=" << n << " V=" << v << " " << name(dt));
  Pool pool;
  DevicePool dev;
  Tensor logits = pool.randn({n, v}, DType::f64, 3.0);
  Tensor targets = pool.ints({n}, 0, static_cast<int32_t>(v));
  int32_t* tp = targets.ptr<int32_t>();
  tp[0] = static_cast<int32_t>(v - 1);
  if (n > 1) tp[1] = kIgnoreTarget;
  if (n > 2) tp[2] = 0;
  if (n > 7) tp[n - 1] = kIgnoreTarget;
  Tensor lr = rounded(pool, logits, dt);
  Tensor lse_ref = pool.zeros({n});
  const double loss_ref = cross_entropy_forward(testing::exec(), lr, targets, lse_ref);
  Tensor ld = dev.upload(logits, dt), td = dev.upload(targets, DType::i32);
  Guarded lse = guarded(dev, {n}, DType::f32);
  const double loss = cross_entropy_forward(testing::exec(), ld, td, lse.t);
  EXPECT_NEAR(loss, loss_ref, kF32Sum * std::abs(loss_ref)) << "cross-entropy loss";
  EXPECT_EQ(cross_entropy_forward(testing::exec(), ld, td, lse.t), loss) << "cross-entropy loss is not deterministic";
  {  // the sum left on the device: the same bits, NaN returned
    Tensor sum_d = dev.empty({1}, DType::f64);
    EXPECT_TRUE(std::isnan(cross_entropy_forward(testing::exec(), ld, td, lse.t, sum_d)));
    Tensor sum_h = pool.zeros({1}, DType::f64);
    sum_h.copy_from(sum_d);
    EXPECT_EQ(sum_h.ptr<double>()[0], loss) << "cross-entropy loss on the device";
  }
  const std::vector<double> lse_gpu = download(lse.t);
  expect_close(lse_gpu, lse_ref, kF32Sum, "cross-entropy lse");
  for (int64_t i = 0; i < n; ++i) {
    if (tp[i] == kIgnoreTarget) {
      EXPECT_EQ(lse_gpu[static_cast<size_t>(i)], 0.0) << "lse of ignored row " << i;
    }
  }
  expect_guard_intact(lse, "cross-entropy lse");

  const double grad_scale = 0.37 / static_cast<double>(n);
  Tensor dl_ref = pool.zeros({n, v});
  cross_entropy_backward(testing::exec(), lr, targets, lse_ref, grad_scale, dl_ref);
  Guarded dl = guarded(dev, {n, v}, dt);
  cross_entropy_backward(testing::exec(), ld, td, lse.t, grad_scale, dl.t);
  const std::vector<double> dl_gpu = download(dl.t);
  expect_dlogits_close(dl_gpu, dl_ref, targets, grad_scale, dt == DType::f32 ? kF32Sum : kBf16);
  expect_guard_intact(dl, "cross-entropy dlogits");
  // In place (dlogits = logits): the same bits.
  cross_entropy_backward(testing::exec(), ld, td, lse.t, grad_scale, ld);
  EXPECT_EQ(download(ld), dl_gpu) << "cross-entropy backward in place";
}

TEST(CudaNorm, CrossEntropyMatchesCpu) {
  MF_REQUIRE_GPU();
  // Rows read element by element (V = 1001, 37: not a multiple of a 16-byte pack; V = 1: the
  // loss is 0) and in packs (V = 1000, 8); N > 1024 rows for the loss sum.
  for (DType dt : {DType::f32, DType::bf16}) {
    check_cross_entropy(13, 1001, dt);
    check_cross_entropy(7, 1000, dt);
    check_cross_entropy(3, 8, dt);
    check_cross_entropy(3, 1, dt);
    check_cross_entropy(1100, 37, dt);
  }
}

TEST(CudaNorm, CrossEntropyFullVocabularyMatchesCpu) {
  MF_REQUIRE_GPU();
  for (DType dt : {DType::f32, DType::bf16}) check_cross_entropy(5, 151936, dt);  // Qwen's vocabulary
}

}  // namespace
}  // namespace moefold

// Core: tensor views, planned arenas, bf16 conversion, the counter-based RNG.
#include <atomic>
#include <cmath>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "moefold/core/device.h"
#include "moefold/core/gpu_activity.h"
#include "moefold/core/host_threads.h"
#include "moefold/core/memory.h"
#include "moefold/core/rng.h"
#include "testing.h"

namespace moefold {
namespace {

TEST(Philox, KnownAnswer) {
  // Random123's known-answer vectors for philox4x32-10.
  auto r = philox4x32({0, 0, 0, 0}, {0, 0});
  EXPECT_EQ(r[0], 0x6627e8d5u);
  EXPECT_EQ(r[1], 0xe169c58du);
  EXPECT_EQ(r[2], 0xbc57ac4cu);
  EXPECT_EQ(r[3], 0x9b00dbd8u);
  r = philox4x32({0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, {0xa4093822u, 0x299f31d0u});
  EXPECT_EQ(r[0], 0xd16cfe09u);
  EXPECT_EQ(r[1], 0x94fdccebu);
}

}  // namespace
}  // namespace moefold

namespace moefold {
namespace {

TEST(BFloat16, RoundsToNearestEvenAndRoundTrips) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(bf16_to_f32(0x3f80), 1.0f);
  // 1 + 2^-8 is exactly halfway between two bf16 values: ties to even (down to 1.0).
  EXPECT_EQ(f32_to_bf16(1.0f + 1.0f / 256), 0x3f80);
  // 1 + 3 * 2^-8 is halfway between 1+2^-7 (odd) and 1+2^-6 (even): up.
  EXPECT_EQ(f32_to_bf16(1.0f + 3.0f / 256), 0x3f82);
  EXPECT_EQ(f32_to_bf16(-2.5f), 0xc020);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::nanf("")))));
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(INFINITY)), INFINITY);
  for (uint32_t h = 0; h < 0x10000; h += 7) {
    float f = bf16_to_f32(static_cast<uint16_t>(h));
    if (!std::isnan(f)) {
      EXPECT_EQ(f32_to_bf16(f), h);
    }
  }
  DType t;
  ASSERT_TRUE(dtype_from_name("BF16", &t));
  EXPECT_EQ(t, DType::bf16);
  EXPECT_EQ(dtype_size(DType::bf16), 2u);
  EXPECT_FALSE(dtype_from_name("Q4", &t));
}

TEST(Tensor, ViewsSliceAndReshape) {
  float buf[24];
  for (int i = 0; i < 24; ++i) buf[i] = static_cast<float>(i);
  Tensor t(buf, DType::f32, {4, 3, 2});
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.stride(0), 6);
  EXPECT_EQ(t.stride(-1), 1);
  EXPECT_TRUE(t.contiguous());
  Tensor s = t.slice(1, 3);
  EXPECT_EQ(s.shape(), Shape({2, 3, 2}));
  EXPECT_EQ(s.ptr<float>()[0], 6.0f);
  Tensor v = s.view({6, 2});
  EXPECT_EQ(v.ptr<float>()[11], 17.0f);
  EXPECT_EQ(t.str(), "F32[4, 3, 2]");
  EXPECT_DEATH(t.ptr<double>(), "accessed as F64");
  EXPECT_DEATH(t.slice(2, 5), "slice");
  EXPECT_DEATH(t.view({5, 5}), "view");
}

TEST(Tensor, StepRowsAndRowStridedCopies) {
  std::vector<float> buf(18);
  for (int i = 0; i < 18; ++i) buf[i] = static_cast<float>(i);
  Tensor t(buf.data(), DType::f32, {6, 3});
  Tensor odd = t.step_rows(1, 2);  // rows 1, 3, 5
  EXPECT_EQ(odd.shape(), Shape({3, 3}));
  EXPECT_EQ(odd.stride(0), 6);
  EXPECT_FALSE(odd.contiguous());
  EXPECT_EQ(t.slice(0, 5).step_rows(1, 2).size(0), 2);
  EXPECT_EQ(t.slice(0, 5).step_rows(0, 2).size(0), 3);
  std::vector<float> out(9);
  Tensor(out.data(), DType::f32, {9}).copy_from(odd);  // strided -> contiguous, any shape of that numel
  EXPECT_EQ(out, std::vector<float>({3, 4, 5, 9, 10, 11, 15, 16, 17}));
  std::vector<float> in = {100, 101, 102, 103, 104, 105, 106, 107, 108};
  t.step_rows(0, 2).copy_from(Tensor(in.data(), DType::f32, {3, 3}));  // contiguous -> strided
  EXPECT_EQ(buf, std::vector<float>({100, 101, 102, 3, 4, 5, 103, 104, 105, 9, 10, 11, 106, 107, 108, 15, 16, 17}));
  std::vector<float> other(18, -1.0f);  // strided -> strided, rows alike
  Tensor(other.data(), DType::f32, {6, 3}).step_rows(1, 2).copy_from(odd);
  EXPECT_EQ(other, std::vector<float>({-1, -1, -1, 3, 4, 5, -1, -1, -1, 9, 10, 11, -1, -1, -1, 15, 16, 17}));
  // Higher dims: every other [3, 2] block of a [4, 3, 2] tensor is rows of 6 contiguous floats.
  std::vector<float> blocks(24), picked(12);
  for (int i = 0; i < 24; ++i) blocks[i] = static_cast<float>(i);
  Tensor(picked.data(), DType::f32, {2, 6}).copy_from(Tensor(blocks.data(), DType::f32, {4, 3, 2}).step_rows(1, 2));
  EXPECT_EQ(picked, std::vector<float>({6, 7, 8, 9, 10, 11, 18, 19, 20, 21, 22, 23}));
  std::vector<float> wide(24), tall(24);  // 12 elements each: 3 rows of 4 vs 4 rows of 3
  EXPECT_DEATH(Tensor(wide.data(), DType::f32, {6, 4})
                   .step_rows(0, 2)
                   .copy_from(Tensor(tall.data(), DType::f32, {8, 3}).step_rows(0, 2)),
               "rows of 3 vs 4");
  EXPECT_DEATH(t.step_rows(0, 0), "rows");
}

// DimShard chunks interleave row by row: a rank holding rows [offset, offset + n) of each of 2
// chunks holds the contiguous range [2 offset, 2 (offset + n)) of the whole dimension, and
// fill_normal_shard gives it exactly those elements of the whole tensor's initialisation.
// A large fill_normal (split over the cores) draws exactly the values one thread would.
TEST(Rng, LargeFillNormalIsTheSequentialDraw) {
  const int64_t n = (int64_t{1} << 22) + 12345;
  std::vector<float> v(static_cast<size_t>(n));
  fill_normal(Tensor(v.data(), DType::f32, {n}), 7, 99, 0.5, 0.02, 1000);
  for (int64_t i = 0; i < n; i += 4099)
    ASSERT_EQ(v[static_cast<size_t>(i)], static_cast<float>(0.5 + 0.02 * rng_normal(7, 99, 1000 + i))) << i;
  ASSERT_EQ(v.back(), static_cast<float>(0.5 + 0.02 * rng_normal(7, 99, 1000 + n - 1)));
}

// HostThreads runs every iteration exactly once, over several loops, with any thread count.
TEST(HostThreads, EveryIterationRunsOnce) {
  for (const int threads : {1, 2, 5}) {
    HostThreads pool(threads);
    EXPECT_EQ(pool.size(), threads);
    for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{1000}}) {
      std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
      pool.parallel_for(n, [&](int64_t i) { ++hits[static_cast<size_t>(i)]; });
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[static_cast<size_t>(i)].load(), 1) << "iteration " << i;
    }
  }
}

TEST(Memory, DimShardOfInterleavedChunksIsAContiguousRange) {
  // Experts 1..2 of 3; rows 1..2 of each of the 2 chunks of 5 along dimension 1.
  Memory mem(DType::f32);
  const auto bind = [&] {
    mem.param({.name = "w",
               .shape = {2, 4, 3},
               .init_std = 1.0,
               .group = ParamGroup::expert,
               .shard_offset = 1,
               .global_rows = 3,
               .dim_shard = {1, 1, 5, 2}});
  };
  mem.bind_twice(bind);
  const Param& p = mem.params().front();
  std::vector<float> whole(3 * 10 * 3);
  EXPECT_EQ(p.global_shape(), Shape({3, 10, 3}));
  for (int64_t e = 0; e < 2; ++e)
    for (int64_t c = 0; c < 4; ++c)
      for (int64_t k = 0; k < 3; ++k)
        EXPECT_EQ(p.global_index((e * 4 + c) * 3 + k), ((e + 1) * 10 + 2 + c) * 3 + k) << e << " " << c << " " << k;
  fill_normal_shard(p, 5, 6, 0.0, 1.0);
  fill_normal(Tensor(whole.data(), DType::f32, {3, 10, 3}), 5, 6, 0.0, 1.0);
  for (int64_t i = 0; i < p.value.numel(); ++i)
    ASSERT_EQ(p.value.ptr<float>()[i], whole[static_cast<size_t>(p.global_index(i))]) << i;
}

TEST(Memory, MeasureThenAllocateGivesTheSameLayout) {
  Memory mem(DType::f32);
  auto bind = [&] {
    Tensor w = mem.param({.name = "w", .shape = {3, 5}, .init_std = 0.02});
    Tensor a = mem.act({7});
    Tensor i = mem.act({2, 2}, DType::i32);
    return std::tuple{w, a, i};
  };
  auto [w0, a0, i0] = bind();
  EXPECT_TRUE(mem.measuring());
  EXPECT_EQ(w0.data(), nullptr);
  EXPECT_EQ(mem.params().size(), 1u);
  mem.allocate();
  auto [w, a, i] = bind();
  mem.finish_binding();
  ASSERT_NE(w.data(), nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(w.data()) % 64, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % 64, 0u);
  EXPECT_EQ(w.ptr<float>()[14], 0.0f);  // zero-initialised
  const Param* p = mem.find("w");
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(p->grad.shape(), Shape({3, 5}));
  EXPECT_NE(p->grad.data(), p->value.data());
  EXPECT_EQ(mem.find("nope"), nullptr);
  EXPECT_DEATH(mem.param({.name = "w", .shape = {1}, .init = Init::ones, .decay = false}), "registered twice");
}

TEST(Memory, RealPassMustMatchMeasuredPass) {
  Memory mem(DType::f32);
  mem.act({100});
  mem.allocate();
  mem.act({4});  // smaller: fits, but the layouts differ
  EXPECT_DEATH(mem.finish_binding(), "differs from the measuring pass");
}

// Layers share one workspace: scratch() of every layer starts at the same byte (so layers overlap)
// while one layer's scratch tensors never overlap each other; a layer recomputed whole keeps its
// act()s in its slot of the recomputed layers' block (layers of one slot overlap, slots do not);
// ScratchActs sends act() to scratch(); result() is always kept; the plan's parts name both blocks.
TEST(Memory, LayersShareScratchAndRecomputedLayersShareTheirSlot) {
  Memory mem(DType::f32);
  struct Taken {
    Tensor kept0, a0, b0, slot0, kept1, a1, slot1a, slot1b, redirected, result, c2, slot2;
  };
  auto bind = [&] {
    Taken t;
    mem.begin_layer();  // layer 0: kept
    t.kept0 = mem.act({10});
    t.a0 = mem.scratch({16});
    t.b0 = mem.scratch({16});
    mem.end_layer();
    mem.begin_layer(0);  // layer 1: recomputed, slot 0
    t.slot0 = mem.act({40});
    t.a1 = mem.scratch({64});
    {
      const Memory::ScratchActs s(mem, true);
      t.redirected = mem.act({8});
    }
    t.result = mem.result({2}, DType::i64);
    mem.end_layer();
    mem.begin_layer(1);  // layer 2: slot 1
    t.slot1a = mem.act({20});
    t.c2 = mem.scratch({4});
    mem.end_layer();
    mem.begin_layer(0);  // layer 3: slot 0 again
    t.slot2 = mem.act({24});
    t.slot1b = mem.act({24});
    mem.end_layer();
    t.kept1 = mem.scratch({3});  // outside a layer: kept
    return t;
  };
  bind();
  EXPECT_EQ(mem.scratch_bytes(), 64 * 4 + 64);  // layer 1's scratch: 64 floats, then 8
  EXPECT_EQ(mem.recompute_bytes(), 256 + 128);  // slot 0: layer 3's two 96 B tensors (64 B aligned); slot 1
  bool shared = false, recomputed = false;
  for (const Memory::PartBytes& p : mem.part_bytes()) {
    shared |= p.part == "layers' shared workspace" && p.device == mem.scratch_bytes();
    recomputed |= p.part == "recomputed layers' block" && p.device == mem.recompute_bytes();
  }
  EXPECT_TRUE(shared && recomputed);
  mem.allocate();
  const Taken t = bind();
  mem.finish_binding();
  auto at = [](const Tensor& x) { return reinterpret_cast<uintptr_t>(x.data()); };
  EXPECT_EQ(at(t.a0), at(t.a1));  // layers overlap in scratch
  EXPECT_EQ(at(t.a0), at(t.c2));
  EXPECT_EQ(at(t.b0), at(t.a0) + 64);  // within a layer they do not
  EXPECT_EQ(at(t.redirected), at(t.a1) + 256);
  EXPECT_EQ(at(t.slot0), at(t.slot2));         // one slot: overlaid
  EXPECT_EQ(at(t.slot1a), at(t.slot0) + 256);  // the next slot starts after slot 0's largest layer
  EXPECT_EQ(at(t.slot1b), at(t.slot2) + 128);
  for (const Tensor* kept : {&t.kept0, &t.result, &t.kept1})
    for (const Tensor* pooled : {&t.a0, &t.slot0, &t.slot1a}) EXPECT_NE(at(*kept), at(*pooled));
  // The real pass must take from each slot what the measuring pass did.
  Memory other(DType::f32);
  other.begin_layer(0);
  other.act({40});
  other.end_layer();
  other.allocate();
  other.begin_layer(0);
  EXPECT_DEATH(other.act({80}), "overflow");
  EXPECT_DEATH(other.begin_layer(3), "inside a layer");
}

// peer_act: a block of its own, where two Memories that bind the same calls in the same order
// (two ranks) put every peer_act at the same offset, whatever else they bind around them.
TEST(Memory, PeerActsShareOffsetsAcrossMemories) {
  Memory a(DType::f32), b(DType::bf16);
  auto bind = [](Memory& m, int64_t other_rows) {
    m.act({other_rows});  // the ranks' other activations may differ
    Tensor p = m.peer_act({5, 3});
    m.act({2});
    Tensor q = m.peer_act({4}, DType::i64);
    return std::pair{p, q};
  };
  bind(a, 10);
  bind(b, 99);
  EXPECT_EQ(a.peer_block(), nullptr);  // measuring
  a.allocate();
  b.allocate();
  const auto [pa, qa] = bind(a, 10);
  const auto [pb, qb] = bind(b, 99);
  a.finish_binding();
  b.finish_binding();
  const auto offset = [](const Memory& m, const Tensor& t) {
    return static_cast<const char*>(t.data()) - static_cast<const char*>(m.peer_block());
  };
  EXPECT_EQ(offset(a, pa), 0);
  EXPECT_EQ(offset(a, qa), offset(b, qb));
  EXPECT_EQ(a.peer_block_bytes(), b.peer_block_bytes());
  EXPECT_GE(a.peer_block_bytes(), static_cast<size_t>(offset(a, qa)) + qa.nbytes());
  EXPECT_EQ(pb.dtype(), DType::bf16);                       // the compute dtype unless given
  EXPECT_GE(a.act_bytes(), a.peer_block_bytes() + 12 * 4);  // activations count the peer block too
}

// The arithmetic of core/gpu_activity.h's windows: overlapping, nested and clipped intervals are
// covered once; the longest uncovered stretch includes the window's ends.
TEST(GpuActivity, IntervalCoverCountsEachInstantOnce) {
  using V = std::vector<std::pair<uint64_t, uint64_t>>;
  IntervalCover c = interval_cover(V{{10, 20}, {15, 30}, {12, 14}, {40, 50}, {45, 45}}, 0, 100);
  EXPECT_EQ(c.covered, 30u);      // [10, 30) and [40, 50)
  EXPECT_EQ(c.largest_gap, 50u);  // [50, 100)
  c = interval_cover(V{{0, 60}, {70, 200}}, 50, 100);
  EXPECT_EQ(c.covered, 40u);  // [50, 60) and [70, 100)
  EXPECT_EQ(c.largest_gap, 10u);
  c = interval_cover(V{}, 5, 9);
  EXPECT_EQ(c.covered, 0u);
  EXPECT_EQ(c.largest_gap, 4u);
  c = interval_cover(V{{1, 2}}, 9, 5);  // an empty window
  EXPECT_EQ(c.covered, 0u);
  EXPECT_EQ(c.largest_gap, 0u);
  // Without CUDA, recording says why instead of failing.
  std::string why;
  if (!cuda_built()) {
    EXPECT_FALSE(gpu_activity_start(&why));
    EXPECT_EQ(why, "built without CUDA");
  }
}

// The layer timeline's idle time before each operation: only where no earlier one (of any stream)
// is still running; the gaps add up to the span's uncovered time.
TEST(GpuActivity, GapsBeforeCountOnlyTimeWithNothingRunning) {
  const std::vector<GpuOpSpan> ops = {{"a", 100, 200}, {"b", 205, 400}, {"side", 250, 300},
                                      {"c", 390, 500}, {"d", 520, 530}, {"e", 530, 540}};
  const std::vector<uint64_t> gaps = gaps_before(ops);
  EXPECT_EQ(gaps, (std::vector<uint64_t>{0, 5, 0, 0, 20, 0}));
  std::vector<std::pair<uint64_t, uint64_t>> intervals;
  for (const GpuOpSpan& op : ops) intervals.emplace_back(op.begin, op.end);
  uint64_t sum = 0;
  for (uint64_t g : gaps) sum += g;
  EXPECT_EQ(sum, 440 - interval_cover(intervals, 100, 540).covered);
  // A long operation hides the gaps of the shorter ones inside it.
  EXPECT_EQ(gaps_before({{"long", 0, 1000}, {"x", 10, 20}, {"y", 50, 60}}), (std::vector<uint64_t>{0, 0, 0}));
  EXPECT_TRUE(gaps_before({}).empty());
}

TEST(GpuActivity, ShortOpNamesDropOurNamespacesAndLongTemplates) {
  EXPECT_EQ(short_op_name("moefold::(anonymous namespace)::add_kernel<2>"), "add_kernel<2>");
  EXPECT_EQ(short_op_name("memset"), "memset");
  const std::string cutlass =
      "cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<" + std::string(200, 'x') + ">>";
  EXPECT_EQ(short_op_name(cutlass), "cutlass::device_kernel<...>");
  EXPECT_EQ(short_op_name(std::string(100, 'z'), 20), std::string(17, 'z') + "...");
}

TEST(Rng, DeterministicAndWellDistributed) {
  EXPECT_EQ(rng_normal(1, 2, 3), rng_normal(1, 2, 3));
  EXPECT_NE(rng_normal(1, 2, 3), rng_normal(1, 2, 4));
  EXPECT_NE(rng_normal(1, 2, 3), rng_normal(1, 3, 3));
  EXPECT_NE(rng_normal(1, 2, 3), rng_normal(2, 2, 3));
  double s = 0, s2 = 0, u = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    double x = rng_normal(7, 0, i);
    s += x;
    s2 += x * x;
    u += rng_uniform(7, 1, i);
    ASSERT_LT(rng_below(7, 2, i, 10), 10u);
  }
  EXPECT_NEAR(s / n, 0.0, 0.01);
  EXPECT_NEAR(s2 / n, 1.0, 0.01);
  EXPECT_NEAR(u / n, 0.5, 0.005);
  std::vector<float> a(100), b(100);
  fill_normal(Tensor(a.data(), DType::f32, {100}), 5, 9, 1.0, 0.5);
  fill_normal(Tensor(b.data(), DType::f32, {100}), 5, 9, 1.0, 0.5);
  EXPECT_EQ(a, b);
  EXPECT_EQ(a[3], static_cast<float>(1.0 + 0.5 * rng_normal(5, 9, 3)));
}

}  // namespace
// Mixed precision: bf16 compute copies beside f32 master weights and gradients; activations in
// the compute dtype; without bf16 the compute view is the master weight itself.
TEST(Memory, MixedPrecisionKeepsF32MastersAndBf16ComputeCopies) {
  for (DType dt : {DType::f32, DType::bf16}) {
    Memory mem(dt);
    auto bind = [&] {
      Tensor w = mem.param({.name = "w", .shape = {3, 4}, .init_std = 0.02});
      Tensor a = mem.act({5});
      EXPECT_EQ(w.dtype(), dt);
      EXPECT_EQ(a.dtype(), dt);
    };
    mem.bind_twice(bind);
    const Param& p = mem.params().front();
    EXPECT_EQ(p.value.dtype(), DType::f32);
    EXPECT_EQ(p.grad.dtype(), DType::f32);
    EXPECT_EQ(p.compute.dtype(), dt);
    EXPECT_EQ(p.compute.data() == p.value.data(), dt == DType::f32);
    EXPECT_EQ(mem.mixed_precision(), dt == DType::bf16);
    EXPECT_EQ(mem.grad_block(ParamGroup::dense).dtype(), DType::f32);
    EXPECT_EQ(mem.param_bytes(), static_cast<size_t>(dt == DType::bf16 ? 64 + 64 : 64));  // 64-byte aligned blocks
  }
}

}  // namespace moefold

// Execution contexts on the GPU (core/exec.h): ops run on the stream of the context they are given,
// with that context's scratch and library handles. Two independent MoE layers, each bound through
// a Memory on a context with a stream of its own, run forward and backward at the same time and
// give bit for bit what each gives alone on the standard context (every kernel on this path is
// deterministic). A context's scratch and cuBLASLt handle are its own, and wait_for orders work
// across contexts. Skipped without a GPU.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "cuda_testing.h"
#include "moefold/comm/communicator.h"
#include "moefold/core/cuda_graph.h"
#include "moefold/core/device.h"
#include "moefold/core/exec.h"
#include "moefold/moe/moe_layer.h"
#include "moefold/moe/slot_dispatcher.h"
#include "moefold/ops/ops.h"

namespace moefold {
namespace {

using testing::Pool;

constexpr int64_t kTokens = 512, kHidden = 128;

MoeConfig layer_config() {
  return MoeConfig{.num_experts = 8, .num_experts_per_tok = 2, .moe_intermediate_size = 64, .aux_loss_coeff = 0.01};
}

// The host values of one layer's parameters, input and output gradient (f32).
struct Values {
  std::vector<Tensor> params;
  Tensor x, dy;
};

// One MoE layer in bf16 on the GPU, bound through a Memory on `ctx`.
struct GpuLayer {
  Memory mem;
  MoeLayer layer;
  Tensor x, y, dy, dx, stage;  // stage: f32 [T, H] for the bf16 uploads
  // d: the dispatcher (null: LocalDispatcher).
  explicit GpuLayer(const ExecContext& ctx, std::unique_ptr<Dispatcher> d = nullptr)
      : mem(DType::bf16, ctx),
        layer(d ? MoeLayer(layer_config(), kHidden, kTokens, "model.mlp", std::move(d))
                : MoeLayer(layer_config(), kHidden, kTokens, "model.mlp")) {
    const auto bind = [&] {
      layer.bind(mem);
      x = mem.act({kTokens, kHidden});
      y = mem.act({kTokens, kHidden});
      dy = mem.act({kTokens, kHidden});
      dx = mem.act({kTokens, kHidden});
      stage = mem.act({kTokens, kHidden}, DType::f32);
    };
    mem.bind_twice(bind);
  }
  // Parameters, input and output gradient from `v`, copied on the context's own stream.
  void load(const Values& v) {
    const ExecContext& ctx = mem.exec();
    ctx.wait_for(ExecContext::standard(Device::cuda));  // the uploads of the test's own helpers
    for (size_t i = 0; i < v.params.size(); ++i) {
      Param& p = mem.params()[i];
      p.value.copy_from(v.params[i], &ctx);
      if (p.has_compute_copy()) cast(ctx, p.value, p.compute);
    }
    stage.copy_from(v.x, &ctx);
    cast(ctx, stage, x);
    stage.copy_from(v.dy, &ctx);
    cast(ctx, stage, dy);
  }
  void step() {
    mem.zero_grads();  // on the Memory's context, in order with its ops
    layer.forward(x, y);
    layer.backward(dy, dx, 1.0);
  }
  // y, dx and every gradient as bytes, copied on the context's stream.
  std::vector<std::vector<char>> results() const {
    std::vector<Tensor> ts = {y, dx};
    for (const Param& p : mem.params()) ts.push_back(p.grad);
    std::vector<std::vector<char>> out;
    for (const Tensor& t : ts) {
      std::vector<char> bytes(static_cast<size_t>(t.nbytes()));
      Tensor(bytes.data(), t.dtype(), t.shape()).copy_from(t, &mem.exec());
      out.push_back(std::move(bytes));
    }
    return out;
  }
};

Values random_values(Pool& pool, const GpuLayer& like) {
  Values v;
  for (const Param& p : like.mem.params())
    v.params.push_back(pool.randn(p.value.shape(), DType::f32, p.init == Init::ones ? 0.0 : 0.05));
  v.x = pool.randn({kTokens, kHidden}, DType::f32);
  v.dy = pool.randn({kTokens, kHidden}, DType::f32, 1e-2);
  return v;
}

TEST(ExecContext, TwoMoeLayersOnTwoStreamsMatchEachAlone) {
  MF_REQUIRE_GPU();
  Pool pool;
  const ExecContext& standard = ExecContext::standard(Device::cuda);
  const ExecContext a_ctx(Device::cuda, {}, ExecContext::Stream::own),
      b_ctx(Device::cuda, {}, ExecContext::Stream::own);
  ASSERT_NE(a_ctx.stream(), b_ctx.stream());
  ASSERT_NE(a_ctx.stream(), standard.stream());
  GpuLayer a(a_ctx), b(b_ctx), alone(standard);
  const Values va = random_values(pool, a), vb = random_values(pool, b);

  // Each alone, one after the other, on the standard context.
  alone.load(va);
  alone.step();
  const auto want_a = alone.results();
  alone.load(vb);
  alone.step();
  const auto want_b = alone.results();

  // Both at once: every op of a and b queued on its own stream before either is read back.
  a.load(va);
  b.load(vb);
  a.step();
  b.step();
  const auto got_a = a.results(), got_b = b.results();
  ASSERT_EQ(got_a.size(), want_a.size());
  for (size_t i = 0; i < want_a.size(); ++i) {
    EXPECT_TRUE(got_a[i] == want_a[i]) << "layer a, result " << i;
    EXPECT_TRUE(got_b[i] == want_b[i]) << "layer b, result " << i;
  }
  EXPECT_TRUE(got_a[0] != got_b[0]) << "the two layers had different inputs";
}

// moe.dispatcher = "slots" over a group of one rank (the self communicator): its one slot holds
// the home rows in LocalDispatcher's order, so the layer gives LocalDispatcher's bits (the slot
// plans' CUDA kernels and the device-only exchange, on one GPU); captured as one CUDA graph (no
// count reaches the host, so nothing stops the capture) and replayed, it gives them again.
TEST(SlotDispatcherCuda, OneRankGivesLocalDispatchersBitsEagerAndReplayed) {
  MF_REQUIRE_GPU();
  Pool pool;
  const ExecContext& ctx = ExecContext::standard(Device::cuda);
  std::unique_ptr<Communicator> self = make_self_communicator("ep");
  GpuLayer local(ctx), slots(ctx, std::make_unique<SlotDispatcher>(layer_config(), kHidden, kTokens, *self));
  const Values v = random_values(pool, local);
  local.load(v);
  local.step();
  const auto want = local.results();
  slots.load(v);
  slots.step();
  const auto eager = slots.results();
  ASSERT_EQ(eager.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(eager[i] == want[i]) << "eager, result " << i;

  CudaGraph graph;
  std::string why;
  ASSERT_TRUE(graph.capture(
      ctx, [&] { slots.step(); }, &why))
      << why;
  slots.load(random_values(pool, slots));  // other values first: the replay must compute, not keep
  slots.load(v);
  graph.launch(ctx);
  const auto replayed = slots.results();
  for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(replayed[i] == want[i]) << "replayed, result " << i;
  const auto* d = dynamic_cast<const SlotDispatcher*>(&slots.layer.dispatcher());
  ASSERT_NE(d, nullptr);
  double overflow = -1;
  Tensor(&overflow, DType::f64, {1}).copy_from(d->overflow(), &ctx);
  EXPECT_EQ(overflow, 0.0);
}

// Scratch belongs to the context: two contexts never share a buffer, and one context reuses its
// own once it is large enough.
TEST(ExecContext, ScratchIsPerContext) {
  MF_REQUIRE_GPU();
  const ExecContext a(Device::cuda, {}, ExecContext::Stream::own), b(Device::cuda, {}, ExecContext::Stream::own);
  void* pa = a.scratch(ScratchSlot::sum_squares, 1024);
  void* pb = b.scratch(ScratchSlot::sum_squares, 1024);
  EXPECT_NE(pa, pb);
  EXPECT_EQ(a.scratch(ScratchSlot::sum_squares, 512), pa);
  const int64_t mallocs = device_malloc_count();
  EXPECT_EQ(b.scratch(ScratchSlot::sum_squares, 1000), pb);
  EXPECT_EQ(device_malloc_count(), mallocs);
}

// wait_for: a long kernel queued on one context, then a copy of its output on another context that
// waited for it, reads the finished values.
TEST(ExecContext, WaitForOrdersWorkAcrossContexts) {
  MF_REQUIRE_GPU();
  testing::DevicePool dev;
  const ExecContext a(Device::cuda, {}, ExecContext::Stream::own), b(Device::cuda, {}, ExecContext::Stream::own);
  const int64_t n = int64_t{1} << 24;
  std::vector<float> ones(static_cast<size_t>(n), 1.0f);
  const Tensor x = dev.empty({n}, DType::f32), y = dev.empty({n}, DType::f32);
  x.copy_from(Tensor(ones.data(), DType::f32, {n}), &a);
  for (int i = 0; i < 8; ++i) scale_inplace(a, x, 2.0);  // x = 256 when a is done
  b.wait_for(a);
  y.copy_from(x, &b);
  std::vector<float> got(static_cast<size_t>(n));
  Tensor(got.data(), DType::f32, {n}).copy_from(y, &b);
  EXPECT_EQ(got.front(), 256.0f);
  EXPECT_EQ(got.back(), 256.0f);
}

}  // namespace
}  // namespace moefold

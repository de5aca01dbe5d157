#include "moefold/bench/moe_layer_bench.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "moefold/bench/format.h"
#include "moefold/core/device.h"
#include "moefold/core/error.h"
#include "moefold/core/gpu_clocks.h"
#include "moefold/core/memory.h"
#include "moefold/core/profile.h"
#include "moefold/core/rng.h"
#include "moefold/model/config.h"
#include "moefold/model/mlp.h"
#include "moefold/moe/all_to_all_dispatcher.h"
#include "moefold/moe/dispatcher.h"
#include "moefold/moe/experts.h"
#include "moefold/moe/hierarchical_dispatcher.h"
#include "moefold/moe/moe_layer.h"
#include "moefold/moe/router.h"
#include "moefold/moe/slot_dispatcher.h"
#include "moefold/ops/fp8.h"
#include "moefold/ops/moe_ops.h"
#include "moefold/ops/ops.h"
#include "moefold/parallel/mesh.h"
#include "moefold/train/trainer.h"

namespace moefold {

using bench_format::fmt;

namespace {

// docs/benchmarks.md, measured on one H200 (2026-11-30): tokens per GPU of the MoE-layer
// benchmark, the grouped-GEMM ceilings (fc1 forward, fc2 forward, fc1 forward+backward; TFLOP/s)
// and the PyTorch bar (forward+backward TFLOP/s, balanced and real routing; the upper end of a
// range, so a ratio never flatters).
struct ShapeFacts {
  int64_t tokens;
  double fc1, fc2, fc1_fwd_bwd;
  double bar_balanced, bar_real;
};
const std::map<std::string, ShapeFacts>& shape_facts() {
  static const std::map<std::string, ShapeFacts> facts = {
      {"qwen3-30b-a3b", {16384, 708, 543, 604, 274, 264}},
      {"qwen3-235b-a22b", {8192, 647, 562, 0, 376, 347}},
      {"deepseek-v3", {8192, 618, 576, 0, 374, 391}},
      {"mixtral-8x7b", {8192, 705, 667, 0, 549, 574}},
  };
  return facts;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Fills float tensors (any device, f32/bf16) with normal(0, std) values cut from one host block
// of random numbers: random data without drawing billions of normals on the host.
class RandomFill {
 public:
  RandomFill(Memory& mem, int64_t block) : ctx_(&mem.exec()), block_(block), host_(static_cast<size_t>(block)) {
    staging_ = mem.act({block}, DType::f32);
    if (!mem.measuring()) fill_normal(Tensor(host_.data(), DType::f32, {block}), 2026, 11, 0.0, 1.0);
  }
  void operator()(const Tensor& t, double std, int64_t salt) {
    const Tensor flat = t.view({t.numel()});
    std::vector<float> scaled(host_.size());
    for (size_t i = 0; i < host_.size(); ++i) scaled[i] = static_cast<float>(std * host_[i]);
    const Tensor src(scaled.data(), DType::f32, {block_});
    for (int64_t off = 0; off < flat.numel(); off += block_) {
      const int64_t n = std::min(block_, flat.numel() - off);
      // A different start in the block per chunk and tensor, so chunks do not repeat exactly.
      const int64_t shift = (off / block_ * 7919 + salt * 104729) % (block_ - n + 1);
      const Tensor dst = flat.slice(off, off + n);
      if (dst.device() == Device::cpu && dst.dtype() == DType::f32) {
        dst.copy_from(src.slice(shift, shift + n));
      } else {
        staging_.slice(0, n).copy_from(src.slice(shift, shift + n));
        cast(*ctx_, staging_.slice(0, n), dst);
      }
    }
  }

 private:
  const ExecContext* ctx_;
  int64_t block_;
  std::vector<float> host_;
  Tensor staging_;
};

// The dispatcher of the benchmark: all experts here, or EP over `ep`: all-to-all, or with
// moe.dispatcher = "hierarchical" over the nodes of `nodes` (a mesh of EP over every rank of ep), or
// in fixed slots with moe.dispatcher = "slots".
std::unique_ptr<Dispatcher> make_dispatcher(const Config& c, int64_t t, Communicator* ep, const Mesh* nodes) {
  if (ep == nullptr || ep->size() == 1) return std::make_unique<LocalDispatcher>(c.moe, c.model.hidden_size, t);
  const EpTransportChoice transport = parse_ep_transport(c.parallel.ep_transport);
  if (nodes != nullptr) {
    if (!nodes->ep_nodes_irregular.empty())
      MF_FAIL("bench moe-layer: moe.dispatcher = \"hierarchical\": ", nodes->ep_nodes_irregular);
    return std::make_unique<HierarchicalDispatcher>(c.moe, c.model.hidden_size, t, *nodes->ep, *nodes->ep_node,
                                                    *nodes->ep_rail, transport);
  }
  if (c.moe.dispatcher == "slots") return std::make_unique<SlotDispatcher>(c.moe, c.model.hidden_size, t, *ep);
  return std::make_unique<AllToAllDispatcher>(c.moe, c.model.hidden_size, t, *ep, transport);
}

struct Layer {
  Router router;
  std::unique_ptr<Dispatcher> dispatcher_ptr;
  Dispatcher& dispatcher;
  Experts experts;
  std::optional<DenseMlp> shared;                // DeepSeek-V3's shared experts (one MLP of n x F)
  std::unique_ptr<ExecContext> side;             // moe.shared_expert_overlap: where they run
  Tensor x, y, dy, dx, out, dout, drows, dprob;  // the layer's own tensors (as MoeLayer's)
  Tensor y_shared, dx_shared;
  Tensor balanced_idx, balanced_prob;  // [T, K]: balanced routing
  Tensor gu, h, dgu, dh, drows2;       // the grouped GEMMs alone
  Tensor dgate_up;
  Tensor q_rows, s_rows;  // FP8: the quantized fc1 input
  Tensor packed;          // moe.fp8_dispatch: the tokens quantized for dispatch (as MoeLayer's)
  Layer(const Config& c, int64_t t, Communicator* ep, const Mesh* nodes)
      : router(c.moe, c.model.hidden_size, t, "bench", c.model.initializer_range),
        dispatcher_ptr(make_dispatcher(c, t, ep, nodes)),
        dispatcher(*dispatcher_ptr),
        experts({.num_experts = dispatcher.num_local_experts(),
                 .hidden = c.model.hidden_size,
                 .ffn = c.moe.moe_intermediate_size,
                 .max_rows = dispatcher.max_rows(),
                 .first_expert = dispatcher.first_local_expert(),
                 .total_experts = c.moe.num_experts},
                "bench", c.model.initializer_range) {
    if (c.moe.n_shared_experts > 0)
      shared.emplace(c.model.hidden_size, c.moe.n_shared_experts * c.moe.moe_intermediate_size, t, t, "bench.shared",
                     c.model.initializer_range);
  }
  // moe.shared_expert_overlap: the shared experts on a context of their own (as Model makes one).
  void overlap_shared(const ExecContext& ctx) {
    side = std::make_unique<ExecContext>(ctx.device(), ctx.kernels(), ExecContext::Stream::own);
  }
  void bind(Memory& mem, const Config& c, int64_t t) {
    const int64_t h_n = c.model.hidden_size, k = c.moe.num_experts_per_tok, f = c.moe.moe_intermediate_size;
    const int64_t r = dispatcher.max_rows();
    router.bind(mem);
    dispatcher.set_fp8_rows(experts_fp8 && c.moe.fp8_dispatch);
    dispatcher.bind(mem);
    packed = mem.act({dispatcher.fp8_rows() ? t : 0, fp8_packed_width(h_n)}, DType::u8);
    experts.bind(mem);
    if (shared) shared->bind(mem, nullptr, side.get());
    y_shared = mem.act({shared ? t : 0, h_n});
    dx_shared = mem.act({shared ? t : 0, h_n});
    x = mem.act({t, h_n});
    y = mem.act({t, h_n});
    dy = mem.act({t, h_n});
    dx = mem.act({t, h_n});
    out = mem.act({r, h_n});
    dout = mem.act({r, h_n});
    drows = mem.act({r, h_n});
    dprob = mem.act({t, k}, mem.master_dtype());
    balanced_idx = mem.act({t, k}, DType::i32);
    balanced_prob = mem.act({t, k}, mem.master_dtype());
    gu = mem.act({r, 2 * f});
    h = mem.act({r, f});
    dgu = mem.act({r, 2 * f});
    dh = mem.act({r, f});
    drows2 = mem.act({r, h_n});
    dgate_up = mem.grad("bench.experts.gate_up_proj");
    const bool fp8 = experts_fp8;
    q_rows = mem.act({fp8 ? r : 0, h_n}, DType::u8);
    s_rows = mem.act({fp8 ? (h_n + kFp8Tile - 1) / kFp8Tile * r : 0}, DType::f32);  // viewed [H / 128, R]
  }
  bool experts_fp8 = false;
};

// Times `fn` reps times after warmup; returns the median in ms.
double time_median(Device device, int warmup, int reps, const std::function<void()>& fn) {
  StreamTimer timer;
  std::vector<double> ms;
  for (int i = 0; i < warmup + reps; ++i) {
    timer.start(device);
    fn();
    timer.stop();
    if (i >= warmup) ms.push_back(timer.elapsed_ms());
  }
  return median(ms);
}

MoeBenchResult run_one(const std::string& shape, const std::string& routing, const MoeBenchOptions& opts) {
  std::vector<std::string> overrides = opts.overrides;  // EP over every rank of opts.ep, as the config says
  if (opts.ep != nullptr) overrides.insert(overrides.begin(), "parallel.ep=" + std::to_string(opts.ep->size()));
  const Config c = load_config(shape, overrides);
  const auto facts_it = shape_facts().find(shape);
  const ShapeFacts* facts = facts_it == shape_facts().end() ? nullptr : &facts_it->second;
  const int64_t t = opts.tokens > 0 ? opts.tokens : facts ? facts->tokens : 4096;
  const int64_t h_n = c.model.hidden_size, e_n = c.moe.num_experts, k = c.moe.num_experts_per_tok;
  const int64_t f = c.moe.moe_intermediate_size;
  const bool balanced = routing == "balanced";
  if (!balanced && routing != "real") MF_FAIL("bench moe-layer: --routing ", routing, " (balanced or real)");

  const ExecContext ctx(opts.device, c.kernels);
  Memory mem(opts.device == Device::cuda ? DType::bf16 : DType::f32, ctx);
  apply_memory_options(mem, c.train);  // train.main_grads_dtype: the expert weight gradients' dtype
  std::optional<Mesh> nodes;           // the hierarchical dispatcher's node and rail groups of EP over every rank
  if (c.moe.dispatcher == "hierarchical" && opts.ep != nullptr && opts.ep->size() > 1) {
    ParallelConfig every{.dp = opts.ep->size(), .ep = opts.ep->size(), .ranks_per_node = c.parallel.ranks_per_node};
    nodes.emplace(Mesh::build(*opts.ep, every.resolve(opts.ep->size()), true));
  }
  Layer layer(c, t, opts.ep, nodes ? &*nodes : nullptr);
  if (c.moe.shared_expert_overlap) layer.overlap_shared(ctx);
  if (opts.fp8) {
    layer.experts.set_fp8(true);
    if (layer.shared) layer.shared->set_fp8(true);
    layer.experts_fp8 = true;
  }
  const int64_t block = std::min<int64_t>(int64_t{1} << 24, std::max<int64_t>(t * h_n, 1 << 16));
  auto bind = [&] {
    layer.bind(mem, c, t);
    return RandomFill(mem, block);
  };
  bind();
  mem.allocate();
  RandomFill fill = bind();
  mem.finish_binding();

  // Random weights (the compute copies too), inputs and output gradients.
  int64_t salt = 0;
  for (const Param& p : mem.params()) {
    fill(p.value, p.init == Init::normal ? p.init_std : 0.0, ++salt);
    if (p.has_compute_copy()) cast(ctx, p.value, p.compute);
  }
  fill(layer.x, 1.0, ++salt);
  fill(layer.dy, 1.0 / static_cast<double>(t), ++salt);
  {
    std::vector<int32_t> idx(static_cast<size_t>(t * k));
    for (int64_t i = 0; i < t * k; ++i) idx[static_cast<size_t>(i)] = static_cast<int32_t>(i % e_n);
    layer.balanced_idx.copy_from(Tensor(idx.data(), DType::i32, {t, k}));
    fill_matrix(ctx, as_matrix(layer.balanced_prob), 1.0 / static_cast<double>(k));
  }

  MoeBenchResult res;
  res.shape = shape;
  res.routing = routing;
  res.tokens = t;
  const double router_fwd = 2.0 * t * h_n * e_n, experts_fwd = 6.0 * k * t * h_n * f;
  const double shared_fwd = 6.0 * t * h_n * f * static_cast<double>(c.moe.n_shared_experts);
  res.flops = 3 * (router_fwd + experts_fwd + shared_fwd);

  // The layer, stage by stage, as MoeLayer::forward / backward run it.
  const DispatchPlan* plan = nullptr;
  std::vector<std::string> names = {"router",           "dispatch",         "experts",           "combine",
                                    "combine backward", "experts backward", "dispatch backward", "router backward"};
  std::vector<double> stage_flops = {router_fwd, 0, experts_fwd, 0, 0, 2 * experts_fwd, 0, 2 * router_fwd};
  std::vector<std::function<void()>> stages = {
      [&] { layer.router.forward(layer.x); },
      [&] {
        Tensor tokens = layer.x;
        if (layer.dispatcher.fp8_rows()) {  // moe.fp8_dispatch: quantized once, as MoeLayer does
          tokens = layer.packed;
          fp8_quantize_packed(ctx, layer.x, tokens);
        }
        plan = &layer.dispatcher.dispatch(tokens, balanced ? layer.balanced_idx : layer.router.topk_idx(),
                                          balanced ? layer.balanced_prob : layer.router.topk_prob());
      },
      [&] { run_experts_forward(*plan, layer.experts, layer.out.slice(0, plan->num_rows)); },
      [&] { layer.dispatcher.combine(layer.out.slice(0, plan->num_rows), *plan, layer.y); },
      [&] {
        layer.dispatcher.combine_backward(layer.dy, layer.out.slice(0, plan->num_rows), *plan,
                                          layer.dout.slice(0, plan->num_rows), layer.dprob);
      },
      [&] {
        run_experts_backward(*plan, layer.experts, layer.dout.slice(0, plan->num_rows),
                             layer.drows.slice(0, plan->num_rows));
      },
      [&] { layer.dispatcher.dispatch_backward(layer.drows.slice(0, plan->num_rows), *plan, layer.dx); },
      [&] { layer.router.backward(layer.x, layer.dprob, 1.0, layer.dx); },
  };
  if (layer.shared && !layer.side) {  // as DecoderLayer runs them: after the routed experts, results added
    names.insert(names.begin() + 4, "shared expert");
    stage_flops.insert(stage_flops.begin() + 4, shared_fwd);
    stages.insert(stages.begin() + 4, [&] {
      layer.shared->forward(layer.x, layer.y_shared);
      add_inplace(ctx, layer.y, layer.y_shared);
    });
    names.push_back("shared expert backward");
    stage_flops.push_back(2 * shared_fwd);
    stages.push_back([&] {
      layer.shared->backward(layer.dy, layer.dx_shared);
      add_inplace(ctx, layer.dx, layer.dx_shared);
    });
  } else if (layer.shared) {  // moe.shared_expert_overlap: queued on their context where their input
    // is ready (before the router; before the combine's backward), joined where their result is
    // added; the stages of the routed experts in between run beside them, and the join's stage
    // times what of them those did not hide.
    const ExecContext& side = *layer.side;
    const auto router = stages[0], combine_backward = stages[4];
    stages[0] = [&, router] {
      side.wait_for(ctx);
      layer.shared->forward(layer.x, layer.y_shared);
      router();
    };
    stages[4] = [&, combine_backward] {
      side.wait_for(ctx);
      layer.shared->backward(layer.dy, layer.dx_shared);
      combine_backward();
    };
    names.insert(names.begin() + 4, "shared expert (overlapped: its wait and add)");
    stages.insert(stages.begin() + 4, [&] {
      ctx.wait_for(side);
      add_inplace(ctx, layer.y, layer.y_shared);
    });
    stage_flops.insert(stage_flops.begin() + 4, 0);
    names.push_back("shared expert backward (overlapped: its wait and add)");
    stage_flops.push_back(0);
    stages.push_back([&] {
      ctx.wait_for(side);
      add_inplace(ctx, layer.dx, layer.dx_shared);
    });
  }
  std::vector<StreamTimer> timers(stages.size() + 1);
  std::vector<std::vector<double>> ms(stages.size() + 1);
  struct ProfileOff {
    ~ProfileOff() { profile_disable(); }
  } profile_off;
  // The timed repetitions run with the profiler off; then, untimed, `phase_reps` more with it on
  // give the layer's own phases (expert pieces, EP waits: the "(within)" rows). Recording CUDA
  // events inside the timed region, around the EP waits above all, could move the times measured.
  const int phase_reps = std::max(1, opts.reps / 2);
  std::vector<uint64_t>* stage_marks = nullptr;  // recording: each stage's start on CUPTI's clock
  const auto repetition = [&](int i, bool timed) {
    // A new step's gradients (untimed): the experts' backward writes its weight gradients, as in
    // the first micro-batch of a training step (Memory::grad_written_by_backward). With
    // accumulate_grads only before the first repetition: the others add to the gradients.
    // A new step also means new weights: FP8 quantizes them again (Fp8Param).
    if (!opts.accumulate_grads || i == 0) {
      mem.zero_grads();
      mem.weights_changed();
    }
    timers.back().start(opts.device);
    for (size_t s = 0; s < stages.size(); ++s) {
      if (stage_marks) stage_marks->push_back(gpu_activity_now());
      timers[s].start(opts.device);
      stages[s]();
      timers[s].stop();
    }
    timers.back().stop();
    if (timed)
      for (size_t s = 0; s < timers.size(); ++s) ms[s].push_back(timers[s].elapsed_ms());
  };
  for (int i = 0; i < opts.warmup; ++i) repetition(i, false);
  {
    GpuClockSampler clocks;  // every 10 ms over the timed repetitions
    std::string why;
    const bool sampling = opts.device == Device::cuda && clocks.start(10, &why);
    for (int i = opts.warmup; i < opts.warmup + opts.reps; ++i) repetition(i, true);
    if (sampling) {  // the repetitions' timers waited for the GPU
      res.gpu_clocks = describe_gpu_clocks(clocks.stop());
    } else if (opts.device == Device::cuda) {
      res.gpu_clocks = "not sampled: " + why;
    }
  }
  res.expert_grad_sq = sum_squares(ctx, layer.dgate_up);  // the timed repetitions' (before the phase ones)
  profile_enable(opts.device);
  for (int i = 0; i < phase_reps; ++i) repetition(opts.warmup + opts.reps + i, false);
  for (const PhaseTime& p : profile_collect()) res.phases.push_back({p.name, p.ms / phase_reps, 0, 0});
  profile_disable();
  if (opts.device == Device::cuda && opts.activity_reps > 0 && gpu_activity_start(&res.activity_unavailable)) {
    std::vector<std::pair<uint64_t, uint64_t>> windows;
    std::vector<std::vector<uint64_t>> marks(opts.activity_reps);
    for (int i = 0; i < opts.activity_reps; ++i) {
      stage_marks = &marks[i];
      const uint64_t t0 = gpu_activity_now();
      repetition(opts.warmup + opts.reps + phase_reps + i, false);
      device_synchronize();
      windows.emplace_back(t0, gpu_activity_now());
    }
    stage_marks = nullptr;
    std::vector<std::vector<GpuOpSpan>> in_order;
    gpu_activity_stop(windows, nullptr, &in_order);
    const auto span = [&](int w) {
      uint64_t end = 0;
      for (const GpuOpSpan& op : in_order[w]) end = std::max(end, op.end);
      return in_order[w].empty() ? 0 : end - in_order[w].front().begin;
    };
    std::vector<int> order(opts.activity_reps);
    for (int i = 0; i < opts.activity_reps; ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](int a, int b) { return span(a) < span(b); });
    const int median_rep = order[order.size() / 2];
    res.activity_reps = opts.activity_reps;
    res.timeline = in_order[median_rep];
    // Each operation's stage: the last stage begun on the host before the call that issued it.
    for (const GpuOpSpan& op : res.timeline) {
      const std::vector<uint64_t>& m = marks[median_rep];
      const auto after = std::upper_bound(m.begin(), m.end(), op.issued);
      res.timeline_stage.push_back(op.issued == 0 ? -1 : static_cast<int>(after - m.begin()) - 1);
    }
  }
  res.rows = plan->num_rows;
  res.local_experts = layer.dispatcher.num_local_experts();
  res.total = {"layer forward+backward", median(ms.back()), 0, 0};
  res.total.tflops = res.flops / (res.total.ms * 1e9);
  if (facts) res.bar = balanced ? facts->bar_balanced : facts->bar_real;
  for (size_t s = 0; s < stages.size(); ++s) {
    BenchTime b{names[s], median(ms[s]), 0, 0};
    if (stage_flops[s] > 0) b.tflops = stage_flops[s] / (b.ms * 1e9);
    res.stages.push_back(b);
  }
  {
    std::vector<int64_t> counts(static_cast<size_t>(e_n));
    device_copy(counts.data(), Device::cpu, layer.router.tokens_per_expert().data(), opts.device,
                counts.size() * sizeof(int64_t));
    if (balanced) std::fill(counts.begin(), counts.end(), t * k / e_n);
    double sum = 0;
    for (int64_t n : counts) {
      res.load_max = std::max(res.load_max, static_cast<double>(n));
      sum += static_cast<double>(n);
    }
    res.load_mean = sum / static_cast<double>(e_n);
  }

  // The expert GEMMs alone, on the last plan's rows, piece by piece as the experts ran them.
  const int64_t r = plan->num_rows;
  // The rows as values (with moe.fp8_dispatch the plan's are packed FP8: their values, for the
  // bf16 GEMMs and the quantization pass below; the FP8 GEMMs read the packed rows as the experts do).
  const Tensor packed_rows = plan->rows_RH.dtype() == DType::u8 ? plan->rows_RH : Tensor();
  const Tensor rows = packed_rows.defined() ? layer.dout.slice(0, r) : plan->rows_RH;  // dout: free by now
  if (packed_rows.defined()) fp8_dequantize_packed(ctx, packed_rows, rows);
  const Tensor fp8_rows = packed_rows.defined() ? packed_rows : rows;
  const Tensor gu = layer.gu.slice(0, r), h = layer.h.slice(0, r), dgu = layer.dgu.slice(0, r);
  const Tensor out = layer.out.slice(0, r), drows2 = layer.drows2.slice(0, r);
  fill(gu, 1.0, ++salt);
  fill(h, 1.0, ++salt);
  fill(dgu, 1e-3, ++salt);
  const double fc1 = 4.0 * r * h_n * f, fc2 = 2.0 * r * h_n * f;
  auto gemm = [&](const std::string& name, double flops, double ceiling,
                  const std::function<void(const Tensor& off, int64_t begin, int64_t end)>& fn) {
    const auto pieces = [&] {
      for (const RowPiece& pc : plan->pieces) fn(pc.offsets_E1, pc.begin, pc.end);
    };
    BenchTime b{name, time_median(opts.device, opts.warmup, opts.reps, pieces), 0, ceiling};
    b.tflops = flops / (b.ms * 1e9);
    res.gemms.push_back(b);
  };
  const Tensor& w1 = layer.experts.gate_up_proj();
  gemm("fc1 forward (grouped, H -> 2F)", fc1, facts ? facts->fc1 : 0, [&](const Tensor& off, int64_t a, int64_t b) {
    grouped_linear_forward(ctx, rows.slice(a, b), w1, off, gu.slice(a, b));
  });
  gemm("fc2 forward (grouped, F -> H)", fc2, facts ? facts->fc2 : 0, [&](const Tensor& off, int64_t a, int64_t b) {
    grouped_linear_forward(ctx, h.slice(a, b), layer.experts.down_proj(), off, out.slice(a, b));
  });
  // The SwiGLU-fused pair as the experts run it, against the plain GEMMs around them (the
  // epilogues' cost: fc1 forward vs fc1 forward + SwiGLU; fc2 dgrad vs fc2 dgrad + SwiGLU backward).
  gemm("fc1 forward + SwiGLU (one grouped GEMM)", fc1, facts ? facts->fc1 : 0,
       [&](const Tensor& off, int64_t a, int64_t b) {
         grouped_linear_swiglu_forward(ctx, rows.slice(a, b), w1, off, gu.slice(a, b), h.slice(a, b));
       });
  gemm("fc2 dgrad (grouped, H -> F)", fc2, 0, [&](const Tensor& off, int64_t a, int64_t b) {
    grouped_linear_backward(ctx, h.slice(a, b), layer.experts.down_proj(), off, out.slice(a, b), h.slice(a, b),
                            Tensor());
  });
  gemm("fc2 dgrad + SwiGLU backward (one grouped GEMM)", fc2, 0, [&](const Tensor& off, int64_t a, int64_t b) {
    grouped_linear_swiglu_backward_data(ctx, out.slice(a, b), layer.experts.down_proj(), off, gu.slice(a, b),
                                        h.slice(a, b), dgu.slice(a, b));
  });
  const auto fc1_backward = [&](const Tensor& off, int64_t a, int64_t b) {
    grouped_linear_backward(ctx, rows.slice(a, b), w1, off, dgu.slice(a, b), drows2.slice(a, b), layer.dgate_up);
  };
  // The weight gradient alone (written as in a step's first micro-batch): with few rows per expert
  // it is bound by writing the gradient (f32: 4 bytes per 2 x rows-per-expert FLOPs).
  const std::string wgrad =
      cat("fc1 wgrad (grouped, ", layer.dgate_up.dtype() == DType::bf16 ? "bf16" : "f32", " gradient written)");
  gemm(wgrad, fc1, 0, [&](const Tensor& off, int64_t a, int64_t b) {
    grouped_linear_backward(ctx, rows.slice(a, b), w1, off, dgu.slice(a, b), Tensor(), layer.dgate_up,
                            /*accumulate=*/false);
  });
  gemm("fc1 backward (dx + dw)", 2 * fc1, 0, fc1_backward);
  gemm("fc1 forward+backward", 3 * fc1, facts ? facts->fc1_fwd_bwd : 0, [&](const Tensor& off, int64_t a, int64_t b) {
    grouped_linear_forward(ctx, rows.slice(a, b), w1, off, gu.slice(a, b));
    fc1_backward(off, a, b);
  });
  if (!opts.fp8) return res;
  // FP8 (ops/fp8.h): the grouped GEMMs with their activations' quantization, the weights quantized
  // once per step as in training (Experts::fp8_gate_up); the quantization passes alone (the GEMMs'
  // own time is the difference).
  gemm(packed_rows.defined() ? "FP8 fc1 forward (packed rows, grouped GEMM)"
                             : "FP8 fc1 forward (quantize x, grouped GEMM)",
       fc1, 0, [&](const Tensor& off, int64_t a, int64_t b) {
         fp8_grouped_linear_forward(ctx, fp8_rows.slice(a, b), w1, off, gu.slice(a, b), layer.experts.fp8_gate_up());
       });
  gemm("FP8 fc2 forward (quantize h, grouped GEMM)", fc2, 0, [&](const Tensor& off, int64_t a, int64_t b) {
    fp8_grouped_linear_forward(ctx, h.slice(a, b), layer.experts.down_proj(), off, out.slice(a, b),
                               layer.experts.fp8_down());
  });
  const auto fp8_fc1_backward = [&](const Tensor& off, int64_t a, int64_t b) {
    fp8_grouped_linear_backward(ctx, fp8_rows.slice(a, b), w1, off, dgu.slice(a, b), drows2.slice(a, b), layer.dgate_up,
                                true, layer.experts.fp8_gate_up());
  };
  gemm("FP8 fc1 backward (dx + dw, quantize dy and x)", 2 * fc1, 0, fp8_fc1_backward);
  gemm("FP8 fc1 forward+backward", 3 * fc1, 0, [&](const Tensor& off, int64_t a, int64_t b) {
    fp8_grouped_linear_forward(ctx, fp8_rows.slice(a, b), w1, off, gu.slice(a, b), layer.experts.fp8_gate_up());
    fp8_fc1_backward(off, a, b);
  });
  const int64_t kb = (h_n + kFp8Tile - 1) / kFp8Tile;
  gemm("FP8 quantize fc1 input rows (1 x 128 tiles)", 0, 0, [&](const Tensor&, int64_t a, int64_t) {
    if (a == 0) fp8_quantize_rows(ctx, rows, layer.q_rows.slice(0, r), layer.s_rows.slice(0, kb * r).view({kb, r}));
  });
  gemm("FP8 quantize fc1 weight (once per step: blocks and transpose)", 0, 0, [&](const Tensor&, int64_t a, int64_t) {
    if (a != 0) return;
    mem.weights_changed();
    layer.experts.fp8_gate_up();
  });
  return res;
}

}  // namespace

std::vector<MoeBenchResult> bench_moe_layer(const MoeBenchOptions& opts) {
  if (opts.reps < 1 || opts.warmup < 0)
    MF_FAIL("bench moe-layer: --reps ", opts.reps, ", --warmup ", opts.warmup, " (need reps >= 1, warmup >= 0)");
  std::vector<std::string> shapes = opts.shapes;
  if (shapes.empty())
    for (const auto& [name, facts] : shape_facts()) shapes.push_back(name);
  std::vector<std::string> routings = opts.routings;
  if (routings.empty()) routings = {"balanced", "real"};
  std::vector<MoeBenchResult> out;
  for (const std::string& s : shapes)
    for (const std::string& r : routings) out.push_back(run_one(s, r, opts));
  return out;
}

namespace {

// The recorded repetition's operations in order: when each starts, how long it runs, how long the
// GPU was idle just before it, and the stage that issued it; then per stage the operations' time
// and the idle time before them.
std::string format_timeline(const MoeBenchResult& r) {
  const std::vector<GpuOpSpan>& ops = r.timeline;
  const std::vector<uint64_t> gaps = gaps_before(ops);
  const auto ms = [](uint64_t ns) { return static_cast<double>(ns) * 1e-6; };
  uint64_t end = 0, idle = 0, longest = 0;
  int counted = 0;  // gaps of a microsecond or more
  for (size_t i = 0; i < ops.size(); ++i) {
    end = std::max(end, ops[i].end);
    idle += gaps[i];
    longest = std::max(longest, gaps[i]);
    counted += gaps[i] >= 1000;
  }
  const double span_ms = ms(end - ops.front().begin);
  // Operation i's row of the per-stage table: 0 for what was issued before the layer's first
  // stage, else its stage + 1.
  const auto row_of = [&](size_t i) {
    const int st = i < r.timeline_stage.size() ? r.timeline_stage[i] : -1;
    return st >= 0 && st < static_cast<int>(r.stages.size()) ? static_cast<size_t>(st) + 1 : 0;
  };
  const auto row_name = [&](size_t row) {
    return row == 0 ? std::string("(before the layer)") : r.stages[row - 1].name;
  };
  std::string s = cat("\nGPU timeline of one repetition (CUPTI; of ", r.activity_reps,
                      " recorded after the timed ones, the one with the median span; recording slows the host's "
                      "calls, not the GPU's work): ",
                      fmt("%.3f", span_ms), " ms from the first operation's start to the last's end, the GPU idle ",
                      fmt("%.3f", ms(idle)), " ms of it (", fmt("%.1f%%", span_ms > 0 ? 100 * ms(idle) / span_ms : 0),
                      ") in ", counted, " gaps of 1 us or more, the longest ", fmt("%.1f", ms(longest) * 1e3), " us; ",
                      ops.size(), " operations. Per stage (the stage that issued them):\n\n");
  s += "| stage | operations | their ms (summed) | idle before them, ms |\n|---|---|---|---|\n";
  struct Row {
    int n = 0;
    uint64_t busy = 0, before = 0;
  };
  std::vector<Row> per(r.stages.size() + 1);
  for (size_t i = 0; i < ops.size(); ++i) {
    Row& row = per[row_of(i)];
    ++row.n;
    row.busy += ops[i].end - ops[i].begin;
    row.before += gaps[i];
  }
  for (size_t k = 0; k < per.size(); ++k)
    if (per[k].n > 0)
      s += cat("| ", row_name(k), " | ", per[k].n, " | ", fmt("%.3f", ms(per[k].busy)), " | ",
               fmt("%.3f", ms(per[k].before)), " |\n");
  s += "\nEvery operation:\n\n| # | stage | operation | starts at ms | ms | idle before, us "
       "|\n|---|---|---|---|---|---|\n";
  for (size_t i = 0; i < ops.size(); ++i) {
    std::string name = short_op_name(ops[i].name);
    for (char& c : name)
      if (c == '|') c = '/';
    s += cat("| ", i + 1, " | ", row_name(row_of(i)), " | `", name, "` | ",
             fmt("%.3f", ms(ops[i].begin - ops.front().begin)), " | ", fmt("%.3f", ms(ops[i].end - ops[i].begin)),
             " | ", fmt("%.1f", ms(gaps[i]) * 1e3), " |\n");
  }
  return s;
}

}  // namespace

std::string format_moe_bench(const std::vector<MoeBenchResult>& results, const std::string& header) {
  std::string s = header + "\n\n";
  s += "| shape | routing | tokens | rows | fwd+bwd ms | TFLOP/s | PyTorch bar | ratio | max/mean expert load |\n";
  s += "|---|---|---|---|---|---|---|---|---|\n";
  for (const MoeBenchResult& r : results)
    s += cat("| ", r.shape, " | ", r.routing, " | ", r.tokens, " | ", r.rows, " | ", fmt("%.3f", r.total.ms), " | ",
             fmt("%.1f", r.total.tflops), " | ", r.bar > 0 ? fmt("%.0f", r.bar) : "-", " | ",
             r.bar > 0 ? fmt("%.2f", r.total.tflops / r.bar) : "-", " | ",
             fmt("%.2f", r.load_mean > 0 ? r.load_max / r.load_mean : 0), " |\n");
  for (const MoeBenchResult& r : results) {
    s += cat("\n", r.shape, ", ", r.routing, " routing, ", r.tokens, " tokens:\n\n");
    if (!r.gpu_clocks.empty()) s += cat("GPU during the timed repetitions: ", r.gpu_clocks, "\n\n");
    s += "| part | median ms | share of the layer | TFLOP/s | ceiling | ratio |\n|---|---|---|---|---|---|\n";
    auto row = [&](const BenchTime& b, bool share) {
      s += cat("| ", b.name, " | ", fmt("%.3f", b.ms), " | ", share ? fmt("%.1f%%", 100 * b.ms / r.total.ms) : "-",
               " | ", b.tflops > 0 ? fmt("%.1f", b.tflops) : "-", " | ", b.ceiling > 0 ? fmt("%.0f", b.ceiling) : "-",
               " | ", b.ceiling > 0 ? fmt("%.2f", b.tflops / b.ceiling) : "-", " |\n");
    };
    for (const BenchTime& b : r.stages) row(b, true);
    for (const BenchTime& b : r.phases) row({"(within) " + b.name + ", mean", b.ms, 0, 0}, true);
    for (const BenchTime& b : r.gemms) row(b, false);
    if (r.activity_reps > 0 && !r.timeline.empty()) s += format_timeline(r);
    if (!r.activity_unavailable.empty()) s += cat("\nGPU timeline: not recorded (", r.activity_unavailable, ")\n");
  }
  return s;
}

}  // namespace moefold

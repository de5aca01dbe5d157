#include "moefold/bench/train_bench.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iterator>
#include <vector>

#include "moefold/bench/format.h"
#include "moefold/core/device.h"
#include "moefold/core/error.h"
#include "moefold/core/gpu_activity.h"
#include "moefold/core/profile.h"
#include "moefold/core/rng.h"
#include "moefold/data/token_dataset.h"
#include "moefold/parallel/mesh.h"
#include "moefold/train/trainer.h"

namespace moefold {

using bench_format::fmt;

namespace fs = std::filesystem;

namespace {
constexpr double kPeakTflops = 989;  // H100/H200 SXM dense bf16 (datasheet), as docs/benchmarks.md quotes MFU

// Profiling is process-wide: off again however the benchmark ends.
struct ProfileOff {
  ~ProfileOff() { profile_disable(); }
};
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0 : n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// `steps` more training steps recorded with CUPTI, each a window from the step's start to the end
// of its GPU work: medians of the host / GPU split into r.activity.
void record_activity(Trainer& trainer, int steps, TrainBenchResult& r) {
  if (!gpu_activity_start(&r.activity_unavailable)) return;
  std::vector<std::pair<uint64_t, uint64_t>> windows;
  for (int i = 0; i < steps; ++i) {
    const uint64_t t0 = gpu_activity_now();
    trainer.train_step();
    device_synchronize();
    windows.emplace_back(t0, gpu_activity_now());
  }
  const std::vector<GpuActivityWindow> w = gpu_activity_stop(windows, &r.activity_ops);
  r.activity_steps = steps;
  auto med = [&](auto GpuActivityWindow::*field) {
    std::vector<double> v;
    for (const GpuActivityWindow& x : w) v.push_back(static_cast<double>(x.*field));
    return median(v);
  };
  HostGpuSplit& a = r.activity;
  a.step_ms = med(&GpuActivityWindow::wall_ms);
  a.host_ms = med(&GpuActivityWindow::host_ms);
  a.host_wait_ms = med(&GpuActivityWindow::host_wait_ms);
  a.launch_ms = med(&GpuActivityWindow::launch_ms);
  a.gpu_busy_ms = med(&GpuActivityWindow::gpu_busy_ms);
  a.gpu_idle_ms = med(&GpuActivityWindow::gpu_idle_ms);
  a.largest_gap_ms = med(&GpuActivityWindow::largest_gap_ms);
  a.gpu_ops = med(&GpuActivityWindow::gpu_ops);
}

}  // namespace

TrainBenchResult bench_train(const Config& cfg_in, Communicator& world, const TrainBenchOptions& opts) {
  if (opts.steps < 1 || opts.warmup < 0)
    MF_FAIL("bench train: --steps ", opts.steps, ", --warmup ", opts.warmup, " (need steps >= 1, warmup >= 0)");
  Config cfg = cfg_in;
  const int64_t total = opts.warmup + opts.steps;
  cfg.train.steps = total;  // the LR schedule spans the benchmark
  cfg.train.eval_interval = 0;
  cfg.train.checkpoint_interval = 0;
  cfg.data.valid_fraction = 0;
  // Random tokens (uniform over the vocabulary), one window per sequence of every step, written
  // by rank 0 into a directory every rank sees under rank 0's name.
  int64_t id = ::getpid();
  world.broadcast(Tensor(&id, DType::i64, {1}), 0);
  const fs::path dir = opts.scratch_dir.empty() ? fs::temp_directory_path() / cat("moefold_bench_train_", id)
                                                : fs::path(opts.scratch_dir);
  const std::string path = (dir / "random.tokens").string();
  const int64_t tokens = cfg.train.global_batch_size * cfg.train.seq_len * (total + 1) + 1;
  if (world.rank() == 0) {
    ProfileScope scope("bench train: random tokens");
    fs::create_directories(dir);
    std::vector<uint32_t> t(static_cast<size_t>(tokens));
    for (int64_t i = 0; i < tokens; ++i)
      t[static_cast<size_t>(i)] = static_cast<uint32_t>(
          rng_below(2026, 1, static_cast<uint64_t>(i), static_cast<uint64_t>(cfg.model.vocab_size)));
    write_token_file(path, t, cfg.model.vocab_size <= 65536 ? 2 : 4);
  }
  world.barrier();
  cfg.data.path = path;
  const ParallelConfig layout = cfg.resolve_layout(world.size());
  Mesh mesh = Mesh::build(world, layout, cfg.moe.dispatcher == "hierarchical");
  const TokenDataset data = open_token_dataset(path);
  Trainer trainer(cfg, data, mesh, opts.device);
  {
    ProfileScope scope("bench train: init");
    trainer.init_fresh();
  }
  std::vector<double> ms;
  TrainBenchResult r;
  ProfileOff profile_off;
  // The breakdown's events would run the layers eagerly (layer_graphs.h): not while graphs replay.
  r.graphs_note = trainer.cuda_graphs_note();
  const bool graphs = cfg.train.cuda_graphs != "none" && r.graphs_note.empty();
  const bool breakdown = opts.breakdown && !graphs;
  if (opts.breakdown && graphs)
    r.graphs_note = "train.cuda_graphs = \"" + cfg.train.cuda_graphs +
                    "\": no phase breakdown (its events would run the graphs' work eagerly)";
  for (int64_t i = 0; i < total; ++i) {
    // The breakdown: the last warm-up step is profiled only to count the scopes of a step, so
    // that room for every timed step's is made before them (recording then creates no events).
    if (breakdown && i == std::max(opts.warmup - 1, 0)) profile_enable(opts.device);
    if (breakdown && i == opts.warmup) {
      int64_t scopes = 0;
      for (const PhaseTime& p : profile_collect()) scopes += p.calls;
      profile_reserve(scopes * opts.steps);
    }
    // Timed to the end of the step's GPU work: train_step returns once the optimizer's kernels
    // are queued, so without the wait a step's optimizer would be timed in the next step (and
    // the last step's in none, against the breakdown's events).
    const auto t0 = std::chrono::steady_clock::now();
    const StepMetrics& m = trainer.train_step();
    if (opts.device == Device::cuda) device_synchronize();
    const double step_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (i == 0) r.first_loss = m.loss;
    r.last_loss = m.loss;
    if (i >= opts.warmup) ms.push_back(step_ms);
  }
  if (breakdown) {
    const double steps = opts.steps;
    for (const double x : ms) r.mean_step_ms += x / steps;
    r.untimed_ms = r.mean_step_ms;
    for (const PhaseTime& p : profile_collect()) {
      r.phases.push_back(StepPhase{p.name, p.depth, p.ms / steps, p.self_ms / steps, p.top_level_ms / steps,
                                   static_cast<double>(p.calls) / steps});
      r.untimed_ms -= p.top_level_ms / steps;
      if (p.name.rfind("moe ep ", 0) == 0) r.exposed_a2a_ms += p.ms / steps;
    }
    profile_disable();
    if (layout.pp > 1) {  // every rank's share of the step in the stage exchanges, gathered
      double mine = 0;
      for (const StepPhase& p : r.phases)
        if (p.name == "pipeline send/recv") mine = r.mean_step_ms > 0 ? p.ms / r.mean_step_ms : 0;
      r.bubble.assign(static_cast<size_t>(world.size()), 0.0);
      world.all_gather(Tensor(&mine, DType::f64, {1}), Tensor(r.bubble.data(), DType::f64, {world.size()}));
      const double m = static_cast<double>(cfg.train.global_batch_size / (cfg.train.micro_batch_size * layout.dp)),
                   pp = static_cast<double>(layout.pp);
      r.bubble_theory = (pp - 1) / (m + pp - 1) / static_cast<double>(layout.vpp);  // interleaving divides it
    }
  }
  if (opts.device == Device::cuda && opts.activity_steps > 0) record_activity(trainer, opts.activity_steps, r);
  if (!trainer.cuda_graphs_note().empty()) r.graphs_note = trainer.cuda_graphs_note();  // stopped in the steps
  world.barrier();
  if (world.rank() == 0 && opts.scratch_dir.empty()) fs::remove_all(dir);
  r.ranks = world.size();
  r.step_ms = median(ms);
  r.tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_len;
  r.tokens_per_s = static_cast<double>(r.tokens_per_step) / (r.step_ms * 1e-3);
  r.flops_per_token = model_size(cfg.model, cfg.moe, cfg.train.seq_len).train_flops_per_token;
  r.tflops_per_gpu = r.tokens_per_s * r.flops_per_token / r.ranks / 1e12;
  r.mfu = r.tflops_per_gpu / kPeakTflops;
  if (opts.device == Device::cuda) {
    r.peak_memory_mib = static_cast<double>(device_bytes_peak()) / (1 << 20);
    r.planned_mib = static_cast<double>(trainer.planned_bytes()) / (1 << 20);
    static const char* const kSlots[] = {"sum_squares",
                                         "cross_entropy",
                                         "router_loss",
                                         "permute_plan",
                                         "attention",
                                         "grouped_gemm_args",
                                         "grouped_gemm_workspace",
                                         "fp8_operand_a",
                                         "fp8_operand_b",
                                         "fp8_gemm_args",
                                         "fp8_tile_map",
                                         "rmsnorm_dw",
                                         "arrivals"};
    static_assert(std::size(kSlots) == static_cast<size_t>(ScratchSlot::count));
    for (int i = 0; i < static_cast<int>(ScratchSlot::count); ++i)
      r.scratch_mib.emplace_back(
          kSlots[i], static_cast<double>(trainer.exec().scratch_bytes(static_cast<ScratchSlot>(i))) / (1 << 20));
  }
  return r;
}

std::string format_train_bench(const Config& cfg, const TrainBenchResult& r, const std::string& header) {
  std::string s = header + "\n\n";
  s += "| config | layers | tokens/step | ranks | median step ms | tokens/s | model TFLOP/s per GPU | MFU | peak "
       "memory MiB | loss first -> last |\n|---|---|---|---|---|---|---|---|---|---|\n";
  s += cat("| ", cfg.preset, " | ", cfg.model.num_hidden_layers, " | ", r.tokens_per_step, " | ", r.ranks, " | ",
           fmt("%.1f", r.step_ms), " | ", fmt("%.0f", r.tokens_per_s), " | ", fmt("%.1f", r.tflops_per_gpu), " | ",
           fmt("%.3f", r.mfu), " | ", fmt("%.0f", r.peak_memory_mib), " | ", fmt("%.4f", r.first_loss), " -> ",
           fmt("%.4f", r.last_loss), " |\n");
  if (r.peak_memory_mib > 0) {
    double scratch = 0;
    std::string slots;
    for (const auto& [name, mib] : r.scratch_mib) {
      scratch += mib;
      if (mib >= 1) slots += cat(slots.empty() ? "" : ", ", name, " ", fmt("%.0f", mib));
    }
    s += cat("\nPeak device memory ", fmt("%.0f", r.peak_memory_mib), " MiB = planned (moefold plan) ",
             fmt("%.0f", r.planned_mib), " + ops' scratch ", fmt("%.0f", scratch), " (", slots, ") + other ",
             fmt("%.0f", r.peak_memory_mib - r.planned_mib - scratch), " (library workspaces, staging)\n");
  }
  if (!r.bubble.empty()) {
    std::string each;
    for (size_t k = 0; k < r.bubble.size(); ++k)
      each += cat(k ? ", " : "", "rank ", k, " ", fmt("%.1f%%", 100 * r.bubble[k]));
    s += cat("\nPipeline bubble (share of the step in the stage exchanges, transfers included): ", each,
             "; in theory (pp - 1) / (m + pp - 1)", cfg.parallel.vpp > 1 ? " / vpp" : "", " = ",
             fmt("%.1f%%", 100 * r.bubble_theory), "\n");
  }
  if (r.exposed_a2a_ms > 0)
    s +=
        cat("\nExposed expert all-to-all (the compute stream waiting on the EP counts and rounds, \"moe ep\" phases): ",
            fmt("%.3f", r.exposed_a2a_ms), " ms per step (",
            fmt("%.1f%%", r.mean_step_ms > 0 ? 100 * r.exposed_a2a_ms / r.mean_step_ms : 0), ")",
            cfg.parallel.overlap_moe_a2a ? ", parallel.overlap_moe_a2a on" : "", "\n");
  if (r.activity_steps > 0) {
    const HostGpuSplit& a = r.activity;
    auto of = [&](double ms) {
      return cat(fmt("%.3f", ms), " ms (", fmt("%.1f%%", a.step_ms > 0 ? 100 * ms / a.step_ms : 0), ")");
    };
    s += cat("\nHost and GPU (CUPTI, medians of ", r.activity_steps,
             " more steps recorded after the timed ones: ", fmt("%.3f", a.step_ms),
             " ms each, recording included): host ", of(a.host_ms), ", of it in kernel launches ", of(a.launch_ms),
             "; host waiting for the GPU ", of(a.host_wait_ms), "; GPU busy ", of(a.gpu_busy_ms), ", idle ",
             of(a.gpu_idle_ms), " (longest gap ", fmt("%.3f", a.largest_gap_ms), " ms); ", fmt("%.0f", a.gpu_ops),
             " GPU operations per step\n");
    constexpr size_t kShown = 30;
    s += cat("\nGPU operations by kernel (CUPTI, per recorded step; the ", std::min(kShown, r.activity_ops.size()),
             " longest of ", r.activity_ops.size(),
             "):\n\n| kernel | calls | ms | share of GPU busy |\n|---|---|---|---|\n");
    for (size_t i = 0; i < std::min(kShown, r.activity_ops.size()); ++i) {
      const GpuOpTotal& t = r.activity_ops[i];
      std::string name = t.name.size() > 90 ? t.name.substr(0, 87) + "..." : t.name;
      for (char& c : name)
        if (c == '|') c = '/';
      s += cat("| `", name, "` | ", fmt("%.1f", static_cast<double>(t.count) / r.activity_steps), " | ",
               fmt("%.4f", t.ms / r.activity_steps), " | ",
               fmt("%.1f%%", a.gpu_busy_ms > 0 ? 100 * t.ms / r.activity_steps / a.gpu_busy_ms : 0), " |\n");
    }
  } else if (!r.activity_unavailable.empty()) {
    s += cat("\nHost and GPU: not measured (", r.activity_unavailable, ")\n");
  }
  if (!r.graphs_note.empty()) s += cat("\n", r.graphs_note, "\n");
  if (r.phases.empty()) return s;
  s += cat("\nWhere a step's time goes (means over the timed steps: ", fmt("%.1f", r.mean_step_ms),
           " ms per step; on a GPU, CUDA events on the compute stream, so a phase includes the stream's idle time "
           "inside it; a nested phase has a dot per level):\n\n");
  s += "| phase | ms per step | share of step | calls per step | self ms per step |\n|---|---|---|---|---|\n";
  auto share = [&](double ms) { return fmt("%.1f%%", r.mean_step_ms > 0 ? 100 * ms / r.mean_step_ms : 0); };
  for (const StepPhase& p : r.phases) {
    std::string name;
    for (int d = 0; d < p.depth; ++d) name += ". ";
    s += cat("| ", name, p.name, " | ", fmt("%.3f", p.ms), " | ", share(p.ms), " | ", fmt("%g", p.calls), " | ",
             fmt("%.3f", p.self_ms), " |\n");
  }
  s += cat("| untimed (outside every top-level scope) | ", fmt("%.3f", r.untimed_ms), " | ", share(r.untimed_ms),
           " | - | - |\n");
  return s;
}

}  // namespace moefold

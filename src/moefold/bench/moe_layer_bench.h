// `moefold bench moe-layer`: one MoE layer (router, dispatch, experts, combine) forward and
// backward at the shapes of docs/benchmarks.md, on random data, with balanced routing
// (token t's k-th expert is (t*K + k) mod E) or the routing of the (random) router itself.
// Times are medians of `reps` timed repetitions after `warmup` (CUDA events on the compute
// stream; host clock on the CPU), per stage and in total, plus the expert grouped GEMMs alone
// against their measured ceilings. With `ep` (mpirun -np N / torchrun) the experts are split over
// the ranks and every rank times its own layer (TFLOP/s per GPU: the same per-token work).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moefold/comm/communicator.h"
#include "moefold/core/gpu_activity.h"
#include "moefold/core/tensor.h"

namespace moefold {

struct MoeBenchOptions {
  std::vector<std::string> shapes;    // presets; empty: the four MoE shapes of docs/benchmarks.md
  std::vector<std::string> routings;  // "balanced", "real"; empty: both
  int64_t tokens = 0;                 // tokens per layer call; 0: docs/benchmarks.md's for the shape
  int reps = 20, warmup = 3;
  Device device = Device::cuda;        // cuda: bf16 mixed precision; cpu: fp32 (small shapes)
  std::vector<std::string> overrides;  // section.key=value applied to every shape's config
  // false: every repetition is a step's first micro-batch (expert weight gradients written);
  // true: a later one (added to the gradients of the repetitions before it).
  bool accumulate_grads = false;
  // The experts' (and shared experts') GEMMs in FP8 (train.fp8 = blockwise); the GEMM table then
  // also times the FP8 grouped GEMMs alone and their operands' quantization.
  bool fp8 = false;
  // Expert parallelism over these ranks (every rank runs the benchmark with its own `tokens`;
  // the experts are split, tokens travel all-to-all); null or one rank: all experts here.
  Communicator* ep = nullptr;
  // GPU: repetitions after the others recorded with CUPTI for the layer's timeline (every kernel in
  // order, with the GPU's idle time before it); 0: none.
  int activity_reps = 2;
};

struct BenchTime {
  std::string name;
  double ms = 0;       // median
  double tflops = 0;   // 0 when no FLOP count is given
  double ceiling = 0;  // TFLOP/s of docs/benchmarks.md's ceiling for it (0: none)
};

struct MoeBenchResult {
  std::string shape, routing;
  int64_t tokens = 0, rows = 0;   // T; R rows handed to the experts
  int64_t local_experts = 0;      // experts on this rank (E / EP)
  double flops = 0;               // forward + backward model FLOPs (3 x forward)
  BenchTime total;                // forward + backward of the layer
  double bar = 0;                 // the PyTorch bar of docs/benchmarks.md (TFLOP/s; 0: none)
  std::vector<BenchTime> stages;  // router, dispatch, experts, combine and their backwards
  std::vector<BenchTime> gemms;   // the grouped GEMMs alone (same rows and offsets)
  // Phases inside the stages (ProfileScope names: the experts' pieces, expert parallelism's
  // waits and counts exchange), means per repetition over extra, untimed repetitions that run
  // with the profiler on (the timed ones run with it off).
  std::vector<BenchTime> phases;
  double load_max = 0, load_mean = 0;  // tokens per expert (router's view, before capacity)
  // Sum of squares of the experts' gate_up gradient after the timed repetitions: one
  // repetition's (written every time), or all of them added (accumulate_grads).
  double expert_grad_sq = 0;
  // The GPU's clocks and power over the timed repetitions (describe_gpu_clocks), or why they
  // were not sampled; empty on the CPU.
  std::string gpu_clocks;
  // The timeline (MoeBenchOptions::activity_reps > 0, GPU): of the recorded repetitions the one
  // whose span from the first operation's start to the last's end is the median, its operations
  // by start time; or why none was recorded.
  int activity_reps = 0;
  std::vector<GpuOpSpan> timeline;
  std::vector<int> timeline_stage;  // each operation's index in `stages` (-1: issued before the first)
  std::string activity_unavailable;
};

// Runs every (shape, routing) of `opts`. Fails (moefold::Error) on a bad shape or option.
std::vector<MoeBenchResult> bench_moe_layer(const MoeBenchOptions& opts);
// A Markdown report: one summary table, then each run's stage and GEMM breakdown.
std::string format_moe_bench(const std::vector<MoeBenchResult>& results, const std::string& header);

}  // namespace moefold

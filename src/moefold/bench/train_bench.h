// `moefold bench train`: full training steps (forward, backward, gradient reduction, clipping,
// AdamW) of a config on random tokens, on this process's device (or every rank of `world`):
// median step time, tokens/s, model TFLOP/s per GPU and MFU, peak planned device memory; and
// where a step's time goes: the phases of core/profile.h timed over the same steps.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "moefold/comm/communicator.h"
#include "moefold/core/gpu_activity.h"
#include "moefold/model/config.h"

namespace moefold {

struct TrainBenchOptions {
  int steps = 10;  // timed optimizer steps (median reported)
  int warmup = 2;  // untimed steps first (they size the ops' scratch, build cuDNN graphs, ...)
  Device device = Device::cuda;
  std::string scratch_dir;  // where the random token file goes (a fresh temporary directory if empty)
  bool breakdown = true;    // time the phases of the timed steps (CUDA events; host clock on the CPU)
  // GPU: steps after the timed ones recorded with CUPTI (core/gpu_activity.h) for the host / GPU
  // split (0: none). Recording slows the CUDA calls, so these steps are not the timed ones.
  int activity_steps = 3;
};

// Host and GPU time of a step (medians over TrainBenchOptions::activity_steps, CUPTI).
struct HostGpuSplit {
  double step_ms = 0;         // wall time of the recorded step
  double host_ms = 0;         // the host planning and issuing work (step - host_wait)
  double host_wait_ms = 0;    // the host inside calls that wait for the GPU
  double launch_ms = 0;       // the host inside kernel launches
  double gpu_busy_ms = 0;     // the union of the GPU's work
  double gpu_idle_ms = 0;     // step - busy: the GPU with nothing of this process to run
  double largest_gap_ms = 0;  // the longest of those gaps
  double gpu_ops = 0;         // kernels, copies and memsets per step
};

// One phase of the step breakdown: means per timed step.
struct StepPhase {
  std::string name;
  int depth = 0;            // phases open around its first call (0: top level)
  double ms = 0;            // phases nested inside it included
  double self_ms = 0;       // ms minus the phases nested directly inside it
  double top_level_ms = 0;  // the part of ms from calls made outside every other phase
  double calls = 0;
};

struct TrainBenchResult {
  int64_t tokens_per_step = 0;  // global batch x sequence length
  double step_ms = 0;           // median
  double tokens_per_s = 0;      // all ranks together
  double flops_per_token = 0;   // model FLOPs of a training step per token (moefold info)
  double tflops_per_gpu = 0;    // model TFLOP/s per rank
  double mfu = 0;               // against 989 TFLOP/s (H100/H200 SXM dense bf16, docs/benchmarks.md)
  double peak_memory_mib = 0;   // device_malloc's high-water mark (0 on the CPU)
  // What the peak holds (GPU): the trainer's planned bytes (moefold plan's), the ops' scratch by
  // ScratchSlot, and the rest (library workspaces, communicator staging).
  double planned_mib = 0;
  std::vector<std::pair<std::string, double>> scratch_mib;
  double first_loss = 0, last_loss = 0;
  int ranks = 1;
  // Where the time goes (this rank's phases; empty without opts.breakdown). The
  // phases are means over the timed steps, so they are set against the mean step time.
  std::vector<StepPhase> phases;  // in the order first seen
  double mean_step_ms = 0;        // mean of the timed steps
  double untimed_ms = 0;          // mean_step_ms minus every phase's top_level_ms
  // Pipeline parallelism (with the breakdown): each rank's share of the mean step spent in the
  // stage exchanges ("pipeline send/recv": waiting for the neighbouring stage, the transfers
  // included), and the bubble in theory, (pp - 1) / (m + pp - 1) for m micro-batches (1F1B; divided
  // by vpp when interleaved).
  std::vector<double> bubble;
  double bubble_theory = 0;
  // Expert parallelism (with the breakdown): the exposed all-to-all, ms per step in which this rank's
  // compute stream waits on the EP counts exchange and rounds (the "moe ep ..." phases); what
  // parallel.overlap_moe_a2a hides.
  double exposed_a2a_ms = 0;
  // The host / GPU split (GPU, with activity_steps > 0): recorded steps, or why it could not be had.
  int activity_steps = 0;
  HostGpuSplit activity;
  // The recorded steps' GPU operations by kernel (count and ms over all of them), longest first.
  std::vector<GpuOpTotal> activity_ops;
  std::string activity_unavailable;
  // train.cuda_graphs: why the layers were not replayed, or that the breakdown was left out.
  std::string graphs_note;
};

// Collective over `world` (every rank calls it). Throws moefold::Error on bad options.
TrainBenchResult bench_train(const Config& cfg, Communicator& world, const TrainBenchOptions& opts);
// A Markdown report of one run.
std::string format_train_bench(const Config& cfg, const TrainBenchResult& r, const std::string& header);

}  // namespace moefold

// `moefold bench`: moe-layer (one MoE layer forward+backward at the full-size presets' MoE shapes)
// and train (full training steps on random tokens); rank 0 prints the table of medians
// (docs/benchmarks.md records them).
#include <cstdio>

#include "moefold/bench/moe_layer_bench.h"
#include "moefold/bench/train_bench.h"
#include "moefold/cli/commands.h"
#include "moefold/core/error.h"

namespace moefold::cli {

namespace {

struct BenchArgs {
  CLI::App* moe_layer = nullptr;
  MoeBenchOptions moe;
  std::string moe_device = "auto";
  CLI::App* train = nullptr;
  ConfigOptions config;
  TrainBenchOptions steps;
  std::string train_device = "auto";
  bool no_breakdown = false;
};

void bench_moe(BenchArgs& a, World& w) {
  MoeBenchOptions& o = a.moe;
  o.device = pick_device(a.moe_device);
  Communicator& world = make_world(o.device, Config{}.parallel.timeout_s, w);
  if (world.size() > 1) o.ep = &world;  // under mpirun / torchrun: EP over every rank
  const std::string where = o.device == Device::cuda ? cuda_device_name() : "CPU (fp32)";
  const std::vector<MoeBenchResult> r = bench_moe_layer(o);
  if (world.rank() == 0)
    std::fputs(format_moe_bench(
                   r, cat("MoE layer forward+backward on ", where,
                          world.size() > 1 ? cat(", EP = ", world.size(), " (rank 0's times)") : "",
                          o.fp8 ? ", experts in FP8 (blockwise)" : "", ", median of ", o.reps, " after ", o.warmup,
                          o.accumulate_grads ? " warm-up; each repetition is a later micro-batch of a step (expert "
                                               "weight gradients added to in fp32)"
                                             : " warm-up; each repetition is a step's first micro-batch (expert weight "
                                               "gradients written in fp32, the router's accumulated)"))
                   .c_str(),
               stdout);
}

void bench_steps(BenchArgs& a, World& w) {
  const Config cfg = a.config.load();
  TrainBenchOptions& o = a.steps;
  o.device = pick_device(a.train_device);
  o.breakdown = !a.no_breakdown;
  Communicator& world = make_world(o.device, cfg.parallel.timeout_s, w);
  const TrainBenchResult r = bench_train(cfg, world, o);
  if (world.rank() == 0)
    std::fputs(
        format_train_bench(cfg, r,
                           cat("Training steps on ", o.device == Device::cuda ? cuda_device_name() : "the CPU (fp32)",
                               ", random tokens, median of ", o.steps, " after ", o.warmup, " warm-up"))
            .c_str(),
        stdout);
}

}  // namespace

Command add_bench(CLI::App& app) {
  auto a = std::make_shared<BenchArgs>();
  CLI::App* cmd = app.add_subcommand("bench", "benchmarks (medians of timed repetitions; see docs/benchmarks.md)");
  cmd->require_subcommand(1);

  CLI::App* moe = a->moe_layer = cmd->add_subcommand(
      "moe-layer", "one MoE layer forward+backward at docs/benchmarks.md's shapes, with its stage and GEMM breakdown");
  moe->add_option("--shape", a->moe.shapes,
                  "preset whose MoE shape to run (repeatable; default: qwen3-30b-a3b, qwen3-235b-a22b, "
                  "deepseek-v3, mixtral-8x7b)");
  moe->add_option("--routing", a->moe.routings, "balanced and/or real (repeatable; default both)")
      ->check(CLI::IsMember({"balanced", "real"}));
  moe->add_option("--tokens", a->moe.tokens, "tokens per call (default: docs/benchmarks.md's for the shape)");
  moe->add_option("--reps", a->moe.reps, "timed repetitions (median reported)");
  moe->add_option("--warmup", a->moe.warmup, "untimed repetitions first");
  moe->add_option("--set", a->moe.overrides, "override a config key of every shape: section.key=value");
  moe->add_flag("--accumulate-grads", a->moe.accumulate_grads,
                "time a step's later micro-batches (expert weight gradients added to, not written)");
  moe->add_flag("--fp8", a->moe.fp8,
                "the experts' GEMMs in FP8 (train.fp8 = blockwise), plus the FP8 GEMMs and quantization alone");
  moe->add_option("--device", a->moe_device, "cuda (bf16), cpu (fp32) or auto")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));

  CLI::App* train = a->train = cmd->add_subcommand(
      "train",
      "full training steps on random tokens: tokens/s, model TFLOP/s per GPU, MFU, peak memory, and where a step's "
      "time goes (per-phase breakdown)");
  add_config_options(train, a->config);
  train->add_option("--steps", a->steps.steps, "timed steps (median reported)");
  train->add_option("--warmup", a->steps.warmup, "untimed steps first");
  train->add_option("--device", a->train_device, "cuda (bf16), cpu (fp32) or auto")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  train->add_flag("--no-breakdown", a->no_breakdown,
                  "time the steps only (no phase scopes: CUDA events cost a few microseconds each)");
  train
      ->add_option("--activity-steps", a->steps.activity_steps,
                   "GPU: steps after the timed ones recorded with CUPTI for the host time and the GPU's idle time "
                   "(0: none)")
      ->check(CLI::NonNegativeNumber);

  return {cmd, [a](World& w) {
            if (*a->train)
              bench_steps(*a, w);
            else if (*a->moe_layer)
              bench_moe(*a, w);
          }};
}

}  // namespace moefold::cli

// `moefold bench`: moe-layer (one MoE layer forward+backward at the full-size presets' MoE shapes),
// fp8-error (FP8's gradient error per parameter against the same step without it)
// and train (full training steps on random tokens); rank 0 prints the table of medians
// (docs/benchmarks.md records them).
#include <cstdio>

#include "moefold/bench/fp8_error_bench.h"
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
  CLI::App* fp8_error = nullptr;
  ConfigOptions fp8_config;
  Fp8ErrorOptions fp8;
  std::string fp8_device = "auto";
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

void bench_fp8(BenchArgs& a, World& w) {
  const Config cfg = a.fp8_config.load();
  Fp8ErrorOptions& o = a.fp8;
  o.device = pick_device(a.fp8_device);
  Communicator& world = make_world(o.device, cfg.parallel.timeout_s, w);
  const Fp8ErrorResult r = bench_fp8_error(cfg, world, o);
  std::fputs(format_fp8_error(
                 r, cat("FP8 (blockwise) against the same step without it on ",
                        o.device == Device::cuda ? cuda_device_name() + " (bf16 mixed precision)" : "the CPU (fp32)",
                        ": gradients of ", o.batches, " global batch", o.batches == 1 ? "" : "es", " from ",
                        o.checkpoint.empty() ? "a fresh init" : o.checkpoint))
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
  moe->add_option("--activity-reps", a->moe.activity_reps,
                  "GPU: repetitions after the timed ones recorded with CUPTI for the layer's timeline (every kernel "
                  "in order, with the GPU's idle time before it; 0: none)")
      ->check(CLI::NonNegativeNumber);
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

  CLI::App* fp8 = a->fp8_error = cmd->add_subcommand(
      "fp8-error",
      "what FP8 (train.fp8 = blockwise) does to a step's gradients: per parameter, the relative error and cosine "
      "against the same step without FP8, from the same weights and batches (nothing timed)");
  add_config_options(fp8, a->fp8_config);
  fp8->add_option("--from", a->fp8.checkpoint,
                  "start from this checkpoint's weights and data position (runs/.../checkpoints/step_NNNNNNNN; "
                  "pass its run's config.toml as --config) instead of a fresh init");
  fp8->add_option("--batches", a->fp8.batches, "global batches compared (sums pooled)")->check(CLI::PositiveNumber);
  fp8->add_flag("--per-layer", a->fp8.per_layer, "one row per layer (else each parameter's layers together)");
  fp8->add_option("--device", a->fp8_device, "cuda (bf16 against FP8), cpu (fp32 against emulated FP8) or auto")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));

  return {cmd, [a](World& w) {
            if (*a->fp8_error)
              bench_fp8(*a, w);
            else if (*a->train)
              bench_steps(*a, w);
            else if (*a->moe_layer)
              bench_moe(*a, w);
          }};
}

}  // namespace moefold::cli

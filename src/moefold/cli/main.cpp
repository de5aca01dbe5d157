// The moefold command line: train, eval, convert, info, config, prepare, bench. User mistakes end in one line on stderr
// ("moefold: error: ...") and exit code 1; usage mistakes get CLI11's message and non-zero code.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "moefold/bench/moe_layer_bench.h"
#include "moefold/bench/train_bench.h"
#include "moefold/comm/communicator.h"
#include "moefold/comm/mpi.h"
#include "moefold/comm/nccl.h"
#include "moefold/core/device.h"
#include "moefold/core/error.h"
#include "moefold/data/npy.h"
#include "moefold/data/prepare.h"
#include "moefold/data/token_dataset.h"
#include "moefold/model/config.h"
#include "moefold/ops/blas.h"
#include "moefold/train/evaluate.h"
#include "moefold/train/hf_import.h"
#include "moefold/train/run.h"
#include "moefold/train/upcycle.h"

namespace {

using namespace moefold;
namespace fs = std::filesystem;

std::string new_run_dir() {
  auto now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  char buf[64];
  std::strftime(buf, sizeof buf, "runs/run-%Y%m%d-%H%M%S", std::localtime(&now));
  return buf;
}

// The newest runs/run-* directory (for --resume without --run-dir).
std::string newest_run_dir() {
  std::string best;
  std::error_code ec;
  if (!fs::is_directory("runs", ec)) return best;
  for (const auto& e : fs::directory_iterator("runs", ec)) {
    std::string p = e.path().string();
    if (e.is_directory() && e.path().filename().string().starts_with("run-") && p > best) best = p;
  }
  return best;
}

void print_info(const Config& c) {
  ModelSize s = model_size(c.model, c.moe, c.train.seq_len);
  std::printf("preset              %s\n", c.preset.c_str());
  std::printf("architecture        %s\n", c.model.architecture.c_str());
  std::printf("layers              %lld (hidden %lld, %lld q / %lld kv heads x %lld, vocab %lld)\n",
              static_cast<long long>(c.model.num_hidden_layers), static_cast<long long>(c.model.hidden_size),
              static_cast<long long>(c.model.num_attention_heads), static_cast<long long>(c.model.num_key_value_heads),
              static_cast<long long>(c.model.head_dim), static_cast<long long>(c.model.vocab_size));
  std::printf("experts             %lld, top-%lld, FFN %lld, %s scores\n", static_cast<long long>(c.moe.num_experts),
              static_cast<long long>(c.moe.num_experts_per_tok), static_cast<long long>(c.moe.moe_intermediate_size),
              c.moe.scoring_func == ScoreFunc::softmax ? "softmax" : "sigmoid");
  std::printf("total parameters    %lld (%.3f B)\n", static_cast<long long>(s.total_params), s.total_params / 1e9);
  std::printf("active parameters   %lld (%.3f B)\n", static_cast<long long>(s.active_params), s.active_params / 1e9);
  if (s.mtp_params > 0)
    std::printf("MTP parameters      %lld (%.3f B; %lld depth(s), embedding and head shared)\n",
                static_cast<long long>(s.mtp_params), s.mtp_params / 1e9,
                static_cast<long long>(c.model.num_nextn_predict_layers));
  std::printf("train FLOPs/token   %.4g (seq_len %lld; 3 x forward)\n", s.train_flops_per_token,
              static_cast<long long>(c.train.seq_len));
}

// --device auto|cpu|cuda: auto is the GPU when one is visible.
Device pick_device(const std::string& name) {
  std::string n = name;
  if (n == "auto") n = cuda_built() && cuda_device_count() > 0 ? "cuda" : "cpu";
  if (n == "cpu") return Device::cpu;
  if (!cuda_built()) MF_FAIL("--device cuda: this moefold was built without CUDA (no nvcc at build time)");
  if (cuda_device_count() == 0) MF_FAIL("--device cuda: no GPU is visible to this process");
  return Device::cuda;
}

// The world of this process: CPU ranks talk over MPI; GPU ranks over NCCL, bootstrapped by MPI
// under mpirun/srun (kept alive in `bootstrap`) or by the torchrun / Slurm environment (RANK,
// WORLD_SIZE, MASTER_ADDR, MASTER_PORT); one rank alone otherwise. Selects this rank's GPU.
std::unique_ptr<Communicator> make_world(Device device, double timeout_s, std::unique_ptr<Communicator>& bootstrap) {
  std::unique_ptr<Communicator> world;
  if (launched_by_mpi()) {
    bootstrap = make_mpi_world(timeout_s);
    if (device == Device::cuda) world = make_nccl_world(bootstrap.get(), timeout_s);
  } else if (launched_by_torchrun()) {
    if (device != Device::cuda)
      MF_FAIL("launched by torchrun (RANK/WORLD_SIZE set): CPU ranks need mpirun; use --device cuda on GPUs");
    world = make_nccl_world(nullptr, timeout_s);
  }
  if (!world) world = bootstrap ? std::move(bootstrap) : make_self_communicator();
  if (device == Device::cuda && world->size() == 1) cuda_set_device(local_rank_from_env() % cuda_device_count());
  return world;
}

}  // namespace

int main(int argc, char** argv) {
  moefold::reexec_with_best_blas_core(argv);
  CLI::App app{"moefold: train Mixture-of-Experts transformers"};
  app.require_subcommand(1);

  std::string config_spec;
  std::vector<std::string> overrides;
  auto add_config = [&](CLI::App* cmd) {
    cmd->add_option("--config", config_spec, "preset name (tiny, qwen3-30b-a3b, qwen3-235b-a22b) or TOML file");
    cmd->add_option("--set", overrides, "override a config key: section.key=value (repeatable)");
  };

  CLI::App* train = app.add_subcommand("train", "train a model");
  add_config(train);
  RunOptions run;
  train->add_option("--steps", run.stop_step, "train until this step (default: train.steps)");
  train->add_option("--run-dir", run.run_dir, "run directory (default: runs/run-DATE-TIME)");
  train->add_flag("--resume", run.resume, "continue from the latest checkpoint in the run directory");
  train->add_flag("--quiet", run.quiet, "no progress output");
  std::string device_name = "auto";
  train
      ->add_option("--device", device_name,
                   "cuda: this process's GPU (LOCAL_RANK or the MPI local rank picks it) in bf16 mixed precision, "
                   "ranks joined by NCCL; cpu: fp32 on the CPU, ranks joined by MPI; auto (default): cuda when "
                   "a GPU is visible")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));

  CLI::App* info = app.add_subcommand("info", "print parameter counts and FLOPs of a config");
  add_config(info);

  CLI::App* show = app.add_subcommand("config", "print the resolved config as TOML (every key)");
  add_config(show);

  CLI::App* eval = app.add_subcommand("eval", "mean next-token loss of sequences under a checkpoint (one JSON line)");
  std::string eval_ckpt, eval_tokens;
  int64_t eval_seq_len = 0;
  eval->add_option("--checkpoint", eval_ckpt, "checkpoint directory (runs/.../checkpoints/step_NNNNNNNN)")->required();
  eval->add_option("--tokens", eval_tokens, "2-D int32/int64 .npy (one sequence per row) or a token file")->required();
  eval->add_option("--seq-len", eval_seq_len, "with a token file: consecutive sequences of this many tokens");
  std::string eval_logits;
  eval->add_option("--logits", eval_logits,
                   "also write the logits as float32 .npy [sequences, length - 1, vocab] (to compare with another "
                   "implementation)");

  CLI::App* convert = app.add_subcommand("convert",
                                         "Hugging Face model directory <-> moefold (--from-hf DIR --to RUN_DIR, or "
                                         "--from CKPT_DIR --to-hf DIR); dense checkpoint -> MoE run (--upcycle "
                                         "--from CKPT_DIR --to RUN_DIR)");
  std::string from_hf, convert_to, convert_from, to_hf;
  bool upcycle_dense = false;
  int64_t granularity = 1;
  auto* o_from_hf =
      convert->add_option("--from-hf", from_hf, "Hugging Face model directory (config.json, *.safetensors)");
  auto* o_to =
      convert->add_option("--to", convert_to, "run directory to create (config.toml, checkpoints/step_00000000)");
  auto* o_from = convert->add_option("--from", convert_from, "moefold checkpoint directory");
  auto* o_to_hf = convert->add_option("--to-hf", to_hf, "Hugging Face model directory to write");
  auto* o_upcycle = convert->add_flag("--upcycle", upcycle_dense,
                                      "initialise an MoE run from the dense checkpoint --from: every expert a copy "
                                      "of the dense MLP (or a 1/G slice of one), step-0 logits those of the dense "
                                      "model");
  auto* o_granularity = convert->add_option(
      "--granularity", granularity,
      "with --upcycle: G experts per copy of the dense MLP, each intermediate_size / G wide (default 1)");
  auto* o_convert_set = convert->add_option(
      "--set", overrides, "with --upcycle: override a key of the upcycled config: section.key=value (repeatable)");
  o_from_hf->needs(o_to)->excludes(o_from)->excludes(o_upcycle);
  o_to_hf->needs(o_from)->excludes(o_to)->excludes(o_upcycle);
  o_upcycle->needs(o_from)->needs(o_to);
  o_granularity->needs(o_upcycle);
  o_convert_set->needs(o_upcycle);
  // --from and --to go together only under --upcycle, which needs/excludes cannot say.
  convert->parse_complete_callback([&] {
    if (!*o_upcycle && *o_from && !*o_to_hf)
      throw CLI::RequiresError("--from", "--to-hf (export) or --upcycle --to RUN_DIR (upcycle)");
    if (!*o_upcycle && *o_to && !*o_from_hf) throw CLI::RequiresError("--to", "--from-hf or --upcycle --from");
    if (!*o_from && !*o_from_hf)
      throw CLI::RequiredError(
          "convert: give --from-hf DIR --to RUN_DIR, --from CKPT_DIR --to-hf DIR or --upcycle --from CKPT_DIR --to "
          "RUN_DIR",
          CLI::ExitCodes::RequiredError);
  });

  CLI::App* prep = app.add_subcommand("prepare", "tokenize text files or directories into a token file");
  std::vector<std::string> inputs;
  std::string output, format = "plain";
  prep->add_option("inputs", inputs, "text files or directories")->required();
  prep->add_option("-o,--output", output, "output .tokens file, or Megatron prefix with --format megatron")->required();
  prep->add_option("--format", format, "plain (.tokens) or megatron (.bin/.idx)")
      ->check(CLI::IsMember({"plain", "megatron"}));
  PrepareOptions prep_opts;
  auto* o_tokenizer = prep->add_option("--tokenizer", prep_opts.tokenizer,
                                       "Hugging Face tokenizer.json (byte-level BPE, e.g. Qwen3's or DeepSeek-V3's); "
                                       "default: bytes");
  prep->add_option("--eos-token", prep_opts.eos_token,
                   "token appended to each document (default: <|endoftext|>, <｜end▁of▁sentence｜> or </s>)")
      ->needs(o_tokenizer);

  CLI::App* bench = app.add_subcommand("bench", "benchmarks (medians of timed repetitions; see docs/benchmarks.md)");
  bench->require_subcommand(1);
  CLI::App* bench_moe = bench->add_subcommand(
      "moe-layer", "one MoE layer forward+backward at BENCHMARKS.md's shapes, with its stage and GEMM breakdown");
  MoeBenchOptions moe_bench;
  std::string bench_device = "auto";
  bench_moe->add_option("--shape", moe_bench.shapes,
                        "preset whose MoE shape to run (repeatable; default: qwen3-30b-a3b, qwen3-235b-a22b, "
                        "deepseek-v3, mixtral-8x7b)");
  bench_moe->add_option("--routing", moe_bench.routings, "balanced and/or real (repeatable; default both)")
      ->check(CLI::IsMember({"balanced", "real"}));
  bench_moe->add_option("--tokens", moe_bench.tokens, "tokens per call (default: BENCHMARKS.md's for the shape)");
  bench_moe->add_option("--reps", moe_bench.reps, "timed repetitions (median reported)");
  bench_moe->add_option("--warmup", moe_bench.warmup, "untimed repetitions first");
  bench_moe->add_option("--set", moe_bench.overrides, "override a config key of every shape: section.key=value");
  bench_moe->add_flag("--accumulate-grads", moe_bench.accumulate_grads,
                      "time a step's later micro-batches (expert weight gradients added to, not written)");
  bench_moe->add_option("--device", bench_device, "cuda (bf16), cpu (fp32) or auto")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));

  CLI::App* bench_train_cmd = bench->add_subcommand(
      "train",
      "full training steps on random tokens: tokens/s, model TFLOP/s per GPU, MFU, peak memory, and where a step's "
      "time goes (per-phase breakdown)");
  add_config(bench_train_cmd);
  TrainBenchOptions train_bench;
  std::string bench_train_device = "auto";
  bench_train_cmd->add_option("--steps", train_bench.steps, "timed steps (median reported)");
  bench_train_cmd->add_option("--warmup", train_bench.warmup, "untimed steps first");
  bench_train_cmd->add_option("--device", bench_train_device, "cuda (bf16), cpu (fp32) or auto")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  bool no_breakdown = false;
  bench_train_cmd->add_flag("--no-breakdown", no_breakdown,
                            "time the steps only (no phase scopes: CUDA events cost a few microseconds each)");

  CLI11_PARSE(app, argc, argv);

  // Under mpirun/srun every rank runs this; user errors are agreed on by all ranks (run_training
  // fails on every rank together), so each prints its line and finalizes MPI cleanly.
  std::unique_ptr<Communicator> bootstrap;  // MPI under mpirun, kept alive under an NCCL world
  std::unique_ptr<Communicator> world;
  int code = 0;
  try {
    if (*train) {
      Config cfg = load_config(config_spec, overrides);
      run.device = pick_device(device_name);
      world = make_world(run.device, cfg.parallel.timeout_s, bootstrap);
      if (run.run_dir.empty()) {
        if (run.resume) {
          run.run_dir = newest_run_dir();
        } else {
          // One timestamped name for every rank: rank 0's.
          int64_t name[8] = {};
          std::string mine = new_run_dir();
          std::memcpy(name, mine.data(), std::min(mine.size(), sizeof name - 1));
          if (world->size() > 1) world->broadcast(Tensor(name, DType::i64, {8}), 0);
          run.run_dir = reinterpret_cast<const char*>(name);
        }
      }
      if (run.run_dir.empty()) MF_FAIL("--resume: no run directory given and none found under runs/");
      if (run.stop_step < -1 || run.stop_step == 0) MF_FAIL("--steps ", run.stop_step, ": must be >= 1");
      run_training(cfg, run, *world);
    } else if (*bench_train_cmd) {
      const Config cfg = load_config(config_spec, overrides);
      train_bench.device = pick_device(bench_train_device);
      train_bench.breakdown = !no_breakdown;
      world = make_world(train_bench.device, cfg.parallel.timeout_s, bootstrap);
      const TrainBenchResult r = bench_train(cfg, *world, train_bench);
      if (world->rank() == 0)
        std::fputs(
            format_train_bench(
                cfg, r,
                cat("Training steps on ", train_bench.device == Device::cuda ? cuda_device_name() : "the CPU (fp32)",
                    ", random tokens, median of ", train_bench.steps, " after ", train_bench.warmup, " warm-up"))
                .c_str(),
            stdout);
    } else if (*bench_moe) {
      moe_bench.device = pick_device(bench_device);
      world = make_world(moe_bench.device, Config{}.parallel.timeout_s, bootstrap);
      if (world->size() > 1) moe_bench.ep = world.get();  // under mpirun / torchrun: EP over every rank
      const std::string where = moe_bench.device == Device::cuda ? cuda_device_name() : "CPU (fp32)";
      const std::vector<MoeBenchResult> r = bench_moe_layer(moe_bench);
      if (world->rank() == 0)
        std::fputs(
            format_moe_bench(r, cat("MoE layer forward+backward on ", where,
                                    world->size() > 1 ? cat(", EP = ", world->size(), " (rank 0's times)") : "",
                                    ", median of ", moe_bench.reps, " after ", moe_bench.warmup,
                                    moe_bench.accumulate_grads
                                        ? " warm-up; each repetition is a later micro-batch of a step (expert "
                                          "weight gradients added to in fp32)"
                                        : " warm-up; each repetition is a step's first micro-batch (expert weight "
                                          "gradients written in fp32, the router's accumulated)"))
                .c_str(),
            stdout);
    } else if (*info) {
      print_info(load_config(config_spec, overrides));
    } else if (*eval) {
      std::vector<int32_t> tokens;
      int64_t rows = 0, cols = 0;
      if (eval_tokens.ends_with(".npy")) {
        NpyTokens t = read_npy_tokens(eval_tokens);
        tokens = std::move(t.tokens);
        rows = t.rows;
        cols = t.cols;
      } else {
        if (eval_seq_len < 2) MF_FAIL("--seq-len ", eval_seq_len, ": a token file needs --seq-len >= 2");
        TokenDataset data = open_token_dataset(eval_tokens);
        cols = eval_seq_len;
        rows = data.num_tokens() / cols;
        tokens.resize(static_cast<size_t>(rows * cols));
        if (rows > 0) data.copy_tokens(0, rows * cols, tokens.data());
      }
      std::vector<float> logits;
      EvalResult r =
          evaluate_checkpoint(eval_ckpt, tokens, rows, cols, eval_tokens, eval_logits.empty() ? nullptr : &logits);
      if (!eval_logits.empty())
        write_npy_f32(eval_logits, logits, {rows, cols - 1, static_cast<int64_t>(logits.size()) / (rows * (cols - 1))});
      std::printf("{\"loss\": %.17g, \"tokens\": %lld, \"sequences\": %lld, \"step\": %lld}\n", r.loss,
                  static_cast<long long>(r.tokens), static_cast<long long>(r.sequences),
                  static_cast<long long>(r.step));
    } else if (*convert) {
      if (upcycle_dense) {
        const std::string ckpt = upcycle(convert_from, convert_to, overrides, granularity);
        std::printf(
            "upcycled %s into %s (continue with: moefold train --config %s/config.toml --run-dir %s --resume)\n",
            convert_from.c_str(), ckpt.c_str(), convert_to.c_str(), convert_to.c_str());
      } else if (!convert_from.empty()) {
        if (std::filesystem::exists(to_hf + "/model.safetensors"))
          MF_FAIL(to_hf, ": already holds a model.safetensors; choose another --to-hf");
        export_hf(convert_from, to_hf);
        std::printf("exported %s to %s\n", convert_from.c_str(), to_hf.c_str());
      } else {
        if (from_hf.empty()) MF_FAIL("convert: give --from-hf DIR --to RUN_DIR, or --from CKPT_DIR --to-hf DIR");
        if (std::filesystem::exists(convert_to + "/checkpoints"))
          MF_FAIL(convert_to, ": already holds checkpoints; choose another --to");
        const std::string ckpt = import_hf(from_hf, convert_to);
        std::printf(
            "imported %s into %s (continue with: moefold train --config %s/config.toml --run-dir %s --resume)\n",
            from_hf.c_str(), ckpt.c_str(), convert_to.c_str(), convert_to.c_str());
      }
    } else if (*show) {
      std::fputs(config_to_toml(load_config(config_spec, overrides)).c_str(), stdout);
    } else if (*prep) {
      PrepareStats s =
          prepare(inputs, output, format == "megatron" ? TokenFormat::megatron : TokenFormat::plain, prep_opts);
      std::printf("prepared %lld files, %lld bytes -> %lld tokens in %s", static_cast<long long>(s.files),
                  static_cast<long long>(s.bytes), static_cast<long long>(s.tokens), output.c_str());
      if (!prep_opts.tokenizer.empty())
        std::printf(" (tokenizer vocabulary: %lld ids, EOS %lld; model.vocab_size must be >= %lld)",
                    static_cast<long long>(s.vocab_size), static_cast<long long>(s.eos_id),
                    static_cast<long long>(s.vocab_size));
      std::printf("\n");
    }
  } catch (const std::exception& e) {
    if (world && world->size() > 1)
      std::fprintf(stderr, "moefold: error: rank %d: %s\n", world->rank(), e.what());
    else
      std::fprintf(stderr, "moefold: error: %s\n", e.what());
    code = 1;
  }
  world.reset();
  bootstrap.reset();
  mpi_finalize();
  return code;
}

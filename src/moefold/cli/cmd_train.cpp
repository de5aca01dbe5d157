// `moefold train`: a training run in a run directory (new, timestamped, or --resume of one), on
// one rank or on every rank of an mpirun / torchrun launch.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>

#include "moefold/cli/commands.h"
#include "moefold/core/error.h"
#include "moefold/train/run.h"

namespace moefold::cli {

namespace {

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

struct TrainArgs {
  ConfigOptions config;
  RunOptions run;
  std::string device = "auto";
};

void train(TrainArgs& a, World& w) {
  Config cfg = a.config.load();
  RunOptions& run = a.run;
  run.device = pick_device(a.device);
  Communicator& world = make_world(run.device, cfg.parallel.timeout_s, w);
  if (run.run_dir.empty()) {
    if (run.resume) {
      run.run_dir = newest_run_dir();
    } else {
      // One timestamped name for every rank: rank 0's.
      int64_t name[8] = {};
      std::string mine = new_run_dir();
      std::memcpy(name, mine.data(), std::min(mine.size(), sizeof name - 1));
      if (world.size() > 1) world.broadcast(Tensor(name, DType::i64, {8}), 0);
      run.run_dir = reinterpret_cast<const char*>(name);
    }
  }
  if (run.run_dir.empty()) MF_FAIL("--resume: no run directory given and none found under runs/");
  if (run.stop_step < -1 || run.stop_step == 0) MF_FAIL("--steps ", run.stop_step, ": must be >= 1");
  run_training(cfg, run, world);
}

}  // namespace

Command add_train(CLI::App& app) {
  auto a = std::make_shared<TrainArgs>();
  CLI::App* cmd = app.add_subcommand("train", "train a model");
  add_config_options(cmd, a->config);
  cmd->add_option("--steps", a->run.stop_step, "train until this step (default: train.steps)");
  cmd->add_option("--run-dir", a->run.run_dir, "run directory (default: runs/run-DATE-TIME)");
  cmd->add_flag("--resume", a->run.resume, "continue from the latest checkpoint in the run directory");
  cmd->add_flag("--quiet", a->run.quiet, "no progress output");
  cmd->add_option("--device", a->device,
                  "cuda: this process's GPU (LOCAL_RANK or the MPI local rank picks it) in bf16 mixed precision, "
                  "ranks joined by NCCL; cpu: fp32 on the CPU, ranks joined by MPI; auto (default): cuda when "
                  "a GPU is visible")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  return {cmd, [a](World& w) { train(*a, w); }};
}

}  // namespace moefold::cli

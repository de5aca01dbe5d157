// Shared by the parallel-layout tests (CPU ranks over MPI, GPUs over NCCL): a layout, the config
// that asks for it, a trainer built on it, and what the tests read back.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "moefold/train/trainer.h"
#include "recompute_check.h"
#include "testing.h"

namespace moefold::testing {

struct Layout {
  int64_t tp, cp, ep, etp;  // dp = world / (pp * tp * cp)
  int64_t pp = 1;
};

// "(tp, cp, dp, ep, etp) = (...) on N ranks" (or "GPUs"), "(pp, tp, ...)" with pipeline stages.
inline std::string layout_name(const Layout& l, int world, const char* unit = "ranks") {
  return cat(l.pp > 1 ? cat("(pp, tp, cp, dp, ep, etp) = (", l.pp, ", ") : std::string("(tp, cp, dp, ep, etp) = ("),
             l.tp, ", ", l.cp, ", ", world / (l.pp * l.tp * l.cp), ", ", l.ep, ", ", l.etp, ") on ", world, " ", unit);
}

inline Config with_layout(Config c, const Layout& l) {
  c.parallel.pp = l.pp;
  c.parallel.tp = l.tp;
  c.parallel.cp = l.cp;
  c.parallel.ep = l.ep;
  c.parallel.etp = l.etp;
  return c;
}

// A freshly initialised trainer on `world` laid out as cfg.parallel says.
struct LayoutRun {
  Mesh mesh;
  TokenDataset data;
  std::unique_ptr<Trainer> trainer;
  LayoutRun(const Config& cfg, Communicator& world, Device device = Device::cpu,
            std::optional<DType> compute = std::nullopt)
      : mesh(Mesh::build(world, cfg.resolve_layout(world.size()), cfg.moe.dispatcher == "hierarchical")),
        data(open_token_dataset(cfg.data.path)) {
    trainer = std::make_unique<Trainer>(cfg, data, mesh, device, compute);
    trainer->init_fresh();
  }
};

inline const Param& find_param(std::vector<Param>& params, const std::string& name) {
  for (const Param& p : params)
    if (p.name == name) return p;
  ADD_FAILURE() << "no parameter " << name;
  return params.front();
}

// One step's losses, gradient norm and expert loads against the one-rank run's (1e-5 relative).
inline void expect_step_matches(const StepMetrics& got, const StepMetrics& want) {
  EXPECT_NEAR(got.lm_loss, want.lm_loss, 1e-5 * want.lm_loss);
  EXPECT_NEAR(got.aux_loss, want.aux_loss, 1e-5 * want.aux_loss);
  EXPECT_NEAR(got.z_loss, want.z_loss, 1e-5 * want.z_loss);
  EXPECT_NEAR(got.mtp_loss, want.mtp_loss, 1e-5 * want.mtp_loss);
  EXPECT_NEAR(got.grad_norm, want.grad_norm, 1e-5 * want.grad_norm);
  EXPECT_EQ(got.expert_load_max, want.expert_load_max);
  EXPECT_EQ(got.expert_load_mean, want.expert_load_mean);
}

// recompute_check.h's variants (the combinations, 2 steps) on `world` laid out as cfg says.
inline void expect_layout_recompute_changes_nothing(const Config& cfg, Communicator& world) {
  std::vector<std::unique_ptr<LayoutRun>> runs;
  expect_recompute_changes_nothing(
      cfg,
      [&](const Config& c) {
        runs.push_back(std::make_unique<LayoutRun>(c, world));
        return std::move(runs.back()->trainer);
      },
      [&] {  // overlap_moe_a2a does not interleave virtual stages
        std::vector<RecomputeVariant> v = recompute_variants(false);
        if (cfg.parallel.vpp > 1) std::erase_if(v, [](const RecomputeVariant& x) { return x.overlap; });
        return v;
      }(),
      2);
}

// The "loss" of every line of a run directory's metrics.jsonl.
inline std::vector<double> metric_losses(const std::filesystem::path& run) {
  std::vector<double> out;
  std::ifstream f(run / "metrics.jsonl");
  std::string line;
  while (std::getline(f, line)) out.push_back(nlohmann::json::parse(line).at("loss").get<double>());
  return out;
}

// max |a_i - b[p.global_index(i)]| / max |b| over the local elements of `a` (p's value or grad
// shard), `b_full` the one-rank tensor: any sharding (EP rows, ETP columns) compares alike.
inline double rel_err(const Param& p, const Tensor& a, const Tensor& b_full) {
  const float* x = a.ptr<float>();
  const float* y = b_full.ptr<float>();
  double diff = 0;
  for (int64_t i = 0; i < a.numel(); ++i)
    diff = std::max(diff, std::abs(static_cast<double>(x[i]) - static_cast<double>(y[p.global_index(i)])));
  return diff / std::max(max_abs(b_full), 1e-30);
}

inline std::filesystem::path fresh_shared_dir(Communicator& world, const std::string& tag) {
  int64_t id = ::getpid();
  world.broadcast(Tensor(&id, DType::i64, {1}), 0);
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / cat("moefold_", tag, "_", id);
  if (world.rank() == 0) std::filesystem::remove_all(dir);
  world.barrier();
  return dir;
}

// The checkpoint tests' runs: 8 steps, a checkpoint at step 4, no evaluation.
inline Config resume_config(Config c) {
  c.train.steps = 8;
  c.train.checkpoint_interval = 4;
  c.train.eval_interval = 0;
  return c;
}

// Run directory `to` starting from run `from`'s step-4 checkpoint (rank 0 copies it).
inline void copy_step4(const std::filesystem::path& from, const std::filesystem::path& to) {
  namespace fs = std::filesystem;
  fs::create_directories(to / "checkpoints");
  fs::copy(from / "checkpoints" / "step_00000004", to / "checkpoints" / "step_00000004", fs::copy_options::recursive);
}

// Run `run` resumed at step 4 logged steps 5..8 with the uninterrupted run's losses `want`.
inline void expect_resumed_steps(const std::filesystem::path& run, const std::vector<double>& want) {
  const std::vector<double> got = metric_losses(run);  // nothing before the checkpoint
  ASSERT_EQ(got.size(), 4u);
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[4 + i], 1e-5 * want[4 + i]) << "step " << 5 + i;
}

}  // namespace moefold::testing

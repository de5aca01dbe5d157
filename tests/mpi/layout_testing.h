// Shared by the parallel-layout tests (CPU ranks over MPI, GPUs over NCCL): a layout, the config
// that asks for it, a trainer built on it, and what the tests read back.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "moefold/train/trainer.h"

namespace moefold::testing {

struct Layout {
  int64_t tp, cp, ep, etp;  // dp = world / (tp * cp)
};

// "(tp, cp, dp, ep, etp) = (...) on N ranks" (or "GPUs").
inline std::string layout_name(const Layout& l, int world, const char* unit = "ranks") {
  return cat("(tp, cp, dp, ep, etp) = (", l.tp, ", ", l.cp, ", ", world / (l.tp * l.cp), ", ", l.ep, ", ", l.etp,
             ") on ", world, " ", unit);
}

inline Config with_layout(Config c, const Layout& l) {
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
      : mesh(Mesh::build(world, cfg.resolve_layout(world.size()))), data(open_token_dataset(cfg.data.path)) {
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

// The "loss" of every line of a run directory's metrics.jsonl.
inline std::vector<double> metric_losses(const std::filesystem::path& run) {
  std::vector<double> out;
  std::ifstream f(run / "metrics.jsonl");
  std::string line;
  while (std::getline(f, line)) out.push_back(nlohmann::json::parse(line).at("loss").get<double>());
  return out;
}

}  // namespace moefold::testing

// `moefold train`: the run directory (config.toml, metrics.jsonl, checkpoints/), the default
// corpus, the progress bar, periodic evaluation and checkpoints, and --resume.
#pragma once

#include <cstdint>
#include <string>

#include "moefold/model/config.h"

namespace moefold {

struct RunOptions {
  std::string run_dir;     // where config.toml, metrics.jsonl and checkpoints/ go
  int64_t stop_step = -1;  // train until this step (-1: train.steps)
  bool resume = false;     // continue from the latest checkpoint in run_dir
  bool quiet = false;      // no progress output
};

// Runs training; returns the final step. Throws moefold::Error on bad input.
int64_t run_training(const Config& cfg, const RunOptions& opts);

}  // namespace moefold

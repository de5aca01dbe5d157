// `moefold train`: the run directory (config.toml, metrics.jsonl, checkpoints/), the default
// corpus, the progress bar, periodic evaluation and checkpoints, and --resume.
#pragma once

#include <cstdint>
#include <string>

#include "moefold/comm/communicator.h"
#include "moefold/data/token_dataset.h"
#include "moefold/model/config.h"

namespace moefold {

struct RunOptions {
  std::string run_dir;          // where config.toml, metrics.jsonl and checkpoints/ go
  int64_t stop_step = -1;       // train until this step (-1: train.steps)
  bool resume = false;          // continue from the latest checkpoint in run_dir
  bool quiet = false;           // no progress output
  Device device = Device::cpu;  // cuda: this process's GPU, bf16 mixed precision (world: NCCL)
};

// The dataset named by data.path, or the default corpus prepared once (by rank 0) into
// run_dir/default_corpus.tokens (collective: every rank opens it after rank 0 has written it).
TokenDataset open_run_data(const Config& cfg, const std::string& run_dir, bool quiet, Communicator& world);

// Runs training on the ranks of `world` (every rank calls it); returns the final step. Rank 0
// writes the metrics, config and progress. Throws moefold::Error on bad input, on every rank.
int64_t run_training(const Config& cfg, const RunOptions& opts, Communicator& world);

}  // namespace moefold

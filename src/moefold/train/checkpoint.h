// Checkpoints: DIR/step_NNNNNNNN/ holds model.safetensors (weights under Hugging Face names,
// fp32), optimizer.safetensors (AdamW moments), trainer.json (step, data position, seed,
// optimizer step, checksums of both tensor files) and config.toml. A checkpoint is written to
// a temporary directory and renamed into place, so a crash never leaves a partial one.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moefold/core/memory.h"
#include "moefold/train/optimizer.h"

namespace moefold {

struct TrainerState {
  int64_t step = 0;           // optimizer steps completed
  int64_t data_position = 0;  // training samples consumed
  uint64_t seed = 0;          // the run's seed (init and data order)
};

// Writes checkpoint `step` under `checkpoints_dir` (created if needed); returns its path.
std::string save_checkpoint(const std::string& checkpoints_dir, const std::vector<Param>& params, const AdamW& opt,
                            const TrainerState& state, const std::string& config_toml);

// The complete checkpoint with the highest step under `checkpoints_dir`; "" when none.
std::string latest_checkpoint(const std::string& checkpoints_dir);

// Loads weights (and optimizer state when `opt` is not null) from checkpoint directory `dir`
// into `params`; verifies checksums, names and shapes. Returns the trainer state.
TrainerState load_checkpoint(const std::string& dir, std::vector<Param>& params, AdamW* opt);

}  // namespace moefold

// Checkpoints: DIR/step_NNNNNNNN/ holds the weights under Hugging Face names in fp32 as one
// model.safetensors, or (expert or pipeline parallel) one shard per stage and EP rank,
// model-0000k-of-0000n.safetensors, with the Hugging Face index model.safetensors.index.json; the AdamW moments the
// same way (optimizer*.safetensors, tensors named "<weight>.exp_avg" / ".exp_avg_sq"); trainer.json (step, data
// position, seed, optimizer step, layout, checksums of every file) and config.toml. Tensors are stored whole per
// expert, so any layout loads any checkpoint. A checkpoint is written to a temporary directory and renamed into place:
// a crash never leaves a partial one.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moefold/core/memory.h"
#include "moefold/parallel/mesh.h"
#include "moefold/train/optimizer.h"

namespace moefold {

struct TrainerState {
  int64_t step = 0;           // optimizer steps completed
  int64_t data_position = 0;  // training samples consumed
  uint64_t seed = 0;          // the run's seed (init and data order)
};

// Writes checkpoint `step` under `checkpoints_dir` (created if needed); returns its path.
// Collective over mesh.world: every rank calls it; the first EDP replica of each EP rank writes
// its shard, each stage's first rank the stage's other parameters (one file per pipeline stage and
// EP rank), rank 0 the index. A failure on any rank fails every rank.
std::string save_checkpoint(const std::string& checkpoints_dir, const std::vector<Param>& params, const AdamW& opt,
                            const TrainerState& state, const std::string& config_toml, const Mesh& mesh);

// The complete checkpoint with the highest step under `checkpoints_dir`; "" when none.
std::string latest_checkpoint(const std::string& checkpoints_dir);

// Loads this rank's weights (and optimizer state when `opt` is not null) from checkpoint
// directory `dir` into `params`, whatever layout wrote it; verifies checksums, names and
// shapes. Returns the trainer state. Pipeline parallelism: `stages` (Mesh::pp) sums the stages'
// tensor counts for the check that the checkpoint holds the whole model (collective over it).
TrainerState load_checkpoint(const std::string& dir, std::vector<Param>& params, AdamW* opt,
                             Communicator* stages = nullptr);

}  // namespace moefold

// Checkpoints: DIR/step_NNNNNNNN/ holds the weights under Hugging Face names in fp32 as one
// model.safetensors, or (expert or pipeline parallel) one shard per stage and EP rank,
// model-0000k-of-0000n.safetensors, with the Hugging Face index model.safetensors.index.json; the AdamW moments the
// same way (optimizer*.safetensors, tensors named "<weight>.exp_avg" / ".exp_avg_sq"); trainer.json (step, data
// position, seed, optimizer step, layout, checksums of every file) and config.toml. Tensors are stored whole per
// expert, so any layout loads any checkpoint. A checkpoint is written to a temporary directory and renamed into place:
// a crash never leaves a partial one (CheckpointWriter, below).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moefold/core/memory.h"
#include "moefold/model/config.h"
#include "moefold/parallel/mesh.h"
#include "moefold/train/optimizer.h"

namespace moefold {

struct TrainerState {
  int64_t step = 0;           // optimizer steps completed
  int64_t data_position = 0;  // training samples consumed
  uint64_t seed = 0;          // the run's seed (init and data order)
};

struct SnapshotPool;  // checkpoint.cpp

struct CheckpointOptions {
  bool async = false;           // train.async_checkpoint: written by a background thread
  int64_t keep = 0;             // train.keep_checkpoints: complete checkpoints kept (0: all)
  Device device = Device::cpu;  // the run's: cuda takes the asynchronous copies in pinned memory
};

// Writes the checkpoints of one run, one save at a time. A save goes: the state is copied out
// (collective: slices gathered; async: into pinned host memory the writer keeps for the next
// save) -> each writing rank writes and fsyncs its files in DIR/.tmp-step_N/ (async: in a
// background thread while training goes on) -> once every rank's files are written (agreed),
// rank 0 writes the indexes, config.toml and trainer.json (last: it marks the checkpoint
// complete), fsyncs them and the directory, renames it to DIR/step_N, fsyncs DIR, and only then
// removes checkpoints past `keep` (oldest first). A crash at any instant leaves every complete
// checkpoint intact; a failed write (a full disk) throws Error on every rank, naming the file,
// after the temporary directory is removed. Every call is collective over mesh.world.
class CheckpointWriter {
 public:
  CheckpointWriter(std::string checkpoints_dir, const Mesh& mesh, CheckpointOptions opts = {});
  // Joins a background write; a save not finished stays a temporary directory, never a checkpoint.
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Saves checkpoint state.step (a save still in flight is finished first); returns its directory.
  // Sync: complete on return. Async: the state is copied on return (params and opt may change);
  // finish() completes it. REQUIRES: opt's state exposed (AdamW::gather_state).
  std::string save(const std::vector<Param>& params, const AdamW& opt, const TrainerState& state,
                   const std::string& config_toml);
  // Completes the save in flight once every rank has written its files; `wait`: waits for them.
  // Returns the step made durable, or -1 (none in flight, or still writing).
  int64_t finish(bool wait);
  bool in_flight() const { return pending_ != nullptr; }
  // Seconds from the start of the last completed save to its completion.
  double last_save_s() const { return last_save_s_; }

 private:
  struct Pending;
  void finalize(const Pending& p, const std::vector<int64_t>& sums_by_rank);  // rank 0

  std::string dir_;
  const Mesh& mesh_;
  CheckpointOptions opts_;
  std::unique_ptr<SnapshotPool> pool_;  // async: the snapshot's host memory, reused
  std::unique_ptr<Pending> pending_;
  double last_save_s_ = 0;
};

// Bytes one checkpoint of cfg's model takes on disk: every parameter's f32 weight and both AdamW
// moments (model_size's counts, multi-token prediction included) plus a bound on the files'
// headers, indexes, trainer.json and config.toml. `moefold plan` prints it; a run warns at start
// when its directory has less free; CheckpointWriter::save refuses before the first byte.
int64_t checkpoint_bytes(const Config& cfg);
// "165.3 kB", "68.6 GB": sizes in the messages about them.
std::string format_bytes(double bytes);

// Writes checkpoint `state.step` under `checkpoints_dir` synchronously (a CheckpointWriter with
// the default options); returns its path.
std::string save_checkpoint(const std::string& checkpoints_dir, const std::vector<Param>& params, const AdamW& opt,
                            const TrainerState& state, const std::string& config_toml, const Mesh& mesh);

// What interrupted saves left in `checkpoints_dir`: temporary and half-removed directories are
// deleted; a checkpoint moved aside to be replaced by a save of the same step is moved back when
// the replacement never arrived. One rank calls it, before latest_checkpoint, with no save running.
void tidy_checkpoints(const std::string& checkpoints_dir);

// The complete checkpoint with the highest step under `checkpoints_dir`; "" when none.
std::string latest_checkpoint(const std::string& checkpoints_dir);

// Checks that `dir` is a complete checkpoint: trainer.json valid and every file it names present
// with its checksum. Throws Error naming the file.
void verify_checkpoint(const std::string& dir);

// Loads this rank's weights (and optimizer state when `opt` is not null) from checkpoint
// directory `dir` into `params`, whatever layout wrote it; verifies checksums, names and
// shapes. Returns the trainer state. Pipeline parallelism: `stages` (Mesh::pp) sums the stages'
// tensor counts for the check that the checkpoint holds the whole model (collective over it).
TrainerState load_checkpoint(const std::string& dir, std::vector<Param>& params, AdamW* opt,
                             Communicator* stages = nullptr);

}  // namespace moefold

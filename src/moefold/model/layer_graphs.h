// train.cuda_graphs = "layers": each decoder layer's forward and backward replayed as CUDA graphs
// (core/cuda_graph.h); "step": each whole micro-batch (micro_batch()). A key (layer, forward or
// backward, and for backward whether it writes or adds to the gradients of the parameters its
// backward writes, and its loss scale) runs eagerly the first time it is seen (the ops size their
// scratch, libraries build their plans), is captured and launched the second time, and replayed
// from then on. A replayed backward marks its parameters written (Memory::mark_grads_written);
// after a replayed forward `after_replay` runs (the host state a forward leaves beside the
// device's: the router's losses to be read again). A failed capture turns every graph off with its
// reason (fallback()); the work then runs eagerly, with the gradients' write marks put back. While
// the profiler records, everything runs eagerly.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "moefold/core/cuda_graph.h"
#include "moefold/core/memory.h"

namespace moefold {

class LayerGraphs {
 public:
  void set_enabled(bool on) { enabled_ = on; }
  bool enabled() const { return enabled_ && fallback_.empty(); }
  // Why graphs stopped (empty: they did not).
  const std::string& fallback() const { return fallback_; }
  // Drops every graph (the buffers they address may move: a new binding).
  void clear();
  int64_t replays() const { return replays_; }

  void forward(const ExecContext& ctx, Memory& mem, int64_t layer, WorkRef work, WorkRef after_replay);
  void backward(const ExecContext& ctx, Memory& mem, int64_t layer, double loss_scale, WorkRef work);
  // train.cuda_graphs = "step": a whole micro-batch (the model's forward and backward and what the
  // trainer queues between them) as one graph; the first in a gradient generation writes the
  // gradients, the others add to them (two graphs). after_replay as for forward. The layers' own
  // graphs must be off (no capture inside a capture).
  void micro_batch(const ExecContext& ctx, Memory& mem, WorkRef work, WorkRef after_replay);

 private:
  struct Entry {
    int seen = 0;  // eager runs before the capture
    CudaGraph graph;
    std::vector<Memory::GradWrite> writes;  // the parameters its backward writes or adds to
  };
  // (layer, backward, writes the gradients, loss scale); layer kMicroBatch: a whole micro-batch
  static constexpr int64_t kMicroBatch = -1;
  using Key = std::tuple<int64_t, bool, bool, double>;
  void run(const ExecContext& ctx, Memory& mem, const Key& key, WorkRef work, const WorkRef* after_replay);
  bool first_in_generation(const Memory& mem, int64_t layer);

  bool enabled_ = false;
  std::string fallback_;
  std::map<Key, Entry> entries_;
  std::map<int64_t, int64_t> backward_generation_;  // layer -> the gradient generation its backward last ran in
  int64_t replays_ = 0;
};

}  // namespace moefold

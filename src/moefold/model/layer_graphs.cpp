// LayerGraphs (layer_graphs.h): eager, then captured, then replayed, per key.
#include "moefold/model/layer_graphs.h"

#include "moefold/core/profile.h"

namespace moefold {

void LayerGraphs::clear() {
  entries_.clear();
  backward_generation_.clear();
}

void LayerGraphs::forward(const ExecContext& ctx, Memory& mem, int64_t layer, WorkRef work, WorkRef after_replay) {
  run(ctx, mem, Key{layer, false, false, 0.0}, work, &after_replay);
}

void LayerGraphs::backward(const ExecContext& ctx, Memory& mem, int64_t layer, double loss_scale, WorkRef work) {
  run(ctx, mem, Key{layer, true, first_in_generation(mem, layer), loss_scale}, work, nullptr);
}

void LayerGraphs::micro_batch(const ExecContext& ctx, Memory& mem, WorkRef work, WorkRef after_replay) {
  run(ctx, mem, Key{kMicroBatch, true, first_in_generation(mem, kMicroBatch), 0.0}, work, &after_replay);
}

bool LayerGraphs::first_in_generation(const Memory& mem, int64_t layer) {
  // The first backward of the layer in a gradient generation writes its written-by-backward
  // gradients, the others add to them: two graphs.
  const auto it = backward_generation_.try_emplace(layer, -1).first;
  const bool first = it->second != mem.grad_generation();
  it->second = mem.grad_generation();
  return first;
}

void LayerGraphs::run(const ExecContext& ctx, Memory& mem, const Key& key, WorkRef work, const WorkRef* after_replay) {
  if (!enabled() || profile_enabled()) {  // the profiler's events would be recorded into the graph
    work();
    return;
  }
  Entry& e = entries_[key];
  if (e.graph.captured()) {
    e.graph.launch(ctx);
    ++replays_;
    mem.mark_grads_written(e.writes);
    if (after_replay != nullptr) (*after_replay)();
    return;
  }
  if (e.seen++ == 0) {
    work();
    return;
  }
  e.writes.clear();
  mem.record_grad_writes(&e.writes);
  std::string why;
  const bool ok = e.graph.capture(ctx, work, &why);
  mem.record_grad_writes(nullptr);
  if (!ok) {  // nothing ran: put the write marks back and run it eagerly, graphs off from now on
    mem.restore_grad_writes(e.writes);
    const int64_t layer = std::get<0>(key);
    fallback_ = (layer == kMicroBatch
                     ? std::string("the micro-batch")
                     : "decoder layer " + std::to_string(layer) + (std::get<1>(key) ? " backward" : " forward")) +
                ": " + why;
    entries_.clear();
    work();
    return;
  }
  e.graph.launch(ctx);
}

}  // namespace moefold

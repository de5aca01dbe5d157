// A CUDA graph captured from one stream and replayed on it (train.cuda_graphs): the work a piece
// of code queues on its execution context's stream, recorded once and launched again as one
// operation, so the host issues one launch instead of hundreds. Capture is thread-local: a call
// that cannot be captured (a wait for the device, an allocation) fails the capture, which then
// reports why instead of recording anything. Only in effect in a CUDA build (elsewhere capture
// fails with "built without CUDA"). WorkRef: the work handed to it, borrowed without allocating.
#pragma once

#include <string>
#include <type_traits>

#include "moefold/core/exec.h"

namespace moefold {

// A callable borrowed for the length of one call: no allocation (a std::function holding a lambda
// of more than two captures allocates, and the step loop allocates nothing).
class WorkRef {
 public:
  template <class F>
  requires(!std::is_same_v<std::decay_t<F>, WorkRef>)
      WorkRef(F&& f)  // NOLINT(google-explicit-constructor): passed as a lambda
      : obj_(const_cast<void*>(static_cast<const void*>(&f))),
        call_([](void* o) { (*static_cast<std::remove_reference_t<F>*>(o))(); }) {}
  void operator()() const { call_(obj_); }

 private:
  void* obj_;
  void (*call_)(void*);
};

class CudaGraph {
 public:
  CudaGraph() = default;
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;
  CudaGraph(CudaGraph&& o) noexcept;
  CudaGraph& operator=(CudaGraph&& o) noexcept;
  ~CudaGraph();

  // Runs `work` with ctx's stream capturing (nothing runs on the device) and instantiates what it
  // queued. False, with the reason in *why and nothing kept, when the capture or `work` failed
  // (`work`'s host side effects stay: run it again uncaptured). REQUIRES: ctx on a GPU stream.
  bool capture(const ExecContext& ctx, WorkRef work, std::string* why);
  // Queues the recorded work on ctx's stream. REQUIRES: captured.
  void launch(const ExecContext& ctx) const;
  bool captured() const { return exec_ != nullptr; }

 private:
  void* exec_ = nullptr;  // cudaGraphExec_t
};

}  // namespace moefold

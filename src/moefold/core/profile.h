// Phase timing of the step loop (`moefold bench train`'s breakdown): named scopes whose elapsed
// times, while profiling is on, add up per name. On the GPU a scope is two CUDA events on
// primary_stream(), so it measures the stream's time between them, idle gaps included (a host
// that waits or launches too slowly shows up in the scope it happens in); on the CPU, the host
// clock. Events come from a pool that only grows; the host never waits while scopes record,
// only profile_collect does. One thread records: the one running the step.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "moefold/core/tensor.h"

namespace moefold {

// One name's totals since the last collect.
struct PhaseTime {
  std::string name;
  int depth = 0;            // scopes open around its first call (0: top level)
  int64_t calls = 0;        // scopes closed under this name
  double ms = 0;            // inclusive: the time of scopes nested inside its calls counted too
  double self_ms = 0;       // ms minus the time of the scopes nested directly inside its calls
  double top_level_ms = 0;  // the part of ms from calls made with no other scope open
};

// Starts recording on `device` (cuda: events on primary_stream(); cpu: the host clock) and drops
// anything recorded but not collected. REQUIRES: no scope open; cuda only in a CUDA build.
void profile_enable(Device device);
// Stops recording; scopes already open still close, and what was recorded waits for collect.
void profile_disable();
bool profile_enabled();
// Makes room for `scopes` more scope calls before the next collect (CUDA events and records), so
// that recording them creates and allocates nothing: call it before a timed region.
void profile_reserve(int64_t scopes);
// CUDA events held by the pool (created on first need, reused after every collect).
int64_t profile_pool_events();
// Waits for the device; returns every name's totals since the last collect (or enable) in the
// order first seen, and starts afresh. Empty when nothing was recorded. REQUIRES: no scope open.
std::vector<PhaseTime> profile_collect();

namespace profile_detail {
extern bool g_enabled;
extern const bool g_trace;
int64_t begin(std::string_view name);
void end(int64_t mark);
void trace_begin(std::string_view name);
void trace_end(std::string_view name);
}  // namespace profile_detail

// Times the enclosing block under `name` while profiling is on; off, it costs one branch. Names
// aggregate over calls: one name for the same work in every layer ("moe experts forward").
// Scopes nest; each name accumulates its own inclusive time.
// Debugging: with MOEFOLD_TRACE=1 in the environment every scope prints a line to stderr when it
// opens, and when it closes after waiting for the device (with the host time in between), so the
// last line a hung or failing step printed names the phase it is stuck in.
class ProfileScope {
 public:
  explicit ProfileScope(std::string_view name)
      : name_(name), mark_(profile_detail::g_enabled ? profile_detail::begin(name) : -1) {
    if (profile_detail::g_trace) profile_detail::trace_begin(name);
  }
  ~ProfileScope() {
    if (profile_detail::g_trace) profile_detail::trace_end(name_);
    if (mark_ >= 0) profile_detail::end(mark_);
  }
  ProfileScope(const ProfileScope&) = delete;
  ProfileScope& operator=(const ProfileScope&) = delete;

 private:
  std::string_view name_;
  int64_t mark_;  // -1: profiling was off when the scope opened
};

}  // namespace moefold

// Where a GPU step's time goes between the host and the GPU (`moefold bench train`'s host time and
// GPU idle time): CUPTI's activity records of the GPU's work (kernels, copies, memsets) and of the
// host's CUDA calls (runtime and driver API), read from libcupti loaded at run time (dlopen: no link
// dependency, and a machine without it only loses this report). For each window of the host clock
// CUPTI timestamps: how long the GPU was busy (the union of its work) and idle, how long the host
// sat in calls that wait for the GPU (stream, event, context synchronisation, blocking copies) and
// in kernel launches. Recording slows every CUDA call a little: measure in steps of their own, not
// in the timed ones. One recording at a time, from one thread.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace moefold {

struct GpuActivityWindow {
  double wall_ms = 0;         // the window's length
  double gpu_busy_ms = 0;     // the union of the GPU's kernels, copies and memsets in it
  double gpu_idle_ms = 0;     // wall - busy: no work of this process on the GPU
  double largest_gap_ms = 0;  // the longest stretch of it without GPU work
  double host_wait_ms = 0;    // the host inside calls that wait for the GPU
  double host_ms = 0;         // wall - host_wait: the host planning and issuing work
  double launch_ms = 0;       // the host inside kernel launches (part of host_ms)
  int64_t gpu_ops = 0;        // kernels, copies and memsets that started in the window
};

// One kind of GPU operation (a kernel by its demangled name without the parameter list, or
// "memcpy HtoD" / "memset" ...) over every window of a recording: how often it started in them and
// its summed duration.
struct GpuOpTotal {
  std::string name;
  int64_t count = 0;
  double ms = 0;
};

// One GPU operation that started in a window (gpu_activity_stop's in_order), on CUPTI's clock (ns).
struct GpuOpSpan {
  std::string name;  // as GpuOpTotal's
  uint64_t begin = 0, end = 0;
  uint64_t issued = 0;  // when the host's call that issued it started (0: not recorded)
};

// Starts recording (enables CUPTI's activity kinds). False when it cannot be had (no CUDA build,
// no libcupti, CUPTI refuses), with the reason in *why.
bool gpu_activity_start(std::string* why);
// Now on CUPTI's clock (ns), the clock the windows are given in. REQUIRES: recording.
uint64_t gpu_activity_now();
// Stops recording and reads every record; each window [begin, end) in ns of gpu_activity_now().
// REQUIRES: recording, and the device's work in the windows finished (synchronised).
// With `by_op`, also the operations that started in any window, longest summed duration first;
// with `in_order`, each window's operations by start time (one vector a window).
std::vector<GpuActivityWindow> gpu_activity_stop(const std::vector<std::pair<uint64_t, uint64_t>>& windows,
                                                 std::vector<GpuOpTotal>* by_op = nullptr,
                                                 std::vector<std::vector<GpuOpSpan>>* in_order = nullptr);

// The length of the union of [begin, end) intervals clipped to [lo, hi), and the longest gap of
// [lo, hi) that none of them covers (the arithmetic of the windows, testable without a GPU).
struct IntervalCover {
  uint64_t covered = 0, largest_gap = 0;
};
IntervalCover interval_cover(std::vector<std::pair<uint64_t, uint64_t>> intervals, uint64_t lo, uint64_t hi);

// For operations in start order: how long the GPU had nothing of them to run just before each
// one started (0 for the first, and where an earlier one, on any stream, was still running).
// Their sum is the idle time between the first start and the last end.
std::vector<uint64_t> gaps_before(const std::vector<GpuOpSpan>& in_order);

// A kernel's readable name shortened for a table: every "(anonymous namespace)::" and
// "moefold::" dropped, and a name still longer than `max_chars` cut at its template arguments
// ("<...>") or, where that is not short enough, at max_chars.
std::string short_op_name(const std::string& name, size_t max_chars = 80);

}  // namespace moefold

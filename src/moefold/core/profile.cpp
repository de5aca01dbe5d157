// core/profile.h: scopes become marks (a phase, its depth, its parent); on the CPU a mark's time
// is read when it closes, on the GPU from its two pooled events at collect.
#include "moefold/core/profile.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "moefold/core/device.h"
#include "moefold/core/error.h"

#ifdef MOEFOLD_WITH_CUDA
#include "moefold/core/cuda_check.h"
#endif

namespace moefold {

namespace profile_detail {
bool g_enabled = false;
const bool g_trace = [] {
  const char* v = std::getenv("MOEFOLD_TRACE");
  return v != nullptr && v[0] != '\0' && std::string_view(v) != "0";
}();

namespace {
thread_local int trace_depth = 0;
thread_local std::vector<std::chrono::steady_clock::time_point> trace_starts;
}  // namespace

void trace_begin(std::string_view name) {
  std::fprintf(stderr, "trace: %*s> %.*s\n", 2 * trace_depth, "", static_cast<int>(name.size()), name.data());
  ++trace_depth;
  trace_starts.push_back(std::chrono::steady_clock::now());
}

void trace_end(std::string_view name) {
  if (cuda_device_count() > 0) device_synchronize();  // errors of the scope's kernels surface here
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - trace_starts.back()).count();
  trace_starts.pop_back();
  --trace_depth;
  std::fprintf(stderr, "trace: %*s< %.*s %.3f ms\n", 2 * trace_depth, "", static_cast<int>(name.size()), name.data(),
               ms);
}
}  // namespace profile_detail

namespace {

double host_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Mark {
  int phase = 0;
  int depth = 0;
  int64_t parent = -1;             // the mark open around it (-1: none)
  int64_t event0 = 0, event1 = 0;  // GPU: indices into the event pool
  double start = 0;                // CPU: host clock at open
  double ms = 0, child_ms = 0;     // its time, and that of the marks directly inside it
};

struct Profiler {
  Device device = Device::cpu;
  std::vector<PhaseTime> phases;  // first-seen order
  std::vector<Mark> marks;        // GPU: every mark since the last collect; CPU: the open ones' stack
  int64_t open = -1;              // innermost open mark
  int depth = 0;
  // cudaEvent_t's, as void* (no CUDA headers in the CPU build): created once, never destroyed
  // (they live as long as the process, like cuBLAS's handles); next_event is the first free one.
  std::vector<void*> events;
  size_t next_event = 0;

  int phase_of(std::string_view name) {
    for (size_t i = 0; i < phases.size(); ++i)
      if (phases[i].name == name) return static_cast<int>(i);
    phases.push_back(PhaseTime{std::string(name), depth});
    return static_cast<int>(phases.size()) - 1;
  }

  // Adds a closed mark whose nested marks were all added before it.
  void add(const Mark& m) {
    PhaseTime& p = phases[static_cast<size_t>(m.phase)];
    ++p.calls;
    p.ms += m.ms;
    p.self_ms += m.ms - m.child_ms;
    if (m.depth == 0) p.top_level_ms += m.ms;
  }

  void reset() {
    phases.clear();
    marks.clear();
    next_event = 0;
  }
};

Profiler& profiler() {
  static Profiler p;
  return p;
}

#ifdef MOEFOLD_WITH_CUDA
void grow_pool(Profiler& p, size_t n) {
  while (p.events.size() < n) {
    cudaEvent_t e = nullptr;
    MF_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDefault));
    p.events.push_back(e);
  }
}

int64_t record_event(Profiler& p) {
  grow_pool(p, p.next_event + 1);  // a no-op once profile_reserve or an earlier collect sized the pool
  const size_t i = p.next_event++;
  MF_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(p.events[i]), static_cast<cudaStream_t>(primary_stream())));
  return static_cast<int64_t>(i);
}

double elapsed_ms(const Profiler& p, const Mark& m) {
  float ms = 0;
  MF_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(p.events[static_cast<size_t>(m.event0)]),
                                     static_cast<cudaEvent_t>(p.events[static_cast<size_t>(m.event1)])));
  return ms;
}
#else
void grow_pool(Profiler&, size_t) {}
int64_t record_event(Profiler&) { return 0; }  // unreachable: profile_enable refuses cuda here
double elapsed_ms(const Profiler&, const Mark&) { return 0; }
#endif

}  // namespace

void profile_enable(Device device) {
  Profiler& p = profiler();
  MF_CHECK(p.open < 0, "profile_enable inside an open scope");
  MF_CHECK(device == Device::cpu || cuda_built(), "profile_enable(cuda) in a build without CUDA");
  p.reset();
  p.device = device;
  profile_detail::g_enabled = true;
}

void profile_disable() { profile_detail::g_enabled = false; }

bool profile_enabled() { return profile_detail::g_enabled; }

void profile_reserve(int64_t scopes) {
  Profiler& p = profiler();
  MF_CHECK(scopes >= 0, "profile_reserve(", scopes, ")");
  p.marks.reserve(p.marks.size() + static_cast<size_t>(scopes));
  if (p.device == Device::cuda) grow_pool(p, p.next_event + 2 * static_cast<size_t>(scopes));
}

int64_t profile_pool_events() { return static_cast<int64_t>(profiler().events.size()); }

std::vector<PhaseTime> profile_collect() {
  Profiler& p = profiler();
  MF_CHECK(p.open < 0, "profile_collect inside an open scope");
  if (p.device == Device::cuda && !p.marks.empty()) {
    device_synchronize();
    for (Mark& m : p.marks) m.ms = elapsed_ms(p, m);
    for (const Mark& m : p.marks)
      if (m.parent >= 0) p.marks[static_cast<size_t>(m.parent)].child_ms += m.ms;
    for (const Mark& m : p.marks) p.add(m);
  }
  std::vector<PhaseTime> out = std::move(p.phases);
  p.reset();
  return out;
}

namespace profile_detail {

int64_t begin(std::string_view name) {
  Profiler& p = profiler();
  Mark m;
  m.phase = p.phase_of(name);
  m.depth = p.depth;
  m.parent = p.open;
  if (p.device == Device::cuda)
    m.event0 = record_event(p);
  else
    m.start = host_ms();
  p.marks.push_back(m);
  p.open = static_cast<int64_t>(p.marks.size()) - 1;
  ++p.depth;
  return p.open;
}

void end(int64_t mark) {
  Profiler& p = profiler();
  MF_CHECK(mark == p.open, "profile scopes closed out of order: ", mark, " while ", p.open, " is innermost");
  Mark& m = p.marks[static_cast<size_t>(mark)];
  p.open = m.parent;
  --p.depth;
  if (p.device == Device::cuda) {  // read at collect: reading now would wait for the stream
    m.event1 = record_event(p);
    return;
  }
  m.ms = host_ms() - m.start;
  if (m.parent >= 0) p.marks[static_cast<size_t>(m.parent)].child_ms += m.ms;
  p.add(m);
  p.marks.pop_back();  // the innermost: the stack of open marks stays short
}

}  // namespace profile_detail

}  // namespace moefold

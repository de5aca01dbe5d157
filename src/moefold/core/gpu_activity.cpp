// GPU activity windows (gpu_activity.h): CUPTI through dlopen, and the interval arithmetic.
#include "moefold/core/gpu_activity.h"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "moefold/core/error.h"
#include "moefold/core/run_time_library.h"

#ifdef MOEFOLD_WITH_CUDA
#include <cupti.h>
#include <cxxabi.h>
#endif

namespace moefold {

IntervalCover interval_cover(std::vector<std::pair<uint64_t, uint64_t>> intervals, uint64_t lo, uint64_t hi) {
  IntervalCover c;
  if (hi <= lo) return c;
  std::sort(intervals.begin(), intervals.end());
  uint64_t at = lo;  // everything before `at` is accounted for
  for (auto [b, e] : intervals) {
    b = std::max(b, lo);
    e = std::min(e, hi);
    if (e <= b || e <= at) continue;
    if (b > at) c.largest_gap = std::max(c.largest_gap, b - at);
    c.covered += e - std::max(b, at);
    at = e;
  }
  c.largest_gap = std::max(c.largest_gap, hi - at);
  return c;
}

std::vector<uint64_t> gaps_before(const std::vector<GpuOpSpan>& in_order) {
  std::vector<uint64_t> gaps;
  gaps.reserve(in_order.size());
  uint64_t busy_until = in_order.empty() ? 0 : in_order.front().begin;
  for (const GpuOpSpan& op : in_order) {
    gaps.push_back(op.begin > busy_until ? op.begin - busy_until : 0);
    busy_until = std::max(busy_until, op.end);
  }
  return gaps;
}

std::string short_op_name(const std::string& name, size_t max_chars) {
  std::string s = name;
  for (const std::string_view drop : {std::string_view("(anonymous namespace)::"), std::string_view("moefold::")})
    for (size_t at = s.find(drop); at != std::string::npos; at = s.find(drop, at)) s.erase(at, drop.size());
  if (s.size() <= max_chars) return s;
  const size_t open = s.find('<');
  if (open != std::string::npos && open + 5 <= max_chars) return s.substr(0, open) + "<...>";
  return s.substr(0, max_chars - 3) + "...";
}

#ifdef MOEFOLD_WITH_CUDA

namespace {

// The CUPTI entry points this uses, from libcupti (the toolkit's, found by the loader's path).
struct Cupti {
  RunTimeLibrary lib{{"libcupti.so", "libcupti.so.13"}, "libcupti"};
  CUptiResult (*enable)(CUpti_ActivityKind) = nullptr;
  CUptiResult (*disable)(CUpti_ActivityKind) = nullptr;
  CUptiResult (*register_callbacks)(CUpti_BuffersCallbackRequestFunc, CUpti_BuffersCallbackCompleteFunc) = nullptr;
  CUptiResult (*flush_all)(uint32_t) = nullptr;
  CUptiResult (*next_record)(uint8_t*, size_t, CUpti_Activity**) = nullptr;
  CUptiResult (*timestamp)(uint64_t*) = nullptr;
};

Cupti& cupti() {
  static Cupti c = [] {
    Cupti x;
    x.lib.get(x.enable, "cuptiActivityEnable");
    x.lib.get(x.disable, "cuptiActivityDisable");
    x.lib.get(x.register_callbacks, "cuptiActivityRegisterCallbacks");
    x.lib.get(x.flush_all, "cuptiActivityFlushAll");
    x.lib.get(x.next_record, "cuptiActivityGetNextRecord");
    x.lib.get(x.timestamp, "cuptiGetTimestamp");
    return x;
  }();
  return c;
}

// call: any runtime or driver call (its correlation id ties it to the GPU work it issued).
enum class Kind : uint8_t { gpu, wait, launch, call };
struct Span {
  Kind kind;
  uint64_t begin, end;
  const char* name;  // GPU work: the kernel's mangled name (CUPTI's, shared by its records) or a label
  uint32_t correlation = 0;
};

const char* memcpy_label(uint8_t kind) {
  switch (kind) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD:
      return "memcpy HtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH:
      return "memcpy DtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD:
      return "memcpy DtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOH:
      return "memcpy HtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_PTOP:
      return "memcpy PtoP";
    default:
      return "memcpy";
  }
}

// A kernel's demangled name without its parameter list (the mangled one where that fails).
std::string readable(const char* mangled) {
  int status = 0;
  char* d = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  if (status != 0 || d == nullptr) return mangled;
  std::string s(d);
  std::free(d);
  // Cut at the '(' of the outermost parameter list: the first '(' outside template brackets.
  static constexpr std::string_view kAnonymous = "(anonymous namespace)";
  int depth = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s.compare(i, kAnonymous.size(), kAnonymous) == 0) {
      i += kAnonymous.size() - 1;
      continue;
    }
    if (s[i] == '<') ++depth;
    if (s[i] == '>') --depth;
    if (s[i] == '(' && depth == 0) return s.substr(0, i);
  }
  return s;
}

// Filled by CUPTI's buffer callback (its own thread) and read after the flush.
std::mutex g_mutex;
std::vector<Span> g_spans;
bool g_recording = false;

constexpr size_t kBufferBytes = 8 << 20;
constexpr CUpti_ActivityKind kKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                                         CUPTI_ACTIVITY_KIND_MEMSET, CUPTI_ACTIVITY_KIND_RUNTIME,
                                         CUPTI_ACTIVITY_KIND_DRIVER};

bool runtime_waits(uint32_t cbid) {
  return cbid == CUPTI_RUNTIME_TRACE_CBID_cudaStreamSynchronize_v3020 ||
         cbid == CUPTI_RUNTIME_TRACE_CBID_cudaEventSynchronize_v3020 ||
         cbid == CUPTI_RUNTIME_TRACE_CBID_cudaDeviceSynchronize_v3020 ||
         cbid == CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy_v3020;
}
bool runtime_launches(uint32_t cbid) {
  return cbid == CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000 ||
         cbid == CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernelExC_v11060 ||
         cbid == CUPTI_RUNTIME_TRACE_CBID_cudaLaunchCooperativeKernel_v9000 ||
         cbid == CUPTI_RUNTIME_TRACE_CBID_cudaGraphLaunch_v10000;
}
bool driver_waits(uint32_t cbid) {
  return cbid == CUPTI_DRIVER_TRACE_CBID_cuStreamSynchronize || cbid == CUPTI_DRIVER_TRACE_CBID_cuEventSynchronize ||
         cbid == CUPTI_DRIVER_TRACE_CBID_cuCtxSynchronize || cbid == CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoH_v2 ||
         cbid == CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoD_v2;
}
bool driver_launches(uint32_t cbid) {
  return cbid == CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel || cbid == CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx ||
         cbid == CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernel || cbid == CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch;
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = kBufferBytes;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::vector<Span> spans;
  CUpti_Activity* rec = nullptr;
  while (cupti().next_record(buffer, valid, &rec) == CUPTI_SUCCESS) {
    switch (rec->kind) {
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
      case CUPTI_ACTIVITY_KIND_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
        spans.push_back({Kind::gpu, k->start, k->end, k->name, k->correlationId});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
        spans.push_back({Kind::gpu, m->start, m->end, memcpy_label(m->copyKind), m->correlationId});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(rec);
        spans.push_back({Kind::gpu, m->start, m->end, "memset", m->correlationId});
        break;
      }
      case CUPTI_ACTIVITY_KIND_RUNTIME:
      case CUPTI_ACTIVITY_KIND_DRIVER: {
        const auto* a = reinterpret_cast<const CUpti_ActivityAPI*>(rec);
        const bool runtime = rec->kind == CUPTI_ACTIVITY_KIND_RUNTIME;
        if (runtime ? runtime_waits(a->cbid) : driver_waits(a->cbid))
          spans.push_back({Kind::wait, a->start, a->end, nullptr});
        if (runtime ? runtime_launches(a->cbid) : driver_launches(a->cbid))
          spans.push_back({Kind::launch, a->start, a->end, nullptr});
        spans.push_back({Kind::call, a->start, a->end, nullptr, a->correlationId});
        break;
      }
      default:
        break;
    }
  }
  std::free(buffer);
  const std::lock_guard<std::mutex> lock(g_mutex);
  g_spans.insert(g_spans.end(), spans.begin(), spans.end());
}

// Each window's GPU spans by start time, with readable names and the host time of their calls.
std::vector<std::vector<GpuOpSpan>> ops_in_order(const std::vector<Span>& spans,
                                                 const std::vector<std::pair<uint64_t, uint64_t>>& windows) {
  std::unordered_map<uint32_t, uint64_t> issued;  // correlation id -> the call's start
  for (const Span& s : spans)
    if (s.kind == Kind::call) issued.emplace(s.correlation, s.begin);
  std::map<const char*, std::string> names;  // demangled once per kernel
  std::vector<std::vector<GpuOpSpan>> out(windows.size());
  for (const Span& s : spans) {
    if (s.kind != Kind::gpu) continue;
    for (size_t w = 0; w < windows.size(); ++w) {
      if (s.begin < windows[w].first || s.begin >= windows[w].second) continue;
      auto [it, fresh] = names.try_emplace(s.name);
      if (fresh) it->second = s.name ? readable(s.name) : std::string("?");
      const auto call = issued.find(s.correlation);
      out[w].push_back({it->second, s.begin, s.end, call == issued.end() ? 0 : call->second});
      break;
    }
  }
  for (std::vector<GpuOpSpan>& ops : out)
    std::stable_sort(ops.begin(), ops.end(), [](const GpuOpSpan& a, const GpuOpSpan& b) { return a.begin < b.begin; });
  return out;
}

// The operations of every window summed by readable name, longest first.
std::vector<GpuOpTotal> op_totals(const std::vector<std::vector<GpuOpSpan>>& in_order) {
  std::map<std::string, GpuOpTotal> merged;  // one entry per readable name
  for (const std::vector<GpuOpSpan>& ops : in_order)
    for (const GpuOpSpan& op : ops) {
      GpuOpTotal& m = merged[op.name];
      ++m.count;
      m.ms += static_cast<double>(op.end - op.begin) * 1e-6;
    }
  std::vector<GpuOpTotal> out;
  for (const auto& [name, t] : merged) out.push_back({name, t.count, t.ms});
  std::sort(out.begin(), out.end(), [](const GpuOpTotal& a, const GpuOpTotal& b) { return a.ms > b.ms; });
  return out;
}

}  // namespace

bool gpu_activity_start(std::string* why) {
  Cupti& c = cupti();
  if (!c.lib.error.empty()) {  // why it could not be loaded
    if (why) *why = c.lib.error;
    return false;
  }
  MF_CHECK(!g_recording, "gpu_activity_start: already recording");
  static const bool registered = c.register_callbacks(buffer_requested, buffer_completed) == CUPTI_SUCCESS;
  if (!registered) {
    if (why) *why = "cuptiActivityRegisterCallbacks failed";
    return false;
  }
  {
    const std::lock_guard<std::mutex> lock(g_mutex);
    g_spans.clear();
  }
  for (const CUpti_ActivityKind k : kKinds)
    if (c.enable(k) != CUPTI_SUCCESS) {
      for (const CUpti_ActivityKind d : kKinds) c.disable(d);
      if (why) *why = "cuptiActivityEnable(" + std::to_string(static_cast<int>(k)) + ") failed (another profiler?)";
      return false;
    }
  g_recording = true;
  return true;
}

uint64_t gpu_activity_now() {
  uint64_t t = 0;
  MF_CHECK(g_recording && cupti().timestamp(&t) == CUPTI_SUCCESS, "gpu_activity_now: not recording");
  return t;
}

std::vector<GpuActivityWindow> gpu_activity_stop(const std::vector<std::pair<uint64_t, uint64_t>>& windows,
                                                 std::vector<GpuOpTotal>* by_op,
                                                 std::vector<std::vector<GpuOpSpan>>* in_order) {
  MF_CHECK(g_recording, "gpu_activity_stop: not recording");
  Cupti& c = cupti();
  for (const CUpti_ActivityKind k : kKinds) c.disable(k);
  c.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  g_recording = false;
  std::vector<std::pair<uint64_t, uint64_t>> by_kind[4];
  {
    const std::lock_guard<std::mutex> lock(g_mutex);
    for (const Span& s : g_spans) by_kind[static_cast<int>(s.kind)].emplace_back(s.begin, s.end);
    if (by_op || in_order) {
      std::vector<std::vector<GpuOpSpan>> ops = ops_in_order(g_spans, windows);
      if (by_op) *by_op = op_totals(ops);
      if (in_order) *in_order = std::move(ops);
    }
    g_spans.clear();
  }
  std::vector<GpuActivityWindow> out;
  for (const auto& [lo, hi] : windows) {
    GpuActivityWindow w;
    auto ms = [](uint64_t ns) { return static_cast<double>(ns) * 1e-6; };
    const IntervalCover gpu = interval_cover(by_kind[0], lo, hi);
    w.wall_ms = ms(hi > lo ? hi - lo : 0);
    w.gpu_busy_ms = ms(gpu.covered);
    w.gpu_idle_ms = w.wall_ms - w.gpu_busy_ms;
    w.largest_gap_ms = ms(gpu.largest_gap);
    w.host_wait_ms = ms(interval_cover(by_kind[1], lo, hi).covered);
    w.host_ms = w.wall_ms - w.host_wait_ms;
    w.launch_ms = ms(interval_cover(by_kind[2], lo, hi).covered);
    for (const auto& [b, e] : by_kind[0]) w.gpu_ops += b >= lo && b < hi;
    out.push_back(w);
  }
  return out;
}

#else  // no CUDA: nothing to record

bool gpu_activity_start(std::string* why) {
  if (why) *why = "built without CUDA";
  return false;
}
uint64_t gpu_activity_now() { MF_FAIL("gpu_activity_now: built without CUDA"); }
std::vector<GpuActivityWindow> gpu_activity_stop(const std::vector<std::pair<uint64_t, uint64_t>>&,
                                                 std::vector<GpuOpTotal>*, std::vector<std::vector<GpuOpSpan>>*) {
  MF_FAIL("gpu_activity_stop: built without CUDA");
}

#endif

}  // namespace moefold

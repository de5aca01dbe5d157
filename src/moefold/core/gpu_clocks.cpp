// GPU clock sampling (gpu_clocks.h): NVML through dlopen on a thread of its own, and the summary.
#include "moefold/core/gpu_clocks.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>
#include <utility>

#ifdef MOEFOLD_WITH_CUDA
#include <cuda_runtime.h>

#include "moefold/core/run_time_library.h"
#endif

namespace moefold {

GpuClocks summarize_gpu_clocks(const std::vector<GpuClockSample>& samples, double sm_mhz_limit, double power_limit_w) {
  GpuClocks c;
  c.sm_mhz_limit = sm_mhz_limit;
  c.power_limit_w = power_limit_w;
  c.samples = static_cast<int64_t>(samples.size());
  if (samples.empty()) return c;
  std::vector<double> mhz;
  double power = 0;
  for (const GpuClockSample& s : samples) {
    mhz.push_back(s.sm_mhz);
    power += s.power_w;
    c.power_w_max = std::max(c.power_w_max, s.power_w);
    c.reasons |= s.reasons;
  }
  std::sort(mhz.begin(), mhz.end());
  const size_t n = mhz.size();
  c.sm_mhz_median = n % 2 == 1 ? mhz[n / 2] : 0.5 * (mhz[n / 2 - 1] + mhz[n / 2]);
  c.sm_mhz_min = mhz.front();
  c.sm_mhz_max = mhz.back();
  c.power_w_mean = power / static_cast<double>(n);
  return c;
}

std::string gpu_clock_reasons(uint64_t reasons) {
  // NVML's nvmlClocksEventReason* bits (GPU idle, 0x1, left out).
  static const std::pair<uint64_t, const char*> kNames[] = {
      {0x2, "application clocks"},
      {0x4, "power cap"},
      {0x8, "hardware slowdown"},
      {0x10, "sync boost"},
      {0x20, "software thermal slowdown"},
      {0x40, "hardware thermal slowdown"},
      {0x80, "power brake"},
      {0x100, "display clocks"},
  };
  std::string s;
  for (const auto& [bit, name] : kNames)
    if ((reasons & bit) != 0) s += (s.empty() ? "" : ", ") + std::string(name);
  return s;
}

std::string describe_gpu_clocks(const GpuClocks& c) {
  if (c.samples == 0) return "no samples";
  char buf[320];
  std::snprintf(buf, sizeof buf, "SM clock median %.0f MHz (%.0f-%.0f", c.sm_mhz_median, c.sm_mhz_min, c.sm_mhz_max);
  std::string s = buf;
  if (c.sm_mhz_limit > 0) {
    std::snprintf(buf, sizeof buf, "; max %.0f", c.sm_mhz_limit);
    s += buf;
  }
  std::snprintf(buf, sizeof buf, "), power %.0f W mean, %.0f W peak", c.power_w_mean, c.power_w_max);
  s += buf;
  if (c.power_limit_w > 0) {
    std::snprintf(buf, sizeof buf, " of %.0f W", c.power_limit_w);
    s += buf;
  }
  const std::string r = gpu_clock_reasons(c.reasons);
  s += "; clock held down by: " + (r.empty() ? std::string("nothing") : r);
  std::snprintf(buf, sizeof buf, " (%lld samples)", static_cast<long long>(c.samples));
  return s + buf;
}

#ifdef MOEFOLD_WITH_CUDA

namespace {

// The NVML entry points this uses (C ABI; nvml.h's types reduced to what is passed here).
using NvmlDevice = void*;
struct Nvml {
  RunTimeLibrary lib{{"libnvidia-ml.so.1"}, "libnvidia-ml"};  // the driver's
  int (*init)() = nullptr;
  int (*by_pci)(const char*, NvmlDevice*) = nullptr;
  int (*clock)(NvmlDevice, int, unsigned*) = nullptr;
  int (*max_clock)(NvmlDevice, int, unsigned*) = nullptr;
  int (*power)(NvmlDevice, unsigned*) = nullptr;
  int (*power_limit)(NvmlDevice, unsigned*) = nullptr;
  int (*reasons)(NvmlDevice, unsigned long long*) = nullptr;
};
constexpr int kNvmlClockSm = 1;

Nvml& nvml() {
  static Nvml n = [] {
    Nvml x;
    x.lib.get(x.init, "nvmlInit_v2");
    x.lib.get(x.by_pci, "nvmlDeviceGetHandleByPciBusId_v2");
    x.lib.get(x.clock, "nvmlDeviceGetClockInfo");
    x.lib.get(x.max_clock, "nvmlDeviceGetMaxClockInfo");
    x.lib.get(x.power, "nvmlDeviceGetPowerUsage");
    x.lib.get(x.power_limit, "nvmlDeviceGetEnforcedPowerLimit");
    x.lib.get(x.reasons, "nvmlDeviceGetCurrentClocksThrottleReasons");
    if (x.lib.error.empty() && x.init() != 0) x.lib.error = "nvmlInit failed";
    return x;
  }();
  return n;
}

}  // namespace

struct GpuClockSampler::State {
  NvmlDevice device = nullptr;
  double sm_mhz_limit = 0, power_limit_w = 0;
  std::vector<GpuClockSample> samples;
  std::atomic<bool> stop{false};
  std::thread thread;
};

GpuClockSampler::GpuClockSampler() = default;
GpuClockSampler::~GpuClockSampler() { stop(); }

bool GpuClockSampler::start(int period_ms, std::string* why) {
  int dev = 0;
  char bus[32] = {};
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetPCIBusId(bus, sizeof bus, dev) != cudaSuccess) {
    cudaGetLastError();
    *why = "no CUDA device";
    return false;
  }
  Nvml& n = nvml();
  if (!n.lib.error.empty()) {
    *why = n.lib.error;
    return false;
  }
  auto s = std::make_unique<State>();
  if (n.by_pci(bus, &s->device) != 0) {
    *why = std::string("NVML does not know the device at ") + bus;
    return false;
  }
  unsigned v = 0;
  if (n.max_clock(s->device, kNvmlClockSm, &v) == 0) s->sm_mhz_limit = v;
  if (n.power_limit(s->device, &v) == 0) s->power_limit_w = v / 1000.0;
  State* st = s.get();
  s->thread = std::thread([st, period_ms, &n] {
    while (!st->stop.load(std::memory_order_relaxed)) {
      GpuClockSample x;
      unsigned u = 0;
      unsigned long long r = 0;
      if (n.clock(st->device, kNvmlClockSm, &u) == 0) x.sm_mhz = u;
      if (n.power(st->device, &u) == 0) x.power_w = u / 1000.0;
      if (n.reasons(st->device, &r) == 0) x.reasons = r;
      st->samples.push_back(x);
      std::this_thread::sleep_for(std::chrono::milliseconds(period_ms));
    }
  });
  s_ = std::move(s);
  return true;
}

GpuClocks GpuClockSampler::stop() {
  if (!s_) return {};
  s_->stop = true;
  s_->thread.join();
  const GpuClocks c = summarize_gpu_clocks(s_->samples, s_->sm_mhz_limit, s_->power_limit_w);
  s_.reset();
  return c;
}

#else

struct GpuClockSampler::State {};
GpuClockSampler::GpuClockSampler() = default;
GpuClockSampler::~GpuClockSampler() = default;
bool GpuClockSampler::start(int, std::string* why) {
  *why = "a CPU-only build";
  return false;
}
GpuClocks GpuClockSampler::stop() { return {}; }

#endif

}  // namespace moefold

// The GPU's SM clock, power draw and clock-event reasons sampled while a benchmark runs (`moefold
// bench moe-layer`): a GEMM timed alone on a rested GPU runs at higher clocks than the same GEMM
// inside a layer that has kept the GPU at its power limit (docs/benchmarks.md, session 26), so a
// timing means little without the clocks it ran at. NVML, read from libnvidia-ml loaded at run time
// (dlopen: the driver's library; no link dependency, and a machine without it only loses this report).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace moefold {

struct GpuClockSample {
  double sm_mhz = 0;     // the SM clock
  double power_w = 0;    // the board's power draw
  uint64_t reasons = 0;  // NVML's clock-event reasons (a bit set: why the clock is below its maximum)
};

// What a run of samples says.
struct GpuClocks {
  int64_t samples = 0;
  double sm_mhz_median = 0, sm_mhz_min = 0, sm_mhz_max = 0;
  double sm_mhz_limit = 0;  // the device's maximum SM clock (0: unknown)
  double power_w_mean = 0, power_w_max = 0;
  double power_limit_w = 0;  // the enforced power limit (0: unknown)
  uint64_t reasons = 0;      // every reason seen in any sample
};

GpuClocks summarize_gpu_clocks(const std::vector<GpuClockSample>& samples, double sm_mhz_limit, double power_limit_w);
// One line, e.g. "SM clock median 1755 MHz (1635-1980; max 1980), power 652 W mean, 699 W peak of
// 700 W; clock held down by: power cap". "no samples" when there were none.
std::string describe_gpu_clocks(const GpuClocks& c);
// The names of the reason bits set in `reasons` ("power cap", "hardware thermal slowdown", ...),
// comma-separated; the GPU idle bit is left out (it says nothing about a loaded GPU).
std::string gpu_clock_reasons(uint64_t reasons);

// Samples the current CUDA device every period from start() to stop() on a thread of its own.
class GpuClockSampler {
 public:
  GpuClockSampler();
  ~GpuClockSampler();
  GpuClockSampler(const GpuClockSampler&) = delete;
  GpuClockSampler& operator=(const GpuClockSampler&) = delete;
  // False, with the reason in *why, where it cannot sample (no CUDA build or device, no
  // libnvidia-ml, NVML refuses). REQUIRES: not started.
  bool start(int period_ms, std::string* why);
  // Ends the sampling and summarizes it (empty when start() failed or was not called).
  GpuClocks stop();

 private:
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace moefold

// core/profile.h on the GPU: scopes are CUDA events on the compute stream that time the stream's
// work, not the host's launches; recording never waits for the stream; after the first collect
// the event pool is reused (no event created, no device memory allocated). Skipped without a GPU.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cuda_testing.h"
#include "moefold/core/device.h"
#include "moefold/core/gpu_activity.h"
#include "moefold/core/gpu_clocks.h"
#include "moefold/core/profile.h"

namespace moefold {
namespace {

TEST(ProfileCuda, EventsTimeTheStreamWithoutWaiting) {
  MF_REQUIRE_GPU();
  // 60 memsets of 256 MiB: 15 GiB written, at least 3 ms at the H200's 4.8 TB/s; their
  // launches take a few microseconds each on the host.
  const size_t bytes = size_t{256} << 20;
  void* buf = device_malloc(bytes);
  device_zero(buf, bytes);
  device_synchronize();
  auto work = [&] {
    ProfileScope outer("outer");
    for (int j = 0; j < 2; ++j) {
      ProfileScope inner("inner");
      for (int k = 0; k < 30; ++k) device_zero(buf, bytes);
    }
  };
  profile_enable(Device::cuda);
  work();  // sizes the pool: three scopes, two events each
  ASSERT_EQ(profile_collect().size(), 2u);
  const int64_t events = profile_pool_events(), mallocs = device_malloc_count();
  EXPECT_EQ(events, 6);

  StreamTimer stream;  // brackets the scopes on the same stream
  stream.start(Device::cuda);
  const auto t0 = std::chrono::steady_clock::now();
  work();
  const double host_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  stream.stop();
  const std::vector<PhaseTime> t = profile_collect();
  profile_disable();
  const double stream_ms = stream.elapsed_ms();
  device_free(buf);

  EXPECT_EQ(profile_pool_events(), events);  // steady state: the pool is reused
  EXPECT_EQ(device_malloc_count(), mallocs);
  ASSERT_EQ(t.size(), 2u);
  const PhaseTime &outer = t[0], &inner = t[1];
  EXPECT_EQ(outer.name, "outer");
  EXPECT_EQ(inner.name, "inner");
  EXPECT_EQ(outer.calls, 1);
  EXPECT_EQ(inner.calls, 2);
  EXPECT_EQ(inner.depth, 1);
  // The scopes timed the stream's work: within the bracketing timer, and far longer than the
  // host took to queue it (a scope that waited for the stream would make host_ms as long).
  EXPECT_LE(outer.ms, stream_ms + 1e-3);
  EXPECT_LE(inner.ms, outer.ms + 1e-3);
  EXPECT_GE(inner.ms, 0.9 * outer.ms);  // all the work is inside the inner scopes
  EXPECT_GT(outer.ms, 2.0);
  EXPECT_LT(host_ms, 0.5 * outer.ms) << "host " << host_ms << " ms, stream " << outer.ms << " ms";
  EXPECT_NEAR(outer.self_ms, outer.ms - inner.ms, 1e-6);
  EXPECT_DOUBLE_EQ(outer.top_level_ms, outer.ms);
  EXPECT_DOUBLE_EQ(inner.top_level_ms, 0);
}

// core/gpu_activity.h: a window of [memsets, host sleeps 30 ms, memsets, synchronise] shows the GPU
// busy for the memsets only, idle across the sleep (its longest gap), and the host waiting in the
// synchronisation for the second batch. Skipped where CUPTI cannot be had (says why).
TEST(GpuActivity, SeesTheGpuIdleWhileTheHostSleeps) {
  MF_REQUIRE_GPU();
  const size_t bytes = size_t{256} << 20;
  void* buf = device_malloc(bytes);
  device_zero(buf, bytes);
  device_synchronize();
  std::string why;
  if (!gpu_activity_start(&why)) {
    device_free(buf);
    GTEST_SKIP() << "CUPTI: " << why;
  }
  const uint64_t t0 = gpu_activity_now();
  for (int k = 0; k < 20; ++k) device_zero(buf, bytes);  // >= 1 ms of GPU work
  device_synchronize();
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  for (int k = 0; k < 20; ++k) device_zero(buf, bytes);
  device_synchronize();
  const uint64_t t1 = gpu_activity_now();
  const std::vector<GpuActivityWindow> w = gpu_activity_stop({{t0, t1}});
  device_free(buf);
  ASSERT_EQ(w.size(), 1u);
  const GpuActivityWindow& a = w[0];
  EXPECT_EQ(a.gpu_ops, 40);
  EXPECT_GT(a.gpu_busy_ms, 2.0);  // 10 GiB written at most ~5 TB/s
  EXPECT_GE(a.gpu_idle_ms, 29.0);
  EXPECT_GE(a.largest_gap_ms, 29.0);
  EXPECT_NEAR(a.gpu_busy_ms + a.gpu_idle_ms, a.wall_ms, 1e-9);
  EXPECT_GE(a.host_wait_ms, 0.5 * a.gpu_busy_ms);  // the host waited out (most of) both batches
  EXPECT_GE(a.host_ms, 29.0);                      // the sleep is host time
  EXPECT_GE(a.launch_ms, 0.0);                     // memsets are no kernel launches
  std::printf("window %.3f ms: GPU busy %.3f, idle %.3f (gap %.3f); host %.3f, waiting %.3f, launching %.3f\n",
              a.wall_ms, a.gpu_busy_ms, a.gpu_idle_ms, a.largest_gap_ms, a.host_ms, a.host_wait_ms, a.launch_ms);
}

TEST(GpuClocksCuda, SamplesTheDeviceWhileItWorks) {
  MF_REQUIRE_GPU();
  GpuClockSampler sampler;
  std::string why;
  ASSERT_TRUE(sampler.start(5, &why)) << why;
  const size_t bytes = size_t{256} << 20;
  void* buf = device_malloc(bytes);
  for (int k = 0; k < 200; ++k) device_zero(buf, bytes);  // ~50 GiB written: >= 10 ms
  device_synchronize();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const GpuClocks c = sampler.stop();
  device_free(buf);
  EXPECT_GE(c.samples, 2);
  EXPECT_GT(c.sm_mhz_median, 0);
  EXPECT_GT(c.sm_mhz_limit, 0);
  EXPECT_LE(c.sm_mhz_max, c.sm_mhz_limit);
  EXPECT_GT(c.power_w_max, 0);
  EXPECT_GT(c.power_limit_w, 0);
  std::printf("%s\n", describe_gpu_clocks(c).c_str());
  EXPECT_EQ(sampler.stop().samples, 0);  // stopped: nothing more
}

}  // namespace
}  // namespace moefold

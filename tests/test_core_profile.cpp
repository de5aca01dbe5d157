// core/profile.h on the host clock: nested scopes accumulate inclusive time per name, calls and
// first-seen order are right, collect starts afresh, and a scope opened while profiling is off
// records nothing. (The CUDA event path: test_core_profile_cuda.cpp.)
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "moefold/core/gpu_clocks.h"
#include "moefold/core/profile.h"

namespace moefold {
namespace {

// sleep_for sleeps at least as long as asked: lower bounds on the times are exact.
void sleep_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

double wall_ms(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

TEST(Profile, NestedScopesAccumulateInclusiveTime) {
  profile_enable(Device::cpu);
  EXPECT_TRUE(profile_enabled());
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 2; ++i) {
    ProfileScope outer("outer");
    sleep_ms(4);
    for (int j = 0; j < 3; ++j) {
      ProfileScope inner("inner");
      sleep_ms(2);
    }
  }
  {
    ProfileScope inner("inner");  // the same name at the top level
    sleep_ms(2);
  }
  const double wall = wall_ms(t0);
  const std::vector<PhaseTime> t = profile_collect();
  profile_disable();
  ASSERT_EQ(t.size(), 2u);
  const PhaseTime &outer = t[0], &inner = t[1];  // first-seen order
  EXPECT_EQ(outer.name, "outer");
  EXPECT_EQ(inner.name, "inner");
  EXPECT_EQ(outer.depth, 0);
  EXPECT_EQ(inner.depth, 1);  // its first call was nested
  EXPECT_EQ(outer.calls, 2);
  EXPECT_EQ(inner.calls, 7);
  EXPECT_GE(inner.ms, 7 * 2);
  EXPECT_DOUBLE_EQ(inner.self_ms, inner.ms);  // nothing nested inside it
  EXPECT_GE(inner.top_level_ms, 2);
  EXPECT_LT(inner.top_level_ms, inner.ms);
  // Inclusive: outer's time holds its six inner calls, its self time only its own sleeps.
  EXPECT_GE(outer.self_ms, 2 * 4);
  EXPECT_GE(outer.ms, 2 * 4 + 6 * 2);
  EXPECT_NEAR(outer.ms - outer.self_ms, inner.ms - inner.top_level_ms, 1e-9);
  EXPECT_DOUBLE_EQ(outer.top_level_ms, outer.ms);
  // The top-level scopes fit in the wall time around them (a clock in the wrong unit fails here).
  EXPECT_LE(outer.top_level_ms + inner.top_level_ms, wall);
}

TEST(Profile, CollectStartsAfreshAndEnableDropsUncollected) {
  profile_enable(Device::cpu);
  { ProfileScope a("a"); }
  profile_enable(Device::cpu);  // drops "a"
  { ProfileScope b("b"); }
  std::vector<PhaseTime> t = profile_collect();
  ASSERT_EQ(t.size(), 1u);
  EXPECT_EQ(t[0].name, "b");
  EXPECT_EQ(t[0].calls, 1);
  EXPECT_TRUE(profile_collect().empty());  // nothing since the last collect
  {
    ProfileScope c("c");
    ProfileScope b("b");
  }
  t = profile_collect();
  ASSERT_EQ(t.size(), 2u);  // a fresh first-seen order
  EXPECT_EQ(t[0].name, "c");
  EXPECT_EQ(t[1].name, "b");
  EXPECT_EQ(t[1].calls, 1);
  EXPECT_EQ(t[1].depth, 1);
  profile_disable();
  EXPECT_EQ(profile_pool_events(), 0);  // the host clock needs no CUDA events
}

TEST(Profile, ScopesRecordNothingWhileOff) {
  profile_disable();
  EXPECT_FALSE(profile_enabled());
  {
    ProfileScope off("off");
    sleep_ms(1);
  }
  EXPECT_TRUE(profile_collect().empty());
  // A scope that opened while on still closes after profiling is turned off; one that opened
  // while off stays unrecorded when profiling is turned on inside it.
  profile_enable(Device::cpu);
  {
    ProfileScope on("on");
    profile_disable();
  }
  std::vector<PhaseTime> t = profile_collect();
  ASSERT_EQ(t.size(), 1u);
  EXPECT_EQ(t[0].name, "on");
  EXPECT_EQ(t[0].calls, 1);
  {
    ProfileScope late("opened while off");
    profile_enable(Device::cpu);
    ProfileScope inner("inner");
  }
  profile_disable();
  t = profile_collect();
  ASSERT_EQ(t.size(), 1u);
  EXPECT_EQ(t[0].name, "inner");
  EXPECT_EQ(t[0].depth, 0);  // the unrecorded scope around it does not count
}

// core/gpu_clocks.h's summary and line (the sampling itself: test_core_profile_cuda.cpp).
TEST(GpuClocks, SummaryAndLine) {
  const GpuClocks c = summarize_gpu_clocks({{1500, 600, 0x4}, {1700, 650, 0x0}, {1600, 700, 0x40 | 0x1}}, 1980, 700);
  EXPECT_EQ(c.samples, 3);
  EXPECT_EQ(c.sm_mhz_median, 1600);
  EXPECT_EQ(c.sm_mhz_min, 1500);
  EXPECT_EQ(c.sm_mhz_max, 1700);
  EXPECT_EQ(c.power_w_mean, 650);
  EXPECT_EQ(c.power_w_max, 700);
  EXPECT_EQ(c.reasons, 0x45u);
  EXPECT_EQ(describe_gpu_clocks(c),
            "SM clock median 1600 MHz (1500-1700; max 1980), power 650 W mean, 700 W peak of 700 W; clock held down "
            "by: power cap, hardware thermal slowdown (3 samples)");
  EXPECT_EQ(summarize_gpu_clocks({{1400, 1, 0}, {1800, 1, 0}}, 0, 0).sm_mhz_median, 1600);  // even: the middle two
  EXPECT_EQ(describe_gpu_clocks(summarize_gpu_clocks({{1980, 300, 0x1}}, 0, 0)),
            "SM clock median 1980 MHz (1980-1980), power 300 W mean, 300 W peak; clock held down by: nothing (1 "
            "samples)");  // unknown limits are left out; the idle bit is no reason
  EXPECT_EQ(describe_gpu_clocks(summarize_gpu_clocks({}, 1980, 700)), "no samples");
}

}  // namespace
}  // namespace moefold

// core/profile.h on the host clock: nested scopes accumulate inclusive time per name, calls and
// first-seen order are right, collect starts afresh, and a scope opened while profiling is off
// records nothing. (The CUDA event path: test_core_profile_cuda.cpp.)
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

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

}  // namespace
}  // namespace moefold

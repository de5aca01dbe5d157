// Core: tensor views, planned arenas, bf16 conversion, the counter-based RNG.
#include <cmath>

#include "moefold/core/memory.h"
#include "moefold/core/rng.h"
#include "testing.h"

namespace moefold {
namespace {

TEST(Philox, KnownAnswer) {
  // Random123's known-answer vectors for philox4x32-10.
  auto r = philox4x32({0, 0, 0, 0}, {0, 0});
  EXPECT_EQ(r[0], 0x6627e8d5u);
  EXPECT_EQ(r[1], 0xe169c58du);
  EXPECT_EQ(r[2], 0xbc57ac4cu);
  EXPECT_EQ(r[3], 0x9b00dbd8u);
  r = philox4x32({0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, {0xa4093822u, 0x299f31d0u});
  EXPECT_EQ(r[0], 0xd16cfe09u);
  EXPECT_EQ(r[1], 0x94fdccebu);
}

}  // namespace
}  // namespace moefold

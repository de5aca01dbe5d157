// Shared state of the multi-rank test binaries (tests/mpi/mpi_main.cpp sets it up): the world
// communicator every test starts from. Tests pass groups on explicitly; nothing else is global.
#pragma once

#include <cstdint>

#include "moefold/comm/communicator.h"

namespace moefold::testing {

// Per-operation timeout of test_world(): far below CTest's TIMEOUT (120 s), so a hang aborts with
// its one-line diagnosis instead of being killed silently.
inline constexpr double kMpiTestTimeoutS = 30.0;

// The world group of this test job. REQUIRES: called from a binary built with mpi_main.cpp.
Communicator& test_world();

// A seed fresh each run and equal on every rank of `comm` (rank 0's, broadcast).
uint64_t shared_seed(Communicator& comm);

}  // namespace moefold::testing

// main() of every multi-rank test binary: initialises MPI, runs GoogleTest on every rank (rank 0
// prints the usual output, other ranks only their failures), and exits non-zero on every rank
// when any rank failed, so mpirun (and CTest) fail too.
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <string>

#include "moefold/comm/mpi.h"
#include "mpi_testing.h"
#include "testing.h"

namespace moefold::testing {
namespace {

std::unique_ptr<Communicator> g_world;

// Ranks other than 0 print failed assertions only, tagged with the rank.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  // (UnitTest::current_test_info() would deadlock inside OnTestPartResult: gtest holds its mutex.)
  void OnTestStart(const ::testing::TestInfo& info) override {
    test_ = std::string(info.test_suite_name()) + "." + info.name();
  }
  void OnTestEnd(const ::testing::TestInfo&) override { test_ = "(outside a test)"; }
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] FAILED %s at %s:%d\n%s\n", rank_, test_.c_str(),
                 r.file_name() ? r.file_name() : "?", r.line_number(), r.message());
    std::fflush(stderr);
  }

 private:
  int rank_;
  std::string test_ = "(outside a test)";
};

}  // namespace

Communicator& test_world() {
  MF_CHECK(g_world != nullptr, "test_world() outside mpi_main");
  return *g_world;
}

uint64_t shared_seed(Communicator& comm) {
  int64_t seed = static_cast<int64_t>(fresh_seed());
  comm.broadcast(Tensor(&seed, DType::i64, {1}), 0);
  return static_cast<uint64_t>(seed);
}

}  // namespace moefold::testing

namespace moefold::testing {

static int run_all(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  g_world = make_mpi_world(kMpiTestTimeoutS);
  const int rank = g_world->rank();
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailurePrinter(rank));
  }
  const int rc = RUN_ALL_TESTS();
  int32_t failed = rc != 0 ? 1 : 0;
  g_world->all_reduce(Tensor(&failed, DType::i32, {1}), ReduceOp::max);
  if (rank == 0 && failed && rc == 0) std::fprintf(stderr, "[rank 0] another rank failed (see its output above)\n");
  g_world.reset();
  mpi_finalize();
  return failed ? 1 : 0;
}

}  // namespace moefold::testing

int main(int argc, char** argv) { return moefold::testing::run_all(argc, argv); }

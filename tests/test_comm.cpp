// One-process tests of the comm module: the self communicator (copies and no-ops, misuse
// aborts), launcher detection and mpi_finalize without MPI. Multi-rank tests: tests/mpi/.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <vector>

#include "moefold/comm/communicator.h"
#include "moefold/comm/mpi.h"
#include "testing.h"

namespace moefold {
namespace {

// Suites are named comm_* so that `ctest -R comm` selects them with the multi-rank tests.

TEST(comm_self, IdentityAndSplit) {
  auto c = make_self_communicator();
  EXPECT_EQ(c->rank(), 0);
  EXPECT_EQ(c->size(), 1);
  EXPECT_EQ(c->world_rank(), 0);
  EXPECT_EQ(c->name(), "world");
  EXPECT_TRUE(std::isinf(c->timeout_s()));
  auto sub = c->split(3, -1, "ep");
  EXPECT_EQ(sub->size(), 1);
  EXPECT_EQ(sub->rank(), 0);
  EXPECT_EQ(sub->name(), "ep");
  c->barrier();
  sub->barrier();
}

TEST(comm_self, CollectivesAreCopiesOrNoOps) {
  testing::Pool pool;
  auto c = make_self_communicator("dp");
  for (DType dt : {DType::f32, DType::f64}) {
    Tensor x = pool.randn({4, 3}, dt);
    Tensor keep = pool.clone(x);
    c->all_reduce(x, ReduceOp::sum);
    EXPECT_EQ(testing::max_abs_diff(x, keep), 0.0);
    c->all_reduce(x, ReduceOp::max);
    c->broadcast(x, 0);
    EXPECT_EQ(testing::max_abs_diff(x, keep), 0.0);

    Tensor y = pool.zeros({4, 3}, dt);
    c->all_gather(x, y);
    EXPECT_EQ(testing::max_abs_diff(y, keep), 0.0);
    y.zero();
    c->reduce_scatter(x, y, ReduceOp::sum);
    EXPECT_EQ(testing::max_abs_diff(y, keep), 0.0);
    y.zero();
    c->all_to_all(x, y);
    EXPECT_EQ(testing::max_abs_diff(y, keep), 0.0);
  }
  // Integer dtypes are accepted too.
  std::vector<int64_t> v = {5, -2};
  c->all_reduce(Tensor(v.data(), DType::i64, {2}), ReduceOp::sum);
  EXPECT_EQ(v, (std::vector<int64_t>{5, -2}));
}

TEST(comm_self, AllToAllVCopiesCountedRowsOnly) {
  testing::Pool pool;
  auto c = make_self_communicator();
  Tensor send = pool.randn({5, 2});
  Tensor recv = pool.zeros({6, 2});
  const int64_t counts[1] = {3};
  c->all_to_all_v(send, counts, recv, counts);
  EXPECT_EQ(testing::max_abs_diff(recv.slice(0, 3), send.slice(0, 3)), 0.0);
  EXPECT_EQ(testing::max_abs(recv.slice(3, 6)), 0.0);  // rows past the count untouched
}

TEST(comm_self_DeathTest, MisuseAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto c = make_self_communicator("tp");
  std::vector<float> f(6);
  Tensor x(f.data(), DType::f32, {2, 3});
  EXPECT_DEATH(c->send(x, 0, 0), "send to peer 0 on group 'tp' of 1 rank");
  EXPECT_DEATH(c->recv(x, 0, 0), "recv from peer 0 on group 'tp' of 1 rank");
  EXPECT_DEATH(c->broadcast(x, 1), "from root 1");
  EXPECT_DEATH(c->all_reduce(Tensor(), ReduceOp::sum), "all_reduce: buf is undefined");
  std::vector<uint16_t> h(6), h2(6, 7);  // bf16 is copied like any dtype (the one-rank groups of GPU runs)
  c->all_gather(Tensor(h2.data(), DType::bf16, {6}), Tensor(h.data(), DType::bf16, {6}));
  EXPECT_EQ(h, h2);
  std::vector<float> g(9);
  EXPECT_DEATH(c->all_gather(x, Tensor(g.data(), DType::f32, {3, 3})), "all_gather: recv");
  const int64_t sc[1] = {2}, rc[1] = {1};
  EXPECT_DEATH(c->all_to_all_v(x, sc, x, rc), "sends 2 rows to itself but expects 1");
}

TEST(comm_mpi_env, LaunchDetection) {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_NTASKS", "SLURM_PROCID",
                        "SLURM_STEP_ID", "SLURM_STEPID"})
    unsetenv(v);
  EXPECT_FALSE(launched_by_mpi());
  setenv("SLURM_NTASKS", "4", 1);
  setenv("SLURM_PROCID", "0", 1);
  EXPECT_FALSE(launched_by_mpi()) << "a batch script is not an srun step";
  setenv("SLURM_STEP_ID", "0", 1);
  EXPECT_TRUE(launched_by_mpi());
  unsetenv("SLURM_NTASKS");
  unsetenv("SLURM_PROCID");
  unsetenv("SLURM_STEP_ID");
  setenv("PMIX_RANK", "1", 1);
  EXPECT_TRUE(launched_by_mpi());
  unsetenv("PMIX_RANK");
  setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
  EXPECT_TRUE(launched_by_mpi());
  unsetenv("OMPI_COMM_WORLD_SIZE");
}

TEST(comm_mpi_env, FinalizeWithoutInitIsANoOp) {
  mpi_finalize();
  mpi_finalize();
}

}  // namespace
}  // namespace moefold

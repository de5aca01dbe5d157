// The NCCL communicator against known results, one GPU per rank (skipped when the ranks have
// fewer GPUs than the job has ranks, or the build has no CUDA): every collective on GPU tensors
// in f32, bf16 and i64, uneven all-to-all-v with empty blocks, host tensors staged, groups from
// split, the torchrun-style TCP bootstrap, and the same results as the MPI backend.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "cuda_testing.h"
#include "moefold/comm/nccl.h"
#include "moefold/comm/peer_memory.h"
#include "mpi_testing.h"

namespace moefold {
namespace {

using testing::DevicePool;

class Nccl : public ::testing::Test {
 protected:
  void SetUp() override {
    Communicator& w = testing::test_world();
    // Every rank must agree to skip (a lone skipper would leave the others in a collective).
    int64_t ok = cuda_device_count() >= 1 ? 1 : 0;
    int64_t gpus = cuda_device_count();
    w.all_reduce(Tensor(&ok, DType::i64, {1}), ReduceOp::max);
    w.all_reduce(Tensor(&gpus, DType::i64, {1}), ReduceOp::max);
    if (ok == 0 || gpus < w.size())
      GTEST_SKIP() << "needs one GPU per rank (" << gpus << " GPUs, " << w.size() << " ranks)";
    nccl_ = make_nccl_world(&w, testing::kMpiTestTimeoutS);
  }
  std::unique_ptr<Communicator> nccl_;
};

// Values rank r holds at element i: distinct per rank and element, exact in bf16.
double value(int r, int64_t i) { return static_cast<double>((r + 1) * 16 + (i % 13)) * 0.25; }

Tensor filled(testing::Pool& pool, DevicePool& dev, int64_t n, int r, DType dt) {
  Tensor h = pool.zeros({n});
  for (int64_t i = 0; i < n; ++i) testing::set_value_at(h, i, value(r, i));
  if (dt == DType::i64) {
    Tensor hi = dev.empty({n}, DType::i64);
    std::vector<int64_t> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) v[i] = static_cast<int64_t>(value(r, i) * 4);
    device_copy(hi.data(), Device::cuda, v.data(), Device::cpu, v.size() * 8);
    return hi;
  }
  return dev.upload(h, dt);
}

TEST_F(Nccl, AllReduceAllGatherReduceScatterBroadcast) {
  const int r = nccl_->rank(), n = nccl_->size();
  for (DType dt : {DType::f32, DType::bf16, DType::i64}) {
    SCOPED_TRACE(dtype_name(dt));
    testing::Pool pool;
    DevicePool dev;
    const int64_t len = 6 * n + 5;
    const double scale = dt == DType::i64 ? 4 : 1;
    Tensor a = filled(pool, dev, len, r, dt);
    nccl_->all_reduce(a, ReduceOp::sum);
    std::vector<double> got = testing::download(a);
    for (int64_t i = 0; i < len; ++i) {
      double want = 0;
      for (int p = 0; p < n; ++p) want += value(p, i) * scale;
      ASSERT_EQ(got[i], want) << i;
    }
    Tensor m = filled(pool, dev, len, r, dt);
    nccl_->all_reduce(m, ReduceOp::max);
    got = testing::download(m);
    for (int64_t i = 0; i < len; ++i) ASSERT_EQ(got[i], value(n - 1, i) * scale) << i;
    // all_gather: rank p's block lands at block p
    Tensor s = filled(pool, dev, 7, r, dt), g = dev.poisoned({7 * n}, dt);
    nccl_->all_gather(s, g);
    got = testing::download(g);
    for (int p = 0; p < n; ++p)
      for (int64_t i = 0; i < 7; ++i) ASSERT_EQ(got[p * 7 + i], value(p, i) * scale);
    // reduce_scatter: block r of the sum
    Tensor big = filled(pool, dev, 5 * n, r, dt), part = dev.poisoned({5}, dt);
    nccl_->reduce_scatter(big, part, ReduceOp::sum);
    got = testing::download(part);
    for (int64_t i = 0; i < 5; ++i) {
      double want = 0;
      for (int p = 0; p < n; ++p) want += value(p, r * 5 + i) * scale;
      ASSERT_EQ(got[i], want);
    }
    Tensor b = filled(pool, dev, 9, r, dt);
    nccl_->broadcast(b, n - 1);
    got = testing::download(b);
    for (int64_t i = 0; i < 9; ++i) ASSERT_EQ(got[i], value(n - 1, i) * scale);
  }
}

// The in-place pair of the distributed optimizer, started on the communicator's stream: after
// start_reduce_scatter + wait block r of rank r is the sum of every rank's block r; after
// start_all_gather every block p is rank p's.
TEST_F(Nccl, InPlaceReduceScatterThenAllGather) {
  const int r = nccl_->rank(), n = nccl_->size();
  for (DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    testing::Pool pool;
    DevicePool dev;
    const int64_t block = 11;
    Tensor a = filled(pool, dev, n * block, r, dt);
    nccl_->wait(nccl_->start_reduce_scatter(a, ReduceOp::sum));
    std::vector<double> got = testing::download(a);
    for (int64_t i = r * block; i < (r + 1) * block; ++i) {
      double want = 0;
      for (int p = 0; p < n; ++p) want += value(p, i);
      ASSERT_EQ(got[i], want) << i;
    }
    Tensor g = filled(pool, dev, n * block, r, dt);
    nccl_->wait(nccl_->start_all_gather(g));
    got = testing::download(g);
    for (int64_t i = 0; i < n * block; ++i) ASSERT_EQ(got[i], value(static_cast<int>(i / block), i)) << i;
  }
}

// Uneven blocks, empty ones included, rows of 3 elements: peer p gets (r + p) % 3 rows from r.
TEST_F(Nccl, AllToAllVUnevenAndEmptyBlocks) {
  const int r = nccl_->rank(), n = nccl_->size();
  testing::Pool pool;
  DevicePool dev;
  std::vector<int64_t> sc(n), rc(n);
  int64_t srows = 0, rrows = 0;
  for (int p = 0; p < n; ++p) {
    sc[p] = (r + p) % 3;
    rc[p] = (p + r) % 3;
    srows += sc[p];
    rrows += rc[p];
  }
  Tensor hs = pool.zeros({std::max<int64_t>(srows, 1), 3});
  int64_t row = 0;
  for (int p = 0; p < n; ++p)
    for (int64_t k = 0; k < sc[p]; ++k, ++row)
      for (int j = 0; j < 3; ++j) testing::set_value_at(hs, row * 3 + j, r * 100 + p * 10 + k + 0.5 * j);
  Tensor send = dev.upload(hs, DType::f32), recv = dev.poisoned({std::max<int64_t>(rrows, 1), 3}, DType::f32);
  nccl_->all_to_all_v(send, sc.data(), recv, rc.data());
  const std::vector<double> got = testing::download(recv);
  row = 0;
  for (int p = 0; p < n; ++p)
    for (int64_t k = 0; k < rc[p]; ++k, ++row)
      for (int j = 0; j < 3; ++j) ASSERT_EQ(got[row * 3 + j], p * 100 + r * 10 + k + 0.5 * j) << p << " " << k;
}

// start_exchange on the communicator's stream: two rounds started back to back (the second one
// from the buffers the first one filled, after a wait), every peer and itself, bf16 rows; the
// compute stream reads them after wait.
TEST_F(Nccl, StartExchangeRoundsAndWait) {
  const int r = nccl_->rank(), n = nccl_->size();
  testing::Pool pool;
  DevicePool dev;
  const int64_t cols = 8;
  std::vector<Tensor> out, mid, back;
  std::vector<Transfer> first, second;
  for (int p = 0; p < n; ++p) {
    const int64_t rows_to = 1 + (r + 2 * p) % 3, rows_from = 1 + (p + 2 * r) % 3;
    Tensor h = pool.zeros({rows_to, cols});
    for (int64_t i = 0; i < rows_to * cols; ++i) testing::set_value_at(h, i, r * 64 + p * 8 + (i % 8) + 0.5);
    out.push_back(dev.upload(h, DType::bf16));
    mid.push_back(dev.poisoned({rows_from, cols}, DType::bf16));
    back.push_back(dev.poisoned({rows_to, cols}, DType::bf16));
    first.push_back(Transfer{p, out.back(), mid.back()});
  }
  const int64_t t1 = nccl_->start_exchange(first);
  nccl_->wait(t1);
  for (int p = 0; p < n; ++p) second.push_back(Transfer{p, mid[p], back[p]});  // every row goes home again
  nccl_->wait(nccl_->start_exchange(second));
  for (int p = 0; p < n; ++p) {
    const std::vector<double> got_mid = testing::download(mid[p]), got_back = testing::download(back[p]);
    for (size_t i = 0; i < got_mid.size(); ++i)
      ASSERT_EQ(got_mid[i], p * 64 + r * 8 + static_cast<double>(i % 8) + 0.5) << "from " << p << " element " << i;
    for (size_t i = 0; i < got_back.size(); ++i)
      ASSERT_EQ(got_back[i], r * 64 + p * 8 + static_cast<double>(i % 8) + 0.5)
          << "back from " << p << " element " << i;
  }
}

// start_send / start_recv as the pipeline's links use them: one direction per communicator (rank 0
// to 1 on the world, 1 to 0 on a second communicator of the same ranks), three messages each way
// started before any wait, waited for in another order: they arrive in the order started.
TEST_F(Nccl, NonBlockingSendRecvOneDirectionPerCommunicator) {
  const int r = nccl_->rank(), n = nccl_->size();
  if (n != 2) GTEST_SKIP() << "needs 2 ranks";
  std::unique_ptr<Communicator> back = nccl_->split(0, r, "back");
  Communicator& out_comm = r == 0 ? *nccl_ : *back;  // this rank sends here
  Communicator& in_comm = r == 0 ? *back : *nccl_;   // and receives here
  testing::Pool pool;
  DevicePool dev;
  const std::vector<int64_t> rows = {3, 1 << 15, 5};
  std::vector<Tensor> in;
  std::vector<int64_t> recvs, sends;
  for (const int64_t n_rows : rows) {
    in.push_back(dev.poisoned({n_rows, 8}, DType::bf16));
    recvs.push_back(in_comm.start_recv(in.back(), 1 - r));
  }
  for (size_t m = 0; m < rows.size(); ++m) {
    Tensor h = pool.zeros({rows[m], 8});
    for (int64_t i = 0; i < rows[m] * 8; ++i) testing::set_value_at(h, i, value(r, i + static_cast<int64_t>(m)));
    sends.push_back(out_comm.start_send(dev.upload(h, DType::bf16), 1 - r));
  }
  for (size_t m = rows.size(); m-- > 0;) in_comm.wait(recvs[m]);
  for (const int64_t t : sends) out_comm.wait(t);
  for (size_t m = 0; m < rows.size(); ++m) {
    const std::vector<double> got = testing::download(in[m]);
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_EQ(got[i], value(1 - r, static_cast<int64_t>(i + m))) << "message " << m << " element " << i;
  }
}

// PeerMemory (GPUs of one host; the test skips where the group cannot map): each rank pushes
// rows into every peer's block at an offset that names the pair, pulls rows from every peer's
// block, twice in a row (sequence numbers move on), and reads them after wait.
TEST_F(Nccl, PeerMemoryPushAndPull) {
  const int r = nccl_->rank(), n = nccl_->size();
  testing::Pool pool;
  DevicePool dev;
  const int64_t cols = 8, rows = 3;         // per pair
  const int64_t block_rows = 2 * n * rows;  // [pushed from p | this rank's rows for p to pull]
  Tensor block = dev.poisoned({block_rows, cols}, DType::f32);
  std::unique_ptr<PeerMemory> pm = nccl_->map_peer_memory(block.data(), block.nbytes());
  if (pm == nullptr) GTEST_SKIP() << "the ranks' GPUs cannot map each other's memory";
  const size_t row_bytes = cols * sizeof(float);
  for (int round = 0; round < 2; ++round) {
    // This rank's rows for p to pull, at block rows [(n + p) * rows, +rows).
    for (int p = 0; p < n; ++p) {
      Tensor h = pool.zeros({rows, cols});
      for (int64_t i = 0; i < rows * cols; ++i) testing::set_value_at(h, i, 1000 * round + 100 * r + 10 * p + i);
      block.slice((n + p) * rows, (n + p + 1) * rows).copy_from(dev.upload(h, DType::f32));
    }
    std::vector<Tensor> out;
    std::vector<PeerMemory::Push> pushes;
    std::vector<PeerMemory::Pull> pulls;
    for (int p = 0; p < n; ++p) {
      if (p == r) continue;
      Tensor h = pool.zeros({rows, cols});
      for (int64_t i = 0; i < rows * cols; ++i) testing::set_value_at(h, i, 1000 * round + 100 * r + 10 * p + i + 0.5);
      out.push_back(dev.upload(h, DType::f32));
      pushes.push_back({p, out.back(), static_cast<size_t>(r * rows) * row_bytes});  // into p's rows from r
      pulls.push_back({p, static_cast<size_t>((n + r) * rows) * row_bytes, dev.poisoned({rows, cols}, DType::f32)});
    }
    const int64_t pushed = pm->push(pushes), pulled = pm->pull(pulls);
    pm->wait(pushed);
    pm->wait(pulled);
    for (int p = 0, k = 0; p < n; ++p) {
      if (p == r) continue;
      const std::vector<double> got = testing::download(block.slice(p * rows, (p + 1) * rows));
      const std::vector<double> took = testing::download(pulls[static_cast<size_t>(k++)].dst);
      for (int64_t i = 0; i < rows * cols; ++i) {
        ASSERT_EQ(got[i], 1000 * round + 100 * p + 10 * r + i + 0.5) << "pushed by " << p << " round " << round;
        ASSERT_EQ(took[i], 1000 * round + 100 * p + 10 * r + i) << "pulled from " << p << " round " << round;
      }
    }
    nccl_->barrier();  // nobody rewrites its rows before every peer has pulled them
  }
}

// Host tensors go through the staging buffer; groups from split reduce within themselves.
TEST_F(Nccl, HostTensorsAndSplitGroups) {
  const int r = nccl_->rank(), n = nccl_->size();
  std::vector<double> h = {1.0 * r, 2.0 * r, 3.5};
  nccl_->all_reduce(Tensor(h.data(), DType::f64, {3}), ReduceOp::sum);
  EXPECT_EQ(h[0], n * (n - 1) / 2.0);
  EXPECT_EQ(h[2], 3.5 * n);
  std::unique_ptr<Communicator> half = nccl_->split(r % 2, r, "half");
  int64_t mine = r + 1;
  half->all_reduce(Tensor(&mine, DType::i64, {1}), ReduceOp::sum);
  int64_t want = 0;
  for (int p = r % 2; p < n; p += 2) want += p + 1;
  EXPECT_EQ(mine, want);
  EXPECT_EQ(half->size(), (n - r % 2 + 1) / 2);
  nccl_->barrier();
  half->barrier();
}

// torchrun / Slurm style: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and a TCP rendezvous.
TEST_F(Nccl, EnvironmentBootstrap) {
  Communicator& w = testing::test_world();
  int64_t port = 29000 + static_cast<int64_t>(testing::shared_seed(w) % 2000);
  ::setenv("RANK", std::to_string(w.rank()).c_str(), 1);
  ::setenv("WORLD_SIZE", std::to_string(w.size()).c_str(), 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  std::unique_ptr<Communicator> env_world = make_nccl_world(nullptr, testing::kMpiTestTimeoutS);
  for (const char* v : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) ::unsetenv(v);
  EXPECT_EQ(env_world->rank(), w.rank());
  double x = 1;
  env_world->all_reduce(Tensor(&x, DType::f64, {1}), ReduceOp::sum);
  EXPECT_EQ(x, w.size());
}

}  // namespace
}  // namespace moefold

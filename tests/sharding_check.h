// One rank with parallel.distributed_optimizer on and off (test_train.cpp on the CPU,
// test_train_cuda.cpp on the GPU): every shard group has one rank, so the sharded path (bucket
// layout, master shards, Param::value over the gradient storage, gather and scatter of the
// state) must change nothing: bit-identical losses and master weights (grad_clip 0: the
// gradient norm, summed per bucket, is the only other difference), and a sharded checkpoint
// resumes sharded and unsharded with the uninterrupted run's next losses.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "moefold/comm/communicator.h"
#include "moefold/core/device.h"
#include "moefold/train/trainer.h"
#include "testing.h"
#include "train_fixture.h"

namespace moefold::testing {

inline std::vector<uint8_t> bytes_of(const Tensor& t) {
  std::vector<uint8_t> out(t.nbytes());
  device_copy(out.data(), Device::cpu, t.data(), t.device(), out.size());
  return out;
}

inline void expect_one_rank_sharding_changes_nothing(Device device, std::vector<std::string> extra) {
  TempDir dir("sharding_check");
  extra.push_back("train.grad_clip=0");
  Config off = small_train_config(make_train_data(dir.path()), extra), on = off;
  on.parallel.distributed_optimizer = true;
  const TokenDataset data = open_token_dataset(off.data.path);
  std::unique_ptr<Communicator> world = make_self_communicator();
  auto trainer = [&](const Config& c, Mesh& m) { return std::make_unique<Trainer>(c, data, m, device); };
  Mesh ma = Mesh::build(*world, off.resolve_layout(1)), mb = Mesh::build(*world, on.resolve_layout(1));
  std::unique_ptr<Trainer> a = trainer(off, ma), b = trainer(on, mb);
  ASSERT_TRUE(b->memory().sharded());
  a->init_fresh();
  b->init_fresh();
  for (int i = 0; i < 6; ++i) ASSERT_EQ(b->train_step().loss, a->train_step().loss) << "step " << i + 1;
  b->gather_master_weights();
  for (const Param& p : b->params()) {
    const Param* r = a->memory().find(p.name);
    ASSERT_NE(r, nullptr) << p.name;
    ASSERT_EQ(bytes_of(p.value), bytes_of(r->value)) << p.name;
    ASSERT_EQ(bytes_of(p.compute), bytes_of(r->compute)) << p.name;
  }
  const std::string ckpt = b->save((dir.path() / "ckpt").string());
  Mesh mc = Mesh::build(*world, on.resolve_layout(1)), md = Mesh::build(*world, off.resolve_layout(1));
  std::unique_ptr<Trainer> c = trainer(on, mc), d = trainer(off, md);
  c->load(ckpt);
  d->load(ckpt);
  // Two steps: the first step's loss shows the weights, the second's the moments too.
  for (int i = 0; i < 2; ++i) {
    const double want = a->train_step().loss;
    EXPECT_EQ(c->train_step().loss, want) << "resumed sharded, step " << i + 1;
    EXPECT_EQ(d->train_step().loss, want) << "resumed unsharded, step " << i + 1;
    EXPECT_EQ(b->train_step().loss, want) << "after the save, step " << i + 1;
  }
}

}  // namespace moefold::testing

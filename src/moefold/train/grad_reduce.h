// Data-parallel gradient reduction, overlapped with backward (Megatron-Core's
// overlap_grad_reduce). Each parameter group's gradients are one flat block (Memory::grad_block)
// reduced over the group's own ranks (dense over DP x CP x TP, tensor-parallel shards over
// DP x CP, experts over EDP). The block is cut into buckets by when their gradients become final
// in backward: the top (final norm, head, multi-token-prediction modules) first, then each
// decoder layer from the last, then the embedding when backward returns. In a step's last
// micro-batch each bucket starts (Communicator::start_all_reduce) as soon as its part of backward
// is queued, so its gradients travel on the communicators' streams while the layers below
// compute; finish() starts the embedding's and orders the compute stream behind all of them. The
// sums are those of one all-reduce per block (reduce_all, the path without overlap).
// With the distributed optimizer (Memory::shard_layout) the buckets are Memory's GradBuckets and
// each is reduce-scattered in place (every rank gets the sums of its slot: AdamW's shard), but
// full_master buckets, which are all-reduced.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "moefold/comm/communicator.h"
#include "moefold/core/memory.h"

namespace moefold {

// When backward finishes a parameter's gradient: N for decoder layer N ("model.layers.N.", N <
// num_layers); num_layers for the top, done before any layer (the final norm, the head, and the
// multi-token-prediction modules, named "model.layers.M." with M >= num_layers); -1 for the rest,
// done when backward returns (the embedding, and anything not named above).
int64_t grad_ready_point(const std::string& param_name, int64_t num_layers);

class GradReducer {
 public:
  // A group's gradients and the ranks that sum them (null or one rank: nothing to reduce).
  struct Group {
    ParamGroup group;
    Communicator* comm;
  };
  // Elements [begin, end) of a group's block, final at ready point `point` (grad_ready_point);
  // scatter: reduce-scattered (the distributed optimizer), else all-reduced.
  struct Bucket {
    int64_t point, begin, end;
    bool scatter = false;
  };
  // REQUIRES: mem allocated and bound (the gradients' places are final).
  GradReducer(const Memory& mem, int64_t num_layers, const std::vector<Group>& groups);

  // Starts the buckets of ready point `point` (Model::backward's grads_ready: num_layers for the
  // top, then each decoder layer from the last).
  void ready(int64_t point);
  // Starts the remaining buckets; the primary stream's later work waits for every bucket.
  void finish();
  // Without overlap: each group's block in one all-reduce (sharded: every bucket, then a wait).
  void reduce_all();

  // Every bucket of `group` (tests; empty when the group is not reduced).
  std::vector<Bucket> buckets(ParamGroup group) const;

 private:
  struct Plan {
    ParamGroup group;
    Communicator* comm;
    Tensor block;
    std::vector<Bucket> buckets;
  };
  void start(const Plan& p, const Bucket& b);
  std::vector<Plan> plans_;
  std::vector<std::pair<Communicator*, int64_t>> last_ticket_;  // per communicator, since the last finish()
};

}  // namespace moefold

// AdamW with decoupled weight decay (Loshchilov & Hutter, 2019) and fp32 (compute-dtype)
// state, global-norm gradient clipping, and the warmup + cosine learning-rate schedule.
// Weight decay is skipped for parameters registered with decay = false (norms, biases).
//
// Distributed optimizer (parallel.distributed_optimizer; Megatron-Core's
// --use-distributed-optimizer): with Memory::shard_layout, each GradBucket of a group is split in
// equal slots over the group's shard ranks (the ranks that reduce its gradients), and rank k
// keeps the f32 master weights and both moments of slot k only. Backward's buckets are
// reduce-scattered (GradReducer), each rank updates its slot (writing its compute copies there),
// and the compute copies are all-gathered. full_master buckets (the router) are all-reduced and
// updated whole on every rank, as without sharding. The updates are the same elementwise
// arithmetic either way, so a sharded run equals an unsharded one but for the order in which the
// gradient norm adds its squares.
//
// Optimizer offload (train.optimizer_offload_fraction f, sharded only, GPU): in each parameter
// group the last f of this rank's slot elements (full_master buckets never) keep their master
// weights and moments in pinned host memory. step() copies their gradients to the host on a copy
// stream in pieces (in their own dtype: bf16 with train.main_grads_dtype) while the GPU updates the rest, updates each
// piece as it lands (adamw_update_host: the kernel's arithmetic, bit for bit, on a pool of host threads) and copies its
// new compute copies back; the primary stream waits for those before the gathers.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "moefold/comm/communicator.h"
#include "moefold/core/device.h"
#include "moefold/core/host_threads.h"
#include "moefold/core/memory.h"
#include "moefold/model/config.h"
#include "moefold/ops/ops.h"

namespace moefold {

class AdamW {
 public:
  explicit AdamW(const TrainConfig& cfg) : cfg_(cfg) {}

  // The communicators each ParamGroup's state is split over (null: a group without parameters).
  using ShardGroups = std::array<Communicator*, kNumParamGroups>;

  // Reserves first and second moments for every parameter (zero-initialised).
  void bind(const ExecContext& ctx, const std::vector<Param>& params);
  // The same for `mem`'s parameters; with mem.sharded() the moments and master weights of this
  // rank's slots. REQUIRES: mem allocated and bound; with sharding, groups[g] has mem.shards(g)
  // ranks for every group with parameters, and they outlive the optimizer.
  void bind(const Memory& mem, const ShardGroups& groups);
  // Bytes bind(mem, ...) reserves with cfg's moment dtypes: exact, from the buckets of mem's last
  // binding pass (so the trainer can plan before allocating).
  static size_t state_bytes(const Memory& mem, const TrainConfig& cfg);
  size_t state_bytes() const { return arena_.capacity(); }
  // The offloaded part: pinned host bytes (master weights, moments, the gradient and compute-copy
  // staging), exact like state_bytes.
  static size_t host_state_bytes(const Memory& mem, const TrainConfig& cfg);
  size_t host_state_bytes() const { return host_arena_.capacity(); }

  // One update with learning rate `lr` from the gradients times grad_scale (clip_factor: global-
  // norm clipping in the same pass, the gradients themselves left as they are); increments
  // step(). Sharded: collective over the shard groups; the gathers of the updated compute copies
  // are started bucket by bucket in forward order (GradBucket::key: -1, 0, 1, ...), and with
  // overlap_gather the step returns without waiting for them (wait_weights does).
  void step(std::vector<Param>& params, double lr, double grad_scale = 1.0);
  // parallel.overlap_param_gather: leave the gathers to wait_weights (default: step waits).
  void set_overlap_gather(bool on) { overlap_gather_ = on; }
  // The context's stream waits for the pending gathers of every bucket with key <= point (the
  // model's weights_needed points), or of all of them. No-ops without pending gathers.
  void wait_weights(int64_t point);
  void wait_all_weights() { wait_weights(INT64_MAX); }

  // Sharded: the sum of squares of the gradients this rank updates (its slots; full_master
  // buckets on shard rank 0 only), so that summing over the shard group counts each element
  // once. REQUIRES: sharded, after the gradients were reduced.
  double owned_grad_squares(ParamGroup group) const;

  // The whole state as Param::value, exp_avg(i) and exp_avg_sq(i) show it (checkpoints). With f32
  // moments and no sharding all are no-ops but for scatter_state refreshing the compute copies.
  // Sharded or with bf16 moments: gather_state (collective) assembles the master weights in
  // Param::value and the moments, in f32, in host memory (through the gradients' storage: call
  // it after a step, never between backward and step); prepare_state gives exp_avg / exp_avg_sq
  // host tensors to load into; scatter_state takes every rank's part from them (the compute
  // copies from the values) and frees the host copies; release_state frees them.
  void gather_state();
  void prepare_state();
  void scatter_state();
  void release_state();

  int64_t num_steps() const { return steps_; }
  void set_num_steps(int64_t t) { steps_ = t; }
  // exp_avg / exp_avg_sq of parameter i (same order as bind's params), shaped like it; f32 host
  // tensors, sharded or with bf16 moments, between gather_state or prepare_state and
  // scatter_state or release_state.
  Tensor exp_avg(size_t i) const { return moment(i, 0); }
  Tensor exp_avg_sq(size_t i) const { return moment(i, 1); }

 private:
  // A contiguous run of one parameter's elements this rank updates: its master weight, moments,
  // gradient and compute copy (undefined: none to write), and where it lies in its group's
  // blocks (sharded). whole: the parameter's own tensors (no sharding, or a full_master bucket).
  struct Segment {
    size_t param = 0;
    ParamGroup group = ParamGroup::dense;
    int64_t begin = 0, end = 0;  // elements of the group's blocks (sharded)
    Tensor master, m, v, grad, compute;
    bool whole = true;
    // Offloaded (master, m, v in host memory): its gradient and compute copy pass through the host
    // staging at `staging` (elements).
    bool host = false;
    int64_t staging = 0;
    // In an FP8-only bucket (GradBucket::fp8): no compute copy; its FP8 codes (the code block's
    // slice) and its first element's flat index in the parameter; offloaded, `values`: where its
    // new bf16 values land on the device (step_host), which the codes are quantized from.
    Tensor code{};
    int64_t first = 0;
    Tensor values{};
  };
  // A piece of the offloaded elements: block elements [begin, begin + n) of `group`, staging
  // elements [staging, staging + n); the unit of the copies and of the host update's pipeline.
  struct Piece {
    size_t group = 0;
    int64_t begin = 0, staging = 0, n = 0;
    void* to = nullptr;  // where its new compute-dtype copies land on the device
  };
  // The offloaded segments' update (step).
  void step_host(const std::vector<Param>& params, const AdamWStep& base);
  // The batched updates of the small segments (bind's last part).
  void make_batches();
  // Group g's buckets' updated copies to every rank, in forward order: the FP8-only buckets' slots
  // quantized first (their blocks' amax, one max over the shard group, scales, codes), then every
  // bucket's gather started (pending_). fp8_only: those buckets only (scatter_state).
  void gather_copies(size_t g, bool fp8_only = false);
  // Each group's sharded buckets and its communicator.
  struct Group {
    Communicator* comm = nullptr;
    Tensor grad_block, compute_block;
    Tensor code_block, scale_block;  // FP8-only buckets' codes and scales (Memory::code_block)
    Tensor stage;                    // bf16 gradients: the f32 host staging of the masters (Memory::master_staging)
    // Where the exposed state passes (gather_state, scatter_state): the staging, else the gradients.
    const Tensor& exposure() const { return stage.defined() ? stage : grad_block; }
    std::vector<GradBucket> buckets;
    std::vector<size_t> gather_order;  // the buckets step() gathers, in forward order (by key)
    // Offload: the group's offloaded gradients on the host (the block's dtype), staging elements
    // [staging_base, staging_base + host_grad.numel()) of the compute copies' staging.
    Tensor host_grad;
    int64_t staging_base = 0;
  };
  Tensor moment(size_t i, int which) const;
  // `pick` of every segment (0 master, 1 m, 2 v) into the gradient blocks (converted to their
  // dtype), then, sharded, each bucket slot gathered there (Param::value shows the masters).
  void gather_into_grad_blocks(int pick);
  // src into dst (same numel and device), converting the dtype where they differ.
  void convert(const Tensor& src, const Tensor& dst) const;

  const ExecContext* ctx_ = nullptr;  // where the update runs (bind)
  TrainConfig cfg_;
  Arena arena_;
  std::vector<Segment> segments_;
  const std::vector<Param>* params_ = nullptr;  // the parameters bound (bind)
  bool sharded_ = false, mixed_ = false;
  DType m_dtype_ = DType::f32, v_dtype_ = DType::f32;  // the moments' dtypes (bind)
  bool exposed_ = false;  // checkpoints see the state through host copies (sharded, or bf16 moments)
  std::array<Group, kNumParamGroups> groups_;
  // Sharded, between gather_state / prepare_state and scatter_state / release_state: each
  // group's moments in host memory, laid out like its gradient block.
  std::array<std::vector<std::byte>, kNumParamGroups> host_m_, host_v_;  // f32 (or f64), a group's block each
  // A gradient block to its host copy and back (f32 on the host; a bf16 block widened / rounded).
  void block_to_host(const Tensor& block, std::vector<std::byte>& host) const;
  void host_to_block(const std::vector<std::byte>& host, const Tensor& block) const;
  std::vector<Tensor> exp_avg_, exp_avg_sq_;  // without sharding: by parameter
  std::vector<AdamWBatch> batches_;           // the small segments' updates (make_batches)
  std::vector<bool> batched_;                 // per segment: in one of batches_
  // Offload: the pinned host state and staging, its pieces and their fences, the copy stream and
  // the host threads.
  Arena host_arena_;
  Tensor host_compute_;
  std::vector<Piece> pieces_;
  std::vector<StreamFence> fences_;
  std::unique_ptr<ExecContext> copy_;
  std::unique_ptr<HostThreads> threads_;
  bool overlap_gather_ = false;
  // Sharded: each group's gathers not yet waited for, (bucket key, ticket) in the order started.
  std::array<std::vector<std::pair<int64_t, int64_t>>, kNumParamGroups> pending_;
  int64_t steps_ = 0;
};

// The global-norm clipping factor: min(1, max_norm / (norm + 1e-6)) when max_norm > 0, else 1.
double clip_factor(double norm, double max_norm);
// Scales every gradient by clip_factor(norm, max_norm); returns the factor.
double clip_grad_norm(const ExecContext& ctx, std::vector<Param>& params, double norm, double max_norm);

// Learning rate for optimizer step `step` (0-based): linear warmup to cfg.lr over
// cfg.warmup_steps, then cosine decay to cfg.min_lr at cfg.steps, constant min_lr after.
double learning_rate(const TrainConfig& cfg, int64_t step);

}  // namespace moefold

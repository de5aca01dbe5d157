// The [parallel] config section: how the ranks are laid out twice (parallel folding).
// Dense view (attention, embeddings, norms): world = PP x DP x CP x TP.
// MoE view (experts):                        world = PP x EDP x EP x ETP, EDP derived.
// validate() says which numbers do not divide what.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moefold {

struct ParallelConfig {
  int64_t tp = 1;   // tensor parallel (attention, dense layers)
  int64_t cp = 1;   // context parallel (sequence split for attention)
  int64_t dp = 0;   // data parallel; 0: world / (pp * tp * cp)
  int64_t ep = 1;   // expert parallel
  int64_t etp = 1;  // expert tensor parallel
  int64_t pp = 1;   // pipeline parallel: stages of consecutive decoder layers (outermost)
  // Pipeline stages (pp > 1): the first and the last stage's decoder layers (Megatron-Core's
  // --decoder-first/last-pipeline-num-layers; 0: an even share), the rest split evenly over the
  // other stages; the schedule ("1f1b"), and virtual stages per rank (1: not interleaved).
  int64_t first_stage_layers = 0, last_stage_layers = 0;
  std::string pipeline_schedule = "1f1b";
  int64_t vpp = 1;
  // The forward of one micro-batch and the backward of another interleaved layer by layer, split
  // where the expert-parallel rows travel, so each one's dispatch and combine run beside the other's
  // computation (Megatron-Core's 1F1B all-to-all overlap); with pp = 1 too (two micro-batches in flight).
  bool overlap_moe_a2a = false;
  double timeout_s = 300;  // longest wait for another rank in one communication call
  // Data-parallel gradient reduction overlapped with backward (each layer's gradients start their
  // all-reduce as its backward ends, in the step's last micro-batch); false: one all-reduce per
  // parameter group after backward.
  bool overlap_grad_reduce = true;
  // Distributed optimizer (train/optimizer.h): the f32 master weights and AdamW moments sharded
  // over the ranks that reduce each gradient (dense over DP x CP x TP, TP shards over DP x CP,
  // experts over EDP), gradients reduce-scattered, updated compute weights all-gathered.
  bool distributed_optimizer = false;
  // With it, each layer's gathered weights are waited for just before the next forward reaches
  // the layer (the gathers run beside the layers before it); false: at the end of the step.
  bool overlap_param_gather = true;
  // Expert-parallel token exchange (moe/ep_transport.h): "ipc" (direct copies into the peers' GPU
  // memory, where the EP group shares a host and can map it; on CPU ranks the same copies as MPI
  // messages), "nccl" (the communicator's send/recv), or "auto" (ipc where GPUs can map).
  std::string ep_transport = "auto";
  // Ranks per node (0: the ranks that share a host name form a node). A smaller number splits each
  // host into emulated nodes of that many ranks (consecutive world ranks): expert traffic between
  // them then takes the inter-node path (NCCL / MPI, never peer copies), as between real hosts.
  int64_t ranks_per_node = 0;

  // Static checks (positive sizes, a known schedule and ep_transport); world-dependent checks are in
  // resolve().
  void validate() const;
  // dp filled in for `world` ranks, and every layout constraint checked (Error naming the
  // numbers that do not divide): pp*dp*cp*tp == world; ep*etp divides dp*cp*tp.
  ParallelConfig resolve(int64_t world) const;
  int64_t world() const { return pp * dp * cp * tp; }
  // Decoder layers of each stage (pp entries, each >= 1; with vpp > 1 each virtual stage's, pp x vpp
  // entries, virtual stage c * pp + s being chunk c of stage s), or one line naming the keys whose
  // numbers do not split `layers` (model.num_hidden_layers).
  std::vector<int64_t> stage_layers(int64_t layers) const;
  int64_t edp() const { return dp * cp * tp / (ep * etp); }
};

}  // namespace moefold

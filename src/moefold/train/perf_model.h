// The performance model behind `moefold plan --perf`: one training step's time and model TFLOP/s per
// GPU for a config, a layout and a cluster, from the ops the trainer runs (the FLOPs of
// model/model_flops.h, the bytes its memory-bound ops and collectives move) and rates measured with
// moefold on an H200 (docs/benchmarks.md; the table and its sources are in perf_model.cpp). No GPU
// is needed. Its assumptions, and how it compares with measured and published runs: docs/scaling.md.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moefold/model/config.h"

namespace moefold {

// One GPU kind's sustained rates (TFLOP/s, GB/s), as moefold's kernels reach them.
struct GpuRates {
  std::string name;
  double dense_tflops = 0;        // bf16 dense linears (cuBLASLt)
  double grouped_tflops = 0;      // bf16 grouped expert GEMMs (CUTLASS), forward and backward alike
  double fp8_dense_tflops = 0;    // blockwise FP8 dense linears (cuBLASLt block scaling)
  double fp8_grouped_tflops = 0;  // blockwise FP8 grouped expert GEMMs
  double attn_fwd_tflops = 0;     // cuDNN causal attention, heads of 128, forward
  double attn_bwd_tflops = 0;     // its deterministic backward
  double attn_bwd_nondet_tflops = 0;
  double mla_fwd_tflops = 0;  // MLA's core (q/k width 192, v padded to it), forward
  double mla_bwd_tflops = 0;  // deterministic backward
  double mla_bwd_nondet_tflops = 0;
  double hbm_gbps = 0;                // a copy's bandwidth (reads + writes)
  double cross_entropy_per_s = 0;     // (token, vocabulary entry) pairs per second, forward + backward
  double fp8_quant_per_s = 0;         // activation elements quantized to 1 x 128 FP8 tiles per second
  double fp8_weight_quant_per_s = 0;  // weight elements quantized (blocks and transpose) per second
  double memory_gib = 0;              // what one GPU can allocate
};

// A cluster of identical nodes. Bandwidths are per GPU and per direction.
struct Cluster {
  GpuRates gpu;
  int64_t gpus_per_node = 8;
  double nvlink_gbps = 0;     // within a node (NVLink)
  double internode_gbps = 0;  // between nodes (each GPU's own NIC)
};

// The command line's cluster flags as given (empty: the kind's value).
struct ClusterOptions {
  std::string kind = "h200";   // --cluster: h200 or h100
  std::string gpus_per_node;   // --gpus-per-node
  std::string nvlink_gbps;     // --nvlink-gbps
  std::string internode_gbps;  // --internode-gbps
};
// The built-in kind with the overrides applied. A bad value: Error, one line naming the flag.
Cluster make_cluster(const ClusterOptions& o);
std::vector<std::string> cluster_kinds();

// One line of the breakdown: milliseconds per step on the slowest pipeline stage's rank.
struct PerfItem {
  std::string name;
  double ms = 0;          // the work's whole time (for communication: if nothing hid it)
  double exposed_ms = 0;  // the part the step waits for
  std::string overlap;    // how it overlaps ("" for compute)
};

struct PerfPrediction {
  ParallelConfig layout;      // resolved
  int64_t micro_batches = 0;  // per step and data-parallel rank
  int64_t slowest_stage = 0;
  // One micro-batch, forward + backward (+ recompute), on one rank: a MoE layer, a dense layer
  // (0 when the model has none), the LM head with the cross-entropy and MTP.
  double moe_layer_ms = 0, dense_layer_ms = 0, head_ms = 0;
  std::vector<PerfItem> compute;        // per step, slowest stage
  std::vector<PerfItem> communication;  // per step, slowest stage
  double bubble_ms = 0;                 // pipeline warm-up and cool-down
  double step_ms = 0;
  double tokens_per_s = 0;
  double tflops_per_gpu = 0;  // model FLOPs (model_size) / step time / GPUs
};

// The model of one training step of cfg on `world` GPUs of `cluster`. REQUIRES: cfg validated;
// Config::resolve_layout(world) accepts the layout (else its Error).
PerfPrediction predict_step(const Config& cfg, int64_t world, const Cluster& cluster);

// One MoE layer's forward + backward on one GPU (bench moe-layer: router, dispatch, experts,
// combine, shared experts; balanced routing, the expert gradients written): milliseconds.
double predict_moe_layer_ms(const Config& cfg, int64_t tokens, const Cluster& cluster);

// Under uniform routing (each token's K experts a uniform K-subset of E, the E experts split evenly
// over `nodes` nodes, the token's own node one of them): the expected number of other nodes that
// hold at least one of its experts, sum over those nodes of 1 - P(none of its experts there). With
// a hierarchical dispatcher a token crosses to each of them once. REQUIRES: E divisible by nodes.
double expected_remote_nodes(int64_t experts, int64_t k, int64_t nodes);

// The pipeline bubble as a fraction of the ideal step (pp - 1) / (m * vpp): (1F1B and Megatron-Core's
// interleaved schedule, train/pipeline_schedule.h) with m micro-batches per step.
double bubble_fraction(int64_t pp, int64_t vpp, int64_t micro_batches);

// Layouts (and the dispatcher) for `world` GPUs, best predicted TFLOP/s first, each with its peak memory per rank
// (train/memory_plan.h), and only those that fit the cluster's GPU memory: at most `top`.
struct LayoutCandidate {
  ParallelConfig layout;
  int64_t micro_batch_size = 1;
  std::string dispatcher;  // moe.dispatcher: hierarchical tried where the EP group spans nodes
  PerfPrediction prediction;
  double peak_gib = 0;
};
struct SearchStats {
  int64_t layouts = 0;    // valid layouts the model timed
  int64_t planned = 0;    // of them, memory-planned (best first, until `top` fitted)
  int64_t too_large = 0;  // of those, not fitting
};
std::vector<LayoutCandidate> search_layouts(const Config& cfg, int64_t world, const Cluster& cluster, int top,
                                            SearchStats* stats = nullptr);

}  // namespace moefold

// The training loop of one rank: micro-batch gradient accumulation, data-parallel gradient
// reduction (dense over DP x CP, experts over EDP), global-norm clipping, AdamW, warmup + cosine
// schedule, held-out evaluation, checkpoints and resume. train_step() does not allocate: every
// buffer is planned when the Trainer is built.
//
// Layout invariance: micro-batch j of a step (j = i * dp + dp_rank for local micro-step i) is
// global samples [position + j * micro, +micro), so every layout sees the same micro-batches,
// and losses are sums over the global batch divided once.
//
// Pipeline parallelism (parallel.pp > 1): each rank runs its stage's layers (PipelineStage) in
// the 1F1B schedule, or with parallel.vpp > 1 the interleaved one over vpp model chunks per rank
// (train/pipeline_schedule.h), moving the residual stream and its gradient between the stages with
// non-blocking messages on the pipeline's link communicators (Mesh::activations_out, ...: posted one
// action ahead, waited for where needed, so transfers overlap the computation). A chunk keeps the
// activations of the micro-batches it has in flight (1F1B: up to pp - stage): one Model each, bound
// through one Memory (the first registers the parameters, the others share them:
// Memory::SharedParams). With parallel.overlap_moe_a2a each steady forward runs interleaved with the
// backward after it (Model::forward_backward), pp = 1 included (two micro-batches in flight).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "moefold/core/memory.h"
#include "moefold/data/loader.h"
#include "moefold/data/token_dataset.h"
#include "moefold/model/config.h"
#include "moefold/model/model.h"
#include "moefold/parallel/mesh.h"
#include "moefold/train/checkpoint.h"
#include "moefold/train/grad_reduce.h"
#include "moefold/train/optimizer.h"
#include "moefold/train/pipeline_schedule.h"

namespace moefold {

struct StepMetrics {
  int64_t step = 0;     // optimizer steps completed after this one
  double loss = 0;      // lm_loss + aux_loss + z_loss + mtp_loss
  double lm_loss = 0;   // mean next-token cross-entropy over the global batch
  double aux_loss = 0;  // load-balancing losses (Switch + sequence-level, times their coefficients), summed over layers
  double z_loss = 0;    // router z-loss (times its coefficient), summed over layers
  double mtp_loss = 0;  // multi-token prediction: scaling factor x mean over depths of each depth's mean loss
  double grad_norm = 0;  // before clipping
  // The loss or the gradient norm was not finite and train.on_nonfinite = "skip": no update.
  bool skipped = false;
  double lr = 0;
  double seconds = 0;                    // wall time of the step
  int64_t tokens = 0;                    // tokens in the global batch
  std::vector<double> expert_load_max;   // per MoE layer: most tokens on one expert / step
  std::vector<double> expert_load_mean;  // per MoE layer: mean tokens per expert / step
  // Per MoE layer, over its experts' step loads as multiples of the mean: the 50th, 90th and 99th
  // percentiles (nearest rank) and the maximum.
  std::vector<double> expert_load_p50, expert_load_p90, expert_load_p99, expert_load_max_over_mean;
  std::vector<double> expert_load_min;  // per MoE layer: fewest tokens on one expert / step
  // Per MoE layer: the share of the step's token-to-expert assignments dropped by the capacity
  // (moe.capacity_factor; 0 when dropless).
  std::vector<double> expert_load_dropped_fraction;
  // Bytes every rank's expert dispatch sent to other nodes in the step (moe.dispatcher =
  // "hierarchical"; 0 for the others, which do not count them).
  double inter_node_bytes = 0;
  // moe.dispatcher = "slots" with EP: the largest share of a fixed exchange buffer (one peer's slot,
  // or the experts' rows) that a dispatch of the step asked for, over every rank (0 otherwise). Above
  // 1 rows did not fit and the step fails; how far below 1 says how much moe.ep_recv_factor could fall.
  double ep_slot_fill = 0;
};

// What the trainer binds beside the models: each in-flight micro-batch's ids and targets (whole
// sequences on the host, this rank's positions on the device), expert loads and step statistics.
struct StepBuffers {
  Tensor full_ids_BS, full_targets_BS;       // whole sequences (targets already shifted)
  std::vector<Mirrored> ids_BL, targets_BL;  // per model: this rank's positions (all of them without CP)
  Mirrored counts_E;                         // i64 [experts]: a layer's step load (expert-bias update)
  // f64: stats, then step_sums. The device side gathers what the forwards leave on the device (the
  // router losses, expert loads and drops, and with train.cuda_graphs = "step" the loss sum); it
  // comes to the host once per step.
  Mirrored sums;
  // Host views of `sums`:
  Tensor stats;        // f64 [4]: loss sum, aux, z, mtp (reduced together)
  Tensor step_sums;    // f64: load_sum_LE's, dropped_L's and inter_node_bytes' storage: one reduction sums them
  Tensor load_sum_LE;  // f64 [MoE layers of the whole model, experts]: tokens per expert over a step's micro-batches
  Tensor dropped_L;    // f64 [MoE layers]: assignments dropped by the capacity over a step's micro-batches
  Tensor inter_node_bytes;  // f64 [1]: bytes the step's dispatches sent between nodes
  Tensor overflow_rows;     // f64 [1]: rows the step's dispatches could not place (Dispatcher::set_overflow_sinks)
  Tensor slot_fill;         // f64 [1] after step_sums (a maximum, not summed): StepMetrics::ep_slot_fill
  // Device views of `sums` (made once: the step loop allocates nothing): the loss sum, the router
  // losses (aux, z), the multi-token prediction loss, and per MoE layer its load row and its
  // dropped count.
  Tensor dev_loss_1, dev_router_2, dev_mtp_1;
  std::vector<Tensor> dev_load_E, dev_dropped_1;
  Tensor dev_overflow_1;  // every MoE layer's dispatcher adds its overflow here
  Tensor dev_fill_1;      // and max-es its fill here
  void bind(Memory& mem, const Config& cfg, const Model& model, size_t models);
};

// The MoE layers of the whole model (multi-token-prediction depths included) before decoder layer
// `layer` (model.num_hidden_layers: all of them but the MTP depths').
int64_t moe_layers_before(const ModelConfig& m, int64_t layer);
int64_t moe_layers_total(const ModelConfig& m);
// This rank's model chunks (one; parallel.vpp with interleaving: chunk c is virtual stage
// c * pp + pp_rank) and how many micro-batches each keeps in flight (1 without pipeline parallelism
// and without parallel.overlap_moe_a2a).
std::vector<PipelineStage> pipeline_chunks(const Config& cfg, const Mesh& mesh);
std::vector<int64_t> micro_batches_in_flight(const Config& cfg, const Mesh& mesh);
// A rank's models: per chunk, one per micro-batch in flight (micro_batches_in_flight), chunk by chunk.
std::vector<std::unique_ptr<Model>> make_models(const Config& cfg, Mesh& mesh);

// The memory options on a Memory before its first bind: train.main_grads_dtype, and one clear line
// for the options this device cannot take (offload and bf16 gradients need the CUDA device).
void apply_memory_options(Memory& mem, const TrainConfig& train);

// A training rank's whole binding pass (the trainer's, and moefold plan's measuring one): the first
// model of each chunk registers the chunk's parameters, the others share them.
void bind_training(Memory& mem, std::vector<std::unique_ptr<Model>>& models, const Config& cfg, StepBuffers& buffers);
// The dispatchers of the model's MoE layers on `mesh` (empty: local experts). Keeps references.
DispatcherFactory dispatchers_for(const Config& cfg, Mesh& mesh);
// train.cuda_graphs ("layers" or "step") on `device` under `mesh`: what prevents capture (empty: nothing).
std::string cuda_graphs_refusal(const Config& cfg, const Mesh& mesh, Device device);
// The distributed optimizer's layout: each group sharded over the ranks that reduce it.
ShardLayout shard_layout_for(const Mesh& mesh, const Model& model);

class Trainer {
 public:
  // REQUIRES: cfg validated; `data` and `mesh` outlive the trainer; data fits the vocabulary.
  // device cuda: the model in bf16 mixed precision on this process's GPU; the mesh's groups are
  // then NCCL communicators (make_nccl_world).
  // compute: the dtype of activations and compute weights; default f32 on the CPU, bf16 (mixed
  // precision) on the GPU. f32 on the GPU gives fp32 training there (exact layout comparisons).
  Trainer(const Config& cfg, const TokenDataset& data, Mesh& mesh, Device device = Device::cpu,
          std::optional<DType> compute = std::nullopt);

  // Fresh parameters from cfg.train.seed, or the state of checkpoint directory `ckpt`.
  void init_fresh();
  void load(const std::string& ckpt);
  // Collective (the distributed optimizer gathers its shards first): checkpoint step() through
  // `writer` (async: copied on return, written in the background), or synchronously into
  // `checkpoints_dir`. Returns its directory.
  std::string save(CheckpointWriter& writer);
  std::string save(const std::string& checkpoints_dir);
  // With parallel.distributed_optimizer: the whole master weights into Param::value (collective;
  // they stay there until the next step's zero_grads). Without it a no-op.
  void gather_master_weights();

  // Forward and backward over the global batch with the gradients reduced over the data-parallel
  // groups (not clipped); fills the loss, norm and load fields of metrics(). Does not step.
  void accumulate_gradients();
  // One optimizer step over global_batch_size sequences; fills and returns metrics().
  const StepMetrics& train_step();
  // Mean next-token loss over up to train.eval_batches held-out micro-batches (0 when none).
  double evaluate();

  // Bytes reserved before step 0: parameters, gradients, activations, the optimizer's state.
  size_t planned_bytes() const { return planned_bytes_; }
  // train.cuda_graphs: why the layers are not (or no longer) replayed as graphs; empty when they
  // are, or when graphs are off.
  std::string cuda_graphs_note() const;
  // Graphs replayed so far (layers and micro-batches).
  int64_t cuda_graph_replays() const;
  size_t optimizer_bytes() const { return opt_.state_bytes(); }
  int64_t step() const { return step_; }
  const StepMetrics& metrics() const { return metrics_; }
  // f64 [MoE layers of the whole model, experts]: the last step's tokens per expert, summed over its
  // micro-batches and every rank (what the expert-bias update and metrics' expert_load_* read).
  const Tensor& expert_loads() const { return buf_.load_sum_LE; }
  Memory& memory() { return mem_; }
  const ExecContext& exec() const { return exec_; }
  const Model& model() const { return *models_.front(); }
  std::vector<Param>& params() { return mem_.params(); }
  int64_t num_valid_batches() const { return loader_.num_valid_batches(); }
  // The slot dispatcher's exchange (the one that can overflow): moe.dispatcher = "slots" with EP.
  bool slot_exchange() const { return cfg_.moe.dispatcher == "slots" && mesh_.dims.ep > 1; }

 private:
  // Sum over the dense data-parallel group (DP x CP) in place.
  void reduce_dense(const Tensor& t);
  // Fails naming the dispatcher's bound when `rows` (summed over every rank) is not 0; `fill`:
  // what the routing asked of the bounds (StepMetrics::ep_slot_fill).
  void fail_on_overflow(double rows, double fill, const std::string& where) const;
  // train.on_nonfinite = "stop": throws naming the step, the loss and norm, and this rank's first
  // parameter (registration order) whose gradient is not finite.
  [[noreturn]] void fail_nonfinite() const;
  // The gradient groups and the ranks that sum each (see GradReducer).
  std::vector<GradReducer::Group> grad_groups() const;
  // The same communicators by ParamGroup: the distributed optimizer's shard groups.
  AdamW::ShardGroups shard_groups() const;
  int64_t local_micro_batches() const;
  // Model `slot`'s ids and targets = this context-parallel rank's positions of the full batch.
  void shard_batch(size_t slot);
  // Local micro-batch i (0-based) of the step into model `slot`'s buffers.
  void load_micro_batch(int64_t position, int64_t i, size_t slot);
  // Local micro-batch i's forward on model `slot` (its statistics and expert loads added), and
  // its backward (the last one starts the overlapped gradient reduction).
  void forward_micro_batch(int64_t i, size_t slot);
  // A forward's loss sum, router losses and expert loads into the step's statistics (`loss`
  // unless the model leaves it on the device).
  void add_forward_results(size_t slot, double loss);
  // train.cuda_graphs = "step": the step's micro-batches, each one graph (forward, statistics,
  // backward) replayed on model 0.
  void run_micro_batch_graphs(int64_t position);
  // Bytes every MoE layer of every model sent to other nodes since the last call (counts restart).
  int64_t take_inter_node_bytes();
  void backward_micro_batch(int64_t i, size_t slot);
  // This stage's schedule over the step's local micro-batches (pipeline parallelism, or the
  // all-to-all overlap).
  void run_pipeline(int64_t position);
  // Model `k` of chunk `chunk` (its index in models_).
  size_t model_index(int64_t chunk, int64_t k) const {
    return chunk_base_[static_cast<size_t>(chunk)] + static_cast<size_t>(k);
  }
  // The embedding's gradient summed over its copies (the first and last stage, with multi-token
  // prediction under pipeline parallelism); the norm counts it once.
  void reduce_embedding_copies();
  // With CUDA graphs and train.fp8: every FP8 weight copy quantized before the step's (the
  // evaluation's) forwards, outside the graphs, since a replayed forward cannot decide to.
  void quantize_fp8_weights_before_graphs();

  Config cfg_;
  Mesh& mesh_;
  std::vector<std::unique_ptr<Model>> models_;  // per chunk, one per micro-batch in flight (make_models)
  Model& model_;                                // the first
  std::vector<size_t> chunk_base_;              // each chunk's first model in models_
  std::vector<PipelineOp> pipeline_ops_;        // run_pipeline's ops (pipeline_ops), the same every step
  struct Tickets {                              // a model's messages under way (run_pipeline)
    int64_t recv_act = -1, recv_grad = -1, send_act = -1, send_grad = -1;
  };
  std::vector<Tickets> tickets_;
  ExecContext exec_;  // where every op of the run goes: the device, its stream, the [kernels] choices
  Memory mem_;
  AdamW opt_;
  std::optional<GradReducer> grads_reducer_;  // built once the gradients have their places
  Loader loader_;
  StepBuffers buf_;
  AdamW::ShardGroups shard_groups_{};  // shard_groups(), taken once
  StepMetrics metrics_;
  std::vector<double> sorted_loads_;  // one layer's expert loads, sorted for the percentiles (sized once)
  int64_t step_ = 0;
  size_t planned_bytes_ = 0;
  std::string graphs_refusal_;                   // cuda_graphs_refusal of this run
  LayerGraphs step_graphs_;                      // train.cuda_graphs = "step"
  double host_loss_sum_ = 0, host_mtp_sum_ = 0;  // the step's loss sums that came back to the host
};

}  // namespace moefold

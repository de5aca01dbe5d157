// The decoder-only MoE model of every supported family (config.h): embedding; N x [RMSNorm ->
// attention (GQA or MLA) -> residual -> RMSNorm -> MoE (+ shared experts) or dense MLP ->
// residual]; final RMSNorm; untied LM head; softmax cross-entropy.
// forward() keeps every activation backward needs (one micro-batch); backward() accumulates
// parameter gradients. The model knows nothing of parallelism: it comes in from outside.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "moefold/core/memory.h"
#include "moefold/model/attention.h"
#include "moefold/model/config.h"
#include "moefold/model/layer_graphs.h"
#include "moefold/model/mlp.h"
#include "moefold/moe/moe_layer.h"
#include "moefold/parallel/vocab_parallel.h"

namespace moefold {

// Makes the dispatcher of MoE layer `layer` (expert parallelism comes in from outside); an empty function or a null
// result means the local dispatcher.
using DispatcherFactory = std::function<std::unique_ptr<Dispatcher>(int64_t layer)>;

// A pipeline stage's part of the model (pipeline parallelism): decoder layers [first_layer,
// first_layer + num_layers) (num_layers < 0: every layer); the first stage embeds the tokens, the
// last one holds the final norm, the LM head, the loss and the multi-token-prediction depths (and,
// with those, a copy of the embedding: Param::pipeline_copy). Other stages take their input from
// input() and leave their output in output() (the caller moves them between the stages).
struct PipelineStage {
  int64_t first_layer = 0, num_layers = -1;
  bool first = true, last = true;
};

// What the model is handed from outside about parallelism.
struct ModelParallel {
  DispatcherFactory dispatchers;   // expert parallelism (empty: local experts)
  Communicator* cp = nullptr;      // context-parallel group (null or size 1: whole sequences)
  Communicator* tp = nullptr;      // tensor-parallel group, with sequence parallelism
  Communicator* tokens = nullptr;  // the ranks splitting a micro-batch's tokens (TP x CP)
  PipelineStage stage;             // the whole model by default
  // parallel.overlap_moe_a2a: the layers run in phases (DecoderLayer::set_phased) so that
  // forward_backward can interleave two micro-batches.
  bool phased = false;
};

class DecoderLayer {
 public:
  // seq_len: tokens per sequence here (S/c); rows: tokens of the residual stream here (B*S/c/tp);
  // tp: tensor-parallel size. A dense layer (ModelConfig::is_dense_layer) ignores `dispatcher`.
  // `recompute`: the modules recomputed before their backward (its selective part).
  DecoderLayer(const ModelConfig& m, const MoeConfig& e, int64_t batch, int64_t seq_len, int64_t rows, int64_t tp,
               int64_t index, std::unique_ptr<Dispatcher> dispatcher, const Recompute& recompute = {},
               const Offload& offload = {});
  // Which of its linear layers run in FP8 (Fp8Linears, config.h). REQUIRES: before bind.
  void set_fp8(const Fp8Linears& fp8) { fp8_ = fp8; }
  // moe.shared_expert_overlap: the context its shared experts run on, beside the routed experts on
  // the layer's own (null: the layer's own, after them). Ignored by a layer without shared experts.
  // REQUIRES: before bind; the layer without tensor parallelism.
  void set_shared_context(const ExecContext* ctx) { shared_ctx_ = ctx; }
  // REQUIRES: between mem.begin_layer() and mem.end_layer(). whole: the caller recomputes the whole
  // layer before its backward (Memory::begin_layer with a recompute slot): no module recomputes
  // itself then.
  void bind(Memory& mem, const Tensor& cos_SD, const Tensor& sin_SD, AttentionScratch* scratch,
            ContextParallelAttention* cp, Communicator* tp, const Tensor& dn_TH, bool whole = false);
  // x_TH -> out_TH (written); x_TH must stay unchanged until backward.
  void forward(const Tensor& x_TH, const Tensor& out_TH);
  // Its forward was replayed from a CUDA graph: the host state forward leaves beside the device's
  // (the router's losses, to be read again).
  void forward_replayed() {
    if (moe_) moe_->forward_replayed();
  }
  // On entry dres_TH = d(out); on exit d(x). moe_loss_scale weights the router losses.
  void backward(const Tensor& dres_TH, double moe_loss_scale);
  // forward and backward in the MoE layer's three phases (MoeLayer): begin (through the dispatch /
  // the combine's backward), experts, end; a dense layer does all in forward_begin / backward_end.
  // Between two phases another micro-batch's layer may run (parallel.overlap_moe_a2a: set_phased
  // before bind; the layer then keeps its backward rows in Memory::exchange_scratch).
  void forward_begin(const Tensor& x_TH, const Tensor& out_TH);
  void forward_experts();
  void forward_end(const Tensor& out_TH);
  void backward_begin(const Tensor& dres_TH);
  void backward_experts();
  void backward_end(const Tensor& dres_TH, double moe_loss_scale);
  void set_phased(bool on) {
    if (moe_) moe_->set_phased(on);
  }
  // Null for a dense layer.
  const MoeLayer* moe() const { return moe_.get(); }
  MoeLayer* moe() { return moe_.get(); }

 private:
  const ExecContext* ctx_ = nullptr;         // where its ops run: the Memory's it was bound through
  const ExecContext* shared_ctx_ = nullptr;  // set_shared_context
  const ExecContext* side_ = nullptr;        // where the shared experts run now, when not on ctx_
  ModelConfig cfg_;
  int64_t rows_;
  std::string prefix_;
  Recompute recompute_;       // as configured
  Offload offload_;           // the modules whose kept input goes to the layer's offload slot
  Fp8Linears fp8_;            // its linear layers in FP8
  bool norms_again_ = false;  // this binding recomputes the two RMSNorms' outputs (layernorm)
  std::unique_ptr<SelfAttention> attn_;
  std::unique_ptr<MoeLayer> moe_;  // MoE layers
  std::unique_ptr<DenseMlp> mlp_;  // the dense layer's MLP, or the MoE layer's shared experts
  Tensor norm1_, norm2_, dnorm1_, dnorm2_;
  Tensor dn_TH_;  // shared backward workspace
  Tensor x_TH_, n1_TH_, rstd1_T_, h_TH_, n2_TH_, rstd2_T_;
  Tensor a_TH_, m_TH_, s_TH_, ds_TH_;  // scratch: forward temporaries, backward workspace
  // forward's norms, attention and residual (a dense layer's MLP too); after the MoE output: its
  // residual and the shared experts. backward's norms recomputed (layernorm); after the MoE
  // backward: the shared experts (or the dense MLP), norms and attention.
  // With the shared experts on side_: *_start queues their forward (backward) there once their
  // input is ready on ctx_, and the tail makes ctx_ wait for it before adding their result.
  void forward_attention(const Tensor& x_TH, const Tensor& out_TH);
  void shared_forward_start();
  void forward_tail(const Tensor& out_TH);
  void recompute_norms();
  void shared_backward_start(const Tensor& dres_TH);
  void backward_tail(const Tensor& dres_TH);
};

// One multi-token-prediction depth k (DeepSeek-V3, sec. 2.2; Megatron-Core's MTP layer): from
// the previous depth's hidden states h (the main model's pre-norm output for k = 1) and the
// embeddings of the tokens k ahead, h' = eh_proj([enorm(emb(rows_{i+k})); hnorm(h_i)]), a decoder
// layer, shared_head.norm and the model's LM head predict rows_{i+k+1}; the last k positions of each
// sequence have no target (ignored). Parameters "model.layers.{L+k-1}.*" as in DeepSeek-V3's
// checkpoints; the embedding and the head are the main model's (shared, as in training).
class MtpDepth {
 public:
  MtpDepth(const ModelConfig& m, const MoeConfig& e, int64_t batch, int64_t seq_len, int64_t rows, int64_t tokens,
           int64_t tp, int64_t depth, std::unique_ptr<Dispatcher> dispatcher);
  DecoderLayer& layer() { return *layer_; }
  int64_t depth() const { return depth_; }

 private:
  friend class Model;
  ModelConfig cfg_;
  int64_t batch_, seq_len_, rows_, tokens_, depth_;
  std::string prefix_;
  std::unique_ptr<DecoderLayer> layer_;
  Tensor enorm_, hnorm_, eh_proj_, head_norm_, denorm_, dhnorm_, deh_proj_, dhead_norm_;
  Fp8Param fp8_eh_proj_;  // eh_proj's FP8 copy (Fp8Linears::mtp)
  Tensor ids_, targets_;  // i32 [n]: ids and targets k positions ahead (kIgnoreTarget past the end)
  Tensor emb_TH_, en_TH_, en_rstd_, hn_TH_, hn_rstd_, cat_T2H_, hp_TH_, out_TH_, nf_TH_, nf_rstd_;
  Tensor logits_NV_, lse_N_;
  Tensor loss_1_;                 // f64 [1]: its token-loss sum, when the model keeps the losses on the device
  Tensor nf_full_NH_;             // tensor parallelism: every TP rank's rows of nf (saved for backward)
  Tensor dcat_T2H_, dprev_TH_;    // backward: d[en; hn], d(previous depth's h) from this depth
  const Tensor* prev_ = nullptr;  // the previous depth's h (forward)
  double loss_sum_ = 0;
};

class Model {
 public:
  // REQUIRES: valid configs (Config::validate). seq_len is the whole sequence; under context
  // parallelism this rank holds local_seq_len() = seq_len / cp of its tokens.
  // recompute: what backward recomputes instead of keeping (TrainConfig::recompute()); the
  // multi-token-prediction layers are never recomputed whole.
  Model(const ModelConfig& m, const MoeConfig& e, int64_t micro_batch, int64_t seq_len,
        const ModelParallel& parallel = {}, const Recompute& recompute = {}, const Offload& offload = {},
        const Fp8Linears& fp8 = {});

  void bind(Memory& mem);
  // Fills every parameter from its init rule (GPU parameters drawn on `ctx`): element i of parameter p gets
  // normal(seed, stream = hash(p.name), i) * init_std (or ones / zeros).
  static void init_params(const ExecContext& ctx, std::vector<Param>& params, uint64_t seed);

  // One micro-batch: ids/targets are i32 [B, local_seq_len()] (this rank's positions under
  // context parallelism). Returns the SUM of the local token losses. weights_needed, when given,
  // is called before the parameters of a part are first read, with the part's point (the
  // grad_ready_point of its parameters): -1 before the embedding, l before decoder layer l,
  // num_layers() before the final norm, the head and the multi-token-prediction modules (the
  // distributed optimizer's gathers of the updated weights wait there).
  double forward(const Tensor& ids_BS, const Tensor& targets_BS,
                 const std::function<void(int64_t point)>& weights_needed = nullptr);
  // lm_grad_scale multiplies d(sum of token losses); moe_loss_scale multiplies the router losses
  // of this micro-batch (1 / micro-batches per step). Multi-token prediction: depth k's token
  // losses get lm_grad_scale * mtp_loss_scaling_factor / depth * S / (S - k).
  // grads_ready, when given, is called as parts of backward are queued, with the gradients of
  // their parameters then final for this micro-batch: grads_ready(num_layers()) after the head,
  // the final norm and the multi-token-prediction modules, then grads_ready(l) after decoder
  // layer l (last layer first); the embedding's are final when backward returns.
  void backward(double lm_grad_scale, double moe_loss_scale,
                const std::function<void(int64_t point)>& grads_ready = nullptr);
  // parallel.overlap_moe_a2a: `fwd`'s forward of one micro-batch and `bwd`'s backward of another
  // (two models of one stage, phased), layer by layer in opposite directions, each layer in its
  // phases so that each one's expert-parallel rows travel while the other computes: per pair of
  // layers, bwd's combine backward, fwd's attention and dispatch, bwd's experts, fwd's experts,
  // bwd's dispatch backward and attention, fwd's combine. Every number is the one forward and
  // backward give; returns fwd's loss sum. No weights_needed or grads_ready points (neither the
  // step's first forward nor its last backward is paired).
  static double forward_backward(Model& fwd, const Tensor& ids_BS, const Tensor& targets_BS, Model& bwd,
                                 double lm_grad_scale, double moe_loss_scale);
  // The losses stay on the device: forward writes the main head's sum to loss_sum() and returns
  // NaN, and the multi-token prediction depths keep theirs (add_mtp_loss); nothing waits for them.
  // REQUIRES: the last stage, no tensor parallelism.
  void set_loss_on_device(bool on);
  // out_1 (f64 [1], on the device) += mtp_loss() of the last forward, computed on the device
  // (mtp_loss_accumulate: the same bits). REQUIRES: set_loss_on_device(true) before that forward.
  void add_mtp_loss(const Tensor& out_1) const;
  // f64 [1]: the last forward's sum of token losses, when set_loss_on_device.
  const Tensor& loss_sum() const { return loss_sum_1_; }
  bool loss_on_device() const { return loss_on_device_; }
  // train.cuda_graphs = "layers": forward and backward replay each decoder layer as CUDA graphs
  // (model/layer_graphs.h). REQUIRES: what the trainer checks (cuda_graphs_refusal).
  void set_cuda_graphs(bool on) {
    graphs_.set_enabled(on);
    set_rows_without_waiting(on);
  }
  // Every MoE layer's dispatcher plans its rows without the host reading them back
  // (Dispatcher::set_rows_without_waiting): what graphs of the layers or of the step need.
  void set_rows_without_waiting(bool on);
  const LayerGraphs& cuda_graphs() const { return graphs_; }

  // Router losses of the last forward, summed over layers (already times their coefficients);
  // aux_loss holds both load-balancing losses (Switch and sequence-level).
  double aux_loss() const;
  double z_loss() const;
  // Multi-token prediction of the last forward: mtp_loss_scaling_factor / depth * sum over
  // depths of (sum of token losses) * S / (S - k), so that dividing by the global tokens B*S gives
  // the weighted mean of each depth's mean loss. 0 without MTP.
  double mtp_loss() const;
  // Decoder layers of this stage (all of them without pipeline parallelism), the first one's
  // index, and the whole model's count (ready points and weights_needed points are whole-model
  // layer indices: grad_ready_point(name, total_layers())).
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  int64_t first_layer() const { return first_layer_; }
  int64_t total_layers() const { return cfg_.num_hidden_layers; }
  bool first_stage() const { return first_stage_; }
  bool last_stage() const { return last_stage_; }
  // Pipeline stages: the residual stream's rows [rows, H] entering this stage (a later stage's
  // forward reads them; the caller writes them before), leaving it (the forward writes them), and
  // the gradient: d(output) before backward on a stage before the last (the caller writes it),
  // d(input) after it on a stage after the first.
  const Tensor& input() const { return res_.front(); }
  const Tensor& output() const { return res_.back(); }
  const Tensor& stream_grad() const { return dres_TH_; }
  // The MoE layers (dense layers skipped), in depth order.
  int64_t num_moe_layers() const { return static_cast<int64_t>(moe_layers_.size()); }
  const MoeLayer& moe(int64_t i) const { return *moe_layers_[i]; }
  MoeLayer& moe(int64_t i) { return *moe_layers_[i]; }
  int64_t tokens() const { return rows_; }
  // Logits of the last forward: [B * local_seq_len(), V / tp] (this rank's vocabulary shard); backward
  // overwrites them with their gradient.
  const Tensor& logits() const { return logits_TV_; }
  int64_t local_seq_len() const { return local_seq_len_; }
  // Global positions of the local tokens (i32 [local_seq_len()]); null without CP.
  const Tensor* positions() const { return cpa_ ? &cpa_->positions() : nullptr; }

 private:
  const ExecContext* ctx_ = nullptr;  // where its ops run: the Memory's it was bound through
  // Final norm + LM head + cross-entropy of rows h_TH (this rank's); returns the token-loss sum.
  // With loss_1 (no TP) the sum is left there (cross_entropy_forward) and NaN returned.
  double head_forward(const Tensor& h_TH, const Tensor& norm, const Tensor& nf_TH, const Tensor& rstd_T,
                      const Tensor& nf_full_NH, const Tensor& logits_NV, const Tensor& lse_N, const Tensor& targets_N,
                      const Tensor& loss_1 = Tensor());
  // dh_TH written; dnorm and the LM head's gradient accumulated; logits_NV overwritten with its gradient.
  void head_backward(const Tensor& h_TH, const Tensor& norm, const Tensor& dnorm, const Tensor& nf_TH,
                     const Tensor& rstd_T, const Tensor& nf_full_NH, const Tensor& logits_NV, const Tensor& lse_N,
                     const Tensor& targets_N, double scale, const Tensor& dh_TH);
  // The last stage's part of backward above the decoder layers: the head's and the multi-token
  // prediction's, d(output) into dres_TH_.
  void backward_top(double lm_grad_scale, double moe_loss_scale, const std::function<void(int64_t)>& grads_ready);
  void embed(const Tensor& ids_N, const Tensor& out_TH);
  void embed_backward(const Tensor& ids_N, const Tensor& dout_TH);
  void bind_mtp(Memory& mem, MtpDepth& d);
  void mtp_forward(MtpDepth& d, const Tensor& prev_TH);
  // scale: of this depth's token losses; dnext_TH: the next depth's d(h_prev) (null for the last).
  void mtp_backward(MtpDepth& d, double scale, double moe_loss_scale, const Tensor* dnext_TH);

  // Whole-layer recomputation: layer l's slot in the recomputed layers' block (its position in its
  // chunk; -1: kept), and the first layer of its chunk.
  std::vector<int> recompute_slot_;
  std::vector<int64_t> chunk_first_;
  // Activation offload: the layers not recomputed whole offload their modules' inputs; each such
  // layer's slot (its index among them mod kOffloadSlots; -1: none), its block (the slot's bytes
  // and their pinned host copy), and the copy stream (a GPU run's real binding).
  static constexpr int kOffloadSlots = 3;
  Offload offload_;
  bool fp8_mtp_ = false;  // the multi-token-prediction projections in FP8 (Fp8Linears::mtp)
  std::vector<int> offload_slot_;
  std::vector<Memory::OffloadBlock> offload_blocks_;
  std::unique_ptr<ExecContext> copy_;
  // moe.shared_expert_overlap: every layer's shared experts run here, beside the routed experts on
  // ctx_ (made at the first binding that allocates; a CPU context runs them in turn, on the caller).
  std::unique_ptr<ExecContext> shared_;
  bool offloads(int64_t layer) const { return offload_slot_[static_cast<size_t>(layer)] >= 0; }
  int64_t offloaded_before(int64_t layer) const;  // the last offloading layer below `layer` (-1: none)
  void offload_after_forward(int64_t layer);      // its block to the host (copy stream)
  void fetch_before_backward(int64_t layer);      // its block back (copy stream)
  ModelConfig cfg_;
  MoeConfig moe_cfg_;
  int64_t batch_, seq_len_, local_seq_len_,
      rows_;                 // batch, full sequence, local sequence, residual rows here (B*local_seq_len_/tp)
  int64_t tokens_ = 0;       // tokens of the local sequences (B*local_seq_len_): every TP rank's rows
  int64_t first_layer_ = 0;  // pipeline stage: the first decoder layer's whole-model index
  bool first_stage_ = true, last_stage_ = true;
  Communicator* tp_ = nullptr;                     // size > 1 only
  int64_t vocab_offset_ = 0;                       // first vocabulary row held here (tensor parallelism)
  std::unique_ptr<ContextParallelAttention> cpa_;  // shared by every layer (stateless between calls)
  std::vector<std::unique_ptr<DecoderLayer>> layers_;
  Memory* mem_ = nullptr;  // bound through
  LayerGraphs graphs_;
  bool loss_on_device_ = false;
  Tensor loss_sum_1_;    // f64 [1]: the head's loss sum (set_loss_on_device)
  Tensor mtp_losses_D_;  // f64 [depths]: each depth's token-loss sum (set_loss_on_device)
  std::vector<MoeLayer*> moe_layers_;
  std::vector<std::unique_ptr<MtpDepth>> mtp_;
  AttentionScratch scratch_;
  Tensor embed_, dembed_, norm_, dnorm_, lm_head_, dlm_head_;
  Tensor cos_SD_, sin_SD_;
  std::vector<Tensor> res_;  // residual stream: res_[l] is the input of layer l, res_[L] the output
  Tensor ids_, targets_, nf_TH_, rstdf_T_, logits_TV_, lse_T_, dnf_TH_, dres_TH_, dn_TH_;
  Tensor full_NH_, partial_NH_;      // tensor parallelism: every TP rank's rows; partial sums
  VocabParallelScratch ce_scratch_;  // vocabulary-parallel cross-entropy
};

}  // namespace moefold

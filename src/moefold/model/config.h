// Run configuration: the [model], [moe], [train], [parallel], [data] and [kernels] sections of a
// TOML file, built-in presets, and `--set section.key=value` overrides. Keys are named as Hugging
// Face names them where a name exists. Every mistake is a moefold::Error naming the file/flag, key
// and value.
// Defined in config.cpp (invariants), config_toml.cpp (keys, TOML in and out), config_presets.cpp,
// rope_scaling.cpp and model_size.cpp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moefold/core/kernel_options.h"
#include "moefold/moe/moe_config.h"
#include "moefold/parallel/parallel_config.h"

namespace moefold {

// Model families (model.architecture), as Hugging Face names their config.json model_type:
//   qwen3_moe   - Qwen3-MoE: per-head RMSNorm on q and k; softmax routing.
//   mixtral     - Mixtral: no q/k norm; experts under "block_sparse_moe" (w1 gate, w3 up, w2 down).
//   olmoe       - OLMoE: RMSNorm over the whole q and k projections (not per head).
//   deepseek_v3 - DeepSeek-V3: multi-head latent attention (MLA), shared experts, sigmoid routing
//                 with a selection bias and group limits, multi-token prediction.
struct ModelConfig {
  std::string architecture = "qwen3_moe";  // one of the families above
  int64_t vocab_size = 320;                // rows of the embedding and LM head (>= tokenizer vocab)
  int64_t hidden_size = 128;               // H
  int64_t num_hidden_layers = 4;           // decoder layers, each attention + MoE (or dense MLP)
  int64_t num_attention_heads = 4;         // query heads
  int64_t num_key_value_heads = 2;         // kv heads (grouped-query attention)
  int64_t head_dim = 32;                   // D (deepseek_v3: the rotary part, qk_rope_head_dim)
  int64_t max_position_embeddings = 4096;  // longest sequence the RoPE table is built for
  double rms_norm_eps = 1e-6;              // RMSNorm epsilon (layer norms and q/k norms)
  double rope_theta = 1e6;                 // RoPE base
  double initializer_range = 0.02;         // std of the normal init of every matrix
  // Dense layers: layer l has a dense SwiGLU MLP of intermediate_size instead of an MoE layer when
  // l < first_k_dense_replace (DeepSeek) or l is listed in mlp_only_layers (Qwen3-MoE).
  int64_t intermediate_size = 0;
  int64_t first_k_dense_replace = 0;
  std::vector<int64_t> mlp_only_layers;
  // Multi-head latent attention (deepseek_v3): q = q_b(norm(q_a(x))) (q_proj(x) when q_lora_rank
  // is 0), kv latent = norm(kv_a(x)[:kv_lora_rank]), k_rope = kv_a(x)[kv_lora_rank:] shared by
  // every head; k_nope, v = kv_b(latent).
  int64_t q_lora_rank = 0;
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  bool rope_interleave = false;  // rotary pairs (x0,x1),(x2,x3).. (DeepSeek) instead of (xj, xj+D/2)
  // RoPE scaling: "default" or "yarn" (YaRN, as Hugging Face computes it for DeepSeek-V3).
  std::string rope_type = "default";
  double rope_factor = 1.0;
  int64_t rope_original_max_position_embeddings = 0;
  double rope_beta_fast = 32.0;
  double rope_beta_slow = 1.0;
  double rope_mscale = 0.0;          // 0: not given
  double rope_mscale_all_dim = 0.0;  // 0: not given
  // Multi-token prediction (DeepSeek-V3): modules predicting token i+1+k, k = 1..depth, whose mean
  // cross-entropy is added to the loss times mtp_loss_scaling_factor.
  int64_t num_nextn_predict_layers = 0;
  double mtp_loss_scaling_factor = 0.1;
  // The dtype of the Hugging Face checkpoint this model came from ("float32" or "bfloat16"):
  // `convert --to-hf` writes the weights in it (training keeps fp32 master weights).
  std::string torch_dtype = "float32";
  // With torch_dtype bfloat16: the tensors the checkpoint kept in float32 (transformers keeps e.g.
  // DeepSeek-V3's router in float32), by name without the "model.layers.N." prefix.
  std::vector<std::string> float32_tensors;

  // Far past any model (the largest have ~100 layers); validation loops over the layers.
  static constexpr int64_t kMaxLayers = int64_t{1} << 14;

  bool is_mla() const { return architecture == "deepseek_v3"; }
  bool is_dense_layer(int64_t layer) const;
  // Query/key width of one head for the attention core (MLA: nope + rope).
  int64_t qk_head_dim() const { return is_mla() ? qk_nope_head_dim + qk_rope_head_dim : head_dim; }
  void validate() const;
};

// What backward recomputes instead of keeping from the forward (TrainConfig::recompute()), with
// Megatron-Core's meanings. Whole layers: method uniform cuts the decoder layers into chunks of
// num_layers, each keeping only its input (the chunk's forward runs again before its backward);
// method block recomputes the first num_layers layers one by one and keeps the rest. Modules
// (selective, in the layers not recomputed whole): layernorm (the two RMSNorms' outputs), core_attn
// (the attention core's output and log-sum-exp), mla_up_proj (MLA's up projections, RoPE and the
// core's q/k/v), moe_act (the routed experts' SwiGLU output), shared_experts, moe (the whole MoE
// block: router, dispatch, experts, combine) and mlp (the dense layers' MLP) run their forward again.
struct Recompute {
  int64_t num_layers = 0;  // 0: no layer recomputed whole
  bool block = false;      // method block (else uniform)
  bool layernorm = false, core_attn = false, mla_up_proj = false, moe_act = false, shared_experts = false, moe = false,
       mlp = false;
  bool any_module() const { return layernorm || core_attn || mla_up_proj || moe_act || shared_experts || moe || mlp; }
};

// Activation offload (TrainConfig::offload(), GPU only), with Megatron-Core's module names: the kept
// input of each named module goes to pinned host memory on a copy stream after the layer's forward
// and comes back one layer ahead of its backward. attn_norm: the layer's input (the attention norm's);
// qkv_linear: the q/k/v projections' input (the norm's output); core_attn: the attention core's q, k,
// v and log-sum-exp; attn_proj: the output projection's input; mlp_norm: the pre-MLP norm's input;
// expert_fc1: the experts' permuted input rows (the local dispatcher's: with expert parallelism the
// received rows are peer-visible and stay); moe_act: the experts' first-layer output (the SwiGLU's input). What a
// module recomputes is not offloaded, nor anything of a layer recomputed whole (train.recompute_num_layers).
struct Offload {
  bool attn_norm = false, qkv_linear = false, core_attn = false, attn_proj = false, mlp_norm = false,
       expert_fc1 = false, moe_act = false;
  bool any() const { return attn_norm || qkv_linear || core_attn || attn_proj || mlp_norm || expert_fc1 || moe_act; }
};

// FP8 training (train.fp8 = blockwise, ops/fp8.h): which linear layers run their GEMMs in FP8, by the
// module names of train.fp8_exclude (the router, norms, attention core, LM head and optimizer never do).
// qkv: the attention's input projections (q, k, v; MLA's down and up projections); attn_proj: its
// output projection; mlp: the dense layers' MLP; experts: the routed experts' fc1 and fc2;
// shared_experts: the shared experts' MLP; mtp: the multi-token-prediction projection (eh_proj).
struct Fp8Linears {
  bool qkv = false, attn_proj = false, mlp = false, experts = false, shared_experts = false, mtp = false;
  bool any() const { return qkv || attn_proj || mlp || experts || shared_experts || mtp; }
  // The modules on, by their train.fp8_exclude names, comma-separated ("" when none).
  std::string names() const;
};

struct TrainConfig {
  int64_t seq_len = 128;           // tokens per sequence
  int64_t micro_batch_size = 8;    // sequences per forward/backward
  int64_t global_batch_size = 16;  // sequences per optimizer step (multiple of micro_batch_size)
  int64_t steps = 600;             // default number of optimizer steps (--steps overrides)
  double lr = 3e-3;                // peak learning rate
  double min_lr = 3e-4;            // cosine floor
  int64_t warmup_steps = 30;       // linear warmup from 0
  double weight_decay = 0.1;       // AdamW decoupled decay (not applied to norms)
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.95;
  double adam_eps = 1e-8;
  double grad_clip = 1.0;  // global-norm clipping threshold (<= 0: off)
  // A step whose loss or gradient norm is not finite: "stop" (an error naming the step and the
  // first parameter with a non-finite gradient) or "skip" (no optimizer step and no expert-bias
  // update; the data position and the step count advance; StepMetrics::skipped).
  std::string on_nonfinite = "stop";
  // AdamW's moments in memory (Megatron's precision-aware optimizer): "f32", or "bf16" (half the
  // bytes; each update reads them to f32 and stores them rounded). Checkpoints hold them in f32.
  std::string exp_avg_dtype = "f32";
  std::string exp_avg_sq_dtype = "f32";
  // The gradient accumulators (Megatron's main grads) of the expert and tensor-parallel weights
  // (all but the replicated norms, router and MLA down projections, which keep f32): "f32", or
  // "bf16" (half the bytes; each micro-batch's gradient is added in f32 and rounded). GPU only.
  std::string main_grads_dtype = "f32";
  // Optimizer offload: this fraction of each rank's optimizer shard (master weights and moments,
  // the last elements of each parameter group's slots) lives in pinned host memory and is updated
  // there by a multi-threaded host AdamW while the GPU updates the rest. GPU, distributed optimizer.
  double optimizer_offload_fraction = 0;
  // Activation offload (struct Offload): module names.
  std::vector<std::string> offload_modules;
  // Recomputation (struct Recompute): module names, whole layers and their method.
  std::vector<std::string> recompute_modules;
  int64_t recompute_num_layers = 0;
  std::string recompute_method = "uniform";
  // FP8: "none" or "blockwise" (struct Fp8Linears; fp8_exclude: module names kept in bf16).
  std::string fp8 = "none";
  std::vector<std::string> fp8_exclude;
  // FP8 weights only: the FP8 linears' weights kept as their FP8 copies (quantized from the f32
  // masters), without bf16 compute copies (Memory::set_fp8_params). Same results. With the
  // distributed optimizer the codes of each rank's slots are gathered (AdamW).
  bool fp8_param = false;
  // CUDA graphs: "none", "layers" (each decoder layer's forward and backward captured once and
  // replayed: the host issues one launch per layer instead of one per op; model/layer_graphs.h) or
  // "step" (each whole micro-batch one graph; Trainer::run_micro_batch_graphs). Where a feature
  // prevents capture the run goes on without, saying why in one line.
  std::string cuda_graphs = "none";
  int64_t eval_interval = 100;  // evaluate every N steps (0: never, except at the end)
  int64_t eval_batches = 4;     // held-out micro-batches per evaluation
  // Every N steps the run directory's expert_load.npy grows by one [MoE layers, experts] slice of
  // the step's tokens per expert (float32, summed over micro-batches and ranks); 0: never.
  int64_t expert_load_interval = 10;
  // Every N steps (and the last) one line, step, loss, lr, tokens/s, TFLOP/s, memory and ETA, to
  // the run directory's train.log and, unless --quiet, standard error; 0: only the last step.
  int64_t log_interval = 10;
  // TensorBoard event files in the run directory's tensorboard/ (rank 0): every step's scalars;
  // every expert_load_interval steps per-layer expert-load scalars and tokens-per-expert histograms.
  bool tensorboard = true;
  int64_t checkpoint_interval = 200;  // checkpoint every N steps (0: only at the end)
  bool save_checkpoints = true;       // false: no checkpoint at all, not even at the end (experiments)
  // Checkpoints (train/checkpoint.h): written by a background thread from a pinned host copy of
  // the state while training goes on; at most keep_checkpoints complete ones kept (0: all); a
  // failed save stops the run or, "continue", is reported and training goes on.
  bool async_checkpoint = false;
  int64_t keep_checkpoints = 0;
  std::string on_save_error = "stop";
  uint64_t seed = 1234;  // init, data order

  void validate() const;
  // The recompute_* keys parsed. REQUIRES: validate() passed.
  Recompute recompute() const;
  Offload offload() const;         // offload_modules parsed
  Fp8Linears fp8_linears() const;  // fp8 and fp8_exclude parsed (all false with fp8 = "none")
};

struct DataConfig {
  std::string path;                // .tokens file or Megatron .bin/.idx prefix; empty: default corpus
  double valid_fraction = 0.01;    // tail of the token stream held out for evaluation
  std::string default_corpus_dir;  // where the default corpus is read from (empty: built-in choice)

  void validate() const;
};

struct Config {
  ModelConfig model;
  MoeConfig moe;
  TrainConfig train;
  DataConfig data;
  ParallelConfig parallel;
  KernelOptions kernels;        // which kernels compute the ops (bits may differ, so recorded with the run)
  std::string preset = "tiny";  // the preset this config derives from

  // Cross-section checks (top-k <= experts is in MoeConfig; heads dividing, etc.).
  void validate() const;
  // The layout for `world` ranks (parallel.dp derived when 0), with every constraint between the
  // layout, the model and the batch checked. Throws Error naming the numbers that do not divide.
  ParallelConfig resolve_layout(int64_t world) const;
};

// Names of the built-in presets: "tiny" (default), "qwen3-30b-a3b", "qwen3-235b-a22b",
// "deepseek-v3", "mixtral-8x7b", "olmoe-1b-7b".
std::vector<std::string> preset_names();
// REQUIRES: a known name (else Error listing the known ones).
Config preset_config(const std::string& name);

// `spec` is a preset name or a TOML file; the file may start with `preset = "NAME"` to derive
// from a preset (default "tiny"). `overrides` are "section.key=value" strings (TOML values; a
// bare word is taken as a string). The result is validated.
Config load_config(const std::string& spec, const std::vector<std::string>& overrides);

// The config as TOML (every key), for run directories and checkpoints.
std::string config_to_toml(const Config& c);

// The rotary table's inverse frequencies (head_dim / 2 of them) and the factor its cos/sin are
// multiplied by: theta^(-2j/D) and 1 by default; YaRN's blend of interpolated and extrapolated
// frequencies and its attention factor (as Hugging Face's _compute_yarn_parameters, truncate on).
std::vector<double> rope_inv_freq(const ModelConfig& m, double* attention_factor);
// The attention softmax scale: qk_head_dim^-0.5 (MLA with YaRN: times mscale(factor, mscale_all_dim)^2).
double attention_softmax_scale(const ModelConfig& m);

// Parameter counts and model FLOPs per token: 2 per multiply-add of every weight a token passes
// through (K of E experts) plus the causal attention core; training is 3 x the forward.
struct ModelSize {
  int64_t total_params = 0;
  int64_t active_params = 0;           // with K of E experts
  int64_t mtp_params = 0;              // multi-token-prediction modules (not in total_params)
  double train_flops_per_token = 0.0;  // 3 x forward, at the given sequence length
};
ModelSize model_size(const ModelConfig& m, const MoeConfig& e, int64_t seq_len);

}  // namespace moefold

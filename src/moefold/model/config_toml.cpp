// The TOML form of a Config (config.h: load_config, config_to_toml): the table of every key with
// its one-line comment, reading a file over a preset, `--set section.key=value` overrides, and
// writing every key back (what configs/tiny.toml and a run directory's config.toml hold).
#include <toml++/toml.h>

#include <charconv>
#include <climits>
#include <cmath>
#include <filesystem>
#include <functional>
#include <sstream>
#include <variant>

#include "moefold/core/error.h"
#include "moefold/model/config.h"

namespace moefold {

namespace {

// Keys stored as an enum (or a struct) and written as a string: their text, and back (parse_text
// throws Error naming `key` and the accepted values).
void parse_text(const std::string& s, const std::string& key, GroupedGemmImpl* p) { *p = parse_grouped_gemm(s, key); }
void parse_text(const std::string& s, const std::string& key, Fp8DenseGemm* p) { *p = parse_fp8_dense_gemm(s, key); }
void parse_text(const std::string& s, const std::string& key, CutlassTiles* p) { *p = parse_cutlass_tiles(s, key); }
void parse_text(const std::string& s, const std::string& key, Fp8Tiles* p) { *p = parse_fp8_tiles(s, key); }
void parse_text(const std::string& s, const std::string& key, SwigluFusion* p) { *p = parse_swiglu_fusion(s, key); }
void parse_text(const std::string& s, const std::string& key, AttentionKernel* p) {
  *p = parse_attention_kernel(s, key);
}
std::string text_of(GroupedGemmImpl v) { return grouped_gemm_name(v); }
std::string text_of(Fp8DenseGemm v) { return fp8_dense_gemm_name(v); }
std::string text_of(const CutlassTiles& v) { return cutlass_tiles_text(v); }
std::string text_of(const Fp8Tiles& v) { return fp8_tiles_text(v); }
std::string text_of(SwigluFusion v) { return swiglu_fusion_name(v); }
std::string text_of(AttentionKernel v) { return attention_kernel_name(v); }
template <class T>
concept TextCoded = requires(const T& v) {
  text_of(v);
};

using Ref = std::variant<int64_t*, uint64_t*, int*, double*, bool*, std::string*, ScoreFunc*, std::vector<int64_t>*,
                         std::vector<std::string>*, GroupedGemmImpl*, Fp8DenseGemm*, CutlassTiles*, Fp8Tiles*,
                         SwigluFusion*, AttentionKernel*>;

struct Field {
  const char* section;
  const char* key;
  std::function<Ref(Config&)> ref;
  const char* doc;  // one line, written next to the key by config_to_toml
};

#define MF_FIELD(sec, key, member, doc)                             \
  Field {                                                           \
#sec, key, [](Config & c) -> Ref { return &c.sec.member; }, doc \
  }

// Every key, section by section in the order config_to_toml writes them; `doc` is the comment
// configs/tiny.toml and every run's config.toml show beside the key.
const std::vector<Field>& fields() {
  static const std::vector<Field> f = {
      MF_FIELD(model, "architecture", architecture, "model family: qwen3_moe, mixtral, olmoe or deepseek_v3"),
      MF_FIELD(model, "vocab_size", vocab_size, "rows of the embedding and LM head (>= the tokenizer's vocabulary)"),
      MF_FIELD(model, "hidden_size", hidden_size, "H, width of the residual stream"),
      MF_FIELD(model, "num_hidden_layers", num_hidden_layers, "decoder layers, each attention + MoE (or a dense MLP)"),
      MF_FIELD(model, "num_attention_heads", num_attention_heads, "query heads"),
      MF_FIELD(model, "num_key_value_heads", num_key_value_heads, "key/value heads (grouped-query attention)"),
      MF_FIELD(model, "head_dim", head_dim, "D, width of one head"),
      MF_FIELD(model, "max_position_embeddings", max_position_embeddings, "longest sequence allowed"),
      MF_FIELD(model, "rms_norm_eps", rms_norm_eps, "epsilon of every RMSNorm"),
      MF_FIELD(model, "rope_theta", rope_theta, "rotary embedding base"),
      MF_FIELD(model, "initializer_range", initializer_range, "std of the normal init of every matrix"),
      MF_FIELD(model, "intermediate_size", intermediate_size, "FFN width of the dense layers (0: none)"),
      MF_FIELD(model, "first_k_dense_replace", first_k_dense_replace, "the first k layers are dense (DeepSeek)"),
      MF_FIELD(model, "mlp_only_layers", mlp_only_layers, "indices of dense layers (Qwen3-MoE)"),
      MF_FIELD(model, "q_lora_rank", q_lora_rank, "MLA: rank of the query compression (0: plain q_proj)"),
      MF_FIELD(model, "kv_lora_rank", kv_lora_rank, "MLA: rank of the key/value latent"),
      MF_FIELD(model, "qk_nope_head_dim", qk_nope_head_dim, "MLA: per-head query/key width without RoPE"),
      MF_FIELD(model, "qk_rope_head_dim", qk_rope_head_dim, "MLA: per-head query/key width with RoPE"),
      MF_FIELD(model, "v_head_dim", v_head_dim, "MLA: per-head value width"),
      MF_FIELD(model, "rope_interleave", rope_interleave, "rotate interleaved pairs (DeepSeek) instead of halves"),
      MF_FIELD(model, "rope_type", rope_type, "\"default\" or \"yarn\" (YaRN context extension)"),
      MF_FIELD(model, "rope_factor", rope_factor, "YaRN: context extension factor"),
      MF_FIELD(model, "rope_original_max_position_embeddings", rope_original_max_position_embeddings,
               "YaRN: context length of pre-training"),
      MF_FIELD(model, "rope_beta_fast", rope_beta_fast, "YaRN: extrapolation boundary (rotations)"),
      MF_FIELD(model, "rope_beta_slow", rope_beta_slow, "YaRN: interpolation boundary (rotations)"),
      MF_FIELD(model, "rope_mscale", rope_mscale, "YaRN: mscale (0: not given)"),
      MF_FIELD(model, "rope_mscale_all_dim", rope_mscale_all_dim, "YaRN: mscale_all_dim (0: not given)"),
      MF_FIELD(model, "num_nextn_predict_layers", num_nextn_predict_layers, "multi-token prediction depth (0: off)"),
      MF_FIELD(model, "mtp_loss_scaling_factor", mtp_loss_scaling_factor,
               "weight of the mean multi-token-prediction loss"),
      MF_FIELD(model, "torch_dtype", torch_dtype, "dtype of exported Hugging Face weights: float32 or bfloat16"),
      MF_FIELD(model, "float32_tensors", float32_tensors,
               "with bfloat16: tensors exported in float32 (names without \"model.layers.N.\")"),
      MF_FIELD(moe, "num_experts", num_experts, "E, routed experts per MoE layer"),
      MF_FIELD(moe, "num_experts_per_tok", num_experts_per_tok, "K, experts each token is sent to"),
      MF_FIELD(moe, "moe_intermediate_size", moe_intermediate_size, "F, FFN width of one expert"),
      MF_FIELD(moe, "scoring_func", scoring_func, "router scores: \"softmax\" or \"sigmoid\""),
      MF_FIELD(moe, "norm_topk_prob", norm_topk_prob, "renormalise the K selected probabilities to sum 1"),
      MF_FIELD(moe, "routed_scaling_factor", routed_scaling_factor,
               "multiplies the (renormalised) top-K probabilities"),
      MF_FIELD(moe, "router_aux_loss_coef", aux_loss_coeff,
               "load-balancing loss weight (Switch/GShard; 1.0 = uniform routing)"),
      MF_FIELD(moe, "router_z_loss_coef", z_loss_coeff, "router z-loss weight (ST-MoE)"),
      MF_FIELD(moe, "router_init_std", router_init_std,
               "standard deviation of the router's initial weights (0: model.initializer_range)"),
      MF_FIELD(moe, "router_fp32_gemm", router_fp32_gemm,
               "mixed precision: router logits from fp32 operands (else bf16 operands, fp32 accumulation)"),
      MF_FIELD(moe, "ep_overlap_chunks", ep_overlap_chunks,
               "expert parallelism: pieces each EP peer's rows travel in, so the all-to-all overlaps the experts"),
      MF_FIELD(moe, "ep_recv_factor", ep_recv_factor,
               "expert parallelism: rows a rank's experts can receive, times the average T*K (0: the worst case)"),
      MF_FIELD(moe, "fp8_dispatch", fp8_dispatch,
               "with train.fp8 = blockwise: tokens travel to the experts as FP8 plus 1 x 128 scales (combine "
               "and gradients stay bf16)"),
      MF_FIELD(moe, "dispatcher", dispatcher,
               "expert-parallel dispatcher: \"alltoall\" (every token-expert pair travels), \"hierarchical\" "
               "(a token crosses to another node once and fans out there; the combine sums within the node) or "
               "\"slots\" (as alltoall in fixed-size slots, moe.ep_recv_factor times the average, with the counts "
               "on the device: no host round trip; dropless or padded)"),
      MF_FIELD(moe, "capacity_factor", capacity_factor,
               "<= 0: dropless; else capacity = ceil(cf * T * K / E) rows per expert"),
      MF_FIELD(moe, "pad_to_capacity", pad_to_capacity, "with a capacity: pad every expert to exactly its capacity"),
      MF_FIELD(moe, "n_shared_experts", n_shared_experts,
               "shared experts every token passes (one MLP of n x moe_intermediate_size)"),
      MF_FIELD(moe, "shared_expert_overlap", shared_expert_overlap,
               "run the shared experts on a CUDA stream of their own beside the routed experts (same results; "
               "not with parallel.tp > 1)"),
      MF_FIELD(moe, "n_group", n_group, "group-limited routing: experts in n_group contiguous groups (1: off)"),
      MF_FIELD(moe, "topk_group", topk_group, "groups a token may route into (best by sum of top-2 scores)"),
      MF_FIELD(moe, "expert_bias", expert_bias,
               "aux-loss-free balancing: a per-expert selection bias (gate.e_score_correction_bias)"),
      MF_FIELD(moe, "expert_bias_update_rate", expert_bias_update_rate,
               "bias += rate * sign(mean load - load) after every step"),
      MF_FIELD(moe, "seq_aux_loss_coef", seq_aux_loss_coeff, "sequence-level load-balancing loss weight (DeepSeek-V3)"),
      MF_FIELD(train, "seq_len", seq_len, "tokens per sequence"),
      MF_FIELD(train, "micro_batch_size", micro_batch_size, "sequences per forward/backward"),
      MF_FIELD(train, "global_batch_size", global_batch_size, "sequences per optimizer step (gradient accumulation)"),
      MF_FIELD(train, "steps", steps, "optimizer steps; the LR schedule spans them (--steps N stops early)"),
      MF_FIELD(train, "lr", lr, "peak learning rate"),
      MF_FIELD(train, "min_lr", min_lr, "learning rate at the end of the cosine decay"),
      MF_FIELD(train, "warmup_steps", warmup_steps, "linear warmup steps"),
      MF_FIELD(train, "weight_decay", weight_decay, "AdamW decoupled weight decay (not on norms)"),
      MF_FIELD(train, "adam_beta1", adam_beta1, "AdamW beta1"),
      MF_FIELD(train, "adam_beta2", adam_beta2, "AdamW beta2"),
      MF_FIELD(train, "adam_eps", adam_eps, "AdamW epsilon"),
      MF_FIELD(train, "grad_clip", grad_clip, "global gradient-norm clipping threshold (<= 0: off)"),
      MF_FIELD(train, "on_nonfinite", on_nonfinite,
               "a non-finite loss or gradient norm: \"stop\" (an error naming the step and the first parameter with a "
               "non-finite gradient) or \"skip\" (no update; the data and the step count move on)"),
      MF_FIELD(train, "exp_avg_dtype", exp_avg_dtype, "AdamW first moment in memory: f32 or bf16 (checkpoints: f32)"),
      MF_FIELD(train, "exp_avg_sq_dtype", exp_avg_sq_dtype,
               "AdamW second moment in memory: f32 or bf16 (checkpoints: f32)"),
      MF_FIELD(train, "main_grads_dtype", main_grads_dtype,
               "gradient accumulators of the expert and tensor-parallel weights: f32 or bf16 (GPU only)"),
      MF_FIELD(train, "optimizer_offload_fraction", optimizer_offload_fraction,
               "fraction of each rank's optimizer shard in pinned host memory, updated there (GPU runs with "
               "parallel.distributed_optimizer)"),
      MF_FIELD(train, "offload_modules", offload_modules,
               "kept inputs moved to pinned host memory between forward and backward (GPU): attn_norm, qkv_linear, "
               "core_attn, attn_proj, mlp_norm, expert_fc1, moe_act"),
      MF_FIELD(train, "recompute_modules", recompute_modules,
               "recomputed in backward instead of kept: layernorm, core_attn, mla_up_proj, moe_act, shared_experts, "
               "moe, mlp"),
      MF_FIELD(train, "recompute_num_layers", recompute_num_layers,
               "decoder layers recomputed whole (0: none): chunk size (uniform) or first N layers (block)"),
      MF_FIELD(train, "recompute_method", recompute_method,
               "uniform (every layer, chunks of recompute_num_layers) or block (the first recompute_num_layers)"),
      MF_FIELD(train, "cuda_graphs", cuda_graphs,
               "\"none\", \"layers\" (each decoder layer's forward and backward replayed as CUDA graphs: one launch "
               "per layer) or \"step\" (each micro-batch's forward, loss and backward one graph; the optimizer "
               "after it); where a feature prevents capture the run says why and goes on without"),
      MF_FIELD(train, "fp8", fp8,
               "FP8 GEMMs of the linear layers: none or blockwise (E4M3, scales per 1 x 128 tile of activations and "
               "gradients and per 128 x 128 block of weights; DeepSeek-V3's recipe)"),
      MF_FIELD(train, "fp8_exclude", fp8_exclude,
               "with fp8 = blockwise, linear layers kept in bf16: qkv, attn_proj, mlp, experts, shared_experts, mtp"),
      MF_FIELD(train, "fp8_param", fp8_param,
               "with fp8 = blockwise, the FP8 linears' weights kept only in FP8 (quantized from the f32 masters; no "
               "bf16 copies; same results); with parallel.distributed_optimizer each rank quantizes its slots and "
               "the FP8 codes are gathered (half the bytes of bf16)"),
      MF_FIELD(train, "eval_interval", eval_interval, "evaluate every N steps (0: only at the end)"),
      MF_FIELD(train, "eval_batches", eval_batches, "held-out micro-batches per evaluation"),
      MF_FIELD(train, "checkpoint_interval", checkpoint_interval, "checkpoint every N steps (0: only at the end)"),
      MF_FIELD(train, "log_interval", log_interval,
               "every N steps one line (step, loss, lr, tokens/s, TFLOP/s, memory, ETA) to train.log and the "
               "terminal (0: the last step only)"),
      MF_FIELD(train, "expert_load_interval", expert_load_interval,
               "every N steps expert_load.npy in the run directory grows by one [MoE layers, experts] slice of "
               "tokens per expert (0: never)"),
      MF_FIELD(train, "tensorboard", tensorboard,
               "TensorBoard event files in the run directory's tensorboard/: every step's metrics; every "
               "expert_load_interval steps per-layer expert-load scalars and tokens-per-expert histograms"),
      MF_FIELD(train, "save_checkpoints", save_checkpoints,
               "false: no checkpoint is written, not even at the end (experiments, measurements)"),
      MF_FIELD(train, "async_checkpoint", async_checkpoint,
               "checkpoints copied to pinned host memory and written by a background thread while training goes on "
               "(still atomic: a temporary directory, fsync, rename)"),
      MF_FIELD(train, "keep_checkpoints", keep_checkpoints,
               "complete checkpoints kept (0: all); older ones are removed once a newer one is durable"),
      MF_FIELD(train, "on_save_error", on_save_error,
               "a checkpoint that cannot be written (a full disk): \"stop\" (an error) or \"continue\" (one line; the "
               "previous checkpoints stay, training goes on)"),
      MF_FIELD(train, "seed", seed, "seed of the init and the data order"),
      MF_FIELD(parallel, "tp", tp, "tensor-parallel size (attention and dense layers)"),
      MF_FIELD(parallel, "cp", cp, "context-parallel size (sequence split for attention)"),
      MF_FIELD(parallel, "dp", dp, "data-parallel size; 0: world / (tp * cp)"),
      MF_FIELD(parallel, "ep", ep, "expert-parallel size (experts split over ep ranks)"),
      MF_FIELD(parallel, "etp", etp, "expert tensor-parallel size"),
      MF_FIELD(parallel, "pp", pp, "pipeline-parallel stages (the outermost dimension of both folds)"),
      MF_FIELD(parallel, "first_stage_layers", first_stage_layers,
               "decoder layers of the first pipeline stage (0: an even share)"),
      MF_FIELD(parallel, "last_stage_layers", last_stage_layers,
               "decoder layers of the last pipeline stage (0: an even share)"),
      MF_FIELD(parallel, "pipeline_schedule", pipeline_schedule, "pipeline schedule: \"1f1b\""),
      MF_FIELD(parallel, "vpp", vpp, "virtual pipeline stages per rank (1: not interleaved)"),
      MF_FIELD(parallel, "overlap_moe_a2a", overlap_moe_a2a,
               "interleave one micro-batch's forward with another's backward so each one's expert all-to-all "
               "runs beside the other's computation (1F1B; pp = 1 too)"),
      MF_FIELD(parallel, "timeout_s", timeout_s, "a rank waiting longer on another fails, naming both"),
      MF_FIELD(parallel, "overlap_grad_reduce", overlap_grad_reduce,
               "start each layer's data-parallel gradient all-reduce as its backward ends"),
      MF_FIELD(parallel, "distributed_optimizer", distributed_optimizer,
               "shard the master weights and AdamW moments over the ranks that reduce each gradient"),
      MF_FIELD(parallel, "overlap_param_gather", overlap_param_gather,
               "distributed optimizer: gather each layer's updated weights beside the next forward's earlier layers"),
      MF_FIELD(parallel, "ep_transport", ep_transport,
               "expert-parallel exchange: \"auto\" (ipc where the EP GPUs can map each other's memory, else nccl), "
               "\"nccl\" (the communicator's send/recv) or \"ipc\" (copies into the peers' memory; MPI messages "
               "on CPU ranks)"),
      MF_FIELD(parallel, "ranks_per_node", ranks_per_node,
               "ranks per node (0: those sharing a host); fewer splits a host into emulated nodes whose expert "
               "traffic takes the inter-node path"),
      MF_FIELD(data, "path", path, ".tokens file or Megatron .bin/.idx prefix; empty: default corpus"),
      MF_FIELD(data, "valid_fraction", valid_fraction, "tail of the token stream held out for evaluation"),
      MF_FIELD(data, "default_corpus_dir", default_corpus_dir,
               "directory the default corpus is read from (empty: built-in)"),
      MF_FIELD(kernels, "grouped_gemm", grouped_gemm,
               "experts' GEMMs: \"cutlass\" (Hopper grouped GEMM; cuBLASLt where it cannot serve) or \"cublaslt\" "
               "(one GEMM per expert)"),
      MF_FIELD(kernels, "cutlass_tile", cutlass_tiles,
               "CUTLASS tiles: \"\" (per-kind defaults), \"small\", \"large\", \"pingpong\", \"large_n2\", "
               "\"pingpong_n2\" (1 x 2 clusters: rows padded to one tile, not two), \"large_auto\" (large or large_n2, "
               "chosen on the device per call), \"auto\" (large_auto for few rows per expert in large calls, else "
               "large; the forward, dgrad and swiglu_dgrad default), \"own\" (wgrad only: moefold's own "
               "weight-gradient kernel, sm_90a) or per kind "
               "\"forward=..,dgrad=..,wgrad=..,swiglu_forward=..,swiglu_dgrad=..\""),
      MF_FIELD(kernels, "fp8_dense_gemm", fp8_dense_gemm,
               "dense FP8 linears (train.fp8): \"cublaslt\" (block scaling where it serves the shape, else "
               "CUTLASS) or \"cutlass\""),
      MF_FIELD(kernels, "fp8_tile", fp8_tiles,
               "FP8 GEMM configurations (train.fp8): \"\" (defaults: rows auto, cols cooperative), \"cooperative\", "
               "\"cooperative_1x1\", \"pingpong\", \"auto\" or per kind \"rows=..,cols=..\" (rows: forward and dgrad; "
               "cols: wgrad); rows may also be \"own\" (moefold's grouped kernel; auto: own for the experts' GEMMs up "
               "to 2048 wide and deep, else cooperative)"),
      MF_FIELD(kernels, "gemm_sms", gemm_sms,
               "SMs the persistent grouped GEMMs use (0: all; fewer leave some to a transfer beside them)"),
      MF_FIELD(kernels, "own_wgrad_units", own_wgrad_units,
               "the own weight-gradient kernel (wgrad = own): up to this many tiles of an expert a cluster takes in "
               "a row, keeping dy in shared memory where every expert has at most 256 rows (1: one tile at a time)"),
      MF_FIELD(kernels, "fused_swiglu", fused_swiglu,
               "SwiGLU in the grouped GEMM epilogues: \"auto\" (backward; forward where measured faster), \"on\" "
               "or \"off\""),
      MF_FIELD(kernels, "attention", attention,
               "causal attention: \"auto\" (cuDNN where built and able, else own), \"own\" or \"cudnn\""),
      MF_FIELD(kernels, "deterministic_attention", deterministic_attention,
               "cuDNN attention backward's deterministic engine (bit-identical reruns); false: faster, atomic dQ"),
  };
  return f;
}
#undef MF_FIELD

const Field* find_field(std::string_view section, std::string_view key) {
  for (const Field& f : fields())
    if (section == f.section && key == f.key) return &f;
  return nullptr;
}

std::string where_of(const std::string& origin, const toml::node& n) {
  const auto& src = n.source();
  if (src.begin.line == 0) return origin;
  return cat(origin, ":", src.begin.line);
}

// Assigns TOML value `n` to the field, checking its type. `what` names the place for errors.
void assign(Config& c, const Field& f, const toml::node& n, const std::string& what) {
  std::string name = cat(f.section, ".", f.key);
  std::visit(
      [&](auto* p) {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, uint64_t> || std::is_same_v<T, int>) {
          auto v = n.value_exact<int64_t>();
          if (!v) MF_FAIL(what, ": ", name, " must be an integer");
          if (std::is_same_v<T, uint64_t> && *v < 0) MF_FAIL(what, ": ", name, " must be >= 0, got ", *v);
          if (std::is_same_v<T, int> && (*v < INT_MIN || *v > INT_MAX))
            MF_FAIL(what, ": ", name, " = ", *v, " is out of range");
          *p = static_cast<T>(*v);
        } else if constexpr (std::is_same_v<T, double>) {
          auto v = n.value<double>();  // integers are accepted for floats
          if (!v || !(n.is_floating_point() || n.is_integer())) MF_FAIL(what, ": ", name, " must be a number");
          *p = *v;
        } else if constexpr (std::is_same_v<T, bool>) {
          auto v = n.value_exact<bool>();
          if (!v) MF_FAIL(what, ": ", name, " must be true or false");
          *p = *v;
        } else if constexpr (std::is_same_v<T, std::string>) {
          auto v = n.value_exact<std::string>();
          if (!v) MF_FAIL(what, ": ", name, " must be a string");
          *p = *v;
        } else if constexpr (std::is_same_v<T, std::vector<int64_t>> || std::is_same_v<T, std::vector<std::string>>) {
          using E = typename T::value_type;
          const char* kind = std::is_same_v<E, int64_t> ? "integers" : "strings";
          const toml::array* a = n.as_array();
          if (!a) MF_FAIL(what, ": ", name, " must be an array of ", kind);
          p->clear();
          for (const toml::node& e : *a) {
            auto v = e.value_exact<E>();
            if (!v) MF_FAIL(what, ": ", name, " must be an array of ", kind);
            p->push_back(*v);
          }
        } else if constexpr (std::is_same_v<T, ScoreFunc>) {
          auto v = n.value_exact<std::string>();
          if (v && *v == "softmax")
            *p = ScoreFunc::softmax;
          else if (v && *v == "sigmoid")
            *p = ScoreFunc::sigmoid;
          else
            MF_FAIL(what, ": ", name, " must be \"softmax\" or \"sigmoid\"");
        } else if constexpr (TextCoded<T>) {
          auto v = n.value_exact<std::string>();
          if (!v) MF_FAIL(what, ": ", name, " must be a string");
          parse_text(*v, cat(what, ": ", name), p);
        }
      },
      f.ref(c));
}

bool is_section(std::string_view name) {
  for (const Field& f : fields())
    if (name == f.section) return true;
  return false;
}

// "[model], [moe], ...": the sections in the order config_to_toml writes them.
std::string section_list() {
  std::string list, last;
  for (const Field& f : fields())
    if (last != f.section) {
      list += cat(list.empty() ? "" : ", ", "[", f.section, "]");
      last = f.section;
    }
  return list;
}

void apply_table(Config& c, const toml::table& root, const std::string& origin) {
  for (const auto& [key, node] : root) {
    std::string k(key.str());
    if (k == "preset") continue;  // consumed by load_config
    const toml::table* sec = node.as_table();
    if (!sec) {
      if (is_section(k)) MF_FAIL(where_of(origin, node), ": '", k, "' must be a [", k, "] section");
      MF_FAIL(where_of(origin, node), ": unknown key '", k, "' (sections: ", section_list(), ")");
    }
    for (const auto& [sk, sn] : *sec) {
      const Field* f = find_field(k, sk.str());
      if (!f) {
        if (!is_section(k))
          MF_FAIL(where_of(origin, node), ": unknown section [", k, "] (sections: ", section_list(), ")");
        MF_FAIL(where_of(origin, sn), ": unknown key '", k, ".", sk.str(), "'");
      }
      assign(c, *f, sn, where_of(origin, sn));
    }
  }
}

void apply_override(Config& c, const std::string& ov) {
  std::string what = cat("--set ", ov);
  auto eq = ov.find('=');
  auto dot = ov.find('.');
  if (eq == std::string::npos || dot == std::string::npos || dot > eq) MF_FAIL(what, ": expected section.key=value");
  std::string section = ov.substr(0, dot), key = ov.substr(dot + 1, eq - dot - 1), value = ov.substr(eq + 1);
  const Field* f = find_field(section, key);
  if (!f) MF_FAIL(what, ": unknown key '", section, ".", key, "'");
  toml::table t;
  try {
    t = toml::parse("v = " + value);
  } catch (const toml::parse_error&) {
    t = toml::table{{"v", value}};  // a bare word: a string
  }
  assign(c, *f, *t.get("v"), what);
}

// Shortest text that reads back as the same double, always a TOML float.
std::string format_double(double v) {
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  if (std::isnan(v)) return "nan";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, v);
  std::string s(buf, r.ptr);
  if (s.find_first_of(".en") == std::string::npos) s += ".0";
  return s;
}

}  // namespace

Config load_config(const std::string& spec, const std::vector<std::string>& overrides) {
  Config c;
  bool is_file =
      spec.ends_with(".toml") || spec.find('/') != std::string::npos || std::filesystem::is_regular_file(spec);
  if (spec.empty()) {
    c = preset_config("tiny");
  } else if (!is_file) {
    c = preset_config(spec);
  } else {
    std::error_code ec;
    if (!std::filesystem::is_regular_file(spec, ec)) MF_FAIL(spec, ": config file not found");
    toml::table root;
    try {
      root = toml::parse_file(spec);
    } catch (const toml::parse_error& e) {
      MF_FAIL(spec, ":", e.source().begin.line, ": TOML syntax error: ", e.description());
    }
    std::string base = "tiny";
    if (const toml::node* p = root.get("preset")) {
      auto v = p->value_exact<std::string>();
      if (!v) MF_FAIL(where_of(spec, *p), ": preset must be a string");
      base = *v;
    }
    try {
      c = preset_config(base);
    } catch (const Error& e) {
      MF_FAIL(spec, ": ", e.what());
    }
    apply_table(c, root, spec);
  }
  for (const std::string& ov : overrides) apply_override(c, ov);
  try {
    c.validate();
  } catch (const Error& e) {
    if (is_file) MF_FAIL(spec, ": ", e.what());
    throw;
  }
  return c;
}

std::string config_to_toml(const Config& cc) {
  Config& c = const_cast<Config&>(cc);  // fields() hands out mutable refs; nothing is written here
  std::ostringstream os;
  os.precision(17);
  os << "preset = \"" << c.preset << "\"\n";
  std::string section;
  for (const Field& f : fields()) {
    if (section != f.section) {
      section = f.section;
      os << "\n[" << section << "]\n";
    }
    os << f.key << " = ";
    std::visit(
        [&](auto* p) {
          using T = std::remove_pointer_t<decltype(p)>;
          if constexpr (std::is_same_v<T, std::string>)
            os << toml::value<std::string>(*p);
          else if constexpr (std::is_same_v<T, bool>)
            os << (*p ? "true" : "false");
          else if constexpr (std::is_same_v<T, ScoreFunc>)
            os << (*p == ScoreFunc::softmax ? "\"softmax\"" : "\"sigmoid\"");
          else if constexpr (std::is_same_v<T, double>)
            os << format_double(*p);
          else if constexpr (TextCoded<T>)
            os << toml::value<std::string>(text_of(*p));
          else if constexpr (std::is_same_v<T, std::vector<int64_t>> || std::is_same_v<T, std::vector<std::string>>) {
            os << "[";
            for (size_t i = 0; i < p->size(); ++i)
              os << (i ? ", " : "") << toml::value<typename T::value_type>((*p)[i]);
            os << "]";
          } else
            os << *p;
        },
        f.ref(c));
    os << "  # " << f.doc << "\n";
  }
  return os.str();
}

}  // namespace moefold

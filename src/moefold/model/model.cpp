#include "moefold/model/model.h"

#include <algorithm>

#include "moefold/core/device.h"
#include "moefold/core/profile.h"
#include "moefold/core/rng.h"
#include "moefold/model/mla.h"
#include "moefold/ops/fp8.h"
#include "moefold/ops/ops.h"
#include "moefold/parallel/vocab_parallel.h"

namespace moefold {

namespace {

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}
}  // namespace

namespace {
std::unique_ptr<SelfAttention> make_attention(const ModelConfig& m, int64_t batch, int64_t seq_len,
                                              const std::string& prefix) {
  if (m.is_mla()) return std::make_unique<MlaAttention>(m, batch, seq_len, prefix, attention_softmax_scale(m));
  return std::make_unique<Attention>(m, batch, seq_len, prefix);
}
}  // namespace

DecoderLayer::DecoderLayer(const ModelConfig& m, const MoeConfig& e, int64_t batch, int64_t seq_len, int64_t rows,
                           int64_t tp, int64_t index, std::unique_ptr<Dispatcher> dispatcher,
                           const Recompute& recompute, const Offload& offload)
    : cfg_(m), rows_(rows), prefix_(cat("model.layers.", index)), recompute_(recompute), offload_(offload) {
  attn_ = make_attention(m, batch, seq_len, prefix_ + ".self_attn");
  const int64_t h = m.hidden_size;
  if (m.is_dense_layer(index)) {
    mlp_ = std::make_unique<DenseMlp>(h, m.intermediate_size, rows, rows * tp, prefix_ + ".mlp", m.initializer_range);
    return;
  }
  // Mixtral names its MoE block "block_sparse_moe" (see hf_names.h for its experts' names).
  const std::string mlp = prefix_ + (m.architecture == "mixtral" ? ".block_sparse_moe" : ".mlp");
  moe_ = std::make_unique<MoeLayer>(e, h, rows, mlp,
                                    dispatcher ? std::move(dispatcher) : std::make_unique<LocalDispatcher>(e, h, rows));
  moe_->set_init_std(m.initializer_range);
  if (e.n_shared_experts > 0)
    mlp_ = std::make_unique<DenseMlp>(h, e.n_shared_experts * e.moe_intermediate_size, rows, rows * tp,
                                      mlp + ".shared_experts", m.initializer_range);
}

void DecoderLayer::bind(Memory& mem, const Tensor& cos_SD, const Tensor& sin_SD, AttentionScratch* scratch,
                        ContextParallelAttention* cp, Communicator* tp, const Tensor& dn_TH, bool whole) {
  ctx_ = &mem.exec();
  const int64_t h = cfg_.hidden_size;
  const Recompute r = whole ? Recompute{} : recompute_;
  const Offload o = whole ? Offload{} : offload_;  // a layer recomputed whole keeps only its input
  norms_again_ = r.layernorm;
  norm1_ = mem.param({.name = prefix_ + ".input_layernorm.weight", .shape = {h}, .init = Init::ones, .decay = false});
  dnorm1_ = mem.grad(prefix_ + ".input_layernorm.weight");
  attn_->set_recompute(r.core_attn, r.mla_up_proj);
  attn_->set_offload(o.qkv_linear, o.core_attn, o.attn_proj);
  attn_->set_fp8(fp8_.qkv, fp8_.attn_proj);
  attn_->bind(mem, cos_SD, sin_SD, scratch, cp, tp);
  norm2_ = mem.param(
      {.name = prefix_ + ".post_attention_layernorm.weight", .shape = {h}, .init = Init::ones, .decay = false});
  dnorm2_ = mem.grad(prefix_ + ".post_attention_layernorm.weight");
  if (moe_) {
    moe_->set_recompute(r.moe_act, r.moe);
    moe_->set_offload(o.expert_fc1, o.moe_act);
    moe_->set_fp8(fp8_.experts);
    moe_->bind(mem);
  }
  side_ = moe_ && mlp_ && shared_ctx_ != ctx_ ? shared_ctx_ : nullptr;
  if (mlp_) {
    mlp_->set_recompute(moe_ ? r.shared_experts : r.mlp);
    mlp_->set_fp8(moe_ ? fp8_.shared_experts : fp8_.mlp);
    mlp_->bind(mem, tp, side_);
  }
  dn_TH_ = dn_TH;
  n1_TH_ = norms_again_ ? mem.scratch({rows_, h}) : o.qkv_linear ? mem.offloaded({rows_, h}) : mem.act({rows_, h});
  rstd1_T_ = mem.act({rows_}, mem.master_dtype());
  h_TH_ = o.mlp_norm ? mem.offloaded({rows_, h}) : mem.act({rows_, h});
  n2_TH_ = norms_again_ ? mem.scratch({rows_, h}) : mem.act({rows_, h});
  rstd2_T_ = mem.act({rows_}, mem.master_dtype());
  const bool shared = moe_ && mlp_;
  a_TH_ = mem.scratch({rows_, h});
  m_TH_ = mem.scratch({rows_, h});
  s_TH_ = mem.scratch({shared ? rows_ : 0, h});
  ds_TH_ = mem.scratch({shared ? rows_ : 0, h});
}

// Profile scopes: one name per part for every layer; the layer's own (self) time is its
// residual add after the MLP (the one after attention is fused into the second RMSNorm).
void DecoderLayer::forward(const Tensor& x_TH, const Tensor& out_TH) {
  ProfileScope layer("decoder layer forward");
  forward_attention(x_TH, out_TH);
  if (!moe_) return;
  shared_forward_start();
  {
    ProfileScope scope("moe forward");
    moe_->forward(n2_TH_, m_TH_);
  }
  forward_tail(out_TH);
}

void DecoderLayer::forward_attention(const Tensor& x_TH, const Tensor& out_TH) {
  x_TH_ = x_TH;
  {
    ProfileScope scope("rmsnorm forward");
    rmsnorm_forward(*ctx_, x_TH, norm1_, cfg_.rms_norm_eps, n1_TH_, rstd1_T_);
  }
  {
    ProfileScope scope("attention forward");
    attn_->forward(n1_TH_, a_TH_);
  }
  {  // h = x + a, kept; its norm; out = h (the residual the MLP's output is added to)
    ProfileScope scope("rmsnorm forward");
    add_rmsnorm_forward(*ctx_, x_TH, a_TH_, norm2_, cfg_.rms_norm_eps, h_TH_, n2_TH_, rstd2_T_, out_TH);
  }
  if (moe_) return;
  {
    ProfileScope scope("dense mlp forward");
    mlp_->forward(n2_TH_, m_TH_);
  }
  add_inplace(*ctx_, out_TH, m_TH_);
}

void DecoderLayer::shared_forward_start() {
  if (side_ == nullptr) return;
  side_->wait_for(*ctx_);  // n2 is ready, and the layer before is done with the shared workspace
  mlp_->forward(n2_TH_, s_TH_);
}

void DecoderLayer::forward_tail(const Tensor& out_TH) {
  if (!mlp_) {
    add_inplace(*ctx_, out_TH, m_TH_);
    return;
  }
  // Shared experts see every token.
  if (side_) {
    ProfileScope scope("shared experts forward (wait)");  // what of them the routed experts did not hide
    ctx_->wait_for(*side_);
  } else {
    ProfileScope scope("shared experts forward");
    mlp_->forward(n2_TH_, s_TH_);
  }
  add_two_inplace(*ctx_, out_TH, m_TH_, s_TH_);  // the routed experts' output, then the shared ones'
}

void DecoderLayer::forward_begin(const Tensor& x_TH, const Tensor& out_TH) {
  forward_attention(x_TH, out_TH);
  if (!moe_) return;
  ProfileScope scope("moe forward");
  moe_->forward_dispatch(n2_TH_);
}

void DecoderLayer::forward_experts() {
  if (!moe_) return;
  ProfileScope scope("moe forward");
  moe_->forward_experts();
}

void DecoderLayer::forward_end(const Tensor& out_TH) {
  if (!moe_) return;
  shared_forward_start();  // beside the combine (not earlier: between the phases another layer runs)
  {
    ProfileScope scope("moe forward");
    moe_->forward_combine(m_TH_);
  }
  forward_tail(out_TH);
}

void DecoderLayer::backward(const Tensor& dres_TH, double moe_loss_scale) {
  ProfileScope layer("decoder layer backward");
  recompute_norms();
  if (moe_) {
    shared_backward_start(dres_TH);
    ProfileScope scope("moe backward");
    moe_->backward(dres_TH, dn_TH_, moe_loss_scale);
  }
  backward_tail(dres_TH);
}

void DecoderLayer::recompute_norms() {
  if (!norms_again_) return;  // both outputs, from the kept inputs (the same op: the same bits)
  ProfileScope scope("recompute rmsnorm forward");
  rmsnorm_forward(*ctx_, h_TH_, norm2_, cfg_.rms_norm_eps, n2_TH_, rstd2_T_);
  rmsnorm_forward(*ctx_, x_TH_, norm1_, cfg_.rms_norm_eps, n1_TH_, rstd1_T_);
}

void DecoderLayer::shared_backward_start(const Tensor& dres_TH) {
  if (side_ == nullptr) return;
  side_->wait_for(*ctx_);  // d(out) is ready (and n2, recomputed)
  mlp_->backward(dres_TH, ds_TH_);
}

void DecoderLayer::backward_tail(const Tensor& dres_TH) {
  if (moe_ && mlp_) {
    if (side_) {
      ProfileScope scope("shared experts backward (wait)");
      ctx_->wait_for(*side_);
    } else {
      ProfileScope scope("shared experts backward");
      mlp_->backward(dres_TH, ds_TH_);
    }
    add_inplace(*ctx_, dn_TH_, ds_TH_);
  } else if (!moe_) {
    ProfileScope scope("dense mlp backward");
    mlp_->backward(dres_TH, dn_TH_);
  }
  {
    ProfileScope scope("rmsnorm backward");
    rmsnorm_backward_add(*ctx_, h_TH_, norm2_, rstd2_T_, dn_TH_, dres_TH, dnorm2_);  // d(h)
  }
  {
    ProfileScope scope("attention backward");
    attn_->backward(dres_TH, dn_TH_);
  }
  {
    ProfileScope scope("rmsnorm backward");
    rmsnorm_backward_add(*ctx_, x_TH_, norm1_, rstd1_T_, dn_TH_, dres_TH, dnorm1_);  // d(x)
  }
}

void DecoderLayer::backward_begin(const Tensor& dres_TH) {
  recompute_norms();
  if (!moe_) return;
  ProfileScope scope("moe backward");
  moe_->backward_combine(dres_TH);
}

void DecoderLayer::backward_experts() {
  if (!moe_) return;
  ProfileScope scope("moe backward");
  moe_->backward_experts();
}

void DecoderLayer::backward_end(const Tensor& dres_TH, double moe_loss_scale) {
  if (moe_) {
    shared_backward_start(dres_TH);  // beside the dispatch's backward
    ProfileScope scope("moe backward");
    moe_->backward_dispatch(dn_TH_, moe_loss_scale);
  }
  backward_tail(dres_TH);
}

Model::Model(const ModelConfig& m, const MoeConfig& e, int64_t micro_batch, int64_t seq_len,
             const ModelParallel& parallel, const Recompute& recompute, const Offload& offload, const Fp8Linears& fp8)
    : offload_(offload), fp8_mtp_(fp8.mtp), cfg_(m), moe_cfg_(e), batch_(micro_batch), seq_len_(seq_len) {
  const int64_t c = parallel.cp ? parallel.cp->size() : 1, n = parallel.tp ? parallel.tp->size() : 1;
  MF_CHECK(seq_len % (c > 1 ? 2 * c : 1) == 0, "seq_len ", seq_len, " over ", c, " context-parallel ranks");
  local_seq_len_ = seq_len / c;
  tokens_ = micro_batch * local_seq_len_;
  MF_CHECK(
      tokens_ % n == 0 && m.vocab_size % n == 0 && m.num_attention_heads % n == 0 && m.num_key_value_heads % n == 0,
      "tensor parallelism over ", n, " ranks: ", tokens_, " tokens, vocab ", m.vocab_size);
  rows_ = tokens_ / n;  // sequence parallelism: this TP rank's rows of the residual stream
  tp_ = n > 1 ? parallel.tp : nullptr;
  vocab_offset_ = tp_ ? tp_->rank() * (m.vocab_size / n) : 0;
  if (c > 1) {  // MLA: every head has its own key and value in the core, at the padded width
    const int64_t kv_heads = m.is_mla() ? m.num_attention_heads : m.num_key_value_heads;
    const int64_t d = m.is_mla() ? MlaAttention::core_head_dim(m) : m.head_dim;
    cpa_ = std::make_unique<ContextParallelAttention>(
        *parallel.cp, CpAttentionShape{micro_batch, seq_len, m.num_attention_heads / n, kv_heads / n, d});
  }
  const PipelineStage& stage = parallel.stage;
  first_layer_ = stage.first_layer;
  first_stage_ = stage.first;
  last_stage_ = stage.last;
  const int64_t layers = stage.num_layers < 0 ? m.num_hidden_layers : stage.num_layers;
  MF_CHECK(first_layer_ >= 0 && first_layer_ + layers <= m.num_hidden_layers && (first_stage_ == (first_layer_ == 0)) &&
               (last_stage_ == (first_layer_ + layers == m.num_hidden_layers)),
           "pipeline stage of layers [", first_layer_, ", ", first_layer_ + layers, ") of ", m.num_hidden_layers);
  const int64_t chunk = std::min(recompute.num_layers, layers);  // per stage (Megatron-Core's meaning)
  MF_CHECK(chunk >= 0, "recompute ", chunk, " of ", layers, " layers");
  for (int64_t l = 0; l < layers; ++l) {  // uniform: chunks of `chunk` layers; block: the first `chunk`, one by one
    const bool whole = chunk > 0 && (!recompute.block || l < chunk);
    recompute_slot_.push_back(!whole ? -1 : recompute.block ? 0 : static_cast<int>(l % chunk));
    chunk_first_.push_back(!whole || recompute.block ? l : l / chunk * chunk);
  }
  int offloading = 0;  // layers offloading so far
  for (int64_t l = 0; l < layers; ++l)
    offload_slot_.push_back(offload.any() && recompute_slot_[l] < 0 ? offloading++ % kOffloadSlots : -1);
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t g = first_layer_ + l;  // the whole model's index: names and dispatchers
    const bool dense = m.is_dense_layer(g);
    layers_.push_back(std::make_unique<DecoderLayer>(m, e, micro_batch, local_seq_len_, rows_, n, g,
                                                     !dense && parallel.dispatchers ? parallel.dispatchers(g) : nullptr,
                                                     recompute, offload));
    layers_.back()->set_phased(parallel.phased);
    layers_.back()->set_fp8(fp8);
    if (MoeLayer* moe = layers_.back()->moe()) {
      moe->set_token_group(parallel.tokens);
      // Sequence-level aux loss: this rank's rows are rows [tp_rank * T, +T) of B sequences of
      // local_seq_len_ local tokens each (S over the CP group).
      moe->set_sequences(micro_batch, local_seq_len_, (n > 1 ? parallel.tp->rank() : 0) * rows_, seq_len);
      moe_layers_.push_back(moe);
    }
  }
  for (int64_t k = 1; last_stage_ && k <= m.num_nextn_predict_layers; ++k) {
    MF_CHECK(c == 1, "multi-token prediction under context parallelism");
    mtp_.push_back(
        std::make_unique<MtpDepth>(m, e, micro_batch, local_seq_len_, rows_, tokens_, n, k,
                                   parallel.dispatchers ? parallel.dispatchers(m.num_hidden_layers + k - 1) : nullptr));
    mtp_.back()->layer().set_fp8(fp8);
    MoeLayer* moe = mtp_.back()->layer().moe();
    moe->set_token_group(parallel.tokens);
    moe->set_sequences(micro_batch, local_seq_len_, (n > 1 ? parallel.tp->rank() : 0) * rows_, seq_len);
    moe_layers_.push_back(moe);
  }
}

void Model::bind(Memory& mem) {
  ctx_ = &mem.exec();
  mem_ = &mem;
  graphs_.clear();
  const int64_t h = cfg_.hidden_size, n = tp_ ? tp_->size() : 1;
  const int64_t v = cfg_.vocab_size / n;
  const double std = cfg_.initializer_range;
  const ParamGroup tpg = ParamGroup::tensor_parallel;
  // Vocabulary-parallel embedding and LM head: rows [vocab_offset_, + V/tp) here. The first stage
  // embeds; the last one has a copy for multi-token prediction.
  embed_ = dembed_ = Tensor();
  if (first_stage_ || !mtp_.empty()) {
    embed_ = mem.param({.name = "model.embed_tokens.weight",
                        .shape = {v, h},
                        .init_std = std,
                        .group = tpg,
                        .shard_offset = vocab_offset_,
                        .global_rows = cfg_.vocab_size,
                        .pipeline_copy = !first_stage_});
    dembed_ = mem.grad("model.embed_tokens.weight");
  }
  mem.set_part("model (shared)");
  cos_SD_ = mem.act({seq_len_, cfg_.head_dim}, mem.master_dtype());  // f32 tables (f64 in gradient checks)
  sin_SD_ = mem.act({seq_len_, cfg_.head_dim}, mem.master_dtype());
  scratch_.bind(mem, cfg_, tokens_, local_seq_len_, cfg_.num_attention_heads / n * cfg_.head_dim,
                cfg_.num_key_value_heads / n * cfg_.head_dim);
  if (cpa_) cpa_->bind(mem);
  dn_TH_ = mem.act({rows_, h});
  // The residual stream: each layer's input, except inside a recomputed chunk, where a layer's
  // input is part of its recomputed activations (its slot), and the model's output.
  // With attn_norm offloaded, an offloading layer's input is in its offload slot.
  res_.assign(static_cast<size_t>(num_layers() + 1), Tensor());
  auto offloaded_input = [&](int64_t l) { return offload_.attn_norm && offloads(l); };
  for (int64_t l = 0; l <= num_layers(); ++l)
    if (l == num_layers() || (recompute_slot_[l] <= 0 && !offloaded_input(l))) res_[l] = mem.act({rows_, h});
  offload_blocks_.clear();
  if (moe_cfg_.shared_expert_overlap && !mem.measuring() && !shared_)
    shared_ = std::make_unique<ExecContext>(ctx_->device(), ctx_->kernels(), ExecContext::Stream::own);
  const ExecContext* shared = mem.measuring() ? nullptr : shared_.get();
  for (auto& layer : layers_) layer->set_shared_context(shared);
  for (auto& d : mtp_) d->layer().set_shared_context(shared);
  for (size_t l = 0; l < layers_.size(); ++l) {
    mem.set_part(cat("layers.", l));
    mem.begin_layer(recompute_slot_[l], offload_slot_[l]);
    if (recompute_slot_[l] > 0) res_[l] = mem.act({rows_, h});
    if (offloaded_input(static_cast<int64_t>(l))) res_[l] = mem.offloaded({rows_, h});
    layers_[l]->bind(mem, cos_SD_, sin_SD_, &scratch_, cpa_.get(), tp_, dn_TH_, recompute_slot_[l] >= 0);
    offload_blocks_.push_back(mem.end_layer());
  }
  copy_.reset();
  if (offload_.any() && !mem.measuring()) {
    MF_CHECK(mem.device() == Device::cuda, "activation offload needs the CUDA device");
    copy_ = std::make_unique<ExecContext>(Device::cuda, ctx_->kernels(), ExecContext::Stream::own);
  }
  mtp_losses_D_ = mem.result({static_cast<int64_t>(mtp_.size())}, DType::f64);
  for (size_t k = 0; k < mtp_.size(); ++k) {
    mem.set_part(cat("mtp.", k));
    bind_mtp(mem, *mtp_[k]);
    mtp_[k]->loss_1_ = mtp_losses_D_.slice(static_cast<int64_t>(k), static_cast<int64_t>(k) + 1);
  }
  mem.set_part("head");
  ids_ = Tensor();
  targets_ = Tensor();
  if (last_stage_) {
    norm_ = mem.param({.name = "model.norm.weight", .shape = {h}, .init = Init::ones, .decay = false});
    dnorm_ = mem.grad("model.norm.weight");
    lm_head_ = mem.param({.name = "lm_head.weight",
                          .shape = {v, h},
                          .init_std = std,
                          .group = tpg,
                          .shard_offset = vocab_offset_,
                          .global_rows = cfg_.vocab_size});
    dlm_head_ = mem.grad("lm_head.weight");
    nf_TH_ = mem.act({rows_, h});
    rstdf_T_ = mem.act({rows_}, mem.master_dtype());
    logits_TV_ = mem.act({tokens_, v});
    lse_T_ = mem.act({tokens_}, mem.master_dtype());
    dnf_TH_ = mem.act({rows_, h});
    loss_sum_1_ = mem.result({1}, DType::f64);
  }
  dres_TH_ = mem.act({rows_, h});
  full_NH_ = mem.act({tp_ ? tokens_ : 0, h});
  partial_NH_ = mem.act({tp_ ? tokens_ : 0, h});
  if (tp_ && last_stage_) ce_scratch_.bind(mem, tokens_);
  if (!mem.measuring()) {
    double attention_factor = 1.0;
    const std::vector<double> inv_freq = rope_inv_freq(cfg_, &attention_factor);
    if (cos_SD_.device() == Device::cpu) {
      rope_table(inv_freq, attention_factor, cos_SD_, sin_SD_);
    } else {  // built on the host, copied once (binding time, not the step loop)
      std::vector<float> c(static_cast<size_t>(cos_SD_.numel())), sn(c.size());
      const Tensor hc(c.data(), DType::f32, cos_SD_.shape()), hs(sn.data(), DType::f32, sin_SD_.shape());
      rope_table(inv_freq, attention_factor, hc, hs);
      cos_SD_.copy_from(hc, ctx_);
      sin_SD_.copy_from(hs, ctx_);
    }
  }
}

int64_t Model::offloaded_before(int64_t layer) const {
  for (int64_t l = layer - 1; l >= 0; --l)
    if (offloads(l)) return l;
  return -1;
}

void Model::offload_after_forward(int64_t layer) {
  const Memory::OffloadBlock& b = offload_blocks_[static_cast<size_t>(layer)];
  copy_->wait_for(*ctx_);
  device_copy_async(b.host, Device::cpu, b.device, Device::cuda, b.bytes, copy_->stream());
}

void Model::fetch_before_backward(int64_t layer) {
  const Memory::OffloadBlock& b = offload_blocks_[static_cast<size_t>(layer)];
  copy_->wait_for(*ctx_);
  device_copy_async(b.device, Device::cuda, b.host, Device::cpu, b.bytes, copy_->stream());
}

void Model::init_params(const ExecContext& ctx, std::vector<Param>& params, uint64_t seed) {
  for (Param& p : params) {
    if (p.init == Init::normal) {
      // A shard draws the values of its elements in the whole tensor (same init for any layout);
      // GPU parameters are drawn on the GPU (the same values, ops.h fill_normal_any).
      fill_normal_shard(p, seed, fnv1a(p.name), 0.0, p.init_std,
                        [&ctx](const Tensor& t, uint64_t seed_, uint64_t stream, double mean, double std,
                               uint64_t first) { fill_normal_any(ctx, t, seed_, stream, mean, std, first); });
      continue;
    }
    // Constants: through a host copy for GPU parameters (norm weights and biases: small).
    std::vector<char> staging(p.value.device() == Device::cpu ? 0 : static_cast<size_t>(p.value.nbytes()));
    const Tensor host = staging.empty() ? p.value : Tensor(staging.data(), p.value.dtype(), p.value.shape());
    fill_constant(host, p.init == Init::ones ? 1.0 : 0.0);
    if (!staging.empty()) p.value.copy_from(host, &ctx);
  }
}

double Model::forward(const Tensor& ids_BS, const Tensor& targets_BS,
                      const std::function<void(int64_t point)>& weights_needed) {
  check_shape(ids_BS, {batch_, local_seq_len_}, "model input ids");
  check_shape(targets_BS, {batch_, local_seq_len_}, "model targets");
  auto needed = [&](int64_t point) {
    if (weights_needed) weights_needed(point);
  };
  ids_ = ids_BS.view({tokens_});
  targets_ = targets_BS.view({tokens_});
  if (copy_) ctx_->wait_for(*copy_);  // the last backward's fetches into the slots
  if (first_stage_ || !mtp_.empty()) needed(-1);
  if (first_stage_) embed(ids_, res_[0]);  // else the caller wrote input()
  for (int64_t l = 0; l < num_layers(); ++l) {
    needed(first_layer_ + l);
    if (copy_ && l > 0) {
      // Layer l and its output (the next layer's input) overwrite the slots of the offloading layers
      // three and two before them, whose copies to the host were started before this point; then
      // layer l - 1's starts (where it offloads).
      ctx_->wait_for(*copy_);
      if (offloads(l - 1)) offload_after_forward(l - 1);
    }
    graphs_.forward(
        *ctx_, *mem_, l, [&] { layers_[l]->forward(res_[l], res_[l + 1]); }, [&] { layers_[l]->forward_replayed(); });
  }
  if (copy_ && offloads(num_layers() - 1)) offload_after_forward(num_layers() - 1);
  if (!last_stage_) return 0.0;  // the caller sends output() on
  needed(total_layers());
  const double loss = head_forward(res_.back(), norm_, nf_TH_, rstdf_T_, full_NH_, logits_TV_, lse_T_, targets_,
                                   loss_on_device_ ? loss_sum_1_ : Tensor());
  const Tensor* prev = &res_.back();
  for (auto& d : mtp_) {
    ProfileScope scope("mtp forward");
    mtp_forward(*d, *prev);
    prev = &d->out_TH_;
  }
  return loss;
}

double Model::head_forward(const Tensor& h_TH, const Tensor& norm, const Tensor& nf_TH, const Tensor& rstd_T,
                           const Tensor& nf_full_NH, const Tensor& logits_NV, const Tensor& lse_N,
                           const Tensor& targets_N, const Tensor& loss_1) {
  ProfileScope head("lm head + loss forward");
  {
    ProfileScope scope("final rmsnorm forward");
    rmsnorm_forward(*ctx_, h_TH, norm, cfg_.rms_norm_eps, nf_TH, rstd_T);
  }
  if (tp_) tp_->all_gather(nf_TH, nf_full_NH);
  {
    ProfileScope scope("lm head gemm forward");
    linear_forward(*ctx_, tp_ ? nf_full_NH : nf_TH, lm_head_, logits_NV);
  }
  // The loss comes back to the host here (the host waits for the stream), or stays on the device.
  ProfileScope scope("cross entropy forward + loss read-back");
  if (!tp_) return cross_entropy_forward(*ctx_, logits_NV, targets_N, lse_N, loss_1);
  return vocab_parallel_cross_entropy_forward(*ctx_, *tp_, logits_NV, vocab_offset_, targets_N, lse_N, ce_scratch_);
}

void Model::head_backward(const Tensor& h_TH, const Tensor& norm, const Tensor& dnorm, const Tensor& nf_TH,
                          const Tensor& rstd_T, const Tensor& nf_full_NH, const Tensor& logits_NV, const Tensor& lse_N,
                          const Tensor& targets_N, double scale, const Tensor& dh_TH) {
  ProfileScope head("lm head + loss backward");
  {
    ProfileScope scope("cross entropy backward");
    // In place: each logit's gradient over the logit (the largest tensor of a step, kept once).
    if (tp_)
      vocab_parallel_cross_entropy_backward(*ctx_, logits_NV, vocab_offset_, targets_N, lse_N, scale, logits_NV);
    else
      cross_entropy_backward(*ctx_, logits_NV, targets_N, lse_N, scale, logits_NV);
  }
  {
    ProfileScope scope("lm head gemm backward");
    linear_backward(*ctx_, tp_ ? nf_full_NH : nf_TH, lm_head_, logits_NV, tp_ ? partial_NH_ : dnf_TH_, dlm_head_);
  }
  if (tp_) tp_->reduce_scatter(partial_NH_, dnf_TH_, ReduceOp::sum);
  ProfileScope scope("final rmsnorm backward");
  rmsnorm_backward(*ctx_, h_TH, norm, rstd_T, dnf_TH_, dh_TH, dnorm);
}

void Model::embed(const Tensor& ids_N, const Tensor& out_TH) {
  ProfileScope scope("embedding forward");
  if (tp_) {  // every token's partial embedding from this vocabulary shard; rows summed and split
    vocab_parallel_embedding_forward(*ctx_, ids_N, embed_, vocab_offset_, partial_NH_);
    tp_->reduce_scatter(partial_NH_, out_TH, ReduceOp::sum);
  } else {
    embedding_forward(*ctx_, ids_N, embed_, out_TH);
  }
}

void Model::embed_backward(const Tensor& ids_N, const Tensor& dout_TH) {
  ProfileScope scope("embedding backward");
  if (tp_) {
    tp_->all_gather(dout_TH, full_NH_);
    vocab_parallel_embedding_backward(*ctx_, ids_N, full_NH_, vocab_offset_, dembed_);
  } else {
    embedding_backward(*ctx_, ids_N, dout_TH, dembed_);
  }
}

void Model::backward(double lm_grad_scale, double moe_loss_scale, const std::function<void(int64_t)>& grads_ready) {
  if (last_stage_) backward_top(lm_grad_scale, moe_loss_scale, grads_ready);  // else the caller wrote stream_grad()
  if (copy_ && offloaded_before(num_layers()) >= 0) fetch_before_backward(offloaded_before(num_layers()));
  for (int64_t l = num_layers() - 1; l >= 0; --l) {
    if (copy_ && offloads(l)) {
      // Layer l's block is back (fetched one offloading layer ahead); the next offloading layer's
      // comes back during layer l's backward, into the slot whose layer's backward has finished.
      ctx_->wait_for(*copy_);
      if (offloaded_before(l) >= 0) fetch_before_backward(offloaded_before(l));
    }
    if (recompute_slot_[l] >= 0 && (l + 1 == num_layers() || chunk_first_[l + 1] != chunk_first_[l])) {
      // The last layer of a recomputed chunk: the chunk's forward again, from its kept input (the
      // chunk's output lands on the next chunk's input, which no later step reads).
      ProfileScope scope("recompute layers forward");
      for (int64_t j = chunk_first_[l]; j <= l; ++j) layers_[j]->forward(res_[j], res_[j + 1]);
    }
    graphs_.backward(*ctx_, *mem_, l, moe_loss_scale, [&] { layers_[l]->backward(dres_TH_, moe_loss_scale); });
    if (grads_ready) grads_ready(first_layer_ + l);
  }
  if (first_stage_) embed_backward(ids_, dres_TH_);  // else stream_grad() is d(input) for the caller
}

void Model::backward_top(double lm_grad_scale, double moe_loss_scale, const std::function<void(int64_t)>& grads_ready) {
  head_backward(res_.back(), norm_, dnorm_, nf_TH_, rstdf_T_, full_NH_, logits_TV_, lse_T_, targets_, lm_grad_scale,
                dres_TH_);
  // Multi-token prediction, deepest first: each depth's d(h_prev) flows into the one before it,
  // the first into the main model's output.
  for (int64_t i = static_cast<int64_t>(mtp_.size()) - 1; i >= 0; --i) {
    MtpDepth& d = *mtp_[i];
    const double scale = lm_grad_scale * cfg_.mtp_loss_scaling_factor / static_cast<double>(mtp_.size()) *
                         static_cast<double>(seq_len_) / static_cast<double>(seq_len_ - d.depth_);
    ProfileScope scope("mtp backward");
    mtp_backward(d, scale, moe_loss_scale,
                 i + 1 < static_cast<int64_t>(mtp_.size()) ? &mtp_[i + 1]->dprev_TH_ : nullptr);
  }
  if (!mtp_.empty()) add_inplace(*ctx_, dres_TH_, mtp_.front()->dprev_TH_);
  if (grads_ready) grads_ready(total_layers());
}

double Model::forward_backward(Model& fwd, const Tensor& ids_BS, const Tensor& targets_BS, Model& bwd,
                               double lm_grad_scale, double moe_loss_scale) {
  MF_CHECK(&fwd != &bwd && fwd.first_layer_ == bwd.first_layer_ && fwd.num_layers() == bwd.num_layers() && !fwd.copy_ &&
               !bwd.copy_,
           "Model::forward_backward: two models of one stage (without activation offload)");
  for (const Model* m : {&fwd, &bwd})
    for (int64_t l = 0; l < m->num_layers(); ++l)
      MF_CHECK(m->recompute_slot_[static_cast<size_t>(l)] < 0, "Model::forward_backward with layers recomputed whole");
  check_shape(ids_BS, {fwd.batch_, fwd.local_seq_len_}, "model input ids");
  check_shape(targets_BS, {fwd.batch_, fwd.local_seq_len_}, "model targets");
  fwd.ids_ = ids_BS.view({fwd.tokens_});
  fwd.targets_ = targets_BS.view({fwd.tokens_});
  if (bwd.last_stage_) bwd.backward_top(lm_grad_scale, moe_loss_scale, nullptr);  // else its caller wrote stream_grad()
  if (fwd.first_stage_) fwd.embed(fwd.ids_, fwd.res_[0]);                         // else its caller wrote input()
  const int64_t n = fwd.num_layers();
  for (int64_t t = 0; t < n; ++t) {
    ProfileScope scope("forward and backward interleaved");
    DecoderLayer &f = *fwd.layers_[static_cast<size_t>(t)], &b = *bwd.layers_[static_cast<size_t>(n - 1 - t)];
    b.backward_begin(bwd.dres_TH_);
    f.forward_begin(fwd.res_[static_cast<size_t>(t)], fwd.res_[static_cast<size_t>(t) + 1]);
    b.backward_experts();
    f.forward_experts();
    b.backward_end(bwd.dres_TH_, moe_loss_scale);
    f.forward_end(fwd.res_[static_cast<size_t>(t) + 1]);
  }
  if (bwd.first_stage_) bwd.embed_backward(bwd.ids_, bwd.dres_TH_);
  if (!fwd.last_stage_) return 0.0;
  const double loss = fwd.head_forward(fwd.res_.back(), fwd.norm_, fwd.nf_TH_, fwd.rstdf_T_, fwd.full_NH_,
                                       fwd.logits_TV_, fwd.lse_T_, fwd.targets_);
  const Tensor* prev = &fwd.res_.back();
  for (auto& d : fwd.mtp_) {
    ProfileScope scope("mtp forward");
    fwd.mtp_forward(*d, *prev);
    prev = &d->out_TH_;
  }
  return loss;
}

MtpDepth::MtpDepth(const ModelConfig& m, const MoeConfig& e, int64_t batch, int64_t seq_len, int64_t rows,
                   int64_t tokens, int64_t tp, int64_t depth, std::unique_ptr<Dispatcher> dispatcher)
    : cfg_(m),
      batch_(batch),
      seq_len_(seq_len),
      rows_(rows),
      tokens_(tokens),
      depth_(depth),
      prefix_(cat("model.layers.", m.num_hidden_layers + depth - 1)),
      layer_(std::make_unique<DecoderLayer>(m, e, batch, seq_len, rows, tp, m.num_hidden_layers + depth - 1,
                                            std::move(dispatcher))) {
  MF_CHECK(depth < seq_len, "multi-token prediction depth ", depth, " needs sequences longer than ", seq_len);
}

void Model::bind_mtp(Memory& mem, MtpDepth& d) {
  const int64_t h = cfg_.hidden_size, v = cfg_.vocab_size / (tp_ ? tp_->size() : 1);
  const std::string& p = d.prefix_;
  d.enorm_ = mem.param({.name = p + ".enorm.weight", .shape = {h}, .init = Init::ones, .decay = false});
  d.hnorm_ = mem.param({.name = p + ".hnorm.weight", .shape = {h}, .init = Init::ones, .decay = false});
  d.eh_proj_ = d.fp8_eh_proj_.param(
      mem, {.name = p + ".eh_proj.weight", .shape = {h, 2 * h}, .init_std = cfg_.initializer_range}, fp8_mtp_);
  d.head_norm_ = mem.param({.name = p + ".shared_head.norm.weight", .shape = {h}, .init = Init::ones, .decay = false});
  d.denorm_ = mem.grad(p + ".enorm.weight");
  d.dhnorm_ = mem.grad(p + ".hnorm.weight");
  d.deh_proj_ = mem.grad(p + ".eh_proj.weight");
  d.dhead_norm_ = mem.grad(p + ".shared_head.norm.weight");
  mem.begin_layer();
  d.layer_->bind(mem, cos_SD_, sin_SD_, &scratch_, cpa_.get(), tp_, dn_TH_);
  mem.end_layer();
  d.ids_ = mem.act({tokens_}, DType::i32);
  d.targets_ = mem.act({tokens_}, DType::i32);
  for (Tensor* t : {&d.emb_TH_, &d.en_TH_, &d.hn_TH_, &d.hp_TH_, &d.out_TH_, &d.nf_TH_, &d.dprev_TH_})
    *t = mem.act({rows_, h});
  for (Tensor* t : {&d.en_rstd_, &d.hn_rstd_, &d.nf_rstd_}) *t = mem.act({rows_}, mem.master_dtype());
  d.cat_T2H_ = mem.act({rows_, 2 * h});
  d.dcat_T2H_ = mem.act({rows_, 2 * h});
  d.nf_full_NH_ = mem.act({tp_ ? tokens_ : 0, h});
  d.logits_NV_ = mem.act({tokens_, v});
  d.lse_N_ = mem.act({tokens_}, mem.master_dtype());
}

void Model::mtp_forward(MtpDepth& d, const Tensor& prev_TH) {
  const int64_t h = cfg_.hidden_size, k = d.depth_;
  // Tokens k ahead within each (whole, local) sequence; past the end: id 0, no target.
  const MatrixView ahead_ids{ids_, batch_, local_seq_len_ - k, local_seq_len_, k},
      ahead_targets{targets_, batch_, local_seq_len_ - k, local_seq_len_, k};
  copy_matrix(*ctx_, ahead_ids, MatrixView{d.ids_, batch_, local_seq_len_ - k, local_seq_len_, 0});
  copy_matrix(*ctx_, ahead_targets, MatrixView{d.targets_, batch_, local_seq_len_ - k, local_seq_len_, 0});
  fill_matrix(*ctx_, MatrixView{d.ids_, batch_, k, local_seq_len_, local_seq_len_ - k}, 0);
  fill_matrix(*ctx_, MatrixView{d.targets_, batch_, k, local_seq_len_, local_seq_len_ - k}, kIgnoreTarget);
  d.prev_ = &prev_TH;
  embed(d.ids_, d.emb_TH_);
  rmsnorm_forward(*ctx_, d.emb_TH_, d.enorm_, cfg_.rms_norm_eps, d.en_TH_, d.en_rstd_);
  rmsnorm_forward(*ctx_, prev_TH, d.hnorm_, cfg_.rms_norm_eps, d.hn_TH_, d.hn_rstd_);
  copy_matrix(*ctx_, as_matrix(d.en_TH_), column_block(d.cat_T2H_, 0, h));
  copy_matrix(*ctx_, as_matrix(d.hn_TH_), column_block(d.cat_T2H_, h, 2 * h));
  linear_forward_in(*ctx_, d.fp8_eh_proj_.get(), d.cat_T2H_, d.eh_proj_, d.hp_TH_);
  d.layer_->forward(d.hp_TH_, d.out_TH_);
  d.loss_sum_ = head_forward(d.out_TH_, d.head_norm_, d.nf_TH_, d.nf_rstd_, d.nf_full_NH_, d.logits_NV_, d.lse_N_,
                             d.targets_, loss_on_device_ ? d.loss_1_ : Tensor());
}

void Model::mtp_backward(MtpDepth& d, double scale, double moe_loss_scale, const Tensor* dnext_TH) {
  const int64_t h = cfg_.hidden_size;
  // d(out): this depth's head, plus the next depth's d(h_prev).
  head_backward(d.out_TH_, d.head_norm_, d.dhead_norm_, d.nf_TH_, d.nf_rstd_, d.nf_full_NH_, d.logits_NV_, d.lse_N_,
                d.targets_, scale, d.dprev_TH_);
  if (dnext_TH) add_inplace(*ctx_, d.dprev_TH_, *dnext_TH);
  d.layer_->backward(d.dprev_TH_, moe_loss_scale);  // now d(h')
  linear_backward_in(*ctx_, d.fp8_eh_proj_.get(), d.cat_T2H_, d.eh_proj_, d.dprev_TH_, d.dcat_T2H_, d.deh_proj_);
  // The normed values are not needed any more: en_TH_ and hn_TH_ take their gradients.
  copy_matrix(*ctx_, column_block(d.dcat_T2H_, 0, h), as_matrix(d.en_TH_));
  copy_matrix(*ctx_, column_block(d.dcat_T2H_, h, 2 * h), as_matrix(d.hn_TH_));
  rmsnorm_backward(*ctx_, d.emb_TH_, d.enorm_, d.en_rstd_, d.en_TH_, d.hp_TH_, d.denorm_);
  embed_backward(d.ids_, d.hp_TH_);
  rmsnorm_backward(*ctx_, *d.prev_, d.hnorm_, d.hn_rstd_, d.hn_TH_, d.dprev_TH_, d.dhnorm_);  // d(h_prev)
}

void Model::set_loss_on_device(bool on) {
  MF_CHECK(!on || (last_stage_ && !tp_), "Model: the losses stay on the device only on the last stage without TP");
  loss_on_device_ = on;
}

void Model::set_rows_without_waiting(bool on) {
  for (MoeLayer* l : moe_layers_) l->dispatcher().set_rows_without_waiting(on);
}

void Model::add_mtp_loss(const Tensor& out_1) const {
  MF_CHECK(loss_on_device_, "Model::add_mtp_loss: the losses are not on the device");
  if (mtp_.empty()) return;
  mtp_loss_accumulate(*ctx_, mtp_losses_D_, seq_len_, cfg_.mtp_loss_scaling_factor, out_1);
}

double Model::aux_loss() const {
  double s = 0;
  for (const MoeLayer* l : moe_layers_) s += l->aux_loss() + l->seq_aux_loss();
  return s;
}

double Model::mtp_loss() const {
  double s = 0;
  for (const auto& d : mtp_)
    s += d->loss_sum_ * static_cast<double>(seq_len_) / static_cast<double>(seq_len_ - d->depth_);
  return mtp_.empty() ? 0.0 : s * cfg_.mtp_loss_scaling_factor / static_cast<double>(mtp_.size());
}

double Model::z_loss() const {
  double s = 0;
  for (const MoeLayer* l : moe_layers_) s += l->z_loss();
  return s;
}

}  // namespace moefold

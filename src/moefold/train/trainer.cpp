#include "moefold/train/trainer.h"

#include <algorithm>
#include <chrono>

namespace moefold {

Trainer::Trainer(const Config& cfg, const TokenDataset& data)
    : cfg_(cfg),
      model_(cfg.model, cfg.moe, cfg.train.micro_batch_size, cfg.train.seq_len),
      mem_(DType::f32),
      opt_(cfg.train),
      loader_(data, cfg.train.seq_len, cfg.train.micro_batch_size, cfg.train.seed, cfg.data.valid_fraction) {
  const Shape bs{cfg.train.micro_batch_size, cfg.train.seq_len};
  auto bind_all = [&] {
    model_.bind(mem_);
    ids_BS_ = mem_.act(bs, DType::i32);
    targets_BS_ = mem_.act(bs, DType::i32);
  };
  bind_all();  // measure
  // AdamW keeps two moments per parameter.
  planned_bytes_ = 3 * mem_.param_bytes() + mem_.act_bytes() + mem_.grad_arena().used();
  const size_t host = host_memory_bytes();
  if (host > 0 && planned_bytes_ > host)
    MF_FAIL("the ", cfg.preset, " config needs ", planned_bytes_ >> 20, " MiB of planned memory (parameters, ",
            "gradients, AdamW state, activations) but this machine has ", host >> 20,
            " MiB; choose a smaller model or micro-batch (train.micro_batch_size, model.num_hidden_layers)");
  mem_.allocate();
  bind_all();
  mem_.finish_binding();
  opt_.bind(mem_.params());
  const int64_t layers = cfg.model.num_hidden_layers, experts = cfg.moe.num_experts;
  load_sum_.assign(static_cast<size_t>(layers * experts), 0.0);
  metrics_.expert_load_max.assign(static_cast<size_t>(layers), 0.0);
  metrics_.expert_load_mean.assign(static_cast<size_t>(layers), 0.0);
}

void Trainer::init_fresh() {
  Model::init_params(mem_.params(), cfg_.train.seed);
  step_ = 0;
  loader_.set_position(0);
}

void Trainer::load(const std::string& ckpt) {
  TrainerState s = load_checkpoint(ckpt, mem_.params(), &opt_);
  step_ = s.step;
  loader_.set_position(s.data_position);
}

std::string Trainer::save(const std::string& checkpoints_dir) const {
  TrainerState s{step_, loader_.position(), cfg_.train.seed};
  return save_checkpoint(checkpoints_dir, mem_.params(), opt_, s, config_to_toml(cfg_));
}

const StepMetrics& Trainer::train_step() {
  auto t0 = std::chrono::steady_clock::now();
  const int64_t micro = cfg_.train.global_batch_size / cfg_.train.micro_batch_size;
  const int64_t tokens = cfg_.train.global_batch_size * cfg_.train.seq_len;
  const int64_t layers = model_.num_layers(), experts = cfg_.moe.num_experts;
  mem_.grad_arena().zero();
  std::fill(load_sum_.begin(), load_sum_.end(), 0.0);
  double loss_sum = 0, aux = 0, z = 0;
  for (int64_t m = 0; m < micro; ++m) {
    loader_.next_train(ids_BS_.ptr<int32_t>(), targets_BS_.ptr<int32_t>());
    loss_sum += model_.forward(ids_BS_, targets_BS_);
    aux += model_.aux_loss();
    z += model_.z_loss();
    for (int64_t l = 0; l < layers; ++l) {
      const int64_t* counts = model_.moe(l).expert_counts();
      for (int64_t e = 0; e < experts; ++e) load_sum_[l * experts + e] += static_cast<double>(counts[e]);
    }
    // Loss = sum of token losses / tokens + mean over micro-batches of the router losses.
    model_.backward(1.0 / static_cast<double>(tokens), 1.0 / static_cast<double>(micro));
  }
  StepMetrics& out = metrics_;
  out.lm_loss = loss_sum / static_cast<double>(tokens);
  out.aux_loss = aux / static_cast<double>(micro);
  out.z_loss = z / static_cast<double>(micro);
  out.loss = out.lm_loss + out.aux_loss + out.z_loss;
  out.grad_norm = global_grad_norm(mem_.params());
  clip_grad_norm(mem_.params(), out.grad_norm, cfg_.train.grad_clip);
  out.lr = learning_rate(cfg_.train, step_);
  opt_.step(mem_.params(), out.lr);
  ++step_;
  out.step = step_;
  out.tokens = tokens;
  for (int64_t l = 0; l < layers; ++l) {
    const double* c = &load_sum_[static_cast<size_t>(l * experts)];
    double mx = 0, sum = 0;
    for (int64_t e = 0; e < experts; ++e) {
      mx = std::max(mx, c[e]);
      sum += c[e];
    }
    out.expert_load_max[l] = mx;
    out.expert_load_mean[l] = sum / static_cast<double>(experts);
  }
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

double Trainer::evaluate() {
  const int64_t n = std::min(cfg_.train.eval_batches, loader_.num_valid_batches());
  if (n == 0) return 0.0;
  double sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    loader_.valid_batch(j, ids_BS_.ptr<int32_t>(), targets_BS_.ptr<int32_t>());
    sum += model_.forward(ids_BS_, targets_BS_);
  }
  return sum / static_cast<double>(n * cfg_.train.micro_batch_size * cfg_.train.seq_len);
}

}  // namespace moefold

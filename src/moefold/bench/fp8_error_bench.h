// `moefold bench fp8-error`: what FP8 (train.fp8 = blockwise) does to one step's gradients. Two
// trainers start from the same weights (a fresh init with train.seed, or a checkpoint) and take
// the same global batches; one computes as the config says with FP8, the other without it (f32 on
// the CPU, bf16 mixed precision on the GPU). Every parameter's gradient is compared, gathered by
// kind (the same parameter of every layer and expert together, or per layer): the relative error
// |g_fp8 - g| / |g| and the cosine of the two. Which linear layers' FP8 costs the most accuracy,
// before a long run or when choosing train.fp8_exclude; nothing is timed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moefold/comm/communicator.h"
#include "moefold/model/config.h"

namespace moefold {

struct Fp8ErrorOptions {
  Device device = Device::cuda;
  std::string checkpoint;  // the weights and data position of this checkpoint (else a fresh init)
  int batches = 1;         // global batches compared (their sums of squares pooled)
  bool per_layer = false;  // one row per parameter and layer (experts still together)
};

// One group of gradients: sums over its elements and over the batches.
struct Fp8ErrorRow {
  std::string name;  // the parameter's name with the layer (unless per_layer) and expert indices as *
  bool fp8 = false;  // the parameter is an FP8 GEMM's weight in the FP8 arm
  int64_t elements = 0;
  double ref_sq = 0;   // sum of g^2 (the arm without FP8)
  double fp8_sq = 0;   // sum of g_fp8^2
  double diff_sq = 0;  // sum of (g_fp8 - g)^2
  double dot = 0;      // sum of g * g_fp8
  double relative_error() const;
  double cosine() const;
};

struct Fp8ErrorResult {
  std::vector<Fp8ErrorRow> rows;  // in the order of the parameters' registration
  // Per batch, both arms: the language-model and multi-token-prediction losses, the gradient norm.
  std::vector<double> lm_loss_ref, lm_loss_fp8, mtp_loss_ref, mtp_loss_fp8, grad_norm_ref, grad_norm_fp8;
  std::string fp8_modules;  // the linear layers in FP8 (train.fp8_exclude applied), comma-separated
};

// Both arms on this process's device (one rank: `world` must be of size 1). cfg.train.fp8 is the
// FP8 arm's (blockwise when the config says none); the other arm has train.fp8 = none and
// moe.fp8_dispatch = false. Throws Error on bad input (a layout of several ranks, --batches < 1,
// no FP8 linear layer left by train.fp8_exclude is fine: every error is then 0).
Fp8ErrorResult bench_fp8_error(const Config& cfg, Communicator& world, const Fp8ErrorOptions& opts);

// The markdown report: the losses of both arms and one table row per group.
std::string format_fp8_error(const Fp8ErrorResult& r, const std::string& title);

}  // namespace moefold

// Loader: deterministic, resumable batch sampler over a TokenDataset. Train sample i (the
// global "data position") is a pure function of (seed, i), so any rank can compute any sample
// and a run resumed at position p sees exactly the batches it would have seen. The last
// valid_fraction of the stream is held out for validation.
//
// Shape letters: B batch, S sequence length. inputs_BS / targets_BS are row-major int32.
#pragma once

#include <cstdint>

#include "moefold/data/token_dataset.h"

namespace moefold {

class Loader {
 public:
  // The Philox stream that train window starts are drawn from.
  static constexpr uint64_t kSampleStream = 0x5eed;

  // REQUIRES: `data` outlives the loader. Fails (naming the data file) when seq_len or batch
  // are not positive, valid_fraction is outside [0, 1), the train part is shorter than one
  // window of seq_len + 1 tokens, or valid_fraction > 0 leaves less than one valid batch.
  Loader(const TokenDataset& data, int64_t seq_len, int64_t batch, uint64_t seed, double valid_fraction);

  int64_t seq_len() const { return seq_len_; }
  int64_t batch() const { return batch_; }
  // Tokens [0, num_train_tokens()) are sampled for training; the rest is held out.
  int64_t num_train_tokens() const { return num_train_; }

  // Fills batch() samples starting at position() and advances position() by batch().
  // targets = inputs shifted by one token. Does not allocate.
  void next_train(int32_t* inputs_BS, int32_t* targets_BS);
  // Train sample `i` alone (S tokens each); what next_train does per row.
  void train_sample(int64_t i, int32_t* inputs_S, int32_t* targets_S) const;
  // First token of train sample `i`: uniform in [0, num_train_tokens() - seq_len).
  int64_t train_window_start(int64_t i) const;

  // Samples consumed so far (saved in checkpoints).
  int64_t position() const { return position_; }
  void set_position(int64_t position);

  // Held-out batches: consecutive, non-overlapping windows of seq_len + 1 tokens from
  // num_train_tokens() on. 0 when valid_fraction == 0.
  int64_t num_valid_batches() const { return num_valid_batches_; }
  // REQUIRES: 0 <= j < num_valid_batches().
  void valid_batch(int64_t j, int32_t* inputs_BS, int32_t* targets_BS) const;

 private:
  const TokenDataset& data_;
  int64_t seq_len_;
  int64_t batch_;
  uint64_t seed_;
  int64_t num_train_ = 0;
  int64_t num_valid_batches_ = 0;
  int64_t position_ = 0;
};

}  // namespace moefold

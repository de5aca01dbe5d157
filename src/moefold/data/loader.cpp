#include "moefold/data/loader.h"

#include "moefold/core/error.h"
#include "moefold/core/rng.h"

namespace moefold {

Loader::Loader(const TokenDataset& data, int64_t seq_len, int64_t batch, uint64_t seed, double valid_fraction)
    : data_(data), seq_len_(seq_len), batch_(batch), seed_(seed) {
  const std::string& p = data.path();
  if (seq_len <= 0) MF_FAIL("data '", p, "': seq_len = ", seq_len, " must be positive");
  if (batch <= 0) MF_FAIL("data '", p, "': batch = ", batch, " must be positive");
  if (!(valid_fraction >= 0.0 && valid_fraction < 1.0))
    MF_FAIL("data '", p, "': valid_fraction = ", valid_fraction, " must be in [0, 1)");
  const int64_t n = data.num_tokens();
  const int64_t num_valid = static_cast<int64_t>(valid_fraction * static_cast<double>(n));
  num_train_ = n - num_valid;
  if (num_train_ < seq_len + 1)
    MF_FAIL("data '", p, "': ", n, " tokens leave ", num_train_, " for training (valid_fraction ", valid_fraction,
            "), fewer than one window of seq_len + 1 = ", seq_len + 1);
  if (valid_fraction > 0) {
    num_valid_batches_ = num_valid / (seq_len + 1) / batch;
    if (num_valid_batches_ == 0)
      MF_FAIL("data '", p, "': valid_fraction ", valid_fraction, " holds out ", num_valid,
              " tokens, fewer than one validation batch of ", batch, " x (seq_len + 1) = ", batch * (seq_len + 1));
  }
}

int64_t Loader::train_window_start(int64_t i) const {
  MF_CHECK(i >= 0, "sample ", i);
  return static_cast<int64_t>(
      rng_below(seed_, kSampleStream, static_cast<uint64_t>(i), static_cast<uint64_t>(num_train_ - seq_len_)));
}

void Loader::train_sample(int64_t i, int32_t* inputs_S, int32_t* targets_S) const {
  const int64_t start = train_window_start(i);
  data_.copy_tokens(start, seq_len_, inputs_S);
  data_.copy_tokens(start + 1, seq_len_, targets_S);
}

void Loader::next_train(int32_t* inputs_BS, int32_t* targets_BS) {
  for (int64_t b = 0; b < batch_; ++b) train_sample(position_ + b, inputs_BS + b * seq_len_, targets_BS + b * seq_len_);
  position_ += batch_;
}

void Loader::set_position(int64_t position) {
  // From a checkpoint's trainer.json. Bounded so that position + batch (next_train) cannot
  // overflow: 2^62 samples is beyond any run.
  constexpr int64_t kMaxPosition = int64_t{1} << 62;
  if (position < 0 || position > kMaxPosition)
    MF_FAIL("data '", data_.path(), "': data position ", position, " must be in [0, 2^62]");
  position_ = position;
}

void Loader::valid_batch(int64_t j, int32_t* inputs_BS, int32_t* targets_BS) const {
  MF_CHECK(j >= 0 && j < num_valid_batches_, "valid batch ", j, " of ", num_valid_batches_);
  for (int64_t b = 0; b < batch_; ++b) {
    const int64_t start = num_train_ + (j * batch_ + b) * (seq_len_ + 1);
    data_.copy_tokens(start, seq_len_, inputs_BS + b * seq_len_);
    data_.copy_tokens(start + 1, seq_len_, targets_BS + b * seq_len_);
  }
}

}  // namespace moefold

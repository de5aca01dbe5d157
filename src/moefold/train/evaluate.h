// `moefold eval`: the mean next-token loss of given sequences under a checkpoint, so anyone can
// compare a checkpoint with another implementation on the same tokens.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moefold {

struct EvalResult {
  double loss = 0;     // mean over every predicted token of every sequence
  int64_t tokens = 0;  // predicted tokens: sequences x (length - 1)
  int64_t sequences = 0;
  int64_t step = 0;  // the checkpoint's step
};

// Loads checkpoint directory `dir` (weights and its config.toml) on one process and runs every
// row of `tokens` (rows x cols, row-major) as one sequence: row[:-1] predicts row[1:].
// `source` names the tokens in error messages. With `logits` non-null it receives the logits,
// float32 [rows, cols - 1, vocab] row-major.
EvalResult evaluate_checkpoint(const std::string& dir, const std::vector<int32_t>& tokens, int64_t rows, int64_t cols,
                               const std::string& source, std::vector<float>* logits = nullptr);

}  // namespace moefold

#include "moefold/train/evaluate.h"

#include <filesystem>

#include "moefold/core/memory.h"
#include "moefold/model/config.h"
#include "moefold/model/model.h"
#include "moefold/train/bound_model.h"
#include "moefold/train/checkpoint.h"

namespace moefold {

EvalResult evaluate_checkpoint(const std::string& dir, const std::vector<int32_t>& tokens, int64_t rows, int64_t cols,
                               const std::string& source, std::vector<float>* logits) {
  const std::string config_path = dir + "/config.toml";
  if (!std::filesystem::is_regular_file(config_path)) MF_FAIL(config_path, ": missing (not a moefold checkpoint?)");
  const Config cfg = load_config(config_path, {});
  if (rows < 1 || cols < 2)
    MF_FAIL(source, ": needs at least one sequence of at least 2 tokens, has ", rows, " x ", cols);
  if (cols - 1 > cfg.model.max_position_embeddings)
    MF_FAIL(source, ": sequences of ", cols,
            " tokens exceed model.max_position_embeddings = ", cfg.model.max_position_embeddings);
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] < 0 || tokens[i] >= cfg.model.vocab_size)
      MF_FAIL(source, ": token id ", tokens[i], " at index ", i, " is outside the vocabulary [0, ",
              cfg.model.vocab_size, ")");
  const int64_t s = cols - 1;
  if (s <= cfg.model.num_nextn_predict_layers)
    MF_FAIL(source, ": sequences of ", cols, " tokens are too short for the checkpoint's multi-token prediction ",
            "(model.num_nextn_predict_layers = ", cfg.model.num_nextn_predict_layers, ")");
  BoundModel bound(cfg, s);
  Model& model = bound.model;
  Memory& mem = bound.mem;
  const Tensor &ids = bound.ids, &targets = bound.targets;
  EvalResult r;
  r.step = load_checkpoint(dir, mem.params(), nullptr).step;
  double sum = 0;
  if (logits) logits->clear();
  for (int64_t row = 0; row < rows; ++row) {
    const int32_t* seq = tokens.data() + row * cols;
    std::copy(seq, seq + s, ids.ptr<int32_t>());
    std::copy(seq + 1, seq + cols, targets.ptr<int32_t>());
    sum += model.forward(ids, targets);
    if (logits) {
      const float* l = model.logits().ptr<float>();
      logits->insert(logits->end(), l, l + model.logits().numel());
    }
  }
  r.sequences = rows;
  r.tokens = rows * s;
  r.loss = sum / static_cast<double>(r.tokens);
  return r;
}

}  // namespace moefold

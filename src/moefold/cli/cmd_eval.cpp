// `moefold eval`: the mean next-token loss of given sequences under a checkpoint, as one JSON
// line (and optionally the logits, to compare with another implementation).
#include <cstdio>

#include "moefold/cli/commands.h"
#include "moefold/core/error.h"
#include "moefold/data/npy.h"
#include "moefold/data/token_dataset.h"
#include "moefold/train/evaluate.h"

namespace moefold::cli {

namespace {

struct EvalArgs {
  std::string checkpoint, tokens, logits;
  int64_t seq_len = 0;
};

void eval(const EvalArgs& a) {
  std::vector<int32_t> tokens;
  int64_t rows = 0, cols = 0;
  if (a.tokens.ends_with(".npy")) {
    NpyTokens t = read_npy_tokens(a.tokens);
    tokens = std::move(t.tokens);
    rows = t.rows;
    cols = t.cols;
  } else {
    if (a.seq_len < 2) MF_FAIL("--seq-len ", a.seq_len, ": a token file needs --seq-len >= 2");
    TokenDataset data = open_token_dataset(a.tokens);
    // Every id must survive the int32 copy below (an int64 Megatron file may hold 2^32 + 5, which
    // would read as 5); evaluate_checkpoint then checks the ids against the checkpoint's vocabulary.
    data.check_vocab(int64_t{1} << 31);
    cols = a.seq_len;
    rows = data.num_tokens() / cols;
    tokens.resize(static_cast<size_t>(rows * cols));
    if (rows > 0) data.copy_tokens(0, rows * cols, tokens.data());
  }
  std::vector<float> logits;
  EvalResult r = evaluate_checkpoint(a.checkpoint, tokens, rows, cols, a.tokens, a.logits.empty() ? nullptr : &logits);
  if (!a.logits.empty())
    write_npy_f32(a.logits, logits, {rows, cols - 1, static_cast<int64_t>(logits.size()) / (rows * (cols - 1))});
  std::printf("{\"loss\": %.17g, \"tokens\": %lld, \"sequences\": %lld, \"step\": %lld}\n", r.loss,
              static_cast<long long>(r.tokens), static_cast<long long>(r.sequences), static_cast<long long>(r.step));
}

}  // namespace

Command add_eval(CLI::App& app) {
  auto a = std::make_shared<EvalArgs>();
  CLI::App* cmd = app.add_subcommand("eval", "mean next-token loss of sequences under a checkpoint (one JSON line)");
  cmd->add_option("--checkpoint", a->checkpoint, "checkpoint directory (runs/.../checkpoints/step_NNNNNNNN)")
      ->required();
  cmd->add_option("--tokens", a->tokens, "2-D int32/int64 .npy (one sequence per row) or a token file")->required();
  cmd->add_option("--seq-len", a->seq_len, "with a token file: consecutive sequences of this many tokens");
  cmd->add_option("--logits", a->logits,
                  "also write the logits as float32 .npy [sequences, length - 1, vocab] (to compare with another "
                  "implementation)");
  return {cmd, [a](World&) { eval(*a); }};
}

}  // namespace moefold::cli

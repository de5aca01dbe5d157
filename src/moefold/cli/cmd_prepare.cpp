// `moefold prepare`: text files or directories (plain text, or JSONL, also gzip- or zstd-compressed)
// tokenized on all cores (bytes or a Hugging Face tokenizer.json) into a token file that `train`
// reads (plain .tokens, or Megatron .bin/.idx).
#include <cstdio>

#include "moefold/cli/commands.h"
#include "moefold/data/prepare.h"

namespace moefold::cli {

namespace {

struct PrepareArgs {
  std::vector<std::string> inputs;
  std::string output, format = "plain";
  PrepareOptions options;
};

void prepare_tokens(const PrepareArgs& a) {
  PrepareStats s =
      prepare(a.inputs, a.output, a.format == "megatron" ? TokenFormat::megatron : TokenFormat::plain, a.options);
  std::printf("prepared %lld files (%lld documents), %lld bytes -> %lld tokens in %s", static_cast<long long>(s.files),
              static_cast<long long>(s.documents), static_cast<long long>(s.bytes), static_cast<long long>(s.tokens),
              a.output.c_str());
  std::printf(" on %d thread%s", s.threads, s.threads == 1 ? "" : "s");
  if (s.bad_lines > 0) std::printf(" (%lld bad .jsonl lines skipped)", static_cast<long long>(s.bad_lines));
  if (!a.options.tokenizer.empty())
    std::printf(" (tokenizer vocabulary: %lld ids, EOS %lld; model.vocab_size must be >= %lld)",
                static_cast<long long>(s.vocab_size), static_cast<long long>(s.eos_id),
                static_cast<long long>(s.vocab_size));
  std::printf("\n");
}

}  // namespace

Command add_prepare(CLI::App& app) {
  auto a = std::make_shared<PrepareArgs>();
  CLI::App* cmd = app.add_subcommand("prepare", "tokenize text files or directories into a token file");
  cmd->add_option("inputs", a->inputs, "text files or directories")->required();
  cmd->add_option("-o,--output", a->output, "output .tokens file, or Megatron prefix with --format megatron")
      ->required();
  cmd->add_option("--format", a->format, "plain (.tokens) or megatron (.bin/.idx)")
      ->check(CLI::IsMember({"plain", "megatron"}));
  auto* o_tokenizer = cmd->add_option("--tokenizer", a->options.tokenizer,
                                      "Hugging Face tokenizer.json (byte-level BPE, e.g. Qwen3's or DeepSeek-V3's); "
                                      "default: bytes");
  cmd->add_option("--eos-token", a->options.eos_token,
                  "token appended to each document (default: <|endoftext|>, <｜end▁of▁sentence｜> or </s>)")
      ->needs(o_tokenizer);
  cmd->add_option("--json-key", a->options.json_key,
                  "in *.jsonl, *.jsonl.gz and *.jsonl.zst inputs (one JSON object per line, one document each): "
                  "the key of the text (default text)");
  cmd->add_flag("--skip-bad-lines", a->options.skip_bad_lines,
                "skip (and count) .jsonl lines that are not JSON objects with a string at --json-key, instead of "
                "failing");
  cmd->add_option("--threads", a->options.threads,
                  "tokenizing threads (default: all cores); the output is the same whatever the number")
      ->check(CLI::Range(1, 65536));
  return {cmd, [a](World&) { prepare_tokens(*a); }};
}

}  // namespace moefold::cli

// `moefold info`: a config's shape, parameter counts and training FLOPs per token.
#include <cstdio>

#include "moefold/cli/commands.h"

namespace moefold::cli {

namespace {

void print_info(const Config& c) {
  ModelSize s = model_size(c.model, c.moe, c.train.seq_len);
  std::printf("preset              %s\n", c.preset.c_str());
  std::printf("architecture        %s\n", c.model.architecture.c_str());
  std::printf("layers              %lld (hidden %lld, %lld q / %lld kv heads x %lld, vocab %lld)\n",
              static_cast<long long>(c.model.num_hidden_layers), static_cast<long long>(c.model.hidden_size),
              static_cast<long long>(c.model.num_attention_heads), static_cast<long long>(c.model.num_key_value_heads),
              static_cast<long long>(c.model.head_dim), static_cast<long long>(c.model.vocab_size));
  std::printf("experts             %lld, top-%lld, FFN %lld, %s scores\n", static_cast<long long>(c.moe.num_experts),
              static_cast<long long>(c.moe.num_experts_per_tok), static_cast<long long>(c.moe.moe_intermediate_size),
              c.moe.scoring_func == ScoreFunc::softmax ? "softmax" : "sigmoid");
  std::printf("total parameters    %lld (%.3f B)\n", static_cast<long long>(s.total_params), s.total_params / 1e9);
  std::printf("active parameters   %lld (%.3f B)\n", static_cast<long long>(s.active_params), s.active_params / 1e9);
  if (s.mtp_params > 0)
    std::printf("MTP parameters      %lld (%.3f B; %lld depth(s), embedding and head shared)\n",
                static_cast<long long>(s.mtp_params), s.mtp_params / 1e9,
                static_cast<long long>(c.model.num_nextn_predict_layers));
  std::printf("train FLOPs/token   %.4g (seq_len %lld; 3 x forward)\n", s.train_flops_per_token,
              static_cast<long long>(c.train.seq_len));
}

}  // namespace

Command add_info(CLI::App& app) {
  auto o = std::make_shared<ConfigOptions>();
  CLI::App* cmd = app.add_subcommand("info", "print parameter counts and FLOPs of a config");
  add_config_options(cmd, *o);
  return {cmd, [o](World&) { print_info(o->load()); }};
}

}  // namespace moefold::cli

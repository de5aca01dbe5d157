// `moefold config`: the resolved config (preset, file and --set applied) as TOML, every key with
// its one-line comment: what a run directory's config.toml holds; with --hf, the model's Hugging
// Face config.json instead (what `convert --to-hf` writes beside the weights).
#include <cstdio>

#include "moefold/cli/commands.h"
#include "moefold/train/hf_import.h"

namespace moefold::cli {

Command add_config(CLI::App& app) {
  auto o = std::make_shared<ConfigOptions>();
  auto hf = std::make_shared<bool>(false);
  CLI::App* cmd = app.add_subcommand("config", "print the resolved config as TOML (every key)");
  add_config_options(cmd, *o);
  cmd->add_flag("--hf", *hf, "print the model's Hugging Face config.json instead");
  return {cmd, [o, hf](World&) {
            const Config cfg = o->load();
            std::fputs(*hf ? (config_to_hf(cfg).dump(2) + "\n").c_str() : config_to_toml(cfg).c_str(), stdout);
          }};
}

}  // namespace moefold::cli

// `moefold config`: the resolved config (preset, file and --set applied) as TOML, every key with
// its one-line comment: what a run directory's config.toml holds.
#include <cstdio>

#include "moefold/cli/commands.h"

namespace moefold::cli {

Command add_config(CLI::App& app) {
  auto o = std::make_shared<ConfigOptions>();
  CLI::App* cmd = app.add_subcommand("config", "print the resolved config as TOML (every key)");
  add_config_options(cmd, *o);
  return {cmd, [o](World&) { std::fputs(config_to_toml(o->load()).c_str(), stdout); }};
}

}  // namespace moefold::cli

// `moefold convert`: Hugging Face model directory -> run directory (--from-hf), checkpoint ->
// Hugging Face directory (--to-hf), and dense checkpoint -> MoE run (--upcycle).
#include <cstdio>
#include <filesystem>

#include "moefold/cli/commands.h"
#include "moefold/core/error.h"
#include "moefold/train/hf_import.h"
#include "moefold/train/upcycle.h"

namespace moefold::cli {

namespace {

struct ConvertArgs {
  std::string from_hf, to, from, to_hf;
  bool upcycle = false;
  int64_t granularity = 1;
  std::vector<std::string> overrides;  // with --upcycle: keys of the upcycled config
};

void convert(const ConvertArgs& a) {
  if (a.upcycle) {
    const std::string ckpt = upcycle(a.from, a.to, a.overrides, a.granularity);
    std::printf("upcycled %s into %s (continue with: moefold train --config %s/config.toml --run-dir %s --resume)\n",
                a.from.c_str(), ckpt.c_str(), a.to.c_str(), a.to.c_str());
  } else if (!a.from.empty()) {
    if (std::filesystem::exists(a.to_hf + "/model.safetensors"))
      MF_FAIL(a.to_hf, ": already holds a model.safetensors; choose another --to-hf");
    export_hf(a.from, a.to_hf);
    std::printf("exported %s to %s\n", a.from.c_str(), a.to_hf.c_str());
  } else {
    if (a.from_hf.empty()) MF_FAIL("convert: give --from-hf DIR --to RUN_DIR, or --from CKPT_DIR --to-hf DIR");
    if (std::filesystem::exists(a.to + "/checkpoints"))
      MF_FAIL(a.to, ": already holds checkpoints; choose another --to");
    const std::string ckpt = import_hf(a.from_hf, a.to);
    std::printf("imported %s into %s (continue with: moefold train --config %s/config.toml --run-dir %s --resume)\n",
                a.from_hf.c_str(), ckpt.c_str(), a.to.c_str(), a.to.c_str());
  }
}

}  // namespace

Command add_convert(CLI::App& app) {
  auto a = std::make_shared<ConvertArgs>();
  CLI::App* cmd = app.add_subcommand("convert",
                                     "Hugging Face model directory <-> moefold (--from-hf DIR --to RUN_DIR, or "
                                     "--from CKPT_DIR --to-hf DIR); dense checkpoint -> MoE run (--upcycle "
                                     "--from CKPT_DIR --to RUN_DIR)");
  auto* o_from_hf =
      cmd->add_option("--from-hf", a->from_hf, "Hugging Face model directory (config.json, *.safetensors)");
  auto* o_to = cmd->add_option("--to", a->to, "run directory to create (config.toml, checkpoints/step_00000000)");
  auto* o_from = cmd->add_option("--from", a->from, "moefold checkpoint directory");
  auto* o_to_hf = cmd->add_option("--to-hf", a->to_hf, "Hugging Face model directory to write");
  auto* o_upcycle = cmd->add_flag("--upcycle", a->upcycle,
                                  "initialise an MoE run from the dense checkpoint --from: every expert a copy "
                                  "of the dense MLP (or a 1/G slice of one), step-0 logits those of the dense "
                                  "model");
  auto* o_granularity = cmd->add_option(
      "--granularity", a->granularity,
      "with --upcycle: G experts per copy of the dense MLP, each intermediate_size / G wide (default 1)");
  auto* o_set = cmd->add_option(
      "--set", a->overrides, "with --upcycle: override a key of the upcycled config: section.key=value (repeatable)");
  o_from_hf->needs(o_to)->excludes(o_from)->excludes(o_upcycle);
  o_to_hf->needs(o_from)->excludes(o_to)->excludes(o_upcycle);
  o_upcycle->needs(o_from)->needs(o_to);
  o_granularity->needs(o_upcycle);
  o_set->needs(o_upcycle);
  // --from and --to go together only under --upcycle, which needs/excludes cannot say.
  cmd->parse_complete_callback([=] {
    if (!*o_upcycle && *o_from && !*o_to_hf)
      throw CLI::RequiresError("--from", "--to-hf (export) or --upcycle --to RUN_DIR (upcycle)");
    if (!*o_upcycle && *o_to && !*o_from_hf) throw CLI::RequiresError("--to", "--from-hf or --upcycle --from");
    if (!*o_from && !*o_from_hf)
      throw CLI::RequiredError(
          "convert: give --from-hf DIR --to RUN_DIR, --from CKPT_DIR --to-hf DIR or --upcycle --from CKPT_DIR --to "
          "RUN_DIR",
          CLI::ExitCodes::RequiredError);
  });
  return {cmd, [a](World&) { convert(*a); }};
}

}  // namespace moefold::cli

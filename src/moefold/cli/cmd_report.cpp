// `moefold report RUN_DIR [-o FILE]`: a training run's metrics, expert loads and config as one
// self-contained HTML page (train/report.h); prints the path written.
#include <cstdio>

#include "moefold/cli/commands.h"
#include "moefold/train/report.h"

namespace moefold::cli {

namespace {

struct ReportArgs {
  std::string run_dir, output;
};

}  // namespace

Command add_report(CLI::App& app) {
  auto a = std::make_shared<ReportArgs>();
  CLI::App* cmd = app.add_subcommand("report", "draw a run directory's metrics and expert loads as one HTML page");
  cmd->add_option("run_dir", a->run_dir, "the --run-dir of a training run (finished or still going)")->required();
  cmd->add_option("-o,--output", a->output, "the HTML file to write (default: RUN_DIR/report.html)");
  return {cmd, [a](World&) { std::printf("%s\n", write_run_report(a->run_dir, a->output).c_str()); }};
}

}  // namespace moefold::cli

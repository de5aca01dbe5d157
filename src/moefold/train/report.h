// `moefold report`: a run directory (config.toml, metrics.jsonl, expert_load.npy) drawn as one
// self-contained HTML page: inline SVG plots made here, no scripts, no fonts or styles fetched from
// anywhere, so it opens offline and can be mailed or archived as it is.
#pragma once

#include <cstdint>
#include <string>

namespace moefold {

// The report of the run in `run_dir` as an HTML document. Every metrics field is optional (older
// runs lack the newer ones); a torn last line (a run still writing) is left out with a note, and an
// expert_load.npy that cannot be read costs its heatmaps (a note says why), not the report.
// Throws Error naming the file (and line) when run_dir or its metrics.jsonl is missing, or a
// metrics line other than a torn last one is not a JSON object with an integer "step".
std::string run_report_html(const std::string& run_dir);

// Writes run_report_html(run_dir) to out_path (empty: RUN_DIR/report.html); returns the path.
std::string write_run_report(const std::string& run_dir, const std::string& out_path = "");

// The colours the report draws with, as 0xRRGGBB (the browser test finds them in a screenshot):
// the training loss line, and a heatmap cell at `position` on its colour bar, -1 (no tokens or
// fewest) through 0 (the layer's mean) to +1 (the bar's top).
inline constexpr uint32_t kReportLossRgb = 0x1f77b4;
uint32_t report_heat_rgb(double position);

}  // namespace moefold

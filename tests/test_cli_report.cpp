// `moefold report`: the page of a real (tiny) training run, -o, and a missing run directory as one
// error line.
#include <filesystem>
#include <string>

#include "cli_testing.h"
#include "moefold/core/error.h"
#include "testing.h"

namespace moefold {
namespace {

namespace fs = std::filesystem;

bool has(const std::string& s, const std::string& needle) { return s.find(needle) != std::string::npos; }

TEST(CliReport, ReportsATrainingRun) {
  testing::TempDir tmp("test_cli_report");
  const fs::path& d = tmp.path();
  std::string text;
  for (int i = 0; i < 300; ++i) text += cat("line ", i % 11, ": the quick brown fox jumps over the lazy dog\n");
  write(d / "a.txt", text);
  ASSERT_EQ(run("prepare a.txt -o data.tokens", d).code, 0);
  // 8 steps: an expert-load slice every 2, an evaluation every 4; no checkpoints to write.
  Result t =
      run(cat("train --run-dir run --steps 8 --set data.path=data.tokens --set data.valid_fraction=0.1 ", kSmall,
              " --set train.expert_load_interval=2 --set train.eval_interval=4 --set train.save_checkpoints=false"),
          d);
  ASSERT_EQ(t.code, 0) << t.err;

  Result r = run("report run", d);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, "run/report.html\n");
  const std::string html = testing::read_bytes((d / "run" / "report.html").string());
  for (const char* id : {"plot-loss", "plot-lr", "plot-grad-norm", "plot-tokens-per-s", "plot-expert-load"})
    EXPECT_TRUE(has(html, cat("<svg class=\"plot\" id=\"", id, "\""))) << id;
  // One MoE layer (kSmall), 4 slices of its 4 experts.
  EXPECT_TRUE(has(html, "<svg class=\"heatmap\" id=\"heatmap-layer-0\""));
  EXPECT_FALSE(has(html, "heatmap-layer-1"));
  EXPECT_TRUE(has(html, "viewBox=\"0 0 4 4\""));
  EXPECT_TRUE(has(html, "8 of 600"));  // steps done of train.steps
  EXPECT_TRUE(has(html, "(step 8)"));  // the last evaluation
  EXPECT_TRUE(has(html, "[moe]"));     // the config
  EXPECT_FALSE(has(html, "<script"));

  Result o = run("report run -o elsewhere.html", d);
  ASSERT_EQ(o.code, 0) << o.err;
  EXPECT_EQ(o.out, "elsewhere.html\n");
  EXPECT_TRUE(fs::exists(d / "elsewhere.html"));
}

TEST(CliReport, MissingRunDirectoryIsOneErrorLine) {
  testing::TempDir tmp("test_cli_report");
  const fs::path& d = tmp.path();
  expect_one_line_error(run("report no_such_run", d), {"no_such_run", "no such run directory"});
  fs::create_directories(d / "empty");
  expect_one_line_error(run("report empty", d), {"empty/metrics.jsonl", "missing"});
  EXPECT_NE(run("report", d).code, 0);  // RUN_DIR is required
}

}  // namespace
}  // namespace moefold

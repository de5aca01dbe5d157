// `moefold report` (train/report.h): the page drawn from synthetic run directories (every plot,
// the heatmaps, the escaped config, gaps at non-finite losses, thinning of long runs, dense runs,
// runs without expert_load.npy, torn last lines, errors naming the file and line), and the page as
// a real browser renders it: chromium-headless-shell's screenshot decoded with libpng, its DOM.
#include <fcntl.h>
#include <png.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "moefold/core/error.h"
#include "moefold/data/npy.h"
#include "moefold/train/report.h"
#include "testing.h"

namespace moefold {
namespace {

namespace fs = std::filesystem;

size_t count(const std::string& s, const std::string& needle) {
  size_t n = 0;
  for (size_t at = s.find(needle); at != std::string::npos; at = s.find(needle, at + 1)) ++n;
  return n;
}

bool has(const std::string& s, const std::string& needle) { return s.find(needle) != std::string::npos; }

// The `d` of the first series path of the plot with this id.
std::string first_series_path(const std::string& html, const std::string& id) {
  const size_t plot = html.find("id=\"" + id + "\"");
  if (plot == std::string::npos) return "";
  const size_t path = html.find("class=\"series\"", plot);
  const size_t d = html.find(" d=\"", path);
  if (path == std::string::npos || d == std::string::npos || d > html.find("</svg>", plot)) return "";
  return html.substr(d + 4, html.find('"', d + 4) - d - 4);
}

struct RunSpec {
  int64_t steps = 60;
  int64_t layers = 2, experts = 8;  // layers 0: a dense model
  int64_t load_interval = 5;        // 0: no expert_load.npy
  int64_t nan_step = 30;            // its loss is non-finite (written as null) and the step skipped
  int64_t eval_interval = 20;
};

// metrics.jsonl line of step s: the loss falls from 10 to 2, evaluations every eval_interval steps.
std::string metrics_line(const RunSpec& r, int64_t s) {
  const double t = static_cast<double>(s - 1) / static_cast<double>(std::max<int64_t>(r.steps - 1, 1));
  const double loss = 10 - 8 * t;
  auto layers = [&](double v) {
    std::string a = "[";
    for (int64_t l = 0; l < r.layers; ++l) a += cat(l ? "," : "", v + 0.1 * static_cast<double>(l));
    return a + "]";
  };
  const bool bad = s == r.nan_step;
  std::string j =
      cat("{\"step\":", s, ",\"loss\":", bad ? "null" : cat(loss), ",\"lm_loss\":", bad ? "null" : cat(loss - 0.01),
          ",\"aux_loss\":0.01,\"z_loss\":0,\"mtp_loss\":0,\"grad_norm\":",
          bad ? "null" : cat(1 + 0.5 * std::sin(static_cast<double>(s))), ",\"skipped\":", bad ? "true" : "false",
          ",\"lr\":", 3e-3 * (1 - 0.9 * t), ",\"tokens\":2048,\"tokens_per_s\":", 20000 + 100 * s,
          ",\"step_time_s\":0.1,\"tflops\":0.5,\"host_memory_peak_mib\":", 300 + s,
          ",\"expert_load_max\":", layers(300), ",\"expert_load_mean\":", layers(100),
          ",\"expert_load_min\":", layers(20), ",\"expert_load_dropped_fraction\":", layers(0.01),
          ",\"expert_load_p50\":", layers(1), ",\"expert_load_max_over_mean\":", layers(3));
  if (r.eval_interval > 0 && s % r.eval_interval == 0) j += cat(",\"eval_loss\":", loss + 0.5);
  return j + "}\n";
}

// A run directory as `moefold train` leaves it. expert_load.npy: in layer 0 expert 0 gets 4x the
// mean and expert 1 nothing; in layer 1 expert 7 gets 4x and expert 6 nothing; the others 2/3.
void make_run(const fs::path& dir, const RunSpec& r) {
  fs::create_directories(dir);
  std::ofstream(dir / "config.toml") << "preset = \"tiny\"\n# a note: <b>bold</b> & \"quoted\"\n\n[model]\n"
                                        "architecture = 'qwen3_moe'\n\n[train]\nsteps = "
                                     << r.steps << "\nexpert_load_interval = " << r.load_interval << "\n";
  std::ofstream metrics(dir / "metrics.jsonl");
  for (int64_t s = 1; s <= r.steps; ++s) metrics << metrics_line(r, s);
  if (r.load_interval > 0 && r.layers > 0) {
    NpyAppender npy((dir / "expert_load.npy").string(), {r.layers, r.experts}, 0);
    std::vector<float> slice(static_cast<size_t>(r.layers * r.experts), 20.0f);
    slice[0] = 120;  // mean 30 in every layer
    slice[1] = 0;
    if (r.layers > 1) {
      slice[static_cast<size_t>(r.experts + r.experts - 1)] = 120;
      slice[static_cast<size_t>(r.experts + r.experts - 2)] = 0;
    }
    for (int64_t s = r.load_interval; s <= r.steps; s += r.load_interval) npy.append(slice.data());
  }
}

TEST(TrainReport, DrawsEveryPlotHeatmapsAndTheEscapedConfig) {
  testing::TempDir tmp("report");
  const fs::path run = tmp.path() / "run";
  make_run(run, {});
  const std::string path = write_run_report(run.string());
  EXPECT_EQ(path, (run / "report.html").string());
  const std::string html = testing::read_bytes(path);
  for (const char* id : {"plot-loss", "plot-aux-loss", "plot-lr", "plot-grad-norm", "plot-tokens-per-s", "plot-tflops",
                         "plot-memory", "plot-expert-load", "plot-expert-load-min", "plot-expert-dropped"})
    EXPECT_TRUE(has(html, cat("<svg class=\"plot\" id=\"", id, "\""))) << id;
  EXPECT_TRUE(has(html, "<svg class=\"heatmap\" id=\"heatmap-layer-0\""));
  EXPECT_TRUE(has(html, "<svg class=\"heatmap\" id=\"heatmap-layer-1\""));
  EXPECT_EQ(count(html, "class=\"heatmap\""), 2u);
  EXPECT_EQ(count(html, "<svg"), count(html, "</svg>"));
  // Host memory (no GPU field), the header, the config escaped.
  EXPECT_TRUE(has(html, "Host memory"));
  EXPECT_TRUE(has(html, "tiny"));
  EXPECT_TRUE(has(html, "qwen3_moe"));
  EXPECT_TRUE(has(html, "60 of 60"));
  EXPECT_TRUE(has(html, "2.5000 (step 60)"));  // last eval loss
  EXPECT_TRUE(has(html, "# a note: &lt;b&gt;bold&lt;/b&gt; &amp; &quot;quoted&quot;"));
  EXPECT_FALSE(has(html, "<b>bold"));
  // Self-contained: nothing run, nothing fetched.
  for (const char* bad : {"<script", "http://", "https://", "<link", "src=", "url(", "@import", "<iframe", "<img"})
    EXPECT_FALSE(has(html, bad)) << bad;
  // The skipped step is a gap: the loss line has two pieces; lm_loss too.
  EXPECT_EQ(count(first_series_path(html, "plot-loss"), "M"), 2u) << first_series_path(html, "plot-loss");
  EXPECT_FALSE(has(html, "nan"));
  EXPECT_FALSE(has(html, "inf\""));
  // Heatmaps: 12 slices x 8 experts each, on one scale up to 4x; the steps 5..60 on the axis.
  EXPECT_EQ(count(html, "viewBox=\"0 0 12 8\""), 2u);
  EXPECT_TRUE(has(html, "\u22654\u00d7"));
  EXPECT_TRUE(has(html, ">60</text>"));
  // -o elsewhere.
  EXPECT_EQ(write_run_report(run.string(), tmp.file("elsewhere.html")), tmp.file("elsewhere.html"));
  EXPECT_EQ(testing::read_bytes(tmp.file("elsewhere.html")), html);
}

TEST(TrainReport, LongRunsAreThinned) {
  testing::TempDir tmp("report");
  const fs::path run = tmp.path() / "run";
  RunSpec r;
  r.steps = 20000;
  r.nan_step = 777;
  r.eval_interval = 1000;
  r.load_interval = 4;  // 5000 slices
  make_run(run, r);
  const std::string html = run_report_html(run.string());
  // At most ~2000 points per series: a bucket's min and max (and a gap where it held a NaN).
  const std::string d = first_series_path(html, "plot-loss");
  const size_t points = count(d, " ") / 2 + 1;
  EXPECT_GT(points, 1000u);
  EXPECT_LE(points, 2100u);
  EXPECT_EQ(count(d, "M"), 2u);  // the skipped step's gap survives the thinning
  // At most 400 columns per heatmap, the note saying so.
  EXPECT_EQ(count(html, "viewBox=\"0 0 400 8\""), 2u);
  EXPECT_TRUE(has(html, "Each column averages 12-13 of the 5000 slices."));
  EXPECT_LT(html.size(), 1500000u) << html.size();
}

TEST(TrainReport, DenseRunsAndRunsWithoutLoadsHaveNoHeatmaps) {
  testing::TempDir tmp("report");
  RunSpec dense;
  dense.layers = 0;
  make_run(tmp.path() / "dense", dense);
  const std::string d = run_report_html((tmp.path() / "dense").string());
  EXPECT_TRUE(has(d, "id=\"plot-loss\""));
  EXPECT_FALSE(has(d, "plot-expert-load"));
  EXPECT_FALSE(has(d, "class=\"heatmap\""));
  EXPECT_TRUE(has(d, "a dense model")) << d;

  RunSpec no_npy;
  no_npy.load_interval = 0;
  make_run(tmp.path() / "no_npy", no_npy);
  const std::string n = run_report_html((tmp.path() / "no_npy").string());
  EXPECT_TRUE(has(n, "id=\"plot-expert-load\""));
  EXPECT_FALSE(has(n, "class=\"heatmap\""));
  EXPECT_TRUE(has(n, "No expert_load.npy")) << n;

  // A damaged expert_load.npy costs its heatmaps, with a note, not the report.
  make_run(tmp.path() / "bad_npy", {});
  fs::resize_file(tmp.path() / "bad_npy" / "expert_load.npy", 140);
  const std::string b = run_report_html((tmp.path() / "bad_npy").string());
  EXPECT_TRUE(has(b, "id=\"plot-loss\""));
  EXPECT_FALSE(has(b, "class=\"heatmap\""));
  EXPECT_TRUE(has(b, "expert_load.npy could not be read")) << b;
}

TEST(TrainReport, RunsStillGoingAndOlderRuns) {
  testing::TempDir tmp("report");
  const fs::path run = tmp.path() / "run";
  make_run(run, {});
  // A torn last line (no newline yet): left out, with a note.
  std::ofstream(run / "metrics.jsonl", std::ios::app) << "{\"step\":61,\"loss\":1.9,\"lm_lo";
  std::string html = run_report_html(run.string());
  EXPECT_TRUE(has(html, "incomplete")) << html;
  EXPECT_TRUE(has(html, "60 of 60"));
  // An older run: only step and loss, no config.toml.
  const fs::path old = tmp.path() / "old";
  fs::create_directories(old);
  std::ofstream(old / "metrics.jsonl") << "{\"step\":1,\"loss\":5.5}\n{\"step\":2,\"loss\":5.25}\n";
  html = run_report_html(old.string());
  EXPECT_TRUE(has(html, "id=\"plot-loss\""));
  EXPECT_FALSE(has(html, "plot-lr"));
  EXPECT_TRUE(has(html, "No config.toml"));
  EXPECT_TRUE(has(html, "5.2500"));
  // Just started: no steps yet.
  std::ofstream(old / "metrics.jsonl", std::ios::trunc).flush();
  html = run_report_html(old.string());
  EXPECT_TRUE(has(html, "no steps yet")) << html;
}

TEST(TrainReport, ErrorsNameTheFileAndLine) {
  testing::TempDir tmp("report");
  const fs::path run = tmp.path() / "run";
  std::string e = testing::error_of([&] { run_report_html(run.string()); });
  EXPECT_TRUE(has(e, run.string()) && has(e, "no such run directory")) << e;
  fs::create_directories(run);
  e = testing::error_of([&] { run_report_html(run.string()); });
  EXPECT_TRUE(has(e, (run / "metrics.jsonl").string()) && has(e, "missing")) << e;
  std::ofstream(run / "metrics.jsonl") << "{\"step\":1,\"loss\":3}\n\n{\"step\":3,\"loss\":2\n{\"step\":4}\n";
  e = testing::error_of([&] { run_report_html(run.string()); });
  EXPECT_TRUE(has(e, (run / "metrics.jsonl").string() + ":3: not JSON")) << e;
  EXPECT_EQ(count(e, "\n"), 0u) << e;
  std::ofstream(run / "metrics.jsonl", std::ios::trunc) << "{\"step\":1}\n{\"loss\":2}\n";
  e = testing::error_of([&] { run_report_html(run.string()); });
  EXPECT_TRUE(has(e, "metrics.jsonl:2: no integer \"step\"")) << e;
  std::ofstream(run / "metrics.jsonl", std::ios::trunc) << "[1, 2]\n";
  e = testing::error_of([&] { run_report_html(run.string()); });
  EXPECT_TRUE(has(e, "metrics.jsonl:1: not a JSON object")) << e;
  std::ofstream(run / "metrics.jsonl", std::ios::trunc) << "{\"step\":1}\n";
  e = testing::error_of([&] { write_run_report(run.string(), (run / "no" / "such" / "dir.html").string()); });
  EXPECT_TRUE(has(e, "dir.html: cannot write")) << e;
}

// ---- in a browser ------------------------------------------------------------------------------

const char* kChromium = "/usr/bin/chromium-headless-shell";

// Runs argv with stdout to `out_file` (stderr dropped), killed with its process group after
// `timeout_s`. Returns the exit status, or -1 when it had to be killed.
int run_with_timeout(const std::vector<std::string>& argv, const std::string& out_file, double timeout_s) {
  std::vector<char*> args;  // built before fork: the child only makes async-signal-safe calls
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::setpgid(0, 0);  // chromium's helpers die with it
    const int out = ::open(out_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int null = ::open("/dev/null", O_RDWR);
    ::dup2(null, 0);
    ::dup2(out, 1);
    ::dup2(null, 2);
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  if (pid < 0) return -2;
  ::setpgid(pid, pid);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(-pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ::kill(-pid, SIGKILL);  // any helper left behind
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::vector<std::string> chromium_args(const testing::TempDir& tmp) {
  return {kChromium,
          "--no-sandbox",
          "--headless",
          "--disable-gpu",
          "--hide-scrollbars",
          "--force-color-profile=srgb",
          "--user-data-dir=" + tmp.file("chromium-profile")};
}

struct Image {
  int w = 0, h = 0;
  std::vector<uint8_t> rgb;
  uint32_t at(int x, int y) const {
    const uint8_t* p = &rgb[3 * (static_cast<size_t>(y) * w + x)];
    return uint32_t{p[0]} << 16 | uint32_t{p[1]} << 8 | p[2];
  }
};

Image read_png(const std::string& path) {
  png_image img{};
  img.version = PNG_IMAGE_VERSION;
  Image out;
  if (!png_image_begin_read_from_file(&img, path.c_str())) return out;
  img.format = PNG_FORMAT_RGB;
  out.rgb.resize(PNG_IMAGE_SIZE(img));
  if (!png_image_finish_read(&img, nullptr, out.rgb.data(), 0, nullptr)) return out;
  out.w = static_cast<int>(img.width);
  out.h = static_cast<int>(img.height);
  return out;
}

bool near(uint32_t a, uint32_t b, int tol) {
  for (int shift = 0; shift <= 16; shift += 8)
    if (std::abs(static_cast<int>((a >> shift) & 0xff) - static_cast<int>((b >> shift) & 0xff)) > tol) return false;
  return true;
}

// Runs of screen rows where at least `min_px` pixels are `colour`: (first row, last row) each.
std::vector<std::pair<int, int>> wide_bands(const Image& im, uint32_t colour, int min_px) {
  std::vector<std::pair<int, int>> bands;
  for (int y = 0; y < im.h; ++y) {
    int n = 0;
    for (int x = 0; x < im.w; ++x) n += near(im.at(x, y), colour, 2);
    if (n < min_px) continue;
    if (!bands.empty() && bands.back().second == y - 1)
      bands.back().second = y;
    else
      bands.emplace_back(y, y);
  }
  return bands;
}

TEST(TrainReport, RendersInAHeadlessBrowser) {
  if (::access(kChromium, X_OK) != 0)
    GTEST_SKIP() << kChromium << " is not installed (scripts/setup.sh installs chromium-headless-shell)";
  testing::TempDir tmp("report_browser");
  const fs::path run = tmp.path() / "run";
  make_run(run, {});
  const std::string report = write_run_report(run.string());
  const std::string url = "file://" + fs::absolute(report).string();

  // The DOM chromium built: every plot and heatmap is an svg element in it.
  std::vector<std::string> dom_args = chromium_args(tmp);
  dom_args.insert(dom_args.end(), {"--dump-dom", url});
  ASSERT_EQ(run_with_timeout(dom_args, tmp.file("dom.html"), 60), 0) << "chromium --dump-dom failed or hung";
  const std::string dom = testing::read_bytes(tmp.file("dom.html"));
  EXPECT_EQ(count(dom, "<svg class=\"plot\""), 10u) << dom.substr(0, 2000);
  EXPECT_EQ(count(dom, "<svg class=\"heatmap\""), 2u);
  EXPECT_TRUE(has(dom, "id=\"plot-loss\""));
  EXPECT_TRUE(has(dom, "id=\"heatmap-layer-1\""));
  EXPECT_FALSE(has(dom, "parsererror"));

  // The screenshot: a window tall enough for every plot and both heatmaps.
  std::vector<std::string> shot_args = chromium_args(tmp);
  shot_args.insert(shot_args.end(), {"--screenshot=" + tmp.file("shot.png"), "--window-size=1280,5600",
                                     "--virtual-time-budget=2000", url});
  ASSERT_EQ(run_with_timeout(shot_args, tmp.file("shot.log"), 60), 0) << "chromium --screenshot failed or hung";
  if (const char* keep = std::getenv("MOEFOLD_TEST_KEEP_REPORT")) {  // a directory to look at them in
    fs::copy_file(report, fs::path(keep) / "report.html", fs::copy_options::overwrite_existing);
    fs::copy_file(tmp.file("shot.png"), fs::path(keep) / "shot.png", fs::copy_options::overwrite_existing);
  }
  const Image im = read_png(tmp.file("shot.png"));
  ASSERT_EQ(im.w, 1280);
  ASSERT_EQ(im.h, 5600);

  // Not blank: many pixels differ from the white page.
  size_t ink = 0;
  for (int y = 0; y < im.h; ++y)
    for (int x = 0; x < im.w; ++x) ink += !near(im.at(x, y), 0xffffff, 8);
  EXPECT_GT(ink, 100000u);

  // The loss line: drawn across the plot, falling (10 -> 2: lower on screen to the right), with a
  // gap at the skipped step 30 of 60.
  std::vector<int> lowest(static_cast<size_t>(im.w), -1);  // per column, the lowest loss-coloured pixel
  int loss_bottom = 0;
  for (int y = 0; y < im.h; ++y)
    for (int x = 0; x < im.w; ++x)
      if (near(im.at(x, y), kReportLossRgb, 16)) {
        lowest[static_cast<size_t>(x)] = y;
        loss_bottom = std::max(loss_bottom, y);
      }
  std::vector<int> cols;
  for (int x = 0; x < im.w; ++x)
    if (lowest[static_cast<size_t>(x)] >= 0) cols.push_back(x);
  ASSERT_GT(cols.size(), 600u) << "the loss line is missing from the screenshot";
  double left = 0, right = 0;
  for (size_t i = 0; i < 50; ++i) {
    left += lowest[static_cast<size_t>(cols[i])];
    right += lowest[static_cast<size_t>(cols[cols.size() - 1 - i])];
  }
  EXPECT_GT(right / 50, left / 50 + 100) << "the loss line does not fall";
  int widest_gap = 0;
  for (size_t i = 1; i < cols.size(); ++i)
    if (cols[i] > cols.front() + 300 && cols[i] < cols.back() - 300)
      widest_gap = std::max(widest_gap, cols[i] - cols[i - 1]);
  EXPECT_GE(widest_gap, 5) << "no gap at the skipped step";

  // The heatmaps, below the line plots: bands of rows filled across the plot with the colour bar's
  // top (4x the mean) and bottom (no tokens). Layer 0: expert 0 (top) over expert 1 (bottom);
  // layer 1: expert 6 (bottom) over expert 7 (top). 16 px a row for 8 experts.
  const auto hot = wide_bands(im, report_heat_rgb(1), 600), cold = wide_bands(im, report_heat_rgb(-1), 600);
  ASSERT_EQ(hot.size(), 2u) << "heatmap rows of the busiest experts";
  ASSERT_EQ(cold.size(), 2u) << "heatmap rows of the idle experts";
  for (const auto& b : hot) EXPECT_NEAR(b.second - b.first + 1, 16, 2);
  for (const auto& b : cold) EXPECT_NEAR(b.second - b.first + 1, 16, 2);
  EXPECT_GT(hot[0].first, loss_bottom);
  EXPECT_NEAR(cold[0].first, hot[0].second + 1, 2);  // layer 0: expert 1 right under expert 0
  EXPECT_NEAR(hot[1].first, cold[1].second + 1, 2);  // layer 1: expert 7 right under expert 6
  EXPECT_GT(cold[1].first, hot[0].second + 100);     // layer 1 is the second heatmap
}

}  // namespace
}  // namespace moefold

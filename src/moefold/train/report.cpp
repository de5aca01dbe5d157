// `moefold report` (report.h): metrics.jsonl read into columns, line plots and expert-load
// heatmaps drawn as inline SVG by hand, and the page around them. Long runs are thinned before
// drawing (min and max per bucket, so spikes survive) to keep the page a few hundred kB.
#include "moefold/train/report.h"

#include <toml++/toml.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>
#include <utility>
#include <vector>

#include "moefold/core/error.h"
#include "moefold/data/npy.h"

namespace moefold {

namespace fs = std::filesystem;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr size_t kMaxLinePoints = 2000;       // per series: ~25 kB of path text
constexpr int64_t kMaxHeatColumns = 400;      // per heatmap
constexpr int64_t kHeatCellBudget = 1000000;  // cells over every heatmap (~7 bytes each)
constexpr int kHeatHalfLevels = 16;           // colour steps on either side of the mean

// ---- text --------------------------------------------------------------------------------------

std::string escape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    const char* e = c == '&'    ? "&amp;"
                    : c == '<'  ? "&lt;"
                    : c == '>'  ? "&gt;"
                    : c == '"'  ? "&quot;"
                    : c == '\'' ? "&#39;"
                                : nullptr;
    if (e)
      out += e;
    else
      out += c;
  }
  return out;
}

// printf onto the end of `out`.
__attribute__((format(printf, 2, 3))) void put(std::string& out, const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  const int n = std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  if (static_cast<size_t>(n) < sizeof buf) {
    out.append(buf, static_cast<size_t>(n));
    return;
  }
  std::string big(static_cast<size_t>(n) + 1, '\0');
  va_start(ap, fmt);
  std::vsnprintf(big.data(), big.size(), fmt, ap);
  va_end(ap);
  out.append(big.data(), static_cast<size_t>(n));
}

// A coordinate with one decimal, "12" rather than "12.0".
void put_coord(std::string& out, double v) {
  const long long tenths = std::llround(v * 10);
  if (tenths % 10 == 0)
    put(out, "%lld", tenths / 10);
  else
    put(out, "%.1f", static_cast<double>(tenths) / 10);
}

std::string rgb_hex(uint32_t rgb) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "#%06x", rgb & 0xffffff);
  return buf;
}

std::string format_value(double v, const char* fmt = "%.4f") {
  if (!std::isfinite(v)) return "non-finite";
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, v);
  return buf;
}

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const long long t = std::llround(s);
  char buf[48];
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%lldh %02lldm %02llds", t / 3600, t / 60 % 60, t % 60);
  else if (s < 60)
    std::snprintf(buf, sizeof buf, "%.1f s", s);
  else
    std::snprintf(buf, sizeof buf, "%lldm %02llds", t / 60, t % 60);
  return buf;
}

// ---- metrics.jsonl -----------------------------------------------------------------------------

// A per-MoE-layer field as a [lines, width] table (width: the longest array seen), NaN where a
// line lacks the field or a layer. float: a long run of a deep model stays a few hundred MB.
struct LayerColumn {
  size_t width = 0;
  std::vector<float> values;

  void add(size_t row, const std::vector<float>& v) {
    if (v.size() > width) {  // re-stride (a wider array than before: not seen in practice)
      std::vector<float> wider(row * v.size(), static_cast<float>(kNaN));
      for (size_t r = 0; r * width < values.size(); ++r)
        std::copy_n(values.begin() + static_cast<ptrdiff_t>(r * width), width,
                    wider.begin() + static_cast<ptrdiff_t>(r * v.size()));
      values = std::move(wider);
      width = v.size();
    }
    values.resize(row * width, static_cast<float>(kNaN));
    values.insert(values.end(), v.begin(), v.end());
    values.resize((row + 1) * width, static_cast<float>(kNaN));
  }
  // Layer `layer` over the lines.
  std::vector<double> column(size_t layer) const {
    std::vector<double> out(width > 0 ? values.size() / width : 0, kNaN);
    if (layer < width)
      for (size_t r = 0; r < out.size(); ++r) out[r] = values[r * width + layer];
    return out;
  }
};

// The run's metrics as columns, one entry per line: numbers (and booleans, as 0/1) of every key, and
// arrays of numbers (one per MoE layer). A key a line lacks, or null (NaN is written as null), is NaN
// there. Strings and objects are not plotted and skipped.
struct Metrics {
  std::vector<double> step;
  std::map<std::string, std::vector<double>> scalar;
  std::map<std::string, LayerColumn> per_layer;
  bool torn_last_line = false;

  size_t rows() const { return step.size(); }
  const std::vector<double>* find(const std::string& key) const {
    auto it = scalar.find(key);
    return it == scalar.end() ? nullptr : &it->second;
  }
  // A per-layer field with at least one layer, or null.
  const LayerColumn* find_layers(const std::string& key) const {
    auto it = per_layer.find(key);
    return it == per_layer.end() || it->second.width == 0 ? nullptr : &it->second;
  }
};

bool any_finite(const std::vector<double>* v) {
  return v && std::any_of(v->begin(), v->end(), [](double x) { return std::isfinite(x); });
}

double number_or_nan(const nlohmann::json& v) {
  if (v.is_boolean()) return v.get<bool>() ? 1.0 : 0.0;
  if (v.is_number()) return v.get<double>();
  return kNaN;
}

void add_line(Metrics& m, const nlohmann::json& j, const std::string& where) {
  if (!j.is_object()) MF_FAIL(where, ": not a JSON object");
  const auto s = j.find("step");
  if (s == j.end() || !s->is_number() || s->get<double>() != std::floor(s->get<double>()))
    MF_FAIL(where, ": no integer \"step\"");
  const size_t r = m.rows();
  m.step.push_back(s->get<double>());
  std::vector<float> vals;
  for (const auto& [key, v] : j.items()) {
    if (key == "step") continue;
    if (v.is_number() || v.is_boolean() || v.is_null()) {
      auto& col = m.scalar[key];
      col.resize(r, kNaN);
      col.push_back(number_or_nan(v));
    } else if (v.is_array() &&
               std::all_of(v.begin(), v.end(), [](const nlohmann::json& e) { return e.is_number() || e.is_null(); })) {
      vals.clear();
      for (const auto& e : v) vals.push_back(static_cast<float>(number_or_nan(e)));
      m.per_layer[key].add(r, vals);
    }
  }
}

Metrics read_metrics(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) MF_FAIL(path, ": missing (a run directory of `moefold train --run-dir` has one)");
  Metrics m;
  size_t line_no = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_no;
    const bool unterminated = in.eof();  // getline met the end before a newline
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      // A line still being written (no newline yet): the run is going on, not broken.
      if (unterminated) {
        m.torn_last_line = true;
        break;
      }
      MF_FAIL(path, ":", line_no, ": not JSON: ", e.what());
    }
    add_line(m, j, cat(path, ":", line_no));
  }
  if (in.bad()) MF_FAIL(path, ": read error after line ", line_no);
  for (auto& [key, col] : m.scalar) col.resize(m.rows(), kNaN);
  for (auto& [key, col] : m.per_layer) col.values.resize(m.rows() * col.width, static_cast<float>(kNaN));
  return m;
}

// ---- config.toml -------------------------------------------------------------------------------

// What the page shows of the config: read leniently, since a report of an old or odd run should
// still come out (a config that does not parse is shown as text, with a note).
struct RunConfig {
  bool present = false;
  std::string text, parse_error;
  std::string preset, architecture;
  int64_t steps = -1, expert_load_interval = -1;
};

RunConfig read_config(const std::string& path) {
  RunConfig c;
  std::ifstream in(path, std::ios::binary);
  if (!in) return c;
  c.present = true;
  std::stringstream ss;
  ss << in.rdbuf();
  c.text = ss.str();
  try {
    const toml::table t = toml::parse(c.text, path);
    c.preset = t["preset"].value_or(std::string());
    c.architecture = t["model"]["architecture"].value_or(std::string());
    c.steps = t["train"]["steps"].value_or(int64_t{-1});
    c.expert_load_interval = t["train"]["expert_load_interval"].value_or(int64_t{-1});
  } catch (const toml::parse_error& e) {
    c.parse_error = std::string(e.description());
  }
  return c;
}

// ---- axes --------------------------------------------------------------------------------------

double nice_step(double raw) {
  if (!(raw > 0) || !std::isfinite(raw)) return 1;
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  const double f = raw / p;
  return (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * p;
}

std::vector<double> ticks(double lo, double hi, double step) {
  std::vector<double> out;
  for (double k = std::ceil(lo / step - 1e-9); k * step <= hi + step * 1e-9 && out.size() < 50; ++k)
    out.push_back(k * step);
  return out;
}

// A tick label precise enough to tell neighbours `step` apart: 0.25, 3e-05, 12k, 1.5M; the axis's
// largest magnitude `axis_max` picks one suffix for all its labels.
std::string tick_label(double v, double step, double axis_max) {
  if (std::fabs(v) < step * 1e-6) v = 0;
  char buf[48];
  const double a = std::max(std::fabs(v), step);
  if (axis_max >= 1e4) {
    static const std::pair<double, const char*> kSi[] = {{1e12, "T"}, {1e9, "G"}, {1e6, "M"}, {1e3, "k"}};
    for (const auto& [scale, suffix] : kSi) {
      if (axis_max < scale) continue;
      const int dec = std::max(0, static_cast<int>(-std::floor(std::log10(step / scale) + 1e-9)));
      std::snprintf(buf, sizeof buf, "%.*f%s", std::min(dec, 3), v / scale, suffix);
      return buf;
    }
  }
  if (step < 1e-3) {  // significant digits down to the step's: 3e-05, 0.2006
    const int digits = static_cast<int>(std::floor(std::log10(a) + 1e-9) - std::floor(std::log10(step) + 1e-9)) + 1;
    std::snprintf(buf, sizeof buf, "%.*g", std::clamp(digits, 1, 12), v);
    return buf;
  }
  const int dec = std::max(0, static_cast<int>(-std::floor(std::log10(step) + 1e-9)));
  std::snprintf(buf, sizeof buf, "%.*f", dec, v);
  return buf;
}

// ---- line plots --------------------------------------------------------------------------------

struct Series {
  std::string name, colour;
  std::vector<double> x, y;  // y non-finite: a gap in the line
  bool dots = false;         // sparse points (evaluations): drawn as dots joined by a thin line
  double width = 2;
  double opacity = 1;
};

struct LinePlot {
  LinePlot(std::string id_, std::string title_, std::string y_label_)
      : id(std::move(id_)), title(std::move(title_)), y_label(std::move(y_label_)) {}
  std::string id, title, y_label, x_label = "step";
  std::vector<Series> series;
  std::vector<std::pair<std::string, std::string>> legend;  // (name, colour); empty: one per series
  std::vector<double> marks;                                // x of steps ticked on the x axis (skipped steps)
  std::string marks_name;
};

// At most `max_points` of (x, y): per bucket of consecutive points the smallest and the largest y
// in their order, so a spike of one step still shows; a bucket holding a non-finite y ends in a gap.
void thin(std::vector<double>& x, std::vector<double>& y, size_t max_points) {
  const size_t n = y.size();
  if (n <= max_points) return;
  const size_t buckets = max_points / 2;
  std::vector<double> ox, oy;
  ox.reserve(max_points + buckets);
  oy.reserve(max_points + buckets);
  for (size_t b = 0; b < buckets; ++b) {
    const size_t lo = b * n / buckets, hi = (b + 1) * n / buckets;
    size_t imin = hi, imax = hi, igap = hi;
    for (size_t i = lo; i < hi; ++i) {
      if (!std::isfinite(y[i])) {
        if (igap == hi) igap = i;
        continue;
      }
      if (imin == hi || y[i] < y[imin]) imin = i;
      if (imax == hi || y[i] > y[imax]) imax = i;
    }
    if (imin != hi) {
      const size_t first = std::min(imin, imax), second = std::max(imin, imax);
      ox.push_back(x[first]);
      oy.push_back(y[first]);
      if (second != first) {
        ox.push_back(x[second]);
        oy.push_back(y[second]);
      }
    }
    if (igap != hi) {
      ox.push_back(x[igap]);
      oy.push_back(kNaN);
    }
  }
  x = std::move(ox);
  y = std::move(oy);
}

// Layout of every line plot (CSS pixels).
constexpr int kPlotW = 960, kLeft = 76, kRight = 16, kPlotH = 220, kBottom = 44;

void legend_items(std::string& out, const std::vector<std::pair<std::string, std::string>>& items, int& top) {
  // Items flow left to right from the plot's left edge; widths estimated at 6.6 px per character.
  double x = kLeft, y = 40;
  for (const auto& [name, colour] : items) {
    const double w = 34 + 6.6 * static_cast<double>(name.size());
    if (x + w > kPlotW - kRight && x > kLeft) {
      x = kLeft;
      y += 16;
    }
    put(out, "<path d=\"M%.0f %.0fh22\" stroke=\"%s\" stroke-width=\"3\"/>", x, y - 4, colour.c_str());
    put(out, "<text x=\"%.0f\" y=\"%.0f\">%s</text>", x + 27, y, escape(name).c_str());
    x += w;
  }
  top = static_cast<int>(y) + 12;
}

std::string svg_line_plot(const LinePlot& p) {
  // The ranges over every finite point.
  double x0 = std::numeric_limits<double>::infinity(), x1 = -x0, y0 = x0, y1 = -x0;
  for (const Series& s : p.series)
    for (size_t i = 0; i < s.y.size(); ++i)
      if (std::isfinite(s.y[i]) && std::isfinite(s.x[i])) {
        x0 = std::min(x0, s.x[i]);
        x1 = std::max(x1, s.x[i]);
        y0 = std::min(y0, s.y[i]);
        y1 = std::max(y1, s.y[i]);
      }
  for (double m : p.marks) {
    x0 = std::min(x0, m);
    x1 = std::max(x1, m);
  }
  if (!std::isfinite(x0)) return "";  // nothing to draw
  if (!std::isfinite(y0)) y0 = 0, y1 = 1;
  if (x1 == x0) x0 -= 1, x1 += 1;
  if (y1 == y0) {
    const double pad = y0 == 0 ? 1 : std::fabs(y0) * 0.1;
    y0 = y0 == 0 ? 0 : y0 - pad;
    y1 += pad;
  } else {
    const double pad = (y1 - y0) * 0.05;
    y0 = y0 >= 0 ? std::max(0.0, y0 - pad) : y0 - pad;  // no negative axis under a quantity that is never negative
    y1 += pad;
  }

  std::vector<std::pair<std::string, std::string>> legend = p.legend;
  if (legend.empty())
    for (const Series& s : p.series) legend.emplace_back(s.name, s.colour);
  if (!p.marks.empty()) legend.emplace_back(p.marks_name, "#999999");
  std::string body;
  int top = 0;
  legend_items(body, legend, top);
  const int pw = kPlotW - kLeft - kRight, ph = kPlotH, height = top + ph + kBottom;
  auto px = [&](double x) { return kLeft + (x - x0) / (x1 - x0) * pw; };
  auto py = [&](double y) { return top + ph - (y - y0) / (y1 - y0) * ph; };

  std::string out;
  put(out, "<svg class=\"plot\" id=\"%s\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" role=\"img\">", p.id.c_str(),
      kPlotW, height, kPlotW, height);
  put(out, "<title>%s</title>", escape(p.title).c_str());
  put(out, "<text class=\"title\" x=\"%d\" y=\"18\">%s</text>", kLeft, escape(p.title).c_str());
  out += body;
  put(out, "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"none\" stroke=\"#bbbbbb\"/>", kLeft, top, pw, ph);
  // Grid and tick labels.
  const double ystep = nice_step((y1 - y0) / 5);
  for (double t : ticks(y0, y1, ystep)) {
    const double y = py(t);
    put(out, "<path d=\"M%d %.1fh%d\" stroke=\"#eeeeee\"/>", kLeft + 1, y, pw - 1);
    put(out, "<text x=\"%d\" y=\"%.1f\" text-anchor=\"end\">%s</text>", kLeft - 6, y + 4,
        tick_label(t, ystep, std::max(std::fabs(y0), std::fabs(y1))).c_str());
  }
  const double xstep = std::max(1.0, nice_step((x1 - x0) / 8));
  for (double t : ticks(x0, x1, xstep)) {
    const double x = px(t);
    put(out, "<path d=\"M%.1f %dv%d\" stroke=\"#eeeeee\"/>", x, top + 1, ph - 1);
    put(out, "<text x=\"%.1f\" y=\"%d\" text-anchor=\"middle\">%s</text>", x, top + ph + 16,
        tick_label(t, xstep, std::max(std::fabs(x0), std::fabs(x1))).c_str());
  }
  put(out, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\">%s</text>", kLeft + pw / 2, top + ph + 36,
      escape(p.x_label).c_str());
  put(out, "<text x=\"16\" y=\"%d\" text-anchor=\"middle\" transform=\"rotate(-90 16 %d)\">%s</text>", top + ph / 2,
      top + ph / 2, escape(p.y_label).c_str());
  // Skipped steps: ticks up from the x axis.
  if (!p.marks.empty()) {
    out += "<path class=\"marks\" stroke=\"#999999\" stroke-width=\"1\" d=\"";
    long long last_px = -1;
    for (double m : p.marks) {
      const long long x = std::llround(px(m));
      if (x == last_px) continue;
      last_px = x;
      put(out, "M%lld %dv-8", x, top + ph);
    }
    out += "\"/>";
  }
  // The lines: one path per series, a gap (a new subpath) wherever y is not finite; a point alone
  // between gaps is a zero-length subpath, which round caps draw as a dot.
  for (const Series& s : p.series) {
    std::string d;
    size_t run = 0;
    for (size_t i = 0; i < s.y.size(); ++i) {
      if (!std::isfinite(s.y[i]) || !std::isfinite(s.x[i])) {
        if (run == 1) d += "h0";
        run = 0;
        continue;
      }
      d += run == 0 ? "M" : " ";
      put_coord(d, px(s.x[i]));
      d += ' ';
      put_coord(d, py(s.y[i]));
      ++run;
    }
    if (run == 1) d += "h0";
    if (d.empty()) continue;
    put(out,
        "<path class=\"series\" fill=\"none\" stroke=\"%s\" stroke-width=\"%.1f\" stroke-linejoin=\"round\" "
        "stroke-linecap=\"round\"%s d=\"",
        s.colour.c_str(), s.dots ? 1.0 : s.width,
        s.opacity < 1 ? cat(" stroke-opacity=\"", s.opacity, "\"").c_str() : "");
    out += d;
    out += "\"/>";
    if (s.dots)
      for (size_t i = 0; i < s.y.size(); ++i)
        if (std::isfinite(s.y[i]))
          put(out, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"%s\"/>", px(s.x[i]), py(s.y[i]), s.colour.c_str());
  }
  out += "</svg>\n";
  return out;
}

Series series_of(const Metrics& m, const std::vector<double>& values, std::string name, std::string colour) {
  Series s;
  s.name = std::move(name);
  s.colour = std::move(colour);
  for (size_t i = 0; i < values.size(); ++i) {
    s.x.push_back(m.step[i]);
    s.y.push_back(values[i]);
  }
  thin(s.x, s.y, kMaxLinePoints);
  return s;
}

// The points of a field only where it has a value (evaluations): no gaps between them.
Series sparse_series_of(const Metrics& m, const std::vector<double>& values, std::string name, std::string colour) {
  Series s;
  s.name = std::move(name);
  s.colour = std::move(colour);
  s.dots = true;
  for (size_t i = 0; i < values.size(); ++i)
    if (std::isfinite(values[i])) {
      s.x.push_back(m.step[i]);
      s.y.push_back(values[i]);
    }
  thin(s.x, s.y, kMaxLinePoints);
  return s;
}

// ---- colours -----------------------------------------------------------------------------------

uint32_t lerp_rgb(const uint32_t* stops, int n, double t) {
  t = std::clamp(t, 0.0, 1.0) * (n - 1);
  const int i = std::min(static_cast<int>(t), n - 2);
  const double f = t - i;
  uint32_t out = 0;
  for (int shift = 16; shift >= 0; shift -= 8) {
    const double a = (stops[i] >> shift) & 0xff, b = (stops[i + 1] >> shift) & 0xff;
    out |= static_cast<uint32_t>(std::lround(a + (b - a) * f)) << shift;
  }
  return out;
}

// One colour per MoE layer: Okabe and Ito's colour-blind-safe set up to 8 layers (none near the loss
// line's blue), viridis beyond.
std::string layer_colour(size_t layer, size_t num) {
  static const uint32_t kCategorical[] = {0xe69f00, 0x56b4e9, 0x009e73, 0xd55e00,
                                          0xcc79a7, 0xf0e442, 0x000000, 0x882255};
  static const uint32_t kViridis[] = {0x440154, 0x3b528b, 0x21918c, 0x5ec962, 0xfde725};
  if (num <= std::size(kCategorical)) return rgb_hex(kCategorical[layer]);
  return rgb_hex(lerp_rgb(kViridis, 5, static_cast<double>(layer) / static_cast<double>(num - 1)));
}

// ---- expert-load heatmaps ----------------------------------------------------------------------

struct ExpertLoads {
  int64_t slices = 0, layers = 0, experts = 0;
  std::vector<float> values;  // [slices, layers, experts]
  std::vector<double> mean;   // [slices, layers]: over the experts
  std::string note;           // why there are no heatmaps, when there are none
};

// expert_load.npy as written by the run loop. Its header is rewritten after each slice, so a read
// racing an append can see one slice more than the header says: read again once, then give up on
// the heatmaps (a note says why) rather than on the whole report.
ExpertLoads read_expert_loads(const std::string& path) {
  ExpertLoads l;
  NpyFloats f;
  for (int attempt = 0;; ++attempt) {
    try {
      f = read_npy_f32(path);
      break;
    } catch (const Error& e) {
      if (attempt == 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        continue;
      }
      l.note = cat("expert_load.npy could not be read (", e.what(), "): no heatmaps.");
      return l;
    }
  }
  if (f.shape.size() != 3) {
    l.note =
        cat("expert_load.npy has ", f.shape.size(), " dimensions, not [slices, MoE layers, experts]: no heatmaps.");
    return l;
  }
  l.slices = f.shape[0];
  l.layers = f.shape[1];
  l.experts = f.shape[2];
  l.values = std::move(f.values);
  l.mean.resize(static_cast<size_t>(l.slices * l.layers));
  for (size_t i = 0; i < l.mean.size(); ++i) {
    double sum = 0;
    for (int64_t e = 0; e < l.experts; ++e) sum += l.values[i * static_cast<size_t>(l.experts) + e];
    l.mean[i] = l.experts > 0 ? sum / static_cast<double>(l.experts) : kNaN;
  }
  return l;
}

// tokens / mean of the layer at that slice (NaN when the layer saw no tokens then).
double load_ratio(const ExpertLoads& l, int64_t slice, int64_t layer, int64_t expert) {
  const int64_t row = slice * l.layers + layer;
  const double mean = l.mean[static_cast<size_t>(row)];
  if (!(mean > 0) || !std::isfinite(mean)) return kNaN;
  return l.values[static_cast<size_t>(row * l.experts + expert)] / mean;
}

// The colour bar: log2(tokens / mean) from -top_log2 to +top_log2 as -1..1, quantised to
// kHeatHalfLevels steps either side so equal colours merge into runs.
int heat_level(double ratio, double top_log2) {
  if (!(ratio > 0)) return -kHeatHalfLevels;
  const double pos = std::clamp(std::log2(ratio) / top_log2, -1.0, 1.0);
  return static_cast<int>(std::lround(pos * kHeatHalfLevels));
}

// One layer's cells, [experts, cols]: column c averages tokens / mean over slices [c N / cols,
// (c + 1) N / cols); NaN where the layer saw no tokens in any of them.
std::vector<double> heat_cells(const ExpertLoads& l, int64_t layer, int64_t cols) {
  std::vector<double> cells(static_cast<size_t>(l.experts * cols), kNaN);
  for (int64_t e = 0; e < l.experts; ++e)
    for (int64_t c = 0; c < cols; ++c) {
      double sum = 0;
      int n = 0;
      for (int64_t s = c * l.slices / cols; s < (c + 1) * l.slices / cols; ++s)
        if (const double r = load_ratio(l, s, layer, e); std::isfinite(r)) sum += r, ++n;
      if (n > 0) cells[static_cast<size_t>(e * cols + c)] = sum / n;
    }
  return cells;
}

std::string svg_heatmap(const std::vector<double>& cells, int64_t layer, int64_t E, int64_t N, int64_t cols,
                        double top_log2, int64_t interval) {
  const int row_h = static_cast<int>(std::clamp<int64_t>(256 / std::max<int64_t>(E, 1), 1, 16));
  const int ph = static_cast<int>(E) * row_h, top = 30, bar_w = 14;
  const int pw = kPlotW - kLeft - 110, height = top + std::max(ph, 60) + kBottom;
  // Each colour is one path of horizontal strokes one row wide (cell units), a run of equal cells
  // one stroke, a stroke after another in the same row a relative move: ~7 bytes a cell where no run
  // merges.
  struct Strokes {
    std::string d;
    int64_t row = -1, end = 0;  // where the last stroke ended
  };
  constexpr int kGrey = std::numeric_limits<int>::min();  // no tokens in the layer
  std::map<int, Strokes> paths;                           // colour level -> its strokes
  for (int64_t e = 0; e < E; ++e) {
    int run_level = 0;
    int64_t run_start = 0, run_len = 0;
    auto flush = [&] {
      if (run_len == 0) return;
      Strokes& p = paths[run_level];
      if (p.row == e)
        put(p.d, "m%lld 0h%lld", static_cast<long long>(run_start - p.end), static_cast<long long>(run_len));
      else
        put(p.d, "M%lld %lld.5h%lld", static_cast<long long>(run_start), static_cast<long long>(e),
            static_cast<long long>(run_len));
      p.row = e;
      p.end = run_start + run_len;
      run_len = 0;
    };
    for (int64_t c = 0; c < cols; ++c) {
      const double r = cells[static_cast<size_t>(e * cols + c)];
      const int level = std::isfinite(r) ? heat_level(r, top_log2) : kGrey;
      if (run_len > 0 && level != run_level) flush();
      if (run_len == 0) run_level = level, run_start = c;
      ++run_len;
    }
    flush();
  }
  std::string out;
  put(out,
      "<svg class=\"heatmap\" id=\"heatmap-layer-%lld\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" "
      "role=\"img\">",
      static_cast<long long>(layer), kPlotW, height, kPlotW, height);
  put(out, "<title>MoE layer %lld</title>", static_cast<long long>(layer));
  put(out, "<text class=\"title\" x=\"%d\" y=\"18\">MoE layer %lld: tokens per expert / layer mean</text>", kLeft,
      static_cast<long long>(layer));
  put(out,
      "<svg x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %lld %lld\" preserveAspectRatio=\"none\" "
      "shape-rendering=\"crispEdges\">",
      kLeft, top, pw, ph, static_cast<long long>(cols), static_cast<long long>(E));
  for (const auto& [level, p] : paths)
    out += cat("<path fill=\"none\" stroke-width=\"1\" stroke=\"",
               level == kGrey ? "#bdbdbd" : rgb_hex(report_heat_rgb(static_cast<double>(level) / kHeatHalfLevels)),
               "\" d=\"", p.d, "\"/>");
  out += "</svg>";
  put(out, "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"none\" stroke=\"#bbbbbb\"/>", kLeft, top, pw, ph);
  // y: experts (row centres).
  const int64_t estep = E <= 16 ? 1 : static_cast<int64_t>(nice_step(static_cast<double>(E) / 8));
  for (int64_t e = 0; e < E; e += estep)
    put(out, "<text x=\"%d\" y=\"%.1f\" text-anchor=\"end\">%lld</text>", kLeft - 6, top + (e + 0.5) * row_h + 4,
        static_cast<long long>(e));
  put(out, "<text x=\"16\" y=\"%d\" text-anchor=\"middle\" transform=\"rotate(-90 16 %d)\">expert</text>", top + ph / 2,
      top + ph / 2);
  // x: the step of each slice ((i + 1) x train.expert_load_interval), or the slice when unknown.
  const double unit = interval > 0 ? static_cast<double>(interval) : 1;
  const double first = unit, last = static_cast<double>(N) * unit;
  auto px = [&](double step) { return kLeft + (step / unit - 0.5) / static_cast<double>(N) * pw; };
  const double xstep = std::max(unit, nice_step((last - first) / 8));
  for (double t : ticks(first, last, xstep)) {
    put(out, "<path d=\"M%.1f %dv5\" stroke=\"#666666\"/>", px(t), top + ph);
    put(out, "<text x=\"%.1f\" y=\"%d\" text-anchor=\"middle\">%s</text>", px(t), top + ph + 18,
        tick_label(t, xstep, last).c_str());
  }
  put(out, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\">%s</text>", kLeft + pw / 2, top + ph + 36,
      interval > 0 ? "step" : "slice of expert_load.npy (train.expert_load_interval unknown)");
  // The colour bar: one block per level, labelled at the powers of two.
  const int bx = kLeft + pw + 20, levels = 2 * kHeatHalfLevels + 1;
  const double bh = static_cast<double>(std::max(ph, 60)) / levels;
  out += "<g shape-rendering=\"crispEdges\">";
  for (int k = -kHeatHalfLevels; k <= kHeatHalfLevels; ++k)
    put(out, "<rect x=\"%d\" y=\"%.2f\" width=\"%d\" height=\"%.2f\" fill=\"%s\"/>", bx,
        top + (kHeatHalfLevels - k) * bh, bar_w, bh + 0.5,
        rgb_hex(report_heat_rgb(static_cast<double>(k) / kHeatHalfLevels)).c_str());
  out += "</g>";
  const int top_k = static_cast<int>(std::lround(top_log2));
  const int label_every = std::max(1, static_cast<int>(std::ceil((2 * top_k + 1) * 12.0 / (levels * bh))));
  for (int k = -top_k; k <= top_k; k += label_every) {
    const double y = top + (kHeatHalfLevels - static_cast<double>(k) / top_k * kHeatHalfLevels + 0.5) * bh;
    char label[32];  // 0.5x, 0.25x, 1/8x, ...
    std::snprintf(label, sizeof label, "%s%s%g\u00d7",
                  k == -top_k  ? "\u2264"
                  : k == top_k ? "\u2265"
                               : "",
                  k < -2 ? "1/" : "", std::ldexp(1.0, k < -2 ? -k : k));
    put(out, "<text x=\"%d\" y=\"%.1f\" font-size=\"10\">%s</text>", bx + bar_w + 4, y + 3, label);
  }
  put(out, "<text x=\"%d\" y=\"%d\" font-size=\"10\">tokens / mean</text>", bx - 4, top - 6);
  out += "</svg>\n";
  return out;
}

// ---- the page ----------------------------------------------------------------------------------

constexpr const char* kStyle =
    "body{font-family:sans-serif;margin:24px;color:#222;max-width:1000px}"
    "h1{font-size:22px}h2{font-size:18px;margin-top:28px}"
    "table.summary td{padding:2px 14px 2px 0}table.summary td:first-child{color:#555}"
    "svg.plot,svg.heatmap{display:block;margin:12px 0;background:#fff}"
    "svg text{font-family:sans-serif;font-size:12px;fill:#333}svg text.title{font-size:14px;font-weight:bold}"
    "p.note{color:#8a5a00}pre{background:#f6f6f6;padding:10px;font-size:12px;overflow-x:auto}";

void summary_row(std::string& out, const std::string& key, const std::string& value) {
  put(out, "<tr><td>%s</td><td>%s</td></tr>", escape(key).c_str(), escape(value).c_str());
}

void note(std::string& out, const std::string& text) { put(out, "<p class=\"note\">%s</p>\n", escape(text).c_str()); }

// The last finite value of a column and its step.
std::pair<double, double> last_finite(const Metrics& m, const std::vector<double>* v) {
  if (v)
    for (size_t i = v->size(); i-- > 0;)
      if (std::isfinite((*v)[i])) return {(*v)[i], m.step[i]};
  return {kNaN, kNaN};
}

void training_plots(std::string& out, const Metrics& m) {
  // Loss: the training loss, its language-model part, and the held-out evaluations; skipped steps
  // (non-finite loss or gradient, train.on_nonfinite = skip) ticked on the axis.
  LinePlot loss{"plot-loss", "Loss", "loss"};
  // lm_loss is a wide pale band under the loss: the two coincide unless the auxiliary losses weigh.
  if (const auto* v = m.find("lm_loss"); any_finite(v)) {
    Series s = series_of(m, *v, "lm_loss", "#2ca02c");
    s.width = 5;
    s.opacity = 0.35;
    loss.series.push_back(std::move(s));
  }
  if (const auto* v = m.find("loss")) loss.series.push_back(series_of(m, *v, "loss", rgb_hex(kReportLossRgb)));
  if (const auto* v = m.find("eval_loss"); any_finite(v))
    loss.series.push_back(sparse_series_of(m, *v, "eval loss", "#ff7f0e"));
  if (const auto* v = m.find("skipped"))
    for (size_t i = 0; i < v->size(); ++i)
      if ((*v)[i] > 0) loss.marks.push_back(m.step[i]);
  loss.marks_name = "skipped step";
  for (const char* name : {"loss", "lm_loss", "eval loss"})  // the legend in this order, whatever draws on top
    for (const Series& s : loss.series)
      if (s.name == name) loss.legend.emplace_back(s.name, s.colour);
  const std::string loss_svg = svg_line_plot(loss);
  if (loss_svg.empty())
    note(out, "No finite loss recorded yet.");
  else
    out += loss_svg;

  // Router and multi-token-prediction losses, when any is not zero.
  LinePlot aux{"plot-aux-loss", "Auxiliary losses", "loss"};
  const std::pair<const char*, const char*> kAux[] = {
      {"aux_loss", "#9467bd"}, {"z_loss", "#8c564b"}, {"mtp_loss", "#e377c2"}};
  for (const auto& [key, colour] : kAux)
    if (const auto* v = m.find(key); v && std::any_of(v->begin(), v->end(), [](double x) { return x != 0; }))
      aux.series.push_back(series_of(m, *v, key, colour));
  if (!aux.series.empty()) out += svg_line_plot(aux);

  // One series each.
  struct One {
    const char *key, *id, *title, *y_label, *colour;
  };
  const One kOnes[] = {{"lr", "plot-lr", "Learning rate", "learning rate", "#9467bd"},
                       {"grad_norm", "plot-grad-norm", "Gradient norm (before clipping)", "global L2 norm", "#8c564b"},
                       {"tokens_per_s", "plot-tokens-per-s", "Throughput", "tokens / s", "#17becf"},
                       {"tflops", "plot-tflops", "Model TFLOP/s", "TFLOP/s", "#bcbd22"}};
  for (const One& o : kOnes)
    if (const auto* v = m.find(o.key); any_finite(v)) {
      LinePlot p{o.id, o.title, o.y_label};
      p.series.push_back(series_of(m, *v, o.key, o.colour));
      out += svg_line_plot(p);
    }
  // Memory: the GPU's peak on CUDA runs, else the process's resident peak.
  const auto* gpu = m.find("gpu_memory_peak_mib");
  const auto* host = m.find("host_memory_peak_mib");
  if (any_finite(gpu) || any_finite(host)) {
    const bool on_gpu = any_finite(gpu);
    LinePlot p{"plot-memory", on_gpu ? "GPU memory, peak so far" : "Host memory, peak resident so far", "MiB"};
    p.series.push_back(
        series_of(m, on_gpu ? *gpu : *host, on_gpu ? "gpu_memory_peak_mib" : "host_memory_peak_mib", "#7f7f7f"));
    out += svg_line_plot(p);
  }
}

// Per MoE layer over steps: the busiest expert's load over the mean (1 = balanced), and where the
// run logs them the idlest expert's and the fraction of routed tokens dropped by a capacity.
void expert_load_plots(std::string& out, const Metrics& m, size_t layers) {
  auto per_layer_plot = [&](LinePlot p, const std::function<std::vector<double>(size_t)>& column) {
    for (size_t l = 0; l < layers; ++l) p.series.push_back(series_of(m, column(l), cat("MoE layer ", l), ""));
    for (size_t l = 0; l < layers; ++l) p.series[l].colour = layer_colour(l, layers);
    if (layers > 8)  // a legend entry per layer would crowd the plot: first, middle, last
      for (size_t l : {size_t{0}, layers / 2, layers - 1})
        p.legend.emplace_back(cat("MoE layer ", l), p.series[l].colour);
    out += svg_line_plot(p);
  };
  const LayerColumn* max = m.find_layers("expert_load_max");
  const LayerColumn* mean = m.find_layers("expert_load_mean");
  const LayerColumn* ratio = m.find_layers("expert_load_max_over_mean");
  const LayerColumn* min = m.find_layers("expert_load_min");
  const LayerColumn* dropped = m.find_layers("expert_load_dropped_fraction");
  auto over_mean = [&](const LayerColumn& top, size_t l) {
    std::vector<double> a = top.column(l), b = mean->column(l);
    for (size_t i = 0; i < a.size(); ++i) a[i] = b[i] > 0 ? a[i] / b[i] : kNaN;
    return a;
  };
  const char* max_title = "Expert load: busiest expert / mean, per MoE layer";
  if (ratio)
    per_layer_plot({"plot-expert-load", max_title, "max / mean"}, [&](size_t l) { return ratio->column(l); });
  else if (max && mean)
    per_layer_plot({"plot-expert-load", max_title, "max / mean"}, [&](size_t l) { return over_mean(*max, l); });
  if (min && mean)
    per_layer_plot({"plot-expert-load-min", "Expert load: idlest expert / mean, per MoE layer", "min / mean"},
                   [&](size_t l) { return over_mean(*min, l); });
  if (dropped && std::any_of(dropped->values.begin(), dropped->values.end(), [](float x) { return x != 0; }))
    per_layer_plot({"plot-expert-dropped", "Tokens dropped by the expert capacity, per MoE layer", "fraction"},
                   [&](size_t l) { return dropped->column(l); });
  else if (dropped)
    note(out, "No token was dropped (dropless routing, or a capacity never reached).");
}

void heatmaps(std::string& out, const ExpertLoads& l, int64_t interval) {
  if (l.slices == 0) {
    note(out, "expert_load.npy holds no slice yet: no heatmaps.");
    return;
  }
  if (l.layers == 0 || l.experts == 0) {
    note(out, "expert_load.npy has no MoE layers (a dense model): no heatmaps.");
    return;
  }
  const int64_t cols = std::min(
      {l.slices, kMaxHeatColumns, std::max<int64_t>(32, kHeatCellBudget / std::max<int64_t>(1, l.layers * l.experts))});
  std::vector<std::vector<double>> cells;
  for (int64_t layer = 0; layer < l.layers; ++layer) cells.push_back(heat_cells(l, layer, cols));
  // One colour scale for every layer, so layers compare: up to the largest cell's power of two
  // (2x at least, 64x at most: beyond, the top colour says ">= 64x").
  double top = 1;
  for (const auto& layer : cells)
    for (double r : layer)
      if (std::isfinite(r)) top = std::max(top, r);
  const double top_log2 = std::clamp(std::ceil(std::log2(top) - 1e-9), 1.0, 6.0);
  put(out,
      "<p>Tokens each expert received (summed over ranks) over the mean of its layer at that step: 1\u00d7 is a "
      "balanced load. %s</p>\n",
      cols < l.slices ? escape(cat("Each column averages ", l.slices / cols, "-", (l.slices + cols - 1) / cols,
                                   " of the ", l.slices, " slices."))
                            .c_str()
                      : "");
  for (int64_t layer = 0; layer < l.layers; ++layer)
    out += svg_heatmap(cells[static_cast<size_t>(layer)], layer, l.experts, l.slices, cols, top_log2, interval);
}

}  // namespace

uint32_t report_heat_rgb(double position) {
  // ColorBrewer's RdYlBu, reversed: blue (idle experts) through pale yellow (the mean) to red (busy).
  static const uint32_t kStops[] = {0x313695, 0x4575b4, 0x74add1, 0xabd9e9, 0xe0f3f8, 0xffffbf,
                                    0xfee090, 0xfdae61, 0xf46d43, 0xd73027, 0xa50026};
  return lerp_rgb(kStops, 11, (position + 1) / 2);
}

std::string run_report_html(const std::string& run_dir) {
  std::error_code ec;
  if (!fs::exists(run_dir, ec)) MF_FAIL(run_dir, ": no such run directory");
  if (!fs::is_directory(run_dir, ec)) MF_FAIL(run_dir, ": not a directory (give the --run-dir of a training run)");
  const fs::path dir(run_dir);
  const Metrics m = read_metrics((dir / "metrics.jsonl").string());
  const RunConfig cfg = read_config((dir / "config.toml").string());
  const std::string abs_dir = fs::absolute(dir, ec).lexically_normal().string();

  std::string out;
  out.reserve(1 << 20);
  put(out,
      "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
      "<meta name=\"viewport\" content=\"width=device-width\"><title>moefold report: %s</title>"
      "<style>%s</style></head>\n<body>\n<h1>moefold run report</h1>\n",
      escape(abs_dir).c_str(), kStyle);

  // The summary.
  out += "<table class=\"summary\">";
  summary_row(out, "run directory", abs_dir);
  if (!cfg.preset.empty()) summary_row(out, "preset", cfg.preset);
  if (!cfg.architecture.empty()) summary_row(out, "architecture", cfg.architecture);
  const double last_step = m.rows() > 0 ? m.step.back() : 0;
  summary_row(out, "steps done",
              cfg.steps > 0 ? cat(static_cast<long long>(last_step), " of ", cfg.steps)
                            : cat(static_cast<long long>(last_step)));
  if (m.rows() > 0) {
    const auto* loss = m.find("loss");
    summary_row(out, "last loss", loss ? format_value(loss->back()) : "not recorded");
    const auto [eval, eval_step] = last_finite(m, m.find("eval_loss"));
    summary_row(
        out, "last eval loss",
        std::isfinite(eval) ? cat(format_value(eval), " (step ", static_cast<long long>(eval_step), ")") : "none yet");
    if (const auto* v = m.find("tokens"); any_finite(v)) {
      double sum = 0;
      for (double t : *v)
        if (std::isfinite(t)) sum += t;
      summary_row(out, "tokens trained on", format_value(sum, "%.0f"));
    }
    if (const auto* v = m.find("step_time_s"); any_finite(v)) {
      double sum = 0;
      for (double t : *v)
        if (std::isfinite(t)) sum += t;
      summary_row(out, "time in steps", format_duration(sum));
    }
    if (const auto* v = m.find("skipped"); v) {
      const auto n = std::count_if(v->begin(), v->end(), [](double x) { return x > 0; });
      if (n > 0) summary_row(out, "skipped steps", cat(n));
    }
  }
  out += "</table>\n";
  if (m.torn_last_line)
    note(out, "The last line of metrics.jsonl is incomplete (the run is still writing it): left out.");
  if (!cfg.present) note(out, "No config.toml in the run directory.");
  if (!cfg.parse_error.empty()) note(out, cat("config.toml does not parse (", cfg.parse_error, "); shown as it is."));

  out += "<h2>Training</h2>\n";
  if (m.rows() == 0)
    note(out, "metrics.jsonl has no steps yet.");
  else
    training_plots(out, m);

  out += "<h2>Expert load</h2>\n";
  size_t layers = 0;  // MoE layers the metrics know of
  for (const char* key : {"expert_load_max", "expert_load_mean", "expert_load_max_over_mean"})
    if (const LayerColumn* c = m.find_layers(key)) layers = std::max(layers, c->width);
  if (layers > 0) expert_load_plots(out, m, layers);
  const std::string npy = (dir / "expert_load.npy").string();
  if (fs::exists(npy, ec)) {
    const ExpertLoads loads = read_expert_loads(npy);
    if (!loads.note.empty())
      note(out, loads.note);
    else
      heatmaps(out, loads, cfg.expert_load_interval);
  } else if (layers > 0) {
    note(out, "No expert_load.npy in the run directory (train.expert_load_interval = 0?): no heatmaps.");
  } else {
    note(out, "No MoE layers recorded (a dense model): no expert-load plots or heatmaps.");
  }

  out += "<h2>Config</h2>\n";
  if (cfg.present) out += cat("<pre id=\"config\">", escape(cfg.text), "</pre>\n");
  out += "</body></html>\n";
  return out;
}

std::string write_run_report(const std::string& run_dir, const std::string& out_path) {
  const std::string html = run_report_html(run_dir);
  const std::string path = out_path.empty() ? (fs::path(run_dir) / "report.html").string() : out_path;
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << html;
  f.close();
  if (!f) MF_FAIL(path, ": cannot write the report");
  return path;
}

}  // namespace moefold

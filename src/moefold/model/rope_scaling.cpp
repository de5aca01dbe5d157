// RoPE scaling (config.h: rope_inv_freq, attention_softmax_scale): the rotary table's inverse
// frequencies, and YaRN's frequency blend and attention factors (arXiv:2309.00071, as Hugging
// Face's _compute_yarn_parameters computes them for DeepSeek-V3).
#include <algorithm>
#include <cmath>

#include "moefold/model/config.h"

namespace moefold {

namespace {
// YaRN's attention factor sqrt(1/t) = 0.1 ln(s) + 1, with mscale scaling the 0.1 as DeepSeek-V3
// parameterises it.
double yarn_mscale(double factor, double mscale) { return factor <= 1 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0; }
}  // namespace

std::vector<double> rope_inv_freq(const ModelConfig& m, double* attention_factor) {
  const int64_t d = m.head_dim, half = d / 2;
  const double base = m.rope_theta;
  std::vector<double> inv(static_cast<size_t>(half));
  for (int64_t j = 0; j < half; ++j) inv[j] = std::pow(base, -2.0 * static_cast<double>(j) / static_cast<double>(d));
  *attention_factor = 1.0;
  if (m.rope_type != "yarn") return inv;
  const double factor = m.rope_factor;
  *attention_factor = m.rope_mscale > 0 && m.rope_mscale_all_dim > 0
                          ? yarn_mscale(factor, m.rope_mscale) / yarn_mscale(factor, m.rope_mscale_all_dim)
                          : yarn_mscale(factor, 1.0);
  const double orig = static_cast<double>(m.rope_original_max_position_embeddings), pi = std::acos(-1.0);
  auto correction_dim = [&](double rotations) {
    return static_cast<double>(d) * std::log(orig / (rotations * 2 * pi)) / (2 * std::log(base));
  };
  double low = std::max(std::floor(correction_dim(m.rope_beta_fast)), 0.0);
  double high = std::min(std::ceil(correction_dim(m.rope_beta_slow)), static_cast<double>(d - 1));
  if (low == high) high += 0.001;
  for (int64_t j = 0; j < half; ++j) {
    const double ramp = std::clamp((static_cast<double>(j) - low) / (high - low), 0.0, 1.0);
    const double extrapolation = 1.0 - ramp;  // weight of the original frequency
    inv[j] = inv[j] / factor * (1.0 - extrapolation) + inv[j] * extrapolation;
  }
  return inv;
}

double attention_softmax_scale(const ModelConfig& m) {
  double scale = 1.0 / std::sqrt(static_cast<double>(m.qk_head_dim()));
  if (m.is_mla() && m.rope_type != "default" && m.rope_mscale_all_dim > 0) {
    const double ms = yarn_mscale(m.rope_factor, m.rope_mscale_all_dim);
    scale *= ms * ms;
  }
  return scale;
}

}  // namespace moefold

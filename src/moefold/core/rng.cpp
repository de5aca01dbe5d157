#include "moefold/core/rng.h"

#include <cmath>

#include "moefold/core/philox.h"

namespace moefold {

std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> c, std::array<uint32_t, 2> k) {
  // draw() takes (seed, stream, index) = the key and the counter's two 64-bit halves.
  const philox::Block b =
      philox::draw(static_cast<uint64_t>(k[1]) << 32 | k[0], static_cast<uint64_t>(c[3]) << 32 | c[2],
                   static_cast<uint64_t>(c[1]) << 32 | c[0]);
  return {b.v[0], b.v[1], b.v[2], b.v[3]};
}

double rng_uniform(uint64_t seed, uint64_t stream, uint64_t index) {
  return philox::to_unit(philox::draw(seed, stream, index).v[0]);
}

double rng_normal(uint64_t seed, uint64_t stream, uint64_t index) {
  const philox::Block r = philox::draw(seed, stream, index);
  const double u1 = philox::to_unit(r.v[0]), u2 = philox::to_unit(r.v[1]);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

uint64_t rng_below(uint64_t seed, uint64_t stream, uint64_t index, uint64_t n) {
  MF_CHECK(n > 0);
  const philox::Block r = philox::draw(seed, stream, index);
  uint64_t x = (static_cast<uint64_t>(r.v[0]) << 32) | r.v[1];
  return x % n;  // bias < n / 2^64: negligible for dataset sizes
}

namespace {
template <class F>
void fill(const Tensor& t, F&& value_of) {
  MF_CHECK(t.contiguous() && t.device() == Device::cpu, "fill ", t.str());
  dispatch_float(t.dtype(), [&]<class T>() {
    T* p = t.ptr<T>();
    for (int64_t i = 0; i < t.numel(); ++i) p[i] = static_cast<T>(value_of(static_cast<uint64_t>(i)));
  });
}
}  // namespace

void fill_normal(const Tensor& t, uint64_t seed, uint64_t stream, double mean, double std, uint64_t first_index) {
  fill(t, [&](uint64_t i) { return mean + std * rng_normal(seed, stream, first_index + i); });
}
void fill_uniform(const Tensor& t, uint64_t seed, uint64_t stream, double lo, double hi) {
  fill(t, [&](uint64_t i) { return lo + (hi - lo) * rng_uniform(seed, stream, i); });
}
void fill_constant(const Tensor& t, double value) {
  fill(t, [&](uint64_t) { return value; });
}

}  // namespace moefold

#include "moefold/core/rng.h"

#include <cmath>

namespace moefold {

namespace {
constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;

std::array<uint32_t, 4> counter(uint64_t stream, uint64_t index) {
  return {static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32), static_cast<uint32_t>(stream),
          static_cast<uint32_t>(stream >> 32)};
}
std::array<uint32_t, 2> key(uint64_t seed) { return {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)}; }
double to_unit(uint32_t x) { return (static_cast<double>(x >> 8) + 0.5) * (1.0 / 16777216.0); }
}  // namespace

std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> c, std::array<uint32_t, 2> k) {
  for (int round = 0; round < 10; ++round) {
    uint64_t p0 = static_cast<uint64_t>(kM0) * c[0];
    uint64_t p1 = static_cast<uint64_t>(kM1) * c[2];
    uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c = {hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0};
    k[0] += kW0;
    k[1] += kW1;
  }
  return c;
}

double rng_uniform(uint64_t seed, uint64_t stream, uint64_t index) {
  return to_unit(philox4x32(counter(stream, index), key(seed))[0]);
}

double rng_normal(uint64_t seed, uint64_t stream, uint64_t index) {
  auto r = philox4x32(counter(stream, index), key(seed));
  double u1 = to_unit(r[0]), u2 = to_unit(r[1]);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

uint64_t rng_below(uint64_t seed, uint64_t stream, uint64_t index, uint64_t n) {
  MF_CHECK(n > 0);
  auto r = philox4x32(counter(stream, index), key(seed));
  uint64_t x = (static_cast<uint64_t>(r[0]) << 32) | r[1];
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

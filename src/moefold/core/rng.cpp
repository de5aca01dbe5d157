#include "moefold/core/rng.h"

#include <algorithm>
#include <cmath>
#include <thread>
#include <vector>

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

// Large tensors are drawn by every core (each value depends only on its index: the same values in
// any split): the host staging of sharded masters with bf16 gradients is initialised here.
void fill_normal(const Tensor& t, uint64_t seed, uint64_t stream, double mean, double std, uint64_t first_index) {
  const int64_t n = t.numel();
  const auto threads = static_cast<int64_t>(std::max(1u, std::thread::hardware_concurrency()));
  if (n < (int64_t{1} << 22) || threads == 1 || !t.contiguous()) {
    fill(t, [&](uint64_t i) { return mean + std * rng_normal(seed, stream, first_index + i); });
    return;
  }
  const Tensor flat = t.view({n});
  const int64_t per = (n + threads - 1) / threads;
  std::vector<std::thread> pool;
  for (int64_t a = 0; a < n; a += per) {
    const int64_t e = std::min(n, a + per);
    pool.emplace_back([&, a, e] {
      fill(flat.slice(a, e), [&](uint64_t i) {
        return mean + std * rng_normal(seed, stream, first_index + static_cast<uint64_t>(a) + i);
      });
    });
  }
  for (std::thread& th : pool) th.join();
}
void fill_uniform(const Tensor& t, uint64_t seed, uint64_t stream, double lo, double hi) {
  fill(t, [&](uint64_t i) { return lo + (hi - lo) * rng_uniform(seed, stream, i); });
}
void fill_constant(const Tensor& t, double value) {
  fill(t, [&](uint64_t) { return value; });
}

}  // namespace moefold

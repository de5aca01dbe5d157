// Deterministic counter-based RNG: Philox4x32-10 (Salmon et al., SC'11), the generator cuRAND
// also implements. Every value is a pure function of (seed, stream, index), so a GPU kernel, a
// sharded rank or a resumed run produces the same numbers for the same element.
#pragma once

#include <array>
#include <cstdint>

#include "moefold/core/tensor.h"

namespace moefold {

// One Philox block: 4 x 32 random bits for counter (c0..c3) under key (k0, k1).
std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> ctr, std::array<uint32_t, 2> key);

// Uniform in (0, 1), 24-bit resolution; element `index` of stream `stream` under `seed`.
double rng_uniform(uint64_t seed, uint64_t stream, uint64_t index);
// Standard normal (Box-Muller on two uniforms of the same block).
double rng_normal(uint64_t seed, uint64_t stream, uint64_t index);
// Uniform integer in [0, n). REQUIRES: n > 0.
uint64_t rng_below(uint64_t seed, uint64_t stream, uint64_t index, uint64_t n);

// Fills a float tensor (f32/f64, cpu, contiguous): element i gets
// mean + std * normal(seed, stream, first_index + i). A shard of a larger tensor passes the
// global index of its first element, so every layout draws the same values.
void fill_normal(const Tensor& t, uint64_t seed, uint64_t stream, double mean, double std, uint64_t first_index = 0);
void fill_uniform(const Tensor& t, uint64_t seed, uint64_t stream, double lo, double hi);
void fill_constant(const Tensor& t, double value);

}  // namespace moefold

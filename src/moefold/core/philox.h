// Philox4x32-10 (Salmon et al., SC'11) for the host and, compiled by nvcc, for CUDA kernels: one
// definition, so the GPU draws the bits core/rng.h draws on the host for the same element.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define MF_HOST_DEVICE __host__ __device__
#else
#define MF_HOST_DEVICE
#endif

namespace moefold::philox {

struct Block {
  uint32_t v[4];
};

// One block: 4 x 32 random bits for counter (index, stream) under key seed.
MF_HOST_DEVICE inline Block draw(uint64_t seed, uint64_t stream, uint64_t index) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  uint32_t c0 = static_cast<uint32_t>(index), c1 = static_cast<uint32_t>(index >> 32);
  uint32_t c2 = static_cast<uint32_t>(stream), c3 = static_cast<uint32_t>(stream >> 32);
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kM0) * c0, p1 = static_cast<uint64_t>(kM1) * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += kW0;
    k1 += kW1;
  }
  return Block{{c0, c1, c2, c3}};
}

// Uniform in (0, 1) from the top 24 bits.
MF_HOST_DEVICE inline double to_unit(uint32_t x) { return (static_cast<double>(x >> 8) + 0.5) * (1.0 / 16777216.0); }

}  // namespace moefold::philox

// GPU parity of the FP8 ops (ops/fp8.h; CUDA side ops/cuda/fp8_quantize.cu and
// fp8_gemm_cutlass.cu) against the CPU reference (ops/cpu/fp8.cpp).
//
// Quantization: every layout (rows; cols in segments of 0, 1, 127, 128, 129 and 300 rows; blocks
// with and without the transposed copy) on f32 and bf16 inputs must match the CPU bit for bit,
// codes and scales, on values spanning ~200 binades with zeros, subnormals, all-zero and all-tiny
// tiles, ties of E4M3's rounding, amax on the 448 * 2^e boundary and non-finite tiles; bytes the
// layout leaves unwritten (the columns between segments) must keep their poison. The inverses
// must match bit for bit too.
//
// GEMMs, against f64 products of the operands quantized and dequantized by the CPU ops (the GPU
// quantizes bit for bit the same, so only the GEMM's own arithmetic differs), on experts with 0,
// 1, 16, 127, 128, 129 and 300 rows (wgrad's K = a group's rows: K tails below 16), O = 80 and 192
// (not multiples of 128), Qwen3-30B-A3B's expert shapes, both accumulate modes and f32 / bf16 dw.
// Tolerances (Frobenius relative error, tests/cuda_testing.h):
// - y, dx and bf16 dw: 4e-3. Products of E4M3 values are exact and the accumulation is f32-like,
//   so the result is one rounding to bf16 away from the f64 value (2^-9 relative at worst, ~1.7e-3
//   in practice, as test_ops_cuda_gemm.cpp's table). Measured on an H200: 1.64e-3..1.69e-3.
// - f32 dw: 3e-4. Hopper's FP8 wgmma keeps only about 14 bits while it sums a block's products
//   (DeepSeek-V3, section 3.3.2), which is why the recipe promotes every 128 terms into f32; the
//   error is of that order per block. Measured: 1.05e-4..1.24e-4 (1.1e-5 with 3 tokens), while
//   an f32 sum would be ~1e-7: a bound of 1e-5 fails.
// - Against the plain bf16 ops: 0.08. Each operand's E4M3 rounding errs by up to 2^-4 relative
//   (~0.026 rms over a binade) and the two add in quadrature (~0.037; measured 0.037..0.038); a
//   wrong scale or layout gives errors of order 1.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cuda_testing.h"
#include "moefold/ops/fp8.h"
#include "moefold/ops/gemm.h"
#include "moefold/ops/moe_ops.h"
#include "moefold/ops/ops.h"

#ifdef MOEFOLD_WITH_CUDA
#include "moefold/ops/cuda/fp8.h"
#endif

namespace moefold {
namespace {

using testing::DevicePool;

// ---- host buffers ----------------------------------------------------------------------------------

// A host tensor owning its bytes (moves keep the storage; no copies).
struct Host {
  std::vector<uint8_t> bytes;
  Tensor t;
  Host(Shape shape, DType dt, uint8_t fill = 0)
      : bytes(static_cast<size_t>(shape.numel()) * dtype_size(dt), fill), t(bytes.data(), dt, shape) {}
  Host(Host&&) = default;
  Host(const Host&) = delete;
  Host& operator=(const Host&) = delete;
};

void set_float(Host& h, int64_t i, float v) {
  if (h.t.dtype() == DType::bf16) {
    const uint16_t b = f32_to_bf16(v);
    std::memcpy(h.bytes.data() + 2 * i, &b, 2);
  } else {
    std::memcpy(h.bytes.data() + 4 * i, &v, 4);
  }
}

Tensor to_device(DevicePool& dev, const Host& h) {
  Tensor d = dev.empty(h.t.shape(), h.t.dtype());
  d.copy_from(h.t);
  return d;
}

// A device tensor whose bytes all hold `fill` (outputs whose unwritten bytes are checked).
Tensor filled(DevicePool& dev, Shape shape, DType dt, uint8_t fill) {
  Tensor d = dev.empty(shape, dt);
  std::vector<uint8_t> bytes(d.nbytes(), fill);
  device_copy(d.data(), Device::cuda, bytes.data(), Device::cpu, bytes.size());
  return d;
}

std::vector<uint8_t> bytes_of(const Tensor& t) {
  std::vector<uint8_t> out(t.nbytes());
  device_copy(out.data(), Device::cpu, t.data(), t.device(), out.size());
  return out;
}

// The first differing byte of two equally long buffers, or -1.
int64_t first_difference(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  return a.size() == b.size() ? -1 : static_cast<int64_t>(std::min(a.size(), b.size()));
}

#define EXPECT_SAME_BYTES(gpu, cpu, what)                                                                     \
  do {                                                                                                        \
    const std::vector<uint8_t> g_ = (gpu), c_ = (cpu);                                                        \
    const int64_t at_ = first_difference(g_, c_);                                                             \
    EXPECT_EQ(at_, -1) << (what) << ": first difference at byte " << at_ << " of " << c_.size() << " (gpu "   \
                       << (at_ >= 0 && at_ < static_cast<int64_t>(g_.size()) ? int(g_[at_]) : -1) << ", cpu " \
                       << (at_ >= 0 && at_ < static_cast<int64_t>(c_.size()) ? int(c_[at_]) : -1) << ")";     \
  } while (0)

// ---- awkward values ----------------------------------------------------------------------------------

// x [rows, cols] of dtype dt: runs of 37 elements share a base binade in [-100, 100] (so tiles mix
// binades and scales span the range), each value that base times 2^[-24, 0], a mantissa with 5
// bits (1 + j / 32: E4M3's rounding meets ties; 1.75 puts amax on a 448 * 2^e boundary) and a
// random sign; 1 in 16 exactly zero. Row 0 and column 1 are zero (all-zero tiles in every
// layout), row 2 holds f32 subnormals (amax below 2^-126: the clamped scale), row 3 values near
// f32's largest.
Host awkward(std::mt19937_64& rng, int64_t rows, int64_t cols, DType dt) {
  Host h({rows, cols}, dt);
  std::uniform_int_distribution<int> base(-100, 100), spread(-24, 0), mant(0, 31), coin(0, 15);
  int b = 0;
  for (int64_t i = 0; i < rows * cols; ++i) {
    if (i % 37 == 0) b = base(rng);
    const int64_t r = i / cols, c = i % cols;
    float v = std::ldexp(1.0f + static_cast<float>(mant(rng)) / 32.0f, b + spread(rng));
    if (coin(rng) & 1) v = -v;
    if (coin(rng) == 0 || r == 0 || c == 1) v = 0.0f;
    if (r == 2) v = std::ldexp(static_cast<float>(mant(rng) + 1), -149 + (c % 8));  // subnormals
    if (r == 3) v = std::ldexp(1.0f + static_cast<float>(mant(rng)) / 32.0f, 120 + (c % 7));
    set_float(h, i, v);
  }
  return h;
}

// Puts NaN, +inf and -inf into a few elements (non-finite tiles: scale 1, saturated values).
void add_non_finite(Host& h) {
  const int64_t n = h.t.numel();
  if (n > 5) set_float(h, 5, NAN);
  if (n > 300) set_float(h, 300, INFINITY);
  if (n > 1000) set_float(h, 1000, -INFINITY);
}

const ExecContext& cpu() { return ExecContext::standard(Device::cpu); }

Host offsets_of(const std::vector<int64_t>& counts) {
  Host h({static_cast<int64_t>(counts.size()) + 1}, DType::i64);
  int64_t* off = h.t.ptr<int64_t>();
  for (size_t j = 0; j < counts.size(); ++j) off[j + 1] = off[j] + counts[j];
  return h;
}

int64_t tiles(int64_t n) { return (n + kFp8Tile - 1) / kFp8Tile; }

constexpr DType kInputs[] = {DType::f32, DType::bf16};

// ---- quantization: bit for bit -------------------------------------------------------------------

void check_rows(std::mt19937_64& rng, int64_t r, int64_t k, DType dt, bool non_finite = false) {
  SCOPED_TRACE(::testing::Message() << "rows " << dtype_name(dt) << " [" << r << ", " << k << "]");
  DevicePool dev;
  Host x = awkward(rng, r, k, dt);
  if (non_finite) add_non_finite(x);
  Host q({r, k}, DType::u8, 0xab), s({tiles(k), r}, DType::f32, 0xab);
  fp8_quantize_rows(cpu(), x.t, q.t, s.t);
  const Tensor xd = to_device(dev, x), qd = filled(dev, {r, k}, DType::u8, 0xab),
               sd = filled(dev, {tiles(k), r}, DType::f32, 0xab);
  fp8_quantize_rows(testing::exec(), xd, qd, sd);
  EXPECT_SAME_BYTES(bytes_of(qd), q.bytes, "codes");
  EXPECT_SAME_BYTES(bytes_of(sd), s.bytes, "scales");
  if (non_finite) return;  // NaN codes dequantize to NaN bit patterns of either side's choosing
  for (DType out : kInputs) {
    Host back({r, k}, out);
    fp8_dequantize_rows(cpu(), q.t, s.t, back.t);
    const Tensor back_d = dev.poisoned({r, k}, out);
    fp8_dequantize_rows(testing::exec(), qd, sd, back_d);
    EXPECT_SAME_BYTES(bytes_of(back_d), back.bytes, "dequantized as " + std::string(dtype_name(out)));
  }
}

#ifdef MOEFOLD_WITH_CUDA
// The rows layout's scales s [B, R] (fp8_quantize_rows's) in the grouped GEMM's layout: group g's
// [B, m_g] block at s[off[g] * B].
Host grouped_scales(const Host& s, const Host& off) {
  const int64_t b_n = s.t.size(0), r = s.t.size(1), g_n = off.t.numel() - 1;
  const int64_t* o = off.t.ptr<int64_t>();
  Host sg({b_n * r}, DType::f32, 0xab);
  for (int64_t g = 0; g < g_n; ++g)
    for (int64_t b = 0; b < b_n; ++b)
      for (int64_t i = o[g]; i < o[g + 1]; ++i)
        sg.t.ptr<float>()[o[g] * b_n + b * (o[g + 1] - o[g]) + (i - o[g])] = s.t.ptr<float>()[b * r + i];
  return sg;
}

// launch_fp8_quantize_rows with group offsets (the grouped GEMM's scales: group g's [B, m_g] block
// at s[off[g] * B]), x and q starting `shift` elements (bytes) into their allocations (unaligned
// starts take the narrower paths): codes as the CPU's fp8_quantize_rows, its scales rearranged.
void check_rows_grouped(std::mt19937_64& rng, const std::vector<int64_t>& counts, int64_t k, DType dt, int64_t shift) {
  const Host off = offsets_of(counts);
  const int64_t g_n = static_cast<int64_t>(counts.size()), r = off.t.ptr<int64_t>()[g_n], b_n = tiles(k);
  SCOPED_TRACE(::testing::Message() << "grouped rows " << dtype_name(dt) << " R " << r << " K " << k << " groups "
                                    << g_n << " shift " << shift);
  DevicePool dev;
  const Host x = awkward(rng, r, k, dt);
  Host q({shift + r * k}, DType::u8, 0xab), s({b_n, r}, DType::f32);
  fp8_quantize_rows(cpu(), x.t, q.t.slice(shift, shift + r * k).view({r, k}), s.t);
  const Host sg = grouped_scales(s, off);
  const size_t es = dtype_size(dt);
  const Tensor xd = dev.empty({shift + r * k}, dt), qd = filled(dev, {shift + r * k}, DType::u8, 0xab),
               sd = filled(dev, {b_n * r}, DType::f32, 0xab), offd = to_device(dev, off);
  device_copy(static_cast<uint8_t*>(xd.data()) + shift * es, Device::cuda, x.bytes.data(), Device::cpu, x.bytes.size());
  cuda::launch_fp8_quantize_rows(testing::exec(), static_cast<uint8_t*>(xd.data()) + shift * es, dt, r, k,
                                 qd.ptr<uint8_t>() + shift, sd.ptr<float>(), offd.ptr<int64_t>(), g_n);
  EXPECT_SAME_BYTES(bytes_of(qd), q.bytes, "codes (after `shift` poisoned bytes)");
  EXPECT_SAME_BYTES(bytes_of(sd), sg.bytes, "grouped scales");
}
#endif

TEST(CudaFp8, QuantizeRowsMatchesCpuBitForBit) {
  MF_REQUIRE_GPU();
  std::mt19937_64 rng(testing::fresh_seed());
  for (DType dt : kInputs) {
    check_rows(rng, 1, 1, dt);
    check_rows(rng, 5, 130, dt);     // k % 4 != 0: the scalar path; a 2-element last tile
    check_rows(rng, 37, 128, dt);    // one whole tile per row
    check_rows(rng, 64, 300, dt);    // vector path with a 44-element last tile
    check_rows(rng, 70, 36, dt);     // k % 8 == 4: 8-byte loads for bf16, 16-byte for f32
    check_rows(rng, 7, 1544, dt);    // 13 tiles, the last of 8 elements; fewer rows than a block's
    check_rows(rng, 300, 1536, dt);  // 12 tiles; rows not a multiple of a block's
    check_rows(rng, 129, 2048, dt);  // training-like rows
    check_rows(rng, 9, 500, dt, true);
  }
#ifdef MOEFOLD_WITH_CUDA
  const std::vector<int64_t> groups = {0, 1, 127, 0, 128, 129, 300, 0};  // empty groups among them
  for (DType dt : kInputs)
    for (int64_t shift : {0, 1, 4}) {  // aligned; unaligned; bf16 8-byte aligned (f32 16)
      check_rows_grouped(rng, groups, 1536, dt, shift);
      check_rows_grouped(rng, groups, 200, dt, shift);
    }
  check_rows_grouped(rng, {512, 512, 512}, 2048, DType::bf16, 0);
#endif
}

// Packed rows (moe.fp8_dispatch's): bytes, padding included, as the CPU's; dequantized alike.
void check_packed(std::mt19937_64& rng, int64_t r, int64_t k, DType dt, bool non_finite = false) {
  SCOPED_TRACE(::testing::Message() << "packed " << dtype_name(dt) << " [" << r << ", " << k << "]");
  DevicePool dev;
  Host x = awkward(rng, r, k, dt);
  if (non_finite) add_non_finite(x);
  const int64_t w = fp8_packed_width(k);
  Host p({r, w}, DType::u8, 0xab);
  fp8_quantize_packed(cpu(), x.t, p.t);
  const Tensor xd = to_device(dev, x), pd = filled(dev, {r, w}, DType::u8, 0xab);
  fp8_quantize_packed(testing::exec(), xd, pd);
  EXPECT_SAME_BYTES(bytes_of(pd), p.bytes, "packed rows");
  if (non_finite) return;
  for (DType out : kInputs) {
    Host back({r, k}, out);
    fp8_dequantize_packed(cpu(), p.t, back.t);
    const Tensor back_d = dev.poisoned({r, k}, out);
    fp8_dequantize_packed(testing::exec(), pd, back_d);
    EXPECT_SAME_BYTES(bytes_of(back_d), back.bytes, "dequantized as " + std::string(dtype_name(out)));
  }
}

TEST(CudaFp8, QuantizePackedMatchesCpuBitForBit) {
  MF_REQUIRE_GPU();
  std::mt19937_64 rng(testing::fresh_seed());
  for (DType dt : kInputs) {
    check_packed(rng, 1, 16, dt);
    check_packed(rng, 5, 144, dt);     // a 16-element last tile, scales padded
    check_packed(rng, 64, 300, dt);    // k % 16 != 0: padding before the scales
    check_packed(rng, 129, 2048, dt);  // Qwen3-30B-A3B's hidden size
    check_packed(rng, 9, 512, dt, true);
  }
}

// The fused SwiGLU quantization (the FP8 experts' fc2 input): the bytes of swiglu_forward (pairs)
// followed by fp8_quantize_packed, on the GPU and against the CPU's composition.
TEST(CudaFp8, SwigluPackedIsSwigluThenQuantize) {
  MF_REQUIRE_GPU();
  std::mt19937_64 rng(testing::fresh_seed());
  for (const auto& [r, f] : {std::pair<int64_t, int64_t>{7, 768}, {129, 144}, {33, 130}, {1, 16}}) {
    SCOPED_TRACE(::testing::Message() << "R " << r << " F " << f);
    DevicePool dev;
    Host gu = awkward(rng, r, 2 * f, DType::bf16);
    const int64_t w = fp8_packed_width(f);
    const Tensor gud = to_device(dev, gu), fused = dev.poisoned({r, w}, DType::u8),
                 split = dev.poisoned({r, w}, DType::u8), h = dev.poisoned({r, f}, DType::bf16);
    fp8_swiglu_packed(testing::exec(), gud, fused);
    swiglu_forward(testing::exec(), gud, h, GateUp::pairs);
    fp8_quantize_packed(testing::exec(), h, split);
    EXPECT_SAME_BYTES(bytes_of(fused), bytes_of(split), "fused vs swiglu_forward + fp8_quantize_packed");
    Host h_gpu({r, f}, DType::bf16), cpu_from_gpu_h({r, w}, DType::u8);
    h_gpu.t.copy_from(h);
    fp8_quantize_packed(cpu(), h_gpu.t, cpu_from_gpu_h.t);
    // The GPU's SwiGLU (tanh.approx sigmoid) may round h differently from the CPU's: the quantization
    // of the GPU's h is the CPU's bit for bit.
    EXPECT_SAME_BYTES(bytes_of(fused), cpu_from_gpu_h.bytes,
                      "GPU packed rows vs the CPU's quantization of the GPU's h");
  }
}

void check_cols(std::mt19937_64& rng, const std::vector<int64_t>& counts, int64_t c, DType dt, int64_t extra_p,
                bool non_finite = false) {
  const Host off = offsets_of(counts);
  const int64_t r = off.t.ptr<int64_t>()[counts.size()], s_n = static_cast<int64_t>(counts.size());
  const int64_t p = fp8_cols_width(r, s_n) + extra_p;
  SCOPED_TRACE(::testing::Message() << "cols " << dtype_name(dt) << " R " << r << " C " << c << " segments " << s_n
                                    << " P " << p);
  DevicePool dev;
  Host x = awkward(rng, r, c, dt);
  if (non_finite) add_non_finite(x);
  Host q({c, p}, DType::u8, 0xab), s({p / kFp8Tile, c}, DType::f32, 0xab);
  fp8_quantize_cols(cpu(), x.t, off.t, q.t, s.t);
  const Tensor xd = to_device(dev, x), offd = to_device(dev, off), qd = filled(dev, {c, p}, DType::u8, 0xab),
               sd = filled(dev, {p / kFp8Tile, c}, DType::f32, 0xab);
  fp8_quantize_cols(testing::exec(), xd, offd, qd, sd);
  EXPECT_SAME_BYTES(bytes_of(qd), q.bytes, "codes (and the unwritten columns' poison)");
  EXPECT_SAME_BYTES(bytes_of(sd), s.bytes, "scales");
  if (non_finite) return;
  for (DType out : kInputs) {
    Host back({r, c}, out);
    fp8_dequantize_cols(cpu(), q.t, s.t, off.t, back.t);
    const Tensor back_d = dev.poisoned({r, c}, out);
    fp8_dequantize_cols(testing::exec(), qd, sd, offd, back_d);
    EXPECT_SAME_BYTES(bytes_of(back_d), back.bytes, "dequantized as " + std::string(dtype_name(out)));
  }
}

TEST(CudaFp8, QuantizeColsMatchesCpuBitForBit) {
  MF_REQUIRE_GPU();
  std::mt19937_64 rng(testing::fresh_seed());
  const std::vector<int64_t> segments = {0, 1, 127, 0, 128, 129, 300, 0};
  for (DType dt : kInputs) {
    check_cols(rng, segments, 64, dt, 0);
    check_cols(rng, segments, 130, dt, 256);  // a partial column chunk; spare columns stay poisoned
    check_cols(rng, segments, 5, dt, 0);      // odd C: the scalar path
    check_cols(rng, {700}, 96, dt, 0);        // one segment (the dense layer's wgrad)
    check_cols(rng, {0, 0}, 8, dt, 128);      // no rows at all
    check_cols(rng, {3, 250}, 40, dt, 0, true);
    check_cols(rng, {512, 0, 200}, 260, dt, 0);  // cols % 4 == 0, not % 128: a partial column chunk
    check_cols(rng, {129}, 6, dt, 0);            // cols % 4 == 2: 4-byte column pairs for bf16
  }
}

#ifdef MOEFOLD_WITH_CUDA
// launch_fp8_quantize_rows_cols (an FP8 backward's dy, read once for both operands): the rows layout
// as the CPU's fp8_quantize_rows (its scales plain, or grouped by the segments) and the cols layout
// as its fp8_quantize_cols, bit for bit, the unwritten columns keeping their poison.
void check_rows_cols(std::mt19937_64& rng, const std::vector<int64_t>& counts, int64_t c, bool grouped,
                     bool non_finite = false) {
  const Host off = offsets_of(counts);
  const int64_t r = off.t.ptr<int64_t>()[counts.size()], s_n = static_cast<int64_t>(counts.size());
  const int64_t p = fp8_cols_width(r, s_n), b_n = tiles(c);
  SCOPED_TRACE(::testing::Message() << "rows and cols R " << r << " C " << c << " segments " << s_n
                                    << (grouped ? " grouped" : " plain") << (non_finite ? " non-finite" : ""));
  DevicePool dev;
  Host x = awkward(rng, r, c, DType::bf16);
  if (non_finite) add_non_finite(x);
  Host q({r, c}, DType::u8, 0xab), s({b_n, r}, DType::f32, 0xab), qT({c, p}, DType::u8, 0xab),
      sT({p / kFp8Tile, c}, DType::f32, 0xab);
  fp8_quantize_rows(cpu(), x.t, q.t, s.t);
  fp8_quantize_cols(cpu(), x.t, off.t, qT.t, sT.t);
  const Tensor xd = to_device(dev, x), offd = to_device(dev, off), qd = filled(dev, {r, c}, DType::u8, 0xab),
               sd = filled(dev, {b_n, r}, DType::f32, 0xab), qTd = filled(dev, {c, p}, DType::u8, 0xab),
               sTd = filled(dev, {p / kFp8Tile, c}, DType::f32, 0xab);
  ASSERT_TRUE(cuda::fp8_rows_cols_fused_serves(DType::bf16, c, xd.data(), qd.data()));
  cuda::launch_fp8_quantize_rows_cols(testing::exec(), xd.data(), DType::bf16, r, c, offd.ptr<int64_t>(), s_n, grouped,
                                      qd.ptr<uint8_t>(), sd.ptr<float>(), p, qTd.ptr<uint8_t>(), sTd.ptr<float>());
  EXPECT_SAME_BYTES(bytes_of(qd), q.bytes, "rows codes");
  EXPECT_SAME_BYTES(bytes_of(sd), grouped ? grouped_scales(s, off).bytes : s.bytes, "rows scales");
  EXPECT_SAME_BYTES(bytes_of(qTd), qT.bytes, "cols codes (and the unwritten columns' poison)");
  EXPECT_SAME_BYTES(bytes_of(sTd), sT.bytes, "cols scales");
}

TEST(CudaFp8, QuantizeRowsColsInOnePassMatchesCpuBitForBit) {
  MF_REQUIRE_GPU();
  std::mt19937_64 rng(testing::fresh_seed());
  const std::vector<int64_t> segments = {0, 1, 127, 0, 128, 129, 300, 0};  // empty ones, some under 128 rows
  for (bool grouped : {true, false}) {
    check_rows_cols(rng, segments, 2048, grouped);  // Qwen3-30B-A3B's hidden size
    check_rows_cols(rng, segments, 200, grouped);   // a 72-column last tile of every row
    check_rows_cols(rng, segments, 260, grouped);   // C % 128 == 4: a 4-column last tile
    check_rows_cols(rng, {700}, 96, grouped);       // one segment (a dense layer's dy)
    check_rows_cols(rng, {0, 0}, 128, grouped);     // no rows at all
    check_rows_cols(rng, {3, 250}, 384, grouped, true);
  }
  check_rows_cols(rng, {512, 512, 512}, 1536, true);  // whole tiles only
  // Where the one pass does not serve, the backward runs the two (f32, C % 4 != 0, unaligned x).
  DevicePool dev;
  const Tensor x = dev.empty({64, 130}, DType::bf16), q = dev.empty({64, 130}, DType::u8);
  EXPECT_FALSE(cuda::fp8_rows_cols_fused_serves(DType::f32, 128, x.data(), q.data()));
  EXPECT_FALSE(cuda::fp8_rows_cols_fused_serves(DType::bf16, 130, x.data(), q.data()));
  EXPECT_FALSE(cuda::fp8_rows_cols_fused_serves(DType::bf16, 128, static_cast<uint8_t*>(x.data()) + 4, q.data()));
}

// launch_fp8_quantize_cols_packed (the weight gradient's x when it came packed): the cols layout of
// the packed rows' values, bit for bit the CPU's fp8_quantize_cols of fp8_dequantize_packed's f32
// (each a code times its tile's scale, as the GPU computes it). The packed rows start `shift` bytes
// into their allocation (4: not 8-byte aligned, the narrow path, as k % 8 != 0 takes).
void check_cols_packed(std::mt19937_64& rng, const std::vector<int64_t>& counts, int64_t k, int64_t shift,
                       bool non_finite = false) {
  const Host off = offsets_of(counts);
  const int64_t r = off.t.ptr<int64_t>()[counts.size()], s_n = static_cast<int64_t>(counts.size());
  const int64_t w = fp8_packed_width(k), p = fp8_cols_width(r, s_n);
  SCOPED_TRACE(::testing::Message() << "packed cols R " << r << " K " << k << " segments " << s_n << " shift "
                                    << shift);
  DevicePool dev;
  Host x = awkward(rng, r, k, DType::f32);
  if (non_finite) add_non_finite(x);
  Host packed({r, w}, DType::u8), v({r, k}, DType::f32), q({k, p}, DType::u8, 0xab),
      s({p / kFp8Tile, k}, DType::f32, 0xab);
  fp8_quantize_packed(cpu(), x.t, packed.t);
  fp8_dequantize_packed(cpu(), packed.t, v.t);
  fp8_quantize_cols(cpu(), v.t, off.t, q.t, s.t);
  const Tensor pd = dev.empty({shift + r * w}, DType::u8), offd = to_device(dev, off),
               qd = filled(dev, {k, p}, DType::u8, 0xab), sd = filled(dev, {p / kFp8Tile, k}, DType::f32, 0xab);
  device_copy(pd.ptr<uint8_t>() + shift, Device::cuda, packed.bytes.data(), Device::cpu, packed.bytes.size());
  cuda::launch_fp8_quantize_cols_packed(testing::exec(), pd.ptr<uint8_t>() + shift, r, k, offd.ptr<int64_t>(), s_n, p,
                                        qd.ptr<uint8_t>(), sd.ptr<float>());
  EXPECT_SAME_BYTES(bytes_of(qd), q.bytes, "codes (and the unwritten columns' poison)");
  EXPECT_SAME_BYTES(bytes_of(sd), s.bytes, "scales");
}

TEST(CudaFp8, QuantizeColsPackedMatchesCpuBitForBit) {
  MF_REQUIRE_GPU();
  std::mt19937_64 rng(testing::fresh_seed());
  const std::vector<int64_t> segments = {0, 1, 127, 0, 128, 129, 300, 0};  // empty ones, some under 128 rows
  check_cols_packed(rng, segments, 2048, 0);       // Qwen3-30B-A3B's hidden size: 8 codes a lane
  check_cols_packed(rng, segments, 200, 0);        // a 72-column last tile, a partial column chunk
  check_cols_packed(rng, {512, 0, 200}, 384, 0);   // whole tiles only
  check_cols_packed(rng, {3, 250}, 512, 0, true);  // NaN codes and saturated ones
  check_cols_packed(rng, segments, 100, 0);        // k % 8 == 4: the narrow path
  check_cols_packed(rng, segments, 130, 0);        // k % 8 == 2
  check_cols_packed(rng, segments, 2048, 4);       // rows 4-byte aligned only
}
#endif

void check_blocks(std::mt19937_64& rng, int64_t e, int64_t o, int64_t i, DType dt, bool transposed,
                  bool non_finite = false, bool via_bf16 = false) {
  SCOPED_TRACE(::testing::Message() << "blocks " << dtype_name(dt) << " E " << e << " O " << o << " I " << i
                                    << (transposed ? " with qT" : "") << (via_bf16 ? " via bf16" : ""));
  DevicePool dev;
  Host wm = awkward(rng, e * o, i, dt);
  if (non_finite) add_non_finite(wm);
  const Shape ws = e > 1 ? Shape{e, o, i} : Shape{o, i}, wts = e > 1 ? Shape{e, i, o} : Shape{i, o};
  const Shape ss = e > 1 ? Shape{e, tiles(o), tiles(i)} : Shape{tiles(o), tiles(i)};
  const Shape sts = e > 1 ? Shape{e, tiles(i), tiles(o)} : Shape{tiles(i), tiles(o)};
  const Tensor w = wm.t.view(ws);
  Host q(ws, DType::u8, 0xab), s(ss, DType::f32, 0xab), qt(wts, DType::u8, 0xab), st(sts, DType::f32, 0xab);
  fp8_quantize_blocks(cpu(), w, q.t, s.t, transposed ? qt.t : Tensor(), transposed ? st.t : Tensor(), via_bf16);
  const Tensor wd = to_device(dev, wm).view(ws), qd = filled(dev, ws, DType::u8, 0xab),
               sd = filled(dev, ss, DType::f32, 0xab), qtd = filled(dev, wts, DType::u8, 0xab),
               std_ = filled(dev, sts, DType::f32, 0xab);
  fp8_quantize_blocks(testing::exec(), wd, qd, sd, transposed ? qtd : Tensor(), transposed ? std_ : Tensor(), via_bf16);
  EXPECT_SAME_BYTES(bytes_of(qd), q.bytes, "codes");
  EXPECT_SAME_BYTES(bytes_of(sd), s.bytes, "scales");
  EXPECT_SAME_BYTES(bytes_of(qtd), qt.bytes, "transposed codes");
  EXPECT_SAME_BYTES(bytes_of(std_), st.bytes, "transposed scales");
  if (non_finite) return;
  for (DType out : kInputs) {
    Host back(ws, out);
    fp8_dequantize_blocks(cpu(), q.t, s.t, back.t);
    const Tensor back_d = dev.poisoned(ws, out);
    fp8_dequantize_blocks(testing::exec(), qd, sd, back_d);
    EXPECT_SAME_BYTES(bytes_of(back_d), back.bytes, "dequantized as " + std::string(dtype_name(out)));
  }
}

TEST(CudaFp8, QuantizeBlocksMatchesCpuBitForBit) {
  MF_REQUIRE_GPU();
  std::mt19937_64 rng(testing::fresh_seed());
  for (DType dt : kInputs) {
    for (bool t : {false, true}) {
      check_blocks(rng, 1, 1, 1, dt, t);
      check_blocks(rng, 1, 130, 70, dt, t);   // partial blocks; O, I % 4 != 0: the scalar paths
      check_blocks(rng, 1, 192, 256, dt, t);  // O not a multiple of 128
      check_blocks(rng, 3, 130, 301, dt, t);  // experts, odd I
      check_blocks(rng, 2, 256, 384, dt, t);
      check_blocks(rng, 2, 144, 132, dt, t);  // a 16-row, 4-column last block: 16-byte qT rows
    }
    check_blocks(rng, 2, 100, 200, dt, true, true);
  }
  check_blocks(rng, 2, 100, 200, DType::f32, true, true, true);  // non-finite masters via bf16
  // f32 masters quantized as their bf16 copies would be (train.fp8_param): scalar and vector paths.
  check_blocks(rng, 3, 130, 301, DType::f32, true, false, true);
  check_blocks(rng, 2, 256, 384, DType::f32, true, false, true);
}

TEST(CudaFp8, GpuQuantizeRejectsF64) {
  MF_REQUIRE_GPU();
  DevicePool dev;
  const Tensor x = dev.empty({4, 8}, DType::f64), q = dev.empty({4, 8}, DType::u8), s = dev.empty({1, 4}, DType::f32);
  EXPECT_NE(testing::error_of([&] { fp8_quantize_rows(testing::exec(), x, q, s); }).find("f64"), std::string::npos);
  // A part of a weight (the distributed optimizer's ops), empty or not.
  const Tensor amax = dev.empty({1, 1}, DType::f32), flat = x.view({32}), flat_q = q.view({32});
  for (const int64_t end : {int64_t{0}, int64_t{20}}) {
    SCOPED_TRACE(::testing::Message() << "part of " << end);
    EXPECT_NE(testing::error_of([&] {
                fp8_block_amax(testing::exec(), flat.slice(0, end), Shape{4, 8}, 0, amax);
              }).find("f64"),
              std::string::npos);
    EXPECT_NE(testing::error_of([&] {
                fp8_quantize_part(testing::exec(), flat.slice(0, end), Shape{4, 8}, 0, amax, flat_q.slice(0, end));
              }).find("f64"),
              std::string::npos);
  }
}

// ---- parts of a weight (FP8-only weights under the distributed optimizer) ----------------------------

// A weight of `shape` (dt): values 0.3 * normal times 2^[-24, 24] per 128 x 128 block (flat block 0:
// 2^0; block 2: f32 subnormals; block 3: near f32's largest), mantissas cut to 5 bits (E4M3's ties),
// 1 in 16 zero, and Fp8Quantize.PartsGiveTheBlocksOfTheWhole's planted values: 447.99 in block 0 (448
// in bf16: with via_bf16 its block's scale moves), block (0, 1) all zero, a NaN and an infinity.
Host part_weight(std::mt19937_64& rng, const Shape& shape, DType dt) {
  const int64_t o_n = shape[shape.ndim - 2], i_n = shape[shape.ndim - 1], n = shape.numel();
  const int64_t ob = tiles(o_n), ib = tiles(i_n);
  std::vector<int> shift(static_cast<size_t>(n / (o_n * i_n) * ob * ib));
  std::uniform_int_distribution<int> binade(-24, 24), coin(0, 15);
  std::normal_distribution<float> normal(0.0f, 0.3f);
  for (size_t b = 0; b < shift.size(); ++b) shift[b] = b == 0 ? 0 : b == 2 ? -140 : b == 3 ? 120 : binade(rng);
  Host h(shape, dt);
  for (int64_t g = 0; g < n; ++g) {
    const int64_t e = g / (o_n * i_n), o = g / i_n % o_n, i = g % i_n;
    float v = normal(rng);
    uint32_t bits = 0;
    std::memcpy(&bits, &v, 4);
    bits &= ~((1u << 18) - 1u);
    std::memcpy(&v, &bits, 4);
    v = std::ldexp(v, shift[static_cast<size_t>((e * ob + o / kFp8Tile) * ib + i / kFp8Tile)]);
    if (coin(rng) == 0 || (e == 0 && o < kFp8Tile && i >= kFp8Tile && i < 2 * kFp8Tile)) v = 0.0f;
    set_float(h, g, v);
  }
  set_float(h, 5 * i_n + 3, 447.99f);
  set_float(h, n - 1, NAN);
  set_float(h, n - 2 * i_n - 1, INFINITY);
  return h;
}

// Each part's fp8_block_amax into one amax, fp8_scales_from_amax, each part's fp8_quantize_part into
// its slice of q (flat), fp8_transpose_blocks: on ctx, outputs in amax (then s), q, qT, sT.
void run_parts(const ExecContext& ctx, const Tensor& w, const std::vector<int64_t>& cuts, bool via_bf16,
               const Tensor& amax_s, const Tensor& q, const Tensor& qT, const Tensor& sT,
               std::vector<uint8_t>* amax_bytes) {
  const int64_t n = w.numel();
  const Tensor flat = w.view({n}), flat_q = q.view({n});
  for (size_t k = 0; k + 1 < cuts.size(); ++k)
    fp8_block_amax(ctx, flat.slice(cuts[k], cuts[k + 1]), w.shape(), cuts[k], amax_s, via_bf16);
  *amax_bytes = bytes_of(amax_s);
  fp8_scales_from_amax(ctx, amax_s);
  for (size_t k = 0; k + 1 < cuts.size(); ++k)
    fp8_quantize_part(ctx, flat.slice(cuts[k], cuts[k + 1]), w.shape(), cuts[k], amax_s,
                      flat_q.slice(cuts[k], cuts[k + 1]), via_bf16);
  fp8_transpose_blocks(ctx, q, amax_s, qT, sT);
}

void check_parts(std::mt19937_64& rng, const Shape& shape, DType dt, bool via_bf16) {
  SCOPED_TRACE(::testing::Message() << "parts of " << shape.str() << " " << dtype_name(dt)
                                    << (via_bf16 ? " via bf16" : ""));
  DevicePool dev;
  const int64_t n = shape.numel();
  Host w = part_weight(rng, shape, dt);
  // 7 parts at random cuts, one empty; every other cut a multiple of 4 (the vector paths).
  std::vector<int64_t> cuts = {0, 0, n};
  for (int k = 0; k < 5; ++k) {
    const int64_t c = std::uniform_int_distribution<int64_t>(0, n)(rng);
    cuts.push_back(k % 2 == 0 ? c : c - c % 4);
  }
  std::sort(cuts.begin(), cuts.end());
  const Shape ss = fp8_block_scale_shape(shape, false), sts = fp8_block_scale_shape(shape, true),
              ts = fp8_transposed_shape(shape);
  // (a) the same sequence on the CPU.
  Host amax(ss, DType::f32), q(shape, DType::u8, 0xab), qt(ts, DType::u8, 0xab), st(sts, DType::f32, 0xab);
  std::vector<uint8_t> amax_cpu, amax_gpu;
  run_parts(cpu(), w.t, cuts, via_bf16, amax.t, q.t, qt.t, st.t, &amax_cpu);
  const Tensor wd = to_device(dev, w), amax_d = filled(dev, ss, DType::f32, 0),
               qd = filled(dev, shape, DType::u8, 0xab), qtd = filled(dev, ts, DType::u8, 0xab),
               std_ = filled(dev, sts, DType::f32, 0xab);
  run_parts(testing::exec(), wd, cuts, via_bf16, amax_d, qd, qtd, std_, &amax_gpu);
  EXPECT_SAME_BYTES(amax_gpu, amax_cpu, "block amax");
  EXPECT_SAME_BYTES(bytes_of(amax_d), amax.bytes, "scales");
  EXPECT_SAME_BYTES(bytes_of(qd), q.bytes, "codes");
  EXPECT_SAME_BYTES(bytes_of(qtd), qt.bytes, "transposed codes");
  EXPECT_SAME_BYTES(bytes_of(std_), st.bytes, "transposed scales");
  // (b) fp8_quantize_blocks of the whole weight on the GPU.
  const Tensor qb = filled(dev, shape, DType::u8, 0xcd), sb = filled(dev, ss, DType::f32, 0xcd),
               qtb = filled(dev, ts, DType::u8, 0xcd), stb = filled(dev, sts, DType::f32, 0xcd);
  fp8_quantize_blocks(testing::exec(), wd, qb, sb, qtb, stb, via_bf16);
  EXPECT_SAME_BYTES(bytes_of(amax_d), bytes_of(sb), "scales vs the whole's");
  EXPECT_SAME_BYTES(bytes_of(qd), bytes_of(qb), "codes vs the whole's");
  EXPECT_SAME_BYTES(bytes_of(qtd), bytes_of(qtb), "transposed codes vs the whole's");
  EXPECT_SAME_BYTES(bytes_of(std_), bytes_of(stb), "transposed scales vs the whole's");
}

TEST(CudaFp8, PartsMatchCpuBitForBit) {
  MF_REQUIRE_GPU();
  std::mt19937_64 rng(testing::fresh_seed());
  for (const Shape& shape :
       {Shape{300, 200}, Shape{3, 130, 260}, Shape{2, 128, 128}, Shape{130, 301}, Shape{4, 1024, 2048}})
    for (const auto& [dt, via_bf16] : {std::pair{DType::f32, false}, {DType::f32, true}, {DType::bf16, false}})
      check_parts(rng, shape, dt, via_bf16);
}

// ---- GEMMs ---------------------------------------------------------------------------------------------

// Q(x) dequantized by the CPU ops, as f64 (rows along K; cols per segment; blocks).
std::vector<double> fake_rows(const Host& x) {
  const int64_t r = x.t.size(0), k = x.t.size(1);
  Host q({r, k}, DType::u8), s({tiles(k), r}, DType::f32), out({r, k}, DType::f64);
  fp8_quantize_rows(cpu(), x.t, q.t, s.t);
  fp8_dequantize_rows(cpu(), q.t, s.t, out.t);
  const double* v = out.t.ptr<double>();
  return std::vector<double>(v, v + r * k);
}

std::vector<double> fake_cols(const Host& x, const Host& off) {
  const int64_t r = x.t.size(0), c = x.t.size(1), p = fp8_cols_width(r, off.t.numel() - 1);
  Host q({c, p}, DType::u8), s({p / kFp8Tile, c}, DType::f32), out({r, c}, DType::f64);
  fp8_quantize_cols(cpu(), x.t, off.t, q.t, s.t);
  fp8_dequantize_cols(cpu(), q.t, s.t, off.t, out.t);
  const double* v = out.t.ptr<double>();
  return std::vector<double>(v, v + r * c);
}

std::vector<double> fake_blocks(const Host& w, Shape shape) {
  const int64_t e = shape.ndim == 3 ? shape[0] : 1, o = shape[shape.ndim - 2], i = shape[shape.ndim - 1];
  const Tensor wv = w.t.view(shape);
  const Shape ss = shape.ndim == 3 ? Shape{e, tiles(o), tiles(i)} : Shape{tiles(o), tiles(i)};
  Host q(shape, DType::u8), s(ss, DType::f32), out(shape, DType::f64);
  fp8_quantize_blocks(cpu(), wv, q.t, s.t, Tensor(), Tensor());
  fp8_dequantize_blocks(cpu(), q.t, s.t, out.t);
  const double* v = out.t.ptr<double>();
  return std::vector<double>(v, v + e * o * i);
}

// Normal(0, 1) values rounded to bf16 (a host copy).
Host gaussian_bf16(std::mt19937_64& rng, int64_t rows, int64_t cols) {
  Host h({rows, cols}, DType::bf16);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (int64_t i = 0; i < rows * cols; ++i) set_float(h, i, n(rng));
  return h;
}

std::vector<double> values_of(const Host& h) {
  std::vector<double> v(static_cast<size_t>(h.t.numel()));
  for (int64_t i = 0; i < h.t.numel(); ++i) v[static_cast<size_t>(i)] = testing::value_at(h.t, i);
  return v;
}

constexpr double kBf16Out = 4e-3;  // y, dx, bf16 dw (the header's table)
constexpr double kF32Dw = 3e-4;
constexpr double kVsBf16 = 0.08;

// One (grouped or dense) FP8 linear layer's forward and backward on the GPU against the f64
// products of the CPU's quantized operands, and against the plain bf16 ops. counts: rows per
// expert (grouped), or one entry with `dense` set (fp8_linear_*, w [O, I]).
void check_fp8_linear(std::mt19937_64& rng, const std::vector<int64_t>& counts, int64_t in, int64_t out, DType dw_dt,
                      bool accumulate, bool dense = false) {
  const int64_t e_n = static_cast<int64_t>(counts.size());
  const Host off = offsets_of(counts);
  const int64_t r = off.t.ptr<int64_t>()[e_n];
  SCOPED_TRACE(::testing::Message() << (dense ? "dense" : "grouped") << " experts " << e_n << " R " << r << " I " << in
                                    << " O " << out << " dw " << dtype_name(dw_dt) << " accumulate " << accumulate);
  DevicePool dev;
  const Host x = gaussian_bf16(rng, r, in), w = gaussian_bf16(rng, e_n * out, in), dy = gaussian_bf16(rng, r, out);
  Host dw0({e_n * out, in}, dw_dt);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (int64_t i = 0; i < dw0.t.numel(); ++i) set_float(dw0, i, n(rng));
  const Shape w_shape = dense ? Shape{out, in} : Shape{e_n, out, in};

  // The reference: f64 products of the dequantized operands, per expert.
  const std::vector<double> qx = fake_rows(x), qdy = fake_rows(dy), qw = fake_blocks(w, w_shape),
                            cx = fake_cols(x, off), cdy = fake_cols(dy, off);
  std::vector<double> y_ref(static_cast<size_t>(r * out)), dx_ref(static_cast<size_t>(r * in)), dw_ref = values_of(dw0);
  if (!accumulate) std::fill(dw_ref.begin(), dw_ref.end(), 0.0);
  const int64_t* o = off.t.ptr<int64_t>();
  for (int64_t e = 0; e < e_n; ++e) {
    const int64_t m = o[e + 1] - o[e];
    if (m == 0) continue;
    const double* we = qw.data() + e * out * in;
    gemm<double>(false, true, m, out, in, 1.0, qx.data() + o[e] * in, in, we, in, 0.0, y_ref.data() + o[e] * out, out);
    gemm<double>(false, false, m, in, out, 1.0, qdy.data() + o[e] * out, out, we, in, 0.0, dx_ref.data() + o[e] * in,
                 in);
    gemm<double>(true, false, out, in, m, 1.0, cdy.data() + o[e] * out, out, cx.data() + o[e] * in, in, 1.0,
                 dw_ref.data() + e * out * in, in);
  }

  const Tensor xd = to_device(dev, x), wd = to_device(dev, w).view(w_shape), dyd = to_device(dev, dy),
               offd = to_device(dev, off);
  const Tensor dwd = accumulate ? to_device(dev, dw0).view(w_shape) : dev.poisoned(w_shape, dw_dt);
  const Tensor yd = dev.poisoned({r, out}, DType::bf16), dxd = dev.poisoned({r, in}, DType::bf16);
  if (dense) {
    fp8_linear_forward(testing::exec(), xd, wd, yd);
    fp8_linear_backward(testing::exec(), xd, wd, dyd, dxd, dwd, accumulate);
  } else {
    fp8_grouped_linear_forward(testing::exec(), xd, wd, offd, yd);
    fp8_grouped_linear_backward(testing::exec(), xd, wd, offd, dyd, dxd, dwd, accumulate);
  }
  const std::vector<double> y = testing::download(yd), dx = testing::download(dxd), dw = testing::download(dwd);
  const double dw_tol = dw_dt == DType::f32 ? kF32Dw : kBf16Out;
  EXPECT_LE(testing::rel_error(y, y_ref), kBf16Out) << "y";
  EXPECT_LE(testing::rel_error(dx, dx_ref), kBf16Out) << "dx";
  EXPECT_LE(testing::rel_error(dw, dw_ref), dw_tol) << "dw";
  // Per expert: a non-empty expert's dw on its own; an empty one's unchanged (accumulate) or zero.
  const int64_t per = out * in;
  const std::vector<double> dw_before = values_of(dw0);
  for (int64_t e = 0; e < e_n; ++e) {
    const auto at = [&](const std::vector<double>& v) {
      return std::vector<double>(v.begin() + e * per, v.begin() + (e + 1) * per);
    };
    if (counts[static_cast<size_t>(e)] != 0) {
      EXPECT_LE(testing::rel_error(at(dw), at(dw_ref)), dw_tol) << "dw of expert " << e;
    } else if (accumulate) {
      EXPECT_EQ(at(dw), at(dw_before)) << "dw of empty expert " << e << " changed";
    } else {
      EXPECT_EQ(at(dw), std::vector<double>(static_cast<size_t>(per), 0.0)) << "dw of empty expert " << e;
    }
  }

  // Against the plain bf16 ops on the same inputs (a loose bound: E4M3's rounding of both operands).
  const Tensor y16 = dev.poisoned({r, out}, DType::bf16), dx16 = dev.poisoned({r, in}, DType::bf16);
  testing::Pool pool;
  const Tensor dw16 = dev.upload(pool.zeros(w_shape), DType::f32);
  if (dense) {
    linear_forward(testing::exec(), xd, wd, y16);
    linear_backward(testing::exec(), xd, wd, dyd, dx16, dw16);
  } else {
    grouped_linear_forward(testing::exec(), xd, wd, offd, y16);
    grouped_linear_backward(testing::exec(), xd, wd, offd, dyd, dx16, dw16);
  }
  EXPECT_LE(testing::rel_error(y, testing::download(y16)), kVsBf16) << "y vs bf16";
  EXPECT_LE(testing::rel_error(dx, testing::download(dx16)), kVsBf16) << "dx vs bf16";
  if (!accumulate) {
    EXPECT_LE(testing::rel_error(dw, testing::download(dw16)), kVsBf16) << "dw vs bf16";
  }
}

#ifdef MOEFOLD_WITH_CUDA
#define MF_REQUIRE_FP8_GEMM()                                                                              \
  do {                                                                                                     \
    MF_REQUIRE_GPU();                                                                                      \
    if (!cuda::fp8_gemm_built()) GTEST_SKIP() << "built without CUTLASS's headers (MOEFOLD_WITH_CUTLASS)"; \
  } while (0)
#else
#define MF_REQUIRE_FP8_GEMM() MF_REQUIRE_GPU()
#endif

TEST(CudaFp8Linear, DenseMatchesF64OfQuantizedOperands) {
  MF_REQUIRE_FP8_GEMM();
  std::mt19937_64 rng(testing::fresh_seed());
  for (bool acc : {true, false}) {
    check_fp8_linear(rng, {257}, 256, 192, DType::f32, acc, true);  // O not a multiple of 128
    check_fp8_linear(rng, {100}, 144, 80, DType::f32, acc, true);   // K tails of 16 (forward) and 80 (dgrad)
    check_fp8_linear(rng, {1000}, 512, 384, DType::bf16, acc, true);
  }
  check_fp8_linear(rng, {3}, 2048, 768, DType::f32, true, true);  // wgrad over 3 tokens (K = 3)
  // Shapes cuBLASLt's block scaling serves (kernels.fp8_dense_gemm's default; the ones above run on
  // CUTLASS): K, the rows for the weight gradient, multiples of 128.
  for (bool acc : {true, false}) {
    check_fp8_linear(rng, {1024}, 512, 384, DType::f32, acc, true);
    check_fp8_linear(rng, {256}, 2048, 640, DType::bf16, acc, true);
  }
}

// The GEMMs cuBLASLt's block scaling ran so far (kernels.fp8_dense_gemm).
int64_t lt_calls() {
#ifdef MOEFOLD_WITH_CUDA
  return cuda::lt_fp8_gemm_calls();
#else
  return 0;
#endif
}

// kernels.fp8_dense_gemm: cuBLASLt and CUTLASS agree to the bf16 output's rounding on a dense
// layer cuBLASLt serves (each against f64 in the test above; here against each other).
TEST(CudaFp8Linear, DenseCublasLtAgreesWithCutlass) {
  MF_REQUIRE_FP8_GEMM();
  std::mt19937_64 rng(testing::fresh_seed());
  DevicePool dev;
  const int64_t r = 512, in = 1024, out = 768;
  const Host x = gaussian_bf16(rng, r, in), w = gaussian_bf16(rng, out, in), dy = gaussian_bf16(rng, r, out);
  const Tensor xd = to_device(dev, x), wd = to_device(dev, w).view({out, in}), dyd = to_device(dev, dy);
  std::vector<std::vector<double>> got[2];
  for (int impl = 0; impl < 2; ++impl) {
    const int64_t calls = lt_calls();
    KernelOptions k;
    k.fp8_dense_gemm = impl == 0 ? Fp8DenseGemm::cublaslt : Fp8DenseGemm::cutlass;
    const ExecContext ctx(Device::cuda, k);
    const Tensor y = dev.poisoned({r, out}, DType::bf16), dx = dev.poisoned({r, in}, DType::bf16),
                 dw = dev.poisoned({out, in}, DType::f32);
    fp8_linear_forward(ctx, xd, wd, y);
    fp8_linear_backward(ctx, xd, wd, dyd, dx, dw, false);
    got[impl] = {testing::download(y), testing::download(dx), testing::download(dw)};
    // cuBLASLt served all three GEMMs, or none.
    EXPECT_EQ(lt_calls() - calls, impl == 0 ? 3 : 0) << "kernels.fp8_dense_gemm " << impl;
  }
  EXPECT_LE(testing::rel_error(got[0][0], got[1][0]), kBf16Out) << "y";
  EXPECT_LE(testing::rel_error(got[0][1], got[1][1]), kBf16Out) << "dx";
  EXPECT_LE(testing::rel_error(got[0][2], got[1][2]), kF32Dw) << "dw";
}

TEST(CudaFp8Linear, GroupedMatchesF64OfQuantizedOperands) {
  MF_REQUIRE_FP8_GEMM();
  std::mt19937_64 rng(testing::fresh_seed());
  const std::vector<int64_t> awkward_counts = {0, 37, 1, 0, 300, 128, 129, 127, 0, 16};
  for (bool acc : {true, false}) {
    check_fp8_linear(rng, awkward_counts, 256, 192, DType::f32, acc);
    check_fp8_linear(rng, awkward_counts, 144, 80, DType::bf16, acc);
    check_fp8_linear(rng, {0, 0, 0}, 128, 64, DType::f32, acc);  // no rows at all
  }
  // Qwen3-30B-A3B's experts: fc1 (gate and up, 2 x 768 from 2048) and fc2 (2048 from 768).
  const std::vector<int64_t> routed = {211, 0, 97, 350, 5, 128, 64, 190};
  check_fp8_linear(rng, routed, 2048, 1536, DType::f32, true);
  check_fp8_linear(rng, routed, 768, 2048, DType::f32, false);
  check_fp8_linear(rng, routed, 768, 2048, DType::bf16, true);
}

// x as packed FP8 rows (moe.fp8_dispatch): y and dx bit for bit those of bf16 x (the same
// operand), dw bit for bit that of x's dequantized values (the GPU dequantizes them into bf16,
// exactly, and quantizes those along the rows).
TEST(CudaFp8Linear, PackedInputIsTheSameOperand) {
  MF_REQUIRE_FP8_GEMM();
  std::mt19937_64 rng(testing::fresh_seed());
  DevicePool dev;
  for (const auto& [counts, in, out] :
       {std::tuple{std::vector<int64_t>{300, 0, 129, 77, 1}, int64_t{256}, int64_t{192}},
        std::tuple{std::vector<int64_t>{211, 97, 350, 5}, int64_t{2048}, int64_t{1536}}}) {
    const Host off = offsets_of(counts);
    const int64_t e_n = static_cast<int64_t>(counts.size()), r = off.t.ptr<int64_t>()[e_n];
    SCOPED_TRACE(::testing::Message() << "R " << r << " I " << in << " O " << out);
    const Host x = gaussian_bf16(rng, r, in), w = gaussian_bf16(rng, e_n * out, in), dy = gaussian_bf16(rng, r, out);
    const Tensor xd = to_device(dev, x), wd = to_device(dev, w).view({e_n, out, in}), dyd = to_device(dev, dy),
                 offd = to_device(dev, off);
    const Tensor pd = dev.poisoned({r, fp8_packed_width(in)}, DType::u8), xv = dev.poisoned({r, in}, DType::bf16);
    fp8_quantize_packed(testing::exec(), xd, pd);
    fp8_dequantize_packed(testing::exec(), pd, xv);
    std::vector<std::vector<uint8_t>> got[2];
    for (int packed = 0; packed < 2; ++packed) {
      const Tensor y = dev.poisoned({r, out}, DType::bf16), dx = dev.poisoned({r, in}, DType::bf16),
                   dw = dev.poisoned({e_n, out, in}, DType::f32), dwv = dev.poisoned({e_n, out, in}, DType::f32);
      const Tensor& xin = packed ? pd : xd;
      fp8_grouped_linear_forward(testing::exec(), xin, wd, offd, y);
      fp8_grouped_linear_backward(testing::exec(), xin, wd, offd, dyd, dx, dw, false);
      fp8_grouped_linear_backward(testing::exec(), xv, wd, offd, dyd, Tensor(), dwv, false);
      got[packed] = {bytes_of(y), bytes_of(dx), bytes_of(dw), bytes_of(dwv)};
    }
    EXPECT_SAME_BYTES(got[1][0], got[0][0], "y");
    EXPECT_SAME_BYTES(got[1][1], got[0][1], "dx");
    EXPECT_SAME_BYTES(got[1][2], got[1][3], "dw (packed) vs dw of the dequantized values");
  }
}

// kernels.fp8_tile changes how the tiles are scheduled, not what is summed: every configuration's
// y, dx and dw (f32 and bf16) are the default's bit for bit.
TEST(CudaFp8Linear, EveryTileConfigurationGivesTheSameBits) {
  MF_REQUIRE_FP8_GEMM();
  std::mt19937_64 rng(testing::fresh_seed());
  DevicePool dev;
  const std::vector<int64_t> counts = {300, 0, 1000, 77, 129, 1};
  const Host off = offsets_of(counts);
  const int64_t e_n = 6, r = off.t.ptr<int64_t>()[e_n], in = 512, out = 384;
  const Host x = gaussian_bf16(rng, r, in), w = gaussian_bf16(rng, e_n * out, in), dy = gaussian_bf16(rng, r, out);
  const Tensor xd = to_device(dev, x), wd = to_device(dev, w).view({e_n, out, in}), dyd = to_device(dev, dy),
               offd = to_device(dev, off);
  std::vector<std::vector<uint8_t>> want;
  for (const char* tile : {"cooperative", "cooperative_1x1", "pingpong", "rows=own", "auto"}) {
    SCOPED_TRACE(tile);
    KernelOptions k;
    k.fp8_tiles = parse_fp8_tiles(tile, "kernels.fp8_tile");
    const ExecContext ctx(Device::cuda, k);
    const Tensor y = dev.poisoned({r, out}, DType::bf16), dx = dev.poisoned({r, in}, DType::bf16),
                 dw = dev.poisoned({e_n, out, in}, DType::f32), dw16 = dev.poisoned({e_n, out, in}, DType::bf16);
    fp8_grouped_linear_forward(ctx, xd, wd, offd, y);
    fp8_grouped_linear_backward(ctx, xd, wd, offd, dyd, dx, dw, false);
    fp8_grouped_linear_backward(ctx, xd, wd, offd, dyd, Tensor(), dw16, false);
    const std::vector<std::vector<uint8_t>> got = {bytes_of(y), bytes_of(dx), bytes_of(dw), bytes_of(dw16)};
    if (want.empty()) {
      want = got;
      continue;
    }
    EXPECT_SAME_BYTES(got[0], want[0], "y");
    EXPECT_SAME_BYTES(got[1], want[1], "dx");
    EXPECT_SAME_BYTES(got[2], want[2], "f32 dw");
    EXPECT_SAME_BYTES(got[3], want[3], "bf16 dw");
  }
}

// kernels.fp8_tile rows = own (fp8_grouped_gemm.cu: one TMA descriptor for every expert, tiles
// that start at each expert's first row and read past its end) sums as CUTLASS does: y and dx bit
// for bit CUTLASS's, over empty experts, experts of 1 row and of 127 / 128 / 129, K tails, N not a
// multiple of 128, packed FP8 rows as x, and a dense layer (one group) where cuBLASLt is off.
TEST(CudaFp8Linear, OwnKernelGivesCutlassBits) {
  MF_REQUIRE_FP8_GEMM();
  std::mt19937_64 rng(testing::fresh_seed());
  DevicePool dev;
  const std::vector<int64_t> awkward = {0, 37, 1, 0, 300, 128, 129, 127, 0, 16};
  struct Case {
    std::vector<int64_t> counts;  // empty: a dense layer of `dense_rows`
    int64_t in, out, dense_rows;
  };
  for (const Case& c :
       {Case{awkward, 256, 192, 0}, Case{awkward, 144, 80, 0}, Case{{211, 0, 97, 350, 5}, 2048, 1536, 0},
        Case{{211, 0, 97, 350, 5}, 768, 2048, 0}, Case{{}, 384, 272, 1000}, Case{{}, 144, 48, 37}}) {
    const bool dense = c.counts.empty();
    const Host off = offsets_of(dense ? std::vector<int64_t>{c.dense_rows} : c.counts);
    const int64_t e_n = dense ? 1 : static_cast<int64_t>(c.counts.size()), r = off.t.ptr<int64_t>()[e_n];
    SCOPED_TRACE(::testing::Message() << "R " << r << " E " << e_n << " I " << c.in << " O " << c.out);
    const Host x = gaussian_bf16(rng, r, c.in), w = gaussian_bf16(rng, e_n * c.out, c.in),
               dy = gaussian_bf16(rng, r, c.out);
    const Tensor xd = to_device(dev, x), dyd = to_device(dev, dy), offd = to_device(dev, off);
    const Tensor wd = dense ? to_device(dev, w).view({c.out, c.in}) : to_device(dev, w).view({e_n, c.out, c.in});
    const Tensor pd = dev.poisoned({r, fp8_packed_width(c.in)}, DType::u8);
    fp8_quantize_packed(testing::exec(), xd, pd);
    std::vector<std::vector<uint8_t>> got[2];
    for (int own = 0; own < 2; ++own) {
      KernelOptions k;
      k.fp8_dense_gemm = Fp8DenseGemm::cutlass;
      k.fp8_tiles = parse_fp8_tiles(own ? "rows=own" : "cooperative", "kernels.fp8_tile");
      const ExecContext ctx(Device::cuda, k);
      const Tensor y = dev.poisoned({r, c.out}, DType::bf16), yp = dev.poisoned({r, c.out}, DType::bf16),
                   dx = dev.poisoned({r, c.in}, DType::bf16);
      if (dense) {
        fp8_linear_forward(ctx, xd, wd, y);
        fp8_linear_forward(ctx, pd, wd, yp);
        fp8_linear_backward(ctx, xd, wd, dyd, dx, Tensor(), false);
      } else {
        fp8_grouped_linear_forward(ctx, xd, wd, offd, y);
        fp8_grouped_linear_forward(ctx, pd, wd, offd, yp);
        fp8_grouped_linear_backward(ctx, xd, wd, offd, dyd, dx, Tensor(), false);
      }
      got[own] = {bytes_of(y), bytes_of(yp), bytes_of(dx)};
    }
    EXPECT_SAME_BYTES(got[1][0], got[0][0], "y");
    EXPECT_SAME_BYTES(got[1][1], got[0][1], "y of packed x");
    EXPECT_SAME_BYTES(got[1][2], got[0][2], "dx");
  }
  EXPECT_NE(testing::error_of([] { parse_fp8_tiles("own", "kernels.fp8_tile"); }).find("rows only"), std::string::npos);
}

TEST(CudaFp8Linear, BackwardIsDeterministic) {
  MF_REQUIRE_FP8_GEMM();
  std::mt19937_64 rng(testing::fresh_seed());
  DevicePool dev;
  const Host off = offsets_of({300, 0, 1000, 77});
  const Host x = gaussian_bf16(rng, 1377, 512), w = gaussian_bf16(rng, 4 * 256, 512),
             dy = gaussian_bf16(rng, 1377, 256);
  const Tensor xd = to_device(dev, x), wd = to_device(dev, w).view({4, 256, 512}), dyd = to_device(dev, dy),
               offd = to_device(dev, off);
  std::vector<uint8_t> first_dx, first_dw;
  for (int run = 0; run < 2; ++run) {
    const Tensor dx = dev.poisoned({1377, 512}, DType::bf16), dw = dev.poisoned({4, 256, 512}, DType::f32);
    fp8_grouped_linear_backward(testing::exec(), xd, wd, offd, dyd, dx, dw, false);
    if (run == 0) {
      first_dx = bytes_of(dx), first_dw = bytes_of(dw);
    } else {
      EXPECT_SAME_BYTES(bytes_of(dx), first_dx, "dx");
      EXPECT_SAME_BYTES(bytes_of(dw), first_dw, "dw");
    }
  }
}

// Fp8SharedOperands (attention's q, k and v projections read one x): three dense linears of different
// widths given x's shared operands give the bits each gives alone, forward and backward (both
// kernels: cuBLASLt at multiples of 128, CUTLASS at O = 80), with the operand made by the first
// call of each kind and a forward after a backward only after reset().
TEST(CudaFp8Linear, SharedInputGivesTheSameBits) {
  MF_REQUIRE_FP8_GEMM();
  std::mt19937_64 rng(testing::fresh_seed());
  DevicePool dev;
  const int64_t n = 700, in = 512;
  const Host x = gaussian_bf16(rng, n, in);
  const Tensor xd = to_device(dev, x);
  Fp8SharedOperands xin;
  xin.bytes = dev.poisoned({fp8_shared_operand_bytes(n, in)}, DType::u8);
  std::vector<Tensor> ws, dys;
  for (int64_t o : {1024, 256, 80}) {
    ws.push_back(to_device(dev, gaussian_bf16(rng, o, in)));
    dys.push_back(to_device(dev, gaussian_bf16(rng, n, o)));
  }
  for (int round = 0; round < 2; ++round) {  // the second: the bytes hold the backward's operand
    xin.reset();
    for (size_t j = 0; j < ws.size(); ++j) {
      SCOPED_TRACE(::testing::Message() << "round " << round << " forward, O " << ws[j].size(0));
      const Tensor alone = dev.poisoned({n, ws[j].size(0)}, DType::bf16),
                   shared = dev.poisoned(alone.shape(), DType::bf16);
      fp8_linear_forward(testing::exec(), xd, ws[j], alone);
      fp8_linear_forward(testing::exec(), xd, ws[j], shared, nullptr, &xin);
      EXPECT_TRUE(xin.rows_ready);
      EXPECT_SAME_BYTES(bytes_of(shared), bytes_of(alone), "y");
    }
    xin.reset();
    for (size_t j = 0; j < ws.size(); ++j) {
      SCOPED_TRACE(::testing::Message() << "round " << round << " backward, O " << ws[j].size(0));
      const Tensor dx = dev.poisoned({n, in}, DType::bf16), dx_shared = dev.poisoned({n, in}, DType::bf16),
                   dw = dev.poisoned(ws[j].shape(), DType::f32), dw_shared = dev.poisoned(ws[j].shape(), DType::f32);
      fp8_linear_backward(testing::exec(), xd, ws[j], dys[j], dx, dw, false);
      fp8_linear_backward(testing::exec(), xd, ws[j], dys[j], dx_shared, dw_shared, false, nullptr, &xin);
      EXPECT_TRUE(xin.cols_ready);
      EXPECT_FALSE(xin.rows_ready);
      EXPECT_SAME_BYTES(bytes_of(dx_shared), bytes_of(dx), "dx");
      EXPECT_SAME_BYTES(bytes_of(dw_shared), bytes_of(dw), "dw");
    }
  }
}

// The experts' split backward (data gradient, then weight gradient, in two calls): dy's cols operand
// carried in a shared operand from the first call to the second gives the bits of one call with
// both, and of two calls without it.
TEST(CudaFp8Linear, SplitBackwardCarriesDyColsOperand) {
  MF_REQUIRE_FP8_GEMM();
  std::mt19937_64 rng(testing::fresh_seed());
  DevicePool dev;
  const std::vector<int64_t> counts = {300, 0, 1000, 77};
  const Host off = offsets_of(counts);
  const int64_t r = 1377, e = 4, o = 256, in = 512;
  const Tensor xd = to_device(dev, gaussian_bf16(rng, r, in)),
               wd = to_device(dev, gaussian_bf16(rng, e * o, in)).view({e, o, in}),
               dyd = to_device(dev, gaussian_bf16(rng, r, o)), offd = to_device(dev, off);
  const Tensor dx = dev.poisoned({r, in}, DType::bf16), dw = dev.poisoned({e, o, in}, DType::f32);
  fp8_grouped_linear_backward(testing::exec(), xd, wd, offd, dyd, dx, dw, false);
  Fp8SharedOperands dyq;
  dyq.bytes = dev.poisoned({fp8_shared_operand_bytes(r, o, e)}, DType::u8);
  for (bool shared : {true, false}) {
    SCOPED_TRACE(shared ? "carried" : "quantized in each call");
    const Tensor dx2 = dev.poisoned({r, in}, DType::bf16), dw2 = dev.poisoned({e, o, in}, DType::f32);
    fp8_grouped_linear_backward(testing::exec(), xd, wd, offd, dyd, dx2, Tensor(), false, nullptr,
                                shared ? &dyq : nullptr);
    EXPECT_EQ(dyq.cols_ready, shared);
    fp8_grouped_linear_backward(testing::exec(), xd, wd, offd, dyd, Tensor(), dw2, false, nullptr,
                                shared ? &dyq : nullptr);
    EXPECT_FALSE(dyq.cols_ready);  // taken
    EXPECT_SAME_BYTES(bytes_of(dx2), bytes_of(dx), "dx");
    EXPECT_SAME_BYTES(bytes_of(dw2), bytes_of(dw), "dw");
  }
}

// fp8_swiglu_backward_operands: the SwiGLU backward's dgu never written, its rows and cols operands
// made in one pass into the shared bytes, give the bits of swiglu_backward's dgu through fc1's
// backward: split (data gradient, then weight gradient, as the experts call it) and in one call;
// without room for both operands it writes dgu as swiglu_backward does. F = 768 (Qwen3-30B-A3B's
// width: 2F = 1536, 12 row tiles) and 200 (a partial tile), experts with 0 and < 128 rows.
TEST(CudaFp8Linear, SwigluBackwardOperandsGiveTheBitsOfDgu) {
  MF_REQUIRE_FP8_GEMM();
  std::mt19937_64 rng(testing::fresh_seed());
  DevicePool dev;
  const std::vector<int64_t> counts = {300, 0, 1000, 77};
  const Host off = offsets_of(counts);
  const int64_t r = 1377, e = 4, in = 256;
  const Tensor offd = to_device(dev, off), xd = to_device(dev, gaussian_bf16(rng, r, in));
  for (int64_t f : {768, 200}) {
    SCOPED_TRACE(::testing::Message() << "F " << f);
    const Tensor gud = to_device(dev, gaussian_bf16(rng, r, 2 * f)), dhd = to_device(dev, gaussian_bf16(rng, r, f)),
                 wd = to_device(dev, gaussian_bf16(rng, e * 2 * f, in)).view({e, 2 * f, in});
    const Tensor dgu = dev.poisoned({r, 2 * f}, DType::bf16);
    swiglu_backward(testing::exec(), gud, dhd, dgu, GateUp::pairs);
    const Tensor dx = dev.poisoned({r, in}, DType::bf16), dw = dev.poisoned({e, 2 * f, in}, DType::f32);
    fp8_grouped_linear_backward(testing::exec(), xd, wd, offd, dgu, dx, dw, false);
    Fp8SharedOperands dyq;
    dyq.bytes = dev.poisoned({fp8_shared_operand_bytes(r, 2 * f, e, true)}, DType::u8);
    for (bool split : {true, false}) {
      SCOPED_TRACE(split ? "split" : "one call");
      const Tensor unwritten = dev.poisoned({r, 2 * f}, DType::bf16);
      const std::vector<uint8_t> poison = bytes_of(unwritten);
      fp8_swiglu_backward_operands(testing::exec(), gud, dhd, offd, unwritten, dyq);
      EXPECT_TRUE(dyq.rows_ready && dyq.cols_ready);
      const Tensor dx2 = dev.poisoned({r, in}, DType::bf16), dw2 = dev.poisoned({e, 2 * f, in}, DType::f32);
      if (split) {
        fp8_grouped_linear_backward(testing::exec(), xd, wd, offd, unwritten, dx2, Tensor(), false, nullptr, &dyq);
        EXPECT_TRUE(dyq.cols_ready);  // kept for the weight gradient
        fp8_grouped_linear_backward(testing::exec(), xd, wd, offd, unwritten, Tensor(), dw2, false, nullptr, &dyq);
      } else {
        fp8_grouped_linear_backward(testing::exec(), xd, wd, offd, unwritten, dx2, dw2, false, nullptr, &dyq);
      }
      EXPECT_FALSE(dyq.rows_ready || dyq.cols_ready);  // taken
      EXPECT_SAME_BYTES(bytes_of(unwritten), poison, "dgu (not written)");
      EXPECT_SAME_BYTES(bytes_of(dx2), bytes_of(dx), "dx");
      EXPECT_SAME_BYTES(bytes_of(dw2), bytes_of(dw), "dw");
    }
    Fp8SharedOperands small;  // room for one operand only: dgu written, nothing made
    small.bytes = dev.poisoned({fp8_shared_operand_bytes(r, 2 * f, e)}, DType::u8);
    small.cols_ready = true;
    const Tensor written = dev.poisoned({r, 2 * f}, DType::bf16);
    fp8_swiglu_backward_operands(testing::exec(), gud, dhd, offd, written, small);
    EXPECT_FALSE(small.rows_ready || small.cols_ready);
    EXPECT_SAME_BYTES(bytes_of(written), bytes_of(dgu), "dgu");
  }
}

TEST(CudaFp8Linear, RejectsWidthsTmaCannotMove) {
  MF_REQUIRE_FP8_GEMM();
  DevicePool dev;
  const Tensor x = dev.empty({8, 24}, DType::bf16), w = dev.empty({32, 24}, DType::bf16),
               y = dev.empty({8, 32}, DType::bf16);
  EXPECT_NE(testing::error_of([&] { fp8_linear_forward(testing::exec(), x, w, y); }).find("multiples of 16"),
            std::string::npos);
}

}  // namespace
}  // namespace moefold

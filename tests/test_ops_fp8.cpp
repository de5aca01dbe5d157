// FP8 blockwise quantization and the FP8 linear layers on the CPU (ops/fp8.h): E4M3 conversion
// against an independent nearest-value search, the power-of-two tile scales, the three tilings
// and their layouts (cols and blocks checked against rows-tiling of transposed copies), and the
// emulated FP8 GEMMs against f64 GEMMs of the dequantized operands (tight) and against the plain
// ops (bounded: E4M3 keeps 3 mantissa bits, each operand element is off by at most 2^-4 relative,
// so a long dot product of random operands is off by ~2^-4 * sqrt(2/3) ~ 5% relative).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "moefold/ops/fp8.h"
#include "moefold/ops/moe_ops.h"
#include "moefold/ops/ops.h"
#include "testing.h"

namespace moefold {
namespace {

using testing::Pool;
using testing::set_value_at;
using testing::value_at;

const ExecContext& cpu() { return ExecContext::standard(Device::cpu); }

// The E4M3 value nearest to a (|a| <= 448), ties to the even code: a brute-force search over the
// 127 non-negative finite codes (independent of e4m3_from_float's arithmetic).
uint8_t nearest_code(float x) {
  const double a = std::fabs(static_cast<double>(x));
  int best = 0;
  double best_d = INFINITY;
  for (int c = 0; c <= 0x7e; ++c) {
    const double v = e4m3_to_float(static_cast<uint8_t>(c));
    const double d = std::fabs(v - a);
    if (d < best_d || (d == best_d && c % 2 == 0)) {
      best = c;
      best_d = d;
    }
  }
  return static_cast<uint8_t>(best | (std::signbit(x) ? 0x80 : 0));
}

TEST(Fp8E4m3, EveryCodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(e4m3_to_float(static_cast<uint8_t>(c))));
      continue;
    }
    EXPECT_EQ(e4m3_from_float(e4m3_to_float(static_cast<uint8_t>(c))), c) << c;
  }
  EXPECT_EQ(e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_to_float(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);
}

TEST(Fp8E4m3, RoundsToNearestEvenAndSaturates) {
  // Midpoints and their neighbours between every pair of adjacent codes, and random values over
  // every binade, against the brute-force search.
  for (int c = 0; c < 0x7e; ++c) {
    const float lo = e4m3_to_float(static_cast<uint8_t>(c)), hi = e4m3_to_float(static_cast<uint8_t>(c + 1));
    const float mid = 0.5f * (lo + hi);
    for (float v : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f), lo, hi}) {
      EXPECT_EQ(e4m3_from_float(v), nearest_code(v)) << v;
      EXPECT_EQ(e4m3_from_float(-v), nearest_code(-v)) << -v;
    }
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> expo(-14, 8);
  for (int i = 0; i < 20000; ++i) {
    const float v = std::ldexp(mant(rng), expo(rng));
    if (v > 448.0f) continue;
    ASSERT_EQ(e4m3_from_float(v), nearest_code(v)) << v;
  }
  for (float v : {448.0f, 448.5f, 464.0f, 480.0f, 1e30f, std::numeric_limits<float>::infinity()}) {
    EXPECT_EQ(e4m3_from_float(v), 0x7e) << v;
    EXPECT_EQ(e4m3_from_float(-v), 0xfe) << -v;
  }
  EXPECT_EQ(e4m3_from_float(std::nanf("")), 0x7f);
  EXPECT_EQ(e4m3_from_float(-0.0f), 0x80);
  EXPECT_EQ(e4m3_from_float(std::ldexp(1.0f, -10)), 0x00);         // half the smallest subnormal: tie to 0
  EXPECT_EQ(e4m3_from_float(std::ldexp(1.5f, -9)), 0x02);          // tie between codes 1 and 2: even
  EXPECT_EQ(e4m3_from_float(std::ldexp(1.0f, -30)), 0x00);         // underflow
  EXPECT_EQ(e4m3_from_float(std::ldexp(1.0f, -6) * 0.99f), 0x08);  // rounds up into the normals
}

TEST(Fp8Scale, SmallestPowerOfTwoThatFits) {
  EXPECT_EQ(fp8_tile_scale(448.0f), 1.0f);
  EXPECT_EQ(fp8_tile_scale(std::nextafter(448.0f, 1e9f)), 2.0f);
  EXPECT_EQ(fp8_tile_scale(224.0f), 0.5f);
  EXPECT_EQ(fp8_tile_scale(1.0f), std::ldexp(1.0f, -8));
  EXPECT_EQ(fp8_tile_scale(0.0f), 1.0f);
  EXPECT_EQ(fp8_tile_scale(std::numeric_limits<float>::infinity()), 1.0f);
  EXPECT_EQ(fp8_tile_scale(1e-44f), std::ldexp(1.0f, -126));  // clamped: 1 / s stays finite
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> expo(-100, 100);
  for (int i = 0; i < 10000; ++i) {
    const float a = std::ldexp(mant(rng), expo(rng)), s = fp8_tile_scale(a);
    int k = 0;
    EXPECT_EQ(std::frexp(s, &k), 0.5f) << a;  // a power of two
    EXPECT_LE(a / s, 448.0f) << a;
    EXPECT_GT(a / (s / 2), 448.0f) << a;
  }
}

// Values over many binades with some exact zeros and all-zero rows.
Tensor awkward(Pool& pool, Shape shape, DType dtype, uint32_t seed) {
  Tensor t = pool.zeros(shape, dtype);
  std::mt19937 rng(seed);
  std::normal_distribution<double> g(0, 1);
  std::uniform_int_distribution<int> e(-20, 12);
  const int64_t cols = shape[-1];
  for (int64_t i = 0; i < t.numel(); ++i) {
    const int64_t row = i / cols;
    if (row % 7 == 3 || i % 11 == 0) continue;  // zero rows (all-zero tiles) and scattered zeros
    set_value_at(t, i, std::ldexp(g(rng), e(rng) / (row % 5 == 0 ? 1 : 4)));
  }
  return t;
}

float tile_amax(const Tensor& x, const std::vector<int64_t>& idx) {
  float a = 0;
  for (int64_t i : idx) a = std::max(a, static_cast<float>(std::fabs(value_at(x, i))));
  return a;
}

TEST(Fp8Quantize, RowsFollowTheLayoutAndTheRule) {
  Pool pool;
  for (DType dt : {DType::f32, DType::bf16}) {
    const int64_t r_n = 9, k = 300;  // three tiles, the last of 44
    const Tensor x = awkward(pool, {r_n, k}, dt, 11);
    const Tensor q = pool.zeros({r_n, k}, DType::u8), s = pool.zeros({3, r_n}, DType::f32);
    fp8_quantize_rows(cpu(), x, q, s);
    for (int64_t r = 0; r < r_n; ++r)
      for (int64_t b = 0; b < 3; ++b) {
        std::vector<int64_t> idx;
        for (int64_t j = b * 128; j < std::min<int64_t>(k, b * 128 + 128); ++j) idx.push_back(r * k + j);
        const float sc = fp8_tile_scale(tile_amax(x, idx));
        ASSERT_EQ(s.ptr<float>()[b * r_n + r], sc) << r << " " << b;
        for (int64_t i : idx)
          ASSERT_EQ(q.ptr<uint8_t>()[i], e4m3_from_float(static_cast<float>(value_at(x, i)) / sc)) << i;
      }
    // Dequantized: within 2^-4 relative of each element above the tile's subnormal range.
    const Tensor back = pool.zeros({r_n, k}, DType::f32);
    fp8_dequantize_rows(cpu(), q, s, back);
    for (int64_t i = 0; i < x.numel(); ++i) {
      const double v = value_at(x, i), d = value_at(back, i);
      const double sc = s.ptr<float>()[(i % k) / 128 * r_n + i / k];
      EXPECT_LE(std::fabs(v - d), std::max(std::fabs(v) / 16, sc * std::ldexp(1.0, -10))) << i;
    }
  }
}

// Packed rows hold exactly the rows layout's codes and scales, each row one block of bytes (its
// codes, then its scales from fp8_packed_scales_at, zeros between and after), and dequantize alike.
TEST(Fp8Quantize, PackedRowsAreRowsWithTheirScalesBeside) {
  Pool pool;
  EXPECT_EQ(fp8_packed_width(2048), 2048 + 64);
  EXPECT_EQ(fp8_packed_width(7168), 7168 + 224);
  EXPECT_EQ(fp8_packed_width(300), 304 + 16);  // scales from byte 304, 3 of them padded to 16 bytes
  for (DType dt : {DType::f32, DType::bf16, DType::f64})
    for (int64_t k : {int64_t{16}, int64_t{300}, int64_t{384}}) {
      const int64_t r_n = 9, b_n = (k + 127) / 128, w_n = fp8_packed_width(k), at = fp8_packed_scales_at(k);
      const Tensor x = awkward(pool, {r_n, k}, dt, 13);
      const Tensor q = pool.zeros({r_n, k}, DType::u8), sc = pool.zeros({b_n, r_n}, DType::f32);
      fp8_quantize_rows(cpu(), x, q, sc);
      const Tensor p = pool.zeros({r_n, w_n}, DType::u8);
      std::memset(p.data(), 0xab, p.nbytes());  // every byte is written
      fp8_quantize_packed(cpu(), x, p);
      for (int64_t r = 0; r < r_n; ++r) {
        const uint8_t* row = p.ptr<uint8_t>() + r * w_n;
        for (int64_t j = 0; j < k; ++j) ASSERT_EQ(row[j], q.ptr<uint8_t>()[r * k + j]) << r << " " << j;
        for (int64_t j = k; j < at; ++j) ASSERT_EQ(row[j], 0) << j;
        for (int64_t b = 0; b < b_n; ++b) {
          float v;
          std::memcpy(&v, row + at + 4 * b, 4);
          ASSERT_EQ(v, sc.ptr<float>()[b * r_n + r]) << r << " " << b;
        }
        for (int64_t j = at + 4 * b_n; j < w_n; ++j) ASSERT_EQ(row[j], 0) << j;
      }
      const Tensor back = pool.zeros({r_n, k}, dt), want = pool.zeros({r_n, k}, dt);
      fp8_dequantize_packed(cpu(), p, back);
      fp8_dequantize_rows(cpu(), q, sc, want);
      EXPECT_EQ(std::memcmp(back.data(), want.data(), back.nbytes()), 0);
      // Quantizing the dequantized rows again gives the same values (what the FP8 GEMMs rely on
      // when x comes packed): scales may halve where a tile's largest code is 224, the codes double.
      const Tensor again = pool.zeros({r_n, w_n}, DType::u8), back2 = pool.zeros({r_n, k}, dt);
      fp8_quantize_packed(cpu(), back, again);
      fp8_dequantize_packed(cpu(), again, back2);
      EXPECT_EQ(std::memcmp(back2.data(), back.data(), back.nbytes()), 0);
    }
  const Tensor x = pool.zeros({4, 256}, DType::f32), narrow = pool.zeros({4, 256}, DType::u8);
  EXPECT_DEATH(fp8_quantize_packed(cpu(), x, narrow), "fp8_quantize_packed");
}

TEST(Fp8Quantize, ColsAreRowsTilingOfEachSegmentTransposed) {
  Pool pool;
  const std::vector<int64_t> sizes = {0, 1, 127, 128, 129, 300, 0};
  int64_t r_n = 0;
  std::vector<int64_t> off = {0};
  for (int64_t n : sizes) off.push_back(r_n += n);
  const int64_t c_n = 40, s_n = static_cast<int64_t>(sizes.size());
  const int64_t p_n = fp8_cols_width(r_n, s_n);
  const Tensor x = awkward(pool, {r_n, c_n}, DType::f32, 5);
  const Tensor offsets(off.data(), DType::i64, {s_n + 1});
  const Tensor qT = pool.zeros({c_n, p_n}, DType::u8), sT = pool.zeros({p_n / 128, c_n}, DType::f32);
  fp8_quantize_cols(cpu(), x, offsets, qT, sT);
  int64_t p = 0;
  for (int64_t j = 0; j < s_n; ++j) {
    const int64_t n = sizes[j];
    if (n > 0) {
      // The segment transposed, tiled as rows.
      const Tensor xt = pool.zeros({c_n, n}, DType::f32);
      for (int64_t t = 0; t < n; ++t)
        for (int64_t c = 0; c < c_n; ++c) set_value_at(xt, c * n + t, value_at(x, (off[j] + t) * c_n + c));
      const int64_t b_n = (n + 127) / 128;
      const Tensor q = pool.zeros({c_n, n}, DType::u8), s = pool.zeros({b_n, c_n}, DType::f32);
      fp8_quantize_rows(cpu(), xt, q, s);
      for (int64_t c = 0; c < c_n; ++c) {
        for (int64_t t = 0; t < n; ++t)
          ASSERT_EQ(qT.ptr<uint8_t>()[c * p_n + p + t], q.ptr<uint8_t>()[c * n + t]) << j << " " << c << " " << t;
        for (int64_t b = 0; b < b_n; ++b)
          ASSERT_EQ(sT.ptr<float>()[(p / 128 + b) * c_n + c], s.ptr<float>()[b * c_n + c]) << j << " " << b;
      }
    }
    p += (n + 127) / 128 * 128;
  }
  EXPECT_LE(p, p_n);
  // The inverse puts every element back where it came from: within 2^-4 relative above its tile's
  // subnormal range.
  const Tensor back = pool.zeros({r_n, c_n}, DType::f32);
  fp8_dequantize_cols(cpu(), qT, sT, offsets, back);
  p = 0;
  for (int64_t j = 0; j < s_n; ++j) {
    for (int64_t t = 0; t < sizes[j]; ++t)
      for (int64_t c = 0; c < c_n; ++c) {
        const int64_t i = (off[j] + t) * c_n + c;
        const double sc = sT.ptr<float>()[((p + t) / 128) * c_n + c];
        ASSERT_LE(std::fabs(value_at(back, i) - value_at(x, i)), std::max(std::fabs(value_at(x, i)) / 16, sc / 1024))
            << i;
      }
    p += (sizes[j] + 127) / 128 * 128;
  }
  // Too narrow a qT for these segments is refused.
  const Tensor narrow = pool.zeros({c_n, 640}, DType::u8), narrow_s = pool.zeros({5, c_n}, DType::f32);
  EXPECT_DEATH(fp8_quantize_cols(cpu(), x, offsets, narrow, narrow_s), "fewer than the 1024 columns needed");
}

TEST(Fp8Quantize, BlocksAndTheirTranspose) {
  Pool pool;
  const int64_t e_n = 2, o_n = 200, i_n = 130;  // 2 x 2 blocks per expert, ragged edges
  const Tensor w = awkward(pool, {e_n, o_n, i_n}, DType::bf16, 9);
  const Tensor q = pool.zeros({e_n, o_n, i_n}, DType::u8), s = pool.zeros({e_n, 2, 2}, DType::f32);
  const Tensor qT = pool.zeros({e_n, i_n, o_n}, DType::u8), sT = pool.zeros({e_n, 2, 2}, DType::f32);
  fp8_quantize_blocks(cpu(), w, q, s, qT, sT);
  for (int64_t e = 0; e < e_n; ++e)
    for (int64_t bo = 0; bo < 2; ++bo)
      for (int64_t bi = 0; bi < 2; ++bi) {
        std::vector<int64_t> idx;
        for (int64_t o = bo * 128; o < std::min<int64_t>(o_n, bo * 128 + 128); ++o)
          for (int64_t i = bi * 128; i < std::min<int64_t>(i_n, bi * 128 + 128); ++i)
            idx.push_back((e * o_n + o) * i_n + i);
        const float sc = fp8_tile_scale(tile_amax(w, idx));
        ASSERT_EQ(s.ptr<float>()[(e * 2 + bo) * 2 + bi], sc);
        ASSERT_EQ(sT.ptr<float>()[(e * 2 + bi) * 2 + bo], sc);
        for (int64_t f : idx) {
          const int64_t o = f / i_n % o_n, i = f % i_n;
          const uint8_t code = e4m3_from_float(static_cast<float>(value_at(w, f)) / sc);
          ASSERT_EQ(q.ptr<uint8_t>()[f], code);
          ASSERT_EQ(qT.ptr<uint8_t>()[(e * i_n + i) * o_n + o], code);
        }
      }
  const Tensor back = pool.zeros({e_n, o_n, i_n}, DType::f32);
  fp8_dequantize_blocks(cpu(), q, s, back);
  for (int64_t f = 0; f < w.numel(); ++f)
    EXPECT_EQ(value_at(back, f), e4m3_to_float(q.ptr<uint8_t>()[f]) *
                                     s.ptr<float>()[(f / (o_n * i_n) * 2 + f / i_n % o_n / 128) * 2 + f % i_n / 128]);
}

// ---- the FP8 linear layers ----------------------------------------------------------------------

// An operand quantized in `how` and dequantized, in f64 (the tight reference's input).
enum class Tiling { rows, blocks };
Tensor dequantized(Pool& pool, const Tensor& x, Tiling how) {
  const Tensor back = pool.zeros(x.shape(), DType::f64);
  const Tensor q = pool.zeros(x.shape(), DType::u8);
  if (how == Tiling::rows) {
    const Tensor s = pool.zeros({(x.size(1) + 127) / 128, x.size(0)}, DType::f32);
    fp8_quantize_rows(cpu(), x, q, s);
    fp8_dequantize_rows(cpu(), q, s, back);
  } else {
    const int64_t d = x.ndim();
    Shape ss = x.shape();
    ss.dims[d - 2] = (ss[d - 2] + 127) / 128;
    ss.dims[d - 1] = (ss[d - 1] + 127) / 128;
    const Tensor s = pool.zeros(ss, DType::f32);
    fp8_quantize_blocks(cpu(), x, q, s, Tensor(), Tensor());
    fp8_dequantize_blocks(cpu(), q, s, back);
  }
  return back;
}

Tensor dequantized_cols(Pool& pool, const Tensor& x, const Tensor& offsets) {
  const int64_t p_n = fp8_cols_width(x.size(0), offsets.numel() - 1);
  const Tensor qT = pool.zeros({x.size(1), p_n}, DType::u8), sT = pool.zeros({p_n / 128, x.size(1)}, DType::f32);
  fp8_quantize_cols(cpu(), x, offsets, qT, sT);
  const Tensor back = pool.zeros(x.shape(), DType::f64);
  fp8_dequantize_cols(cpu(), qT, sT, offsets, back);
  return back;
}

double rel_err(const Tensor& got, const Tensor& want) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    const double d = value_at(got, i) - value_at(want, i);
    num += d * d;
    den += value_at(want, i) * value_at(want, i);
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

Tensor to_f64(Pool& pool, const Tensor& t) {
  const Tensor out = pool.zeros(t.shape(), DType::f64);
  for (int64_t i = 0; i < t.numel(); ++i) set_value_at(out, i, value_at(t, i));
  return out;
}

// Per expert: y_e = a_e @ b_e^T (trans_b) or a_e @ b_e, over rows [off[e], off[e+1]) of a.
Tensor grouped_f64(Pool& pool, const Tensor& a, const Tensor& b, const std::vector<int64_t>& off, bool trans_b) {
  const int64_t e_n = static_cast<int64_t>(off.size()) - 1, k = a.size(1);
  const int64_t n = trans_b ? b.size(b.ndim() - 2) : b.size(b.ndim() - 1);
  const int64_t per = b.size(b.ndim() - 2) * b.size(b.ndim() - 1);
  const Tensor y = pool.zeros({a.size(0), n}, DType::f64);
  for (int64_t e = 0; e < e_n; ++e)
    for (int64_t r = off[e]; r < off[e + 1]; ++r)
      for (int64_t j = 0; j < n; ++j) {
        double acc = 0;
        for (int64_t t = 0; t < k; ++t)
          acc += value_at(a, r * k + t) * value_at(b, e * per + (trans_b ? j * k + t : t * n + j));
        set_value_at(y, r * n + j, acc);
      }
  return y;
}

// dw_e = dy_e^T @ x_e per expert.
Tensor wgrad_f64(Pool& pool, const Tensor& dy, const Tensor& x, const std::vector<int64_t>& off) {
  const int64_t e_n = static_cast<int64_t>(off.size()) - 1, o_n = dy.size(1), i_n = x.size(1);
  const Tensor dw = pool.zeros({e_n, o_n, i_n}, DType::f64);
  for (int64_t e = 0; e < e_n; ++e)
    for (int64_t o = 0; o < o_n; ++o)
      for (int64_t i = 0; i < i_n; ++i) {
        double acc = 0;
        for (int64_t r = off[e]; r < off[e + 1]; ++r) acc += value_at(dy, r * o_n + o) * value_at(x, r * i_n + i);
        set_value_at(dw, (e * o_n + o) * i_n + i, acc);
      }
  return dw;
}

TEST(Fp8Linear, GroupedMatchesDequantizedOperandsAndStaysNearThePlainOp) {
  Pool pool;
  const std::vector<int64_t> sizes = {70, 0, 129, 1, 200};
  std::vector<int64_t> off = {0};
  for (int64_t n : sizes) off.push_back(off.back() + n);
  const int64_t e_n = 5, r_n = off.back(), i_n = 160, o_n = 144;
  const Tensor offsets(off.data(), DType::i64, {e_n + 1});
  const Tensor x = pool.randn({r_n, i_n}, DType::f32), w = pool.randn({e_n, o_n, i_n}, DType::f32, 0.05);
  const Tensor dy = pool.randn({r_n, o_n}, DType::f32);
  const Tensor y = pool.zeros({r_n, o_n}, DType::f32), dx = pool.zeros({r_n, i_n}, DType::f32);
  const Tensor dw = pool.randn({e_n, o_n, i_n}, DType::f32);  // accumulated into
  const Tensor dw0 = pool.clone(dw);
  fp8_grouped_linear_forward(cpu(), x, w, offsets, y);
  fp8_grouped_linear_backward(cpu(), x, w, offsets, dy, dx, dw);

  const Tensor qx = dequantized(pool, x, Tiling::rows), qw = dequantized(pool, w, Tiling::blocks);
  const Tensor qdy = dequantized(pool, dy, Tiling::rows);
  EXPECT_LT(rel_err(y, grouped_f64(pool, qx, qw, off, true)), 1e-6);
  EXPECT_LT(rel_err(dx, grouped_f64(pool, qdy, qw, off, false)), 1e-6);
  const Tensor want_dw = wgrad_f64(pool, dequantized_cols(pool, dy, offsets), dequantized_cols(pool, x, offsets), off);
  const Tensor got_dw = pool.zeros(dw.shape(), DType::f64);
  for (int64_t i = 0; i < dw.numel(); ++i) set_value_at(got_dw, i, value_at(dw, i) - value_at(dw0, i));
  EXPECT_LT(rel_err(got_dw, want_dw), 1e-5);
  // Experts without rows keep their gradient (accumulated) or get zeros (written).
  for (int64_t i = o_n * i_n; i < 2 * o_n * i_n; ++i) ASSERT_EQ(value_at(dw, i), value_at(dw0, i));
  fp8_grouped_linear_backward(cpu(), x, w, offsets, dy, Tensor(), dw, false);
  for (int64_t i = o_n * i_n; i < 2 * o_n * i_n; ++i) ASSERT_EQ(value_at(dw, i), 0.0);
  EXPECT_LT(rel_err(to_f64(pool, dw), want_dw), 1e-5);

  // Against the unquantized products.
  EXPECT_LT(rel_err(y, grouped_f64(pool, x, w, off, true)), 0.1);
  EXPECT_LT(rel_err(dx, grouped_f64(pool, dy, w, off, false)), 0.1);
  EXPECT_LT(rel_err(dw, wgrad_f64(pool, dy, x, off)), 0.1);
}

// x given as packed FP8 rows (moe.fp8_dispatch): the forward and the data gradient are those of x
// itself bit for bit (the forward's operand is Q_rows(x) either way); the weight gradient is that
// of x's dequantized values (DeepSeek-V3's requantization of dispatched tokens), within the FP8
// bound of the plain one.
TEST(Fp8Linear, PackedInputIsTheSameOperand) {
  Pool pool;
  const std::vector<int64_t> off = {0, 70, 70, 199, 200, 400};
  const int64_t e_n = 5, r_n = off.back(), i_n = 160, o_n = 144;
  const Tensor offsets(const_cast<int64_t*>(off.data()), DType::i64, {e_n + 1});
  for (DType dt : {DType::f32, DType::f64}) {
    const Tensor x = pool.randn({r_n, i_n}, dt), w = pool.randn({e_n, o_n, i_n}, dt, 0.05);
    const Tensor dy = pool.randn({r_n, o_n}, dt);
    const Tensor p = pool.zeros({r_n, fp8_packed_width(i_n)}, DType::u8), xv = pool.zeros({r_n, i_n}, dt);
    fp8_quantize_packed(cpu(), x, p);
    fp8_dequantize_packed(cpu(), p, xv);
    const Tensor y = pool.zeros({r_n, o_n}, dt), py = pool.zeros({r_n, o_n}, dt);
    fp8_grouped_linear_forward(cpu(), x, w, offsets, y);
    fp8_grouped_linear_forward(cpu(), p, w, offsets, py);
    EXPECT_EQ(testing::max_abs_diff(py, y), 0.0);
    const Tensor dx = pool.zeros({r_n, i_n}, dt), pdx = pool.zeros({r_n, i_n}, dt);
    const Tensor dw = pool.zeros({e_n, o_n, i_n}, dt), pdw = pool.zeros({e_n, o_n, i_n}, dt);
    const Tensor vdw = pool.zeros({e_n, o_n, i_n}, dt);
    fp8_grouped_linear_backward(cpu(), x, w, offsets, dy, dx, dw, false);
    fp8_grouped_linear_backward(cpu(), p, w, offsets, dy, pdx, pdw, false);
    fp8_grouped_linear_backward(cpu(), xv, w, offsets, dy, Tensor(), vdw, false);
    EXPECT_EQ(testing::max_abs_diff(pdx, dx), 0.0);
    EXPECT_EQ(testing::max_abs_diff(pdw, vdw), 0.0);
    EXPECT_LT(rel_err(pdw, dw), 0.05);
    // The dense op alike.
    const Tensor w2 = w.slice(0, 1).view({o_n, i_n}), dy2 = pool.randn({r_n, o_n}, dt);
    const Tensor y2 = pool.zeros({r_n, o_n}, dt), py2 = pool.zeros({r_n, o_n}, dt);
    fp8_linear_forward(cpu(), x, w2, y2);
    fp8_linear_forward(cpu(), p, w2, py2);
    EXPECT_EQ(testing::max_abs_diff(py2, y2), 0.0);
    const Tensor pdw2 = pool.zeros({o_n, i_n}, dt), vdw2 = pool.zeros({o_n, i_n}, dt);
    fp8_linear_backward(cpu(), p, w2, dy2, Tensor(), pdw2, false);
    fp8_linear_backward(cpu(), xv, w2, dy2, Tensor(), vdw2, false);
    EXPECT_EQ(testing::max_abs_diff(pdw2, vdw2), 0.0);
  }
  // Packed rows of another width are refused.
  const Tensor w = pool.randn({1, o_n, i_n}, DType::f32);
  const Tensor bad = pool.zeros({8, fp8_packed_width(i_n) + 16}, DType::u8), y = pool.zeros({8, o_n}, DType::f32);
  int64_t one[2] = {0, 8};
  EXPECT_DEATH(fp8_grouped_linear_forward(cpu(), bad, w, Tensor(one, DType::i64, {2}), y),
               "fp8_grouped_linear_forward");
}

// The SwiGLU's output straight into packed rows: swiglu_forward (pairs) then fp8_quantize_packed.
TEST(Fp8Quantize, SwigluPackedIsSwigluThenQuantize) {
  Pool pool;
  for (DType dt : {DType::f32, DType::f64}) {
    const int64_t r_n = 6, f = 200;
    const Tensor gu = awkward(pool, {r_n, 2 * f}, dt, 19), h = pool.zeros({r_n, f}, dt);
    const Tensor want = pool.zeros({r_n, fp8_packed_width(f)}, DType::u8),
                 got = pool.zeros({r_n, fp8_packed_width(f)}, DType::u8);
    swiglu_forward(cpu(), gu, h, GateUp::pairs);
    fp8_quantize_packed(cpu(), h, want);
    fp8_swiglu_packed(cpu(), gu, got);
    EXPECT_EQ(std::memcmp(got.data(), want.data(), want.nbytes()), 0);
  }
  const Tensor odd = pool.zeros({2, 7}, DType::f32), p = pool.zeros({2, 16}, DType::u8);
  EXPECT_DEATH(fp8_swiglu_packed(cpu(), odd, p), "fp8_swiglu_packed");
}

// Byte rows (packed FP8) permute bit for bit, padding rows zero.
TEST(Fp8Quantize, PackedRowsPermuteAsBytes) {
  Pool pool;
  const int64_t t_n = 5, k = 256, w_n = fp8_packed_width(k);
  const Tensor x = awkward(pool, {t_n, k}, DType::f32, 17), p = pool.zeros({t_n, w_n}, DType::u8);
  fp8_quantize_packed(cpu(), x, p);
  int64_t token[4] = {3, -1, 0, 3};
  const Tensor rows = pool.zeros({4, w_n}, DType::u8);
  std::memset(rows.data(), 0xcd, rows.nbytes());
  moe_permute(cpu(), p, Tensor(token, DType::i64, {4}), rows);
  for (int64_t r = 0; r < 4; ++r)
    for (int64_t j = 0; j < w_n; ++j)
      ASSERT_EQ(rows.ptr<uint8_t>()[r * w_n + j], token[r] < 0 ? 0 : p.ptr<uint8_t>()[token[r] * w_n + j]) << r;
}

// On the CPU fp8_swiglu_backward_operands is swiglu_backward (the FP8 calls after it quantize the
// written dgu) and drops whatever the shared operands held; the pair layout's bytes are the two
// operands' together.
TEST(Fp8Linear, SwigluBackwardOperandsOnTheCpuWriteDgu) {
  Pool pool;
  const int64_t r = 50, f = 24;
  const Tensor gu = pool.randn({r, 2 * f}, DType::f32), dh = pool.randn({r, f}, DType::f32);
  const Tensor want = pool.zeros({r, 2 * f}, DType::f32), got = pool.zeros({r, 2 * f}, DType::f32);
  int64_t off[3] = {0, 20, r};
  const Tensor offsets(off, DType::i64, {3});
  swiglu_backward(cpu(), gu, dh, want, GateUp::pairs);
  Fp8SharedOperands dyq;
  dyq.rows_ready = dyq.cols_ready = true;
  fp8_swiglu_backward_operands(cpu(), gu, dh, offsets, got, dyq);
  EXPECT_EQ(testing::max_abs_diff(got, want), 0.0);
  EXPECT_FALSE(dyq.rows_ready || dyq.cols_ready);
  EXPECT_EQ(fp8_shared_operand_bytes(300, 256, 3, true),
            fp8_operand_bytes(300 * 256, 2 * 300) +
                fp8_operand_bytes(256 * fp8_cols_width(300, 3), fp8_cols_width(300, 3) / 128 * 256));
  EXPECT_EQ(fp8_shared_operand_bytes(300, 256, 3),
            std::max(fp8_operand_bytes(300 * 256, 2 * 300),
                     fp8_operand_bytes(256 * fp8_cols_width(300, 3), fp8_cols_width(300, 3) / 128 * 256)));
}

TEST(Fp8Linear, DenseIsOneSegment) {
  Pool pool;
  const int64_t n = 300, i_n = 96, o_n = 64;
  const Tensor x = pool.randn({n, i_n}, DType::f64), w = pool.randn({o_n, i_n}, DType::f64, 0.1);
  const Tensor dy = pool.randn({n, o_n}, DType::f64);
  const Tensor y = pool.zeros({n, o_n}, DType::f64), dx = pool.zeros({n, i_n}, DType::f64);
  const Tensor dw = pool.zeros({o_n, i_n}, DType::f64);
  fp8_linear_forward(cpu(), x, w, y);
  fp8_linear_backward(cpu(), x, w, dy, dx, dw);
  // The grouped op with one expert computes the same.
  int64_t off[2] = {0, n};
  const Tensor offsets(off, DType::i64, {2});
  const Tensor w3 = w.view({1, o_n, i_n});
  const Tensor gy = pool.zeros({n, o_n}, DType::f64), gdx = pool.zeros({n, i_n}, DType::f64);
  const Tensor gdw = pool.zeros({1, o_n, i_n}, DType::f64);
  fp8_grouped_linear_forward(cpu(), x, w3, offsets, gy);
  fp8_grouped_linear_backward(cpu(), x, w3, offsets, dy, gdx, gdw);
  EXPECT_EQ(testing::max_abs_diff(y, gy), 0.0);
  EXPECT_EQ(testing::max_abs_diff(dx, gdx), 0.0);
  EXPECT_EQ(testing::max_abs_diff(dw, gdw.view({o_n, i_n})), 0.0);
  // linear_*_in picks the plain op without an FP8 copy of w, the FP8 op with one.
  const Tensor py = pool.zeros({n, o_n}, DType::f64), ry = pool.zeros({n, o_n}, DType::f64);
  linear_forward_in(cpu(), nullptr, x, w, py);
  linear_forward(cpu(), x, w, ry);
  EXPECT_EQ(testing::max_abs_diff(py, ry), 0.0);
  const Fp8Weight wq{pool.zeros(w.shape(), DType::u8), pool.zeros(fp8_block_scale_shape(w.shape(), false), DType::f32),
                     pool.zeros(fp8_transposed_shape(w.shape()), DType::u8),
                     pool.zeros(fp8_block_scale_shape(w.shape(), true), DType::f32)};
  fp8_quantize_blocks(cpu(), w, wq.q, wq.s, wq.qT, wq.sT);
  linear_forward_in(cpu(), &wq, x, w, py);
  EXPECT_EQ(testing::max_abs_diff(py, y), 0.0);
  EXPECT_GT(testing::max_abs_diff(py, ry), 0.0);  // quantization changed something
  EXPECT_LT(rel_err(py, ry), 0.1);
  // Shared FP8 operands of x (Fp8SharedOperands): the CPU's emulation quantizes at every call, the same
  // results; bytes too few for x's operands are a caller's bug.
  Fp8SharedOperands xin;
  xin.bytes = pool.zeros({fp8_shared_operand_bytes(n, i_n)}, DType::u8);
  const Tensor sy = pool.zeros({n, o_n}, DType::f64), sdx = pool.zeros({n, i_n}, DType::f64);
  const Tensor sdw = pool.zeros({o_n, i_n}, DType::f64);
  fp8_linear_forward(cpu(), x, w, sy, nullptr, &xin);
  fp8_linear_backward(cpu(), x, w, dy, sdx, sdw, true, nullptr, &xin);
  EXPECT_EQ(testing::max_abs_diff(sy, y), 0.0);
  EXPECT_EQ(testing::max_abs_diff(sdx, dx), 0.0);
  EXPECT_EQ(testing::max_abs_diff(sdw, dw), 0.0);
  xin.bytes = pool.zeros({fp8_shared_operand_bytes(n, i_n) - 1}, DType::u8);
  EXPECT_DEATH(fp8_linear_forward(cpu(), x, w, sy, nullptr, &xin), "shared FP8 operands' bytes");
}

}  // namespace
}  // namespace moefold

namespace moefold {
namespace {

// A weight's FP8 copy (Fp8Param): quantized at the first get() of each weights version, reused
// until the next (a changed weight without Memory::weights_changed() keeps its old codes: the
// Trainer calls it before every step and evaluation); the FP8 GEMMs give the same bits with it as
// without. A second binding of the module (Memory::SharedParams) shares the copy; with CUDA graphs
// the Trainer quantizes every changed copy up front (fp8_quantize_changed_params).
TEST(Fp8Param, QuantizesOncePerWeightsVersionAndChangesNothing) {
  Memory mem(DType::f32, cpu());
  Tensor w, w2;
  Fp8Param cache, off, shared;
  const auto bind = [&] {
    w = cache.param(mem, {.name = "w", .shape = {3, 144, 160}, .init_std = 0.05}, true);
    off.param(mem, {.name = "v", .shape = {144, 160}}, false);
    Memory::SharedParams again(mem, true);
    w2 = shared.param(mem, {.name = "w", .shape = {3, 144, 160}, .init_std = 0.05}, true);
  };
  bind();
  mem.allocate();
  bind();
  mem.finish_binding();
  EXPECT_EQ(w2.data(), w.data());
  const auto codes = static_cast<size_t>(2 * w.numel());  // q, qT; then s, sT: 48 bytes each, aligned
  EXPECT_GE(mem.fp8_bytes(), codes + 96);
  EXPECT_LE(mem.fp8_bytes(), codes + 4 * 64);
  EXPECT_FALSE(mem.find("v")->fp8.defined());
  Pool pool;
  const Tensor init = pool.randn({3, 144, 160}, DType::f32, 0.05);
  w.copy_from(init);
  EXPECT_EQ(off.get(), nullptr);
  const Fp8Weight* q = cache.get();
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(shared.get(), q);  // one copy for both bindings
  const Tensor q0 = pool.zeros(w.shape(), DType::u8), s0 = pool.zeros({3, 2, 2}, DType::f32);
  const Tensor qT0 = pool.zeros({3, 160, 144}, DType::u8), sT0 = pool.zeros({3, 2, 2}, DType::f32);
  fp8_quantize_blocks(cpu(), w, q0, s0, qT0, sT0);
  for (const auto& [got, want] : {std::pair{q->q, q0}, {q->s, s0}, {q->qT, qT0}, {q->sT, sT0}})
    ASSERT_EQ(std::memcmp(got.data(), want.data(), want.nbytes()), 0);

  // The GEMMs read the cached weight: the same bits as quantizing w themselves.
  std::vector<int64_t> off_v = {0, 100, 100, 260};
  const Tensor offsets(off_v.data(), DType::i64, {4});
  const Tensor x = pool.randn({260, 160}, DType::f32), dy = pool.randn({260, 144}, DType::f32);
  const Tensor y1 = pool.zeros({260, 144}, DType::f32), y2 = pool.zeros({260, 144}, DType::f32);
  const Tensor dx1 = pool.zeros({260, 160}, DType::f32), dx2 = pool.zeros({260, 160}, DType::f32);
  fp8_grouped_linear_forward(cpu(), x, w, offsets, y1, cache.get());
  fp8_grouped_linear_forward(cpu(), x, w, offsets, y2);
  fp8_grouped_linear_backward(cpu(), x, w, offsets, dy, dx1, Tensor(), true, cache.get());
  fp8_grouped_linear_backward(cpu(), x, w, offsets, dy, dx2, Tensor());
  EXPECT_EQ(testing::max_abs_diff(y1, y2), 0.0);
  EXPECT_EQ(testing::max_abs_diff(dx1, dx2), 0.0);

  // Doubled weights: the same codes, the scales doubled, once the weights version moves.
  scale_inplace(cpu(), w, 2.0);
  EXPECT_EQ(cache.get()->s.ptr<float>()[0], s0.ptr<float>()[0]);
  mem.weights_changed();
  EXPECT_EQ(shared.get()->s.ptr<float>()[0], 2 * s0.ptr<float>()[0]);
  EXPECT_EQ(std::memcmp(cache.get()->q.data(), q0.data(), q0.nbytes()), 0);

  // fp8_quantize_changed_params (before CUDA graphs): what the first get() of a new version would
  // do, done up front; get() then quantizes nothing (a copy changed behind its back stays).
  scale_inplace(cpu(), w, 0.5);
  mem.weights_changed();
  fp8_quantize_changed_params(mem);
  EXPECT_EQ(q->s.ptr<float>()[0], s0.ptr<float>()[0]);
  q->s.ptr<float>()[0] = 7.0f;
  EXPECT_EQ(cache.get()->s.ptr<float>()[0], 7.0f);
  fp8_quantize_changed_params(mem);  // the same version: nothing again
  EXPECT_EQ(cache.get()->s.ptr<float>()[0], 7.0f);
  mem.weights_changed();
  EXPECT_EQ(cache.get()->s.ptr<float>()[0], s0.ptr<float>()[0]);
}

// via_bf16: an f32 weight quantized as its bf16 rounding would be, bit for bit (values chosen so
// that rounding to bf16 moves many of them across E4M3 rounding boundaries and one block's amax).
TEST(Fp8Quantize, BlocksViaBf16AreTheBlocksOfTheBf16Rounding) {
  Pool pool;
  const Tensor w = pool.randn({2, 130, 200}, DType::f32, 0.3);
  float* wd = w.ptr<float>();
  wd[0] = 447.99f;  // rounds to 448 in bf16: the block's scale changes
  const Tensor r = pool.zeros(w.shape(), DType::f32);
  for (int64_t i = 0; i < w.numel(); ++i) r.ptr<float>()[i] = bf16_to_f32(f32_to_bf16(wd[i]));
  const Shape ss = fp8_block_scale_shape(w.shape(), false), st = fp8_block_scale_shape(w.shape(), true);
  const Shape ts = fp8_transposed_shape(w.shape());
  const Tensor q1 = pool.zeros(w.shape(), DType::u8), s1 = pool.zeros(ss, DType::f32);
  const Tensor qT1 = pool.zeros(ts, DType::u8), sT1 = pool.zeros(st, DType::f32);
  const Tensor q2 = pool.zeros(w.shape(), DType::u8), s2 = pool.zeros(ss, DType::f32);
  const Tensor qT2 = pool.zeros(ts, DType::u8), sT2 = pool.zeros(st, DType::f32);
  fp8_quantize_blocks(cpu(), w, q1, s1, qT1, sT1, true);
  fp8_quantize_blocks(cpu(), r, q2, s2, qT2, sT2);
  for (const auto& [got, want] : {std::pair{q1, q2}, {s1, s2}, {qT1, qT2}, {sT1, sT2}})
    EXPECT_EQ(std::memcmp(got.data(), want.data(), want.nbytes()), 0);
  // and differ from quantizing the f32 values themselves
  fp8_quantize_blocks(cpu(), w, q2, s2, qT2, sT2);
  EXPECT_NE(std::memcmp(q1.data(), q2.data(), q2.nbytes()), 0);
}

// FP8-only weights under the distributed optimizer: a weight cut into flat parts anywhere (as
// AdamW's slots cut it), each part's block amax, their max, the scales and each part's codes, then
// the transposes, give fp8_quantize_blocks's q, s, qT and sT of the whole weight bit for bit: 2-D
// and 3-D, sides off the 128 grid, f32 through bf16, bf16 and f64 parts, an all-zero block (scale
// 1), a block with a NaN and one with an infinity (scale 1, saturated / NaN codes).
TEST(Fp8Quantize, PartsGiveTheBlocksOfTheWhole) {
  Pool pool;
  std::mt19937 rng(7);
  for (const Shape& shape : {Shape{300, 200}, Shape{3, 130, 260}, Shape{2, 128, 128}})
    for (const DType dt : {DType::f32, DType::bf16, DType::f64})
      for (const bool via_bf16 : {false, true}) {
        if (via_bf16 && dt != DType::f32) continue;
        SCOPED_TRACE(cat(shape.str(), " ", dtype_name(dt), via_bf16 ? " via bf16" : ""));
        const Tensor w = pool.zeros(shape, dt);
        cast(cpu(), pool.randn(shape, DType::f32, 0.3), w);
        const int64_t i_n = shape[shape.ndim - 1], n = w.numel();
        set_value_at(w, 5 * i_n + 3, 447.99);  // rounds to 448 in bf16: the block's scale moves
        for (int64_t o = 0; o < 128 && o < shape[shape.ndim - 2]; ++o)  // block (0, 1) all zero
          for (int64_t i = 128; i < 256 && i < i_n; ++i) set_value_at(w, o * i_n + i, 0.0);
        set_value_at(w, n - 1, std::numeric_limits<double>::quiet_NaN());
        set_value_at(w, n - 2 * i_n - 1, std::numeric_limits<double>::infinity());
        const Shape ss = fp8_block_scale_shape(shape, false);
        const Tensor q = pool.zeros(shape, DType::u8), s = pool.zeros(ss, DType::f32);
        const Tensor qT = pool.zeros(fp8_transposed_shape(shape), DType::u8);
        const Tensor sT = pool.zeros(fp8_block_scale_shape(shape, true), DType::f32);
        fp8_quantize_blocks(cpu(), w, q, s, qT, sT, via_bf16);
        // Parts of random lengths (one empty), as slots of a flat block.
        std::vector<int64_t> cuts = {0, 0, n};
        for (int k = 0; k < 5; ++k) cuts.push_back(std::uniform_int_distribution<int64_t>(0, n)(rng));
        std::sort(cuts.begin(), cuts.end());
        const Tensor flat = w.view({n});
        const Tensor amax = pool.zeros(ss, DType::f32), qp = pool.zeros(shape, DType::u8);
        const Tensor flat_q = qp.view({n});
        for (size_t k = 0; k + 1 < cuts.size(); ++k) {  // each rank's part, its amax into one max
          const Tensor part_amax = pool.zeros(ss, DType::f32);
          fp8_block_amax(cpu(), flat.slice(cuts[k], cuts[k + 1]), shape, cuts[k], part_amax, via_bf16);
          for (int64_t b = 0; b < amax.numel(); ++b)
            amax.ptr<float>()[b] = std::max(amax.ptr<float>()[b], part_amax.ptr<float>()[b]);
        }
        fp8_scales_from_amax(cpu(), amax);
        EXPECT_EQ(std::memcmp(amax.data(), s.data(), s.nbytes()), 0);
        EXPECT_EQ(amax.ptr<float>()[1], 1.0f);  // the all-zero block
        for (size_t k = 0; k + 1 < cuts.size(); ++k)
          fp8_quantize_part(cpu(), flat.slice(cuts[k], cuts[k + 1]), shape, cuts[k], amax,
                            flat_q.slice(cuts[k], cuts[k + 1]), via_bf16);
        EXPECT_EQ(std::memcmp(qp.data(), q.data(), q.nbytes()), 0);
        const Tensor qT2 = pool.zeros(qT.shape(), DType::u8), sT2 = pool.zeros(sT.shape(), DType::f32);
        fp8_transpose_blocks(cpu(), qp, amax, qT2, sT2);
        EXPECT_EQ(std::memcmp(qT2.data(), qT.data(), qT.nbytes()), 0);
        EXPECT_EQ(std::memcmp(sT2.data(), sT.data(), sT.nbytes()), 0);
      }
  // One line for a part outside its weight.
  const Tensor w = pool.randn({4, 8}, DType::f32, 1.0), a = pool.zeros({1, 1}, DType::f32);
  EXPECT_DEATH(fp8_block_amax(cpu(), w.view({32}).slice(0, 8), Shape{4, 8}, 30, a), "of a weight of 32");
}

// train.fp8_param (Memory::set_fp8_params) with bf16 compute: an FP8 weight gets no bf16 copy (its
// compute tensor has a shape and no data; compute_bytes shrink by its 2 bytes an element), and its
// FP8 copy, quantized from the f32 master, holds exactly the codes and scales the bf16 copy gives.
// Other weights keep their bf16 copies. The FP8 ops refuse such a weight without its copy.
TEST(Fp8Param, KeptOnlyInFp8IsQuantizedFromTheMasterAsItsBf16Copy) {
  Memory with(DType::bf16, cpu()), without(DType::bf16, cpu());
  with.set_fp8_params(true);
  Fp8Param a, b;
  Tensor wa, wb, na, nb;
  const auto bind = [](Memory& mem, Fp8Param& h, Tensor& w, Tensor& n) {
    w = h.param(mem, {.name = "w", .shape = {144, 272}, .init_std = 0.05}, true);
    n = mem.param({.name = "n", .shape = {16}});
  };
  for (auto* m : {&with, &without}) {
    Fp8Param& h = m == &with ? a : b;
    Tensor& w = m == &with ? wa : wb;
    Tensor& n = m == &with ? na : nb;
    bind(*m, h, w, n);
    m->allocate();
    bind(*m, h, w, n);
    m->finish_binding();
  }
  EXPECT_EQ(wa.data(), nullptr);
  EXPECT_EQ(wa.shape(), wb.shape());
  EXPECT_NE(na.data(), nullptr);
  EXPECT_FALSE(with.find("w")->has_compute_copy());
  EXPECT_TRUE(with.find("n")->has_compute_copy());
  EXPECT_EQ(without.compute_bytes() - with.compute_bytes(), static_cast<size_t>(2 * wb.numel()));
  EXPECT_EQ(with.fp8_bytes(), without.fp8_bytes());
  Pool pool;
  const Tensor master = pool.randn({144, 272}, DType::f32, 0.05);
  with.find("w")->value.copy_from(master);
  without.find("w")->value.copy_from(master);
  auto* bf = static_cast<uint16_t*>(wb.data());  // the bf16 copy the optimizer would write
  for (int64_t i = 0; i < master.numel(); ++i) bf[i] = f32_to_bf16(master.ptr<float>()[i]);
  const Fp8Weight *qa = a.get(), *qb = b.get();
  for (const auto& [got, want] : {std::pair{qa->q, qb->q}, {qa->s, qb->s}, {qa->qT, qb->qT}, {qa->sT, qb->sT}})
    EXPECT_EQ(std::memcmp(got.data(), want.data(), want.nbytes()), 0);
  const Tensor x = pool.zeros({4, 272}, DType::bf16), y = pool.zeros({4, 144}, DType::bf16);
  EXPECT_DEATH(fp8_linear_forward(cpu(), x, wa, y), "kept only in FP8");
  EXPECT_DEATH(with.set_fp8_params(false), "after parameters were registered");
}

}  // namespace
}  // namespace moefold

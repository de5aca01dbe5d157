// io: safetensors round trips (f32, bf16, metadata) and every malformed-file case, each of
// which must be a moefold::Error whose message names the file.
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "moefold/core/rng.h"
#include "moefold/io/mapped_file.h"
#include "moefold/io/safetensors.h"
#include "testing.h"

namespace moefold {
namespace {

namespace fs = std::filesystem;
using testing::read_bytes;
using testing::TempDir;
using testing::write_bytes;

// A safetensors file by hand: u64 header length (or `len_override`), header text, data.
std::string raw_file(const std::string& header, size_t data_bytes, int64_t len_override = -1) {
  uint64_t n = len_override >= 0 ? static_cast<uint64_t>(len_override) : header.size();
  std::string s(8, '\0');
  std::memcpy(s.data(), &n, 8);
  s += header;
  for (size_t i = 0; i < data_bytes; ++i) s.push_back(static_cast<char>(i * 37 + 1));
  return s;
}

// Runs f, which must throw moefold::Error naming `path` and containing `what`.
template <class F>
void expect_error(F&& f, const std::string& path, const std::string& what) {
  try {
    f();
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << "message does not name the file: " << msg;
    EXPECT_NE(msg.find(what), std::string::npos) << "message lacks '" << what << "': " << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << "message is not one line: " << msg;
    return;
  }
  ADD_FAILURE() << "no moefold::Error for " << path << " (expected '" << what << "')";
}

void expect_bad_file(const std::string& path, const std::string& bytes, const std::string& what) {
  write_bytes(path, bytes);
  expect_error([&] { SafetensorsReader r(path); }, path, what);
}

TEST(Safetensors, RoundTripF32WithMetadata) {
  TempDir dir;
  testing::Pool pool;
  Tensor a = pool.randn({3, 5}, DType::f32);
  Tensor b = pool.randn({7}, DType::f32);
  Tensor c = pool.randn({2, 2, 3}, DType::f64);
  std::string path = dir.file("model.safetensors");
  write_safetensors(path, {{"z.first", a, DType::f32}, {"a.second", b, DType::f32}, {"m.third", c, DType::f64}},
                    {{"format", "pt"}, {"step", "42"}});

  // The data starts 8-byte aligned.
  std::string bytes = read_bytes(path);
  uint64_t n;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ((8 + n) % 8, 0u);
  EXPECT_EQ(bytes.size(), 8 + n + a.nbytes() + b.nbytes() + c.nbytes());

  SafetensorsReader r(path);
  EXPECT_EQ(r.metadata().size(), 2u);
  EXPECT_EQ(r.metadata().at("format"), "pt");
  EXPECT_EQ(r.metadata().at("step"), "42");
  ASSERT_EQ(r.tensors().size(), 3u);
  // Header order and offsets follow the given order, not the names.
  EXPECT_EQ(r.tensors()[0].name, "z.first");
  EXPECT_EQ(r.tensors()[1].name, "a.second");
  EXPECT_EQ(r.tensors()[2].name, "m.third");
  EXPECT_LT(r.tensors()[0].data, r.tensors()[1].data);
  EXPECT_LT(r.tensors()[1].data, r.tensors()[2].data);
  EXPECT_EQ(r.tensor("z.first").dtype, DType::f32);
  EXPECT_EQ(r.tensor("z.first").shape, (std::vector<int64_t>{3, 5}));
  EXPECT_EQ(r.tensor("z.first").nbytes, a.nbytes());
  EXPECT_EQ(r.tensor("m.third").dtype, DType::f64);
  EXPECT_TRUE(r.contains("a.second"));
  EXPECT_FALSE(r.contains("nope"));

  Tensor a2 = pool.zeros({3, 5}, DType::f32), b2 = pool.zeros({7}, DType::f32), c2 = pool.zeros({2, 2, 3}, DType::f64);
  r.load_into("z.first", a2);
  r.load_into("a.second", b2);
  r.load_into("m.third", c2);
  EXPECT_EQ(std::memcmp(a.data(), a2.data(), a.nbytes()), 0);
  EXPECT_EQ(std::memcmp(b.data(), b2.data(), b.nbytes()), 0);
  EXPECT_EQ(std::memcmp(c.data(), c2.data(), c.nbytes()), 0);
  // F32 -> f64 widening on load is exact.
  Tensor a64 = pool.zeros({3, 5}, DType::f64);
  r.load_into("z.first", a64);
  for (int64_t i = 0; i < a.numel(); ++i) EXPECT_EQ(a64.ptr<double>()[i], static_cast<double>(a.ptr<float>()[i]));
}

TEST(Safetensors, RoundTripBf16) {
  TempDir dir;
  testing::Pool pool;
  Tensor w = pool.randn({4, 6}, DType::f32);
  Tensor v = pool.randn({5}, DType::f64);
  std::string path = dir.file("bf16.safetensors");
  write_safetensors(path, {{"w", w, DType::bf16}, {"v", v, DType::bf16}});
  SafetensorsReader r(path);
  EXPECT_TRUE(r.metadata().empty());
  EXPECT_EQ(r.tensor("w").dtype, DType::bf16);
  EXPECT_EQ(r.tensor("w").nbytes, 4u * 6u * 2u);
  Tensor w2 = pool.zeros({4, 6}, DType::f32);
  Tensor w64 = pool.zeros({4, 6}, DType::f64);
  r.load_into("w", w2);
  r.load_into("w", w64);
  for (int64_t i = 0; i < w.numel(); ++i) {
    float x = w.ptr<float>()[i];
    EXPECT_EQ(w2.ptr<float>()[i], bf16_to_f32(f32_to_bf16(x)));  // exactly the rounded value
    EXPECT_EQ(w64.ptr<double>()[i], static_cast<double>(w2.ptr<float>()[i]));
    // bf16 has 8 significant bits: relative error <= 2^-9 after round to nearest.
    EXPECT_LE(std::fabs(w2.ptr<float>()[i] - x), std::ldexp(std::fabs(x), -8));
  }
  Tensor v2 = pool.zeros({5}, DType::f64);
  r.load_into("v", v2);
  for (int64_t i = 0; i < 5; ++i)
    EXPECT_NEAR(v2.ptr<double>()[i], v.ptr<double>()[i], std::fabs(v.ptr<double>()[i]) / 128);
}

TEST(Safetensors, ReadsHandBuiltFile) {
  // Written byte by byte from the format description, so the reader is not only checked
  // against our writer. Offsets are relative to the start of the data.
  TempDir dir;
  std::string path = dir.file("hand.safetensors");
  std::string header = R"({"__metadata__":{"k":"v"},"b":{"dtype":"BF16","shape":[2],"data_offsets":[8,12]},)"
                       R"("a":{"dtype":"F32","shape":[1,2],"data_offsets":[0,8]}})";
  std::string s = raw_file(header, 0);
  float a[2] = {1.5f, -2.25f};
  uint16_t b[2] = {0x3f80, 0xc000};  // bf16 1.0, -2.0
  s.append(reinterpret_cast<const char*>(a), 8);
  s.append(reinterpret_cast<const char*>(b), 4);
  write_bytes(path, s);
  SafetensorsReader r(path);
  EXPECT_EQ(r.metadata().at("k"), "v");
  testing::Pool pool;
  Tensor ta = pool.zeros({1, 2}, DType::f32), tb = pool.zeros({2}, DType::f32);
  r.load_into("a", ta);
  r.load_into("b", tb);
  EXPECT_EQ(ta.ptr<float>()[0], 1.5f);
  EXPECT_EQ(ta.ptr<float>()[1], -2.25f);
  EXPECT_EQ(tb.ptr<float>()[0], 1.0f);
  EXPECT_EQ(tb.ptr<float>()[1], -2.0f);
}

TEST(Safetensors, MalformedFilesNameTheFile) {
  TempDir dir;
  const std::string p = dir.file("bad.safetensors");
  const std::string f32x2 = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";

  expect_bad_file(p, std::string(5, '\0'), "too short");
  expect_bad_file(p, raw_file(f32x2, 8, 4096), "bad header length 4096");
  expect_bad_file(p, raw_file(f32x2, 8, 0), "bad header length 0");
  expect_bad_file(p, raw_file(R"({"a":{"dtype":"F32",)", 8), "not valid JSON");
  expect_bad_file(p, raw_file(R"([1, 2, 3])", 0), "not a JSON object");
  expect_bad_file(p, raw_file(f32x2, 3), "truncated: header says 8 bytes of data, file has 3");
  expect_bad_file(p, raw_file(R"({"a":{"dtype":"F17","shape":[2],"data_offsets":[0,8]}})", 8),
                  "tensor 'a' has unknown dtype 'F17'");
  expect_bad_file(p, raw_file(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", 8), "tensor 'a'");
  expect_bad_file(p, raw_file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
                  "tensor 'a': shape [3] of F32 needs 12 bytes, data_offsets [0, 8] hold 8");
  expect_bad_file(p, raw_file(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8), "tensor 'a'");
  expect_bad_file(p, raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8),
                  "tensor 'a': 'data_offsets'");
  expect_bad_file(p, raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", 8), "tensor 'a'");
  expect_bad_file(p,
                  raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                           R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                           12),
                  "tensors 'a' and 'b' overlap");
  expect_bad_file(p,
                  raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                           R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                           12),
                  "hole");
  expect_bad_file(p, raw_file(f32x2, 12), "4 trailing bytes");
  expect_bad_file(p, raw_file(R"({"__metadata__":{"k":1}})", 0), "'__metadata__' key 'k'");
  expect_error([&] { SafetensorsReader r(dir.file("absent.safetensors")); }, dir.file("absent.safetensors"),
               "cannot open");
}

// Headers from elsewhere that the audit of the readers found (docs/faults.md, "Untrusted files"):
// JSON nested 100,000 deep overflowed the stack (nlohmann copies values recursively), and a shape
// whose partial products pass 2^63 before a 0 dimension was accepted, then multiplied in int64 by
// SafetensorsTensor::numel(). Both are now one line naming the file.
TEST(Safetensors, HostileHeadersNameTheFile) {
  TempDir dir;
  const std::string p = dir.file("hostile.safetensors");
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  expect_bad_file(p, raw_file(R"({"a":{"dtype":"F32","shape":)" + deep + R"(,"data_offsets":[0,0]}})", 0),
                  "JSON nested deeper than 64 levels");
  expect_bad_file(p, raw_file(R"({"a":{"dtype":"F32","shape":[4294967296,2147483649,0],"data_offsets":[0,0]}})", 0),
                  "tensor 'a': shape [4294967296, 2147483649, 0] of F32 needs an overflowing number of bytes");
  // Nesting up to the limit is fine (the error is then about the shape, not the depth).
  expect_bad_file(p, raw_file(R"({"a":{"dtype":"F32","shape":[[[1]]],"data_offsets":[0,4]}})", 4),
                  "'shape' must be an array of non-negative integers");
}

// A file name that a file gives (a checkpoint's index) may name a FIFO: opening it must fail at
// once, not wait for a writer.
TEST(MappedFile, FifoFailsAtOnce) {
  TempDir dir;
  const std::string p = dir.file("fifo");
  ASSERT_EQ(::mkfifo(p.c_str(), 0600), 0);
  expect_error([&] { MappedFile f(p); }, p, "not a regular file");
}

TEST(Safetensors, TruncatedWrittenFile) {
  TempDir dir;
  testing::Pool pool;
  std::string path = dir.file("x.safetensors");
  write_safetensors(path, {{"w", pool.randn({32, 32}, DType::f32), DType::f32}});
  uint64_t n;
  std::memcpy(&n, read_bytes(path).data(), 8);
  fs::resize_file(path, 8 + n + 100);
  expect_error([&] { SafetensorsReader r(path); }, path, "truncated: header says 4096 bytes of data, file has 100");
}

TEST(Safetensors, LoadErrors) {
  TempDir dir;
  testing::Pool pool;
  std::string path = dir.file("model.safetensors");
  write_safetensors(path, {{"lm_head.weight", pool.randn({10, 4}, DType::f32), DType::f32},
                           {"step", pool.ints({1}, 0, 100), DType::i32}});
  SafetensorsReader r(path);
  Tensor dst = pool.zeros({12, 4}, DType::f32);
  try {
    r.load_into("lm_head.weight", dst);
    ADD_FAILURE() << "no error on shape mismatch";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), path + ": tensor 'lm_head.weight' has shape [10, 4], expected [12, 4]");
  }
  expect_error([&] { r.load_into("missing.weight", dst); }, path, "no tensor 'missing.weight'");
  expect_error([&] { r.tensor("missing.weight"); }, path, "no tensor 'missing.weight'");
  expect_error([&] { r.load_into("step", pool.zeros({1}, DType::f32)); }, path, "is I32, cannot load into F32");
  // Same-dtype integer loads are plain copies.
  int32_t buf = -1;
  r.load_into("step", Tensor(&buf, DType::i32, {1}));
  EXPECT_GE(buf, 0);
  EXPECT_LT(buf, 100);
}

TEST(Safetensors, WriterRejectsBadEntries) {
  TempDir dir;
  testing::Pool pool;
  std::string path = dir.file("w.safetensors");
  Tensor t = pool.randn({2}, DType::f32);
  expect_error(
      [&] {
        write_safetensors(path, {{"a", t, DType::f32}, {"a", t, DType::f32}});
      },
      path, "tensor 'a' given twice");
  expect_error(
      [&] {
        write_safetensors(path, {{"i", pool.ints({2}, 0, 5), DType::bf16}});
      },
      path, "cannot store I32 as BF16");
  expect_error(
      [&] {
        write_safetensors(dir.file("no/such/dir/x.safetensors"), {{"a", t, DType::f32}});
      },
      dir.file("no/such/dir/x.safetensors"), "cannot create");
}

}  // namespace
}  // namespace moefold

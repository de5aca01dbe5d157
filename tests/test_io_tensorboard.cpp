// io: TensorBoard event files. The framing and both CRCs checked against a bitwise CRC-32C written
// here (not ISA-L's); corrupt and cut-short files; histograms; cutting a resumed run's events;
// and, where TensorBoard is installed (scripts/setup.sh puts it in build-venv/), the files read
// back by TensorBoard's own reader.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "moefold/io/tensorboard.h"
#include "testing.h"

namespace moefold {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::read_bytes;
using testing::TempDir;
using testing::write_bytes;

// CRC-32C bit by bit: reflected polynomial 0x82f63b78, initial and final inversion.
uint32_t reference_crc32c(const std::string& s) {
  uint32_t c = 0xffffffffu;
  for (unsigned char b : s) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82f63b78u & (0u - (c & 1u)));
  }
  return ~c;
}

uint32_t reference_masked(const std::string& s) {
  const uint32_t c = reference_crc32c(s);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

uint64_t le(const std::string& s, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(s[at + static_cast<size_t>(i)]);
  return v;
}

// A file of: the version, steps 1..steps with a scalar "loss" = 1/step, a histogram at even steps,
// a text at step 1.
std::string write_run(const std::string& dir, int64_t steps) {
  TensorBoardWriter w(dir);
  for (int64_t s = 1; s <= steps; ++s) {
    w.scalar("loss", 1.0 / static_cast<double>(s));
    if (s % 2 == 0) {
      const double v[5] = {1, 2, 2, 3, static_cast<double>(s)};
      w.histogram("tokens", make_histogram(v, 5, 3));
    }
    if (s == 1) w.text("config", "    [model]\n    hidden = 64\n");
    w.write_step(s);
  }
  w.write_step(steps + 1);  // nothing pending: no record
  return w.path();
}

TEST(TensorBoard, Crc32cMatchesKnownValues) {
  EXPECT_EQ(crc32c("123456789", 9), 0xe3069283u);  // the check value of CRC-32C
  const std::string zeros(32, '\0'), ones(32, '\xff');
  EXPECT_EQ(crc32c(zeros.data(), 32), 0x8a9136aau);  // RFC 3720's examples
  EXPECT_EQ(crc32c(ones.data(), 32), 0x62a8ab43u);
  std::string text;
  for (int i = 0; i < 100000; ++i) text.push_back(static_cast<char>(i * 131 + i / 7));
  EXPECT_EQ(crc32c(text.data(), text.size()), reference_crc32c(text));
  EXPECT_EQ(masked_crc32c(text.data(), text.size()), reference_masked(text));
  EXPECT_EQ(crc32c("", 0), 0u);
}

// Every record: u64 length, masked CRC of those 8 bytes, the bytes, masked CRC of them, and
// nothing after the last; each parses back to what was written.
TEST(TensorBoard, RecordsAreFramedAndEventsReadBack) {
  TempDir tmp("test_tb");
  const std::string path = write_run(tmp.file("tb"), 4);
  EXPECT_NE(fs::path(path).filename().string().find("events.out.tfevents."), std::string::npos);
  const std::string bytes = read_bytes(path);
  size_t at = 0, records = 0;
  while (at < bytes.size()) {
    ASSERT_GE(bytes.size() - at, 16u);
    const uint64_t n = le(bytes, at, 8);
    EXPECT_EQ(le(bytes, at + 8, 4), reference_masked(bytes.substr(at, 8))) << "record " << records;
    ASSERT_LE(at + 16 + n, bytes.size());
    EXPECT_EQ(le(bytes, at + 12 + n, 4), reference_masked(bytes.substr(at + 12, n))) << "record " << records;
    at += 16 + n;
    ++records;
  }
  EXPECT_EQ(at, bytes.size());
  EXPECT_EQ(records, 5u);  // the version and four steps
  const std::vector<TbEvent> events = read_tb_events(path);
  ASSERT_EQ(events.size(), 5u);
  EXPECT_EQ(events[0].file_version, "brain.Event:2");
  EXPECT_TRUE(events[0].values.empty());
  for (int64_t s = 1; s <= 4; ++s) {
    const TbEvent& e = events[static_cast<size_t>(s)];
    EXPECT_EQ(e.step, s);
    EXPECT_GT(e.wall_time, 1.7e9);
    ASSERT_EQ(e.values.size(), s == 1 ? 2u : s % 2 == 0 ? 2u : 1u);
    EXPECT_EQ(e.values[0].kind, TbValue::Kind::scalar);
    EXPECT_EQ(e.values[0].tag, "loss");
    EXPECT_EQ(e.values[0].scalar, static_cast<float>(1.0 / static_cast<double>(s)));
    if (s == 1) {
      EXPECT_EQ(e.values[1].kind, TbValue::Kind::text);
      EXPECT_EQ(e.values[1].text, "    [model]\n    hidden = 64\n");
    }
    if (s % 2 == 0) {
      EXPECT_EQ(e.values[1].kind, TbValue::Kind::histogram);
      EXPECT_EQ(e.values[1].histogram.max, static_cast<double>(std::max<int64_t>(s, 3)));
      EXPECT_EQ(e.values[1].histogram.num, 5);
    }
  }
}

// A flipped byte fails its CRC with the file named; a file cut inside its last record keeps the
// records before it.
TEST(TensorBoard, CorruptAndCutShortFiles) {
  TempDir tmp("test_tb");
  const std::string path = write_run(tmp.file("tb"), 3);
  const std::string good = read_bytes(path);
  const TbRecords all = read_tf_records(path);
  ASSERT_EQ(all.records.size(), 4u);
  std::string bad = good;
  bad[all.offsets[2] + 14] ^= 0x10;  // inside the second step's event
  write_bytes(path, bad);
  EXPECT_NE(error_of([&] {
              read_tf_records(path);
            }).find(path + ": the record at byte " + std::to_string(all.offsets[2]) + " fails its CRC-32C"),
            std::string::npos);
  bad = good;
  bad[all.offsets[1] + 3] ^= 0x01;  // a length
  write_bytes(path, bad);
  EXPECT_NE(error_of([&] { read_tf_records(path); }).find("the length of the record at byte"), std::string::npos);
  write_bytes(path, "not an event file at all");
  EXPECT_NE(error_of([&] { read_tf_records(path); }).find(path + ": the length of the record at byte 0"),
            std::string::npos);
  for (size_t cut : {all.offsets[3] + 5, all.offsets[3] + 13, good.size() - 1}) {
    write_bytes(path, good.substr(0, cut));
    const TbRecords r = read_tf_records(path);
    EXPECT_TRUE(r.truncated_tail) << cut;
    EXPECT_EQ(r.records.size(), 3u) << cut;
  }
  EXPECT_NE(error_of([&] { read_tf_records(tmp.file("missing")); }).find("missing: cannot open"), std::string::npos);
}

TEST(TensorBoard, HistogramBucketsCountEveryValue) {
  const double v[7] = {4, 0, 1, 2, 8, 8, 3};
  const TbHistogram h = make_histogram(v, 7, 4);
  EXPECT_EQ(h.min, 0);
  EXPECT_EQ(h.max, 8);
  EXPECT_EQ(h.num, 7);
  EXPECT_EQ(h.sum, 26);
  EXPECT_EQ(h.sum_squares, 16 + 0 + 1 + 4 + 64 + 64 + 9);
  EXPECT_EQ(h.bucket_limit, (std::vector<double>{2, 4, 6, 8}));
  EXPECT_EQ(h.bucket, (std::vector<double>{3, 2, 0, 2}));  // [0, 2], (2, 4], (4, 6], (6, 8]
  const double same[3] = {5, 5, 5};
  const TbHistogram one = make_histogram(same, 3, 4);
  EXPECT_EQ(one.bucket_limit, (std::vector<double>{5}));
  EXPECT_EQ(one.bucket, (std::vector<double>{3}));
}

// A resumed run: the steps after it are cut from every file (rewritten in place), the rest kept
// byte for byte; cut to step 0 a file is left with its version alone; a corrupt file is named and
// left as it is.
TEST(TensorBoard, ResumeCutsTheLaterSteps) {
  TempDir tmp("test_tb");
  const std::string dir = tmp.file("tb");
  const std::string first = write_run(dir, 6);
  const std::string before = read_bytes(first);
  const TbRecords r = read_tf_records(first);
  truncate_tb_events(dir, 6);  // nothing after step 6: untouched
  EXPECT_EQ(read_bytes(first), before);
  write_bytes(first, before + before.substr(r.offsets[1], 9));  // a record cut short by a crash
  truncate_tb_events(dir, 3);
  EXPECT_EQ(read_bytes(first), before.substr(0, r.offsets[4]));
  EXPECT_EQ(tb_event_files(dir), std::vector<std::string>{first});  // no temporary left behind
  truncate_tb_events(dir, 0);
  const std::vector<TbEvent> left = read_tb_events(first);
  ASSERT_EQ(left.size(), 1u);
  EXPECT_EQ(left[0].file_version, "brain.Event:2");
  EXPECT_TRUE(tb_event_files(tmp.file("missing")).empty());
  EXPECT_TRUE(truncate_tb_events(tmp.file("missing"), 0).empty());
  // A corrupt file is named and left alone; the others are still cut.
  const std::string second = write_run(dir, 4);
  const std::string corrupt = tmp.file("tb") + "/events.out.tfevents.0.corrupt";
  write_bytes(corrupt, "garbage, not records");
  const std::vector<std::string> problems = truncate_tb_events(dir, 2);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_NE(problems[0].find(corrupt + ": the length of the record at byte 0"), std::string::npos) << problems[0];
  EXPECT_EQ(read_bytes(corrupt), "garbage, not records");
  EXPECT_EQ(read_tb_events(second).back().step, 2);
}

// TensorBoard's own reader (EventAccumulator) sees every scalar, histogram and text.
TEST(TensorBoard, TensorBoardReadsTheFiles) {
  const std::string python = std::string(MOEFOLD_SOURCE_DIR) + "/build-venv/bin/python";
  if (!fs::exists(python) || std::system((python + " -c 'import tensorboard' 2>/dev/null").c_str()) != 0)
    GTEST_SKIP() << "TensorBoard is not installed in build-venv/ (scripts/setup.sh installs it)";
  TempDir tmp("test_tb");
  const std::string dir = tmp.file("tb");
  write_run(dir, 6);
  const std::string out = tmp.file("read.json");
  const std::string cmd =
      python + " " + MOEFOLD_SOURCE_DIR + "/tests/tools/read_tensorboard.py " + dir + " > " + out + " 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << read_bytes(out);
  const nlohmann::json j = nlohmann::json::parse(read_bytes(out));
  const nlohmann::json& loss = j["scalars"]["loss"];
  ASSERT_EQ(loss.size(), 6u) << j.dump();
  for (int64_t s = 1; s <= 6; ++s) {
    EXPECT_EQ(loss[static_cast<size_t>(s - 1)][0].get<int64_t>(), s);
    EXPECT_EQ(loss[static_cast<size_t>(s - 1)][1].get<double>(), static_cast<float>(1.0 / static_cast<double>(s)));
  }
  const nlohmann::json& h = j["histograms"]["tokens"];
  ASSERT_EQ(h.size(), 3u) << j.dump();
  EXPECT_EQ(h[2][0].get<int64_t>(), 6);
  EXPECT_EQ(h[2][1].get<double>(), 1);
  EXPECT_EQ(h[2][2].get<double>(), 6);
  EXPECT_EQ(h[2][3].get<double>(), 5);
  EXPECT_EQ(h[2][5], (nlohmann::json{3, 1, 1}));  // [1, 2.67], (2.67, 4.33], (4.33, 6]
  ASSERT_EQ(j["text"]["config"].size(), 1u) << j.dump();
  EXPECT_EQ(j["text"]["config"][0][1].get<std::string>(), "    [model]\n    hidden = 64\n");
}

}  // namespace
}  // namespace moefold

#include "moefold/io/tensorboard.h"

#include <isa-l/crc.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "moefold/core/error.h"
#include "moefold/io/tensorboard_event.pb.h"

namespace moefold {

namespace fs = std::filesystem;
namespace pb = moefold::tensorboard;

uint32_t crc32c(const void* data, size_t n) {
  // ISA-L's iSCSI CRC is CRC-32C without the final inversion; its length is an int.
  auto* p = static_cast<unsigned char*>(const_cast<void*>(data));
  unsigned int c = 0xffffffffu;
  while (n > 0) {
    const size_t chunk = std::min<size_t>(n, INT_MAX);
    c = crc32_iscsi(p, static_cast<int>(chunk), c);
    p += chunk;
    n -= chunk;
  }
  return ~c;
}

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

TbHistogram make_histogram(const double* values, size_t n, int buckets) {
  MF_CHECK(n > 0 && buckets >= 1);
  TbHistogram h;
  h.min = *std::min_element(values, values + n);
  h.max = *std::max_element(values, values + n);
  h.num = static_cast<double>(n);
  for (size_t i = 0; i < n; ++i) {
    h.sum += values[i];
    h.sum_squares += values[i] * values[i];
  }
  const int k = h.max > h.min ? buckets : 1;
  const double width = (h.max - h.min) / k;
  for (int b = 0; b < k; ++b) h.bucket_limit.push_back(b + 1 == k ? h.max : h.min + width * (b + 1));
  h.bucket.assign(static_cast<size_t>(k), 0.0);
  for (size_t i = 0; i < n; ++i) {
    // Bucket b holds (limit[b-1], limit[b]]; the minimum goes to the first.
    const auto it = std::lower_bound(h.bucket_limit.begin(), h.bucket_limit.end(), values[i]);
    h.bucket[static_cast<size_t>(std::min<ptrdiff_t>(it - h.bucket_limit.begin(), k - 1))] += 1;
  }
  return h;
}

struct TensorBoardWriter::Pending {
  pb::Summary summary;
};

TensorBoardWriter::TensorBoardWriter(const std::string& dir) : pending_(std::make_unique<Pending>()) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) MF_FAIL(dir, ": cannot create the TensorBoard directory: ", ec.message());
  char host[256] = "localhost";
  if (::gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "localhost");
  host[sizeof host - 1] = '\0';
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  const long long seconds = std::chrono::duration_cast<std::chrono::seconds>(now).count();
  for (int n = 0; !file_; ++n) {
    path_ = (fs::path(dir) / cat("events.out.tfevents.", seconds, ".", host, ".", ::getpid(), ".", n)).string();
    file_ = std::fopen(path_.c_str(), "wbx");  // x: never another file's name
    if (!file_ && errno != EEXIST) MF_FAIL(path_, ": cannot create: ", std::strerror(errno));
  }
  pb::Event e;
  e.set_wall_time(std::chrono::duration<double>(now).count());
  e.set_file_version("brain.Event:2");
  write_record(e.SerializeAsString());
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_) std::fclose(file_);
}

void TensorBoardWriter::scalar(const std::string& tag, double value) {
  pb::Summary::Value* v = pending_->summary.add_value();
  v->set_tag(tag);
  v->set_simple_value(static_cast<float>(value));
}

void TensorBoardWriter::histogram(const std::string& tag, const TbHistogram& h) {
  pb::Summary::Value* v = pending_->summary.add_value();
  v->set_tag(tag);
  pb::HistogramProto* p = v->mutable_histo();
  p->set_min(h.min);
  p->set_max(h.max);
  p->set_num(h.num);
  p->set_sum(h.sum);
  p->set_sum_squares(h.sum_squares);
  for (double x : h.bucket_limit) p->add_bucket_limit(x);
  for (double x : h.bucket) p->add_bucket(x);
}

void TensorBoardWriter::text(const std::string& tag, const std::string& markdown) {
  pb::Summary::Value* v = pending_->summary.add_value();
  v->set_tag(tag);
  v->mutable_metadata()->mutable_plugin_data()->set_plugin_name("text");
  pb::TensorProto* t = v->mutable_tensor();
  t->set_dtype(7);            // a string
  t->mutable_tensor_shape();  // a scalar: no dimensions
  t->add_string_val(markdown);
}

void TensorBoardWriter::write_step(int64_t step) {
  if (pending_->summary.value_size() == 0) return;
  pb::Event e;
  e.set_wall_time(std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
  e.set_step(step);
  e.mutable_summary()->Swap(&pending_->summary);
  pending_->summary.Clear();
  write_record(e.SerializeAsString());
}

namespace {

void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

std::string frame(const std::string& data) {
  std::string out;
  out.reserve(data.size() + 16);
  const uint64_t n = data.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  put_u32(out, masked_crc32c(out.data(), 8));
  out += data;
  put_u32(out, masked_crc32c(data.data(), data.size()));
  return out;
}

uint64_t get_le(const unsigned char* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

}  // namespace

void TensorBoardWriter::write_record(const std::string& data) {
  const std::string r = frame(data);
  if (std::fwrite(r.data(), 1, r.size(), file_) != r.size() || std::fflush(file_) != 0)
    MF_FAIL(path_, ": cannot write: ", std::strerror(errno));
}

TbRecords read_tf_records(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) MF_FAIL(path, ": cannot open");
  const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  TbRecords out;
  uint64_t at = 0;
  const uint64_t size = bytes.size();
  while (at < size) {
    if (size - at < 12) {
      out.truncated_tail = true;
      break;
    }
    const uint64_t n = get_le(p + at, 8);
    if (get_le(p + at + 8, 4) != masked_crc32c(p + at, 8))
      MF_FAIL(path, ": the length of the record at byte ", at, " fails its CRC-32C (not an event file, or corrupt)");
    if (n > size - at - 12 || size - at - 12 - n < 4) {
      out.truncated_tail = true;
      break;
    }
    if (get_le(p + at + 12 + n, 4) != masked_crc32c(p + at + 12, n))
      MF_FAIL(path, ": the record at byte ", at, " fails its CRC-32C (corrupt)");
    out.offsets.push_back(at);
    out.records.emplace_back(bytes.data() + at + 12, n);
    at += 16 + n;
  }
  return out;
}

TbEvent parse_tb_event(const std::string& record, const std::string& path) {
  pb::Event e;
  if (!e.ParseFromString(record)) MF_FAIL(path, ": a record is not a TensorBoard event");
  TbEvent out;
  out.wall_time = e.wall_time();
  out.step = e.step();
  out.file_version = e.file_version();
  for (const pb::Summary::Value& v : e.summary().value()) {
    TbValue t;
    t.tag = v.tag();
    if (v.has_simple_value()) {
      t.kind = TbValue::Kind::scalar;
      t.scalar = v.simple_value();
    } else if (v.has_histo()) {
      t.kind = TbValue::Kind::histogram;
      const pb::HistogramProto& h = v.histo();
      t.histogram = {h.min(), h.max(), h.num(), h.sum(), h.sum_squares(), {}, {}};
      t.histogram.bucket_limit.assign(h.bucket_limit().begin(), h.bucket_limit().end());
      t.histogram.bucket.assign(h.bucket().begin(), h.bucket().end());
    } else if (v.has_tensor() && v.metadata().plugin_data().plugin_name() == "text" &&
               v.tensor().string_val_size() == 1) {
      t.kind = TbValue::Kind::text;
      t.text = v.tensor().string_val(0);
    }
    out.values.push_back(std::move(t));
  }
  return out;
}

std::vector<TbEvent> read_tb_events(const std::string& path) {
  std::vector<TbEvent> out;
  for (const std::string& r : read_tf_records(path).records) out.push_back(parse_tb_event(r, path));
  return out;
}

std::vector<std::string> tb_event_files(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (const fs::directory_entry& d : fs::directory_iterator(dir, ec))
    if (d.is_regular_file() && d.path().filename().string().find("tfevents") != std::string::npos)
      out.push_back(d.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::string> truncate_tb_events(const std::string& dir, int64_t step) {
  std::vector<std::string> unread;
  for (const std::string& path : tb_event_files(dir)) {
    std::string kept;
    bool dropped = false;
    try {
      const TbRecords r = read_tf_records(path);
      dropped = r.truncated_tail;
      for (const std::string& rec : r.records) {
        const TbEvent e = parse_tb_event(rec, path);
        if (e.file_version.empty() && e.step > step) {
          dropped = true;
          continue;
        }
        kept += frame(rec);
      }
    } catch (const Error& e) {
      unread.push_back(cat(e.what(), "; left as it is"));
      continue;
    }
    if (!dropped) continue;
    const std::string tmp = (fs::path(dir) / ".cut.tmp").string();  // not named like an event file
    {
      std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
      f.write(kept.data(), static_cast<std::streamsize>(kept.size()));
      f.flush();
      if (!f) MF_FAIL(tmp, ": cannot write");
    }
    std::error_code ec;
    fs::rename(tmp, path, ec);
    if (ec) MF_FAIL(path, ": cannot replace: ", ec.message());
  }
  return unread;
}

}  // namespace moefold

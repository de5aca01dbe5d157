// TensorBoard event files: what `moefold train` writes to RUN_DIR/tensorboard/ and how they are
// read back (tests; cutting a resumed run's files). A file is a sequence of TFRecords, each
//   u64 length | u32 masked CRC-32C of the length | length bytes: an Event | u32 masked CRC-32C of them
// (little-endian). The Events are TensorBoard's protobuf messages (tensorboard_event.proto); the
// CRCs are ISA-L's. Problems are one moefold::Error line naming the file.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

namespace moefold {

// CRC-32C (Castagnoli), and the masked form TFRecords store: ((c >> 15) | (c << 17)) + 0xa282ead8.
uint32_t crc32c(const void* data, size_t n);
uint32_t masked_crc32c(const void* data, size_t n);

struct TbHistogram {
  double min = 0, max = 0, num = 0, sum = 0, sum_squares = 0;
  std::vector<double> bucket_limit;  // bucket i: values in (limit[i-1], limit[i]], the first from min
  std::vector<double> bucket;        // counts
};
// At most `buckets` equal-width buckets from the smallest to the largest of `values` (one bucket
// when they are all equal). REQUIRES: n > 0, buckets >= 1.
TbHistogram make_histogram(const double* values, size_t n, int buckets);

// One event file, written by one process. The values given between two write_step calls become
// one Event (one record) at that step, flushed to the file.
class TensorBoardWriter {
 public:
  // Creates `dir` and in it events.out.tfevents.<seconds>.<host>.<pid>.<n> (n: the first name not
  // taken), whose first record holds the file version.
  explicit TensorBoardWriter(const std::string& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  void scalar(const std::string& tag, double value);
  void histogram(const std::string& tag, const TbHistogram& h);
  void text(const std::string& tag, const std::string& markdown);  // TensorBoard's Text tab
  void write_step(int64_t step);                                   // nothing when no value is pending
  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& data);
  std::string path_;
  std::FILE* file_ = nullptr;
  struct Pending;
  std::unique_ptr<Pending> pending_;  // the values of the step being gathered
};

// The records of an event file, framing and both CRCs checked (a mismatch is an Error naming the
// file and the record's offset). A last record cut short (a crash while writing) ends the list and
// sets truncated_tail.
struct TbRecords {
  std::vector<std::string> records;
  std::vector<uint64_t> offsets;  // where each record starts
  bool truncated_tail = false;
};
TbRecords read_tf_records(const std::string& path);

struct TbValue {
  enum class Kind { scalar, histogram, text, other } kind = Kind::other;
  std::string tag;
  double scalar = 0;
  TbHistogram histogram;
  std::string text;
};
struct TbEvent {
  double wall_time = 0;
  int64_t step = 0;
  std::string file_version;  // set in a file's first event
  std::vector<TbValue> values;
};
// `record` parsed as an Event; not one is an Error naming `path`.
TbEvent parse_tb_event(const std::string& record, const std::string& path);
// Every event of a file, in order.
std::vector<TbEvent> read_tb_events(const std::string& path);

// The event files (names containing "tfevents") in `dir`, sorted by name; none when `dir` is missing.
std::vector<std::string> tb_event_files(const std::string& dir);
// A resumed run: in every event file of `dir`, the summaries of steps after `step` are dropped
// (and a cut-short last record); a file that changes is rewritten under a temporary name and
// renamed into place. A file that cannot be read (a CRC mismatch) is left as it is: one message
// naming it is returned for each such file (statistics are not worth refusing to train for).
std::vector<std::string> truncate_tb_events(const std::string& dir, int64_t step);

}  // namespace moefold

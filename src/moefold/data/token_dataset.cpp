#include "moefold/data/token_dataset.h"

#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <utility>

#include "moefold/core/error.h"

namespace moefold {

static_assert(std::endian::native == std::endian::little, "token files are little-endian");

namespace {

constexpr char kPlainMagic[8] = {'M', 'F', 'T', 'O', 'K', 'E', 'N', 'S'};
constexpr uint64_t kPlainHeader = 24;  // magic, u32 version, u32 bytes per token, u64 count
constexpr uint32_t kPlainVersion = 1;
constexpr char kIdxMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr uint64_t kIdxHeader = 34;  // magic 9, version 8, dtype 1, sequences 8, doc indices 8
constexpr uint64_t kIdxVersion = 1;

template <class T>
T read_as(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

const char* megatron_dtype_name(uint8_t code) {
  switch (code) {
    case 1:
      return "uint8";
    case 2:
      return "int8";
    case 3:
      return "int16";
    case 4:
      return "int32";
    case 5:
      return "int64";
    case 6:
      return "float64";
    case 7:
      return "float32";
    case 8:
      return "uint16";
    default:
      return "unknown";
  }
}

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && std::string_view(s).substr(s.size() - suffix.size()) == suffix;
}

std::FILE* create(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) MF_FAIL(path, ": cannot create: ", std::strerror(errno));
  return f;
}

void write_or_fail(std::FILE* f, const std::string& path, const void* p, size_t n) {
  if (n > 0 && std::fwrite(p, 1, n, f) != n) MF_FAIL(path, ": write failed: ", std::strerror(errno));
}

void close_or_fail(std::FILE* f, const std::string& path) {
  if (std::fclose(f) != 0) MF_FAIL(path, ": close failed: ", std::strerror(errno));
}

template <class T>
void append(std::vector<uint8_t>* out, T v) {
  const auto* p = reinterpret_cast<const uint8_t*>(&v);
  out->insert(out->end(), p, p + sizeof(T));
}

}  // namespace

// Calls f.template operator()<T>() with the C++ type stored for `e`.
#define MF_DISPATCH_ELEM(e, f)           \
  switch (e) {                           \
    case Elem::u8:                       \
      f.template operator()<uint8_t>();  \
      break;                             \
    case Elem::i8:                       \
      f.template operator()<int8_t>();   \
      break;                             \
    case Elem::u16:                      \
      f.template operator()<uint16_t>(); \
      break;                             \
    case Elem::i16:                      \
      f.template operator()<int16_t>();  \
      break;                             \
    case Elem::u32:                      \
      f.template operator()<uint32_t>(); \
      break;                             \
    case Elem::i32:                      \
      f.template operator()<int32_t>();  \
      break;                             \
    case Elem::i64:                      \
      f.template operator()<int64_t>();  \
      break;                             \
  }

TokenDataset TokenDataset::open_plain(const std::string& path) {
  TokenDataset ds;
  ds.path_ = path;
  ds.bin_ = MappedFile(path);
  const uint8_t* p = ds.bin_.data();
  const uint64_t size = ds.bin_.size();
  if (size < kPlainHeader) MF_FAIL(path, ": truncated: ", size, " bytes, the header alone is ", kPlainHeader);
  if (std::memcmp(p, kPlainMagic, 8) != 0) MF_FAIL(path, ": bad magic (not an MFTOKENS file)");
  uint32_t version = read_as<uint32_t>(p + 8);
  if (version != kPlainVersion) MF_FAIL(path, ": unsupported version ", version, ", expected ", kPlainVersion);
  uint32_t bpt = read_as<uint32_t>(p + 12);
  if (bpt != 2 && bpt != 4) MF_FAIL(path, ": bad bytes per token ", bpt, ", expected 2 or 4");
  uint64_t count = read_as<uint64_t>(p + 16);
  const uint64_t have = size - kPlainHeader;
  if (count > have / bpt)
    MF_FAIL(path, ": truncated: header says ", count, " tokens (", count, " x ", bpt, " bytes), file has ", have,
            " bytes of tokens");
  if (count * bpt != have) MF_FAIL(path, ": ", have - count * bpt, " trailing bytes after ", count, " tokens");
  ds.tokens_ = p + kPlainHeader;
  ds.elem_ = bpt == 2 ? Elem::u16 : Elem::u32;
  ds.elem_size_ = static_cast<int>(bpt);
  ds.num_tokens_ = static_cast<int64_t>(count);
  return ds;
}

TokenDataset TokenDataset::open_megatron(const std::string& prefix) {
  TokenDataset ds;
  ds.path_ = prefix;
  const std::string ip = prefix + ".idx", bp = prefix + ".bin";
  ds.idx_ = MappedFile(ip);
  ds.bin_ = MappedFile(bp);
  const uint8_t* p = ds.idx_.data();
  const uint64_t size = ds.idx_.size();
  if (size < kIdxHeader) MF_FAIL(ip, ": truncated: ", size, " bytes, the header alone is ", kIdxHeader);
  if (std::memcmp(p, kIdxMagic, 9) != 0) MF_FAIL(ip, ": bad magic (not a Megatron MMIDIDX index)");
  uint64_t version = read_as<uint64_t>(p + 9);
  if (version != kIdxVersion) MF_FAIL(ip, ": unsupported version ", version, ", expected ", kIdxVersion);
  uint8_t code = p[17];
  switch (code) {
    case 1:
      ds.elem_ = Elem::u8;
      break;
    case 2:
      ds.elem_ = Elem::i8;
      break;
    case 3:
      ds.elem_ = Elem::i16;
      break;
    case 4:
      ds.elem_ = Elem::i32;
      break;
    case 5:
      ds.elem_ = Elem::i64;
      break;
    case 8:
      ds.elem_ = Elem::u16;
      break;
    case 6:
    case 7:
      MF_FAIL(ip, ": dtype ", megatron_dtype_name(code), " (code ", int(code), ") cannot hold token ids");
    default:
      MF_FAIL(ip, ": unknown dtype code ", int(code), " (Megatron knows 1-8)");
  }
  constexpr int kSizes[] = {0, 1, 1, 2, 4, 8, 8, 4, 2};
  const uint64_t elem = kSizes[code];
  ds.elem_size_ = static_cast<int>(elem);
  const uint64_t num_seq = read_as<uint64_t>(p + 18);
  const uint64_t num_doc_idx = read_as<uint64_t>(p + 26);
  // Bounded by the file size first so that the sums below cannot overflow.
  const uint64_t want = kIdxHeader + 12 * std::min(num_seq, size) + 8 * std::min(num_doc_idx, size);
  const bool multimodal = num_seq <= size && want + num_seq == size;  // trailing i8 mode per sequence
  if (num_seq > size || num_doc_idx > size || (size != want && !multimodal))
    MF_FAIL(ip, ": index says ", num_seq, " sequences and ", num_doc_idx, " document indices (", want,
            " bytes), file has ", size, " bytes");

  const uint8_t* sizes = p + kIdxHeader;
  const uint8_t* pointers = sizes + 4 * num_seq;
  const uint8_t* doc_idx = pointers + 8 * num_seq;
  const uint64_t bin_size = ds.bin_.size();
  // The flat view needs the sequences back to back from byte 0, which is what Megatron's
  // writer produces (pointers are the running sum of sizes x dtype size).
  uint64_t pos = 0;
  for (uint64_t i = 0; i < num_seq; ++i) {
    int32_t len = read_as<int32_t>(sizes + 4 * i);
    int64_t ptr = read_as<int64_t>(pointers + 8 * i);
    if (len < 0) MF_FAIL(ip, ": sequence ", i, " has negative size ", len);
    if (ptr < 0 || static_cast<uint64_t>(ptr) != pos)
      MF_FAIL(ip, ": sequence ", i, " starts at byte ", ptr, " of the .bin, expected ", pos,
              " (sequences must be back to back)");
    pos += static_cast<uint64_t>(len) * elem;
    if (pos > bin_size)
      MF_FAIL(bp, ": truncated: sequence ", i, " of the index ends at byte ", pos, ", file has ", bin_size);
  }
  if (pos != bin_size) MF_FAIL(bp, ": file has ", bin_size, " bytes, the index describes ", pos);
  if (num_doc_idx == 0) MF_FAIL(ip, ": no document indices (expected documents + 1 entries)");
  int64_t prev = 0;
  for (uint64_t d = 0; d < num_doc_idx; ++d) {
    int64_t v = read_as<int64_t>(doc_idx + 8 * d);
    if ((d == 0 && v != 0) || v < prev || static_cast<uint64_t>(v) > num_seq)
      MF_FAIL(ip, ": document index ", d, " = ", v, " (must start at 0, not decrease, and stay <= ", num_seq,
              " sequences)");
    prev = v;
  }
  if (static_cast<uint64_t>(prev) != num_seq)
    MF_FAIL(ip, ": last document index is ", prev, ", expected the sequence count ", num_seq);
  ds.tokens_ = ds.bin_.data();
  ds.num_tokens_ = static_cast<int64_t>(pos / elem);
  ds.num_documents_ = static_cast<int64_t>(num_doc_idx) - 1;
  return ds;
}

int64_t TokenDataset::raw(int64_t i) const {
  int64_t v = 0;
  auto f = [&]<class T>() { v = static_cast<int64_t>(read_as<T>(tokens_ + i * sizeof(T))); };
  MF_DISPATCH_ELEM(elem_, f);
  return v;
}

uint32_t TokenDataset::token(int64_t i) const {
  MF_CHECK(i >= 0 && i < num_tokens_, "token ", i, " of ", num_tokens_);
  return static_cast<uint32_t>(raw(i));
}

void TokenDataset::copy_tokens(int64_t begin, int64_t count, int32_t* out) const {
  MF_CHECK(begin >= 0 && count >= 0 && begin + count <= num_tokens_, "tokens [", begin, ", ", begin + count, ") of ",
           num_tokens_);
  auto f = [&]<class T>() {
    const uint8_t* src = tokens_ + begin * static_cast<int64_t>(sizeof(T));
    for (int64_t k = 0; k < count; ++k) out[k] = static_cast<int32_t>(read_as<T>(src + k * sizeof(T)));
  };
  MF_DISPATCH_ELEM(elem_, f);
}

int64_t TokenDataset::max_token() const {
  int64_t m = -1;
  auto f = [&]<class T>() {
    for (int64_t i = 0; i < num_tokens_; ++i) m = std::max<int64_t>(m, read_as<T>(tokens_ + i * sizeof(T)));
  };
  MF_DISPATCH_ELEM(elem_, f);
  return m;
}

void TokenDataset::check_vocab(int64_t vocab_size) const {
  int64_t bad = -1;
  auto f = [&]<class T>() {
    for (int64_t i = 0; i < num_tokens_; ++i) {
      int64_t v = static_cast<int64_t>(read_as<T>(tokens_ + i * sizeof(T)));
      if (v < 0 || v >= vocab_size) {
        bad = i;
        return;
      }
    }
  };
  MF_DISPATCH_ELEM(elem_, f);
  if (bad >= 0)
    MF_FAIL(bin_.path(), ": token id ", raw(bad), " at index ", bad, " is outside the vocabulary [0, ", vocab_size,
            ")");
}

TokenDataset open_token_dataset(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (ends_with(path, ".tokens")) {
    if (!fs::exists(path, ec)) MF_FAIL("data.path = '", path, "': no such file");
    return TokenDataset::open_plain(path);
  }
  if (fs::exists(path + ".idx", ec)) return TokenDataset::open_megatron(path);
  if (ends_with(path, ".idx") || ends_with(path, ".bin"))
    return TokenDataset::open_megatron(path.substr(0, path.size() - 4));
  if (fs::exists(path, ec)) {
    // A plain file under another name is still recognised by its magic.
    MappedFile f(path);
    if (f.size() >= 8 && std::memcmp(f.data(), kPlainMagic, 8) == 0) return TokenDataset::open_plain(path);
    MF_FAIL("data.path = '", path, "': not a token dataset (expected a .tokens file or a Megatron prefix with ", path,
            ".idx/.bin)");
  }
  MF_FAIL("data.path = '", path, "': no such file, nor '", path, ".idx'/'", path, ".bin'");
}

// ---- writers ----

TokenWriter TokenWriter::plain(const std::string& path, int bytes_per_token) {
  MF_CHECK(bytes_per_token == 2 || bytes_per_token == 4, "bytes per token ", bytes_per_token);
  TokenWriter w;
  w.path_ = path;
  w.elem_size_ = bytes_per_token;
  w.f_ = create(path);
  uint8_t header[kPlainHeader] = {};
  std::memcpy(header, kPlainMagic, 8);
  std::memcpy(header + 8, &kPlainVersion, 4);
  uint32_t bpt = static_cast<uint32_t>(bytes_per_token);
  std::memcpy(header + 12, &bpt, 4);  // the count (bytes 16..24) is written by finish()
  w.write(header, sizeof header);
  return w;
}

TokenWriter TokenWriter::megatron(const std::string& prefix, MegatronDType dtype) {
  MF_CHECK(dtype != MegatronDType::float32 && dtype != MegatronDType::float64, "float token dtype");
  constexpr int kSizes[] = {0, 1, 1, 2, 4, 8, 8, 4, 2};
  TokenWriter w;
  w.path_ = prefix + ".bin";
  w.idx_path_ = prefix + ".idx";
  w.dtype_ = dtype;
  w.elem_size_ = kSizes[static_cast<int>(dtype)];
  w.f_ = create(w.path_);
  return w;
}

TokenWriter::TokenWriter(TokenWriter&& o) noexcept
    : path_(std::move(o.path_)),
      idx_path_(std::move(o.idx_path_)),
      f_(std::exchange(o.f_, nullptr)),
      dtype_(o.dtype_),
      elem_size_(o.elem_size_),
      num_tokens_(o.num_tokens_),
      sizes_(std::move(o.sizes_)),
      buf_(std::move(o.buf_)) {}

TokenWriter::~TokenWriter() {
  if (f_) {  // never finished: do not leave a file that looks valid
    std::fclose(f_);
    std::remove(path_.c_str());
  }
}

void TokenWriter::write(const void* p, size_t n) { write_or_fail(f_, path_, p, n); }

void TokenWriter::add_document(std::span<const uint32_t> tokens) {
  MF_CHECK(f_ != nullptr, "add_document after finish");
  const bool is_megatron = !idx_path_.empty();
  uint64_t max = 0;
  const char* type = "";
  if (!is_megatron) {
    max = elem_size_ == 2 ? 0xffffu : 0xffffffffu;
    type = elem_size_ == 2 ? "2-byte tokens" : "4-byte tokens";
  } else {
    type = megatron_dtype_name(static_cast<uint8_t>(dtype_));
    switch (dtype_) {
      case MegatronDType::uint8:
        max = 0xff;
        break;
      case MegatronDType::int8:
        max = 0x7f;
        break;
      case MegatronDType::int16:
        max = 0x7fff;
        break;
      case MegatronDType::uint16:
        max = 0xffff;
        break;
      case MegatronDType::int32:
        max = 0x7fffffff;
        break;
      default:
        max = 0xffffffffu;
        break;
    }
    if (tokens.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max()))
      MF_FAIL(path_, ": document ", sizes_.size(), " has ", tokens.size(), " tokens, more than an int32 size holds");
  }
  buf_.resize(tokens.size() * static_cast<size_t>(elem_size_));
  for (size_t k = 0; k < tokens.size(); ++k) {
    uint32_t t = tokens[k];
    if (t > max) MF_FAIL(path_, ": token ", t, " (document ", sizes_.size(), ", position ", k, ") does not fit ", type);
    uint64_t v = t;  // little-endian: the low bytes are the value for every width up to 8
    std::memcpy(buf_.data() + k * static_cast<size_t>(elem_size_), &v, static_cast<size_t>(elem_size_));
  }
  write(buf_.data(), buf_.size());
  if (is_megatron) {
    sizes_.push_back(static_cast<int32_t>(tokens.size()));
  } else {
    sizes_.push_back(0);  // only the count matters for plain files
  }
  num_tokens_ += static_cast<int64_t>(tokens.size());
}

void TokenWriter::finish() {
  MF_CHECK(f_ != nullptr, "finish twice");
  if (idx_path_.empty()) {
    uint64_t count = static_cast<uint64_t>(num_tokens_);
    if (std::fseek(f_, 16, SEEK_SET) != 0) MF_FAIL(path_, ": seek failed: ", std::strerror(errno));
    write(&count, sizeof count);
    std::FILE* f = std::exchange(f_, nullptr);
    close_or_fail(f, path_);
    return;
  }
  std::FILE* bin = std::exchange(f_, nullptr);
  close_or_fail(bin, path_);
  std::vector<uint8_t> idx;
  idx.insert(idx.end(), kIdxMagic, kIdxMagic + 9);
  append<uint64_t>(&idx, kIdxVersion);
  append<uint8_t>(&idx, static_cast<uint8_t>(dtype_));
  append<uint64_t>(&idx, sizes_.size());
  append<uint64_t>(&idx, sizes_.size() + 1);
  for (int32_t s : sizes_) append<int32_t>(&idx, s);
  int64_t ptr = 0;
  for (int32_t s : sizes_) {
    append<int64_t>(&idx, ptr);
    ptr += static_cast<int64_t>(s) * elem_size_;
  }
  for (size_t d = 0; d <= sizes_.size(); ++d) append<int64_t>(&idx, static_cast<int64_t>(d));
  std::FILE* f = create(idx_path_);
  try {
    write_or_fail(f, idx_path_, idx.data(), idx.size());
  } catch (...) {
    std::fclose(f);
    std::remove(idx_path_.c_str());
    throw;
  }
  close_or_fail(f, idx_path_);
}

void write_token_file(const std::string& path, std::span<const uint32_t> tokens, int bytes_per_token) {
  TokenWriter w = TokenWriter::plain(path, bytes_per_token);
  w.add_document(tokens);
  w.finish();
}

void write_megatron_dataset(const std::string& prefix, const std::vector<std::vector<uint32_t>>& documents,
                            MegatronDType dtype) {
  TokenWriter w = TokenWriter::megatron(prefix, dtype);
  for (const auto& d : documents) w.add_document(d);
  w.finish();
}

}  // namespace moefold
#undef MF_DISPATCH_ELEM

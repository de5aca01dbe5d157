// data: token datasets (Megatron .bin/.idx and plain .tokens) round trips, a hand-built
// Megatron file, malformed files, the byte tokenizer, prepare, and the resumable loader.
#include <unistd.h>
#include <zlib.h>
#include <zstd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <new>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>

#include "moefold/core/rng.h"
#include "moefold/data/bpe_tokenizer.h"
#include "moefold/data/byte_tokenizer.h"
#include "moefold/data/line_reader.h"
#include "moefold/data/loader.h"
#include "moefold/data/npy.h"
#include "moefold/data/prepare.h"
#include "moefold/data/token_dataset.h"
#include "testing.h"

// Counts heap allocations while g_count_allocs is set (the loader's no-allocation promise).
namespace {
std::atomic<bool> g_count_allocs{false};
std::atomic<int64_t> g_allocs{0};
}  // namespace
// noinline: inlined into callers, GCC would flag the free() of a `new` pointer.
[[gnu::noinline]] void* operator new(size_t n) {
  if (g_count_allocs) ++g_allocs;
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
[[gnu::noinline]] void operator delete(void* p) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete(void* p, size_t) noexcept { std::free(p); }

namespace moefold {
namespace {

namespace fs = std::filesystem;
using testing::read_bytes;
using testing::TempDir;
using testing::write_bytes;

template <class T>
void put(std::string* s, T v) {
  s->append(reinterpret_cast<const char*>(&v), sizeof(T));
}

template <class F>
void expect_error(F&& f, const std::string& name, const std::string& what) {
  try {
    f();
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(name), std::string::npos) << "message does not name '" << name << "': " << msg;
    EXPECT_NE(msg.find(what), std::string::npos) << "message lacks '" << what << "': " << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << "message is not one line: " << msg;
    return;
  }
  ADD_FAILURE() << "no moefold::Error (expected '" << what << "' naming " << name << ")";
}

std::vector<uint32_t> all_tokens(const TokenDataset& ds) {
  std::vector<uint32_t> v;
  for (int64_t i = 0; i < ds.num_tokens(); ++i) v.push_back(ds.token(i));
  return v;
}

std::vector<std::vector<uint32_t>> random_documents(uint64_t seed, uint32_t max_token) {
  std::vector<std::vector<uint32_t>> docs(5);
  docs[2] = {};  // an empty document is legal
  for (size_t d = 0; d < docs.size(); ++d) {
    if (d == 2) continue;
    int64_t len = 1 + static_cast<int64_t>(rng_below(seed, d, 1000, 50));
    for (int64_t i = 0; i < len; ++i) docs[d].push_back(static_cast<uint32_t>(rng_below(seed, d, i, max_token + 1)));
  }
  docs[0].push_back(max_token);  // the extreme value must survive
  return docs;
}

// ---- Megatron ----

TEST(Megatron, RoundTripUint16AndInt32) {
  TempDir dir;
  for (MegatronDType dt : {MegatronDType::uint16, MegatronDType::int32, MegatronDType::uint8, MegatronDType::int64}) {
    uint32_t max_token = dt == MegatronDType::uint16 ? 65535 : dt == MegatronDType::uint8 ? 255 : 2000000000;
    auto docs = random_documents(testing::fresh_seed(), max_token);
    std::string prefix = dir.file("ds" + std::to_string(int(dt)));
    write_megatron_dataset(prefix, docs, dt);
    std::vector<uint32_t> flat;
    for (const auto& d : docs) flat.insert(flat.end(), d.begin(), d.end());

    TokenDataset ds = TokenDataset::open_megatron(prefix);
    EXPECT_EQ(ds.path(), prefix);
    EXPECT_EQ(ds.num_documents(), 5);
    EXPECT_EQ(ds.num_tokens(), static_cast<int64_t>(flat.size()));
    EXPECT_EQ(all_tokens(ds), flat);
    EXPECT_EQ(ds.max_token(), max_token);
    std::vector<int32_t> copy(flat.size());
    ds.copy_tokens(0, ds.num_tokens(), copy.data());
    for (size_t i = 0; i < flat.size(); ++i) ASSERT_EQ(static_cast<uint32_t>(copy[i]), flat[i]);
    // The .bin is exactly the tokens at the dtype's width.
    EXPECT_EQ(fs::file_size(prefix + ".bin"), flat.size() * (dt == MegatronDType::uint16  ? 2
                                                             : dt == MegatronDType::uint8 ? 1
                                                             : dt == MegatronDType::int32 ? 4
                                                                                          : 8));
    // open_token_dataset resolves the prefix, PREFIX.idx and PREFIX.bin alike.
    for (const std::string& p : {prefix, prefix + ".idx", prefix + ".bin"})
      EXPECT_EQ(all_tokens(open_token_dataset(p)), flat) << p;
  }
}

// The .idx written byte by byte from Megatron's _IndexWriter description (not by our writer):
// 3 sequences of int32 tokens in 2 documents (document 0 = sequences 0-1, document 1 = 2).
std::string hand_built_idx(uint8_t code, uint64_t num_seq, const std::vector<int32_t>& sizes,
                           const std::vector<int64_t>& pointers, const std::vector<int64_t>& doc_idx) {
  std::string s("MMIDIDX\0\0", 9);
  put<uint64_t>(&s, 1);
  put<uint8_t>(&s, code);
  put<uint64_t>(&s, num_seq);
  put<uint64_t>(&s, doc_idx.size());
  for (int32_t v : sizes) put(&s, v);
  for (int64_t v : pointers) put(&s, v);
  for (int64_t v : doc_idx) put(&s, v);
  return s;
}

TEST(Megatron, ReadsHandBuiltFile) {
  TempDir dir;
  std::string prefix = dir.file("hand");
  std::string idx = hand_built_idx(4, 3, {2, 0, 3}, {0, 8, 8}, {0, 2, 3});
  ASSERT_EQ(idx.size(), 34u + 3 * 4 + 3 * 8 + 3 * 8);
  write_bytes(prefix + ".idx", idx);
  std::string bin;
  for (int32_t t : {7, 1000000, 0, 65536, 42}) put(&bin, t);
  write_bytes(prefix + ".bin", bin);
  TokenDataset ds = open_token_dataset(prefix);
  EXPECT_EQ(ds.num_tokens(), 5);
  EXPECT_EQ(ds.num_documents(), 2);
  EXPECT_EQ(all_tokens(ds), (std::vector<uint32_t>{7, 1000000, 0, 65536, 42}));

  // Multimodal indexes carry one int8 mode per sequence after doc_idx; accepted.
  std::string mm = idx + std::string(3, '\0');
  write_bytes(prefix + ".idx", mm);
  EXPECT_EQ(open_token_dataset(prefix).num_tokens(), 5);

  // Our writer produces these very bytes for the same documents split one sequence each.
  std::string ours = dir.file("ours");
  write_megatron_dataset(ours, {{7, 1000000}, {0, 65536, 42}}, MegatronDType::int32);
  EXPECT_EQ(read_bytes(ours + ".bin"), bin);
  EXPECT_EQ(read_bytes(ours + ".idx"), hand_built_idx(4, 2, {2, 3}, {0, 8}, {0, 1, 2}));
}

TEST(Megatron, CorruptFilesNameTheFile) {
  TempDir dir;
  std::string prefix = dir.file("bad");
  std::string idx_path = prefix + ".idx", bin_path = prefix + ".bin";
  std::string good = hand_built_idx(4, 2, {2, 3}, {0, 8}, {0, 1, 2});
  std::string bin(20, '\0');
  auto check = [&](const std::string& idx, const std::string& b, const std::string& name, const std::string& what) {
    write_bytes(idx_path, idx);
    write_bytes(bin_path, b);
    expect_error([&] { TokenDataset::open_megatron(prefix); }, name, what);
  };
  write_bytes(idx_path, good);
  write_bytes(bin_path, bin);
  EXPECT_EQ(TokenDataset::open_megatron(prefix).num_tokens(), 5);

  std::string x = good;
  x[0] = 'X';
  check(x, bin, idx_path, "bad magic");
  x = good;
  x[9] = 2;
  check(x, bin, idx_path, "unsupported version 2");
  x = good;
  x[17] = 7;
  check(x, bin, idx_path, "float32");
  x = good;
  x[17] = 9;
  check(x, bin, idx_path, "unknown dtype code 9");
  check(good.substr(0, 20), bin, idx_path, "truncated");
  check(good.substr(0, good.size() - 1), bin, idx_path, "index says 2 sequences and 3 document indices");
  check(good + "xxx", bin, idx_path, "file has");  // (2 extra bytes would be multimodal modes)
  check(good, bin.substr(0, 19), bin_path, "truncated: sequence 1");
  check(good, bin + "zzzz", bin_path, "file has 24 bytes, the index describes 20");
  check(hand_built_idx(4, 2, {2, 3}, {0, 12}, {0, 1, 2}), bin, idx_path, "sequence 1 starts at byte 12");
  check(hand_built_idx(4, 2, {-2, 3}, {0, 8}, {0, 1, 2}), bin, idx_path, "negative size");
  check(hand_built_idx(4, 2, {2, 3}, {0, 8}, {1, 1, 2}), bin, idx_path, "document index 0");
  check(hand_built_idx(4, 2, {2, 3}, {0, 8}, {0, 2, 1}), bin, idx_path, "document index 2");
  check(hand_built_idx(4, 2, {2, 3}, {0, 8}, {0, 1}), bin, idx_path, "last document index is 1");
  fs::remove(bin_path);
  write_bytes(idx_path, good);
  expect_error([&] { open_token_dataset(prefix); }, bin_path, "cannot open");
}

TEST(Megatron, WriterRejectsTokensThatDoNotFit) {
  TempDir dir;
  std::string prefix = dir.file("w");
  expect_error(
      [&] {
        write_megatron_dataset(prefix, {{1, 2}, {3, 65536}}, MegatronDType::uint16);
      },
      prefix + ".bin", "token 65536 (document 1, position 1) does not fit uint16");
  EXPECT_FALSE(fs::exists(prefix + ".bin"));  // the unfinished file is removed
  EXPECT_FALSE(fs::exists(prefix + ".idx"));
}

// ---- plain .tokens ----

TEST(PlainTokens, RoundTrip) {
  TempDir dir;
  for (int bpt : {2, 4}) {
    std::string path = dir.file(cat("t", bpt, ".tokens"));  // (GCC 12 -O3 -Wrestrict false positive on string +)
    auto docs = random_documents(testing::fresh_seed(), bpt == 2 ? 65535 : 4000000000u);
    TokenWriter w = TokenWriter::plain(path, bpt);
    std::vector<uint32_t> flat;
    for (const auto& d : docs) {
      w.add_document(d);
      flat.insert(flat.end(), d.begin(), d.end());
    }
    w.finish();
    EXPECT_EQ(fs::file_size(path), 24 + flat.size() * bpt);
    TokenDataset ds = open_token_dataset(path);
    EXPECT_EQ(ds.num_tokens(), static_cast<int64_t>(flat.size()));
    EXPECT_EQ(ds.num_documents(), -1);
    EXPECT_EQ(all_tokens(ds), flat);
  }
}

TEST(PlainTokens, ReadsHandBuiltFile) {
  TempDir dir;
  std::string path = dir.file("hand.tokens");
  std::string s = "MFTOKENS";
  put<uint32_t>(&s, 1);
  put<uint32_t>(&s, 2);
  put<uint64_t>(&s, 3);
  for (uint16_t t : {5, 256, 65535}) put(&s, t);
  write_bytes(path, s);
  EXPECT_EQ(all_tokens(open_token_dataset(path)), (std::vector<uint32_t>{5, 256, 65535}));
  // Our writer produces the same bytes.
  std::string ours = dir.file("ours.tokens");
  write_token_file(ours, std::vector<uint32_t>{5, 256, 65535}, 2);
  EXPECT_EQ(read_bytes(ours), s);
  // Recognised by its magic under another name too.
  std::string other = dir.file("tokens.dat");
  write_bytes(other, s);
  EXPECT_EQ(open_token_dataset(other).num_tokens(), 3);
}

TEST(PlainTokens, CorruptFilesNameTheFile) {
  TempDir dir;
  std::string path = dir.file("c.tokens");
  write_token_file(path, std::vector<uint32_t>{1, 2, 3, 4}, 4);
  const std::string good = read_bytes(path);
  auto check = [&](const std::string& bytes, const std::string& what) {
    write_bytes(path, bytes);
    expect_error([&] { open_token_dataset(path); }, path, what);
  };
  check(good.substr(0, good.size() - 3), "truncated: header says 4 tokens");
  check(good.substr(0, 10), "truncated");
  check(good + "x", "1 trailing bytes");
  std::string x = good;
  x[1] = 'X';
  check(x, "bad magic");
  x = good;
  x[8] = 7;
  check(x, "unsupported version 7");
  x = good;
  x[12] = 3;
  check(x, "bad bytes per token 3");
  std::string missing = dir.file("missing.tokens");
  expect_error([&] { open_token_dataset(missing); }, missing, "no such file");
  std::string nothing = dir.file("nothing");
  expect_error([&] { open_token_dataset(nothing); }, "data.path = '" + nothing + "': no such file, nor", ".idx");
  std::string text = dir.file("notes.txt");
  write_bytes(text, "hello");
  expect_error([&] { open_token_dataset(text); }, text, "not a token dataset");
}

// .npy shapes from elsewhere (issue 22's fuzzing found the unchecked product): a shape whose
// element count overflows, or a dimension too long to be a number, is one line naming the file;
// an empty array reads as empty.
// A version 1.0 .npy file by hand (a header of at most 64 kB).
std::string npy(const std::string& descr, const std::string& shape, const std::string& data) {
  std::string header = "{'descr': '" + descr + "', 'fortran_order': False, 'shape': " + shape + ", }";
  header.append((64 - (10 + header.size() + 1) % 64) % 64, ' ');
  header += '\n';
  const char len[2] = {static_cast<char>(header.size() & 0xff), static_cast<char>(header.size() >> 8)};
  return std::string("\x93NUMPY\x01\x00", 8) + std::string(len, 2) + header + data;
}

TEST(Npy, HostileShapesNameTheFile) {
  TempDir dir;
  const std::string path = dir.file("a.npy");
  write_bytes(path, npy("<f4", "(4294967296, 4294967296)", ""));
  expect_error([&] { read_npy_f32(path); }, path, "more elements than memory can hold");
  write_bytes(path, npy("<i4", "(4294967296, 4294967297)", "abcd"));
  expect_error([&] { read_npy_tokens(path); }, path, "more elements than memory can hold");
  write_bytes(path, npy("<f4", "(2, 99999999999999999999)", ""));
  expect_error([&] { read_npy_f32(path); }, path, "a dimension of 20 digits");
  write_bytes(path, npy("<f4", "(3, 2)", std::string(20, '\0')));
  expect_error([&] { read_npy_f32(path); }, path, "needs 6 x 4 data bytes, file has 20");
  write_bytes(path, npy("<f4", "(0, 3)", ""));
  EXPECT_TRUE(read_npy_f32(path).values.empty());
  write_bytes(path, npy("<i4", "(2, 2)", std::string(16, '\1')));
  EXPECT_EQ(read_npy_tokens(path).tokens.size(), 4u);
}

// NpyAppender (expert_load.npy): a complete array after every append; reopened, it keeps the
// slices asked for and cuts off the rest, a slice torn by a crash (bytes written, header not yet)
// included; a file of another slice shape or dtype is one line naming it.
TEST(Npy, AppenderGrowsACompleteArrayAndResumes) {
  TempDir dir;
  const std::string path = dir.file("loads.npy");
  std::vector<float> slice(6);
  auto fill = [&](int k) {
    for (size_t i = 0; i < slice.size(); ++i) slice[i] = static_cast<float>(10 * k + static_cast<int>(i));
  };
  {
    NpyAppender a(path, {2, 3}, 0);
    EXPECT_EQ(read_npy_f32(path).shape, (std::vector<int64_t>{0, 2, 3}));
    for (int k = 0; k < 3; ++k) {
      fill(k);
      a.append(slice.data());
      const NpyFloats f = read_npy_f32(path);  // as numpy would read it now
      EXPECT_EQ(f.shape, (std::vector<int64_t>{k + 1, 2, 3}));
      EXPECT_EQ(f.values[static_cast<size_t>(6 * k + 5)], static_cast<float>(10 * k + 5));
    }
  }
  std::ofstream(path, std::ios::binary | std::ios::app).write("torn", 4);  // a crash mid-append
  {
    NpyAppender a(path, {2, 3}, 99);  // keeps all 3 complete slices, cuts the torn bytes
    EXPECT_EQ(a.size(), 3);
    EXPECT_EQ(read_npy_f32(path).shape, (std::vector<int64_t>{3, 2, 3}));
  }
  {
    NpyAppender a(path, {2, 3}, 2);  // a run resumed after the 2nd slice
    EXPECT_EQ(a.size(), 2);
    fill(7);
    a.append(slice.data());
    const NpyFloats f = read_npy_f32(path);
    EXPECT_EQ(f.shape, (std::vector<int64_t>{3, 2, 3}));
    EXPECT_EQ(f.values[6], 10.0f);   // slice 1 kept
    EXPECT_EQ(f.values[12], 70.0f);  // slice 2 replaced
  }
  expect_error([&] { NpyAppender(path, {3, 2}, 1); }, path, "not the float32 slices (3, 2)");
  EXPECT_EQ(NpyAppender(path, {3, 2}, 0).size(), 0);  // keep 0: a new file
  EXPECT_EQ(read_npy_f32(path).shape, (std::vector<int64_t>{0, 3, 2}));
}

// Found by the audit of the readers (docs/faults.md, "Untrusted files"): the header dict was read
// with std::regex, which recursed once per character matched and overflowed the stack on a 40 kB
// 'descr'; and the shape's digits were picked out of any text, so "(-2, -2)" read as (2, 2).
TEST(Npy, HostileHeadersNameTheFile) {
  TempDir dir;
  const std::string path = dir.file("h.npy");
  write_bytes(path, npy(std::string(40000, 'a'), "(1, 1)", std::string(4, '\0')));
  expect_error([&] { read_npy_f32(path); }, path, "is not supported (expected float32 '<f4')");
  for (const char* shape : {"(-2, -2)", "(2, 2.0)", "(2, x)", "(2,, 2)", "(,)"}) {
    write_bytes(path, npy("<i4", shape, std::string(16, '\1')));
    expect_error([&] { read_npy_tokens(path); }, path,
                 cat("shape ", shape, " is not a tuple of non-negative integers"));
  }
  // What numpy writes still reads: "(4,)", "()" and Python 2's "2L".
  write_bytes(path, npy("<f4", "(4,)", std::string(16, '\0')));
  EXPECT_EQ(read_npy_f32(path).shape, std::vector<int64_t>{4});
  write_bytes(path, npy("<f4", "()", std::string(4, '\0')));
  EXPECT_EQ(read_npy_f32(path).values.size(), 1u);
  write_bytes(path, npy("<i4", "(2L, 2L)", std::string(16, '\1')));
  EXPECT_EQ(read_npy_tokens(path).rows, 2);
}

TEST(PlainTokens, CheckVocab) {
  TempDir dir;
  std::string path = dir.file("v.tokens");
  write_token_file(path, std::vector<uint32_t>{1, 2, 256, 3, 4, 300, 5, 999}, 2);
  TokenDataset ds = open_token_dataset(path);
  EXPECT_EQ(ds.max_token(), 999);
  ds.check_vocab(1000);
  expect_error([&] { ds.check_vocab(257); }, path, "token id 300 at index 5 is outside the vocabulary [0, 257)");
  // Signed Megatron storage: a negative id is caught too.
  std::string prefix = dir.file("neg");
  write_bytes(prefix + ".idx", hand_built_idx(4, 1, {2}, {0}, {0, 1}));
  std::string bin;
  put<int32_t>(&bin, 3);
  put<int32_t>(&bin, -1);
  write_bytes(prefix + ".bin", bin);
  expect_error([&] { open_token_dataset(prefix).check_vocab(257); }, prefix + ".bin", "token id -1 at index 1");
}

// ---- byte tokenizer ----

TEST(ByteTokenizer, RoundTrip) {
  std::string all;
  for (int c = 0; c < 256; ++c) all.push_back(static_cast<char>(c));
  all += "hello, wörld";
  std::vector<uint32_t> t = ByteTokenizer::encode(all);
  ASSERT_EQ(t.size(), all.size());
  for (size_t i = 0; i < t.size(); ++i) EXPECT_EQ(t[i], static_cast<uint8_t>(all[i]));
  EXPECT_EQ(ByteTokenizer::decode(t), all);
  t.push_back(ByteTokenizer::kEos);
  EXPECT_EQ(ByteTokenizer::decode(t), all);
  EXPECT_EQ(ByteTokenizer::decode(t, "<eos>"), all + "<eos>");
  EXPECT_EQ(ByteTokenizer::decode(std::vector<uint32_t>{'a', 300, 'b'}),
            "a\xEF\xBF\xBD"
            "b");
  EXPECT_EQ(ByteTokenizer::kVocabSize, 257);
}

// ---- prepare ----

// JSONL corpora (Megatron's preprocess_data.py input): one document per line from the string at
// --json-key, blank lines skipped, unicode and a 1 MB line kept whole; a bad line (not JSON, not
// an object, no key, not a string, nested too deep) is one error naming the file and line, or with
// --skip-bad-lines skipped and counted; a cut .jsonl.gz is an error naming it, not sniffed as binary.
TEST(Prepare, JsonlLinesAreDocuments) {
  TempDir dir;
  const std::string big(1 << 20, 'w');
  const std::string jsonl = dir.file("c.jsonl");
  write_bytes(jsonl,
              "{\"text\": \"ab\", \"id\": 1}\n\n   \r\n{\"text\": \"\\u00e9\u4e2d\"}\n{\"body\": \"x\", \"text\": \"" +
                  big + "\"}");  // no final newline
  const std::string out = dir.file("j.tokens");
  PrepareStats st = prepare({jsonl}, out);
  EXPECT_EQ(st.files, 1);
  EXPECT_EQ(st.documents, 3);
  EXPECT_EQ(st.bad_lines, 0);
  // ab EOS, the 2 + 3 UTF-8 bytes of "\u00e9\u4e2d" EOS, the big line EOS.
  EXPECT_EQ(st.tokens, 3 + 6 + static_cast<int64_t>(big.size()) + 1);
  TokenDataset ds = open_token_dataset(out);
  std::vector<int32_t> head(9);
  ds.copy_tokens(0, 9, head.data());
  EXPECT_EQ(head,
            (std::vector<int32_t>{'a', 'b', ByteTokenizer::kEos, 0xc3, 0xa9, 0xe4, 0xb8, 0xad, ByteTokenizer::kEos}));
  PrepareOptions body;
  body.json_key = "body";
  expect_error([&] { prepare({jsonl}, out, TokenFormat::plain, body); }, jsonl + ":1", "no key \"body\" (--json-key)");
  const std::string bad = dir.file("bad.jsonl");
  for (const auto& [line, what] : std::vector<std::pair<std::string, std::string>>{
           {"{\"text\": \"ok\"\n", "not JSON"},
           {"[\"text\"]", "not a JSON object"},
           {"{\"text\": 7}", "\"text\" is not a string"},
           {"{\"text\": " + std::string(100, '[') + std::string(100, ']') + "}", "nested deeper than 64"}}) {
    write_bytes(bad, "{\"text\": \"fine\"}\n" + line + "\n{\"text\": \"also fine\"}\n");
    expect_error([&] { prepare({bad}, out); }, bad + ":2", what);
    PrepareOptions skip;
    skip.skip_bad_lines = true;
    const PrepareStats s = prepare({bad}, out, TokenFormat::plain, skip);
    EXPECT_EQ(s.documents, 2) << line;
    EXPECT_EQ(s.bad_lines, 1) << line;
  }
  const std::string gz = dir.file("c.jsonl.gz");
  write_bytes(gz, std::string("\x1f\x8b\x08\0", 4));
  expect_error([&] { prepare({gz}, out); }, gz + ":1", "truncated gzip data");
}

TEST(Prepare, TreeSortedSkipsBinaryDeterministic) {
  TempDir dir;
  fs::path in = dir.path() / "corpus";
  fs::create_directories(in / "a" / "c");
  write_bytes((in / "z.txt").string(), "zzz");
  write_bytes((in / "a" / "b.txt").string(), "bee\n");
  write_bytes((in / "a" / "c" / "d.txt").string(), "dee");
  write_bytes((in / "a" / "empty.txt").string(), "");
  std::string binary(9000, 'x');
  binary[100] = '\0';
  write_bytes((in / "a" / "blob.dat").string(), binary);
  std::string late_nul(9000, 'y');
  late_nul[8500] = '\0';  // a NUL past the first 8 KiB: still text
  write_bytes((in / "m.txt").string(), late_nul);
  std::string single = dir.file("single.txt");
  write_bytes(single, "S");

  std::string out = dir.file("out.tokens");
  PrepareStats st = prepare({in.string(), single}, out);
  EXPECT_EQ(st.files, 5);
  EXPECT_EQ(st.skipped, 2);
  EXPECT_EQ(st.bytes, 4 + 3 + 9000 + 3 + 1);
  EXPECT_EQ(st.tokens, st.bytes + 5);
  EXPECT_EQ(st.output, out);
  TokenDataset ds = open_token_dataset(out);
  ASSERT_EQ(ds.num_tokens(), st.tokens);
  // Sorted: a/b.txt, a/c/d.txt, m.txt, z.txt; then the second input.
  std::string want = "bee\n|dee|" + late_nul + "|zzz|S|";
  std::vector<uint32_t> toks = all_tokens(ds);
  EXPECT_EQ(ByteTokenizer::decode(toks, "|"), want);
  EXPECT_EQ(toks.back(), ByteTokenizer::kEos);
  ds.check_vocab(ByteTokenizer::kVocabSize);

  // Same inputs, same bytes; Megatron output holds the same stream and one document per file.
  std::string out2 = dir.file("out2.tokens");
  prepare({in.string(), single}, out2);
  EXPECT_EQ(read_bytes(out), read_bytes(out2));
  std::string prefix = dir.file("mega");
  PrepareStats sm = prepare({in.string(), single}, prefix + ".bin", TokenFormat::megatron);
  EXPECT_EQ(sm.output, prefix);
  TokenDataset dm = open_token_dataset(prefix);
  EXPECT_EQ(dm.num_documents(), 5);
  EXPECT_EQ(all_tokens(dm), toks);
  // No temporary files are left behind.
  for (const auto& e : fs::directory_iterator(dir.path()))
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();

  expect_error([&] { prepare({dir.file("nope")}, dir.file("x.tokens")); }, dir.file("nope"), "no such file");
  expect_error([&] { prepare({in.string()}, dir.file("x.bin")); }, dir.file("x.bin"), "must end with .tokens");
  EXPECT_FALSE(default_corpus_dirs().empty());
}

// ---- prepare: compressed JSONL, threads ----

// `s` as a gzip member (zlib's deflate with the gzip wrapper).
std::string gzip(std::string_view s) {
  z_stream zs{};
  EXPECT_EQ(deflateInit2(&zs, 1, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY), Z_OK);
  std::string out(deflateBound(&zs, static_cast<uLong>(s.size())), '\0');
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(s.data()));
  zs.avail_in = static_cast<uInt>(s.size());
  zs.next_out = reinterpret_cast<Bytef*>(out.data());
  zs.avail_out = static_cast<uInt>(out.size());
  EXPECT_EQ(deflate(&zs, Z_FINISH), Z_STREAM_END);
  out.resize(zs.total_out);
  deflateEnd(&zs);
  return out;
}

// `s` as one zstd frame with a content checksum (as the zstd tool writes by default).
std::string zstd(std::string_view s) {
  ZSTD_CCtx* cctx = ZSTD_createCCtx();
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_compressionLevel, 1);
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_checksumFlag, 1);
  std::string out(ZSTD_compressBound(s.size()), '\0');
  const size_t n = ZSTD_compress2(cctx, out.data(), out.size(), s.data(), s.size());
  ZSTD_freeCCtx(cctx);
  EXPECT_FALSE(ZSTD_isError(n)) << ZSTD_getErrorName(n);
  out.resize(n);
  return out;
}

// `n` characters of text, ASCII and multi-byte UTF-8 mixed with the characters JSON escapes.
std::string random_text(uint64_t seed, uint64_t stream, size_t n) {
  static const std::vector<std::string> kAlphabet = {"a", "b", "e", "t",  " ",  " ", "\n", "\t", "\"", "\\",
                                                     "/", "é", "ß", "中", "文", "😀", "Ω",  "7",  ".",  "\r"};
  std::string s;
  for (size_t i = 0; i < n; ++i) s += kAlphabet[rng_below(seed, stream, i, kAlphabet.size())];
  return s;
}

std::string json_line(const std::string& text) { return nlohmann::json{{"text", text}}.dump(); }

// The byte tokenizer's stream for `docs`: each document's bytes, then EOS.
std::vector<uint32_t> byte_tokens(const std::vector<std::string>& docs) {
  std::vector<uint32_t> t;
  for (const auto& d : docs) {
    ByteTokenizer::encode(d, &t);
    t.push_back(ByteTokenizer::kEos);
  }
  return t;
}

// .jsonl.gz and .jsonl.zst (one gzip member or two, one zstd frame or two, cut inside a line) give
// the bytes the same .jsonl gives: blank lines (CRLF ones too) skipped, unicode raw and escaped,
// a 6 MB line spanning many buffers of compressed and decompressed bytes, no final newline; a
// missing key names the compressed file and its line.
TEST(Prepare, CompressedJsonlGivesThePlainTokens) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(cat("seed ", seed));
  TempDir dir;
  std::vector<std::string> docs = {"first", "é中😀 raw", "é中😀 escaped", random_text(seed, 1, 4 << 20), ""};
  std::string jsonl = "\n" + json_line(docs[0]) + "\r\n\n   \n" + json_line(docs[1]) + "\n" +
                      R"({"text": "\u00e9\u4e2d\ud83d\ude00 escaped", "id": 3})" + "\n" + json_line(docs[3]) + "\n" +
                      json_line(docs[4]) + "\n\n";
  for (uint64_t i = 0; i < 200; ++i) {
    docs.push_back(random_text(seed, 2 + i, rng_below(seed, 0, i, 3000)));
    jsonl += json_line(docs.back()) + "\n";
  }
  docs.push_back("last, no newline");
  jsonl += json_line(docs.back());
  const size_t cut = jsonl.size() / 3;  // inside the 6 MB line
  const std::string big = json_line(docs[3]);
  const size_t big_begin = jsonl.find(big);
  ASSERT_TRUE(big_begin < cut && cut < big_begin + big.size());

  const std::string plain = dir.file("c.jsonl");
  write_bytes(plain, jsonl);
  const std::string want_out = dir.file("plain.tokens");
  const PrepareStats want = prepare({plain}, want_out);
  EXPECT_EQ(want.documents, static_cast<int64_t>(docs.size()));
  EXPECT_EQ(all_tokens(open_token_dataset(want_out)), byte_tokens(docs));

  const std::vector<std::pair<std::string, std::string>> files = {
      {"one.jsonl.gz", gzip(jsonl)},
      {"two.jsonl.gz", gzip(jsonl.substr(0, cut)) + gzip(jsonl.substr(cut))},
      {"one.jsonl.zst", zstd(jsonl)},
      {"two.jsonl.zst", zstd(jsonl.substr(0, cut)) + zstd(jsonl.substr(cut))}};
  for (const auto& [name, bytes] : files) {
    SCOPED_TRACE(name);
    const std::string path = dir.file(name);
    write_bytes(path, bytes);
    const std::string out = dir.file(name + ".tokens");
    const PrepareStats st = prepare({path}, out, TokenFormat::plain);
    EXPECT_EQ(st.files, 1);
    EXPECT_EQ(st.documents, want.documents);
    EXPECT_EQ(st.bytes, static_cast<int64_t>(jsonl.size()));
    EXPECT_EQ(st.tokens, want.tokens);
    EXPECT_TRUE(read_bytes(out) == read_bytes(want_out));

    // A line without the key after the 6 MB line, the two members/frames cut inside it.
    const size_t at = jsonl.find('\n', cut) + 1;
    const std::string bad_text = jsonl.substr(0, at) + "{\"id\": 7}\n" + jsonl.substr(at);
    const int64_t bad_line = 1 + std::count(jsonl.begin(), jsonl.begin() + static_cast<std::ptrdiff_t>(at), '\n');
    const bool gz = name.ends_with(".gz");
    auto compress = [&](std::string_view s) { return gz ? gzip(s) : zstd(s); };
    const std::string bad = dir.file("bad-" + name);
    write_bytes(bad, name.starts_with("one") ? compress(bad_text)
                                             : compress(std::string_view(bad_text).substr(0, at + 4)) +
                                                   compress(std::string_view(bad_text).substr(at + 4)));
    expect_error([&] { prepare({bad}, out); }, cat(bad, ":", bad_line), "no key \"text\" (--json-key)");
    PrepareOptions skip;
    skip.skip_bad_lines = true;
    const PrepareStats s = prepare({bad}, out, TokenFormat::plain, skip);
    EXPECT_EQ(s.bad_lines, 1);
    EXPECT_EQ(s.documents, want.documents);
  }
}

// A cut or corrupt compressed file is one error naming the file and the line reached; the output
// already there is left as it was and no temporary file stays. A compressed empty text is an empty
// file (skipped); an empty .gz is not gzip. Lines longer than the reader's limit fail by name.
TEST(Prepare, CorruptCompressedJsonlNamesTheFile) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(cat("seed ", seed));
  TempDir dir;
  std::string jsonl;
  for (uint64_t i = 0; i < 3000; ++i) jsonl += json_line(random_text(seed, i, 200)) + "\n";
  const std::string out = dir.file("out.tokens");
  write_bytes(dir.file("ok.jsonl"), jsonl);
  prepare({dir.file("ok.jsonl")}, out);
  const std::string good = read_bytes(out);

  const std::string gz = gzip(jsonl), zs = zstd(jsonl);
  std::string gz_flipped = gz, zs_flipped = zs;
  gz_flipped[gz.size() / 2] ^= 0x55;
  zs_flipped[zs.size() / 2] ^= 0x55;
  // (name, bytes, what the message says, whether the line reached is past the first)
  const std::vector<std::tuple<std::string, std::string, std::string, bool>> cases = {
      {"half.jsonl.gz", gz.substr(0, gz.size() / 2), "truncated gzip data (the file ends inside a member)", true},
      {"no-trailer.jsonl.gz", gz.substr(0, gz.size() - 4), "truncated gzip data", true},
      {"second-member-cut.jsonl.gz", gz + gz.substr(0, 20), "truncated gzip data", true},
      {"flipped.jsonl.gz", gz_flipped, "gzip data", false},
      {"not-gzip.jsonl.gz", jsonl, "corrupt gzip data (zlib: incorrect header check)", false},
      {"empty.jsonl.gz", "", "truncated gzip data (an empty file)", false},
      {"half.jsonl.zst", zs.substr(0, zs.size() / 2), "truncated zstd data (the file ends inside a frame)", true},
      {"flipped.jsonl.zst", zs_flipped, "zstd data", false},
      {"not-zstd.jsonl.zst", jsonl, "corrupt zstd data (Unknown frame descriptor)", false},
      {"empty.jsonl.zst", "", "truncated zstd data (an empty file)", false}};
  for (const auto& [name, bytes, what, past_first] : cases) {
    SCOPED_TRACE(name);
    const std::string path = dir.file(name);
    write_bytes(path, bytes);
    // Checksums come at the ends of members and frames: without skip_bad_lines a flipped byte may
    // first show as a bad line, still naming the file.
    PrepareOptions skip;
    skip.skip_bad_lines = true;
    expect_error(
        [&] {
          prepare({dir.file("ok.jsonl"), path}, out, TokenFormat::plain, skip);
        },
        "prepare: " + path + ":", what);
    expect_error(
        [&] {
          prepare({dir.file("ok.jsonl"), path}, out);
        },
        "prepare: " + path + ":", name.starts_with("flipped") ? "" : what);
    try {
      prepare({path}, out, TokenFormat::plain, skip);
    } catch (const Error& e) {
      const std::string msg = e.what();
      const int64_t line = std::atoll(msg.c_str() + msg.find(path) + path.size() + 1);
      EXPECT_GE(line, 1) << msg;
      if (past_first) {
        EXPECT_GT(line, 1) << msg;
      }
    }
    EXPECT_TRUE(read_bytes(out) == good);
    fs::remove(path);
  }
  for (const auto& e : fs::directory_iterator(dir.path()))
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();

  // Compressed empty text: an empty file, skipped like an empty .jsonl.
  write_bytes(dir.file("nothing.jsonl.gz"), gzip(""));
  write_bytes(dir.file("nothing.jsonl.zst"), zstd(""));
  const PrepareStats st = prepare({dir.file("ok.jsonl"), dir.file("nothing.jsonl.gz"), dir.file("nothing.jsonl.zst")},
                                  dir.file("n.tokens"));
  EXPECT_EQ(st.files, 1);
  EXPECT_EQ(st.skipped, 2);

  // The reader's line limit (1 GiB in prepare), here 300 bytes: line 2 is longer.
  const std::string lines = dir.file("lines.zst");
  write_bytes(lines, zstd("short\n" + std::string(301, 'x') + "\n"));
  LineReader r(lines, compression_of(lines), 300);
  std::string line;
  EXPECT_TRUE(r.next(&line));
  EXPECT_EQ(line, "short");
  expect_error([&] { r.next(&line); }, lines + ":2", "a line longer than 300 bytes");
}

// The thread count changes nothing: 1, 2 and 5 threads write the same bytes (plain and Megatron,
// byte tokenizer and a BPE tokenizer.json), equal to the documents encoded one by one in corpus
// order, over a corpus of many batches; the first bad line is the one reported whatever the count.
TEST(Prepare, ThreadCountDoesNotChangeTheOutput) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(cat("seed ", seed));
  TempDir dir;
  fs::create_directories(dir.path() / "corpus");
  std::vector<std::string> docs;
  std::string a, c;
  for (uint64_t i = 0; i < 2400; ++i) {
    docs.push_back(random_text(seed, i, rng_below(seed, 1u << 20, i, 1200)));
    (i < 1600 ? a : c) += json_line(docs.back()) + "\n";
    if (i == 100) a += "{\"no text\": 1}\n";  // skipped under skip_bad_lines
    if (i == 2000) c += "[1]\n";
  }
  docs.push_back("b, a text file");
  write_bytes((dir.path() / "corpus" / "a.jsonl.zst").string(), zstd(a));
  write_bytes((dir.path() / "corpus" / "b.txt").string(), docs.back());
  write_bytes((dir.path() / "corpus" / "c.jsonl.gz").string(), gzip(c));
  std::rotate(docs.begin() + 1600, docs.end() - 1, docs.end());  // b.txt comes before c.jsonl.gz
  const std::string corpus = (dir.path() / "corpus").string();

  const std::string tokenizer = std::string(MOEFOLD_SOURCE_DIR) + "/tests/fixtures/tokenizer/qwen2/tokenizer.json";
  const BpeTokenizer bpe(tokenizer);
  const int32_t bpe_eos = *bpe.added_token_id("<|endoftext|>");
  std::vector<uint32_t> want_bpe;
  for (const auto& d : docs) {
    for (int32_t id : bpe.encode(d)) want_bpe.push_back(static_cast<uint32_t>(id));
    want_bpe.push_back(static_cast<uint32_t>(bpe_eos));
  }
  const std::vector<uint32_t> want_bytes = byte_tokens(docs);

  for (const std::string& tok : {std::string(), tokenizer}) {
    SCOPED_TRACE(tok.empty() ? "bytes" : tok);
    std::string first;
    for (int threads : {1, 2, 5}) {
      SCOPED_TRACE(cat(threads, " threads"));
      PrepareOptions o;
      o.tokenizer = tok;
      o.skip_bad_lines = true;
      o.threads = threads;
      const std::string out = dir.file(cat("t", threads, ".tokens"));
      const PrepareStats st = prepare({corpus}, out, TokenFormat::plain, o);
      EXPECT_EQ(st.threads, threads);
      EXPECT_EQ(st.bad_lines, 2);
      EXPECT_EQ(st.documents, static_cast<int64_t>(docs.size()));
      EXPECT_GT(st.bytes, 4 * (256 << 10));  // several batches (prepare's are 256 KiB) in flight
      const std::string bytes = read_bytes(out);
      if (first.empty()) {
        first = bytes;
        EXPECT_TRUE(all_tokens(open_token_dataset(out)) == (tok.empty() ? want_bytes : want_bpe));
      }
      EXPECT_TRUE(bytes == first);
      const std::string prefix = dir.file(cat("m", threads));
      prepare({corpus}, prefix, TokenFormat::megatron, o);
      EXPECT_TRUE(all_tokens(open_token_dataset(prefix)) == all_tokens(open_token_dataset(out)));
      EXPECT_EQ(open_token_dataset(prefix).num_documents(), st.documents);

      o.skip_bad_lines = false;
      const std::string a_path = (dir.path() / "corpus" / "a.jsonl.zst").string();
      expect_error([&] { prepare({corpus}, out, TokenFormat::plain, o); }, a_path + ":102:", "no key \"text\"");
    }
  }
}

// ---- loader ----

// A stream whose token i is i, so a window's tokens tell where it came from.
std::string iota_dataset(const TempDir& dir, int64_t n) {
  std::vector<uint32_t> t(n);
  for (int64_t i = 0; i < n; ++i) t[i] = static_cast<uint32_t>(i);
  std::string path = dir.file("iota" + std::to_string(n) + ".tokens");
  write_token_file(path, t, 4);
  return path;
}

TEST(Loader, WindowsShiftedAndInsideTrainRange) {
  TempDir dir;
  TokenDataset ds = open_token_dataset(iota_dataset(dir, 5000));
  const int64_t S = 16, B = 4;
  Loader ld(ds, S, B, testing::fresh_seed(), 0.1);
  EXPECT_EQ(ld.num_train_tokens(), 4500);
  std::vector<int32_t> in(B * S), tg(B * S);
  std::set<int32_t> starts;
  for (int step = 0; step < 200; ++step) {
    ld.next_train(in.data(), tg.data());
    for (int64_t b = 0; b < B; ++b) {
      starts.insert(in[b * S]);
      for (int64_t s = 0; s < S; ++s) {
        ASSERT_EQ(in[b * S + s], in[b * S] + s);      // a contiguous window
        ASSERT_EQ(tg[b * S + s], in[b * S + s] + 1);  // targets = inputs shifted by one
      }
      ASSERT_GE(in[b * S], 0);
      ASSERT_LT(tg[b * S + S - 1], ld.num_train_tokens());  // never reads held-out tokens
    }
  }
  EXPECT_EQ(ld.position(), 200 * B);
  EXPECT_GT(starts.size(), 400u);  // windows are spread, not repeated
}

TEST(Loader, DeterministicAndResumable) {
  TempDir dir;
  TokenDataset ds = open_token_dataset(iota_dataset(dir, 3000));
  const int64_t S = 8, B = 3;
  const uint64_t seed = testing::fresh_seed();
  Loader a(ds, S, B, seed, 0.0), b(ds, S, B, seed, 0.0), c(ds, S, B, seed + 1, 0.0);
  std::vector<int32_t> ia(B * S), ta(B * S), ib(B * S), tb(B * S);
  std::vector<std::vector<int32_t>> history;
  bool differs = false;
  for (int step = 0; step < 10; ++step) {
    a.next_train(ia.data(), ta.data());
    b.next_train(ib.data(), tb.data());
    EXPECT_EQ(ia, ib);
    EXPECT_EQ(ta, tb);
    history.push_back(ia);
    c.next_train(ib.data(), tb.data());
    differs |= ia != ib;
  }
  EXPECT_TRUE(differs) << "another seed gave the same batches";
  // A fresh loader resumed at the position after step 6 replays steps 7..9.
  Loader r(ds, S, B, seed, 0.0);
  r.set_position(6 * B);
  for (int step = 6; step < 10; ++step) {
    r.next_train(ib.data(), tb.data());
    EXPECT_EQ(ib, history[step]) << "step " << step;
  }
  // Any rank can compute any sample alone.
  std::vector<int32_t> one(S), one_t(S);
  a.train_sample(4 * B + 1, one.data(), one_t.data());
  EXPECT_TRUE(std::equal(one.begin(), one.end(), history[4].begin() + S));
  expect_error([&] { r.set_position(-1); }, ds.path(), "data position -1 must be in [0, 2^62]");
  // A checkpoint's data position that next_train would overflow (trainer.json is a file).
  expect_error([&] { r.set_position(INT64_MAX - 1); }, ds.path(), "must be in [0, 2^62]");
}

TEST(Loader, ValidBatchesAreHeldOutAndDisjoint) {
  TempDir dir;
  TokenDataset ds = open_token_dataset(iota_dataset(dir, 2000));
  const int64_t S = 10, B = 2;
  Loader ld(ds, S, B, 7, 0.25);
  EXPECT_EQ(ld.num_train_tokens(), 1500);
  EXPECT_EQ(ld.num_valid_batches(), 500 / 11 / 2);
  std::vector<int32_t> in(B * S), tg(B * S);
  std::set<int32_t> seen;
  for (int64_t j = 0; j < ld.num_valid_batches(); ++j) {
    ld.valid_batch(j, in.data(), tg.data());
    for (int64_t b = 0; b < B; ++b) {
      // Window = inputs plus the last target: S + 1 tokens, none shared with another window.
      for (int64_t s = 0; s < S; ++s) {
        EXPECT_GE(in[b * S + s], ld.num_train_tokens());
        EXPECT_EQ(tg[b * S + s], in[b * S + s] + 1);
        EXPECT_TRUE(seen.insert(in[b * S + s]).second) << "windows overlap at token " << in[b * S + s];
      }
      EXPECT_TRUE(seen.insert(tg[b * S + S - 1]).second) << "windows overlap at token " << tg[b * S + S - 1];
    }
  }
  EXPECT_LT(*seen.rbegin(), 2000);
  EXPECT_EQ(Loader(ds, S, B, 7, 0.0).num_valid_batches(), 0);
}

TEST(Loader, RejectsShortDataAndBadArguments) {
  TempDir dir;
  std::string path = iota_dataset(dir, 100);
  TokenDataset ds = open_token_dataset(path);
  expect_error([&] { Loader(ds, 100, 1, 0, 0.0); }, path, "fewer than one window of seq_len + 1 = 101");
  expect_error([&] { Loader(ds, 60, 1, 0, 0.5); }, path, "fewer than one window");
  expect_error([&] { Loader(ds, 10, 4, 0, 0.2); }, path, "fewer than one validation batch of 4 x (seq_len + 1) = 44");
  expect_error([&] { Loader(ds, 0, 4, 0, 0.0); }, path, "seq_len = 0");
  expect_error([&] { Loader(ds, 4, 4, 0, 1.0); }, path, "valid_fraction = 1");
  Loader ok(ds, 99, 1, 0, 0.0);  // exactly one window: always starts at 0
  std::vector<int32_t> in(99), tg(99);
  ok.next_train(in.data(), tg.data());
  EXPECT_EQ(in[0], 0);
  EXPECT_EQ(tg[98], 99);
}

TEST(Loader, NextTrainDoesNotAllocate) {
  TempDir dir;
  TokenDataset ds = open_token_dataset(iota_dataset(dir, 4096));
  Loader ld(ds, 32, 8, 1, 0.1);
  std::vector<int32_t> in(32 * 8), tg(32 * 8);
  ld.next_train(in.data(), tg.data());
  g_allocs = 0;
  g_count_allocs = true;
  for (int i = 0; i < 50; ++i) ld.next_train(in.data(), tg.data());
  ld.valid_batch(0, in.data(), tg.data());
  g_count_allocs = false;
  EXPECT_EQ(g_allocs.load(), 0);
}

}  // namespace
}  // namespace moefold

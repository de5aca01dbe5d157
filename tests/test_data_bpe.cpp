// data: the Hugging Face byte-level BPE tokenizer. Ids equal the tokenizers library's on the
// committed fixtures (tests/fixtures/tokenizer/, scripts/make_tokenizer_fixture.py); hand-made
// tokenizer.json files pin merge order, ignore_merges, added-token splitting, normalization and
// GPT-2's byte map; unsupported or broken files fail naming file and key; prepare --tokenizer.
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "moefold/core/error.h"
#include "moefold/data/bpe_tokenizer.h"
#include "moefold/data/prepare.h"
#include "moefold/data/token_dataset.h"
#include "testing.h"

namespace moefold {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using testing::read_bytes;
using testing::TempDir;
using testing::write_bytes;

const std::string kFixtures = std::string(MOEFOLD_SOURCE_DIR) + "/tests/fixtures/tokenizer/";

template <class F>
void expect_error(F&& f, const std::string& name, const std::string& what) {
  const std::string msg = testing::error_of(f);
  ASSERT_FALSE(msg.empty()) << "no moefold::Error (expected '" << what << "' naming " << name << ")";
  EXPECT_NE(msg.find(name), std::string::npos) << "message does not name '" << name << "': " << msg;
  EXPECT_NE(msg.find(what), std::string::npos) << "message lacks '" << what << "': " << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << "message is not one line: " << msg;
}

std::vector<int32_t> ids_of(const json& j) { return j.get<std::vector<int32_t>>(); }

// ---- parity with the tokenizers library ----

class Fixture : public ::testing::TestWithParam<std::string> {};

TEST_P(Fixture, IdsEqualTheLibrary) {
  const std::string dir = kFixtures + GetParam() + "/";
  const json want = json::parse(read_bytes(dir + "expected.json"));
  BpeTokenizer tok(dir + "tokenizer.json");
  SCOPED_TRACE("tokenizers " + want["tokenizers_version"].get<std::string>());
  EXPECT_EQ(tok.vocab_size(), want["vocab_size"].get<int64_t>());
  const std::string text = read_bytes(dir + "text.txt");
  ASSERT_GT(text.size(), 200u);
  const std::vector<int32_t> expect = ids_of(want["ids"]);
  EXPECT_EQ(tok.encode(text), expect);
  // Appending form, on top of existing ids.
  std::vector<int32_t> out = {7};
  tok.encode(text, &out);
  ASSERT_EQ(out.size(), expect.size() + 1);
  EXPECT_TRUE(std::equal(expect.begin(), expect.end(), out.begin() + 1));
  ASSERT_GT(want["cases"].size(), 20u);
  for (const json& c : want["cases"]) {
    const std::string t = c["text"].get<std::string>();
    EXPECT_EQ(tok.encode(t), ids_of(c["ids"])) << "text: '" << t << "'";
  }
}

// The word cache is shared: threads encoding at once get the same ids.
TEST_P(Fixture, ThreadsAgree) {
  const std::string dir = kFixtures + GetParam() + "/";
  const json want = json::parse(read_bytes(dir + "expected.json"));
  const BpeTokenizer tok(dir + "tokenizer.json");
  const std::string text = read_bytes(dir + "text.txt");
  std::vector<std::vector<int32_t>> got(4);
  std::vector<std::thread> threads;
  for (auto& g : got)
    threads.emplace_back([&] {
      for (int i = 0; i < 20; ++i) g = tok.encode(text);
    });
  for (auto& t : threads) t.join();
  for (const auto& g : got) EXPECT_EQ(g, ids_of(want["ids"]));
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, Fixture, ::testing::Values("qwen2", "deepseek", "gpt2"));

TEST(BpeFixture, SpecialTokensAndIds) {
  BpeTokenizer qwen(kFixtures + "qwen2/tokenizer.json");
  // Added after training: ids follow the 800 vocabulary entries.
  EXPECT_EQ(qwen.token_id("<|endoftext|>"), 800);
  EXPECT_EQ(qwen.added_token_id("<|im_end|>"), 802);
  EXPECT_EQ(qwen.token_id("Ġt"), qwen.encode(" t").at(0));  // vocabulary entries in byte-level spelling
  EXPECT_EQ(qwen.added_token_id("Ġt"), std::nullopt);
  EXPECT_EQ(qwen.token_id("no such token"), std::nullopt);
  EXPECT_EQ(qwen.encode("<|im_start|>x<|im_end|>").front(), 801);
  // DeepSeek's sentence tokens are in its vocabulary (ids 0 and 1), as in the real file.
  BpeTokenizer ds(kFixtures + "deepseek/tokenizer.json");
  EXPECT_EQ(ds.added_token_id("<｜end▁of▁sentence｜>"), 1);
  EXPECT_EQ(ds.encode("<｜begin▁of▁sentence｜>"), std::vector<int32_t>{0});
}

// ---- hand-made tokenizers ----

json byte_level(bool use_regex = false) {
  return {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", use_regex}};
}

// A tokenizer.json whose vocabulary is `vocab` (ids in order) with "a b" merges (rank = index).
json tiny(const std::vector<std::string>& vocab, const std::vector<std::string>& merges) {
  json v = json::object();
  for (size_t i = 0; i < vocab.size(); ++i) v[vocab[i]] = i;
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", json::array()},
          {"normalizer", nullptr},
          {"pre_tokenizer", byte_level()},
          {"post_processor", nullptr},
          {"decoder", {{"type", "ByteLevel"}}},
          {"model",
           {{"type", "BPE"},
            {"dropout", nullptr},
            {"unk_token", nullptr},
            {"continuing_subword_prefix", nullptr},
            {"end_of_word_suffix", nullptr},
            {"fuse_unk", false},
            {"byte_fallback", false},
            {"ignore_merges", false},
            {"vocab", v},
            {"merges", merges}}}};
}

json added(const std::string& content, int id, bool special = true, bool normalized = false) {
  return {{"id", id},        {"content", content},       {"single_word", false}, {"lstrip", false},
          {"rstrip", false}, {"normalized", normalized}, {"special", special}};
}

std::string save(const TempDir& dir, const json& j, const std::string& name = "tokenizer.json") {
  const std::string p = dir.file(name);
  write_bytes(p, j.dump());
  return p;
}

TEST(BpeTokenizer, MergesApplyLowestRankFirst) {
  TempDir dir("bpe");
  // "b c" outranks "a b": abc -> a bc, never ab c.
  BpeTokenizer t1(save(dir, tiny({"a", "b", "c", "ab", "bc"}, {"b c", "a b"}), "t1.json"));
  EXPECT_EQ(t1.encode("abc"), (std::vector<int32_t>{0, 4}));
  BpeTokenizer t2(save(dir, tiny({"a", "b", "c", "ab", "bc"}, {"a b", "b c"}), "t2.json"));
  EXPECT_EQ(t2.encode("abc"), (std::vector<int32_t>{3, 2}));
  // Merged symbols merge again; among equal ranks the leftmost pair goes first.
  BpeTokenizer t3(save(dir, tiny({"a", "b", "c", "ab", "bc", "abc", "aa"}, {"b c", "a bc", "a a"}), "t3.json"));
  EXPECT_EQ(t3.encode("abc"), (std::vector<int32_t>{5}));
  EXPECT_EQ(t3.encode("aaa"), (std::vector<int32_t>{6, 0}));
  EXPECT_EQ(t3.encode("aaaa"), (std::vector<int32_t>{6, 6}));
  EXPECT_EQ(t3.encode("aabcc"), (std::vector<int32_t>{0, 5, 2}));
  // The ["a", "b"] pair form means the same as "a b".
  json pairs = tiny({"a", "b", "c", "ab", "bc"}, {});
  pairs["model"]["merges"] = json::array({json::array({"b", "c"}), json::array({"a", "b"})});
  EXPECT_EQ(BpeTokenizer(save(dir, pairs, "t4.json")).encode("abc"), (std::vector<int32_t>{0, 4}));
  EXPECT_EQ(t1.vocab_size(), 5);
}

TEST(BpeTokenizer, IgnoreMerges) {
  TempDir dir("bpe");
  json j = tiny({"a", "b", "c", "ab", "bc", "abc"}, {"b c", "a b"});
  EXPECT_EQ(BpeTokenizer(save(dir, j, "off.json")).encode("abc"), (std::vector<int32_t>{0, 4}));
  j["model"]["ignore_merges"] = true;
  BpeTokenizer on(save(dir, j, "on.json"));
  EXPECT_EQ(on.encode("abc"), (std::vector<int32_t>{5}));  // a whole pre-token in the vocabulary
  EXPECT_EQ(on.encode("abcc"), (std::vector<int32_t>{0, 4, 2}));
}

TEST(BpeTokenizer, PreTokensDoNotMergeAcrossSplits) {
  TempDir dir("bpe");
  // Without a regex "b a" is one pre-token and "b Ġ" merges; GPT-2's regex cuts it into "b", " a".
  json j = tiny({"a", "b", "Ġ", "bĠ"}, {"b Ġ"});
  EXPECT_EQ(BpeTokenizer(save(dir, j, "whole.json")).encode("b a"), (std::vector<int32_t>{3, 0}));
  j["pre_tokenizer"] = byte_level(true);
  EXPECT_EQ(BpeTokenizer(save(dir, j, "gpt2.json")).encode("b a"), (std::vector<int32_t>{1, 2, 0}));
  // A Split with a literal String pattern, Isolated: "b" pieces stand alone, so "a b" never applies.
  j = tiny({"a", "b", "ab"}, {"a b"});
  EXPECT_EQ(BpeTokenizer(save(dir, j, "nosplit.json")).encode("abab"), (std::vector<int32_t>{2, 2}));
  j["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       {{{"type", "Split"}, {"pattern", {{"String", "b"}}}, {"behavior", "Isolated"}, {"invert", false}},
        byte_level()}}};
  EXPECT_EQ(BpeTokenizer(save(dir, j, "split.json")).encode("abab"), (std::vector<int32_t>{0, 1, 0, 1}));
  // Special regex characters in a String pattern are literal.
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {{"String", "a.b"}};
  EXPECT_EQ(BpeTokenizer(save(dir, j, "dot.json")).encode("abab"), (std::vector<int32_t>{2, 2}));
}

TEST(BpeTokenizer, AddedTokensSplitTheTextFirst) {
  TempDir dir("bpe");
  json j = tiny({"a", "b", "<", ">", "x", "y", "ab"}, {"a b"});
  j["added_tokens"] = {added("<x>", 100), added("<xy>", 101), added("ab", 102, false)};
  BpeTokenizer t(save(dir, j));
  // Ids as the library assigns them: not in the vocabulary -> 7, 8 (the file's ids only warn
  // there); "ab" is in the vocabulary -> its id 6.
  EXPECT_EQ(t.added_token_id("<x>"), 7);
  EXPECT_EQ(t.added_token_id("<xy>"), 8);
  EXPECT_EQ(t.added_token_id("ab"), 6);
  EXPECT_EQ(t.vocab_size(), 9);
  // Leftmost-longest; the rest is tokenized normally; a partial token is plain text.
  EXPECT_EQ(t.encode("a<xy>b<x>"), (std::vector<int32_t>{0, 8, 1, 7}));
  EXPECT_EQ(t.encode("<x><xy"), (std::vector<int32_t>{7, 2, 4, 5}));
  EXPECT_EQ(t.encode("<<x>>"), (std::vector<int32_t>{2, 7, 3}));
}

TEST(BpeTokenizer, NormalizedAddedTokensMatchAfterNormalization) {
  TempDir dir("bpe");
  // "é" is C3 A9: byte-level "Ã" (U+00C3) and "©" (U+00A9).
  json j = tiny({"e", "Ã", "©", "Ì", "ģ", "Ã©"}, {"Ã ©"});
  j["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "NFC"}}}}};
  BpeTokenizer nfc(save(dir, j, "nfc.json"));
  EXPECT_EQ(nfc.encode("e\u0301"), (std::vector<int32_t>{5}));  // NFC: U+00E9
  EXPECT_EQ(nfc.encode("\u00e9"), (std::vector<int32_t>{5}));
  j["normalizer"] = nullptr;  // e + U+0301 (CC 81: "Ì", "ģ")
  EXPECT_EQ(BpeTokenizer(save(dir, j, "none.json")).encode("e\u0301"), (std::vector<int32_t>{0, 3, 4}));
  // An added token with normalized=true matches the normalized text, in either spelling.
  j["normalizer"] = {{"type", "NFC"}};
  j["added_tokens"] = {added("e\u0301!", 50, false, true), added("<raw>", 51)};
  BpeTokenizer t(save(dir, j, "added.json"));
  EXPECT_EQ(t.encode("e\u0301!"), (std::vector<int32_t>{6}));
  EXPECT_EQ(t.encode("\u00e9!"), (std::vector<int32_t>{6}));
}

// GPT-2's bytes_to_unicode, written out independently.
char32_t gpt2_byte_char(int b) {
  if ((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255)) return static_cast<char32_t>(b);
  int n = 0;
  for (int c = 0; c < b; ++c)
    if (!((c >= 33 && c <= 126) || (c >= 161 && c <= 172) || (c >= 174 && c <= 255))) ++n;
  return static_cast<char32_t>(256 + n);
}

std::string utf8(char32_t c) {
  std::string s;
  if (c < 0x80) {
    s.push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    s.push_back(static_cast<char>(0xC0 | (c >> 6)));
    s.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    s.push_back(static_cast<char>(0xE0 | (c >> 12)));
    s.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    s.push_back(static_cast<char>(0xF0 | (c >> 18)));
    s.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
  return s;
}

TEST(BpeTokenizer, ByteLevelMapCoversAllBytes) {
  std::set<char32_t> seen;
  for (int b = 0; b < 256; ++b) {
    EXPECT_EQ(byte_level_code_point(static_cast<uint8_t>(b)), gpt2_byte_char(b)) << "byte " << b;
    seen.insert(byte_level_code_point(static_cast<uint8_t>(b)));
  }
  EXPECT_EQ(seen.size(), 256u);
  EXPECT_EQ(byte_level_code_point(' '), U'Ġ');
  EXPECT_EQ(byte_level_code_point('\n'), U'Ċ');
  EXPECT_EQ(byte_level_code_point(0xAD), U'\u0143');
  EXPECT_EQ(byte_level_code_point('A'), U'A');

  // A vocabulary of the 256 byte tokens, id = byte: every byte of the text comes back as itself.
  std::vector<std::string> vocab;
  for (int b = 0; b < 256; ++b) vocab.push_back(utf8(gpt2_byte_char(b)));
  TempDir dir("bpe");
  BpeTokenizer t(save(dir, tiny(vocab, {})));
  std::string text;
  for (char32_t c = 0; c < 0x800; ++c) text += utf8(c);
  text += utf8(0xFFFF) + utf8(0x10FFFF) + "😀 中文";
  std::vector<int32_t> want;
  for (char c : text) want.push_back(static_cast<uint8_t>(c));
  EXPECT_EQ(t.encode(text), want);
  EXPECT_EQ(t.vocab_size(), 256);
  // Invalid UTF-8: each maximal ill-formed subsequence reads as U+FFFD (EF BF BD).
  const std::vector<int32_t> fffd = {0xEF, 0xBF, 0xBD};
  auto cat_ids = [](std::initializer_list<std::vector<int32_t>> parts) {
    std::vector<int32_t> v;
    for (const auto& p : parts) v.insert(v.end(), p.begin(), p.end());
    return v;
  };
  EXPECT_EQ(t.encode("a\xFF"
                     "b"),
            cat_ids({{'a'}, fffd, {'b'}}));
  EXPECT_EQ(t.encode("\xE2\x82"
                     "x\xC0\xAF"),
            cat_ids({fffd, {'x'}, fffd, fffd}));
  EXPECT_EQ(t.encode("\xED\xA0\x80"), cat_ids({fffd, fffd, fffd}));  // a surrogate
  EXPECT_EQ(t.encode("\xF0\x9F\x98"), cat_ids({fffd}));              // a truncated emoji
}

// Byte-level spelling of UTF-8 text.
std::string spell(const std::string& text) {
  std::string s;
  for (char c : text) s += utf8(byte_level_code_point(static_cast<uint8_t>(c)));
  return s;
}

// \s means Oniguruma's White_Space (what the library compiles), not PCRE2's (which adds U+180E).
TEST(BpeTokenizer, RegexWhitespaceIsOniguruma) {
  TempDir dir("bpe");
  const std::string mvs = spell("\u180e"), nel = spell("\u0085");
  std::vector<std::string> vocab = {"a", "b"};
  for (const std::string& sp : {mvs, nel})
    for (size_t i = 0; i < sp.size();) {  // the byte tokens of the separator
      size_t n = static_cast<uint8_t>(sp[i]) < 0x80 ? 1 : 2;
      vocab.push_back(sp.substr(i, n));
      i += n;
    }
  // Merges that build "a" + U+180E + "b" and "a" + U+0085 + "b" into one token each.
  std::vector<std::string> merges;
  for (const std::string& sp : {mvs, nel}) {
    std::string acc = "a";
    for (size_t i = 0; i < sp.size();) {
      size_t n = static_cast<uint8_t>(sp[i]) < 0x80 ? 1 : 2;
      merges.push_back(acc + " " + sp.substr(i, n));
      acc += sp.substr(i, n);
      vocab.push_back(acc);
      i += n;
    }
    merges.push_back(acc + " b");
    vocab.push_back(acc + "b");
  }
  json j = tiny(vocab, merges);
  BpeTokenizer whole(save(dir, j, "whole.json"));
  const auto mvs_word = whole.token_id("a" + mvs + "b"), nel_word = whole.token_id("a" + nel + "b");
  ASSERT_TRUE(mvs_word && nel_word);
  EXPECT_EQ(whole.encode("a\u180eb"), std::vector<int32_t>{*mvs_word});
  for (const char* re : {"\\s+", "[\\s]+", "\\S+", "[^\\S]+"}) {
    SCOPED_TRACE(re);
    j["pre_tokenizer"] = {
        {"type", "Sequence"},
        {"pretokenizers",
         {{{"type", "Split"}, {"pattern", {{"Regex", re}}}, {"behavior", "Isolated"}, {"invert", false}},
          byte_level()}}};
    BpeTokenizer t(save(dir, j, "split.json"));
    EXPECT_EQ(t.encode("a\u180eb"), std::vector<int32_t>{*mvs_word});  // U+180E: not a space, no split
    EXPECT_EQ(t.encode("a\u0085b").size(), 4u);                        // U+0085: a space, split off
  }
}

TEST(BpeTokenizer, UnknownBytesAreDroppedOrUnk) {
  TempDir dir("bpe");
  json j = tiny({"a", "<unk>"}, {});
  EXPECT_EQ(BpeTokenizer(save(dir, j, "drop.json")).encode("abba"), (std::vector<int32_t>{0, 0}));
  j["model"]["unk_token"] = "<unk>";
  EXPECT_EQ(BpeTokenizer(save(dir, j, "unk.json")).encode("abba"), (std::vector<int32_t>{0, 1, 1, 0}));
  j["model"]["fuse_unk"] = true;
  EXPECT_EQ(BpeTokenizer(save(dir, j, "fuse.json")).encode("abba"), (std::vector<int32_t>{0, 1, 0}));
}

// Long pieces (a whole file of letters or spaces) neither overflow the regex engine nor crawl.
TEST(BpeTokenizer, LongPieces) {
  BpeTokenizer tok(kFixtures + "qwen2/tokenizer.json");
  for (const std::string& s : {std::string(2000000, ' '), std::string(2000000, 'q'), std::string(300000, '\n')}) {
    std::vector<int32_t> ids = tok.encode(s);
    EXPECT_GT(ids.size(), 0u);
    EXPECT_LE(ids.size(), s.size());
  }
}

// ---- bad files ----

TEST(BpeTokenizer, BadFilesNameFileAndKey) {
  TempDir dir("bpe");
  const json good = tiny({"a", "b", "ab"}, {"a b"});
  ASSERT_EQ(BpeTokenizer(save(dir, good)).encode("ab"), std::vector<int32_t>{2});

  expect_error([&] { BpeTokenizer t(dir.file("missing.json")); }, dir.file("missing.json"), "cannot read");
  write_bytes(dir.file("bad.json"), "{\"model\": {\"type\": \"BPE\",");
  expect_error([&] { BpeTokenizer t(dir.file("bad.json")); }, dir.file("bad.json"), "not valid JSON");
  write_bytes(dir.file("array.json"), "[1, 2]");
  expect_error([&] { BpeTokenizer t(dir.file("array.json")); }, dir.file("array.json"), "expected a JSON object");

  auto expect_bad = [&](const std::string& name, const std::function<void(json&)>& edit, const std::string& key,
                        const std::string& what) {
    SCOPED_TRACE(name);
    json j = good;
    edit(j);
    const std::string p = save(dir, j, name + ".json");
    expect_error([&] { BpeTokenizer t(p); }, p, what);
    expect_error([&] { BpeTokenizer t(p); }, p, key);
  };
  expect_bad(
      "unigram", [](json& j) { j["model"]["type"] = "Unigram"; }, "model.type", "\"Unigram\" is not supported");
  expect_bad(
      "no_model", [](json& j) { j.erase("model"); }, "model", "missing");
  expect_bad(
      "no_merges", [](json& j) { j["model"].erase("merges"); }, "model.merges", "missing");
  expect_bad(
      "no_vocab", [](json& j) { j["model"].erase("vocab"); }, "model.vocab", "missing");
  expect_bad(
      "fallback", [](json& j) { j["model"]["byte_fallback"] = true; }, "model.byte_fallback", "not supported");
  expect_bad(
      "dropout", [](json& j) { j["model"]["dropout"] = 0.1; }, "model.dropout", "not supported");
  expect_bad(
      "suffix", [](json& j) { j["model"]["end_of_word_suffix"] = "</w>"; }, "model.end_of_word_suffix",
      "not supported");
  expect_bad(
      "merge_oov", [](json& j) { j["model"]["merges"] = {"a c"}; }, "model.merges[0]", "\"c\" is not in");
  expect_bad(
      "merge_result", [](json& j) { j["model"]["merges"] = {"b a"}; }, "model.merges[0]", "\"ba\" is not in");
  expect_bad(
      "merge_form", [](json& j) { j["model"]["merges"] = {"a b c"}; }, "model.merges[0]", "one space");
  expect_bad(
      "bad_id", [](json& j) { j["model"]["vocab"]["a"] = -1; }, "model.vocab[\"a\"]", "token id");
  expect_bad(
      "lowercase",
      [](json& j) {
        j["normalizer"] = {{"type", "Lowercase"}};
      },
      "normalizer.type", "\"Lowercase\" is not supported");
  expect_bad(
      "seq_norm",
      [](json& j) {
        j["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "NFC"}}, {{"type", "Strip"}}}}};
      },
      "normalizer.normalizers[1].type", "\"Strip\" is not supported");
  expect_bad(
      "metaspace",
      [](json& j) {
        j["pre_tokenizer"] = {{"type", "Metaspace"}};
      },
      "pre_tokenizer.type", "\"Metaspace\" is not supported");
  expect_bad(
      "no_pre", [](json& j) { j["pre_tokenizer"] = nullptr; }, "pre_tokenizer", "ByteLevel");
  expect_bad(
      "prefix_space", [](json& j) { j["pre_tokenizer"]["add_prefix_space"] = true; }, "pre_tokenizer.add_prefix_space",
      "not supported");
  auto split = [](const std::string& regex, const std::string& behavior) {
    return json{{"type", "Sequence"},
                {"pretokenizers",
                 {{{"type", "Split"}, {"pattern", {{"Regex", regex}}}, {"behavior", behavior}, {"invert", false}},
                  byte_level()}}};
  };
  expect_bad(
      "removed", [&](json& j) { j["pre_tokenizer"] = split("a", "Removed"); },
      "pre_tokenizer.pretokenizers[0].behavior", "\"Removed\" is not supported");
  expect_bad(
      "bad_regex", [&](json& j) { j["pre_tokenizer"] = split("(a", "Isolated"); },
      "pre_tokenizer.pretokenizers[0].pattern", "bad regex");
  expect_bad(
      "word_class", [&](json& j) { j["pre_tokenizer"] = split("\\w+", "Isolated"); },
      "pre_tokenizer.pretokenizers[0].pattern.Regex", "\\w");
  expect_bad(
      "dotall", [&](json& j) { j["pre_tokenizer"] = split("(?m:a.)", "Isolated"); },
      "pre_tokenizer.pretokenizers[0].pattern.Regex", "(?m");
  expect_bad(
      "byte_level_first",
      [&](json& j) {
        j["pre_tokenizer"] = split("a", "Isolated");
        std::swap(j["pre_tokenizer"]["pretokenizers"][0], j["pre_tokenizer"]["pretokenizers"][1]);
      },
      "pre_tokenizer.pretokenizers[0]", "ByteLevel must be the last");
  expect_bad(
      "lstrip",
      [](json& j) {
        j["added_tokens"] = json::array({added("<s>", 3)});
        j["added_tokens"][0]["lstrip"] = true;
      },
      "added_tokens[0].lstrip", "not supported");
  expect_bad(
      "no_content",
      [](json& j) {
        j["added_tokens"] = json::array({json{{"id", 3}}});
      },
      "added_tokens[0].content", "missing");
}

// Found by the audit of the readers (docs/faults.md, "Untrusted files"): a value nested 100,000
// deep overflowed the stack (nlohmann dumps and copies values recursively; dump() wrote the error
// message), and so did 100,000 Split pre-tokenizers (encode recursed once per stage).
TEST(BpeTokenizer, HostileFilesNameTheFile) {
  TempDir dir("bpe");
  std::string text = tiny({"a"}, {}).dump();
  const size_t at = text.find("\"merges\":[]");
  ASSERT_NE(at, std::string::npos);
  text.insert(at + 10, std::string(100000, '[') + std::string(100000, ']'));
  const std::string deep = dir.file("deep.json");
  write_bytes(deep, text);
  expect_error([&] { BpeTokenizer t(deep); }, deep, "JSON nested deeper than 64 levels");

  const json split = {{"type", "Split"}, {"pattern", {{"String", "a"}}}, {"behavior", "Isolated"}};
  json j = tiny({"a", "b"}, {});
  j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", json::array()}};
  for (int i = 0; i < 63; ++i) j["pre_tokenizer"]["pretokenizers"].push_back(split);
  j["pre_tokenizer"]["pretokenizers"].push_back(byte_level());
  EXPECT_EQ(BpeTokenizer(save(dir, j, "64.json")).encode("aba"), (std::vector<int32_t>{0, 1, 0}));
  j["pre_tokenizer"]["pretokenizers"].insert(j["pre_tokenizer"]["pretokenizers"].begin(), split);
  const std::string many = save(dir, j, "65.json");
  expect_error([&] { BpeTokenizer t(many); }, many, "pre_tokenizer.pretokenizers: 65 pre-tokenizers, more than the 64");
}

// ---- prepare --tokenizer ----

TEST(BpePrepare, TokensAreEncodePlusEos) {
  TempDir dir("bpe");
  const std::string tok_path = kFixtures + "qwen2/tokenizer.json";
  BpeTokenizer tok(tok_path);
  const fs::path in = dir.path() / "in";
  fs::create_directories(in);
  const std::string a = read_bytes(kFixtures + "qwen2/text.txt");
  const std::string b = "Second document: Cafe\u0301 <|im_start|> 12345\n\n";
  write_bytes((in / "a.txt").string(), a);
  write_bytes((in / "b.txt").string(), b);

  const std::string out = dir.file("out.tokens");
  PrepareStats st = prepare({in.string()}, out, TokenFormat::plain, {.tokenizer = tok_path, .eos_token = ""});
  EXPECT_EQ(st.files, 2);
  EXPECT_EQ(st.vocab_size, tok.vocab_size());
  EXPECT_EQ(st.eos_id, 800);  // <|endoftext|>
  std::vector<int32_t> want = tok.encode(a);
  want.push_back(800);
  tok.encode(b, &want);
  want.push_back(800);
  EXPECT_EQ(st.tokens, static_cast<int64_t>(want.size()));
  TokenDataset ds = open_token_dataset(out);
  ASSERT_EQ(ds.num_tokens(), static_cast<int64_t>(want.size()));
  std::vector<int32_t> got(want.size());
  ds.copy_tokens(0, ds.num_tokens(), got.data());
  EXPECT_EQ(got, want);
  EXPECT_EQ(read_bytes(out).size(), 24 + 2 * want.size());  // <= 65536 ids: 2 bytes per token

  // --eos-token picks another token; Megatron output holds the same documents.
  PrepareStats sm = prepare({in.string()}, dir.file("mega"), TokenFormat::megatron,
                            {.tokenizer = tok_path, .eos_token = "<|im_end|>"});
  EXPECT_EQ(sm.eos_id, 802);
  TokenDataset dm = open_token_dataset(dir.file("mega"));
  EXPECT_EQ(dm.num_documents(), 2);
  EXPECT_EQ(dm.token(static_cast<int64_t>(tok.encode(a).size())), 802u);

  expect_error(
      [&] {
        prepare({in.string()}, dir.file("x.tokens"), TokenFormat::plain, {tok_path, "<nope>"});
      },
      "--eos-token '<nope>'", "is not a token");
  expect_error(
      [&] {
        prepare({in.string()}, dir.file("x.tokens"), TokenFormat::plain, {"", "<|im_end|>"});
      },
      "--eos-token", "needs --tokenizer");
  expect_error(
      [&] {
        prepare({in.string()}, dir.file("x.tokens"), TokenFormat::plain, {dir.file("none.json"), ""});
      },
      dir.file("none.json"), "cannot read");
  // No EOS candidate among the added tokens: the message asks for --eos-token.
  const std::string bare = save(dir, tiny({"a", "b"}, {}), "bare.json");
  expect_error(
      [&] {
        prepare({in.string()}, dir.file("x.tokens"), TokenFormat::plain, {bare, ""});
      },
      bare, "--eos-token");
  EXPECT_FALSE(fs::exists(dir.file("x.tokens")));
}

// Ids past 65535: 4 bytes per token in plain files, int32 in Megatron datasets.
TEST(BpePrepare, WideVocabularies) {
  TempDir dir("bpe");
  json j = tiny({"a", "b"}, {});
  j["model"]["vocab"]["<big>"] = 70000;
  j["added_tokens"] = {added("<big>", 70000), added("</s>", 3)};
  const std::string tok_path = save(dir, j);
  BpeTokenizer tok(tok_path);
  EXPECT_EQ(tok.vocab_size(), 70001);
  EXPECT_EQ(tok.added_token_id("</s>"), 3);
  write_bytes(dir.file("doc.txt"), "ab<big>ba");
  const std::vector<int32_t> want = {0, 1, 70000, 1, 0, 3};

  PrepareStats st = prepare({dir.file("doc.txt")}, dir.file("w.tokens"), TokenFormat::plain, {tok_path, ""});
  EXPECT_EQ(st.vocab_size, 70001);
  EXPECT_EQ(read_bytes(dir.file("w.tokens")).size(), 24 + 4 * want.size());
  TokenDataset ds = open_token_dataset(dir.file("w.tokens"));
  std::vector<int32_t> got(want.size());
  ASSERT_EQ(ds.num_tokens(), static_cast<int64_t>(want.size()));
  ds.copy_tokens(0, ds.num_tokens(), got.data());
  EXPECT_EQ(got, want);

  prepare({dir.file("doc.txt")}, dir.file("wm"), TokenFormat::megatron, {tok_path, ""});
  const std::string idx = read_bytes(dir.file("wm.idx"));
  ASSERT_GT(idx.size(), 17u);
  EXPECT_EQ(idx[17], static_cast<char>(MegatronDType::int32));
  TokenDataset dm = open_token_dataset(dir.file("wm"));
  ASSERT_EQ(dm.num_tokens(), static_cast<int64_t>(want.size()));
  dm.copy_tokens(0, dm.num_tokens(), got.data());
  EXPECT_EQ(got, want);
}

}  // namespace
}  // namespace moefold

#include "moefold/data/bpe_tokenizer.h"

// PCRE2 for the pre-tokenizer regexes: they need Unicode properties (\p{L}, \p{N}, ...),
// lookahead (`\s+(?!\S)`) and possessive quantifiers, which std::regex lacks; its JIT matches
// at hundreds of MB/s. utf8proc for normalization: a small C library taking UTF-8 directly
// (ICU would mean converting every piece to UTF-16 and back, and a much larger dependency).
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <tuple>
#include <unordered_map>
#include <utility>

#include "moefold/core/error.h"
#include "moefold/io/json_limits.h"

namespace moefold {

namespace {

using json = nlohmann::json;

// ---- UTF-8 ----

// Length of the well-formed UTF-8 sequence at s[i] (Unicode 15, table 3-7), or 0 when it is
// ill-formed, with *bad = the length of its maximal subpart (what one U+FFFD replaces).
size_t utf8_length(std::string_view s, size_t i, size_t* bad) {
  const auto b0 = static_cast<uint8_t>(s[i]);
  if (b0 < 0x80) return 1;
  size_t n = 0;
  uint8_t lo = 0x80, hi = 0xBF;  // range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    n = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    n = 3;
    if (b0 == 0xE0) lo = 0xA0;  // no overlong forms
    if (b0 == 0xED) hi = 0x9F;  // no surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    n = 4;
    if (b0 == 0xF0) lo = 0x90;  // no overlong forms
    if (b0 == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
  } else {
    *bad = 1;
    return 0;
  }
  for (size_t k = 1; k < n; ++k) {
    if (i + k >= s.size() || static_cast<uint8_t>(s[i + k]) < lo || static_cast<uint8_t>(s[i + k]) > hi) {
      *bad = k;
      return 0;
    }
    lo = 0x80;
    hi = 0xBF;
  }
  return n;
}

// `s` when it is valid UTF-8; else a copy in *buf with each maximal ill-formed subsequence
// replaced by U+FFFD.
std::string_view valid_utf8(std::string_view s, std::string* buf) {
  size_t i = 0, bad = 0;
  while (i < s.size()) {
    if (static_cast<uint8_t>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    size_t n = utf8_length(s, i, &bad);
    if (n == 0) break;
    i += n;
  }
  if (i == s.size()) return s;
  buf->assign(s.substr(0, i));
  while (i < s.size()) {
    size_t n = utf8_length(s, i, &bad);
    if (n == 0) {
      buf->append("\xEF\xBF\xBD");
      i += bad;
    } else {
      buf->append(s.substr(i, n));
      i += n;
    }
  }
  return *buf;
}

// The code point at s[*i] (REQUIRES: valid UTF-8); advances *i past it.
char32_t next_code_point(std::string_view s, size_t* i) {
  const auto b0 = static_cast<uint8_t>(s[*i]);
  size_t n = b0 < 0x80 ? 1 : b0 < 0xE0 ? 2 : b0 < 0xF0 ? 3 : 4;
  char32_t c = n == 1 ? b0 : n == 2 ? (b0 & 0x1F) : n == 3 ? (b0 & 0x0F) : (b0 & 0x07);
  for (size_t k = 1; k < n; ++k) c = (c << 6) | (static_cast<uint8_t>(s[*i + k]) & 0x3F);
  *i += n;
  return c;
}

bool is_ascii(std::string_view s) {
  for (char c : s)
    if (static_cast<uint8_t>(c) >= 0x80) return false;
  return true;
}

// ---- byte level ----

struct ByteMap {
  std::array<char32_t, 256> to_cp{};
  std::array<int16_t, 0x144> to_byte{};  // code point -> byte, -1 when none
  ByteMap() {
    to_byte.fill(-1);
    char32_t next = 0x100;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      to_cp[b] = printable ? static_cast<char32_t>(b) : next++;
      to_byte[to_cp[b]] = static_cast<int16_t>(b);
    }
  }
};

const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}

// The raw bytes a byte-level spelling stands for; nullopt when a character is not one of the 256.
std::optional<std::string> byte_level_bytes(std::string_view token) {
  const ByteMap& m = byte_map();
  std::string out;
  out.reserve(token.size());
  for (size_t i = 0; i < token.size();) {
    char32_t c = next_code_point(token, &i);
    if (c >= m.to_byte.size() || m.to_byte[c] < 0) return std::nullopt;
    out.push_back(static_cast<char>(m.to_byte[c]));
  }
  return out;
}

// ---- regexes ----

// Rewrites an Oniguruma pattern (what the tokenizers library compiles) into PCRE2 syntax with the
// same meaning, or fails naming `key`. Both engines agree on \p{..}, \d, \x{..}, lookaround and
// possessive quantifiers; they differ on \s (Oniguruma: White_Space; PCRE2 adds U+180E), on \w
// and \b (PCRE2 10.42 omits marks and connector punctuation), on \h (a hex digit in Oniguruma)
// and on the (?m) flag (dotall in Oniguruma). ^ and $ are line anchors in Oniguruma: the caller
// compiles with PCRE2_MULTILINE.
std::string onig_to_pcre2(std::string_view pattern, const std::string& path, const std::string& key) {
  std::string out;
  out.reserve(pattern.size() + 16);
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '(' && i + 1 < pattern.size() && pattern[i + 1] == '?') {
      size_t k = i + 2;
      while (k < pattern.size() &&
             (pattern[k] == 'i' || pattern[k] == 'm' || pattern[k] == 's' || pattern[k] == 'x' || pattern[k] == '-'))
        ++k;
      std::string_view flags = pattern.substr(i + 2, k - i - 2);
      if (flags.find_first_of("msx") != std::string_view::npos)
        MF_FAIL(path, ": ", key, ": the inline flags (?", flags,
                ") are not supported (Oniguruma and PCRE2 read them differently)");
    }
    if (c != '\\' || i + 1 == pattern.size()) {
      out.push_back(c);
      continue;
    }
    const char e = pattern[++i];
    switch (e) {
      case 's':
        out += "\\p{White_Space}";
        break;
      case 'S':
        out += "\\P{White_Space}";
        break;
      case 'w':
      case 'W':
      case 'b':
      case 'B':
      case 'h':
      case 'H':
      case 'Q':
        MF_FAIL(path, ": ", key, ": \\", e, " in a regex is not supported (Oniguruma and PCRE2 differ on it)");
      default:
        out.push_back('\\');
        out.push_back(e);
    }
  }
  return out;
}

// A literal string as a PCRE2 pattern.
std::string escape_literal(std::string_view s) {
  std::string out;
  for (char c : s) {
    const auto u = static_cast<uint8_t>(c);
    if (u < 0x80 && !std::isalnum(u) && c != '\0') out.push_back('\\');
    if (c == '\0') {
      out += "\\x{0}";
      continue;
    }
    out.push_back(c);
  }
  return out;
}

class Regex {
 public:
  Regex(const std::string& pattern, const std::string& path, const std::string& key) : where_(path + ": " + key) {
    int err = 0;
    PCRE2_SIZE offset = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                          PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE, &err, &offset, nullptr);
    if (code_ == nullptr) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof msg);
      MF_FAIL(path, ": ", key, ": bad regex at offset ", offset, ": ", reinterpret_cast<const char*>(msg));
    }
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // when JIT is unavailable, the interpreter runs
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(Regex&& o) noexcept : where_(std::move(o.where_)), code_(std::exchange(o.code_, nullptr)) {}
  Regex& operator=(Regex&&) = delete;
  Regex(const Regex&) = delete;

  // Calls f(begin, end) for every non-empty match in `s` (REQUIRES: valid UTF-8), left to right.
  // After an empty match the search resumes one character later, as Oniguruma's find_iter
  // (which the library uses) does; empty matches produce no piece in the library either.
  template <class F>
  void for_each_match(std::string_view s, pcre2_match_data* md, pcre2_match_context* mc, F&& f) const {
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
    size_t start = 0;
    while (start < s.size()) {
      int rc = pcre2_match(code_, subject, s.size(), start, PCRE2_NO_UTF_CHECK, md, mc);
      if (rc == PCRE2_ERROR_NOMATCH) return;
      if (rc < 0) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof msg);
        MF_FAIL(where_, ": regex failed on a piece of ", s.size(), " bytes: ", reinterpret_cast<const char*>(msg));
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      if (ov[1] == ov[0]) {  // an empty match
        size_t i = ov[0];
        if (i >= s.size()) return;
        next_code_point(s, &i);
        start = i;
        continue;
      }
      // Copied out first: f may run nested matches that reuse `md`.
      const size_t begin = ov[0], end = ov[1];
      f(begin, end);
      start = end;
    }
  }

 private:
  std::string where_;  // file and key, for errors
  pcre2_code* code_ = nullptr;
};

// Per-thread match state: PCRE2 match data and a JIT stack may not be shared between threads.
// The JIT stack grows to 16 MiB (the 32 KiB default overflows on long pieces).
struct MatchState {
  pcre2_match_data* md = pcre2_match_data_create(1, nullptr);
  pcre2_jit_stack* stack = pcre2_jit_stack_create(32 * 1024, 16 * 1024 * 1024, nullptr);
  pcre2_match_context* mc = pcre2_match_context_create(nullptr);
  MatchState() {
    MF_CHECK(md && stack && mc, "PCRE2 allocation");
    pcre2_jit_stack_assign(mc, nullptr, stack);
  }
  ~MatchState() {
    pcre2_match_context_free(mc);
    pcre2_jit_stack_free(stack);
    pcre2_match_data_free(md);
  }
  MatchState(const MatchState&) = delete;
  MatchState& operator=(const MatchState&) = delete;
};

MatchState& match_state() {
  thread_local MatchState s;
  return s;
}

// ---- added tokens ----

// The added tokens of one kind as a byte trie; find() gives the leftmost-longest match, as the
// library's Aho-Corasick automaton (MatchKind::LeftmostLongest) does.
class TokenTrie {
 public:
  void add(std::string_view s, int32_t id) {
    if (s.empty()) return;
    first_[static_cast<uint8_t>(s[0])] = true;
    int32_t node = 0;
    for (char c : s) {
      const uint64_t key = edge_key(node, c);
      auto it = edges_.find(key);
      if (it == edges_.end()) {
        it = edges_.emplace(key, static_cast<int32_t>(ids_.size())).first;
        ids_.push_back(-1);
      }
      node = it->second;
    }
    ids_[node] = id;
  }
  bool empty() const { return ids_.size() == 1; }

  // The first match starting at or after `from`, as (start, length, id); length 0 when none.
  std::tuple<size_t, size_t, int32_t> find(std::string_view s, size_t from) const {
    for (size_t i = from; i < s.size(); ++i) {
      if (!first_[static_cast<uint8_t>(s[i])]) continue;
      int32_t node = 0;
      size_t best_len = 0;
      int32_t best_id = -1;
      for (size_t k = i; k < s.size(); ++k) {
        auto it = edges_.find(edge_key(node, s[k]));
        if (it == edges_.end()) break;
        node = it->second;
        if (ids_[node] >= 0) {
          best_len = k + 1 - i;
          best_id = ids_[node];
        }
      }
      if (best_len > 0) return {i, best_len, best_id};
    }
    return {s.size(), 0, -1};
  }

 private:
  static uint64_t edge_key(int32_t node, char c) {
    return (static_cast<uint64_t>(node) << 8) | static_cast<uint8_t>(c);
  }
  std::array<bool, 256> first_{};
  std::unordered_map<uint64_t, int32_t> edges_;  // (node, byte) -> child
  std::vector<int32_t> ids_ = {-1};              // per node: the token ending there, or -1
};

// Calls piece(text, -1) for the stretches between added tokens and piece({}, id) for each match.
template <class F>
void split_added(std::string_view s, const TokenTrie& trie, F&& piece) {
  if (trie.empty()) {
    if (!s.empty()) piece(s, -1);
    return;
  }
  size_t pos = 0;
  while (pos < s.size()) {
    auto [start, len, id] = trie.find(s, pos);
    if (start > pos) piece(s.substr(pos, start - pos), -1);
    if (len == 0) return;
    piece(std::string_view(), id);
    pos = start + len;
  }
}

// ---- JSON access with errors naming the file and key ----

struct Keys {
  const std::string& path;

  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    MF_FAIL(path, ": ", key, ": ", what);
  }
  // o[name] when present and not null; else nullptr.
  const json* find(const json& o, const char* name) const {
    auto it = o.find(name);
    return it == o.end() || it->is_null() ? nullptr : &*it;
  }
  const json& need(const json& o, const char* name, const std::string& key) const {
    const json* v = find(o, name);
    if (v == nullptr) fail(key, "missing");
    return *v;
  }
  std::string str(const json& o, const char* name, const std::string& key) const {
    const json& v = need(o, name, key);
    if (!v.is_string()) fail(key, "expected a string, found " + v.dump());
    return v.get<std::string>();
  }
  std::optional<std::string> opt_str(const json& o, const char* name, const std::string& key) const {
    const json* v = find(o, name);
    if (v == nullptr) return std::nullopt;
    if (!v->is_string()) fail(key, "expected a string, found " + v->dump());
    return v->get<std::string>();
  }
  bool flag(const json& o, const char* name, const std::string& key, bool dflt) const {
    const json* v = find(o, name);
    if (v == nullptr) return dflt;
    if (!v->is_boolean()) fail(key, "expected true or false, found " + v->dump());
    return v->get<bool>();
  }
  int32_t id(const json& v, const std::string& key) const {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > std::numeric_limits<int32_t>::max())
      fail(key, "expected a token id (an integer in [0, 2^31)), found " + v.dump());
    return static_cast<int32_t>(v.get<int64_t>());
  }
};

// Strings as keys with lookups by string_view.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <class V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;

struct Merge {
  int32_t rank;
  int32_t new_id;
};

uint64_t pair_key(int32_t a, int32_t b) { return (static_cast<uint64_t>(a) << 32) | static_cast<uint32_t>(b); }

// Pre-tokens up to this many bytes are cached (longer ones are rare and cheap to miss). The cache
// is split into kCacheShards by the pre-token's hash, each behind its own lock, so that threads
// sharing a tokenizer (`moefold prepare --threads`) rarely wait on one another; a shard is emptied
// when it reaches kCacheEntries / kCacheShards.
constexpr size_t kCacheMaxWord = 256;
constexpr size_t kCacheEntries = 1 << 18;
constexpr size_t kCacheShards = 64;

struct alignas(64) CacheShard {  // a cache line of its own: the locks of two shards never share one
  std::mutex mu;
  StringMap<std::vector<int32_t>> map;  // raw pre-token -> ids
};

}  // namespace

char32_t byte_level_code_point(uint8_t b) { return byte_map().to_cp[b]; }

struct BpeTokenizer::Impl {
  std::string path;
  std::vector<utf8proc_option_t> normalize_steps;  // applied in order
  TokenTrie raw_added, normalized_added;           // matched before / after normalization
  StringMap<int32_t> added;                        // content -> id
  std::vector<Regex> splits;                       // Split pre-tokenizers, then GPT-2's regex
  StringMap<int32_t> vocab;                        // byte-level spelling -> id
  StringMap<int32_t> byte_vocab;                   // raw bytes -> id (entries made of the 256)
  std::array<int32_t, 256> byte_id{};              // id of each one-byte token, -1 when absent
  std::unordered_map<uint64_t, Merge> merges;      // pair_key(left, right) -> rank, merged id
  bool ignore_merges = false;
  std::optional<std::string> unk_token;
  bool fuse_unk = false;
  int64_t vocab_size = 0;

  mutable std::array<CacheShard, kCacheShards> cache;

  void load_model(const Keys& k, const json& m);
  void load_normalizer(const Keys& k, const json& n, const std::string& key);
  void load_pre_tokenizer(const Keys& k, const json& p);
  void load_added_tokens(const Keys& k, const json& a);

  std::string_view normalize(std::string_view s, std::string* buf) const;
  void pre_tokenize(std::string_view s, size_t stage, MatchState& ms, std::vector<int32_t>* out) const;
  void bpe(std::string_view word, std::vector<int32_t>* out) const;
  void merge_word(std::string_view word, std::vector<int32_t>* out) const;
};

void BpeTokenizer::Impl::load_model(const Keys& k, const json& m) {
  if (!m.is_object()) k.fail("model", "expected an object, found " + m.dump());
  const std::string type = k.str(m, "type", "model.type");
  if (type != "BPE") k.fail("model.type", "\"" + type + "\" is not supported (only \"BPE\")");
  if (k.flag(m, "byte_fallback", "model.byte_fallback", false))
    k.fail("model.byte_fallback", "true is not supported (byte-level BPE needs no fallback)");
  if (const json* d = k.find(m, "dropout"); d != nullptr && !(d->is_number() && d->get<double>() == 0.0))
    k.fail("model.dropout", d->dump() + " is not supported (BPE dropout is random; expected null)");
  for (const char* name : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const std::string key = std::string("model.") + name;
    if (auto v = k.opt_str(m, name, key); v && !v->empty()) k.fail(key, "\"" + *v + "\" is not supported");
  }
  ignore_merges = k.flag(m, "ignore_merges", "model.ignore_merges", false);
  unk_token = k.opt_str(m, "unk_token", "model.unk_token");
  fuse_unk = k.flag(m, "fuse_unk", "model.fuse_unk", false);

  const json& v = k.need(m, "vocab", "model.vocab");
  if (!v.is_object()) k.fail("model.vocab", "expected an object of token -> id");
  byte_id.fill(-1);
  vocab.reserve(v.size());
  for (const auto& [token, id_json] : v.items()) {
    const int32_t id = k.id(id_json, "model.vocab[\"" + token + "\"]");
    vocab[token] = id;
    vocab_size = std::max<int64_t>(vocab_size, int64_t{id} + 1);
    if (auto bytes = byte_level_bytes(token)) {
      if (bytes->size() == 1) byte_id[static_cast<uint8_t>((*bytes)[0])] = id;
      byte_vocab[*bytes] = id;
    }
  }

  const json& ms = k.need(m, "merges", "model.merges");
  if (!ms.is_array()) k.fail("model.merges", "expected an array");
  merges.reserve(ms.size());
  int32_t rank = 0;
  for (size_t i = 0; i < ms.size(); ++i) {
    const json& e = ms[i];
    const std::string key = "model.merges[" + std::to_string(i) + "]";
    std::string a, b;
    if (e.is_string()) {
      // The legacy "a b" form: exactly one space; "#version" lines are skipped (not ranked).
      const std::string s = e.get<std::string>();
      if (s.starts_with("#version")) continue;
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
        k.fail(key, "\"" + s + "\" is not two tokens separated by one space");
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
      a = e[0].get<std::string>();
      b = e[1].get<std::string>();
    } else {
      k.fail(key, "expected \"a b\" or [\"a\", \"b\"], found " + e.dump());
    }
    auto ia = vocab.find(a), ib = vocab.find(b), iab = vocab.find(a + b);
    if (ia == vocab.end()) k.fail(key, "token \"" + a + "\" is not in model.vocab");
    if (ib == vocab.end()) k.fail(key, "token \"" + b + "\" is not in model.vocab");
    if (iab == vocab.end()) k.fail(key, "the merged token \"" + a + b + "\" is not in model.vocab");
    // A repeated pair takes its last rank, as the library's map does.
    merges[pair_key(ia->second, ib->second)] = Merge{rank++, iab->second};
  }
}

void BpeTokenizer::Impl::load_normalizer(const Keys& k, const json& n, const std::string& key) {
  if (n.is_null()) return;
  if (!n.is_object()) k.fail(key, "expected an object or null, found " + n.dump());
  const std::string type = k.str(n, "type", key + ".type");
  if (type == "Sequence") {
    const json& list = k.need(n, "normalizers", key + ".normalizers");
    if (!list.is_array()) k.fail(key + ".normalizers", "expected an array");
    for (size_t i = 0; i < list.size(); ++i)
      load_normalizer(k, list[i], key + ".normalizers[" + std::to_string(i) + "]");
  } else if (type == "NFC") {
    normalize_steps.push_back(static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  } else if (type == "NFD") {
    normalize_steps.push_back(static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE));
  } else if (type == "NFKC") {
    normalize_steps.push_back(static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT));
  } else if (type == "NFKD") {
    normalize_steps.push_back(static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT));
  } else {
    k.fail(key + ".type", "normalizer \"" + type + "\" is not supported (only NFC, NFD, NFKC, NFKD and Sequence)");
  }
}

void BpeTokenizer::Impl::load_pre_tokenizer(const Keys& k, const json& p) {
  if (p.is_null()) k.fail("pre_tokenizer", "null is not supported (a byte-level BPE needs a ByteLevel pre-tokenizer)");
  if (!p.is_object()) k.fail("pre_tokenizer", "expected an object, found " + p.dump());
  std::vector<std::pair<const json*, std::string>> steps;  // (pre-tokenizer, its key)
  if (k.str(p, "type", "pre_tokenizer.type") == "Sequence") {
    const json& list = k.need(p, "pretokenizers", "pre_tokenizer.pretokenizers");
    if (!list.is_array()) k.fail("pre_tokenizer.pretokenizers", "expected an array");
    for (size_t i = 0; i < list.size(); ++i)
      steps.emplace_back(&list[i], "pre_tokenizer.pretokenizers[" + std::to_string(i) + "]");
  } else {
    steps.emplace_back(&p, "pre_tokenizer");
  }
  // encode() recurses once per stage (pre_tokenize); real files have at most a handful.
  constexpr size_t kMaxPreTokenizers = 64;
  if (steps.size() > kMaxPreTokenizers)
    k.fail("pre_tokenizer.pretokenizers",
           cat(steps.size(), " pre-tokenizers, more than the ", kMaxPreTokenizers, " supported"));
  for (size_t i = 0; i < steps.size(); ++i) {
    const json& s = *steps[i].first;
    const std::string& key = steps[i].second;
    if (!s.is_object()) k.fail(key, "expected an object, found " + s.dump());
    const std::string type = k.str(s, "type", key + ".type");
    const bool last = i + 1 == steps.size();
    if (type == "Split") {
      if (last) k.fail(key, "the last pre-tokenizer must be ByteLevel (only byte-level BPE is supported)");
      const json& pat = k.need(s, "pattern", key + ".pattern");
      std::string pattern;
      if (auto r = pat.is_object() ? k.opt_str(pat, "Regex", key + ".pattern.Regex") : std::nullopt) {
        pattern = onig_to_pcre2(*r, path, key + ".pattern.Regex");
      } else if (auto l = pat.is_object() ? k.opt_str(pat, "String", key + ".pattern.String") : std::nullopt) {
        pattern = escape_literal(*l);
      } else {
        k.fail(key + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}, found " + pat.dump());
      }
      const std::string behavior = k.str(s, "behavior", key + ".behavior");
      if (behavior != "Isolated")
        k.fail(key + ".behavior", "\"" + behavior + "\" is not supported (only \"Isolated\")");
      if (k.flag(s, "invert", key + ".invert", false)) k.fail(key + ".invert", "true is not supported");
      splits.emplace_back(pattern, path, key + ".pattern");
    } else if (type == "ByteLevel") {
      if (!last) k.fail(key, "ByteLevel must be the last pre-tokenizer");
      if (k.flag(s, "add_prefix_space", key + ".add_prefix_space", true))
        k.fail(key + ".add_prefix_space", "true is not supported (expected false)");
      if (k.flag(s, "use_regex", key + ".use_regex", true)) {
        // GPT-2's pre-tokenizer regex (the library's ByteLevel, Split with Isolated behavior).
        static constexpr std::string_view kGpt2 =
            R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
        splits.emplace_back(onig_to_pcre2(kGpt2, path, key), path, key + ".use_regex");
      }
    } else {
      k.fail(key + ".type", "pre-tokenizer \"" + type + "\" is not supported (only Split and ByteLevel)");
    }
  }
}

void BpeTokenizer::Impl::load_added_tokens(const Keys& k, const json& a) {
  if (a.is_null()) return;
  if (!a.is_array()) k.fail("added_tokens", "expected an array");
  // Ids as the library's AddedVocabulary assigns them: the vocabulary's id when the content is
  // in it, else the next id from the vocabulary's entry count up (the file's "id" is only a
  // check there). By id, the token's content and whether it matches after normalization.
  int64_t next_id = static_cast<int64_t>(vocab.size());
  std::map<int32_t, std::pair<std::string, bool>> by_id;
  for (size_t i = 0; i < a.size(); ++i) {
    const json& t = a[i];
    const std::string key = "added_tokens[" + std::to_string(i) + "]";
    if (!t.is_object()) k.fail(key, "expected an object, found " + t.dump());
    const std::string content = k.str(t, "content", key + ".content");
    for (const char* name : {"single_word", "lstrip", "rstrip"})
      if (k.flag(t, name, key + "." + name, false))
        k.fail(key + "." + name, "true is not supported (token \"" + content + "\")");
    const bool normalized = k.flag(t, "normalized", key + ".normalized", true);
    if (content.empty()) continue;
    int32_t id = 0;
    if (auto it = added.find(content); it != added.end()) {
      id = it->second;
    } else if (auto iv = vocab.find(content); iv != vocab.end()) {
      id = iv->second;
    } else {
      if (next_id > std::numeric_limits<int32_t>::max()) k.fail(key, "too many tokens");
      id = static_cast<int32_t>(next_id++);
    }
    added[content] = id;
    by_id[id] = {content, normalized};
    vocab_size = std::max<int64_t>(vocab_size, int64_t{id} + 1);
  }
  for (const auto& [id, token] : by_id) {
    if (token.second) {
      std::string buf;
      normalized_added.add(normalize(token.first, &buf), id);
    } else {
      raw_added.add(token.first, id);
    }
  }
}

std::string_view BpeTokenizer::Impl::normalize(std::string_view s, std::string* buf) const {
  // Every Unicode normal form leaves ASCII text unchanged.
  if (normalize_steps.empty() || is_ascii(s)) return s;
  std::string cur(s);
  for (utf8proc_option_t opt : normalize_steps) {
    utf8proc_uint8_t* dst = nullptr;
    const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(cur.data()),
                                            static_cast<utf8proc_ssize_t>(cur.size()), &dst, opt);
    // Input is valid UTF-8, so only allocation can fail.
    MF_CHECK(n >= 0, "utf8proc_map: ", utf8proc_errmsg(n));
    cur.assign(reinterpret_cast<const char*>(dst), static_cast<size_t>(n));
    std::free(dst);
  }
  *buf = std::move(cur);
  return *buf;
}

void BpeTokenizer::Impl::pre_tokenize(std::string_view s, size_t stage, MatchState& ms,
                                      std::vector<int32_t>* out) const {
  if (stage == splits.size()) {
    bpe(s, out);
    return;
  }
  // Isolated: the matches and the stretches between them are each a piece.
  size_t prev = 0;
  splits[stage].for_each_match(s, ms.md, ms.mc, [&](size_t begin, size_t end) {
    if (begin > prev) pre_tokenize(s.substr(prev, begin - prev), stage + 1, ms, out);
    pre_tokenize(s.substr(begin, end - begin), stage + 1, ms, out);
    prev = end;
  });
  if (prev < s.size()) pre_tokenize(s.substr(prev), stage + 1, ms, out);
}

void BpeTokenizer::Impl::bpe(std::string_view word, std::vector<int32_t>* out) const {
  if (ignore_merges) {
    if (auto it = byte_vocab.find(word); it != byte_vocab.end()) {
      out->push_back(it->second);
      return;
    }
  }
  if (word.size() == 1 && byte_id[static_cast<uint8_t>(word[0])] >= 0) {
    out->push_back(byte_id[static_cast<uint8_t>(word[0])]);
    return;
  }
  if (word.size() >= kCacheMaxWord) {
    merge_word(word, out);
    return;
  }
  CacheShard& shard = cache[StringHash{}(word) % kCacheShards];
  {
    std::lock_guard<std::mutex> lock(shard.mu);
    if (auto it = shard.map.find(word); it != shard.map.end()) {
      out->insert(out->end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = out->size();
  merge_word(word, out);
  std::vector<int32_t> ids(out->begin() + static_cast<std::ptrdiff_t>(first), out->end());
  std::lock_guard<std::mutex> lock(shard.mu);
  if (shard.map.size() >= kCacheEntries / kCacheShards) shard.map.clear();
  shard.map.emplace(std::string(word), std::move(ids));
}

// The library's Word::merge_all: a min-heap of candidate merges ordered by (rank, position);
// a popped candidate is applied when its left symbol is still alive, has a right neighbour, and
// that pair still merges into the candidate's token; the merged symbol's new pairs with its
// neighbours then enter the heap.
void BpeTokenizer::Impl::merge_word(std::string_view word, std::vector<int32_t>* out) const {
  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
    bool alive;
  };
  struct Candidate {
    int32_t rank;
    int32_t pos;
    int32_t new_id;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::vector<Symbol> sym;
  sym.reserve(word.size());
  // One symbol per byte; a byte without a token becomes unk_token when there is one (runs of
  // them fused into one with fuse_unk), else it is dropped, as in the library.
  bool prev_unk = false;
  for (char c : word) {
    int32_t id = byte_id[static_cast<uint8_t>(c)];
    if (id < 0) {
      if (!unk_token) continue;
      auto it = vocab.find(*unk_token);
      if (it == vocab.end()) MF_FAIL(path, ": model.unk_token: \"", *unk_token, "\" is not in model.vocab");
      if (fuse_unk && prev_unk) continue;
      prev_unk = true;
      id = it->second;
    } else {
      prev_unk = false;
    }
    const auto n = static_cast<int32_t>(sym.size());
    sym.push_back({id, n - 1, n + 1, true});
  }
  if (sym.empty()) return;
  sym.back().next = -1;

  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  auto push_pair = [&](int32_t pos) {
    const int32_t nx = sym[pos].next;
    if (nx < 0) return;
    auto it = merges.find(pair_key(sym[pos].id, sym[nx].id));
    if (it != merges.end()) heap.push({it->second.rank, pos, it->second.new_id});
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(sym.size()); ++i) push_pair(i);
  while (!heap.empty()) {
    const Candidate top = heap.top();
    heap.pop();
    Symbol& left = sym[top.pos];
    if (!left.alive || left.next < 0) continue;
    Symbol& right = sym[left.next];
    auto it = merges.find(pair_key(left.id, right.id));
    if (it == merges.end() || it->second.new_id != top.new_id) continue;  // stale
    left.id = top.new_id;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) sym[right.next].prev = top.pos;
    if (left.prev >= 0) push_pair(left.prev);
    push_pair(top.pos);
  }
  for (const Symbol& s : sym)
    if (s.alive) out->push_back(s.id);
}

BpeTokenizer::BpeTokenizer(const std::string& path) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.path = path;
  std::ifstream in(path, std::ios::binary);
  if (!in) MF_FAIL(path, ": cannot read the tokenizer file");
  json j;
  try {
    j = parse_json_limited<json>(path, in);
  } catch (const json::exception& e) {
    std::string what = e.what();
    std::replace(what.begin(), what.end(), '\n', ' ');
    MF_FAIL(path, ": not valid JSON: ", what);
  }
  if (!j.is_object()) MF_FAIL(path, ": not a tokenizer.json (expected a JSON object)");
  const Keys k{path};
  m.load_model(k, k.need(j, "model", "model"));
  m.load_normalizer(k, j.contains("normalizer") ? j["normalizer"] : json(), "normalizer");
  m.load_pre_tokenizer(k, j.contains("pre_tokenizer") ? j["pre_tokenizer"] : json());
  m.load_added_tokens(k, j.contains("added_tokens") ? j["added_tokens"] : json());
}

BpeTokenizer::~BpeTokenizer() = default;
BpeTokenizer::BpeTokenizer(BpeTokenizer&&) noexcept = default;
BpeTokenizer& BpeTokenizer::operator=(BpeTokenizer&&) noexcept = default;

std::vector<int32_t> BpeTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  encode(text, &out);
  return out;
}

void BpeTokenizer::encode(std::string_view text, std::vector<int32_t>* out) const {
  const Impl& m = *impl_;
  std::string fixed;
  const std::string_view s = valid_utf8(text, &fixed);
  MatchState& ms = match_state();
  split_added(s, m.raw_added, [&](std::string_view piece, int32_t id) {
    if (id >= 0) {
      out->push_back(id);
      return;
    }
    std::string buf;
    split_added(m.normalize(piece, &buf), m.normalized_added, [&](std::string_view rest, int32_t id2) {
      if (id2 >= 0) {
        out->push_back(id2);
      } else {
        m.pre_tokenize(rest, 0, ms, out);
      }
    });
  });
}

int64_t BpeTokenizer::vocab_size() const { return impl_->vocab_size; }

std::optional<int32_t> BpeTokenizer::token_id(std::string_view token) const {
  if (auto id = added_token_id(token)) return id;
  if (auto it = impl_->vocab.find(token); it != impl_->vocab.end()) return it->second;
  return std::nullopt;
}

std::optional<int32_t> BpeTokenizer::added_token_id(std::string_view token) const {
  if (auto it = impl_->added.find(token); it != impl_->added.end()) return it->second;
  return std::nullopt;
}

const std::string& BpeTokenizer::path() const { return impl_->path; }

}  // namespace moefold

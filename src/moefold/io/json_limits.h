// JSON from files that may come from elsewhere (safetensors headers, tokenizer.json, a Hugging
// Face config.json and index): parsed with a nesting limit, integers read checked. nlohmann's
// parser is iterative, but copying a value, dump() and ordered_json's insertions recurse once per
// level, so a file of 100,000 '[' overflows the stack (docs/faults.md, "Untrusted files").
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "moefold/core/error.h"

namespace moefold {

// Far above any real file's nesting: safetensors headers nest 3 deep, tokenizer.json and
// config.json about 6.
constexpr int kMaxJsonDepth = 64;

// Json::parse(input...) (Json: nlohmann::json or ordered_json; input: what parse takes, a stream
// or an iterator pair), failing with one line naming `path` past kMaxJsonDepth levels. Syntax
// errors stay nlohmann's parse_error, for the caller to word.
template <class Json, class... Input>
Json parse_json_limited(const std::string& path, Input&&... input) {
  return Json::parse(std::forward<Input>(input)..., [&](int depth, typename Json::parse_event_t, Json&) {
    if (depth > kMaxJsonDepth) MF_FAIL(path, ": JSON nested deeper than ", kMaxJsonDepth, " levels");
    return true;
  });
}

// v as an int64, failing with one line naming `path` and `key` unless v is a JSON integer below
// 2^63: get<int64_t>() converts a float such as 1e300 with undefined behaviour, and an unsigned
// above 2^63 to a negative number.
template <class Json>
int64_t json_int64(const Json& v, const std::string& path, const std::string& key) {
  if (!v.is_number_integer() || (v.is_number_unsigned() && v.template get<uint64_t>() > uint64_t{INT64_MAX}))
    MF_FAIL(path, ": '", key, "' must be an integer below 2^63, got ", v.dump());
  return v.template get<int64_t>();
}

}  // namespace moefold

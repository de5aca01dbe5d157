// Errors: `Error` is the one typed error for user mistakes (config, data, checkpoint files);
// its message is a single line naming the file/key/value. Broken internal invariants use
// MF_CHECK, which aborts loudly with the statement, function, file and line.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <string>

namespace moefold {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Concatenates anything streamable into one string: cat("key ", k, " = ", v).
template <class... A>
std::string cat(const A&... a) {
  std::ostringstream os;
  (os << ... << a);
  return os.str();
}

[[noreturn]] inline void check_failed(const char* stmt, const char* func, const char* file, int line,
                                      const std::string& msg) {
  std::fprintf(stderr, "moefold: internal error: %s failed in %s (%s:%d)%s%s\n", stmt, func, file, line,
               msg.empty() ? "" : ": ", msg.c_str());
  std::abort();
}

}  // namespace moefold

// Internal invariant: abort loudly. Optional extra arguments are concatenated into the message.
#define MF_CHECK(cond, ...)                                                                                        \
  do {                                                                                                             \
    if (!(cond))                                                                                                   \
      ::moefold::check_failed(#cond, __func__, __FILE__, __LINE__, ::moefold::cat("" __VA_OPT__(, ) __VA_ARGS__)); \
  } while (0)

// User-facing failure: throws moefold::Error with a one-line message.
#define MF_FAIL(...) throw ::moefold::Error(::moefold::cat(__VA_ARGS__))

namespace moefold {
// Config check: "SECTION.KEY = V must be >= 1" unless v >= 1.
inline void require_positive(const char* section, const char* key, int64_t v) {
  if (v < 1) MF_FAIL(section, ".", key, " = ", v, " must be >= 1");
}
}  // namespace moefold

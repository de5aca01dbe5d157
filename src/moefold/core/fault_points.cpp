#include "moefold/core/fault_points.h"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <string>

#include "moefold/core/error.h"

namespace moefold {

namespace {

enum class Action { none, kill, hang, enospc };

struct Spec {
  std::string point;
  long long n = 0;
  Action action = Action::none;
  int rank = -1;  // -1: any
};

Spec parse(const char* text) {
  Spec s;
  if (text == nullptr || *text == '\0') return s;
  const std::string v = text;
  auto bad = [&] { MF_FAIL("MOEFOLD_FAULT = '", v, "' is not <point>:<n>:<kill|hang|enospc>[@<world rank>]"); };
  const size_t a = v.find(':'), b = a == std::string::npos ? a : v.find(':', a + 1);
  if (a == std::string::npos || b == std::string::npos || a == 0) bad();
  s.point = v.substr(0, a);
  char* end = nullptr;
  s.n = std::strtoll(v.c_str() + a + 1, &end, 10);
  if (end != v.c_str() + b || s.n < 1) bad();
  std::string action = v.substr(b + 1);
  if (const size_t at = action.find('@'); at != std::string::npos) {
    const std::string r = action.substr(at + 1);
    s.rank = static_cast<int>(std::strtol(r.c_str(), &end, 10));
    if (r.empty() || *end != '\0' || s.rank < 0) bad();
    action.resize(at);
  }
  if (action == "kill")
    s.action = Action::kill;
  else if (action == "hang")
    s.action = Action::hang;
  else if (action == "enospc")
    s.action = Action::enospc;
  else
    bad();
  return s;
}

const Spec& spec() {
  static const Spec s = parse(std::getenv("MOEFOLD_FAULT"));
  return s;
}

std::atomic<int> g_rank{-1};
std::atomic<long long> g_hits{0};

}  // namespace

void set_fault_rank(int world_rank) {
  g_rank = world_rank;
  (void)spec();  // a malformed value fails at start-up, not at the point
}

int fault_point(const char* point) {
  const Spec& s = spec();
  if (s.action == Action::none || s.point != point) return 0;
  if (s.rank >= 0 && g_rank.load() != s.rank) return 0;
  if (++g_hits != s.n) return 0;
  switch (s.action) {
    case Action::kill:
      ::kill(::getpid(), SIGKILL);
      for (;;) ::pause();
    case Action::hang:
      for (;;) ::pause();
    case Action::enospc:
      return ENOSPC;
    case Action::none:
      break;
  }
  return 0;
}

}  // namespace moefold

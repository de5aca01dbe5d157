// Agreement on failure: a user error (moefold::Error) thrown on one rank must not leave the
// other ranks waiting in their next collective until the timeout.
#pragma once

#include <utility>

#include "moefold/comm/communicator.h"
#include "moefold/core/error.h"

namespace moefold {

// Runs f on this rank; if it throws moefold::Error on ANY rank of `group`, every rank throws:
// the failing rank its own message, the others "WHAT failed on rank R". Collective over group.
template <class F>
void on_every_rank(Communicator& group, const char* what, F&& f) {
  int64_t failed = 0;
  std::string message;
  try {
    std::forward<F>(f)();
  } catch (const Error& e) {
    failed = group.world_rank() + 1;
    message = e.what();
  }
  if (group.size() > 1) {
    Tensor flag(&failed, DType::i64, {1});
    group.all_reduce(flag, ReduceOp::max);
  }
  if (failed == 0) return;
  if (!message.empty()) throw Error(message);
  MF_FAIL(what, " failed on rank ", failed - 1, " (its message is in its output)");
}

}  // namespace moefold

// A fixed set of host threads that share the iterations of a loop with the calling thread (the
// optimizer's host update under train.optimizer_offload_fraction): started once, so the step loop
// starts no threads and allocates nothing.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace moefold {

class HostThreads {
 public:
  // threads: the threads that run a loop, the caller's included (<= 1: the caller alone).
  explicit HostThreads(int threads);
  ~HostThreads();
  HostThreads(const HostThreads&) = delete;
  HostThreads& operator=(const HostThreads&) = delete;
  int size() const { return static_cast<int>(workers_.size()) + 1; }
  // fn(i) for every i in [0, n), spread over the threads; returns when every call has returned.
  // REQUIRES: fn does not throw; one parallel_for at a time.
  void parallel_for(int64_t n, const std::function<void(int64_t)>& fn);

 private:
  void work();
  void run_iterations();
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable start_, done_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_ = 0, next_ = 0, generation_ = 0;
  int busy_ = 0;
  bool stop_ = false;
};

}  // namespace moefold

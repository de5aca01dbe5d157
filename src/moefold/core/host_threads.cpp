#include "moefold/core/host_threads.h"

namespace moefold {

HostThreads::HostThreads(int threads) {
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { work(); });
}

HostThreads::~HostThreads() {
  {
    const std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  start_.notify_all();
  for (std::thread& t : workers_) t.join();
}

// Takes iterations one at a time under the lock: each is a large block of work (a chunk of
// parameters), so the lock is not what limits the loop.
void HostThreads::run_iterations() {
  for (;;) {
    int64_t i = 0;
    {
      const std::lock_guard<std::mutex> lock(mu_);
      if (next_ >= n_) return;
      i = next_++;
    }
    (*fn_)(i);
  }
}

void HostThreads::work() {
  int64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      start_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    run_iterations();
    {
      const std::lock_guard<std::mutex> lock(mu_);
      if (--busy_ == 0) done_.notify_all();
    }
  }
}

void HostThreads::parallel_for(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  {
    const std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    n_ = n;
    next_ = 0;
    busy_ = static_cast<int>(workers_.size());
    ++generation_;
  }
  start_.notify_all();
  run_iterations();
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [&] { return busy_ == 0; });
  fn_ = nullptr;
}

}  // namespace moefold

// OrderedPool: a fixed set of threads applying one function to a stream of inputs, results given
// back in the order the inputs came (as a sequential loop would give them), with a bound on the
// inputs in flight so that memory stays bounded however fast the producer is.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "moefold/core/error.h"

namespace moefold {

template <class In, class Out>
class OrderedPool {
 public:
  // `work(input)` runs on `num_threads` threads at once, on distinct inputs. What it throws comes
  // out of the pop() that would have given its result. REQUIRES: num_threads >= 1,
  // max_in_flight >= 1.
  OrderedPool(int num_threads, size_t max_in_flight, std::function<Out(In&)> work)
      : max_in_flight_(max_in_flight), work_(std::move(work)) {
    MF_CHECK(num_threads >= 1 && max_in_flight >= 1);
    threads_.reserve(static_cast<size_t>(num_threads));
    for (int i = 0; i < num_threads; ++i) threads_.emplace_back([this] { run(); });
  }
  // Stops the threads: inputs not started are dropped, those being worked on are finished first.
  ~OrderedPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    todo_cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  OrderedPool(const OrderedPool&) = delete;
  OrderedPool& operator=(const OrderedPool&) = delete;

  // Inputs pushed and not yet popped.
  size_t in_flight() const { return pushed_ - popped_; }
  bool full() const { return in_flight() >= max_in_flight_; }

  // REQUIRES: !full() (pop() first).
  void push(In in) {
    MF_CHECK(!full());
    {
      std::lock_guard<std::mutex> lock(mu_);
      todo_.emplace_back(pushed_, std::move(in));
    }
    ++pushed_;
    todo_cv_.notify_one();
  }

  // The result of the oldest input not yet popped, waiting for it; rethrows what `work` threw on
  // it. REQUIRES: in_flight() > 0.
  Out pop() {
    MF_CHECK(in_flight() > 0);
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return done_.count(popped_) > 0; });
    auto node = done_.extract(popped_);
    ++popped_;
    lock.unlock();
    Result& r = node.mapped();
    if (r.error) std::rethrow_exception(r.error);
    return std::move(*r.out);
  }

 private:
  struct Result {
    std::optional<Out> out;
    std::exception_ptr error;
  };

  void run() {
    for (;;) {
      std::unique_lock<std::mutex> lock(mu_);
      todo_cv_.wait(lock, [&] { return stop_ || !todo_.empty(); });
      if (stop_) return;
      auto [seq, in] = std::move(todo_.front());
      todo_.pop_front();
      lock.unlock();
      Result r;
      try {
        r.out.emplace(work_(in));
      } catch (...) {
        r.error = std::current_exception();
      }
      lock.lock();
      done_.emplace(seq, std::move(r));
      lock.unlock();
      done_cv_.notify_one();  // only the owner waits on it
    }
  }

  const size_t max_in_flight_;
  const std::function<Out(In&)> work_;
  // pushed_/popped_ are touched by the owner's thread only (push, pop).
  uint64_t pushed_ = 0, popped_ = 0;
  std::mutex mu_;
  std::condition_variable todo_cv_, done_cv_;
  std::deque<std::pair<uint64_t, In>> todo_;   // (sequence number, input), oldest first
  std::unordered_map<uint64_t, Result> done_;  // sequence number -> result
  bool stop_ = false;
  std::vector<std::thread> threads_;  // last: started after everything above exists
};

}  // namespace moefold

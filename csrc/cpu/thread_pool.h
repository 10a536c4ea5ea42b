// A fixed pool of worker threads for data-parallel loops (no OpenMP: Apple clang ships none).
//
// parallel_for(n, fn) splits [0, n) into contiguous ranges, one per participant (the calling
// thread included), and returns when all are done. A decode step of the 40-layer model makes
// a few hundred such calls, so hand-off latency matters: workers spin on an atomic generation
// counter for a short while after each job (a hand-off then costs about a microsecond) and only
// then sleep on a condition variable, so an idle pool burns no CPU.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace lily::cpu {

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads);  // n_threads <= 0: the machine's cores
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }

  // fn(begin, end, thread_index) over disjoint ranges covering [0, n). Ranges are multiples of
  // `grain` (except the last), so callers can keep SIMD-friendly blocks together. fn must not
  // throw. Not re-entrant: fn must not call parallel_for.
  void parallel_for(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn, int64_t grain = 1);

 private:
  void worker(int index);

  int n_threads_;
  std::vector<std::thread> threads_;
  // The job, published by the release increment of generation_.
  const std::function<void(int64_t, int64_t, int)>* job_ = nullptr;
  int64_t job_n_ = 0, job_grain_ = 1;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  // Sleeping workers.
  std::mutex mu_;
  std::condition_variable wake_;
  int sleeping_ = 0;
};

}  // namespace lily::cpu

// A fixed pool of worker threads for data-parallel loops (no OpenMP: Apple clang ships none).
//
// parallel_for(n, fn) splits [0, n) into contiguous ranges, one per participant (the calling
// thread included), and returns when all are done. Workers sleep on a condition variable
// between calls; a call costs a few microseconds, so kernels parallelise over work of at least
// tens of microseconds (rows of a matrix, heads, experts), never over single elements.
#pragma once
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
  // `grain` (except the last), so callers can keep SIMD-friendly blocks together.
  void parallel_for(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn, int64_t grain = 1);

 private:
  void worker(int index);

  int n_threads_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  const std::function<void(int64_t, int64_t, int)>* job_ = nullptr;
  int64_t job_n_ = 0, job_grain_ = 1;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
};

}  // namespace lily::cpu

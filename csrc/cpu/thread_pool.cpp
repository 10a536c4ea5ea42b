#include "cpu/thread_pool.h"

#include <algorithm>

namespace lily::cpu {

namespace {

// The range of participant `i` out of `parts` when [0, n) is cut in grain-sized blocks.
void range_of(int64_t n, int64_t grain, int parts, int i, int64_t* b, int64_t* e) {
  const int64_t blocks = (n + grain - 1) / grain;
  const int64_t per = blocks / parts, extra = blocks % parts;
  const int64_t b0 = i * per + std::min<int64_t>(i, extra);
  const int64_t b1 = b0 + per + (i < extra ? 1 : 0);
  *b = std::min(n, b0 * grain);
  *e = std::min(n, b1 * grain);
}

}  // namespace

ThreadPool::ThreadPool(int n_threads) {
  if (n_threads <= 0) n_threads = int(std::max(1u, std::thread::hardware_concurrency()));
  n_threads_ = n_threads;
  for (int i = 1; i < n_threads_; ++i) threads_.emplace_back([this, i] { worker(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadPool::worker(int index) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int64_t, int64_t, int)>* job;
    int64_t n, grain;
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
      n = job_n_;
      grain = job_grain_;
    }
    int64_t b, e;
    range_of(n, grain, n_threads_, index, &b, &e);
    if (b < e) (*job)(b, e, index);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_.notify_one();
    }
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn, int64_t grain) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  if (n_threads_ == 1 || n <= grain) {
    fn(0, n, 0);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = &fn;
    job_n_ = n;
    job_grain_ = grain;
    pending_ = n_threads_ - 1;
    ++generation_;
  }
  wake_.notify_all();
  int64_t b, e;
  range_of(n, grain, n_threads_, 0, &b, &e);
  if (b < e) fn(b, e, 0);
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [&] { return pending_ == 0; });
  job_ = nullptr;
}

}  // namespace lily::cpu

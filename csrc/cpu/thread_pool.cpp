#include "cpu/thread_pool.h"

#include <algorithm>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace lily::cpu {

namespace {

// ~50 microseconds of polling before a worker sleeps: longer than the gap between the ops of
// one decode step, much shorter than the gap between requests.
constexpr int kSpinIterations = 20000;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

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
    stop_.store(true);
  }
  wake_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadPool::worker(int index) {
  uint64_t seen = 0;
  for (;;) {
    uint64_t gen = generation_.load(std::memory_order_acquire);
    for (int spins = 0; gen == seen && !stop_.load(std::memory_order_relaxed); ++spins) {
      if (spins < kSpinIterations) {
        cpu_relax();
      } else {
        std::unique_lock<std::mutex> lock(mu_);
        ++sleeping_;
        wake_.wait(lock, [&] { return stop_.load() || generation_.load() != seen; });
        --sleeping_;
        spins = 0;
      }
      gen = generation_.load(std::memory_order_acquire);
    }
    if (stop_.load()) return;
    seen = gen;
    int64_t b, e;
    range_of(job_n_, job_grain_, n_threads_, index, &b, &e);
    if (b < e) (*job_)(b, e, index);
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn, int64_t grain) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  if (n_threads_ == 1 || n <= grain) {
    fn(0, n, 0);
    return;
  }
  job_ = &fn;
  job_n_ = n;
  job_grain_ = grain;
  pending_.store(n_threads_ - 1, std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_release);
  {
    // Taking the lock orders this wake-up after any worker's predicate check (no lost wake-up).
    std::lock_guard<std::mutex> lock(mu_);
    if (sleeping_ > 0) wake_.notify_all();
  }
  int64_t b, e;
  range_of(n, grain, n_threads_, 0, &b, &e);
  if (b < e) fn(b, e, 0);
  for (int spins = 0; pending_.load(std::memory_order_acquire) != 0; ++spins) {
    if (spins < kSpinIterations) cpu_relax();
    else std::this_thread::yield();
  }
}

}  // namespace lily::cpu

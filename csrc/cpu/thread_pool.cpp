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
// Chunks per participant: enough to rebalance around a slow or absent thread, few enough that
// claiming costs nothing next to a chunk.
constexpr int64_t kChunksPerThread = 4;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
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

void ThreadPool::run_chunks(uint32_t gen, int thread_index) {
  uint64_t t = ticket_.load(std::memory_order_acquire);
  for (;;) {
    if (uint32_t(t >> 32) != gen) return;  // a later (or earlier) call's ticket
    // The chunk count comes from the ticket itself, never from n_chunks_: the caller of the
    // next call rewrites the job fields before it publishes that call's ticket, so a worker
    // still holding this call's ticket could otherwise read the next call's (larger) count,
    // "claim" a chunk past this call's end, and leave done_ one too high for the next call,
    // which then waits forever (seen as a hang in CI; tests/test_thread_pool.py).
    const uint32_t idx = uint32_t(t) & kChunkMask, count = uint32_t(t >> kChunkBits) & kChunkMask;
    if (idx >= count) return;
    if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
    // The chunk is ours: this call cannot finish without it, so its job fields (published
    // before its ticket, which the CAS acquired) stay as they are until we are done.
    const int64_t b = int64_t(idx) * chunk_, e = std::min(n_, b + chunk_);
    (*fn_)(b, e, thread_index);
    done_.fetch_add(1, std::memory_order_release);
    t = ticket_.load(std::memory_order_acquire);
  }
}

void ThreadPool::worker(int index) {
  uint32_t seen = 0;
  for (;;) {
    uint32_t gen = generation_.load(std::memory_order_acquire);
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
    run_chunks(gen, index);
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn, int64_t grain) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  const int64_t blocks = (n + grain - 1) / grain;
  if (n_threads_ == 1 || blocks == 1) {
    fn(0, n, 0);
    return;
  }
  const int64_t chunks = std::min<int64_t>({blocks, n_threads_ * kChunksPerThread, int64_t(kChunkMask)});
  fn_ = &fn;
  n_ = n;
  chunk_ = (blocks + chunks - 1) / chunks * grain;
  n_chunks_ = uint32_t((n + chunk_ - 1) / chunk_);
  done_.store(0, std::memory_order_relaxed);
  const uint32_t gen = generation_.load(std::memory_order_relaxed) + 1;
  ticket_.store(uint64_t(gen) << 32 | uint64_t(n_chunks_) << kChunkBits, std::memory_order_release);
  generation_.store(gen, std::memory_order_release);
  {
    // Taking the lock orders this wake-up after any worker's predicate check (no lost wake-up).
    std::lock_guard<std::mutex> lock(mu_);
    if (sleeping_ > 0) wake_.notify_all();
  }
  run_chunks(gen, 0);
  for (int spins = 0; done_.load(std::memory_order_acquire) != n_chunks_; ++spins) {
    if (spins < kSpinIterations) cpu_relax();
    else std::this_thread::yield();
  }
}

}  // namespace lily::cpu

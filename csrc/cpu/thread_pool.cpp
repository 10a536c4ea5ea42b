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
// The smallest piece: 1 / (kMinPieceDivisor x threads) of the call (or one unit). Claiming
// costs an atomic on a shared line and a kernel call restarts its prefetch stream, so pieces
// stay long; short enough that threads finish within ~1% of a call of each other.
constexpr int64_t kMinPieceDivisor = 64;
constexpr uint32_t kMaxUnits = 0xFFFF;

thread_local int64_t t_run_end = 0;  // ThreadPool::run_end() of this thread's current piece

constexpr uint64_t share_word(uint32_t gen, uint32_t front, uint32_t back) {
  return uint64_t(gen) << 32 | uint64_t(front) << 16 | back;
}

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
  shares_ = std::vector<Share>(size_t(n_threads_));  // one per participant
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

int64_t ThreadPool::run_end() { return t_run_end; }

bool ThreadPool::claim(int s, uint32_t gen, bool front, uint32_t* lo, uint32_t* hi, uint32_t* back) {
  std::atomic<uint64_t>& word = shares_[size_t(s)].word;
  uint64_t w = word.load(std::memory_order_acquire);
  for (;;) {
    if (uint32_t(w >> 32) != gen) return false;  // a later (or earlier) call's share
    const uint32_t f = uint32_t(w >> 16) & kMaxUnits, b = uint32_t(w) & kMaxUnits;
    if (f >= b) return false;
    // Half of what is left, at least min_piece_ (the share's last piece may be shorter).
    const uint32_t left = b - f, take = std::min(left, std::max(min_piece_.load(std::memory_order_relaxed), left / 2));
    *lo = front ? f : b - take;
    *hi = front ? f + take : b;
    *back = b;
    const uint64_t next = front ? share_word(gen, *hi, b) : share_word(gen, f, *lo);
    // On success the piece is ours: this call cannot finish without it, so its job fields
    // (published before its generation, which the worker acquired) stay as they are until we
    // are done. On failure w holds the current word.
    if (word.compare_exchange_weak(w, next, std::memory_order_acq_rel, std::memory_order_acquire)) {
      if (take == left) open_shares_.fetch_sub(1, std::memory_order_relaxed);
      return true;
    }
  }
}

void ThreadPool::run_pieces(uint32_t gen, int thread_index) {
  // Own share front to back, then the others' from the back, nearest first.
  uint32_t ran = 0;  // units
  for (int k = 0; k < n_threads_; ++k) {
    // (A stale worker may read a later call's count here: it only decides whether to look.)
    if (k > 0 && open_shares_.load(std::memory_order_relaxed) == 0) break;
    const int s = (thread_index + k) % n_threads_;
    uint32_t lo, hi, back;
    while (claim(s, gen, k == 0, &lo, &hi, &back)) {
      t_run_end = std::min(n_, int64_t(k == 0 ? back : hi) * unit_);
      (*fn_)(int64_t(lo) * unit_, std::min(n_, int64_t(hi) * unit_), thread_index);
      ran += hi - lo;
    }
  }
  // The call cannot finish before this (its units include ours), so done_ is still this call's.
  if (ran > 0) done_.fetch_add(ran, std::memory_order_release);
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
        sleeping_.fetch_add(1);  // before the predicate's check of the generation: parallel_for says why
        wake_.wait(lock, [&] { return stop_.load() || generation_.load() != seen; });
        sleeping_.fetch_sub(1, std::memory_order_relaxed);
        spins = 0;
      }
      gen = generation_.load(std::memory_order_acquire);
    }
    if (stop_.load()) return;
    seen = gen;
    run_pieces(gen, index);
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn, int64_t grain) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  const int64_t blocks = (n + grain - 1) / grain;
  if (n_threads_ == 1 || blocks == 1) {
    t_run_end = n;
    fn(0, n, 0);
    return;
  }
  // Units of whole grains, at most kMaxUnits; share s = units [s * units / T, (s+1) * units / T).
  const int64_t grains_per_unit = (blocks + kMaxUnits - 1) / kMaxUnits;
  const uint32_t units = uint32_t((blocks + grains_per_unit - 1) / grains_per_unit);
  fn_ = &fn;
  n_ = n;
  unit_ = grains_per_unit * grain;
  min_piece_.store(uint32_t(std::max<int64_t>(1, units / (kMinPieceDivisor * n_threads_))), std::memory_order_relaxed);
  done_.store(0, std::memory_order_relaxed);
  const uint32_t gen = generation_.load(std::memory_order_relaxed) + 1;
  uint32_t open = 0;
  for (int s = 0; s < n_threads_; ++s) {
    const uint32_t front = uint32_t(int64_t(units) * s / n_threads_);
    const uint32_t back = uint32_t(int64_t(units) * (s + 1) / n_threads_);
    open += front < back;
    shares_[size_t(s)].word.store(share_word(gen, front, back), std::memory_order_relaxed);
  }
  open_shares_.store(open, std::memory_order_relaxed);
  // seq_cst, as the worker's count in sleeping_ before its own load of the generation: either
  // that load sees this generation, or the load of sleeping_ below sees the worker, and the
  // notify under the lock comes after its check (it holds the lock from its check to its wait).
  // No lock when no one sleeps: the lock's line is a round trip per call.
  generation_.store(gen, std::memory_order_seq_cst);
  if (sleeping_.load(std::memory_order_seq_cst) > 0) {
    std::lock_guard<std::mutex> lock(mu_);
    wake_.notify_all();
  }
  run_pieces(gen, 0);
  for (int spins = 0; done_.load(std::memory_order_acquire) != units; ++spins) {
    if (spins < kSpinIterations) cpu_relax();
    else std::this_thread::yield();
  }
}

}  // namespace lily::cpu

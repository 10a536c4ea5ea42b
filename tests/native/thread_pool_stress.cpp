// Stress driver for csrc/cpu/thread_pool.cpp (run by tests/test_thread_pool.py).
//
//   thread_pool_stress THREADS CALLS
// Makes CALLS back-to-back parallel_for calls of varying sizes and grains on a pool of THREADS,
// with more threads than cores so the OS preempts workers at arbitrary points, which is where
// a late worker from one call meets the next call's job. Each call checks that every index of
// [0, n) ran exactly once, and every piece's ThreadPool::run_end() lies in [piece end, n].
// Prints "ok CALLS" on success; a wrong count or run_end prints the call and exits 1; a lost
// chunk or an over-counted completion hangs, which the caller's timeout turns into a failure.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cpu/thread_pool.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: thread_pool_stress THREADS CALLS\n");
    return 2;
  }
  const int threads = std::atoi(argv[1]);
  const long calls = std::atol(argv[2]);
  lily::cpu::ThreadPool pool(threads);
  std::vector<std::atomic<int>> hits(4096);
  std::atomic<int64_t> bad_run_end{-1};
  for (long c = 0; c < calls; ++c) {
    // Sizes from 1 to 4095 and grains from 1 to 64, varying call to call (including calls
    // with fewer chunks than the one before, which stale workers must not mistake for theirs).
    const int64_t n = 1 + (c * 2654435761u) % 4095;
    const int64_t grain = 1 + (c * 40503u) % 64;
    for (int64_t i = 0; i < n; ++i) hits[i].store(0, std::memory_order_relaxed);
    pool.parallel_for(
        n,
        [&](int64_t b, int64_t e, int) {
          for (int64_t i = b; i < e; ++i) hits[i].fetch_add(1, std::memory_order_relaxed);
          // Where this thread's run goes on to (a kernel prefetches up to it): from the piece's
          // end to at most n, on a grain boundary.
          const int64_t run_end = lily::cpu::ThreadPool::run_end();
          if (run_end < e || run_end > n || (run_end != n && run_end % grain != 0)) bad_run_end.store(run_end);
        },
        grain);
    if (bad_run_end.load() >= 0) {
      std::printf("call %ld (n=%lld grain=%lld): run_end() = %lld\n", c, (long long)n, (long long)grain,
                  (long long)bad_run_end.load());
      return 1;
    }
    for (int64_t i = 0; i < n; ++i)
      if (hits[i].load(std::memory_order_relaxed) != 1) {
        std::printf("call %ld (n=%lld grain=%lld): index %lld ran %d times\n", c, (long long)n,
                    (long long)grain, (long long)i, hits[i].load());
        return 1;
      }
  }
  std::printf("ok %ld\n", calls);
  return 0;
}

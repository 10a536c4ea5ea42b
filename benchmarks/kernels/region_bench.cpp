// What one parallel region costs the thread pool by itself: back-to-back cpu::ThreadPool::
// parallel_for calls over UNITS units whose work is nothing but a write to the calling
// thread's own counter, so the time is the pool's: waking the workers, the claims, the end of
// the call. A decode step at the 35B shape makes about 250 regions (docs/performance.md, run
// 11), so at N us a region the pool alone holds a step for 250 N us.
//   region_bench THREADS [UNITS=16,1024] [ROUNDS=5]
// Prints, per unit count, the median and the best of ROUNDS rounds of 20,000 calls, in us a call,
// and how many units ran in all (UNITS x 20,000 x ROUNDS when each ran once).
// Standalone (the pool has no other dependency):
//   c++ -O3 -std=c++17 -pthread -Icsrc benchmarks/kernels/region_bench.cpp csrc/cpu/thread_pool.cpp
//       -o region_bench
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cpu/thread_pool.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: region_bench THREADS [UNITS=16,1024] [ROUNDS=5]\n");
    return 2;
  }
  const int threads = std::atoi(argv[1]);
  std::vector<long> unit_counts;
  for (const char* p = argc > 2 ? argv[2] : "16,1024"; *p;) {
    char* end;
    unit_counts.push_back(std::strtol(p, &end, 10));
    p = *end == ',' ? end + 1 : end;
  }
  const int rounds = argc > 3 ? std::max(1, std::atoi(argv[3])) : 5;
  constexpr int kCalls = 20000;
  lily::cpu::ThreadPool pool(threads);
  struct alignas(128) Counter {
    long n = 0;
  };
  std::vector<Counter> counters(static_cast<size_t>(threads));  // one line each: the work shares nothing
  for (long units : unit_counts) {
    std::vector<double> us;
    for (Counter& c : counters) c.n = 0;
    for (int r = 0; r < rounds; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int c = 0; c < kCalls; ++c)
        pool.parallel_for(units, [&](int64_t i0, int64_t i1, int t) { counters[size_t(t)].n += i1 - i0; });
      us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / kCalls);
    }
    std::sort(us.begin(), us.end());
    long total = 0;
    for (const Counter& c : counters) total += c.n;
    std::printf("%d threads, %ld units: %.2f us a call (median of %d rounds of %d; best %.2f)   (units run %ld)\n",
                threads, units, us[us.size() / 2], rounds, kCalls, us[0], total);
  }
}

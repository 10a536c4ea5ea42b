// A fixed pool of worker threads for data-parallel loops (no OpenMP: Apple clang ships none).
//
// parallel_for(n, fn) cuts [0, n) into a few chunks per participant; the calling thread and
// the workers claim chunks from one atomic ticket until none are left, and the call returns
// when every chunk is done. Claiming (rather than a fixed range per thread) matters on a busy
// machine: a worker the OS has not scheduled yet simply claims nothing, and the caller does its
// share instead of waiting a scheduler quantum for it.
//
// The ticket holds (generation << 32 | chunk count << 16 | next chunk), so a worker that wakes
// up late, from an earlier call, fails its compare-and-swap and never runs a stale job, and it
// never needs a job field of a call whose ticket it does not hold. Workers spin briefly on
// the generation after each job (a decode step makes hundreds of calls) and then sleep on a
// condition variable, so an idle pool burns no CPU.
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
  // Claims and runs chunks of generation `gen` until none are left.
  void run_chunks(uint32_t gen, int thread_index);

  int n_threads_;
  std::vector<std::thread> threads_;
  // The job of the current generation, written before the ticket is published (release).
  const std::function<void(int64_t, int64_t, int)>* fn_ = nullptr;
  int64_t n_ = 0, chunk_ = 1;
  uint32_t n_chunks_ = 0;
  static constexpr int kChunkBits = 16;
  static constexpr uint32_t kChunkMask = (1u << kChunkBits) - 1;
  std::atomic<uint64_t> ticket_{0};   // generation << 32 | chunk count << 16 | next chunk
  std::atomic<uint32_t> done_{0};     // chunks finished in the current generation
  std::atomic<uint32_t> generation_{0};
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::condition_variable wake_;
  int sleeping_ = 0;
};

}  // namespace lily::cpu

// A fixed pool of worker threads for data-parallel loops (no OpenMP: Apple clang ships none).
//
// parallel_for(n, fn) gives each participant (the calling thread and the workers) one
// contiguous share of [0, n). A thread works through its own share front to back, in pieces of
// half of what is left of it; when its share is empty it steals from the back of the others'
// shares, half of what is left there, until nothing is left; the call returns when every piece
// is done.
// - Contiguous shares: batch-1 decode streams each matrix from memory, and a thread reads one
//   run of rows per call, front to back, in a few long pieces. Equal chunks handed out in turn
//   (what this pool did before) sent each thread across the matrix in chunks of 1/(4 x threads).
// - Stealing: two threads streaming from memory do not get equal bandwidth, and a worker the
//   OS has not scheduled yet claims nothing; pieces that shrink toward the end of a share let
//   the threads finish within a small piece of each other, and the caller does an absent
//   worker's share instead of waiting a scheduler quantum for it.
// Measured with benchmarks/kernels/pool_bench.cpp (cpu::linear, int8, one call after another,
// GB/s read), equal chunks (4 a thread) -> shares. 2-core Zen 2 EPYC, 2 threads: the lm_head
// (2048 x 248,320) 27.5 -> 28.3; 256 matrices of 512 x 2048 in turn 17.2 -> 18.9, of 2048 x 512
// 17.8 -> 18.0; the main thread's wait at the ends of calls fell from 3.2% to 1.0% of a decode
// step. The H200 host's Xeon, 16 threads (scripts/h200/phase_n.sh, a noisy shared host): the
// lm_head about the same or better, 512 x 2048 worse (40-44 -> 29-32: 32 KB shares, small
// calls), full-size decode within the host's noise at 4 and 16 threads (results/
// 2026-12-04-h200-phase-n/README.md).
// - One line per kind of traffic (below): at 16 threads the counters a call changes many times
//   shared a line with the generation every idle worker spins on, and each claim paid for it.
//   Counters apart, completions counted once per thread and call, shares' emptiness instead of
//   units left (scripts/h200/cpu_ab.sh, H100 host's Xeon, 16 threads, pool_bench GB/s, two
//   rounds each): 256 matrices of 2048 x 512 one a call 53-64 -> 71-82, of 512 x 2048
//   42-46 -> 69-81; 18 a call (an MoE block's gate and up) and the lm_head within the host's
//   noise; full-size decode 57.1 / 58.2 -> 62.3 / 57.3 tok/s (results/2026-12-06-gpu-host-pool-ab).
//
// Each share's state is one word (generation << 32 | front << 16 | back), claimed by
// compare-and-swap, so a worker that wakes up late, from an earlier call, fails its
// compare-and-swap and never runs a stale job, and it never needs a job field of a call whose
// piece it does not hold. Positions count units of whole grains, at most 65,535 a call. Workers
// spin briefly on the generation after each job (a decode step makes hundreds of calls) and
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

  // Inside fn: where the calling thread's run of indices continues past the piece it was
  // given, for a kernel that prefetches ahead of what it reads. A piece from the front of the
  // thread's own share is followed by that thread's next piece, so the run goes on to the
  // share's end (as it stood at the claim); a piece taken from another share's back ends the
  // run. Prefetching past the piece but never past this, a kernel's stream does not restart
  // at every piece, and reaches no row that was another thread's when the piece was taken.
  static int64_t run_end();

 private:
  void worker(int index);
  // Claims and runs pieces of generation `gen` (its own share, then the others') until none
  // are left.
  void run_pieces(uint32_t gen, int thread_index);
  // Takes a piece of share `s` for call `gen`, from its front (own) or back (stolen): false
  // when the share is empty or belongs to another call; else [*lo, *hi) in units.
  bool claim(int s, uint32_t gen, bool front, uint32_t* lo, uint32_t* hi, uint32_t* back);

  // Apple's cores have 128-byte lines, and Intel's adjacent-line prefetcher pulls 64-byte lines
  // in pairs: 128 keeps two groups below off each other's lines on both.
  static constexpr size_t kLine = 128;

  int n_threads_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable wake_;
  // The job of the current call, written before its generation is published (release) and
  // only read during it.
  alignas(kLine) const std::function<void(int64_t, int64_t, int)>* fn_ = nullptr;
  int64_t n_ = 0, unit_ = 1;  // a unit: whole grains, so that a call has at most 65,535 units
  // Units: the smallest piece claimed, but for a share's last one. Atomic because claim()
  // reads it before its compare-and-swap, which fails if the call has moved on.
  std::atomic<uint32_t> min_piece_{1};
  // What idle workers spin on, alone on its line with what changes as rarely: the counters
  // below change many times a call, and each change on this line would take it from under
  // every spinning worker (and each spinning worker's reload would slow the next change).
  alignas(kLine) std::atomic<uint32_t> generation_{0};
  std::atomic<bool> stop_{false};
  std::atomic<int> sleeping_{0};  // workers waiting on wake_, or about to
  // One word per share (generation << 32 | front << 16 | back), a line each.
  struct alignas(kLine) Share {
    std::atomic<uint64_t> word{0};
  };
  std::vector<Share> shares_;
  // Shares of the current call not yet empty: a thread whose own share is empty looks at the
  // others' only while some are open, instead of reading every other share's line at the end
  // of every call. The claim that empties a share counts it down: once per share and call,
  // where a count of units would be changed by every claim.
  alignas(kLine) std::atomic<uint32_t> open_shares_{0};
  // Units finished in the current call. Each thread adds what it ran once, when it finds
  // nothing left to claim, not after each piece: one change per thread and call.
  alignas(kLine) std::atomic<uint32_t> done_{0};
};

}  // namespace lily::cpu

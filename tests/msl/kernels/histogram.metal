// Histogram with atomics at both levels: each threadgroup counts into threadgroup memory, then
// adds its non-zero bins to the device histogram.
#include <metal_stdlib>
#include "lily_msl.h"
using namespace metal;

struct HistogramArgs {
  uint n;     // values
  uint bins;  // values are counted modulo bins
};

[[max_total_threads_per_threadgroup(1024)]]  // tests dispatch up to 1024 threads
kernel void histogram(device const uint* values [[buffer(0)]],
                      device atomic_uint* hist [[buffer(1)]],
                      constant HistogramArgs& args [[buffer(2)]],
                      threadgroup atomic_uint* local_hist [[threadgroup(0)]],
                      uint gid [[thread_position_in_grid]],
                      uint tid [[thread_index_in_threadgroup]],
                      uint tg_size [[threads_per_threadgroup]]) {
  for (uint b = tid; b < args.bins; b += tg_size)
    atomic_store_explicit(&local_hist[b], 0u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (gid < args.n)
    atomic_fetch_add_explicit(&local_hist[values[gid] % args.bins], 1u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint b = tid; b < args.bins; b += tg_size) {
    const uint count = atomic_load_explicit(&local_hist[b], memory_order_relaxed);
    if (count != 0) atomic_fetch_add_explicit(&hist[b], count, memory_order_relaxed);
  }
}

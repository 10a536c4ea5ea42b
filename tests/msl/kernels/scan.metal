// Exclusive prefix sum of n uints, in three dispatches:
//   scan_blocks      each threadgroup scans its block (one element per thread) and writes the
//                    block's total;
//   scan_blocks      again, over the block totals (one threadgroup), giving block offsets;
//   add_offsets      adds each block's offset.
// Within a block: simd_prefix_exclusive_sum per simdgroup, then the simdgroup totals are
// scanned by the first simdgroup through threadgroup memory.
#include <metal_stdlib>
#include "lily_msl.h"
using namespace metal;

[[max_total_threads_per_threadgroup(1024)]]  // tests dispatch up to 1024 threads
kernel void scan_blocks(device const uint* in [[buffer(0)]],
                        device uint* out [[buffer(1)]],
                        device uint* block_totals [[buffer(2)]],
                        constant uint& n [[buffer(3)]],
                        uint gid [[thread_position_in_grid]],
                        uint group [[threadgroup_position_in_grid]],
                        ushort lane [[thread_index_in_simdgroup]],
                        ushort simd_group [[simdgroup_index_in_threadgroup]],
                        ushort simd_groups [[simdgroups_per_threadgroup]]) {
  LILY_THREADGROUP(uint, simd_offsets, [32]);
  const uint x = gid < n ? in[gid] : 0u;
  const uint prefix = simd_prefix_exclusive_sum(x);
  const uint total = simd_sum(x);
  if (lane == 0) simd_offsets[simd_group] = total;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (simd_group == 0) {
    const uint t = lane < simd_groups ? simd_offsets[lane] : 0u;
    const uint before = simd_prefix_exclusive_sum(t);
    const uint block_total = simd_sum(t);
    if (lane < simd_groups) simd_offsets[lane] = before;
    if (lane == 0) block_totals[group] = block_total;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (gid < n) out[gid] = prefix + simd_offsets[simd_group];
}

[[max_total_threads_per_threadgroup(1024)]]  // tests dispatch up to 1024 threads
kernel void add_offsets(device uint* out [[buffer(0)]],
                        device const uint* block_offsets [[buffer(1)]],
                        constant uint& n [[buffer(2)]],
                        uint gid [[thread_position_in_grid]],
                        uint group [[threadgroup_position_in_grid]]) {
  if (gid < n) out[gid] += block_offsets[group];
}

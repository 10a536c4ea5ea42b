// Threadgroup reductions, two ways: a shared-memory tree over [[threadgroup(0)]] memory, and
// simd_sum within simdgroups then across them through a kernel-scope threadgroup array.
// partial[g] = sum of in[g * per_group .. (g + 1) * per_group) (clipped to n).
#include <metal_stdlib>
#include "lily_msl.h"
using namespace metal;

struct ReduceArgs {
  uint n;          // elements in `in`
  uint per_group;  // elements each threadgroup sums
};

// Tree reduction; threads_per_threadgroup must be a power of two.
[[max_total_threads_per_threadgroup(1024)]]  // tests dispatch up to 1024 threads
kernel void reduce_tree(device const float* in [[buffer(0)]],
                        device float* partial [[buffer(1)]],
                        constant ReduceArgs& args [[buffer(2)]],
                        threadgroup float* shared [[threadgroup(0)]],
                        uint tid [[thread_index_in_threadgroup]],
                        uint tg_size [[threads_per_threadgroup]],
                        uint group [[threadgroup_position_in_grid]]) {
  const uint begin = group * args.per_group;
  const uint end = min(begin + args.per_group, args.n);
  float acc = 0.0f;
  for (uint i = begin + tid; i < end; i += tg_size) acc += in[i];
  shared[tid] = acc;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint stride = tg_size / 2; stride > 0; stride /= 2) {
    if (tid < stride) shared[tid] += shared[tid + stride];
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (tid == 0) partial[group] = shared[0];
}

// simd_sum, then the first simdgroup sums the simdgroups' totals. Any threadgroup size.
template <typename T>
[[max_total_threads_per_threadgroup(1024)]]  // tests dispatch up to 1024 threads
kernel void reduce_simd(device const T* in [[buffer(0)]],
                        device float* partial [[buffer(1)]],
                        constant ReduceArgs& args [[buffer(2)]],
                        uint tid [[thread_index_in_threadgroup]],
                        uint tg_size [[threads_per_threadgroup]],
                        uint group [[threadgroup_position_in_grid]],
                        uint simd_lane [[thread_index_in_simdgroup]],
                        uint simd_group [[simdgroup_index_in_threadgroup]],
                        uint simd_groups [[simdgroups_per_threadgroup]]) {
  LILY_THREADGROUP(float, totals, [32]);
  const uint begin = group * args.per_group;
  const uint end = min(begin + args.per_group, args.n);
  float acc = 0.0f;
  for (uint i = begin + tid; i < end; i += tg_size) acc += float(in[i]);
  acc = simd_sum(acc);
  if (simd_lane == 0) totals[simd_group] = acc;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (simd_group == 0) {
    float t = simd_lane < simd_groups ? totals[simd_lane] : 0.0f;
    t = simd_sum(t);
    if (simd_lane == 0) partial[group] = t;
  }
}

LILY_KERNEL_INSTANTIATE("reduce_simd_float", reduce_simd, float)
LILY_KERNEL_INSTANTIATE("reduce_simd_half", reduce_simd, half)

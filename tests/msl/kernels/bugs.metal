// Kernels with the GPU bugs msl_cpu must catch (tests/test_msl_cpu_bugs.py). Each is marked BUG.
#include <metal_stdlib>
#include "lily_msl.h"
using namespace metal;

// BUG: threads past n return before the barrier the others wait at.
kernel void divergent_barrier(device float* out [[buffer(0)]],
                              constant uint& n [[buffer(1)]],
                              uint gid [[thread_position_in_grid]],
                              uint tid [[thread_index_in_threadgroup]]) {
  LILY_THREADGROUP(float, shared, [1024]);
  if (gid >= n) return;
  shared[tid] = float(gid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[gid] = shared[tid ^ 1];
}

// BUG: a simdgroup collective reached by half of the lanes.
kernel void divergent_simd_sum(device float* out [[buffer(0)]],
                               uint gid [[thread_position_in_grid]],
                               ushort lane [[thread_index_in_simdgroup]]) {
  float x = float(gid);
  if (lane < 16) x = simd_sum(x);
  out[gid] = x;
}

// BUG: reads a neighbour's threadgroup element with no barrier after the writes.
kernel void missing_barrier(device const float* in [[buffer(0)]],
                            device float* out [[buffer(1)]],
                            uint gid [[thread_position_in_grid]],
                            uint tid [[thread_index_in_threadgroup]],
                            uint tg_size [[threads_per_threadgroup]]) {
  LILY_THREADGROUP(float, shared, [1024]);
  shared[tid] = in[gid];
  out[gid] = shared[(tid + 1) % tg_size];
}

// BUG: `<=` writes one element past the end of `out`.
kernel void oob_write(device float* out [[buffer(0)]],
                      constant uint& n [[buffer(1)]],
                      uint gid [[thread_position_in_grid]]) {
  if (gid <= n) out[gid] = 1.0f;
}

// Correct on their own; a bug when encoded concurrently with no barrier between them.
kernel void produce(device float* data [[buffer(0)]], uint gid [[thread_position_in_grid]]) {
  data[gid] = 2.0f * float(gid);
}
kernel void consume(device const float* data [[buffer(0)]],
                    device float* out [[buffer(1)]],
                    uint gid [[thread_position_in_grid]]) {
  out[gid] = data[gid] + 1.0f;
}

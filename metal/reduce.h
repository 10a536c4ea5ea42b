// Threadgroup-wide reductions shared by the kernel families: a simdgroup reduction, one
// partial per simdgroup through a 32-float threadgroup scratch, then a second simdgroup pass.
// Every thread of the threadgroup must call them (they contain barriers) and every thread gets
// the result. The scratch is the caller's, so a kernel can reuse one array for all reductions.
#pragma once
#include <metal_stdlib>
using namespace metal;

inline float threadgroup_sum(float v, threadgroup float* scratch, uint simd_id, uint lane,
                             uint n_simd) {
  v = simd_sum(v);
  threadgroup_barrier(mem_flags::mem_threadgroup);  // scratch may still be read by a prior call
  if (lane == 0) scratch[simd_id] = v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float total = lane < n_simd ? scratch[lane] : 0.0f;
  return simd_sum(total);
}

inline float threadgroup_max(float v, threadgroup float* scratch, uint simd_id, uint lane,
                             uint n_simd) {
  v = simd_max(v);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lane == 0) scratch[simd_id] = v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float m = lane < n_simd ? scratch[lane] : -INFINITY;
  return simd_max(m);
}

inline uint threadgroup_min_uint(uint v, threadgroup uint* scratch, uint simd_id, uint lane,
                                 uint n_simd) {
  v = simd_min(v);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lane == 0) scratch[simd_id] = v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint m = lane < n_simd ? scratch[lane] : 0xFFFFFFFFu;
  return simd_min(m);
}

inline float sigmoid_f(float x) { return 1.0f / (1.0f + exp(-x)); }
inline float silu_f(float x) { return x / (1.0f + exp(-x)); }

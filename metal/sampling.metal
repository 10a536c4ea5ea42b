// Sampling family: greedy argmax over the logits on the GPU, so a decode step's token can be
// written into the next step's input slot without a CPU round trip. Ties go to the lowest id
// (as numpy.argmax and the CPU sampler do); NaN logits are never picked.
//
//   argmax   token[0] = argmax(logits[0 .. n))      grid (1), 1024 threads
#include <metal_stdlib>
#include "lily_msl.h"
#include "reduce.h"
using namespace metal;

kernel void argmax(device const float* logits [[buffer(0)]],  // [n]
                   device int* token [[buffer(1)]],           // [1]
                   constant uint& n [[buffer(2)]],
                   uint tid [[thread_index_in_threadgroup]],
                   uint threads [[threads_per_threadgroup]],
                   uint simd_id [[simdgroup_index_in_threadgroup]],
                   uint lane [[thread_index_in_simdgroup]],
                   uint n_simd [[simdgroups_per_threadgroup]]) {
  LILY_THREADGROUP(float, scratch, [32]);
  LILY_THREADGROUP(uint, uscratch, [32]);
  float best = -INFINITY;
  uint best_id = 0xFFFFFFFFu;
  for (uint i = tid; i < n; i += threads) {  // ascending i: strict > keeps the lowest id
    const float v = logits[i];
    if (v > best || (best_id == 0xFFFFFFFFu && !isnan(v))) {
      best = v;
      best_id = i;
    }
  }
  const float top = threadgroup_max(best, scratch, simd_id, lane, n_simd);
  const uint cand = best == top && best_id != 0xFFFFFFFFu ? best_id : 0xFFFFFFFFu;
  const uint sel = threadgroup_min_uint(cand, uscratch, simd_id, lane, n_simd);
  if (tid == 0) token[0] = sel == 0xFFFFFFFFu ? 0 : int(sel);
}

// Scalar and vector semantics that must match the GPU bit for bit.
//   arith_*          half / bfloat / float: every operation rounds to T (no wider
//                    intermediate), then math functions.
//   vector_semantics vector constructors convert values (int4(float4) truncates), as_type
//                    reinterprets bits, swizzles and concatenation.
//   simd_ops         simdgroup functions, including short simdgroups (31, 33 threads).
#include <metal_stdlib>
#include "lily_msl.h"
using namespace metal;

template <typename T>
kernel void arith(device const T* a [[buffer(0)]],
                  device const T* b [[buffer(1)]],
                  device const T* c [[buffer(2)]],
                  device T* out [[buffer(3)]],  // [n][4]
                  constant uint& n [[buffer(4)]],
                  uint gid [[thread_position_in_grid]]) {
  if (gid >= n) return;
  const T x = a[gid], y = b[gid], z = c[gid];
  const T product = x * y;
  const T sum = product + z;       // rounded after * and after +
  const T mixed = sum * sum - x;   // one expression, still rounded per operation
  out[4 * gid + 0] = sum;
  out[4 * gid + 1] = mixed;
  out[4 * gid + 2] = T(exp(float(x)));
  out[4 * gid + 3] = sqrt(abs(y)) / (abs(z) + T(1));
}

LILY_KERNEL_INSTANTIATE("arith_float", arith, float)
LILY_KERNEL_INSTANTIATE("arith_half", arith, half)
LILY_KERNEL_INSTANTIATE("arith_bfloat", arith, bfloat)

kernel void vector_semantics(device const float4* in [[buffer(0)]],
                             device int4* converted [[buffer(1)]],
                             device uint4* bits [[buffer(2)]],
                             device half4* halves [[buffer(3)]],
                             device float4* shuffled [[buffer(4)]],
                             constant uint& n [[buffer(5)]],
                             uint gid [[thread_position_in_grid]]) {
  if (gid >= n) return;
  const float4 v = in[gid];
  converted[gid] = int4(v);         // value conversion, toward zero
  bits[gid] = as_type<uint4>(v);    // bit reinterpretation
  halves[gid] = half4(v);
  shuffled[gid] = float4(v.zw, v.x, 1.0f) + v.wzyx * 2.0f;
}

[[max_total_threads_per_threadgroup(1024)]]  // tests dispatch up to 1000 threads
kernel void simd_ops(device const float* in [[buffer(0)]],
                     device float* out [[buffer(1)]],  // [threads][8]
                     uint gid [[thread_position_in_grid]]) {
  const float x = in[gid];
  out[8 * gid + 0] = simd_sum(x);
  out[8 * gid + 1] = simd_max(x);
  out[8 * gid + 2] = simd_prefix_inclusive_sum(x);
  out[8 * gid + 3] = simd_prefix_exclusive_sum(x);
  out[8 * gid + 4] = simd_shuffle_down(x, 1);
  out[8 * gid + 5] = simd_broadcast(x, 3);
  out[8 * gid + 6] = simd_shuffle_xor(x, 1);
  out[8 * gid + 7] = float(popcount(static_cast<simd_vote::vote_t>(simd_ballot(x > 0.5f))));
}

[[max_total_threads_per_threadgroup(1024)]]  // tests dispatch up to 1000 threads
kernel void simd_ops_more(device const float* in [[buffer(0)]],
                          device const uint* bits [[buffer(1)]],
                          device float* out [[buffer(2)]],  // [threads][6]
                          device uint* out_bits [[buffer(3)]],  // [threads][2]
                          uint gid [[thread_position_in_grid]]) {
  const float x = in[gid];
  out[6 * gid + 0] = simd_shuffle_up(x, 2);
  out[6 * gid + 1] = simd_min(x);
  out[6 * gid + 2] = simd_product(x);
  out[6 * gid + 3] = quad_sum(x);
  out[6 * gid + 4] = simd_broadcast_first(x);
  out[6 * gid + 5] = simd_prefix_inclusive_product(x);
  out_bits[2 * gid + 0] = simd_or(bits[gid]);
  out_bits[2 * gid + 1] = simd_and(bits[gid]);
}

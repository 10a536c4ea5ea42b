// Norm family: the residual add fused with the RMSNorm that follows it, so the residual stream
// is read once per block. The zero-centred norms' gain (1 + w) is folded at load time, so the
// kernel multiplies by the full gain. One threadgroup per token row; f32 throughout.
//
//   add_rms_norm   x[t] += y[t] (optional);  h[t] = (x[t] * r) * w     grid (T), 256 threads
#include <metal_stdlib>
#include "lily_msl.h"
#include "norm_args.h"
#include "reduce.h"
using namespace metal;

kernel void add_rms_norm(constant NormArgs& args [[buffer(0)]],
                         device const float* y [[buffer(1)]],  // [T, n] last block's output (when add)
                         device const float* w [[buffer(2)]],  // [n] full gain
                         device float* x [[buffer(3)]],        // [T, n] residual stream (+= y in place)
                         device float* h [[buffer(4)]],        // [T, n] normed
                         uint t [[threadgroup_position_in_grid]],
                         uint tid [[thread_index_in_threadgroup]],
                         uint threads [[threads_per_threadgroup]],
                         uint simd_id [[simdgroup_index_in_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]],
                         uint n_simd [[simdgroups_per_threadgroup]]) {
  LILY_THREADGROUP(float, scratch, [32]);
  device float* xt = x + ulong(t) * args.n;
  device const float* yt = y + ulong(t) * args.n;
  float ss = 0.0f;
  for (uint i = tid; i < args.n; i += threads) {
    float v = xt[i];
    if (args.add) {
      v += yt[i];
      xt[i] = v;  // each element is read back only by the thread that wrote it
    }
    ss += v * v;
  }
  const float total = threadgroup_sum(ss, scratch, simd_id, lane, n_simd);
  const float r = 1.0f / sqrt(total / float(args.n) + args.eps);
  device float* ht = h + ulong(t) * args.n;
  for (uint i = tid; i < args.n; i += threads) ht[i] = (xt[i] * r) * w[i];
}

// MoE family, decode-first (prefill runs the same kernels with T tokens in the grid).
//
//   moe_route     softmax over the router logits, top-k by repeated argmax with ties to the
//                 lowest expert id, renormalisation.          grid (T), E rounded to 32 threads
//   moe_gate_up   fused gather-GEMV: rows of gate and up of the expert picked for job j, SwiGLU
//                 in registers, act written once.        grid (ceil(I / 8), k, T), 64 threads
//   moe_down      fused down-projection of every job + weighted combine + sigmoid-gated shared
//                 expert: each output row sums all experts' partial dots before one
//                 simd_sum, so y is written once and never re-read.  grid (ceil(H / 8), T), 64
// Weights stay packed (quant.h reads them); S is the scale (or dense element) type.
#include <metal_stdlib>
#include "lily_msl.h"
#include "moe_args.h"
#include "quant.h"
#include "reduce.h"
using namespace metal;

kernel void moe_route(device const float* logits [[buffer(0)]],  // [T, E]
                      device uint* ids [[buffer(1)]],            // [T, k]
                      device float* weights [[buffer(2)]],       // [T, k]
                      constant MoeRouteArgs& args [[buffer(3)]],
                      uint t [[threadgroup_position_in_grid]],
                      uint e [[thread_index_in_threadgroup]],
                      uint simd_id [[simdgroup_index_in_threadgroup]],
                      uint lane [[thread_index_in_simdgroup]],
                      uint n_simd [[simdgroups_per_threadgroup]]) {
  LILY_THREADGROUP(float, scratch, [32]);
  LILY_THREADGROUP(uint, uscratch, [32]);
  LILY_THREADGROUP(float, picked, [LILY_MOE_MAX_TOPK]);
  const bool valid = e < args.E;
  const float logit = valid ? logits[ulong(t) * args.E + e] : -INFINITY;
  const float mx = threadgroup_max(logit, scratch, simd_id, lane, n_simd);
  const float sum = threadgroup_sum(valid ? exp(logit - mx) : 0.0f, scratch, simd_id, lane, n_simd);
  bool taken = false;
  for (uint r = 0; r < args.k; ++r) {
    const float v = valid && !taken ? logit : -INFINITY;
    const float best = threadgroup_max(v, scratch, simd_id, lane, n_simd);
    const uint cand = valid && !taken && v == best ? e : 0xFFFFFFFFu;
    const uint sel = threadgroup_min_uint(cand, uscratch, simd_id, lane, n_simd);
    if (e == sel) {
      taken = true;
      ids[ulong(t) * args.k + r] = sel;
      picked[r] = exp(best - mx) / sum;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (e == 0) {
    float total = 0.0f;
    for (uint r = 0; r < args.k; ++r) total += picked[r];
    for (uint r = 0; r < args.k; ++r)
      weights[ulong(t) * args.k + r] = args.renormalize ? picked[r] / total : picked[r];
  }
}

// Offsets of expert e's matrix within its bound buffers.
inline device const uchar* at(device const uchar* base, device const ulong* table, uint e, uint part) {
  return base + table[3 * e + part];
}

template <typename S>
kernel void moe_gate_up(device const uchar* gate_w [[buffer(0)]],
                        device const uchar* gate_s [[buffer(1)]],
                        device const uchar* gate_b [[buffer(2)]],
                        device const ulong* gate_table [[buffer(3)]],  // [E, 3]
                        device const uchar* up_w [[buffer(4)]],
                        device const uchar* up_s [[buffer(5)]],
                        device const uchar* up_b [[buffer(6)]],
                        device const ulong* up_table [[buffer(7)]],    // [E, 3]
                        device const uint* ids [[buffer(8)]],          // [T, k]
                        device const float* h [[buffer(9)]],           // [T, H]
                        device float* act [[buffer(10)]],              // [T, k, I]
                        constant MoeGateUpArgs& args [[buffer(11)]],
                        uint3 tg [[threadgroup_position_in_grid]],
                        uint simd_id [[simdgroup_index_in_threadgroup]],
                        uint lane [[thread_index_in_simdgroup]]) {
  const uint job = tg.y, t = tg.z, I = args.gate.out;
  const uint e = ids[ulong(t) * args.k + job];
  device const float* x = h + ulong(t) * args.gate.in;
  device float* out = act + (ulong(t) * args.k + job) * I;
  const uint row0 = (tg.x * LILY_GEMV_SIMDGROUPS + simd_id) * LILY_GEMV_ROWS_PER_SIMDGROUP;
  for (uint r = 0; r < LILY_GEMV_ROWS_PER_SIMDGROUP; ++r) {
    const uint row = row0 + r;
    if (row >= I) break;
    const float g = simd_sum(row_partial<S>(at(gate_w, gate_table, e, 0), at(gate_s, gate_table, e, 1),
                                            at(gate_b, gate_table, e, 2), args.gate, row, x, lane));
    const float u = simd_sum(row_partial<S>(at(up_w, up_table, e, 0), at(up_s, up_table, e, 1),
                                            at(up_b, up_table, e, 2), args.up, row, x, lane));
    if (lane == 0) out[row] = silu_f(g) * u;
  }
}

LILY_KERNEL_INSTANTIATE("moe_gate_up_float", moe_gate_up, float)
LILY_KERNEL_INSTANTIATE("moe_gate_up_half", moe_gate_up, half)
LILY_KERNEL_INSTANTIATE("moe_gate_up_bfloat", moe_gate_up, bfloat)

template <typename S>
kernel void moe_down(device const uchar* down_w [[buffer(0)]],
                     device const uchar* down_s [[buffer(1)]],
                     device const uchar* down_b [[buffer(2)]],
                     device const ulong* down_table [[buffer(3)]],    // [E, 3]
                     device const uint* ids [[buffer(4)]],            // [T, k]
                     device const float* weights [[buffer(5)]],       // [T, k]
                     device const float* act [[buffer(6)]],           // [T, k, I]
                     device const uchar* shared_w [[buffer(7)]],
                     device const uchar* shared_s [[buffer(8)]],
                     device const uchar* shared_b [[buffer(9)]],
                     device const ulong* shared_table [[buffer(10)]],  // [1, 3]
                     device const float* shared_act [[buffer(11)]],    // [T, Is]
                     device const float* shared_gate [[buffer(12)]],   // [T] logit
                     device float* y [[buffer(13)]],                   // [T, H]
                     constant MoeDownArgs& args [[buffer(14)]],
                     uint2 tg [[threadgroup_position_in_grid]],
                     uint simd_id [[simdgroup_index_in_threadgroup]],
                     uint lane [[thread_index_in_simdgroup]]) {
  const uint t = tg.y, H = args.down.out, I = args.down.in;
  const uint row0 = (tg.x * LILY_GEMV_SIMDGROUPS + simd_id) * LILY_GEMV_ROWS_PER_SIMDGROUP;
  for (uint r = 0; r < LILY_GEMV_ROWS_PER_SIMDGROUP; ++r) {
    const uint row = row0 + r;
    if (row >= H) break;
    float part = 0.0f;
    for (uint j = 0; j < args.k; ++j) {
      const uint e = ids[ulong(t) * args.k + j];
      const float wt = args.weighted ? weights[ulong(t) * args.k + j] : 1.0f;
      part += wt * row_partial<S>(at(down_w, down_table, e, 0), at(down_s, down_table, e, 1),
                                  at(down_b, down_table, e, 2), args.down, row,
                                  act + (ulong(t) * args.k + j) * I, lane);
    }
    if (args.has_shared) {
      part += sigmoid_f(shared_gate[t]) *
              row_partial<S>(at(shared_w, shared_table, 0, 0), at(shared_s, shared_table, 0, 1),
                             at(shared_b, shared_table, 0, 2), args.shared_down, row,
                             shared_act + ulong(t) * args.shared_down.in, lane);
    }
    const float total = simd_sum(part);
    if (lane == 0) y[ulong(t) * H + row] = total;
  }
}

LILY_KERNEL_INSTANTIATE("moe_down_float", moe_down, float)
LILY_KERNEL_INSTANTIATE("moe_down_half", moe_down, half)
LILY_KERNEL_INSTANTIATE("moe_down_bfloat", moe_down, bfloat)

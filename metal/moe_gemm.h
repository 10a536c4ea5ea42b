// The MoE family's grouped expert GEMMs of prefill, moe_gemm_gate_up<S, BM, TENSOR> and
// moe_gemm_down<S, BM, TENSOR>, over the block map moe_plan builds (moe.metal), with the
// weights dequantized into the tiles (gemm.h). Kernel templates here, instantiated by moe.metal
// (TENSOR = false, simdgroup_matrix) and by moe_tensor.metal (TENSOR = true, Metal 4 matmul2d).
#pragma once
#include <metal_stdlib>
#include "gemm.h"
#include "lily_msl.h"
#include "moe_args.h"
#include "reduce.h"
using namespace metal;

// Offsets of expert e's matrix within its bound buffers.
inline device const uchar* at(device const uchar* base, device const ulong* table, uint e, uint part) {
  return base + table[3 * e + part];
}

// Row block `blk` of a grouped GEMM: its expert, first (sorted) row and row count. False past
// the blocks in use (uniform over the threadgroup: the caller returns before any barrier).
inline bool moe_block(device const uint4* blocks, device const uint* header, constant MoeGemmArgs& args,
                      uint blk, uint bm, thread uint& e, thread uint& first, thread uint& count) {
  if (args.routed) {
    if (blk >= header[0]) return false;
    const uint4 b = blocks[blk];
    e = b.x;
    first = b.y;
    count = b.z;
    return true;
  }
  e = 0;
  first = blk * bm;
  if (first >= args.n) return false;
  count = min(bm, args.n - first);
  return true;
}

template <typename S, int BM, bool TENSOR>
kernel void moe_gemm_gate_up(constant MoeGemmArgs& args [[buffer(0)]],
                             device const uchar* gate_w [[buffer(1)]],
                             device const uchar* gate_s [[buffer(2)]],
                             device const uchar* gate_b [[buffer(3)]],
                             device const ulong* gate_table [[buffer(4)]],  // [E, 3]
                             device const uchar* up_w [[buffer(5)]],
                             device const uchar* up_s [[buffer(6)]],
                             device const uchar* up_b [[buffer(7)]],
                             device const ulong* up_table [[buffer(8)]],    // [E, 3]
                             device const uint4* blocks [[buffer(9)]],      // moe_plan
                             device const uint* header [[buffer(10)]],
                             device const uint* rows [[buffer(11)]],        // [T*k] sorted slots
                             device const float* h [[buffer(12)]],          // [T, H]
                             device float* act [[buffer(13)]],              // [n, I] sorted rows
                             uint2 tg [[threadgroup_position_in_grid]],
                             uint tid [[thread_index_in_threadgroup]],
                             uint simd_id [[simdgroup_index_in_threadgroup]]) {
  typedef GemmMma<BM, TENSOR> Mma;
  LILY_THREADGROUP(float, xs, [BM * LILY_GEMM_LD]);
  LILY_THREADGROUP(float, wg, [LILY_GEMM_BK * LILY_GEMM_LDW]);
  LILY_THREADGROUP(float, wu, [LILY_GEMM_BK * LILY_GEMM_LDW]);
  LILY_THREADGROUP(uint, src_row, [BM]);
  LILY_THREADGROUP(float, cacc_g, [Mma::ACC]);
  LILY_THREADGROUP(float, cacc_u, [Mma::ACC]);
  uint e, first, count;
  if (!moe_block(blocks, header, args, tg.y, BM, e, first, count)) return;
  const uint H = args.a.in, I = args.a.out, n0 = tg.x * LILY_GEMM_BN;
  if (tid < uint(BM))  // the token row of h each tile row reads
    src_row[tid] = tid >= count ? LILY_GEMM_NO_ROW : args.routed ? rows[first + tid] / args.k : first + tid;
  Mma mma_g, mma_u;
  mma_g.begin(cacc_g, tid, simd_id);
  mma_u.begin(cacc_u, tid, simd_id);
  threadgroup_barrier(mem_flags::mem_threadgroup);

  for (uint k0 = 0; k0 < H; k0 += LILY_GEMM_BK) {
    gemm_load_x<BM>(xs, h, H, src_row, k0, H, tid);
    gemm_load_w<S>(wg, at(gate_w, gate_table, e, 0), at(gate_s, gate_table, e, 1), at(gate_b, gate_table, e, 2),
                   args.a, n0, k0, tid);
    gemm_load_w<S>(wu, at(up_w, up_table, e, 0), at(up_s, up_table, e, 1), at(up_b, up_table, e, 2),
                   args.b, n0, k0, tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    mma_g.step(cacc_g, xs, wg, simd_id);
    mma_u.step(cacc_u, xs, wu, simd_id);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  threadgroup float* g = mma_g.finish(cacc_g, xs, simd_id);
  threadgroup float* u = mma_u.finish(cacc_u, wg, simd_id);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint i = tid; i < uint(BM * LILY_GEMM_BN); i += LILY_GEMM_THREADS) {
    const uint r = i / LILY_GEMM_BN, c = i % LILY_GEMM_BN;
    if (r < count && n0 + c < I)
      act[ulong(first + r) * I + n0 + c] = silu_f(g[r * LILY_GEMM_LD + c]) * u[r * LILY_GEMM_LD + c];
  }
}

template <typename S, int BM, bool TENSOR>
kernel void moe_gemm_down(constant MoeGemmArgs& args [[buffer(0)]],
                          device const uchar* down_w [[buffer(1)]],
                          device const uchar* down_s [[buffer(2)]],
                          device const uchar* down_b [[buffer(3)]],
                          device const ulong* down_table [[buffer(4)]],  // [E, 3]
                          device const uint4* blocks [[buffer(5)]],      // moe_plan
                          device const uint* header [[buffer(6)]],
                          device const uint* rows [[buffer(7)]],         // [T*k] sorted slots
                          device const float* weights [[buffer(8)]],     // [T*k] routing weights
                          device const float* act [[buffer(9)]],         // [n, I] sorted rows
                          device float* out [[buffer(10)]],              // routed: yr [T*k, H]; else y [T, H]
                          uint2 tg [[threadgroup_position_in_grid]],
                          uint tid [[thread_index_in_threadgroup]],
                          uint simd_id [[simdgroup_index_in_threadgroup]]) {
  typedef GemmMma<BM, TENSOR> Mma;
  LILY_THREADGROUP(float, xs, [BM * LILY_GEMM_LD]);
  LILY_THREADGROUP(float, ws, [LILY_GEMM_BK * LILY_GEMM_LDW]);
  LILY_THREADGROUP(uint, src_row, [BM]);
  LILY_THREADGROUP(uint, dst_row, [BM]);
  LILY_THREADGROUP(float, scale, [BM]);
  LILY_THREADGROUP(float, cacc, [Mma::ACC]);
  uint e, first, count;
  if (!moe_block(blocks, header, args, tg.y, BM, e, first, count)) return;
  const uint I = args.a.in, H = args.a.out, n0 = tg.x * LILY_GEMM_BN;
  if (tid < uint(BM)) {
    const bool live = tid < count;
    const uint slot = live && args.routed ? rows[first + tid] : first + tid;
    src_row[tid] = live ? first + tid : LILY_GEMM_NO_ROW;
    dst_row[tid] = slot;
    scale[tid] = live && args.routed ? weights[slot] : 1.0f;
  }
  Mma mma;
  mma.begin(cacc, tid, simd_id);
  threadgroup_barrier(mem_flags::mem_threadgroup);

  for (uint k0 = 0; k0 < I; k0 += LILY_GEMM_BK) {
    gemm_load_x<BM>(xs, act, I, src_row, k0, I, tid);
    gemm_load_w<S>(ws, at(down_w, down_table, e, 0), at(down_s, down_table, e, 1), at(down_b, down_table, e, 2),
                   args.a, n0, k0, tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    mma.step(cacc, xs, ws, simd_id);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  threadgroup float* res = mma.finish(cacc, xs, simd_id);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint i = tid; i < uint(BM * LILY_GEMM_BN); i += LILY_GEMM_THREADS) {
    const uint r = i / LILY_GEMM_BN, c = i % LILY_GEMM_BN;
    if (r < count && n0 + c < H) out[ulong(dst_row[r]) * H + n0 + c] = scale[r] * res[r * LILY_GEMM_LD + c];
  }
}

// moe_gemm_{gate_up,down}<path>_<S>_bm<BM>: path "" on simdgroup_matrix (moe.metal, every Apple
// GPU), "_tensor" on Metal 4 matmul2d (moe_tensor.metal).
#define LILY_MOE_GEMM_INSTANTIATE(kind, path, tensor)                                                         \
  LILY_KERNEL_INSTANTIATE("moe_gemm_" #kind path "_float_bm8", moe_gemm_##kind, float, 8, tensor)   \
  LILY_KERNEL_INSTANTIATE("moe_gemm_" #kind path "_half_bm8", moe_gemm_##kind, half, 8, tensor)     \
  LILY_KERNEL_INSTANTIATE("moe_gemm_" #kind path "_bfloat_bm8", moe_gemm_##kind, bfloat, 8, tensor) \
  LILY_KERNEL_INSTANTIATE("moe_gemm_" #kind path "_float_bm32", moe_gemm_##kind, float, 32, tensor) \
  LILY_KERNEL_INSTANTIATE("moe_gemm_" #kind path "_half_bm32", moe_gemm_##kind, half, 32, tensor)   \
  LILY_KERNEL_INSTANTIATE("moe_gemm_" #kind path "_bfloat_bm32", moe_gemm_##kind, bfloat, 32, tensor) \
  LILY_KERNEL_INSTANTIATE("moe_gemm_" #kind path "_uchar_bm8", moe_gemm_##kind, uchar, 8, tensor)     \
  LILY_KERNEL_INSTANTIATE("moe_gemm_" #kind path "_uchar_bm32", moe_gemm_##kind, uchar, 32, tensor)

